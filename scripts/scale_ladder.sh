#!/usr/bin/env bash
# The scale ladder of the two tables where our CPU proxies invert the paper's ordering
# (docs/results/scale-ladder.md): Jordan-RoPE Table 8 (experiments/jordan-t8.toml) and the GRAPE
# proxy (experiments/grape-small.toml), each at three rungs, the [scale.cpu-small], [scale.cpu] and
# [scale.cpu-large] sections of its experiment file.
#
#   bash scripts/scale_ladder.sh            # run what is missing (finished runs are skipped), then
#                                           # write OUT/ladder.csv, OUT/ladder.md and the plots
#   bash scripts/scale_ladder.sh --report   # only the report and the plots, from the runs there are
#
# Jordan Table 8 runs through `relpos reproduce jordan-t8 --scale RUNG --methods ...` (the seeds of
# the file's scale section). The GRAPE proxy runs only the base
# setting (no KV-shift), which `reproduce` cannot select, so this script writes a sweep file from
# the experiment file's base configuration (everything above its [sweep]) with the rung's `set`
# list and runs `relpos sweep`. One process at a time, one thread, niced: the machine has 2 shared
# cores. Environment: RELPOS (default build/relpos), PY (default .venv/bin/python), OUT (default
# runs/scale-ladder), FIGURES (default docs/results/figures), RUNGS (default "cpu-small cpu
# cpu-large"), GRAPE_SEEDS / GRAPE_SEEDS_LARGE (comma lists, default 0,1 / 0).
set -euo pipefail
cd "$(dirname "$0")/.."
RELPOS=${RELPOS:-build/relpos}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/scale-ladder}
FIGURES=${FIGURES:-docs/results/figures}
RUNGS=${RUNGS:-"cpu-small cpu cpu-large"}
GRAPE_SEEDS=${GRAPE_SEEDS:-0,1}
GRAPE_SEEDS_LARGE=${GRAPE_SEEDS_LARGE:-0}
JORDAN_ROWS=(RoPE ALiBi RoPE+ALiBi Stabilized)
GRAPE_METHODS='"rope", "alibi", "grape_ap"'
export OMP_NUM_THREADS=1
mkdir -p "$OUT"

# A rung's `set` list from an experiment file, one override a line.
scale_sets() {  # FILE SCALE
  "$PY" - "$1" "$2" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    doc = tomllib.load(f)
for s in doc["scale"][sys.argv[2]].get("set", []):
    print(s)
EOF
}

run_jordan() {  # RUNG
  local rung=$1 rows=()
  for r in "${JORDAN_ROWS[@]}"; do rows+=(--methods "$r"); done
  nice -n 10 "$RELPOS" reproduce jordan-t8 --scale "$rung" --set threads=1 "${rows[@]}" \
    --out "$OUT/jordan-t8-$rung" > "$OUT/jordan-t8-$rung.md"
}

# A sweep of METHODS x SEEDS with the base configuration of FILE and the `set` list of RUNG.
run_sweep() {  # FILE RUNG SEEDS METHODS DIR
  local file=$1 rung=$2 seeds=$3 methods=$4 dir=$5 sets=()
  local cfg="$OUT/$(basename "$file" .toml)-$rung.sweep.toml"
  {
    sed '/^\[sweep\]/,$d' "$file"
    printf '[sweep]\nmethods = [%s]\nseeds = [%s]\n' "$methods" "$seeds"
  } > "$cfg"
  while IFS= read -r s; do sets+=(--set "$s"); done < <(scale_sets "$file" "$rung")
  nice -n 10 "$RELPOS" sweep --config "$cfg" "${sets[@]}" --set threads=1 --out "$dir" \
    > "$dir.md"
}

run_grape() {  # RUNG
  local rung=$1 seeds=$GRAPE_SEEDS
  [[ $rung == cpu-large ]] && seeds=$GRAPE_SEEDS_LARGE
  run_sweep experiments/grape-small.toml "$rung" "$seeds" "$GRAPE_METHODS" "$OUT/grape-small-$rung"
}

if [[ ${1:-} != --report ]]; then
  for rung in $RUNGS; do
    run_jordan "$rung"
    run_grape "$rung"
  done
fi

# The report: every finished run's final evaluation, mean +- sample std over seeds per rung, at
# the long evaluation length (the plotted one) and at the training length.
"$PY" - "$OUT" "$FIGURES" <<'EOF'
import csv, json, math, pathlib, statistics, subprocess, sys
out, figures = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rungs = ["cpu-small", "cpu", "cpu-large"]
tables = {
    "jordan-t8": dict(metric="loss", short=256, long=1024, rows={
        "rope": "RoPE", "alibi": "ALiBi", "rope_alibi": "RoPE+ALiBi",
        "jordan_m_2_regime_stabilized_L_256_direction_paper": "Stabilized"}),
    "grape-small": dict(metric="bpb", short=128, long=512, rows={
        "rope": "RoPE", "alibi": "ALiBi", "grape_ap": "GRAPE-AP"}),
}
def cell(v):
    if not v:
        return "-"
    if len(v) == 1:
        return f"{v[0]:.4f} (1 seed)"
    return f"{statistics.mean(v):.4f} ± {statistics.stdev(v):.4f}"
lines, md = [], []
for name, t in tables.items():
    conv = (lambda x: x / math.log(2)) if t["metric"] == "bpb" else (lambda x: x)
    res = {}  # (rung, label) -> (short values, long values, seeds, params, walls)
    for rung in rungs:
        for folder, label in t["rows"].items():
            short, long_, seeds, params, walls = [], [], [], [], []
            for s in sorted((out / f"{name}-{rung}" / folder).glob("s*/summary.json")):
                j = json.loads(s.read_text())
                ev = {e["length"]: e["loss"] for e in j["final_eval"]}
                short.append(conv(ev[t["short"]])); long_.append(conv(ev[t["long"]]))
                seeds.append(j["seed"]); params.append(j["parameters"]); walls.append(j["wall_s"])
            res[rung, label] = (short, long_, seeds, params, walls)
            if long_:
                sd = lambda v: f"{statistics.stdev(v):.4f}" if len(v) > 1 else "nan"
                lines.append([name, rung, label, len(long_), " ".join(map(str, seeds)),
                              f"{statistics.mean(long_):.4f}", sd(long_),
                              f"{statistics.mean(short):.4f}", sd(short), params[0],
                              f"{statistics.mean(walls):.0f}"])
    for which, L in (("long", t["long"]), ("short", t["short"])):
        md.append(f"### {name}: {t['metric']}@{L}\n")
        md.append("| method | " + " | ".join(rungs) + " |")
        md.append("|---|" + "---:|" * len(rungs))
        for label in t["rows"].values():
            md.append(f"| {label} | " + " | ".join(
                cell(res[r, label][1 if which == "long" else 0]) for r in rungs) + " |")
        md.append("")
    md.append(f"{name} runs (parameters of the first row, seeds, mean wall s per run):\n")
    for r in rungs:
        v = [res[r, l] for l in t["rows"].values() if res[r, l][1]]
        if v:
            md.append(f"- {r}: {v[0][3][0]} parameters, seeds "
                      f"{sorted(set(x for w in v for x in w[2]))}, "
                      f"{statistics.mean(x for w in v for x in w[4]):.0f} s")
    md.append("")
with open(out / "ladder.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["table", "rung", "method", "n", "seeds", "mean_long", "std_long", "mean_train_len",
                "std_train_len", "params", "mean_wall_s"])
    w.writerows(lines)
(out / "ladder.md").write_text("\n".join(md) + "\n")
print("\n".join(md))

# One figure per table, two panels: the metric at the training length and at the long length
# against the parameter count of the rung, one line per method (mean, sample-std error bars).
figures.mkdir(parents=True, exist_ok=True)
for name, t in tables.items():
    labels = [l for l in t["rows"].values() if any(r[0] == name and r[2] == l for r in lines)]
    if not labels:
        continue
    data = out / f"ladder-{name}.dat"
    blocks = []
    for label in labels:
        pts = [r for r in lines if r[0] == name and r[2] == label]
        blocks.append(f"# {label}: params mean_long std_long mean_train_len std_train_len rung\n" +
                      "\n".join(f"{r[9]} {r[5]} {0 if r[6] == 'nan' else r[6]} {r[7]} "
                                f"{0 if r[8] == 'nan' else r[8]} {r[1]}" for r in pts))
    data.write_text("\n\n\n".join(blocks) + "\n")
    png = figures / f"scale-ladder-{name}.png"
    def plot(col):
        return ", ".join(f"'{data}' index {i} using 1:{col}:{col + 1} with yerrorlines lw 2 "
                         f"title '{l}'" for i, l in enumerate(labels))
    gp = (f"set terminal pngcairo size 1400,560 noenhanced\nset output '{png}'\n"
          f"set multiplot layout 1,2 title '{name}: scale ladder (rungs cpu-small, cpu, cpu-large)'\n"
          f"set logscale x\nset grid\nset key top right\n"
          f"set xlabel 'parameters'\n"
          f"set ylabel '{t['metric']}@{t['short']} (training length), mean +- sample std'\n"
          f"plot {plot(4)}\n"
          f"set ylabel '{t['metric']}@{t['long']} ({t['long'] // t['short']}x), mean +- sample std'\n"
          f"plot {plot(2)}\nunset multiplot\n")
    (out / f"ladder-{name}.gp").write_text(gp)
    subprocess.run(["gnuplot", str(out / f"ladder-{name}.gp")], check=True)
    print(f"plot: {png}")
EOF
