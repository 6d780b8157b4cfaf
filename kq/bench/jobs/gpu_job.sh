#!/usr/bin/env bash
# Everything kq runs on a CUDA machine, in one call from the repository root:
#   PARTS="tests check memcheck" OUT=out bash kq/bench/jobs/gpu_job.sh
# Parts: tests (the suite's GPU part, `pytest -m gpu`, PYTEST_WORKERS processes, TEST_FILES to narrow it), check (`kq check` on the GPU backends with
# ROWS random rows), memcheck (compute-sanitizer over the kernel's launch cases), bench (`kq bench`,
# BENCH_SETS), sweep (the Pallas launch sweeps), moe (the MoE arena overhead), sharding (the sharding
# and expert-parallel tests: on a GPU mesh where there are two GPUs or more), compile (`kq bench --sets
# compile`), expert_parallel (the expert-parallel layer over this machine's GPUs), decode_e2e (`kq bench
# --sets decode-e2e`, DECODE_MODELS picks its models), decode_full (its modes at full residency
# only), decode_tests (the engine loop's exact mode and the overlapped loop), host (`kq bench --sets host` on this machine's CPU), host_tests (the host side's
# tests: the replayed traces and the compiled bookkeeping against NumPy), arena_tests (publishing's faults and the
# arenas, JAX's on the GPU), h2d (landed experts' copies to the
# device: pageable against pinned staging), experts_fence (the experts' fenced computation: its bits in other programs, its cost), decode_floor (a full arena's decode token taken apart, extra arguments in DECODE_FLOOR_ARGS), tier_decode (decode through the low-precision tier against resident),
# study_grid (the shedding study's grid on STUDY_MODELS, extra arguments in STUDY_ARGS), exact_loop (the exact
# layer-by-layer loop with and without look-ahead, extra arguments in EXACT_ARGS, the JSON and log named
# with EXACT_TAG; and its tests); and MLX on CUDA, after
# `source .mlxb/env.sh` (../shared/device/mlx-cuda-prepare.sh, then kq/bench/jobs/mlx_cuda_parts.sh, which
# packs it and mlx-lm into calls that fit; mlx-lm is installed beside it): mlx_check (`kq check --backends mlx-cuda`), mlx_tests (the tests/test_mlx*.py files,
# MLX_TEST_FILES to narrow them),
# mlx_bench (`kq bench`: mlx-cuda beside mlx-ops-gpu, the pure-`mx` path on the GPU stream,
# on the same GPU), mlx_decode (mlx-lm decode through
# the arena, `python -m kq.bench.jobs mlx_decode`, extra arguments in MLX_DECODE_ARGS), mlx_chunk_bits (a
# prompt chunk's gather_mm bits against the whole pass's, `python -m kq.bench.jobs chunk_bits`), mlx_token_parts (a decode
# token taken apart: `python -m kq.bench.jobs mlx_token_parts`, extra arguments in MLX_TOKEN_PARTS_ARGS); TAG ends the
# names of decode_full's, mlx_decode's and mlx_token_parts' log and JSON (one job run twice, e.g. MLX_USE_CUDA_GRAPHS=0). Each part's log and
# JSON go under $OUT, with the device and versions in device.txt and one line per part in
# summary.txt; a part is cut at PART_TIMEOUT seconds (default 500). Exits non-zero if a part failed.
# Wheels in WHEELS (default .whl, e.g. Numba's for the host side: `pip download numba`) are installed
# first, without an index, where their packages are missing.
set -uo pipefail
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false KQ_HYPOTHESIS_PROFILE=gpu
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}  # MLX-CUDA: NVRTC's output reused by later parts
OUT=${OUT:-out}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ] && ls "$WHEELS"/numba-*.whl >/dev/null 2>&1 && ! python3 -c "import numba" 2>/dev/null; then
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --find-links "$WHEELS" numba
fi
if [ -d /tmp/mlxparts/wheels ] && ! python3 -c "import mlx_lm" 2>/dev/null; then  # kq/bench/jobs/mlx_cuda_parts.sh
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --find-links /tmp/mlxparts/wheels mlx-lm
fi
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import sys, jax, numpy; print('python', sys.version.split()[0], 'jax', jax.__version__, 'numpy', numpy.__version__)"
  python3 -c "import numba; print('numba', numba.__version__)" 2>/dev/null
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" 2>/dev/null
} 2>&1 | tee "$OUT/device.txt"
status=0
part() {  # name, command...
  local name=$1 start rc
  shift
  start=$(date +%s)
  timeout "${PART_TIMEOUT:-500}" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  last_rc=$rc
  echo "$name: exit $rc in $(( $(date +%s) - start )) s: $*" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
  status=$(( status || rc ))
}
for name in ${PARTS:-tests check memcheck}; do
  case $name in
    tests) # pytest-xdist, where installed, spreads the kernels' compiles (CPU-bound) over PYTEST_WORKERS processes.
           workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-4}")
           part tests python3 -m pytest -q -m gpu -p no:cacheprovider --durations=20 -rf --tb=line $workers \
             ${TEST_FILES:-} ;;
    check) part check python3 -m kq check --backends jax-pallas jax-reference cuda-source-cupy \
             --random-rows "${ROWS:-50000}" ;;
    memcheck) part memcheck compute-sanitizer --tool memcheck --leak-check no \
                python3 -m kq.bench.jobs launches --variants default tiled lanes ;;
    bench) for set in ${BENCH_SETS:-decode prefill}; do
             part "bench_$set" python3 -m kq bench --sets "$set" --backends jax-pallas jax-reference jax-naive \
               --repeats 9 --no-progress --json "$OUT/bench_$set.json"
           done ;;
    sweep) part sweep_route_shed python3 -m kq.bench.jobs sweep_route_shed --json "$OUT/sweep_route_shed.json"
           part sweep_topk python3 -m kq.bench.jobs sweep_topk --json "$OUT/sweep_topk.json" ;;
    moe) part moe_overhead python3 -m kq.bench.jobs moe_overhead --profile --json "$OUT/moe_overhead.json" ;;
    sharding) part sharding python3 -m pytest -q -p no:cacheprovider -rs tests/test_sharding.py \
                tests/test_expert_parallel.py ;;
    decode_e2e) part decode_e2e python3 -m kq bench --sets decode-e2e ${DECODE_MODELS:+--models $DECODE_MODELS} \
                  --no-progress --json "$OUT/decode_e2e.json" ;;
    decode_full) # decode-e2e's modes at full residency only, on DECODE_MODELS (default olmoe-size), in the
                 # order DECODE_MODES gives (default every mode)
                 part "decode_full${TAG:-}" python3 -c "import os, sys; from kq.bench import decode_e2e as d
modes = os.environ.get('DECODE_MODES', '').split() or None
results = [r for model in sys.argv[2:] for r in d.run_model(model, residencies=(1.0,), modes=modes)]
print(d.format_table(results)); d.write_json(results, sys.argv[1])" "$OUT/decode_full${TAG:-}.json" \
                   ${DECODE_MODELS:-olmoe-size} ;;
    host) part host python3 -m kq bench --sets host --no-progress --json "$OUT/host.json" ;;
    h2d) part h2d python3 -m kq.bench.jobs h2d_staging --json "$OUT/h2d_staging.json" ;;
    experts_fence) part experts_fence python3 -m kq.bench.jobs experts_fence --json "$OUT/experts_fence.json" ;;
    arena_tests) part arena_tests python3 -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_publish_faults.py \
                   tests/test_arena.py ;;
    decode_tests) part decode_tests python3 -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_decode_e2e.py \
                    tests/test_decode_pipeline.py ;;
    host_tests) part host_tests python3 -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_residency_replay.py \
                  tests/test_bookkeeping_numba.py tests/test_faults.py ;;
    compile) part compile python3 -m kq bench --sets compile --no-progress --json "$OUT/compile.json" ;;
    expert_parallel) part expert_parallel python3 -m kq.bench.jobs expert_parallel --json "$OUT/expert_parallel.json" ;;
    mlx_check) part mlx_check python3 -m kq check --backends mlx-cuda mlx-ops-gpu --random-rows "${ROWS:-50000}" ;;
    mlx_tests) part mlx_tests python3 -m pytest -q -p no:cacheprovider -n 0 -rfs --tb=short --durations=10 \
                 ${MLX_TEST_FILES:-tests/test_mlx.py tests/test_mlx_lm.py tests/test_mlx_lm_resident.py \
                 tests/test_mlx_lm_exact_loop.py tests/test_mlx_families.py} ;;
    mlx_bench) # One backend and one set per process; a set that MLX's CUDA graph refuses is run again with
               # MLX_USE_CUDA_GRAPHS=0, its log kept beside the first.
               for backend in mlx-cuda mlx-ops-gpu; do
                 for set in ${BENCH_SETS:-decode prefill}; do
                   part "mlx_bench_${backend}_$set" python3 -m kq bench --sets "$set" --backends "$backend" \
                     --repeats 9 --no-progress --json "$OUT/mlx_bench_${backend}_$set.json"
                   if [ "$last_rc" != 0 ] && grep -q cudaGraph "$OUT/mlx_bench_${backend}_$set.log"; then
                     part "mlx_bench_${backend}_${set}_no_graphs" env MLX_USE_CUDA_GRAPHS=0 python3 -m kq bench \
                       --sets "$set" --backends "$backend" --repeats 9 --no-progress \
                       --json "$OUT/mlx_bench_${backend}_${set}_no_graphs.json"
                   fi
                 done
               done ;;
    mlx_decode) part "mlx_decode${TAG:-}" python3 -m kq.bench.jobs mlx_decode --json "$OUT/mlx_decode${TAG:-}.json" \
                  ${MLX_DECODE_ARGS:-} ;;
    mlx_chunk_bits) part mlx_chunk_bits python3 -m kq.bench.jobs chunk_bits --json "$OUT/chunk_bits.json" ;;
    mlx_token_parts) part "mlx_token_parts${TAG:-}" python3 -m kq.bench.jobs mlx_token_parts \
                       --json "$OUT/mlx_token_parts${TAG:-}.json" \
                       ${MLX_TOKEN_PARTS_ARGS:-} ;;
    exact_loop) part "exact_loop${EXACT_TAG:-}" python3 -m kq.bench.jobs exact_loop --json "$OUT/exact_loop${EXACT_TAG:-}.json" \
                  ${EXACT_ARGS:-}
                part exact_loop_tests python3 -m pytest -q -p no:cacheprovider -n 0 -rs tests/test_exact_loop.py ;;
    decode_floor) part decode_floor python3 -m kq.bench.jobs decode_floor --json "$OUT/decode_floor.json" \
                    ${DECODE_FLOOR_ARGS:-} ;;
    tier_decode) part tier_decode python3 -m kq.bench.jobs tier_decode --json "$OUT/tier_decode.json" ;;
    study_grid) for model in ${STUDY_MODELS:-stdlib-moe wheels-moe}; do
                  part "study_grid_$model" python3 -m kq.bench.jobs study_grid --checkpoint "models/$model" \
                    --json "$OUT/study_grid_$model.json" ${STUDY_ARGS:-}
                done ;;
    *) echo "unknown part: $name (tests check memcheck bench sweep moe sharding compile expert_parallel decode_e2e host" \
            "decode_full host_tests arena_tests decode_tests h2d experts_fence decode_floor tier_decode study_grid" \
            "exact_loop" \
            "mlx_check mlx_tests mlx_bench mlx_decode mlx_chunk_bits mlx_token_parts)"
       status=2 ;;
  esac
done
exit $status
