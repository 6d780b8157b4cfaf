#!/usr/bin/env bash
# One device call: Nsight Compute on the Pallas kernel at one shape (default the largest prefill shape),
# (its LaunchStats section gives registers per thread). Report text under $OUT.
# Usage: bash tools/gpu_profile.sh [ROWS K E]
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
mkdir -p "$OUT"
SHAPE=${*:-1048576 8 256}
# --clock-control none: leave the clocks as they are (the device README's METHOD.md).
timeout 300 ncu --clock-control none --target-processes all --kernel-name regex:route_shed --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section LaunchStats --section Occupancy --section WarpStateStats \
  python3 tools/gpu_launches.py --shape $SHAPE > "$OUT/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E "^case|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Stall" "$OUT/ncu.txt" | head -40
