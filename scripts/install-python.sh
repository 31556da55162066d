#!/usr/bin/env bash
# Installs the `relpos` Python package into .venv/ (scikit-build-core over the CMake project; it
# reuses the build folder of scripts/build.sh, so the operator library is not compiled twice).
# Usage: scripts/install-python.sh [BUILD_DIR]   (after scripts/install-deps.sh and build.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/build}
py=$root/.venv/bin/python
prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
SKBUILD_BUILD_DIR="$dir" "$py" -m pip install --disable-pip-version-check --no-input -q \
  --no-build-isolation --no-deps --config-settings=cmake.define.CMAKE_PREFIX_PATH="$prefix" \
  "$root/python"
"$py" -c 'import relpos, torch; print("relpos: Python package installed (torch", torch.__version__ + ")")'
