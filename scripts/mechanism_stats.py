#!/usr/bin/env python3
"""The learned mechanism statistics of a sweep's runs, as a Markdown table.

    python3 scripts/mechanism_stats.py runs/reproduce/pj-bridge-lc-core-cpu [--keys gate_,high_order_mass]
    python3 scripts/mechanism_stats.py FOLDER... --keys gate_ --match sectors=fj/affine/lc --plot gates.png

Reads every `<method>/s<seed>/summary.json` under the folder (as `relpos reproduce` and
`relpos-train sweep` write them). Each summary's `mechanism_stats` has one entry per layer (the
block's attention stats: for the PJ bias its sector gates `gate_fj`, `gate_affine`, `gate_lc`,
the order masses `fj_mass_r<r>`, `lc_mass_r<r>` and `high_order_mass`). Per run the values are
averaged over layers (as the PJ reference's summaries average over heads and layers); per method
the table gives the mean and the sample standard deviation over seeds; a sweep's settings (the
`-NAME` suffix of a method folder) are rows of their own. `--keys` keeps the
statistics whose names start with one of the comma-separated prefixes (default: the gates, the
order masses and the high-order mass); `--match TEXT` keeps the rows whose name contains TEXT;
with several folders each row is prefixed by its folder's name; `--plot PNG` also draws the table
as bars with error bars (sample std) through gnuplot. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

DEFAULT_KEYS = "gate_,fj_mass_r,lc_mass_r,high_order_mass"


def run_means(summary: dict) -> dict[str, float]:
    """Layer means of every numeric statistic the run's layers report."""
    layers = summary.get("mechanism_stats") or []
    keys = sorted({k for layer in layers for k, v in layer.items() if isinstance(v, (int, float))})
    out = {}
    for k in keys:
        vals = [layer[k] for layer in layers if isinstance(layer.get(k), (int, float))]
        out[k] = sum(vals) / len(vals)
    return out


def run_key(path: Path, summary: dict) -> str:
    """The row of a `<method>[-<setting>]/s<seed>/summary.json`: its mechanism, and the setting
    in parentheses (method folder names are safe stems, so '-' only precedes a setting)."""
    folder = path.parent.parent.name
    method = summary.get("mechanism", folder)
    return f"{method} ({folder.rsplit('-', 1)[1]})" if "-" in folder else method


def mean_std(vals: list[float]) -> str:
    if len(vals) == 1:
        return f"{vals[0]:.4f}"
    return f"{statistics.mean(vals):.4f} ± {statistics.stdev(vals):.4f}"


def draw(rows: dict[str, list[dict[str, float]]], keys: list[str], out: Path,
         by_folder: bool) -> int:
    """Bars of `keys` (mean, sample-std error bars) for each row, with gnuplot; the .gp script
    and its data stay beside the PNG. Rows are labelled by their folder when there are several
    (the rows then being one method matched in each), else by the first 40 characters."""
    stem = out.with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for row, runs in rows.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in runs if k in r]
            mu = statistics.mean(vals) if vals else float("nan")
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells += [f"{mu:.6g}", f"{sd:.6g}"]
        label = row.split(": ", 1)[0] if by_folder else row[:40]
        lines.append(f'"{label}" ' + " ".join(cells))
    Path(f"{stem}.dat").write_text("\n".join(lines) + "\n")
    series = ", ".join(f"'{stem.name}.dat' using {2 + 2 * i}:{3 + 2 * i}:xtic(1) title '{k}'"
                       for i, k in enumerate(keys))
    Path(f"{stem}.gp").write_text(
        f"set terminal pngcairo size 1100,520 noenhanced\nset output '{out.name}'\n"
        "set style data histograms\nset style histogram errorbars gap 1 lw 1\n"
        "set style fill solid 0.8 border -1\nset yrange [0:*]\nset key outside right top\n"
        f"set grid ytics\nset xtics rotate by -20\nplot {series}\n")
    if shutil.which("gnuplot") is None:
        print(f"mechanism_stats: gnuplot not found; wrote {stem}.gp and its data", file=sys.stderr)
        return 0
    r = subprocess.run(["gnuplot", f"{stem.name}.gp"], cwd=out.parent, capture_output=True,
                       text=True)
    if r.returncode != 0:
        print(f"mechanism_stats: gnuplot failed on {stem}.gp:\n{r.stderr}", file=sys.stderr)
        return 2
    print(f"\nwrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", type=Path, nargs="+")
    ap.add_argument("--keys", default=DEFAULT_KEYS,
                    help="comma-separated name prefixes of the statistics to show")
    ap.add_argument("--match", default="",
                    help="keep only the methods whose row name contains this text")
    ap.add_argument("--plot", type=Path, help="also draw the table as bars into this PNG")
    a = ap.parse_args()
    prefixes = [p for p in a.keys.split(",") if p]
    per_method: dict[str, list[dict[str, float]]] = {}
    for folder in a.folders:
        if not folder.is_dir():
            print(f"mechanism_stats: {folder} is not a folder", file=sys.stderr)
            return 2
        paths = sorted(folder.glob("*/s*/summary.json"))
        if not paths:
            print(f"mechanism_stats: no */s*/summary.json under {folder}", file=sys.stderr)
            return 2
        for path in paths:
            try:
                summary = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                print(f"mechanism_stats: {path}: {e}", file=sys.stderr)
                return 2
            row = run_key(path, summary)
            if a.match not in row:
                continue
            # several folders: each row says which one (a sweep folder names its experiment)
            if len(a.folders) > 1:
                row = f"{folder.name}: {row}"
            per_method.setdefault(row, []).append(run_means(summary))
    if not per_method:
        print(f"mechanism_stats: no run matches '{a.match}'", file=sys.stderr)
        return 2
    keys = sorted({k for runs in per_method.values() for r in runs for k in r
                   if any(k.startswith(p) for p in prefixes)})
    if not keys:
        print("mechanism_stats: the runs report none of those statistics (summaries written "
              "before the runtime recorded them have none)", file=sys.stderr)
        return 2
    print("| method | seeds | " + " | ".join(keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for method, runs in per_method.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in runs if k in r]
            cells.append(mean_std(vals) if vals else "-")
        print(f"| {method} | {len(runs)} | " + " | ".join(cells) + " |")
    return draw(per_method, keys, a.plot, len(a.folders) > 1) if a.plot else 0


if __name__ == "__main__":
    sys.exit(main())
