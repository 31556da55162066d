#!/usr/bin/env bash
# Command (a) of the README: install dependencies, build, run the main job on built-in inputs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/install-deps.sh"
bash "$root/scripts/build.sh" "$root/build"
"$root/build/relpos" verify "$@"
