#!/usr/bin/env python3
"""PJ-RoPE Fig. 5 (natural-task contrast) from our Table 4a and 4b runs.

    python3 scripts/pj_fig5.py --music runs/reproduce/pj-t4b-cpu \
        [--language runs/reproduce/pj-t4-cpu] --out docs/results/figures/pj-fig5.png

Reads every `<method>-<setting>/s<seed>/summary.json` under the folders (settings: A and B, the
MusicNet selectors, for the music runs; tiny, wikitext and warpeace for the language runs) and
keeps Fig. 5's methods: affine, full (FJ + A + LC), LC + affine, RoPE dynamic NTK + affine and the
exact PJ-rotary control. Three panels: the loss at the longest evaluation length per method and
corpus; the learned high-order mass (orders >= 2 of both jet branches, layer mean) of the PJ bias
rows; and PJ-rotary at its training length against the longest length. Prints the plotted numbers
(mean ± sample std over seeds) as Markdown and draws the PNG with gnuplot (the .gp script and its
data stay beside it when gnuplot is missing). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mechanism_stats import mean_std, run_means  # noqa: E402

METHODS = ["affine", "full", "lc_affine", "rope_ntk_affine", "pj_rotary"]
SHORT = {"affine": "A", "full": "FJ+A+LC", "lc_affine": "LC+A", "rope_ntk_affine": "NTK+A",
         "pj_rotary": "PJ-rotary"}
CORPUS_NAMES = {"tiny": "Tiny Shakespeare", "wikitext": "WikiText-2", "warpeace": "War and Peace",
                "A": "MusicNet A", "B": "MusicNet B"}


def fig5_method(mechanism: str) -> str | None:
    """The reference method name of one of Fig. 5's rows, None for other rows."""
    if "pj_rotary" in mechanism:
        return "pj_rotary"
    if "pj_bias" not in mechanism:
        return None
    if "rope" in mechanism.replace("pj_rotary", ""):
        return "rope_ntk_affine" if "pj_dynamic_ntk" in mechanism and "sectors=affine" in mechanism \
            else None
    for sectors, name in (("sectors=affine,", "affine"), ("sectors=fj/affine/lc", "full"),
                          ("sectors=lc/affine", "lc_affine")):
        if sectors in mechanism:
            return name
    return None


def collect(folder: Path) -> dict:
    """{(method, corpus): [(losses by length, high-order mass or None), ...]} over seeds."""
    out: dict = {}
    for path in sorted(folder.glob("*-*/s*/summary.json")):
        s = json.loads(path.read_text())
        method = fig5_method(s.get("mechanism", ""))
        if method is None:
            continue
        corpus = path.parent.parent.name.rsplit("-", 1)[1]
        losses = {int(e["length"]): float(e["loss"]) for e in s.get("final_eval", [])}
        out.setdefault((method, corpus), []).append(
            (losses, run_means(s).get("high_order_mass")))
    return out


def stats(vals: list[float]) -> tuple[float, float]:
    return statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--music", type=Path, required=True)
    ap.add_argument("--language", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    a = ap.parse_args()
    runs: dict = {}
    for folder in [a.music] + ([a.language] if a.language else []):
        if not folder.is_dir():
            print(f"pj_fig5: {folder} is not a folder", file=sys.stderr)
            return 2
        runs.update(collect(folder))
    corpora = [c for c in CORPUS_NAMES if any(k[1] == c for k in runs)]
    if not runs or not corpora:
        print("pj_fig5: no runs of Fig. 5's methods under the folders", file=sys.stderr)
        return 2

    def cell(method, corpus, pick):
        vals = [v for r in runs.get((method, corpus), []) if (v := pick(r)) is not None]
        return vals

    longest = lambda r: r[0][max(r[0])] if r[0] else None  # noqa: E731
    shortest = lambda r: r[0][min(r[0])] if r[0] else None  # noqa: E731
    mass = lambda r: r[1]  # noqa: E731
    tables = [("loss at the longest length", longest, METHODS),
              ("high-order mass (r >= 2, FJ + LC)", mass, ["full", "lc_affine"]),
              ("PJ-rotary: loss at the training length", shortest, ["pj_rotary"]),
              ("PJ-rotary: loss at the longest length", longest, ["pj_rotary"])]
    for title, pick, methods in tables:
        print(f"\n{title}\n")
        print("| method | " + " | ".join(CORPUS_NAMES[c] for c in corpora) + " |")
        print("|---|" + "---:|" * len(corpora))
        for m in methods:
            print(f"| {m} | " + " | ".join(
                mean_std(v) if (v := cell(m, c, pick)) else "-" for c in corpora) + " |")

    # gnuplot: one data block per panel, rows = methods (or train / longest), columns = corpora
    # (mean, std); a panel plots only the corpora it has values for
    a.out.parent.mkdir(parents=True, exist_ok=True)
    stem = a.out.with_suffix("")
    plots = [("loss at the longest length", [(m, longest, SHORT[m]) for m in METHODS]),
             ("high-order mass (orders >= 2)",
              [(m, mass, SHORT[m]) for m in ("full", "lc_affine")]),
             ("exact PJ-rotary control", [("pj_rotary", shortest, "train"),
                                          ("pj_rotary", longest, "longest")])]
    blocks, plot_cmds = [], []
    for index, (title, rows) in enumerate(plots):
        lines, present = [], set()
        for method, pick, label in rows:
            row = [label]
            for i, c in enumerate(corpora):
                v = cell(method, c, pick)
                if v:
                    present.add(i)
                mu, sd = stats(v) if v else (float("nan"), 0.0)
                row += [f"{mu:.6g}", f"{sd:.6g}"]
            lines.append(" ".join(row))
        blocks.append("\n".join(lines))
        series = ", ".join(
            f"'{stem.name}.dat' index {index} using {2 + 2 * i}:{3 + 2 * i}:xtic(1) "
            f"title '{CORPUS_NAMES[c]}'" for i, c in enumerate(corpora) if i in present)
        plot_cmds.append(f"set title '{title}'\n" + (f"plot {series}\n" if series else
                                                    "plot 0 notitle  # no runs for this panel\n"))
    Path(f"{stem}.dat").write_text("\n\n\n".join(blocks) + "\n")
    gp = (f"set terminal pngcairo size 1500,480 noenhanced\nset output '{a.out.name}'\n"
          "set yrange [0:*]\n"
          "set style data histograms\nset style histogram errorbars gap 1 lw 1\n"
          "set style fill solid 0.8 border -1\nset key top left\nset grid ytics\n"
          "set multiplot layout 1,3 title 'PJ-RoPE Fig. 5 (ours, CPU scale): language vs MIDI "
          "tokens'\n" + "".join(plot_cmds) + "unset multiplot\n")
    script = Path(f"{stem}.gp")
    script.write_text(gp)
    if shutil.which("gnuplot") is None:
        print(f"pj_fig5: gnuplot not found; wrote {script} and its data", file=sys.stderr)
        return 0
    r = subprocess.run(["gnuplot", script.name], cwd=script.parent, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"pj_fig5: gnuplot failed on {script} (a panel without any run?):\n{r.stderr}",
              file=sys.stderr)
        return 2
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
