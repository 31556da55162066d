#!/usr/bin/env bash
# Configures and builds relpos. Usage: scripts/build.sh [BUILD_DIR] [extra cmake args...]
# LibTorch comes from the torch wheel in .venv/ (scripts/install-deps.sh); builds with
# -DRELPOS_CORE_ONLY=ON need no LibTorch and no venv.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/build}
shift || true
torch_args=()
if [[ " $* " != *" -DRELPOS_CORE_ONLY=ON "* ]]; then
  if ! [ -x "$root/.venv/bin/python" ]; then
    echo "build.sh: no $root/.venv: run scripts/install-deps.sh first (or pass -DRELPOS_CORE_ONLY=ON)" >&2
    exit 1
  fi
  prefix=$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  # (the venv's Python: the operator library is also its Python module, CMakeLists.txt)
  torch_args=(-DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$root/.venv/bin/python")
fi
cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${torch_args[@]}" "$@" >/dev/null
ninja -C "$dir" -j "$(nproc)"
