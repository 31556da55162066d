#!/usr/bin/env bash
# Installs what relpos needs: Debian 12 packages (apt-get), then the Python packages of
# requirements.txt, LibTorch among them (the PyPI torch wheel), into the project-local virtual
# environment .venv/ made with Debian's /usr/bin/python3. Idempotent: a second run checks and
# returns at once.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

pkgs=(cmake ninja-build g++ pkg-config libeigen3-dev libgtest-dev libbenchmark-dev
      libcli11-dev nlohmann-json3-dev libtomlplusplus-dev libfmt-dev libgloo-dev libopenblas0-pthread
      gnuplot-nox
      python3 python3-venv python3-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "relpos: installing ${missing[*]}" >&2
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -q
  "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Debian's python3 (not whatever python3 comes first on PATH, such as a pyenv one), so that the
# venv is the same on every Debian 12 machine. The copy of requirements.txt kept in the venv
# says what was installed; the venv is brought up to date when the file changes.
venv=$root/.venv
req=$root/requirements.txt
stamp=$venv/relpos-requirements.txt
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c '' 2>/dev/null && cmp -s "$req" "$stamp"; then
  exit 0
fi
if ! [ -x "$venv/bin/python" ] || ! "$venv/bin/python" -c '' 2>/dev/null; then
  echo "relpos: creating $venv" >&2
  rm -rf "$venv"
  /usr/bin/python3 -m venv "$venv"
fi
echo "relpos: pip install -r requirements.txt into $venv (LibTorch: ~3 GB the first time)" >&2
rm -f "$stamp"
# install from a snapshot, and stamp that snapshot: an edit of requirements.txt during the
# install is picked up by the next run
snapshot=$(mktemp)
trap 'rm -f "$snapshot"' EXIT
cp "$req" "$snapshot"
"$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q -r "$snapshot"
cp "$snapshot" "$stamp"
