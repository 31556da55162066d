#!/usr/bin/env bash
# relpos bench attention, quickly (T=256, one repeat): it runs relpos-bench from relpos's
# directory, exits 0, and prints JSON that parses and holds every case, its memory and a passing
# correctness check. Usage: tests/bench_quick.sh RELPOS_BINARY
set -u
relpos=$(realpath "$1")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$relpos" bench attention --T 256 --repeats 1 --format json >"$tmp/out.json" 2>"$tmp/err.txt"
rc=$?
if [ "$rc" != 0 ]; then echo "FAIL: relpos bench attention exited $rc: $(tail -n 5 "$tmp/err.txt")"; exit 1; fi
python3 - "$tmp/out.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
res = d["results"]
cases = {(r["mode"], r["case"]) for r in res}
want = {(m, c) for m in ("fwd", "fwdbwd") for c in ("ours", "sdpa", "sdpa_mask", "ours_lag")}
assert cases == want, f"cases {sorted(cases)}"
for r in res:
    assert r["T"] == 256 and len(r["runs_ms"]) == 1 and r["median_ms"] > 0, r
    assert r["memory"]["ok"] and r["memory"]["peak_above_inputs_mib"] >= 0, r
    # at::mm timed in the same rounds: one time per round, and the case's fraction of its rate
    assert len(r["mm_runs_ms"]) == len(r["runs_ms"]) and min(r["mm_runs_ms"]) > 0, r
    assert r["fraction_of_mm_in_rounds"] > 0, r
t = d["targets"]
assert [x["T"] for x in t["faster_than_sdpa_at_every_T"]["rows"]] == [256, 256], t
assert t["at_least_75pct_of_mm_same_rounds_from_4096"]["met"] is None, t  # no T >= 4096 here
assert d["checks_ok"] and len(d["checks"]) == 4, d["checks"]
assert d["mm_start"]["gflops"] > 0 and d["long_forward"] == [], d["long_forward"]
print(f"ok: {len(res)} cases, ratios {[(r['mode'], r['ours_over_sdpa']) for r in d['ratios']]}")
PY
rc=$?
[ "$rc" != 0 ] && exit "$rc"
# relpos bench decode, quickly: every case of each mechanism and layout (a mechanism the decode
# cache refuses in every layout, such as a dynamic context-extension rule, is bad input: exit 2,
# tests/cli_smoke.sh)
"$relpos" bench decode --ctx 64,200 --specs 'rope;alibi;fox' --heads 4:4,4:2 --rounds 2 \
  --warmup 1 --format json >"$tmp/decode.json" 2>"$tmp/err.txt"
rc=$?
if [ "$rc" != 0 ]; then echo "FAIL: relpos bench decode exited $rc: $(tail -n 5 "$tmp/err.txt")"; exit 1; fi
python3 - "$tmp/decode.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
seen = {(r["spec"], r["heads"], r.get("ctx")) for r in rows}
for spec in ("rope", "alibi", "fox"):
    for heads in ("4:4", "4:2"):
        for ctx in (64, 200):
            assert (spec, heads, ctx) in seen, (spec, heads, ctx, sorted(seen))
refused = [r for r in rows if "note" in r]
assert refused == [], refused
for r in rows:
    if "note" in r:
        continue
    base = "sdpa_bias" if r["spec"] != "rope" else "sdpa_step"
    assert set(r["ms"]) == {"ours", "sdpa", base} and all(v > 0 for v in r["ms"].values()), r
    assert set(r["ours_over"]) == {"sdpa", base}, r
print(f"ok: decode, {len(rows)} rows")
PY
rc=$?
[ "$rc" != 0 ] && exit "$rc"
# relpos bench step: the training step's benchmark, run by relpos-train (bench-step), one tiny round
"$relpos" bench step --layers 1 --d-model 32 --heads 2 --vocab 64 --T 32 --batch 1 --rounds 1 \
  --mechanisms rope --attention fused sdpa >"$tmp/step.txt" 2>"$tmp/err.txt"
rc=$?
if [ "$rc" != 0 ]; then echo "FAIL: relpos bench step exited $rc: $(tail -n 5 "$tmp/err.txt")"; exit 1; fi
for path in fused sdpa; do
  grep -q "^| rope | $path |" "$tmp/step.txt" || { echo "FAIL: relpos bench step has no rope/$path row: $(cat "$tmp/step.txt")"; exit 1; }
done
echo "ok: step"
