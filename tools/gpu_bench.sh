#!/usr/bin/env bash
# One device call: kq bench on the GPU (JAX backends, both shape sets) and the MoE arena overhead; JSON, PNG and logs under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -m kq.cli bench --sets decode prefill --backends jax-pallas jax-reference jax-naive \
  --repeats 9 --no-progress --json "$OUT/bench_gpu.json" --plot "$OUT/bench_gpu.png" 2>&1 | tee "$OUT/bench_gpu.txt"
# Issue 7: the JAX MoE layer on an arena against the resident layer (bar: <= 5% over resident).
python3 tools/moe_overhead.py --json "$OUT/moe_overhead.json" 2>&1 | tee "$OUT/moe_overhead.txt"
