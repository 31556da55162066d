#!/usr/bin/env bash
# CLI smoke test: the tool runs, verifies, and turns bad input into a named error and exit code.
set -u
relpos=$(realpath "$1")
fail=0
check() { # expected-exit description command...
  local want=$1 what=$2; shift 2
  out=$("$@" 2>&1); got=$?
  if [ "$got" != "$want" ]; then echo "FAIL: $what (exit $got, wanted $want): $out"; fail=1; else echo "ok: $what"; fi
}
check 0 "list" "$relpos" list
check 0 "verify rope json" "$relpos" verify --enc rope --len 4096 --positions 24 --format json
check 0 "kernel csv" "$relpos" kernel --enc "jordan(m=2, regime=raw)" --lags 0:8
check 0 "verify --structured" "$relpos" verify --structured
check 2 "verify --structured bad --dims" "$relpos" verify --structured --dims 1,4
check 0 "linear-attention small" "$relpos" linear-attention --T 64,128 --m 16 --D 16 --H 1 --repeats 1
check 2 "linear-attention m = 0" "$relpos" linear-attention --T 64 --m 0
check 2 "unknown mechanism" "$relpos" verify --enc "bogus(m=2)"
check 2 "unknown option" "$relpos" verify --enc "jordan(q=1)"
check 2 "indivisible head dim" "$relpos" kernel --enc "jordan(m=3)" --head-dim 64 --lags 0:2
check 2 "L <= 0" "$relpos" kernel --enc "jordan(L=0)" --lags 0:2
check 2 "bad lags" "$relpos" kernel --enc rope --lags 5
check 2 "unknown kernel build" env RELPOS_KERNEL_ISA=sse9 "$relpos" verify --enc rope --len 64 --positions 8
check 2 "bad attention prefetch setting" env RELPOS_ATTENTION_PREFETCH=2 "$relpos" linear-attention --T 64 --m 16 --D 16 --H 1 --repeats 1
# issue 7 regressions: one exit-code contract (0 ok, 1 check failed, 2 bad input)
check 0 "help is not an error" "$relpos" verify --help
check 2 "CLI11 parse error: unknown flag" "$relpos" verify --bogus
check 2 "CLI11 parse error: missing value" "$relpos" verify --enc
check 2 "CLI11 parse error: no subcommand" "$relpos"
check 2 "head dim beyond int" "$relpos" verify --enc rope --head-dim 99999999999
check 2 "huge number in an alias" "$relpos" verify --enc jordan_m99999999999
check 2 "trailing junk in an alias" "$relpos" kernel --enc jordan_exact_m3_c05O --head-dim 48 --lags 0:1
check 2 "jordan_exactly" "$relpos" kernel --enc jordan_exactly --lags 0:1
check 2 "jetmixXYZ" "$relpos" kernel --enc jordan_jetmixXYZ_m3_g010_g005 --lags 0:1
check 2 "nan lags" "$relpos" kernel --enc rope --lags nan:4
check 2 "junk lags" "$relpos" kernel --enc rope --lags 0abc:4xyz
check 2 "c out of range" "$relpos" kernel --enc "jordan(regime=scaled, c=1e308)" --lags 0:1
check 2 "L out of range" "$relpos" kernel --enc "jordan(regime=scaled, L=1e-300)" --lags 0:1
check 2 "theta out of range" "$relpos" kernel --enc "rope(theta=1e-300)" --lags 0:1
check 2 "center out of range" "$relpos" kernel --enc "jordan(regime=raw, center=1e308)" --lags 0:1
check 2 "seed beyond 64 bits" "$relpos" kernel --enc rope --params random --seed 99999999999999999999999 --lags 0:1
check 2 "negative seed" "$relpos" kernel --enc rope --params random --seed -1 --lags 0:1
check 2 "lag step below float64 resolution" "$relpos" kernel --enc rope --lags 1e16:1.0000000000000004e16:0.1
check 0 "negative lags stay finite" "$relpos" kernel --enc damped_rope --lags -1e6:-1e6
out=$("$relpos" kernel --enc damped_rope --lags -1e6:-999998 2>/dev/null)
echo "$out" | grep -qiE 'inf|nan' && { echo "FAIL: kernel printed inf/nan at negative lags"; fail=1; }
out=$("$relpos" kernel --enc rope --lags 1e3:1.0005e3:0.0001 2>/dev/null | cut -d, -f1 | tail -n +2)
[ "$(echo "$out" | sort | uniq -d | wc -l)" = 0 ] || { echo "FAIL: repeated lag labels"; fail=1; }
big=$(head -c 100000 /dev/zero | tr '\0' 'x')
out=$("$relpos" verify --enc "$big" 2>&1); [ ${#out} -lt 2000 ] || { echo "FAIL: a 100 KB spec is echoed in full (${#out} chars)"; fail=1; }
# no shell on user paths: quotes, $(), backticks and newlines in --out
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for name in "x'; touch PWNED; echo '" 'a$(touch PWNED)b' 'c`touch PWNED`d' "$(printf 'e\ntouch PWNED\nf')"; do
  check 0 "probe --out with a hostile name" bash -c 'cd "$1" && "$2" probe --suite jordan-t3 --format csv --out "$1/$3"' _ "$tmp" "$relpos" "$name"
  [ -f "$tmp/$name/probe-jordan-t3.csv" ] || { echo "FAIL: no table in the hostile --out directory"; fail=1; }
  [ -e "$tmp/$name/INCOMPLETE" ] && { echo "FAIL: finished run left its INCOMPLETE marker"; fail=1; }
  ls -A "$tmp/$name" | grep -q '\.tmp\.' && { echo "FAIL: temp files left behind"; fail=1; }
done
find "$tmp" / -maxdepth 1 -name PWNED 2>/dev/null | grep -q . && { echo "FAIL: a shell ran a user string"; fail=1; }
[ -e "$tmp/PWNED" ] && { echo "FAIL: a shell ran a user string"; fail=1; }
# bench runs relpos-bench from relpos's own directory: a relpos without it (the core-only build,
# or a copy elsewhere) refuses with exit 2 and says it needs the LibTorch build
mkdir "$tmp/alone" && cp "$relpos" "$tmp/alone/relpos"
check 2 "bench without relpos-bench" "$tmp/alone/relpos" bench attention --T 64
out=$("$tmp/alone/relpos" bench attention 2>&1); echo "$out" | grep -q "LibTorch build" || { echo "FAIL: bench without relpos-bench does not say why: $out"; fail=1; }
check 2 "bench: unknown flag" "$relpos" bench attention --bogus
check 2 "bench: no benchmark named" "$relpos" bench
# context extension: spec terms and a model config's rope_scaling dictionary (docs/rope-scaling.md)
check 0 "verify rope + yarn" "$relpos" verify --enc "rope + yarn(factor=4, original=512)" --len 4096 --positions 16 --dtype f64
printf '{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}' > "$tmp/llama3.json"
out=$("$relpos" verify --enc "rope(theta=500000)" --rope-scaling "$tmp/llama3.json" --len 4096 --positions 16 --dtype f64 --format json 2>&1); rc=$?
{ [ $rc = 0 ] && echo "$out" | grep -q "llama3(factor=8, original=1024"; } && echo "ok: verify --rope-scaling" || { echo "FAIL: verify --rope-scaling (exit $rc): $out"; fail=1; }
printf '{"rope_type": "yarn", "factor": 4, "betafast": 3}' > "$tmp/bad.json"
check 2 "rope_scaling: unknown key" "$relpos" verify --enc rope --rope-scaling "$tmp/bad.json"
check 2 "rope_scaling: no --enc" "$relpos" verify --rope-scaling "$tmp/llama3.json"
check 2 "rope_scaling: no file" "$relpos" verify --enc rope --rope-scaling "$tmp/none.json"
check 2 "a rule without a rotary term" "$relpos" verify --enc "nope + yarn"
# --max-position-embeddings: a finite number in [1, 1e15] (nan, -1, 0 were read as "not given"; 0.5
# and inf were refused later without the flag's name), refused by
# name with the value; read only with --rope-scaling (alone it was ignored without a word)
printf '{"rope_type": "dynamic", "factor": 2.0}' > "$tmp/dynamic.json"
check_msg() { # expected-exit description pattern command...
  local want=$1 what=$2 pattern=$3; shift 3
  out=$("$@" 2>&1); got=$?
  if [ "$got" != "$want" ]; then echo "FAIL: $what (exit $got, wanted $want): $out"; fail=1
  elif ! grep -qE -- "$pattern" <<<"$out"; then echo "FAIL: $what: no /$pattern/ in: $out"; fail=1
  else echo "ok: $what"; fi
}
for v in nan -1 0 0.5 inf; do
  check_msg 2 "--max-position-embeddings $v" "--max-position-embeddings: '$v' is not a finite number in \[1," \
    "$relpos" verify --enc rope --rope-scaling "$tmp/dynamic.json" --max-position-embeddings "$v"
done
check_msg 2 "--max-position-embeddings without --rope-scaling" \
  "--max-position-embeddings is read only with --rope-scaling" \
  "$relpos" verify --enc rope --len 64 --positions 8 --max-position-embeddings 4096
check_msg 2 "--max-position-embeddings with --structured" \
  "--max-position-embeddings is read only with --rope-scaling" \
  "$relpos" verify --structured --max-position-embeddings 4096
check_msg 0 "dynamic rope_scaling with --max-position-embeddings" "dynamic" \
  "$relpos" verify --enc rope --rope-scaling "$tmp/dynamic.json" --max-position-embeddings 4096 \
  --len 64 --positions 8 --format csv
check_msg 2 "dynamic rope_scaling without it" "original_max_position_embeddings is required" \
  "$relpos" verify --enc rope --rope-scaling "$tmp/dynamic.json" --len 64 --positions 8
out=$("$relpos" verify --enc "bogus" 2>&1); echo "$out" | grep -q "unknown mechanism 'bogus'" || { echo "FAIL: error text does not name the mechanism: $out"; fail=1; }
# kernel: a mechanism whose scores are not a function of the lag alone (content-gated biases,
# content phases, vector positions) or whose lag table is learned is refused by name, never
# printed as a table without its terms
for enc in fox grape_a grape_ap structured 'journey(angles=token)' 'grape_m(context=true)' t5_bias; do
  check 2 "kernel --enc $enc" "$relpos" kernel --enc "$enc" --lags 0:2
  out=$("$relpos" kernel --enc "$enc" --lags 0:2 2>&1)
  echo "$out" | grep -q "no lag kernel" && echo "$out" | grep -q "${enc%%(*}" ||
    { echo "FAIL: kernel --enc $enc does not name the mechanism and why: $out"; fail=1; }
done
check 0 "kernel --enc journey (fixed angles)" "$relpos" kernel --enc journey --lags 0:2
check 0 "kernel --enc alibi" "$relpos" kernel --enc alibi --lags 0:2
# non-finite values of floating-point flags are refused by name before anything runs
check 2 "linear-attention --qk-std nan" "$relpos" linear-attention --T 64 --m 16 --D 16 --H 1 --repeats 1 --qk-std nan
out=$("$relpos" linear-attention --T 64 --m 16 --D 16 --H 1 --repeats 1 --qk-std nan 2>&1)
echo "$out" | grep -q -- "--qk-std" || { echo "FAIL: --qk-std nan not named: $out"; fail=1; }
# relpos bench: bad flags exit 2 before running (the benchmark's first stderr line is not printed)
# (relpos-bench is the LibTorch build's: the core-only build, e.g. CI's sanitizer build, has none)
if [ -x "$(dirname "$relpos")/relpos-bench" ]; then
  att=(bench attention --T 4 --B 1 --H 1 --D 4 --repeats 1 --warmup 1 --no-memory --no-scaling --long-T 0 --mm-n 16)
  dec=(bench decode --ctx 8 --rounds 1 --warmup 0 --D 8 --heads 2:2)
  check 2 "bench attention --max-mask-gib nan" "$relpos" "${att[@]}" --max-mask-gib nan
  for specs in bogus '' 'damped_rope(center=mid)' 'rope;bogus(m=2)' 'rope + dynamic_ntk'; do
    check 2 "bench decode --specs '$specs'" "$relpos" "${dec[@]}" --specs "$specs"
    out=$("$relpos" "${dec[@]}" --specs "$specs" 2>&1)
    echo "$out" | grep -q -- "--specs" || { echo "FAIL: bench decode --specs '$specs' not named: $out"; fail=1; }
    echo "$out" | grep -q "relpos bench decode: torch" && { echo "FAIL: bench decode --specs '$specs' ran: $out"; fail=1; }
  done
  for heads in 1:1:1 8x:2 8:3 0:0 2 ''; do
    check 2 "bench decode --heads '$heads'" "$relpos" "${dec[@]}" --specs rope --heads "$heads"
  done
  # --json-out: never over someone else's file, a link or a folder, refused before the benchmark
  # runs; a new file or an earlier report of the same benchmark is written (atomically)
  mkdir -p "$tmp/json"
  printf 'hi\n' >"$tmp/json/x.txt"
  ln -s "$tmp/json/nowhere.json" "$tmp/json/dangling.json"
  for cmd in att dec; do
    declare -n args=$cmd
    for target in x.txt dangling.json . ; do
      check 2 "bench ${args[1]} --json-out $target" "$relpos" "${args[@]}" --json-out "$tmp/json/$target"
      out=$("$relpos" "${args[@]}" --json-out "$tmp/json/$target" 2>&1)
      echo "$out" | grep -q -- "--json-out" || { echo "FAIL: bench ${args[1]} --json-out $target not named: $out"; fail=1; }
      echo "$out" | grep -qE "kernel build|relpos bench decode: torch" &&
        { echo "FAIL: bench ${args[1]} --json-out $target refused only after running: $out"; fail=1; }
    done
    [ "$(cat "$tmp/json/x.txt")" = hi ] || { echo "FAIL: bench ${args[1]} changed a foreign file"; fail=1; }
    [ -L "$tmp/json/dangling.json" ] && [ ! -e "$tmp/json/nowhere.json" ] ||
      { echo "FAIL: bench ${args[1]} replaced or followed a dangling link"; fail=1; }
    check 0 "bench ${args[1]} --json-out a new file" "$relpos" "${args[@]}" --json-out "$tmp/json/$cmd.json"
    check 0 "bench ${args[1]} --json-out its own report again" "$relpos" "${args[@]}" --json-out "$tmp/json/$cmd.json"
    python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$tmp/json/$cmd.json" ||
      { echo "FAIL: bench ${args[1]} --json-out is not JSON"; fail=1; }
    ln -s "$tmp/json/$cmd.json" "$tmp/json/$cmd-link.json"
    check 2 "bench ${args[1]} --json-out a link to its own report" "$relpos" "${args[@]}" --json-out "$tmp/json/$cmd-link.json"
    unset -n args
  done
  check 2 "bench decode --json-out an attention report" "$relpos" "${dec[@]}" --json-out "$tmp/json/att.json"
  ls -A "$tmp/json" | grep -q '\.tmp\.' && { echo "FAIL: bench --json-out left temp files"; fail=1; }
else
  echo "cli_smoke: relpos bench checks skipped (no relpos-bench beside $relpos: a core-only build)"
fi
exit $fail
