#!/usr/bin/env bash
# Command (a) of the README: install dependencies, build, run the main job on built-in inputs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/install-deps.sh"
bash "$root/scripts/build.sh" "$root/build"
bash "$root/scripts/install-python.sh" "$root/build"
# Jordan-RoPE basis-level tables 3, 4, 6, 11, 16 next to the paper's values, with plots
"$root/build/relpos" reproduce jordan-basis --out "$root/runs/jordan-basis" "$@"
