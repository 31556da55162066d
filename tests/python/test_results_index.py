"""The results index (docs/results/README.md) cannot go stale: it is the generator's output of
docs/results/tables.toml, and the data file names exactly the experiments of
`relpos reproduce --list` (the CLI part is skipped when build/relpos is absent)."""
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELPOS = ROOT / "build" / "relpos"


def _load_generator():
    spec = importlib.util.spec_from_file_location("results_index", ROOT / "scripts" / "results_index.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()
DATA = gen.load()


def test_committed_readme_is_the_generated_one():
    assert gen.README.read_text(encoding="utf-8") == gen.render(DATA), (
        "docs/results/README.md is stale: run python3 scripts/results_index.py")
    assert gen.main(["--check"]) == 0


def test_every_entry_is_valid():
    assert DATA["entry"], "no entries"
    assert gen.problems(DATA) == []
    for e in DATA["entry"]:
        assert e["status"] in gen.STATUSES
        if e["status"] not in {"exact", "cpu-scale", "partial"}:
            assert e.get("reason", "").strip(), f"{e['paper']} {e['table']}: no reason"


def test_docs_and_sections_exist():
    for e in DATA["entry"]:
        if not e.get("doc"):
            continue
        doc = ROOT / "docs" / "results" / e["doc"]
        assert doc.is_file(), f"{e['paper']} {e['table']}: {e['doc']} is missing"
        if e.get("section"):
            headings = {line.lstrip("#").strip() for line in doc.read_text(encoding="utf-8").splitlines()
                        if line.startswith("#")}
            assert e["section"] in headings, f"{e['paper']} {e['table']}: no heading {e['section']!r} in {e['doc']}"


def test_every_paper_has_entries():
    papers = {e["paper"] for e in DATA["entry"]}
    assert papers == set(DATA["papers"])


def _catalogue():
    if not (RELPOS.is_file() and os.access(RELPOS, os.X_OK)):
        pytest.skip(f"{RELPOS} is not built")
    out = subprocess.run([str(RELPOS), "reproduce", "--list"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    names = set()
    for line in out.splitlines():
        m = re.match(r"^\|\s*([a-z0-9][a-z0-9-]*)\s*\|", line)
        if m and m.group(1) != "experiment":
            names.add(m.group(1))
    assert names, "relpos reproduce --list printed no experiments:\n" + out
    return names


def test_index_matches_the_experiment_catalogue():
    listed = _catalogue()
    named = gen.experiments(DATA)
    unknown = sorted(named - listed)
    missing = sorted(listed - named)
    assert not unknown, f"tables.toml names experiments that `relpos reproduce --list` lacks: {unknown}"
    assert not missing, f"experiments with no row in docs/results/tables.toml: {missing}"
