#!/usr/bin/env bash
# Installs the Debian 12 packages relpos needs. Idempotent: does nothing when all are present.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config libtorch-dev libeigen3-dev libgtest-dev libbenchmark-dev
      libcli11-dev nlohmann-json3-dev libfmt-dev libopenblas0-pthread gnuplot-nox)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
echo "relpos: installing ${missing[*]}" >&2
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
