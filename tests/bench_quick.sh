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
assert d["checks_ok"] and len(d["checks"]) == 4, d["checks"]
assert d["mm_start"]["gflops"] > 0 and d["long_forward"] == [], d["long_forward"]
print(f"ok: {len(res)} cases, ratios {[(r['mode'], r['ours_over_sdpa']) for r in d['ratios']]}")
PY
