#!/usr/bin/env bash
# Builds the Python package's operator library (_relpos_ops.so) for a machine with another torch
# than ours (requirements.txt's), such as the GPU machine with torch 2.11.0 (cu130), Python 3.12, no
# internet and no compilers, Eigen or fmt:
#
#   TORCH_VERSION=2.11.0 scripts/build_device_ops.sh      # (2.11.0 is the default)
#
# 1. .venv-device/: a virtual environment with torch==$TORCH_VERSION (PyPI's wheel; set
#    TORCH_INDEX_URL for another index, e.g. https://download.pytorch.org/whl/cpu) plus the test
#    tools pinned in requirements.txt (numpy, pytest), to build against and to test here;
# 2. build-device/: a build folder configured against that LibTorch, where only the relpos_ops
#    target is built (nice -n 15, JOBS=2 jobs unless set);
# 3. .device/: the library, stripped (.device/_relpos_ops.so), and beside it in .device/lib/ the
#    shared libraries it needs that are neither torch's nor a standard Ubuntu base's (Debian's
#    libfmt.so.9), plus BUILD-INFO.txt.
#
# Idempotent: a rerun after source changes reuses the venv, rebuilds relpos_ops only and refreshes
# .device/. On the other machine (torch imported first, as the package does):
#   RELPOS_OPS_LIBRARY=$PWD/.device/_relpos_ops.so LD_LIBRARY_PATH=$PWD/.device/lib \
#     PYTHONPATH=$PWD/python python3 -c 'import relpos'
# The library links only libtorch_cpu / libc10 (no libpython, no CUDA, and no Python module:
# the package calls its steps through TorchScript), so the Python version of the venv here need
# not be the other machine's.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
JOBS=${JOBS:-2}
venv=$root/.venv-device
build=$root/build-device
out=$root/.device
say() { echo "build_device_ops: $*" >&2; }

# --- 1. the venv -----------------------------------------------------------------------------------
py=$venv/bin/python
have=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$TORCH_VERSION" ]; then
  if ! [ -x "$py" ] || ! "$py" -c '' 2>/dev/null; then
    say "creating $venv"
    rm -rf "$venv"
    base=/usr/bin/python3
    [ -x "$base" ] || base=python3
    "$base" -m venv "$venv"
  fi
  # the test tools at the versions of requirements.txt
  pins=()
  for p in numpy pytest iniconfig packaging pluggy Pygments; do
    line=$(grep -iE "^$p==" "$root/requirements.txt" || true)
    pins+=("${line:-$p}")
  done
  index=()
  [ -n "$TORCH_INDEX_URL" ] && index=(--index-url "$TORCH_INDEX_URL")
  say "pip install torch==$TORCH_VERSION ${pins[*]} into $venv (the CUDA wheel: ~5 GB the first time)"
  "$py" -m pip install --disable-pip-version-check --no-input -q "${index[@]}" \
    "torch==$TORCH_VERSION" "${pins[@]}"
  have=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')
  [ "$have" = "$TORCH_VERSION" ] || { say "torch $have in $venv, not $TORCH_VERSION"; exit 1; }
fi

# --- 2. configure and build relpos_ops only ---------------------------------------------------------
prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
torch_lib=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
# RELPOS_PROGRAMS must stay on with LibTorch (CMakeLists.txt), so CLI11 / GoogleTest are looked
# for, but nothing of theirs is built; no benchmarks, no install rules.
nice -n 15 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DRELPOS_PYTHON=ON -DRELPOS_BENCH=OFF -DRELPOS_INSTALL=OFF \
  -DRELPOS_PYTHON_MODULE=OFF >/dev/null
nice -n 15 ninja -C "$build" -j "$JOBS" relpos_ops
lib=$build/_relpos_ops.so

# --- 3. .device/: the library and the shared libraries it needs beyond torch and the base image ----
# Found in torch's lib folder or part of a standard Ubuntu (24.04) image with libstdc++ / libgomp
# (the torch wheel ships its own libgomp.so.1, loaded by libtorch_cpu first anyway).
base_re='^(libc|libm|libdl|libpthread|librt|libutil|libgcc_s|libstdc\+\+|libgomp|ld-linux-x86-64)\.so'
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
resolve() {  # soname of a library needed by $2 -> its path here (ldd of $2)
  ldd "$2" | awk -v n="$1" '$1 == n && $3 ~ /^\// { print $3; exit }'
}
stage=$build/device-stage  # (build-device/ is ignored by git, as .device/ is)
rm -rf "$stage"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
todo=("$lib")
while [ ${#todo[@]} -gt 0 ]; do
  obj=${todo[0]}
  todo=("${todo[@]:1}")
  for so in $(needed "$obj"); do
    [[ $so =~ $base_re ]] && continue
    [ -e "$torch_lib/$so" ] && continue
    [ -e "$stage/lib/$so" ] && continue
    path=$(resolve "$so" "$obj")
    [ -n "$path" ] || { say "$so (needed by $obj) not found"; exit 1; }
    say "bundling $so ($path)"
    cp -L "$path" "$stage/lib/$so"
    strip --strip-unneeded "$stage/lib/$so"
    todo+=("$stage/lib/$so")
  done
done
cp "$lib" "$stage/_relpos_ops.so"
strip --strip-unneeded "$stage/_relpos_ops.so"
if readelf -d "$stage/_relpos_ops.so" | grep -q 'NEEDED.*libpython'; then
  say "the library links libpython: it would only load with this venv's Python"; exit 1
fi
{
  echo "_relpos_ops.so built $(date -u +%FT%TZ) by scripts/build_device_ops.sh"
  echo "torch $("$py" -c 'import torch; print(torch.__version__)') (C++11 ABI: $("$py" -c 'import torch; print(torch._C._GLIBCXX_USE_CXX11_ABI)'))"
  echo "source: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$root" diff --quiet HEAD -- src CMakeLists.txt 2>/dev/null || echo ' + uncommitted changes in src/ or CMakeLists.txt')"
  echo "needs: $(needed "$stage/_relpos_ops.so" | tr '\n' ' ')"
  echo "bundled in lib/: $(cd "$stage/lib" && ls | tr '\n' ' ')"
  echo "highest symbol versions: $(objdump -T "$stage/_relpos_ops.so" "$stage"/lib/*.so* \
    | grep -oE '(GLIBC|GLIBCXX)_[0-9.]+' | sort -Vu | awk -F_ '{m[$1]=$0} END {print m["GLIBC"], m["GLIBCXX"]}')"
  echo "use: RELPOS_OPS_LIBRARY=<this folder>/_relpos_ops.so LD_LIBRARY_PATH=<this folder>/lib"
} >"$stage/BUILD-INFO.txt"
# replace .device/ at once (no half-copied library for a reader)
old=$build/device-old
rm -rf "$old"
if [ -e "$out" ]; then mv "$out" "$old"; fi
mv "$stage" "$out"
rm -rf "$old"
trap - EXIT
say "$out: $(du -sh "$out" | cut -f1) ($(cat "$out/BUILD-INFO.txt" | sed -n 2p))"
