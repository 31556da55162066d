#!/usr/bin/env bash
# The C++ package end to end (docs/cpp.md): installs relpos from a build folder into a temporary
# prefix, moves the installed tree (it must be relocatable), then configures the example consumers
# of examples/cpp/ with only -DCMAKE_PREFIX_PATH=<prefix> (plus LibTorch's for the torch one),
# builds them with -Wall -Wextra -Werror, runs them (each checks its results and exits 1 on a
# mismatch) and checks with ldd that the LibTorch-free example links no LibTorch and no Python.
# Usage: scripts/package_test.sh [BUILD_DIR]   (default build/; a RELPOS_CORE_ONLY build folder
# tests the LibTorch-free example only). RELPOS_PACKAGE_TEST_VENDORED=1 also builds the
# LibTorch-free example with relpos vendored through add_subdirectory (a few minutes more).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
jobs=$(nproc)
SECONDS=0
fail() { echo "package_test: $*" >&2; exit 1; }

cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
[ -f "$build/CMakeCache.txt" ] || fail "$build is not a configured build folder"
core_only=$(cache_value RELPOS_CORE_ONLY)

work=$(mktemp -d "${TMPDIR:-/tmp}/relpos-package.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "== package: cmake --install $build, then the tree moved to another prefix =="
cmake --install "$build" --prefix "$work/staged" >"$work/install.log"
mv "$work/staged" "$work/prefix"
prefix=$work/prefix
[ -f "$prefix/lib/cmake/relpos/relposConfig.cmake" ] || fail "no relposConfig.cmake installed"
[ -f "$prefix/lib/cmake/relpos/relposConfigVersion.cmake" ] || fail "no version file installed"
[ -f "$prefix/include/relpos/core/registry.hpp" ] || fail "headers missing under include/relpos"
# relocatable: nothing installed for CMake names the source tree, the build folder or the staging
# prefix
if grep -rl -e "$root" -e "$build" -e "$work/staged" "$prefix/lib/cmake/relpos"; then
  fail "installed CMake files hold absolute paths (above)"
fi
echo "installed $(find "$prefix" -type f | wc -l) files: $(cd "$prefix" && ls lib/*relpos* | tr '\n' ' ')"

# The examples build against the installed package only: CMAKE_PREFIX_PATH is the one way in, and
# CMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY keeps CMake's user package registry out of it.
configure() {  # configure SRC BIN PREFIX_PATH
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$3" \
    -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON >"$2.configure.log" ||
    { cat "$2.configure.log"; fail "configuring $1 failed"; }
  local dir
  dir=$(sed -n 's/^relpos_DIR:[A-Z]*=//p' "$2/CMakeCache.txt")
  [ "$dir" = "$prefix/lib/cmake/relpos" ] || fail "$1 found relpos in '$dir', not in the installed prefix"
}

echo "== example (a): LibTorch-free (relpos::kernels) =="
configure "$root/examples/cpp/kernels" "$work/kernels" "$prefix"
cmake --build "$work/kernels" -j "$jobs"
"$work/kernels/relpos_example_kernels"
echo "-- ldd relpos_example_kernels:"
ldd "$work/kernels/relpos_example_kernels" | tee "$work/ldd.txt"
# (the load addresses are left out: an address such as 0x7f35c10c0000 contains "c10")
if sed 's/ *(0x[0-9a-f]*)//' "$work/ldd.txt" | grep -Ei 'torch|c10|python'; then
  fail "the LibTorch-free example links LibTorch or Python (above)"
fi
if grep -q 'not found' "$work/ldd.txt"; then fail "unresolved libraries (above)"; fi

if [ "$core_only" = "ON" ]; then
  echo "== example (b) skipped: $build is a RELPOS_CORE_ONLY build (no torch layer) =="
else
  echo "== example (b): LibTorch (relpos::torch, nn::Attention in a tiny model) =="
  [ -f "$prefix/lib/cmake/relpos/relpos-torch-targets.cmake" ] || fail "the torch layer was not installed"
  torch_prefix=$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  configure "$root/examples/cpp/torch" "$work/torch" "$prefix;$torch_prefix"
  cmake --build "$work/torch" -j "$jobs"
  "$work/torch/relpos_example_torch"
  echo "-- ldd relpos_example_torch (LibTorch and Python):"
  ldd "$work/torch/relpos_example_torch" | grep -Ei 'torch|c10|python|gomp' || true
fi
if [ "${RELPOS_PACKAGE_TEST_VENDORED:-0}" = 1 ]; then
  # docs/cpp.md, vendoring: the LibTorch-free layers built from source by a parent project
  # (compiles core and kernels again: a few minutes on 2 cores, so not part of CI's default run)
  echo "== example (a) vendored with add_subdirectory (RELPOS_CORE_ONLY, RELPOS_PROGRAMS off) =="
  mkdir -p "$work/vendored-src"
  cat >"$work/vendored-src/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.22)
project(vendored LANGUAGES CXX)
set(RELPOS_CORE_ONLY ON)
add_subdirectory("$root" relpos EXCLUDE_FROM_ALL)
add_subdirectory("$root/examples/cpp/kernels" example)
if(TARGET relpos_core_tests OR TARGET relpos)
  message(FATAL_ERROR "vendored relpos defined its programs")
endif()
CMAKE
  cmake -S "$work/vendored-src" -B "$work/vendored" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    >"$work/vendored.configure.log" || { cat "$work/vendored.configure.log"; fail "vendored configure"; }
  cmake --build "$work/vendored" -j "$jobs"
  "$work/vendored/example/relpos_example_kernels"
fi
echo "== package_test done after ${SECONDS}s =="
