"""scripts/mechanism_stats.py: layer means per run, mean and sample std over seeds per method,
'-' where a method's runs report no such statistic, exit 2 with a message for a folder without
summaries or without the statistics asked for."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mechanism_stats.py"


def _summary(folder, method_dir, seed, mechanism, layers):
    d = folder / method_dir / f"s{seed}"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"mechanism": mechanism, "mechanism_stats": layers}))


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True)


def test_layer_means_then_seed_mean_and_std(tmp_path):
    # seed 0: layer means gate_fj 0.5, high 0.2; seed 1: 0.7, 0.4 -> 0.6 +- 0.1414, 0.3 +- 0.1414
    _summary(tmp_path, "pj", 0, "pj_bias(R=3)",
             [{"gate_fj": 0.4, "high_order_mass": 0.1, "gamma": 0.0},
              {"gate_fj": 0.6, "high_order_mass": 0.3, "gamma": 0.0}])
    _summary(tmp_path, "pj", 1, "pj_bias(R=3)",
             [{"gate_fj": 0.7, "high_order_mass": 0.4}, {"gate_fj": 0.7, "high_order_mass": 0.4}])
    _summary(tmp_path, "nope", 0, "nope", [{"gamma": 0.0}])
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "| method | seeds | gate_fj | high_order_mass |"
    assert "| pj_bias(R=3) | 2 | 0.6000 ± 0.1414 | 0.3000 ± 0.1414 |" in lines
    assert "| nope | 1 | - | - |" in lines
    r = _run(tmp_path, "--keys", "gamma")
    assert r.returncode == 0 and "| nope | 1 | 0.0000 |" in r.stdout


def test_errors_name_the_problem(tmp_path):
    r = _run(tmp_path / "missing")
    assert r.returncode == 2 and "is not a folder" in r.stderr
    r = _run(tmp_path)
    assert r.returncode == 2 and "no */s*/summary.json" in r.stderr
    _summary(tmp_path, "nope", 0, "nope", [{"gamma": 0.0}])
    r = _run(tmp_path)
    assert r.returncode == 2 and "none of those statistics" in r.stderr


def test_settings_are_rows_of_their_own(tmp_path):
    _summary(tmp_path, "pj-A", 0, "pj_bias(R=3)", [{"high_order_mass": 0.1}])
    _summary(tmp_path, "pj-B", 0, "pj_bias(R=3)", [{"high_order_mass": 0.3}])
    r = _run(tmp_path, "--keys", "high_order_mass")
    assert r.returncode == 0, r.stderr
    assert "| pj_bias(R=3) (A) | 1 | 0.1000 |" in r.stdout
    assert "| pj_bias(R=3) (B) | 1 | 0.3000 |" in r.stdout


def test_several_folders_match_and_plot(tmp_path):
    a, b = tmp_path / "jet-a", tmp_path / "jet-b"
    _summary(a, "full", 0, "pj_bias(sectors=fj/affine/lc)", [{"gate_fj": 0.9}])
    _summary(a, "fj", 0, "pj_bias(sectors=fj)", [{"gate_fj": 1.0}])
    _summary(b, "full", 0, "pj_bias(sectors=fj/affine/lc)", [{"gate_fj": 0.2}])
    r = _run(a, b, "--keys", "gate_", "--match", "sectors=fj/affine/lc", "--plot",
             tmp_path / "out" / "gates.png")
    assert r.returncode == 0, r.stderr
    assert "| jet-a: pj_bias(sectors=fj/affine/lc) | 1 | 0.9000 |" in r.stdout
    assert "| jet-b: pj_bias(sectors=fj/affine/lc) | 1 | 0.2000 |" in r.stdout
    assert "sectors=fj)" not in r.stdout
    assert (tmp_path / "out" / "gates.gp").exists()
    r = _run(a, "--match", "nothing")
    assert r.returncode == 2 and "no run matches" in r.stderr
