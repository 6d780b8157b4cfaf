#!/usr/bin/env bash
# One device call: the JAX GPU check, then memcheck of the kernel. Logs under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 tools/gpu_check.py --out "$OUT/check"; check=$?
compute-sanitizer --tool memcheck --leak-check no python3 tools/gpu_memcheck.py 2>&1 | tail -n 25 | tee "$OUT/memcheck.log"
mem=${PIPESTATUS[0]}
tar czf "$OUT/xla_dump.tgz" -C "$OUT/check" xla_dump 2>/dev/null && rm -rf "$OUT/check/xla_dump"
echo "gpu_check exit $check, memcheck exit $mem"
exit $(( check || mem ))
