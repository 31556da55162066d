"""Two builds of relpos timed against each other on one machine: `relpos bench attention` (the
fused kernel, every bias policy) and bench/bench_ops.py (the transforms from Python), each run as
a process per build in alternating rounds (A B, B A, A B, ...) so that a drift of the machine's
load hits both builds alike. A build is a checkout whose build folder holds relpos, relpos-bench
and _relpos_ops.so (scripts/build.sh); its Python package is its python/relpos with that library.

    .venv/bin/python bench/compare_builds.py BEFORE AFTER [--rounds 4] [--T 1024,4096]
        [--threads 2] [--skip-ops] [--json-out FILE]

Prints, per case, the median over rounds of each run's median time for both builds and the
after/before ratio (median of the per-round ratios, with their min and max: the per-round spread).
The Python benchmark script is AFTER's for both builds (the same workload).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def attention_run(build: pathlib.Path, args) -> dict:
    cmd = [str(build / "build" / "relpos"), "bench", "attention", "--T", args.T, "--bias",
           "none,alibi,fox,grape-ap", "--cases", "ours,ours_lag,ours_fox,ours_grape_ap",
           "--modes", "fwd,fwdbwd", "--long-T", "0", "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--format", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    return {f"attention T={r['T']} {r['mode']} {r['case']}": r["median_ms"]
            for r in report["results"]}


def package(build: pathlib.Path, where: pathlib.Path) -> pathlib.Path:
    """build's Python package (sources + operator library) in a folder for PYTHONPATH."""
    dst = where / "relpos"
    shutil.copytree(build / "python" / "relpos", dst,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(build / "build" / "_relpos_ops.so", dst / "_relpos_ops.so")
    return where


def ops_run(pythonpath: pathlib.Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    cmd = [sys.executable, str(ROOT / "bench" / "bench_ops.py"), "--json", "--threads",
           str(args.threads), "--rounds", str(args.ops_rounds)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd="/").stdout
    report = json.loads(out[out.index("{"):])
    return {f"transform {name} fwd+bwd relpos": r["relpos"]
            for name, r in report["results"].items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=pathlib.Path)
    ap.add_argument("after", type=pathlib.Path)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--T", default="1024,4096")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ops-rounds", type=int, default=9,
                    help="bench_ops.py's rounds per run (each case's median over them)")
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--json-out", type=pathlib.Path)
    a = ap.parse_args()
    builds = {"before": a.before.resolve(), "after": a.after.resolve()}
    for name, b in builds.items():
        # (--skip-ops: the binaries alone, e.g. a build folder kept without its checkout)
        for f in ("relpos", "relpos-bench") + (() if a.skip_ops else ("_relpos_ops.so",)):
            if not (b / "build" / f).exists():
                sys.exit(f"compare_builds: {name}: {b / 'build' / f} is missing (scripts/build.sh)")
    times: dict = {"before": {}, "after": {}}  # build -> case -> [per-round medians]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {} if a.skip_ops else {n: package(b, pathlib.Path(tmp) / n)
                                       for n, b in builds.items()}
        for rnd in range(a.rounds):
            order = ["before", "after"] if rnd % 2 == 0 else ["after", "before"]
            for n in order:
                got = attention_run(builds[n], a)
                if not a.skip_ops:
                    got.update(ops_run(paths[n], a))
                for case, ms in got.items():
                    times[n].setdefault(case, []).append(ms)
            print(f"round {rnd + 1}/{a.rounds} done ({' then '.join(order)})", file=sys.stderr)
    rows = []
    for case in times["after"]:
        b, f = times["before"].get(case), times["after"][case]
        if not b:
            continue
        ratios = [x / y for x, y in zip(f, b)]
        rows.append({"case": case, "before_ms": statistics.median(b),
                     "after_ms": statistics.median(f), "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)})
    print(f"threads {a.threads}, {a.rounds} rounds alternating builds; ratio = after / before "
          "(< 1: faster), median of the per-round ratios [min, max]\n")
    print("| case | before ms | after ms | ratio [min, max] |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['before_ms']:.2f} | {r['after_ms']:.2f} | "
              f"{r['ratio']:.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}] |")
    if a.json_out:
        a.json_out.write_text(json.dumps({"threads": a.threads, "rounds": a.rounds,
                                          "before": str(builds["before"]),
                                          "after": str(builds["after"]), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
