#!/usr/bin/env bash
# CLI exit-code contract: every run of relpos exits 0 (ok), 1 (a check failed) or 2 (bad input,
# with a short message naming the problem); 3 and above, or death by a signal, is a bug.
# Runs the fuzz seed corpus (tests/fuzz/corpus) as --enc for `verify` and `kernel`, then hostile
# argument vectors (unknown flags, missing or out-of-range values, shell metacharacters in --out).
# Usage: tests/cli_contract.sh RELPOS_BINARY
# Env: RELPOS_CONTRACT_KERNEL_N (corpus entries run one by one through `kernel`, default 40;
#      0 = all), RELPOS_CONTRACT_BATCH (--enc flags per `verify` call, default 12).
set -u
relpos=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
here=$(cd "$(dirname "$0")" && pwd)
corpus=$here/fuzz/corpus
kernel_n=${RELPOS_CONTRACT_KERNEL_N:-40}
batch=${RELPOS_CONTRACT_BATCH:-12}
max_msg=1000
fail=0
nchecks=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 3

printable() { printf '%s' "$1" | head -c 160 | tr -c '[:print:]' '?'; }

# check DESCRIPTION COMMAND... : exit code must be 0, 1 or 2; an exit-2 message must be short.
check() {
  local what=$1; shift
  local out got
  out=$("$@" 2>&1 </dev/null); got=$?
  nchecks=$((nchecks + 1))
  if [ "$got" -gt 2 ]; then
    local why="exit $got"
    [ "$got" -gt 128 ] && why="killed by signal $((got - 128))"
    echo "FAIL: $what ($why; contract: 0, 1 or 2): $(printable "$(printf '%s' "$out" | tail -n 3)")"
    fail=1
  elif [ "$got" -eq 2 ] && [ "${#out}" -gt "$max_msg" ]; then
    echo "FAIL: $what (exit 2 with a ${#out}-character message, limit $max_msg): $(printable "$out")"
    fail=1
  elif [ "$got" -eq 2 ] && [ -z "$out" ]; then
    echo "FAIL: $what (exit 2 without a message)"
    fail=1
  else
    echo "ok: $what (exit $got)"
  fi
}

# check_bad DESCRIPTION COMMAND... : input that is plainly wrong must be refused with exit 2 (the
# contract's bad-input code) and a short message; exit 0 means it was silently accepted.
check_bad() {
  local what=$1; shift
  local out got
  out=$("$@" 2>&1 </dev/null); got=$?
  nchecks=$((nchecks + 1))
  if [ "$got" -ne 2 ]; then
    local why="exit $got"
    [ "$got" -gt 128 ] && why="killed by signal $((got - 128))"
    [ "$got" -eq 0 ] && why="exit 0: accepted"
    echo "FAIL: $what ($why; contract: bad input exits 2): $(printable "$(printf '%s' "$out" | tail -n 3)")"
    fail=1
  elif [ "${#out}" -gt "$max_msg" ]; then
    echo "FAIL: $what (exit 2 with a ${#out}-character message, limit $max_msg): $(printable "$out")"
    fail=1
  elif [ -z "$out" ]; then
    echo "FAIL: $what (exit 2 without a message)"
    fail=1
  else
    echo "ok: $what (exit 2)"
  fi
}

# The corpus entries as --enc values: the fuzzer-only shape prefix "@DxH:" is dropped and NUL
# bytes (which argv cannot carry) are removed.
specs=() names=()
for f in "$corpus"/*; do
  [ -f "$f" ] || continue
  s=$(tr -d '\000' <"$f")
  if [[ $s =~ ^@[0-9]+x[0-9]+: ]]; then s=${s#*:}; fi
  specs+=("$s")
  names+=("$(basename "$f")")
done
if [ ${#specs[@]} -eq 0 ]; then echo "FAIL: no corpus in $corpus"; exit 1; fi

# verify: every corpus entry, several per call (one bad entry makes the whole call exit 2).
for ((i = 0; i < ${#specs[@]}; i += batch)); do
  args=() label=()
  for ((j = i; j < i + batch && j < ${#specs[@]}; ++j)); do
    args+=(--enc "${specs[j]}")
    label+=("${names[j]}")
  done
  check "verify ${label[*]}" "$relpos" verify "${args[@]}" --len 64 --positions 8 --heads 1
done
# kernel: entries one by one (a verify batch stops at its first bad entry); the hostile-* and
# alias-* entries go first.
order=()
for k in "${!names[@]}"; do [[ ${names[k]} == hostile-* ]] && order+=("$k"); done
for k in "${!names[@]}"; do [[ ${names[k]} == alias-* ]] && order+=("$k"); done
for k in "${!names[@]}"; do [[ ${names[k]} != hostile-* && ${names[k]} != alias-* ]] && order+=("$k"); done
n=${#order[@]}
if [ "$kernel_n" -gt 0 ] && [ "$kernel_n" -lt "$n" ]; then n=$kernel_n; fi
for ((i = 0; i < n; ++i)); do
  k=${order[i]}
  check "kernel ${names[k]}" "$relpos" kernel --enc "${specs[k]}" --lags 0:2
done

# Hostile argument vectors: each is bad input, so each must exit 2 with a short message.
check_bad "unknown flag" "$relpos" verify --bogus-flag
check_bad "unknown subcommand" "$relpos" frobnicate
check_bad "no subcommand" "$relpos"
check_bad "missing value --enc" "$relpos" kernel --enc
check_bad "missing value --len" "$relpos" verify --enc rope --len
check_bad "kernel without --enc" "$relpos" kernel --lags 0:2
check_bad "seed out of range" "$relpos" verify --enc rope --len 64 --positions 8 --seed 99999999999999999999999
check "negative seed" "$relpos" verify --enc rope --len 64 --positions 8 --seed -1
check_bad "head-dim out of range" "$relpos" kernel --enc rope --head-dim 99999999999 --lags 0:2
check_bad "head-dim out of range (verify)" "$relpos" verify --enc rope --head-dim 99999999999 --len 64 --positions 8
check_bad "head-dim zero" "$relpos" kernel --enc rope --head-dim 0 --lags 0:2
check_bad "heads out of range" "$relpos" kernel --enc rope --heads 100000 --lags 0:2
check_bad "head beyond heads" "$relpos" kernel --enc alibi --heads 2 --head 7 --lags 0:2
check_bad "len out of range" "$relpos" verify --enc rope --len 99999999999999 --positions 8
check_bad "len not a number" "$relpos" verify --enc rope --len abc --positions 8
check_bad "positions out of range" "$relpos" verify --enc rope --len 64 --positions 1
check_bad "lags nan" "$relpos" kernel --enc rope --lags nan:4
check_bad "lags inf" "$relpos" kernel --enc rope --lags 0:inf
check_bad "lags junk" "$relpos" kernel --enc rope --lags 0abc:4xyz
check_bad "lags empty" "$relpos" kernel --enc rope --lags ""
check_bad "lags huge" "$relpos" kernel --enc rope --lags 0:1e300
check_bad "lags 1e400" "$relpos" kernel --enc rope --lags 0:1e400
check_bad "lags negative step" "$relpos" kernel --enc rope --lags 0:4:-1
check_bad "lags zero step" "$relpos" kernel --enc rope --lags 0:4:0
check_bad "bad format" "$relpos" kernel --enc rope --lags 0:2 --format xml
check_bad "bad dtype" "$relpos" verify --enc rope --len 64 --positions 8 --dtype f16
check_bad "bad layout" "$relpos" verify --enc rope --len 64 --positions 8 --layout diagonal
check_bad "unknown probe suite" "$relpos" probe --suite nope
# pj-t5 runs in float32 (the reference's default) or, with --dtype f64, float64; nothing else
check_bad "pj-t5 bad dtype" "$relpos" probe --suite pj-t5 --dtype f16
check_bad "reproduce pj-t5 bad dtype" "$relpos" reproduce pj-t5 --dtype bf16
check_bad "reproduce pj-t3 is float64 only" "$relpos" reproduce pj-t3 --dtype f32
check_bad "unknown experiment" "$relpos" reproduce nothing
mkdir -p "$tmp/not-records" && printf 'mine\n' > "$tmp/not-records/notes.txt"
check_bad "export-runs missing folder" "$relpos" export-runs "$tmp/no-such-sweep" --out "$tmp/rec"
check_bad "export-runs no --out" "$relpos" export-runs "$tmp"
check_bad "export-runs into someone's folder" "$relpos" export-runs "$tmp/not-records" --out "$tmp/not-records"
check_bad "export-runs onto a file" "$relpos" export-runs "$tmp/not-records" --out "$tmp/not-records/notes.txt"
mkdir -p "$tmp/midi-empty" && printf 'my notes\n' > "$tmp/notes.txt"
check_bad "midi-text missing folder" "$relpos" midi-text "$tmp/no-such-folder" --out "$tmp/c.txt"
check_bad "midi-text folder without MIDI" "$relpos" midi-text "$tmp/midi-empty" --out "$tmp/c.txt"
check_bad "midi-text max-files 0" "$relpos" midi-text "$tmp/midi-empty" --out "$tmp/c.txt" --max-files 0
check_bad "midi-text overwrites a foreign file" "$relpos" midi-text "$tmp/midi-empty" --out "$tmp/notes.txt"
check_bad "enc huge m" "$relpos" kernel --enc jordan_m99999999999 --lags 0:2
check_bad "enc empty" "$relpos" kernel --enc "" --lags 0:2
check_bad "enc 3 KB" "$relpos" kernel --enc "$(printf 'j%.0s' $(seq 3000))" --lags 0:2

# an explicitly empty value is bad input naming the flag (every option of every command, one
# check: refuse_empty_values), never "not given": `--out ""` wrote no report or the default
# folder, `--rope-scaling ""` verified without the rule
check_empty() {
  local flag=$1; shift
  local out got
  out=$("$@" 2>&1 </dev/null); got=$?
  nchecks=$((nchecks + 1))
  if [ "$got" -ne 2 ] || ! grep -q -- "^relpos: error: $flag: the value is empty" <<<"$out"; then
    echo "FAIL: empty $flag (exit $got; wanted 2 naming $flag): $(printable "$out")"; fail=1
  else
    echo "ok: empty $flag refused"
  fi
}
mkdir -p "$tmp/empty" && cd "$tmp/empty" || exit 3
check_empty --out "$relpos" probe --suite jordan-t3 --out ""
check_empty --out "$relpos" verify --structured-sweep --dims 1 --out ""
check_empty --out "$relpos" linear-attention --T 64 --m 16 --D 16 --H 1 --repeats 1 --out ""
check_empty --rope-scaling "$relpos" verify --enc rope --len 64 --positions 8 --rope-scaling ""
check_empty --enc "$relpos" verify --enc "" --len 64 --positions 8
check_empty --lags "$relpos" kernel --enc rope --lags ""
check_empty --seed "$relpos" verify --enc rope --len 64 --positions 8 --seed ""
nchecks=$((nchecks + 1))
if [ -n "$(ls -A "$tmp/empty")" ]; then
  echo "FAIL: an empty value wrote into the working folder: $(ls -A "$tmp/empty" | head -c 200)"; fail=1
else
  echo "ok: empty values wrote nothing"
fi
cd "$tmp" || exit 3

# --out paths with shell metacharacters (legal file names: any of 0, 1, 2 is fine), each run in its
# own directory: nothing may be executed, i.e. no file named PWNED may appear.
outs=('out/$(touch PWNED)' 'out/`touch PWNED`' "out/a'\$(touch PWNED)'b" "out/c';touch PWNED;'d"
      'out/e";touch PWNED;"f' $'out/new\nline' $'out/g\n$(touch PWNED)' "out/q'uote" 'out/sp ace')
for i in "${!outs[@]}"; do
  o=${outs[i]}
  mkdir -p "$tmp/probe$i"
  cd "$tmp/probe$i" || exit 3
  check "probe --out $(printable "$o")" "$relpos" probe --suite jordan-t3 --out "$o"
  cd "$tmp" || exit 3
  pwned=$(find "$tmp" -name PWNED 2>/dev/null; [ -e "$here/../PWNED" ] && echo "$here/../PWNED"
    [ -e "$HOME/PWNED" ] && echo "$HOME/PWNED"; [ -e /tmp/PWNED ] && echo /tmp/PWNED)
  nchecks=$((nchecks + 1))
  if [ -n "$pwned" ]; then
    echo "FAIL: probe --out $(printable "$o") ran a shell command (created $(printable "$pwned"))"
    fail=1
    find "$tmp" -name PWNED -delete 2>/dev/null
  else
    echo "ok: probe --out $(printable "$o") ran no shell command"
  fi
done

# --out into a folder of someone else's files (docs/errors.md "Output directories"): refused with
# exit 2 before any write, every file byte-identical; into its own earlier output: rewritten.
mkdir -p "$tmp/theirs"
printf 'their notes\n' >"$tmp/theirs/probe-jordan-t3.md"
before=$(cd "$tmp/theirs" && ls -A && cat probe-jordan-t3.md)
check_bad "probe --out a folder of other files" "$relpos" probe --suite jordan-t3 --out "$tmp/theirs"
nchecks=$((nchecks + 1))
if [ "$before" != "$(cd "$tmp/theirs" && ls -A && cat probe-jordan-t3.md)" ]; then
  echo "FAIL: probe --out changed a folder it refused"; fail=1
else
  echo "ok: the refused folder is byte-identical"
fi
check "probe --out a new folder" "$relpos" probe --suite jordan-t3 --out "$tmp/ours"
check "probe --out its own folder again" "$relpos" probe --suite jordan-t3 --out "$tmp/ours"
touch "$tmp/plainfile"
check_bad "probe --out naming a file" "$relpos" probe --suite jordan-t3 --out "$tmp/plainfile"

echo "cli_contract: $nchecks checks, $([ $fail = 0 ] && echo 'all ok' || echo 'some FAILED')"
exit $fail
