#!/usr/bin/env bash
# Golden outputs: the CLI's probe and reproduce tables and verify's JSON must stay what they were
# when tests/golden/ was recorded (before the mechanism-model reorganisation of issue 8). Probes
# are float64/float32 least squares on fixed bases whose condition numbers reach 2.3e7: libm's
# last bits (glibc point releases) move their numbers by up to cond x eps = 7e-9 relative, and
# rounding-level MSEs (1e-14) by more, so they are compared to 1e-7 relative or 1e-12 absolute
# (a change of method moves them by far more). Re-record with
#   tests/golden.sh BUILD/relpos BUILD/json_close --record
# only when a change of numbers is intended, and say why in the commit.
set -u
relpos=$(realpath "$1"); close=$(realpath "$2"); mode=${3:-check}
dir=$(cd "$(dirname "$0")" && pwd)/golden
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail=0
run() { # name rtol atol loose command...   (loose: KEY=VALUE:RTOL or -)
  local name=$1 rtol=$2 atol=$3 loose=$4; shift 4
  local extra=(); [ "$loose" = - ] || extra=(--loose "$loose")
  local rc=0
  "$@" > "$tmp/$name.json" 2> "$tmp/$name.err" || rc=$?
  # verify exits 1 when a row fails; the golden file records that too
  if [ $rc -gt 1 ]; then echo "FAIL: $name: exit $rc: $(head -c 500 "$tmp/$name.err")"; fail=1; return; fi
  if [ "$mode" = --record ]; then cp "$tmp/$name.json" "$dir/$name.json"; echo "recorded $name"; return; fi
  if "$close" "$dir/$name.json" "$tmp/$name.json" --rtol "$rtol" --atol "$atol" "${extra[@]}" > "$tmp/$name.diff"; then
    echo "ok: $name"
  else
    echo "FAIL: $name differs from tests/golden/$name.json:"; head -25 "$tmp/$name.diff"; fail=1
  fi
}
run probe-all 1e-7 1e-12 - "$relpos" probe --suite all --format json
run reproduce-jordan-basis 1e-7 1e-12 - "$relpos" reproduce jordan-basis --format json
run reproduce-jordan-basis-f32 1e-6 1e-9 - "$relpos" reproduce jordan-basis --dtype f32 --format json
# verify's residuals are rounding-level numbers (1e-16 .. 1e-7) that depend on the kernel build
# (ISA, -O2 / -O3 contraction): statuses and strings must match exactly, float64 rows' numbers to
# 1e-6 relative or 1e-9 absolute, float32 rows' (the rounding noise of float) to a factor 2
run verify-default 1e-6 1e-9 dtype=f32:0.5 "$relpos" verify --format json
run verify-composed 1e-6 1e-9 dtype=f32:0.5 "$relpos" verify --format json --len 4096 --positions 24 --enc "rope + alibi" --enc "damped_rope(gamma0=10, max_exp=700)" --enc "jordan(m=8, regime=raw, zero_gamma=true, eta0=0.09)"
exit $fail
