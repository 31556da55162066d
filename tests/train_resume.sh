#!/usr/bin/env bash
# A training killed with SIGKILL and continued with --resume ends with the same final metrics as
# an uninterrupted run with the same seed. Usage: tests/train_resume.sh RELPOS_TRAIN
set -euo pipefail
bin=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=(--quiet --set threads=1 --set model.d_model=32 --set model.heads=2 --set model.layers=1
        --set task.train_length=32 --set optim.steps=300 --set optim.batch=4 --set eval.every=0
        --set 'eval.lengths=[32, 64]' --set eval.batches=2 --set checkpoint_every=10 --set log_every=10)
"$bin" train "${common[@]}" --out "$dir/full" >/dev/null
"$bin" train "${common[@]}" --out "$dir/killed" >/dev/null &
pid=$!
# kill once a checkpoint past step 10 is on disk
for _ in $(seq 1 1200); do
  if [ -f "$dir/killed/metrics.csv" ] && grep -q '^[2-9][0-9],train' "$dir/killed/metrics.csv"; then break; fi
  sleep 0.05
done
kill -9 "$pid"
wait "$pid" 2>/dev/null || true
if [ -f "$dir/killed/summary.json" ]; then
  echo "train_resume: the run finished before the kill; nothing was tested" >&2
  exit 1
fi
step=$(tail -n 1 "$dir/killed/metrics.csv" | cut -d, -f1)
"$bin" train "${common[@]}" --out "$dir/killed" --resume >/dev/null
final() { python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["final_eval"]))' "$1"; }
a=$(final "$dir/full/summary.json")
b=$(final "$dir/killed/summary.json")
if [ "$a" != "$b" ]; then
  echo "train_resume: killed at step $step and resumed, final metrics differ:" >&2
  echo "  uninterrupted: $a" >&2
  echo "  resumed:       $b" >&2
  exit 1
fi
echo "train_resume: killed after step $step, resumed: final metrics identical"
