#!/usr/bin/env bash
# `relpos reproduce --list` lists every experiment: the CLI's basis-level reproductions and every
# experiments/*.toml (through relpos-train), each with a run count at each of its scales.
set -u
relpos=$(realpath "$1")
root=$(cd "$(dirname "$0")/.." && pwd)
fail=0
out=$("$relpos" reproduce --list 2>&1); rc=$?
[ "$rc" = 0 ] || { echo "FAIL: reproduce --list exit $rc: $out"; exit 1; }
for name in jordan-basis pj-t3 pj-t5; do
  grep -q "^| $name |" <<<"$out" || { echo "FAIL: $name not listed"; fail=1; }
done
for f in "$root"/experiments/*.toml; do
  name=$(basename "$f" .toml)
  row=$(grep "^| $name |" <<<"$out")
  [ -n "$row" ] || { echo "FAIL: $name not listed"; fail=1; continue; }
  # every scale's configurations build: a run count, never "does not build"
  grep -q "does not build" <<<"$row" && { echo "FAIL: $name: $row"; fail=1; }
  grep -Eq "paper \([0-9]+\)" <<<"$row" || { echo "FAIL: $name has no paper scale: $row"; fail=1; }
done
"$relpos" reproduce --list jordan-t5 >/dev/null 2>&1; rc=$?
[ "$rc" = 2 ] || { echo "FAIL: --list with a name exits $rc, wanted 2"; fail=1; }
"$relpos" reproduce >/dev/null 2>&1; rc=$?
[ "$rc" = 2 ] || { echo "FAIL: reproduce without a name exits $rc, wanted 2"; fail=1; }
[ "$fail" = 0 ] && echo "ok: reproduce --list"
exit "$fail"
