#!/usr/bin/env bash
# Builds and runs the libFuzzer target of the spec parser / alias expander / registry builder
# (tests/fuzz/fuzz_spec.cpp) under ASan + UBSan. See docs/fuzzing.md.
#
#   scripts/fuzz.sh [SECONDS]     fuzz for SECONDS (default 60) on a copy of tests/fuzz/corpus;
#                                 exit non-zero when the fuzzer finds a crash
#   scripts/fuzz.sh --merge [SECONDS]
#                                 fuzz (past crashes, as --keep-going), then merge the new finds into
#                                 tests/fuzz/corpus/ (for maintainers; review and commit the result)
#   scripts/fuzz.sh --keep-going [SECONDS]
#                                 fuzz in fork mode past crashes (to triage several bugs at once);
#                                 exit non-zero when any crash was found
#
# Environment: RELPOS_FUZZ_BUILD (build folder, default build-fuzz/), RELPOS_FUZZ_JOBS (ninja -j,
# default 2), RELPOS_FUZZ_WERROR (ON/OFF, default ON).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=run
case "${1:-}" in
  --merge) mode=merge; shift ;;
  --keep-going) mode=keep-going; shift ;;
  -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
esac
secs=${1:-60}
if ! [[ $secs =~ ^[0-9]+$ ]] || [ "$secs" -lt 1 ]; then
  echo "fuzz.sh: SECONDS must be a positive integer, got '$secs'" >&2
  exit 2
fi
build=${RELPOS_FUZZ_BUILD:-$root/build-fuzz}
jobs=${RELPOS_FUZZ_JOBS:-2}

# Debian 12 packages: clang (libFuzzer and the sanitizer runtimes are in libclang-rt-14-dev),
# llvm (llvm-symbolizer for readable stacks) and the core's libraries. Idempotent.
pkgs=(cmake ninja-build g++ clang libclang-rt-14-dev llvm libeigen3-dev libfmt-dev nlohmann-json3-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "fuzz.sh: installing ${missing[*]}" >&2
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -q
  "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

cxx=$(command -v clang++ || command -v clang++-14)
cmake -S "$root/tests/fuzz" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
  -DRELPOS_FUZZ_WERROR="${RELPOS_FUZZ_WERROR:-ON}" >/dev/null
ninja -C "$build" -j "$jobs" fuzz_spec

# Work on a copy of the corpus: new finds stay in the build folder unless --merge.
work=$build/run
rm -rf "$work"
mkdir -p "$work/corpus" "$work/artifacts"
cp "$root/tests/fuzz/corpus/"* "$work/corpus/"
symbolizer=$(command -v llvm-symbolizer || command -v llvm-symbolizer-14 || true)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1${symbolizer:+:external_symbolizer_path=$symbolizer}}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
args=(-max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=4096
      -dict="$root/tests/fuzz/spec.dict" -artifact_prefix="$work/artifacts/" -print_final_stats=1)
# --merge also fuzzes past known crashes, so that a crashing seed does not stop the exploration.
if [ "$mode" != run ]; then args+=(-fork=1 -ignore_crashes=1); fi

echo "== fuzz_spec for ${secs}s (corpus copy in $work/corpus, crashes in $work/artifacts) =="
rc=0
"$build/fuzz_spec" "${args[@]}" "$work/corpus" || rc=$?

if [ "$mode" = merge ]; then
  # libFuzzer's merge: inputs of the working copy that add coverage to tests/fuzz/corpus/ are
  # copied there (named by their SHA-1); existing seeds are kept. Crashing inputs are skipped by
  # the merge and stay in artifacts/.
  before=$(ls "$root/tests/fuzz/corpus" | wc -l)
  "$build/fuzz_spec" -merge=1 -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/artifacts/" "$root/tests/fuzz/corpus" "$work/corpus" || true
  after=$(ls "$root/tests/fuzz/corpus" | wc -l)
  echo "fuzz.sh: merged $((after - before)) new input(s) into tests/fuzz/corpus/ (review, then commit)"
fi

crashes=$(find "$work/artifacts" -type f | wc -l)
if [ "$rc" -ne 0 ] || [ "$crashes" -gt 0 ]; then
  echo "fuzz.sh: FAIL: the fuzzer found $crashes crashing input(s) (exit $rc):" >&2
  for f in "$work/artifacts"/*; do
    [ -e "$f" ] || continue
    echo "  $f: $(head -c 200 "$f" | tr -c '[:print:]' '?')" >&2
  done
  echo "  reproduce: $build/fuzz_spec FILE" >&2
  exit 1
fi
echo "fuzz.sh: ok, no crash in ${secs}s"
