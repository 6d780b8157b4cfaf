#!/usr/bin/env bash
# One device call: the Pallas kernel's paths (tiled_io, ptx_arith, entry_lanes) checked and measured.
# 1. their GPU tests (inline-PTX rounding against NumPy; golden and adversarial rows per path);
# 2. Nsight Compute on each path at three prefill shapes (ncu_<shape>.txt);
# 3. tools/gpu_tune.py: paths x launch parameters, bits checked, timed (tune.json), capped at TUNE_SECONDS.
source "$(dirname "$0")/gpu_env.sh" tune.txt
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$LOG"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_exact_f32.py tests/test_jax.py -k "variant or ptx or lanes" \
  2>&1 | tail -15 | tee -a "$LOG"
for shape in "65536 8 256" "1048576 8 256" "4096 64 1024"; do
  name="ncu_${shape// /x}.txt"
  # --clock-control none: leave the clocks as they are (the device README's METHOD.md).
  timeout 120 ncu --clock-control none --target-processes all --kernel-name regex:route_shed --launch-count 5 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --section WarpStateStats --section SourceCounters \
    python3 tools/gpu_launches.py --shape $shape --variants strided+integer strided+ptx tiled+integer tiled+ptx lanes+ptx \
    > "$OUT/$name" 2>&1
  echo "ncu $shape exit $?" | tee -a "$LOG"
  grep -E "^case|Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy" \
    "$OUT/$name" | tee -a "$LOG"
done
timeout "${TUNE_SECONDS:-240}" python3 tools/gpu_tune.py --json "$OUT/tune.json" 2>&1 | tee -a "$LOG"
