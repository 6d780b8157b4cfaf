#!/usr/bin/env bash
# Puts mlx-lm and the packages it imports (cp312, manylinux; numpy left out: the machine has it) in
# .mlxc/wheels, for a device machine that reaches no package registry. Run from the project root after
# ../shared/device/mlx-cuda-prepare.sh. A call carries at most 64 MiB with the working tree, so the wheels
# travel in a call of their own between that script's two:
#   call 1: carry [".mlxa"]  mkdir -p /tmp/mlxparts && cp .mlxa/part.aa /tmp/mlxparts/
#   call 2: carry [".mlxc"]  cp -r .mlxc/wheels /tmp/mlxparts/
#   call 3: carry [".mlxb"]  source .mlxb/env.sh && PARTS="mlx_tests ..." bash kq/bench/jobs/gpu_job.sh
# gpu_job.sh installs from /tmp/mlxparts/wheels what the machine lacks.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx "/.mlxc/" .git/info/exclude 2>/dev/null || echo "/.mlxc/" >> .git/info/exclude
rm -rf .mlxc && mkdir -p .mlxc/wheels
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .mlxc/wheels "mlx-lm==${MLX_LM_VERSION:-0.32.2}"
rm -f .mlxc/wheels/numpy-*.whl
du -sh .mlxc
