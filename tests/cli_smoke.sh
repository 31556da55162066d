#!/usr/bin/env bash
# CLI smoke test: the tool runs, verifies, and turns bad input into a named error and exit code.
set -u
relpos=$1
fail=0
check() { # expected-exit description command...
  local want=$1 what=$2; shift 2
  out=$("$@" 2>&1); got=$?
  if [ "$got" != "$want" ]; then echo "FAIL: $what (exit $got, wanted $want): $out"; fail=1; else echo "ok: $what"; fi
}
check 0 "list" "$relpos" list
check 0 "verify rope json" "$relpos" verify --enc rope --len 4096 --positions 24 --format json
check 0 "kernel csv" "$relpos" kernel --enc "jordan(m=2, regime=raw)" --lags 0:8
check 2 "unknown mechanism" "$relpos" verify --enc "bogus(m=2)"
check 2 "unknown option" "$relpos" verify --enc "jordan(q=1)"
check 2 "indivisible head dim" "$relpos" kernel --enc "jordan(m=3)" --head-dim 64 --lags 0:2
check 2 "L <= 0" "$relpos" kernel --enc "jordan(L=0)" --lags 0:2
check 2 "bad lags" "$relpos" kernel --enc rope --lags 5
check 2 "unknown kernel build" env RELPOS_KERNEL_ISA=sse9 "$relpos" verify --enc rope --len 64 --positions 8
out=$("$relpos" verify --enc "bogus" 2>&1); echo "$out" | grep -q "unknown mechanism 'bogus'" || { echo "FAIL: error text does not name the mechanism: $out"; fail=1; }
exit $fail
