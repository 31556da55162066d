#!/usr/bin/env python3
"""The learned mechanism statistics of a sweep's runs, as a Markdown table.

    python3 scripts/mechanism_stats.py runs/reproduce/pj-bridge-lc-core-cpu [--keys gate_,high_order_mass]

Reads every `<method>/s<seed>/summary.json` under the folder (as `relpos reproduce` and
`relpos-train sweep` write them). Each summary's `mechanism_stats` has one entry per layer (the
block's attention stats: for the PJ bias its sector gates `gate_fj`, `gate_affine`, `gate_lc`,
the order masses `fj_mass_r<r>`, `lc_mass_r<r>` and `high_order_mass`). Per run the values are
averaged over layers (as the PJ reference's summaries average over heads and layers); per method
the table gives the mean and the sample standard deviation over seeds; a sweep's settings (the
`-NAME` suffix of a method folder) are rows of their own. `--keys` keeps the
statistics whose names start with one of the comma-separated prefixes (default: the gates, the
order masses and the high-order mass). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--keys", default=DEFAULT_KEYS,
                    help="comma-separated name prefixes of the statistics to show")
    a = ap.parse_args()
    if not a.folder.is_dir():
        print(f"mechanism_stats: {a.folder} is not a folder", file=sys.stderr)
        return 2
    prefixes = [p for p in a.keys.split(",") if p]
    per_method: dict[str, list[dict[str, float]]] = {}
    for path in sorted(a.folder.glob("*/s*/summary.json")):
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"mechanism_stats: {path}: {e}", file=sys.stderr)
            return 2
        per_method.setdefault(run_key(path, summary), []).append(run_means(summary))
    if not per_method:
        print(f"mechanism_stats: no */s*/summary.json under {a.folder}", file=sys.stderr)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
