#!/usr/bin/env bash
# Packs MLX's CUDA build and mlx-lm for a device machine that reaches no package registry and takes at
# most 64 MiB a call, the working tree included. Run from the project root after
# ../shared/device/mlx-cuda-prepare.sh (which leaves the CUDA library in .mlxa/part.aa and .mlxb/part.ab):
#   bash kq/bench/jobs/mlx_cuda_parts.sh
# It downloads mlx-lm and the packages it imports (cp312, manylinux; numpy left out: the machine has it),
# splits the library and the wheels into folders .mlxp1, .mlxp2, ... each small enough to travel beside
# this working tree, leaves .mlxb with the rest of the CUDA build (its part.ab emptied, the whole library
# kept in .mlxa/part.aa: running it again packs the same), and prints the
# device calls, to be made back to back (an idle machine is given back after about 30 s): one a folder,
# then `source .mlxb/env.sh` with the job. Of what a job leaves under $OUT a call brought back 8 files of
# 12 once, the rest left out: tar them into one.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -s .mlxa/part.aa ] && [ -f .mlxb/env.sh ] || { echo "run ../shared/device/mlx-cuda-prepare.sh first" >&2; exit 1; }
grep -qxF "/.mlxp*/" .git/info/exclude 2>/dev/null || echo "/.mlxp*/" >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$work/wheels" "mlx-lm==${MLX_LM_VERSION:-0.32.2}"
rm -f "$work"/wheels/numpy-*.whl
# What travels with every call: the tracked files and the untracked ones git does not ignore.
tree=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | du -cb --files0-from=- | tail -1 | cut -f1)
# 6 MiB to spare: a part of 30.0 MB beside a tree of 36.9 MB was refused, one of 24.0 MB carried
budget=$(( 64 * 1024 * 1024 - tree - 6 * 1024 * 1024 ))
[ "$budget" -gt $(( 4 * 1024 * 1024 )) ] || { echo "the working tree ($tree bytes) leaves too little of 64 MiB" >&2; exit 1; }
# The whole library in .mlxa (env.sh appends .mlxb/part.ab to what the calls left: now nothing), so a
# second run packs the same bytes.
cat .mlxa/part.aa .mlxb/part.ab > "$work/libmlx.xz"
cp "$work/libmlx.xz" .mlxa/part.aa
: > .mlxb/part.ab
(cd "$work" && split -a 3 -d -b "$budget" libmlx.xz lib.)
rm -rf .mlxp[0-9]*
folder=1 used=0
mkdir -p .mlxp1
for item in "$work"/lib.* "$work"/wheels/*.whl; do
  size=$(stat -c %s "$item")
  if [ $(( used + size )) -gt "$budget" ] && [ "$used" -gt 0 ]; then
    folder=$(( folder + 1 )) used=0
    mkdir -p ".mlxp$folder"
  fi
  mv "$item" ".mlxp$folder/"
  used=$(( used + size ))
done
echo "working tree $(( tree / 1024 / 1024 )) MiB; $folder folders of at most $(( budget / 1024 / 1024 )) MiB. Device calls, back to back:"
for n in $(seq 1 "$folder"); do
  fresh=$([ "$n" = 1 ] && echo "rm -rf /tmp/mlxparts && " || true)
  echo "  carry [\".mlxp$n\"]  ${fresh}mkdir -p /tmp/mlxparts/wheels && for f in .mlxp$n/lib.*; do [ -e \"\$f\" ] && cat \"\$f\" >> /tmp/mlxparts/part.aa; done; cp .mlxp$n/*.whl /tmp/mlxparts/wheels/ 2>/dev/null; true"
done
echo "  carry [\".mlxb\"]  source .mlxb/env.sh && PARTS=\"mlx_tests ...\" OUT=\$OUT bash kq/bench/jobs/gpu_job.sh"
