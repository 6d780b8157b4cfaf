#!/usr/bin/env bash
# One device call: kq bench on the GPU (JAX backends; decode, then prefill, then their plot), the MoE
# arena overhead (issue 7), then, in whatever time is left, the Pallas launch-parameter sweep. Each
# step writes its JSON under $OUT as it finishes, so a call cut short brings back the finished steps.
# BENCH_SETS (default "decode prefill") picks the shape sets; MOE=0 skips the MoE overhead;
# TUNE_SECONDS (default 120) caps the sweep; 0 skips it; TUNE_SHAPES (ROWSxKxE words) narrows it.
source "$(dirname "$0")/gpu_env.sh" gpu_bench.txt
bench() {
  python3 -m kq.cli bench --sets "$1" --backends jax-pallas jax-reference jax-naive --repeats 9 --no-progress \
    --json "$OUT/bench_$1.json" 2>&1 | tee -a "$LOG"
}
for set in ${BENCH_SETS:-decode prefill}; do bench "$set"; done
python3 -c "import sys; from kq.bench import read_json, write_plot
write_plot([r for p in sys.argv[2:] for r in read_json(p)], sys.argv[1])" \
  "$OUT/bench_gpu.png" "$OUT"/bench_*.json 2>&1 | tee -a "$LOG"
[ "${MOE:-1}" = 0 ] || python3 tools/moe_overhead.py --json "$OUT/moe_overhead.json" 2>&1 | tee -a "$LOG"
if [ "${TUNE_SECONDS:-120}" -gt 0 ]; then
  timeout "${TUNE_SECONDS:-120}" python3 tools/gpu_tune.py --json "$OUT/tune.json" ${TUNE_SHAPES:+--shapes $TUNE_SHAPES} 2>&1 | tee -a "$LOG"
fi
