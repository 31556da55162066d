#!/usr/bin/env bash
# Run folders through the relpos CLI (issue 23, docs/errors.md "Output directories"): `train --out`
# never writes into `/`, into a folder of the user's files or into another run's folder (exit 2, every
# file byte-identical); a second run on a busy folder is refused naming the holder; INCOMPLETE
# marks a run until it finishes; bad paths, changed resumes, patched checkpoints and hostile names
# exit 2 (never 3) with the reason. Usage: tests/train_outdirs.sh RELPOS_BINARY
set -u
relpos=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
tmp=$(mktemp -d)
bg=
trap '[ -n "$bg" ] && kill -KILL "$bg" 2>/dev/null; rm -rf "$tmp"' EXIT
fail=0
common=(--quiet --set threads=1 --set model.d_model=32 --set model.heads=2 --set model.layers=1
        --set task.train_length=16 --set optim.steps=3 --set optim.batch=2 --set eval.every=0
        --set 'eval.lengths=[16]' --set eval.batches=1)

# expect CODE DESCRIPTION PATTERN COMMAND...: the exit code, and the output matching PATTERN
expect() {
  local code=$1 what=$2 pattern=$3; shift 3
  local out got
  out=$("$@" 2>&1 </dev/null); got=$?
  if [ "$got" -ne "$code" ]; then
    echo "FAIL: $what: exit $got, expected $code: $(printf '%s' "$out" | tail -n 3 | head -c 600)"
    fail=1
  elif [ -n "$pattern" ] && ! grep -qE -- "$pattern" <<<"$out"; then
    echo "FAIL: $what: the message does not match /$pattern/: $(printf '%s' "$out" | head -c 600)"
    fail=1
  else
    echo "ok: $what (exit $got)"
  fi
}
# every file below a folder with its checksum
digest() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 -r sha256sum); }
same() {
  if [ "$2" != "$3" ]; then echo "FAIL: $1: files changed"; fail=1; else echo "ok: $1: byte-identical"; fi
}

# --- `--out /`: refused before any write (the listing of / is unchanged; nothing named
# .relpos-run or INCOMPLETE appears there)
before=$(ls -A /)
expect 2 "train --out /" "not empty and holds no relpos output" "$relpos" train "${common[@]}" --out /
same "/ after train --out /" "$before" "$(ls -A /)"
[ -e /.relpos-run ] || [ -e /INCOMPLETE ] && { echo "FAIL: train --out / wrote into /"; fail=1; }

# --- `--out .` in a folder of the user's own files
mkdir -p "$tmp/project/src"
printf '# my settings, with comments\nseed = 7\n' >"$tmp/project/config.toml"
printf 'my,own\n1,2\n' >"$tmp/project/metrics.csv"
echo '{}' >"$tmp/project/summary.json"
before=$(digest "$tmp/project")
expect 2 "train --out . (a folder of other files)" "not empty" \
  bash -c 'cd "$1" && shift && exec "$@"' _ "$tmp/project" "$relpos" train "${common[@]}" --out .
expect 2 "train --out . --resume (not a run of ours)" "not empty" \
  bash -c 'cd "$1" && shift && exec "$@"' _ "$tmp/project" "$relpos" train "${common[@]}" --out . --resume
same "the user's folder" "$before" "$(digest "$tmp/project")"

# --- another run's folder: a new run without --resume is refused; INCOMPLETE only while running
expect 0 "train a run" "" "$relpos" train "${common[@]}" --out "$tmp/run"
[ -e "$tmp/run/INCOMPLETE" ] && { echo "FAIL: a finished run keeps INCOMPLETE"; fail=1; }
[ -f "$tmp/run/.relpos-run" ] || { echo "FAIL: no lock file .relpos-run in the run folder"; fail=1; }
before=$(digest "$tmp/run")
expect 2 "a new run into a finished run's folder" "holds a relpos run already.*--resume" \
  "$relpos" train "${common[@]}" --set model.mechanism=rope --set seed=4 --out "$tmp/run"
same "the finished run" "$before" "$(digest "$tmp/run")"

# --- --resume with a changed model, seed or optimiser: exit 2 naming the keys (was exit 3 for
# d_model); the run untouched
expect 2 "--resume --set model.d_model=64" "model.d_model \(32 -> 64\)" \
  "$relpos" train "${common[@]}" --set model.d_model=64 --out "$tmp/run" --resume
expect 2 "--resume with another mechanism and seed" "model.mechanism.*seed|seed.*model.mechanism" \
  "$relpos" train "${common[@]}" --set 'model.mechanism="alibi"' --set seed=9 --out "$tmp/run" --resume
expect 2 "--resume with another optim.lr" "optim.lr" \
  "$relpos" train "${common[@]}" --set optim.lr=0.1 --out "$tmp/run" --resume
same "the run after refused resumes" "$before" "$(digest "$tmp/run")"
expect 0 "--resume with more steps (allowed)" "" \
  "$relpos" train "${common[@]}" --set optim.steps=5 --out "$tmp/run" --resume
expect 0 "--overwrite starts again" "" \
  "$relpos" train "${common[@]}" --set model.mechanism=rope --out "$tmp/run" --overwrite

# --- a busy folder: the second run is refused naming the first (pid); INCOMPLETE while it runs
"$relpos" train "${common[@]}" --set optim.steps=1000000 --set checkpoint_every=0 --out "$tmp/busy" \
  >/dev/null 2>&1 &
bg=$!
for _ in $(seq 1 200); do
  grep -q '^pid ' "$tmp/busy/.relpos-run" 2>/dev/null && break
  sleep 0.05
done
holder=$(sed -n 's/^pid //p' "$tmp/busy/.relpos-run" 2>/dev/null)
[ -e "$tmp/busy/INCOMPLETE" ] || { echo "FAIL: no INCOMPLETE while the run goes"; fail=1; }
expect 2 "a second run on a busy folder" "in use by another relpos \(pid ${holder:-none}" \
  "$relpos" train "${common[@]}" --out "$tmp/busy" --resume
kill -TERM "$bg"
wait "$bg" 2>/dev/null
bg=
[ -e "$tmp/busy/INCOMPLETE" ] || { echo "FAIL: a killed run lost its INCOMPLETE marker"; fail=1; }

# --- bad --out paths: exit 2 (was 3), nothing created
touch "$tmp/afile"
ln -s "$tmp/nowhere" "$tmp/dangling"
expect 2 "--out naming a file" "is a file" "$relpos" train "${common[@]}" --out "$tmp/afile"
expect 2 "--out under a file" "not a folder" "$relpos" train "${common[@]}" --out "$tmp/afile/sub"
expect 2 "--out a dangling symlink" "dangling" "$relpos" train "${common[@]}" --out "$tmp/dangling"
expect 2 "--out an over-long name" "longer than 255" \
  "$relpos" train "${common[@]}" --out "$tmp/$(printf 'n%.0s' $(seq 300))"
[ -e "$tmp/nowhere" ] && { echo "FAIL: a dangling symlink's target was created"; fail=1; }

# --- names and overrides
expect 2 "reproduce with a 100,000-character name" "experiment" \
  "$relpos" reproduce "$(head -c 100000 /dev/zero | tr '\0' x)"
expect 2 "--set with a newline" "newline" \
  "$relpos" train "${common[@]}" --set $'optim.steps=5\noptim.batch=0' --out "$tmp/newline"
expect 2 "config name with a newline" "control character" \
  "$relpos" train "${common[@]}" --set 'name="a\nb"' --out "$tmp/named"
cat >"$tmp/sweep.toml" <<EOF
name = "../../../../../../../..$tmp/escaped"
threads = 1
[model]
d_model = 32
heads = 2
layers = 1
[task]
train_length = 16
[optim]
steps = 2
batch = 2
[eval]
every = 0
lengths = [16]
batches = 1
[sweep]
methods = ["nope"]
EOF
expect 2 "sweep name ../../x" "name" bash -c 'cd "$1" && shift && exec "$@"' _ "$tmp/project/src" \
  "$relpos" sweep --config "$tmp/sweep.toml" --quiet
[ -e "$tmp/escaped" ] && { echo "FAIL: a sweep name wrote outside runs/"; fail=1; }

# --- a run whose weights or loss become NaN stops with exit 1 naming the step (Adam with beta2 = 0
# and an eps below float's range divides 0 by 0 for a weight without gradient)
expect 1 "a diverging run stops" "training stopped: the .* at step [0-9]+; the last good checkpoint" \
  "$relpos" train "${common[@]}" --set optim.steps=100 --set checkpoint_every=1 --set optim.lr=10 \
  --set optim.clip=0 --set optim.beta2=0 --set optim.eps=1e-300 --out "$tmp/nan"
[ -e "$tmp/nan/summary.json" ] && { echo "FAIL: a diverged run wrote a summary"; fail=1; }

# --- eval: a patched checkpoint, a profile onto a folder
expect 2 "eval --profiles /tmp" "is a folder" \
  "$relpos" eval --checkpoint "$tmp/run" --lengths 16 --profiles /tmp
python3 - "$tmp/run/checkpoints/last.pt" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
b[len(b) // 2] ^= 0x10
open(p, "wb").write(bytes(b))
PY
expect 2 "eval of a patched checkpoint" "last.pt.*integrity" \
  "$relpos" eval --checkpoint "$tmp/run" --lengths 16

# --- --overwrite removes the run's own files only: the user's files in checkpoints/ (and beside
# it) survive, byte-identical
expect 0 "a run to overwrite" "" "$relpos" train "${common[@]}" --out "$tmp/ow"
mkdir -p "$tmp/ow/checkpoints/sub"
echo 'my weights' >"$tmp/ow/checkpoints/best_manual.pt"
echo 'mine' >"$tmp/ow/checkpoints/sub/notes.txt"
echo 'mine' >"$tmp/ow/notes.txt"
expect 0 "--overwrite a run with the user's files in checkpoints/" "" \
  "$relpos" train "${common[@]}" --set seed=5 --out "$tmp/ow" --overwrite
{ [ "$(cat "$tmp/ow/checkpoints/best_manual.pt" 2>/dev/null)" = 'my weights' ] &&
  [ -f "$tmp/ow/checkpoints/sub/notes.txt" ] && [ -f "$tmp/ow/notes.txt" ]; } ||
  { echo "FAIL: --overwrite deleted files relpos did not make"; fail=1; }
[ -f "$tmp/ow/checkpoints/last.pt" ] || { echo "FAIL: --overwrite wrote no new last.pt"; fail=1; }
grep -q '^seed = 5' "$tmp/ow/config.toml" || { echo "FAIL: --overwrite kept the old run"; fail=1; }

# --- --resume with the checkpoint gone: a recorded history is never restarted over (exit 2, the
# run byte-identical); a run that recorded nothing past step 0 starts from step 0
expect 0 "a run to lose its checkpoint" "" \
  "$relpos" train "${common[@]}" --set eval.every=3 --out "$tmp/nockpt"
rm "$tmp/nockpt/checkpoints/last.pt"
before=$(digest "$tmp/nockpt")
expect 2 "--resume without checkpoints/last.pt over a recorded run" \
  "checkpoints/last.pt' is missing.*metrics.csv rows up to step 3.*history.*--overwrite" \
  "$relpos" train "${common[@]}" --set optim.steps=1 --set eval.every=3 --out "$tmp/nockpt" --resume
same "the run whose checkpoint is missing" "$before" "$(digest "$tmp/nockpt")"
rm "$tmp/nockpt/summary.json"
expect 2 "--resume without checkpoint, metrics.csv only" "metrics.csv rows up to step 3" \
  "$relpos" train "${common[@]}" --out "$tmp/nockpt" --resume
head -n 1 "$tmp/nockpt/metrics.csv" >"$tmp/header" && cp "$tmp/header" "$tmp/nockpt/metrics.csv"
expect 0 "--resume without checkpoint and no rows past step 0 starts" "" \
  "$relpos" train "${common[@]}" --out "$tmp/nockpt" --resume
grep -q '^3,train' "$tmp/nockpt/metrics.csv" || { echo "FAIL: the restarted run has no rows"; fail=1; }

# --- an explicitly empty value is bad input naming the flag, never "not given" (which wrote to
# runs/NAME, skipped the profile, used the default target)
# (run in an empty folder: an empty path read as "" or "." finds nothing there and writes nothing)
mkdir -p "$tmp/cwd"
cd "$tmp/cwd" || exit 1
expect 2 "train --out ''" "--out: the value is empty" "$relpos" train "${common[@]}" --out ""
expect 2 "train --config ''" "--config: the value is empty" \
  "$relpos" train --config "" "${common[@]}" --out "$tmp/e1"
expect 2 "eval --profiles ''" "--profiles: the value is empty" \
  "$relpos" eval --checkpoint "$tmp/ow" --lengths 16 --profiles ""
expect 2 "eval --checkpoint ''" "--checkpoint: the value is empty" "$relpos" eval --checkpoint ""
expect 2 "diagnose --target ''" "--target: the value is empty" \
  "$relpos" diagnose --checkpoint "$tmp/ow" --target ""
expect 2 "diagnose --out ''" "--out: the value is empty" \
  "$relpos" diagnose --checkpoint "$tmp/ow" --out ""
expect 2 "sweep --out ''" "--out: the value is empty" \
  "$relpos" sweep --config "$tmp/sweep.toml" --out "" --quiet
expect 2 "export-runs --out ''" "--out: the value is empty" "$relpos" export-runs "$tmp" --out ""
expect 2 "bench attention --json-out ''" "--json-out: the value is empty" \
  "$relpos" bench attention --T 64 --repeats 1 --json-out ""
cd "$tmp" || exit 1
{ [ -n "$(ls -A "$tmp/cwd")" ] || [ -e "$tmp/e1" ]; } &&
  { echo "FAIL: an empty value wrote into the working folder or --out"; fail=1; }

# --- export-runs: a folder with no finished run, and one run's folder, are refused (no records)
mkdir -p "$tmp/no-runs/sub"
expect 2 "export-runs of a folder without finished runs" "no-runs' holds no finished run" \
  "$relpos" export-runs "$tmp/no-runs" --out "$tmp/rec-none"
expect 2 "export-runs of one run's folder" "one run's folder.*pass the sweep" \
  "$relpos" export-runs "$tmp/ow" --out "$tmp/rec-one"
{ [ -e "$tmp/rec-none" ] || [ -e "$tmp/rec-one" ]; } && { echo "FAIL: a refused export wrote"; fail=1; }

# --- a sweep's run killed before its first checkpoint (metrics.csv rows, no last.pt) starts again
# on the next call, in this process and in a child (--jobs 2): the sweep drops its partial history
printf '%s\n' 'name = "resweep"' 'threads = 1' '[model]' 'd_model = 16' 'heads = 2' 'layers = 1' \
  '[task]' 'train_length = 16' '[optim]' 'steps = 2' 'batch = 2' '[eval]' 'every = 0' \
  'lengths = [16]' 'batches = 1' '[sweep]' 'methods = ["nope", "rope"]' >"$tmp/resweep.toml"
for jobs in 1 2; do
  expect 0 "a sweep (--jobs $jobs)" "" \
    "$relpos" sweep --config "$tmp/resweep.toml" --jobs "$jobs" --quiet --out "$tmp/resweep$jobs"
  for m in nope rope; do
    rm -f "$tmp/resweep$jobs/$m/s0/checkpoints/last.pt" "$tmp/resweep$jobs/$m/s0/summary.json"
  done
  expect 0 "the sweep again, its runs killed before a checkpoint (--jobs $jobs)" "" \
    "$relpos" sweep --config "$tmp/resweep.toml" --jobs "$jobs" --quiet --out "$tmp/resweep$jobs"
  [ -f "$tmp/resweep$jobs/rope/s0/summary.json" ] ||
    { echo "FAIL: the sweep did not finish its restarted run (--jobs $jobs)"; fail=1; }
done

echo "train_outdirs: $([ $fail = 0 ] && echo 'all ok' || echo 'some FAILED')"
exit $fail
