#!/usr/bin/env bash
# `relpos-train train --nproc 2` (two workers over loopback, c10d/Gloo, half the batch each) ends
# with the same model as one process: the final evaluation losses agree to 1e-5 relative.
# Usage: tests/train_nproc.sh RELPOS_TRAIN
set -euo pipefail
bin=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=(--quiet --set threads=1 --set model.d_model=32 --set model.heads=2 --set model.layers=2
        --set 'model.mechanism="jordan(m=2, regime=raw) + alibi"' --set task.train_length=32
        --set optim.steps=20 --set optim.batch=8 --set optim.lr=3e-3 --set eval.every=0
        --set 'eval.lengths=[32, 64]' --set eval.batches=4 --set eval.batch_size=2)
"$bin" train "${common[@]}" --out "$dir/one" >/dev/null
"$bin" train "${common[@]}" --out "$dir/two" --nproc 2 >/dev/null
python3 - "$dir/one/summary.json" "$dir/two/summary.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
assert b["workers"] == 2, b["workers"]
for x, y in zip(a["final_eval"], b["final_eval"]):
    rel = abs(x["loss"] - y["loss"]) / abs(x["loss"])
    print(f"length {x['length']}: one process {x['loss']:.8f}, two workers {y['loss']:.8f}, rel {rel:.1e}")
    assert rel < 1e-5, "losses differ"
PY
