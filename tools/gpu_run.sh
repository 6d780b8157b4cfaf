#!/usr/bin/env bash
# One device call: memcheck of the kernel, then the JAX GPU check. Logs under $OUT.
# GPU_CHECK_PARTS picks tools/gpu_check.py's parts; PYTEST_TIMEOUT (default 300 s) caps its pytest part,
# ROWS_SECONDS (default 240) its random-rows part.
source "$(dirname "$0")/gpu_env.sh" device.txt
[ -n "${SKIP_MEMCHECK:-}" ] || timeout 150 compute-sanitizer --tool memcheck --leak-check no python3 tools/gpu_launches.py --variants default tiled lanes > "$OUT/memcheck.log" 2>&1
mem=$?
grep -E "^case|ERROR SUMMARY" "$OUT/memcheck.log"
timeout $(( ${PYTEST_TIMEOUT:-300} + ${ROWS_SECONDS:-240} + 240 )) python3 tools/gpu_check.py --out "$OUT/check" \
  --pytest-timeout "${PYTEST_TIMEOUT:-300}" --rows-seconds "${ROWS_SECONDS:-240}" ${GPU_CHECK_PARTS:+--parts $GPU_CHECK_PARTS} 2>&1 | grep -v -E "RuntimeWarning|astype\("; check=${PIPESTATUS[0]}
rm -rf "$OUT/check/xla_dump"
echo "gpu_check exit $check, memcheck exit $mem"
exit $(( check || mem ))
