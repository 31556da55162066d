#!/usr/bin/env bash
# `relpos-train diagnose` (and `relpos diagnose`, forwarded) on a tiny PJ run trained for 2 steps:
# the Markdown table, JSON, the lag-kernel CSV of --out, and named errors with exit code 2 for a
# missing run folder, a corrupt or missing checkpoint and a run without a PJ bias.
# Usage: tests/diagnose_cli.sh RELPOS_TRAIN
set -euo pipefail
bin=$1
relpos=$(dirname "$bin")/relpos
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "diagnose_cli: $*" >&2; exit 1; }
common=(--quiet --set threads=1 --set model.preset=pj --set model.d_model=16 --set model.heads=2
        --set model.layers=2 --set task.train_length=16 --set optim.steps=2 --set optim.batch=2
        --set eval.every=0 --set 'eval.lengths=[16]' --set eval.batches=1)
"$bin" train "${common[@]}" --set 'model.mechanism="pj_bias(sectors=fj/affine/lc, R=2, L=16)"' \
  --out "$dir/pj" >/dev/null
"$bin" train "${common[@]}" --set model.mechanism=rope --out "$dir/rope" >/dev/null

md=$("$bin" diagnose --checkpoint "$dir/pj")
for want in "## Layer 0 (L = 16, R = 2, sectors fj+affine+lc)" "## Layer 1" "| top order (mass) |" \
            "## Model summary (head mean, then layer mean)" "| **model** |"; do
  grep -qF -- "$want" <<<"$md" || fail "Markdown lacks '$want'"
done
[ "$(grep -c '^| [01] | ' <<<"$md")" -ge 4 ] || fail "expected a row per head and layer"

"$bin" diagnose --checkpoint "$dir/pj" --format json --length 20 --out "$dir/plots" >"$dir/d.json"
python3 - "$dir/d.json" <<'PY' || fail "JSON output"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["window"] == 20 and d["loo_reference"] == "self", d
assert len(d["layers"]) == 2 and len(d["layers"][0]["heads"]) == 2
assert len(d["layers"][0]["heads"][0]["energy"]) == 3
PY
[ "$(wc -l <"$dir/plots/pj_lag_kernels.csv")" -eq $((1 + 2 * 2 * 20)) ] || fail "CSV rows"
[ -f "$dir/plots/pj_lag_kernels.gp" ] || fail "no gnuplot script"

if [ -x "$relpos" ]; then
  "$relpos" diagnose --checkpoint "$dir/pj" | grep -qF "## Layer 1" || fail "relpos diagnose"
fi

rc=0; err=$("$bin" diagnose --checkpoint "$dir/missing" 2>&1) || rc=$?
[ "$rc" -eq 2 ] && grep -qF "no run folder" <<<"$err" || fail "missing run: rc $rc, '$err'"
echo garbage >"$dir/pj/checkpoints/last.pt"
rc=0; err=$("$bin" diagnose --checkpoint "$dir/pj" 2>&1) || rc=$?
[ "$rc" -eq 2 ] && grep -qF "is corrupt" <<<"$err" || fail "corrupt checkpoint: rc $rc, '$err'"
rm "$dir/pj/checkpoints/last.pt"
rc=0; err=$("$bin" diagnose --checkpoint "$dir/pj" 2>&1) || rc=$?
[ "$rc" -eq 2 ] && grep -qF "no checkpoint at" <<<"$err" || fail "missing checkpoint: rc $rc, '$err'"
rc=0; err=$("$bin" diagnose --checkpoint "$dir/rope" 2>&1) || rc=$?
[ "$rc" -eq 2 ] && grep -qF "has no PJ bias" <<<"$err" || fail "rope run: rc $rc, '$err'"
echo "diagnose_cli: tables, JSON, CSV and named errors ok"
