#!/usr/bin/env bash
# One device call: the Pallas kernel's paths (strided, tiled_io, entry_lanes; PTX or integer rounding) measured.
# 1. the entry_lanes paths' GPU tests (golden and adversarial rows);
# 2. Nsight Compute on entry_lanes against the default path at K = 64 and at 2^20 x 8 (ncu_<shape>.txt);
# 3. tools/gpu_tune.py: paths x launch parameters, bits checked, timed (tune.json), capped at TUNE_SECONDS.
source "$(dirname "$0")/gpu_env.sh" tune.txt
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$LOG"
# The entry_lanes paths' tests (the other paths' are in tools/gpu_check.py's pytest part).
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jax.py -k "lanes" 2>&1 | tail -15 | tee -a "$LOG"
for job in "4096 64 1024:strided+ptx lanes+ptx" "1048576 8 256:tiled+ptx lanes+ptx"; do
  shape=${job%%:*}
  name="ncu_${shape// /x}.txt"
  # --clock-control none: leave the clocks as they are (the device README's METHOD.md).
  timeout 120 ncu --clock-control none --target-processes all --kernel-name regex:route_shed --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --section WarpStateStats --section SourceCounters \
    python3 tools/gpu_launches.py --shape $shape --variants ${job#*:} > "$OUT/$name" 2>&1
  echo "ncu $shape exit $?" | tee -a "$LOG"
  grep -E "^case|Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy" \
    "$OUT/$name" | tee -a "$LOG"
done
timeout "${TUNE_SECONDS:-240}" python3 tools/gpu_tune.py --json "$OUT/tune.json" 2>&1 | tee -a "$LOG"
