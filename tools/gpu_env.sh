# Sourced by the tools/gpu_*.sh device jobs: strict mode, the environment, $OUT, and $LOG named by $1,
# which starts with the card's name, driver and clocks as the job found them.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/$1"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee -a "$LOG"
