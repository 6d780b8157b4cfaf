#!/usr/bin/env bash
# Puts mlx-lm and the packages it imports (cp312, manylinux) beside MLX's CUDA build for a device machine
# that reaches no package registry: run after ../shared/device/mlx-cuda-prepare.sh, from the project root.
# The wheels are split over the two carried folders (each call carries at most 64 MiB): transformers goes
# with .mlxa (call 1 copies it to /tmp/mlxparts/wheels), the rest with .mlxb. numpy is left out (the
# machine has it). benchmarks/gpu_job.sh installs from both folders what the machine lacks.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .mlxa ] && [ -d .mlxb ] || { echo "run ../shared/device/mlx-cuda-prepare.sh first"; exit 1; }
work=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$work" "mlx-lm==${MLX_LM_VERSION:-0.32.2}"
rm -f "$work"/numpy-*.whl
rm -rf .mlxa/wheels .mlxb/wheels && mkdir -p .mlxa/wheels .mlxb/wheels
mv "$work"/transformers-*.whl .mlxa/wheels/
mv "$work"/*.whl .mlxb/wheels/
rm -rf "$work"
du -sh .mlxa .mlxb
