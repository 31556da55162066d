"""scripts/pj_fig5.py: Fig. 5's five methods picked out of a sweep's runs by their mechanism,
per corpus (the `-SETTING` folder suffix), mean ± sample std over seeds; other rows ignored;
exit 2 without runs."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pj_fig5.py"
AFFINE = "pj_bias(sectors=affine, gates=affine, slope0=2, L=512)"
LC = "pj_bias(sectors=lc/affine, gates=affine, slope0=2, L=512)"
NTK = "rope + pj_dynamic_ntk(L=512) + pj_bias(sectors=affine, gates=affine, slope0=2, L=512)"


def _run_folder(root, folder, seed, mechanism, losses, mass=None):
    d = root / folder / f"s{seed}"
    d.mkdir(parents=True)
    layers = [{"high_order_mass": mass}] if mass is not None else []
    d.joinpath("summary.json").write_text(json.dumps({
        "mechanism": mechanism, "mechanism_stats": layers,
        "final_eval": [{"length": L, "loss": v} for L, v in losses.items()]}))


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True)


def test_tables_per_method_and_corpus(tmp_path):
    music = tmp_path / "music"
    _run_folder(music, "affine-A", 0, AFFINE, {512: 1.0, 32768: 1.2})
    _run_folder(music, "affine-A", 1, AFFINE, {512: 1.0, 32768: 1.4})
    _run_folder(music, "lc-B", 0, LC, {512: 1.1, 32768: 1.3}, mass=0.02)
    _run_folder(music, "ntk-A", 0, NTK, {512: 0.9, 32768: 2.0})
    _run_folder(music, "rot-B", 0, "pj_rotary(L=512)", {512: 0.8, 32768: 3.0})
    _run_folder(music, "rope-A", 0, "rope", {512: 0.7, 32768: 9.0})  # not one of Fig. 5's rows
    r = _run("--music", music, "--out", tmp_path / "fig.png")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "| affine | 1.3000 ± 0.1414 | - |" in out
    assert "| lc_affine | - | 1.3000 |" in out
    assert "| rope_ntk_affine | 2.0000 | - |" in out
    assert "| lc_affine | - | 0.0200 |" in out  # the high-order mass panel
    assert out.count("| pj_rotary | - | 0.8000 |") == 1 and "| pj_rotary | - | 3.0000 |" in out
    assert "9.0000" not in out
    assert (tmp_path / "fig.gp").exists() and (tmp_path / "fig.dat").exists()


def test_no_runs_is_an_error(tmp_path):
    r = _run("--music", tmp_path, "--out", tmp_path / "fig.png")
    assert r.returncode == 2 and "no runs" in r.stderr
    r = _run("--music", tmp_path / "missing", "--out", tmp_path / "fig.png")
    assert r.returncode == 2 and "not a folder" in r.stderr
