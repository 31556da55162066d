"""`relpos midi-text` against the spec's tokeniser written with mido (spec pj-rope.md 3.5): random
multi-track MIDI files (tempo changes in any track, running status, note_on of velocity 0,
controls, programs, sysex, other meta events), a metadata CSV with quotes and non-ASCII, and the
reference's selection (Python's random.Random(seed).shuffle, unreadable files skipped). The corpus
text must be byte-identical. Skipped when build/relpos or mido is absent."""
import csv
import os
import random
import re
import subprocess
from pathlib import Path

import pytest

mido = pytest.importorskip("mido")

ROOT = Path(__file__).resolve().parents[2]
RELPOS = ROOT / "build" / "relpos"
pytestmark = pytest.mark.skipif(not RELPOS.exists(), reason="build/relpos not built")


def clean_text(s):
    s = re.sub(r"[^A-Za-z0-9_ .,+:/()-]", "_", s)
    s = re.sub(r"\s+", "_", s)
    return s[:80] or "NA"


def reference_tokens(path, grid_ms, controls, programs, max_events):
    out, pending = [], 0
    for msg in mido.MidiFile(path):
        pending += round(msg.time * 1000 / grid_ms)
        if len(out) >= max_events:
            break
        d = min(max(pending, 0), 999)
        if msg.type == "note_on" and msg.velocity > 0:
            t = f"d{d:03d}.on{msg.note:03d}.v{msg.velocity:03d}.c{msg.channel}"
        elif msg.type in ("note_off", "note_on"):
            t = f"d{d:03d}.off{msg.note:03d}.c{msg.channel}"
        elif msg.type == "control_change" and controls:
            t = f"d{d:03d}.cc{msg.control:03d}.v{msg.value:03d}.c{msg.channel}"
        elif msg.type == "program_change" and programs:
            t = f"d{d:03d}.pg{msg.program:03d}.c{msg.channel}"
        else:
            continue
        out.append(t)
        pending = 0
    return out


def reference_lines(root, seed, max_files, **tok):
    files = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/")
            m = re.search(r"(?:^|/)(\d+)[^/]*\.midi?$", rel, re.I)
            if m:
                files[m.group(1)] = rel
    with open(root / "musicnet_metadata.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    candidates = [r for r in rows if r["id"] in files]
    random.Random(seed).shuffle(candidates)
    lines = []
    for r in candidates:
        if len(lines) >= max_files:
            break
        try:
            toks = reference_tokens(root / files[r["id"]], **tok)
        except Exception:  # mido refuses the file: the reference skips it
            continue
        lines.append(
            f"PIECE={len(lines):04d}|ID={clean_text(r['id'])}|SEC={float(r['seconds']):.2f}"
            f"|COMP={clean_text(r['composer'])}|ENS={clean_text(r['ensemble'])}"
            f"|WORK={clean_text(r['composition'])}|MOVE={clean_text(r['movement'])}| "
            + " ".join(toks))
    return lines


def random_midi(rng, path):
    mid = mido.MidiFile(type=1, ticks_per_beat=rng.choice([96, 384, 480, 1000]))
    for k in range(rng.randint(1, 4)):
        track = mido.MidiTrack()
        for _ in range(rng.randint(0, 60)):
            dt = rng.choice([0, 0, 1, 7, 48, 96, 240, 480, 5000, 200000])
            kind = rng.random()
            ch = rng.randrange(16)
            if kind < 0.35:
                msg = mido.Message("note_on", note=rng.randrange(128),
                                   velocity=rng.choice([0, 1, 64, 127]), channel=ch, time=dt)
            elif kind < 0.55:
                msg = mido.Message("note_off", note=rng.randrange(128), channel=ch, time=dt)
            elif kind < 0.65:
                msg = mido.Message("control_change", control=rng.randrange(128),
                                   value=rng.randrange(128), channel=ch, time=dt)
            elif kind < 0.72:
                msg = mido.Message("program_change", program=rng.randrange(128), channel=ch,
                                   time=dt)
            elif kind < 0.82:
                msg = mido.MetaMessage("set_tempo", tempo=rng.choice([1, 250000, 500000, 833333]),
                                       time=dt)
            elif kind < 0.88:
                msg = mido.Message("pitchwheel", pitch=rng.randrange(-8192, 8192), channel=ch,
                                   time=dt)
            elif kind < 0.94:
                msg = mido.Message("sysex", data=[1, 2, 3], time=dt)
            else:
                msg = mido.MetaMessage("marker", text="m", time=dt)
            track.append(msg)
        mid.tracks.append(track)
    mid.save(path)


@pytest.mark.parametrize("seed,controls,programs,max_events,grid_ms",
                         [(29, False, True, 20000, 20), (37, True, False, 25, 20),
                          (3, True, True, 20000, 7)])
def test_corpus_is_the_mido_reference(tmp_path, seed, controls, programs, max_events, grid_ms):
    rng = random.Random(seed * 1000 + grid_ms)
    root = tmp_path / "musicnet"
    root.mkdir()
    with open(root / "musicnet_metadata.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, quoting=csv.QUOTE_NONNUMERIC)
        w.writerow(["id", "composer", "composition", "movement", "ensemble", "seconds"])
        for i in range(1, 13):
            w.writerow([i, rng.choice(["Dvořák", "Bach", "Fauré  \t x"]),
                        f'Suite "No {i}", K.{i}/{i}' + "&" * (i % 2), "1. Allegro" * (i % 5),
                        "String Quartet", rng.choice([61, 7.5, 1234.567])])
    for i in range(1, 13):
        if i == 5:
            continue  # a metadata row without a file
        folder = root / rng.choice(["Bach", "Haydn"])
        folder.mkdir(exist_ok=True)
        path = folder / f"{i}_piece.mid"
        if i == 7:
            path.write_bytes(b"MThd\x00\x00")  # unreadable: skipped by both
        else:
            random_midi(rng, path)
    want = reference_lines(root, seed, 8, grid_ms=grid_ms, controls=controls, programs=programs,
                           max_events=max_events)
    out = tmp_path / "corpus.txt"
    args = [str(RELPOS), "midi-text", str(root), "--out", str(out), "--seed", str(seed),
            "--max-files", "8", "--max-events", str(max_events), "--grid-ms", str(grid_ms)]
    args += ["--controls"] if controls else []
    args += [] if programs else ["--no-programs"]
    subprocess.run(args, check=True, capture_output=True)
    text = out.read_text(encoding="utf-8")
    header, body = text.split("\n\n", 1)
    assert header.startswith("# musicnet_reference_midi\n")
    assert body.splitlines() == want
    assert len(want) == 8


def test_refuses_to_overwrite_a_foreign_file(tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("my notes\n")
    r = subprocess.run([str(RELPOS), "midi-text", str(tmp_path), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "not overwriting" in r.stderr
    assert out.read_text() == "my notes\n"
