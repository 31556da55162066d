#!/usr/bin/env bash
# Command (b) of the README: install dependencies, build, run the whole test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/install-deps.sh"
bash "$root/scripts/build.sh" "$root/build"
bash "$root/scripts/install-python.sh" "$root/build"
ctest --test-dir "$root/build" --output-on-failure -j "$(nproc)"
# the Python package's tests (pytest fails when it collects none); the GPU backend's run in
# Triton's interpreter, and every kernel they launch is compiled for sm_90 too (docs/gpu.md)
RELPOS_TRITON_COMPILE=90 "$root/.venv/bin/python" -m pytest "$root/tests/python" -q -p no:cacheprovider
