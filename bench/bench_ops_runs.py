"""bench/bench_ops.py in N fresh processes, one after another, and each ratio's spread across them.

On a shared VM a process's heap layout (whether freed 16 MiB blocks go back to the OS and come
back as fresh pages) and the memory bandwidth it gets move one process's medians by more than the
ratios' margins; a figure that holds in one run may not in the next. This prints, per transform,
compile / relpos and compile / copy of every run (ratio of the medians), their minimum, median
and maximum, and in how many runs compile / relpos reached `--floor`.

    .venv/bin/python bench/bench_ops_runs.py [--runs 10] [--floor 2] [-- bench_ops.py arguments]

Defaults passed on: --rounds 31 --threads 2 (the issue's 2-core figures).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--floor", type=float, default=2.0)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then bench_ops.py's arguments")
    a = ap.parse_args()
    if a.runs < 1:
        ap.error("--runs must be at least 1")
    rest = [x for x in a.rest if x != "--"] or ["--rounds", "31", "--threads", "2"]
    runs = []
    for i in range(a.runs):
        out = subprocess.run([sys.executable, str(HERE / "bench_ops.py"), *rest, "--json"],
                             check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out[out.index("{"):]))
        print(f"run {i + 1}/{a.runs} done", file=sys.stderr)
    meta = runs[0]["meta"]
    print(f"torch {meta['torch']}, {meta['threads']} threads, shape {meta['shape']} {meta['dtype']}, "
          f"{meta['rounds']} rounds a run, {a.runs} runs (each a fresh process)")
    print()
    print(f"| transform | compile / relpos, run by run | min | median | max | runs >= {a.floor:g} "
          "| compile / copy: min - max | relpos / copy: min - max |")
    print("|---|---|---|---|---|---|---|---|")
    for name in runs[0]["results"]:
        r = [run["results"][name] for run in runs]
        ratio = [x["compiled_over_relpos"] for x in r]
        over_copy = [x["compiled_over_copy"] for x in r]
        relpos_copy = [1 / x["copy_over_relpos"] for x in r]
        print(f"| {name} | {' '.join(f'{x:.2f}' for x in ratio)} | {min(ratio):.2f} | "
              f"{statistics.median(ratio):.2f} | {max(ratio):.2f} | "
              f"{sum(x >= a.floor for x in ratio)} / {len(ratio)} | "
              f"{min(over_copy):.2f} - {max(over_copy):.2f} | "
              f"{min(relpos_copy):.2f} - {max(relpos_copy):.2f} |")


if __name__ == "__main__":
    main()
