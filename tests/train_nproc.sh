#!/usr/bin/env bash
# `relpos-train train --nproc 2` (two workers over loopback, c10d/Gloo, half the batch each) ends
# with the same model as one process, for a language model and for the 2-D grid task: the final
# evaluation losses agree to 1e-5 relative.
# Usage: tests/train_nproc.sh RELPOS_TRAIN
set -euo pipefail
bin=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=(--quiet --set threads=1 --set model.d_model=32 --set model.heads=2 --set model.layers=2
        --set 'model.mechanism="jordan(m=2, regime=raw) + alibi"' --set task.train_length=32
        --set optim.steps=20 --set optim.batch=8 --set optim.lr=3e-3 --set eval.every=0
        --set 'eval.lengths=[32, 64]' --set eval.batches=4 --set eval.batch_size=2)
# the 2-D grid task (its model and checks) runs in the same loop
grid=(--quiet --set threads=1 --set model.d_model=16 --set model.heads=2 --set model.layers=1
      --set 'model.mechanism="structured"' --set 'task.kind="grid2d"' --set 'task.benchmark="oblique"'
      --set task.train_length=36 --set optim.steps=20 --set optim.batch=8 --set optim.lr=3e-3
      --set eval.every=0 --set 'eval.lengths=[36, 64]' --set eval.batches=2 --set eval.batch_size=4)
for run in lm grid; do
  if [ "$run" = lm ]; then args=("${common[@]}"); else args=("${grid[@]}"); fi
  "$bin" train "${args[@]}" --out "$dir/$run-one" >/dev/null
  "$bin" train "${args[@]}" --out "$dir/$run-two" --nproc 2 >/dev/null
  python3 - "$dir/$run-one/summary.json" "$dir/$run-two/summary.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
assert b["workers"] == 2, b["workers"]
for x, y in zip(a["final_eval"], b["final_eval"]):
    rel = abs(x["loss"] - y["loss"]) / abs(x["loss"])
    print(f"length {x['length']}: one process {x['loss']:.8f}, two workers {y['loss']:.8f}, rel {rel:.1e}")
    assert rel < 1e-5, "losses differ"
PY
done
