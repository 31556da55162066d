#!/usr/bin/env bash
# No orphan trainer (issue 23, item 4): SIGTERM, SIGHUP or SIGKILL sent to a launcher - `relpos
# train` (which runs relpos-train), the `relpos-train train --nproc 2` launcher (which runs two
# workers), `relpos train --nproc 2` (both) or `relpos sweep --jobs 2` (runs in processes) - leaves none of its descendants running: the
# launchers forward the signals they can catch, and every child dies with its parent
# (PR_SET_PDEATHSIG) when the launcher is killed outright.
# Usage: tests/train_signals.sh RELPOS_BINARY (relpos-train beside it)
set -u
relpos=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
trainer=$(dirname "$relpos")/relpos-train
tmp=$(mktemp -d)
leftover=()
trap 'for p in "${leftover[@]}"; do kill -KILL "$p" 2>/dev/null; done; rm -rf "$tmp"' EXIT
fail=0
common=(--quiet --set threads=1 --set model.d_model=16 --set model.heads=2 --set model.layers=1
        --set task.train_length=16 --set optim.steps=100000000 --set optim.batch=2
        --set eval.every=0 --set 'eval.lengths=[16]' --set eval.batches=1 --set checkpoint_every=0)

# the live descendants of a process (zombies, which run nothing, are not counted)
descendants() {
  local parent=$1 stat pid ppid state
  for stat in /proc/[0-9]*/stat; do
    read -r pid _ state ppid _ <"$stat" 2>/dev/null || continue
    if [ "$ppid" = "$parent" ] && [ "$state" != Z ]; then
      echo "$pid"
      descendants "$pid"
    fi
  done
}
alive() { local s; s=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) && [ "$s" != Z ] && [ "$s" != X ]; }

# case NAME SIGNAL EXPECTED_DESCENDANTS COMMAND...
case_() {
  local name=$1 sig=$2 want=$3; shift 3
  "$@" >/dev/null 2>&1 &
  local launcher=$! kids=() _i p
  for _i in $(seq 1 300); do  # up to 15 s for the children to start
    mapfile -t kids < <(descendants "$launcher")
    [ "${#kids[@]}" -ge "$want" ] && break
    sleep 0.05
  done
  if [ "${#kids[@]}" -lt "$want" ]; then
    echo "FAIL: $name: ${#kids[@]} of $want children started"
    fail=1
    kill -KILL "$launcher" 2>/dev/null
    wait "$launcher" 2>/dev/null
    for p in "${kids[@]}"; do kill -KILL "$p" 2>/dev/null; done
    return
  fi
  sleep 0.5  # let them get going (a worker past its start, the trainer's re-exec done)
  mapfile -t kids < <(descendants "$launcher")
  kill -"$sig" "$launcher"
  wait "$launcher" 2>/dev/null
  local left=()
  for _i in $(seq 1 200); do  # up to 10 s for every descendant to end
    left=()
    for p in "${kids[@]}"; do alive "$p" && left+=("$p"); done
    [ "${#left[@]}" -eq 0 ] && break
    sleep 0.05
  done
  if [ "${#left[@]}" -gt 0 ]; then
    echo "FAIL: $name: kill -$sig of the launcher left ${#left[@]} of ${#kids[@]} running (pids ${left[*]})"
    fail=1
    leftover+=("${left[@]}")
    for p in "${left[@]}"; do kill -KILL "$p" 2>/dev/null; done
  else
    echo "ok: $name: kill -$sig of the launcher, none of its ${#kids[@]} children left"
  fi
}

for sig in TERM HUP KILL; do
  case_ "relpos train" "$sig" 1 "$relpos" train "${common[@]}" --out "$tmp/one-$sig"
  case_ "relpos-train train --nproc 2" "$sig" 2 \
    "$trainer" train "${common[@]}" --nproc 2 --out "$tmp/two-$sig"
done
case_ "relpos train --nproc 2" KILL 3 "$relpos" train "${common[@]}" --nproc 2 --out "$tmp/three"
# a sweep running its runs in processes (relpos -> relpos-train sweep -> two runs)
cat >"$tmp/sweep.toml" <<EOF
name = "signals"
threads = 1
checkpoint_every = 0
[model]
d_model = 16
heads = 2
layers = 1
[task]
train_length = 16
[optim]
steps = 100000000
batch = 2
[eval]
every = 0
lengths = [16]
batches = 1
[sweep]
methods = ["nope", "rope"]
EOF
for sig in TERM KILL; do
  case_ "relpos sweep --jobs 2" "$sig" 3 "$relpos" sweep --config "$tmp/sweep.toml" --jobs 2 --quiet \
    --out "$tmp/sweep-$sig"
done
echo "train_signals: $([ $fail = 0 ] && echo 'all ok' || echo 'some FAILED')"
exit $fail
