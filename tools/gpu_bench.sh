#!/usr/bin/env bash
# One device call: kq bench on the GPU (JAX backends; decode, then prefill), the MoE arena overhead
# (issue 7), then, in whatever time is left, the Pallas launch-parameter sweep. Each step writes its
# own JSON/PNG under $OUT as it finishes, so a call cut short still brings back the finished steps.
# TUNE_SECONDS (default 120) caps the sweep; 0 skips it.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_bench.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee -a "$LOG"
bench() {
  python3 -m kq.cli bench --sets "$1" --backends jax-pallas jax-reference jax-naive --repeats 9 --no-progress \
    --json "$OUT/bench_$1.json" --plot "$OUT/bench_$1.png" 2>&1 | tee -a "$LOG"
}
bench decode
python3 tools/moe_overhead.py --json "$OUT/moe_overhead.json" 2>&1 | tee -a "$LOG"
bench prefill
if [ "${TUNE_SECONDS:-120}" -gt 0 ]; then
  timeout "${TUNE_SECONDS:-120}" python3 tools/gpu_tune.py 2>&1 | tee -a "$LOG"
fi
