"""What the bench scripts share: the timing loop (every case once per round, in a fresh random
order) and the parsing of a --shape B,H,T,D option.

A call's time depends on what ran just before it: eager code's temporaries leave the caches cold
and the heap's top freed (the next allocation faults fresh pages in), a light case leaves both
warm. A fixed order, or one reversed every other round, puts the same cases after the heavy one
every time and biases them (bench_ops.py measured RoPE's default call 0.80-0.86x its unchecked
twin in an alternating order: the two are the same kernel). A seeded shuffle per round gives every
case the same chance of every predecessor.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time
from typing import Callable, Hashable, Mapping


def stale_install_warning() -> str | None:
    """A warning when the relpos a script imported is older than this checkout: its operator
    library older than the C++ sources or the checkout's build, or an installed package older than
    the checkout's python/relpos (`.venv/bin/python bench/...` imports the installed package:
    after a change, rerun scripts/build.sh and scripts/install-python.sh, or run with
    PYTHONPATH=python RELPOS_OPS_LIBRARY=build/_relpos_ops.so). None when relpos is not imported
    yet (scripts that import it late, after their arguments) or the files cannot be read."""
    relpos = sys.modules.get("relpos")
    if relpos is None:
        return None
    try:
        root = pathlib.Path(__file__).resolve().parent.parent
        lib = pathlib.Path(relpos._LIB).resolve()
        lib_time = lib.stat().st_mtime
        newer = [f for f in sorted((root / "src").rglob("*"))
                 if f.suffix in (".cpp", ".hpp", ".inc") and f.stat().st_mtime > lib_time]
        build = root / "build" / "_relpos_ops.so"
        if build.exists() and build.resolve() != lib and build.stat().st_mtime > lib_time:
            newer.append(build)
        loaded = pathlib.Path(relpos.__file__).resolve().parent
        checkout = root / "python" / "relpos"
        installed = list(loaded.rglob("*.py"))
        if loaded != checkout and installed:
            py_time = min(f.stat().st_mtime for f in installed)
            newer += [f for f in sorted(checkout.rglob("*.py")) if f.stat().st_mtime > py_time]
    except (OSError, AttributeError, ValueError):
        return None
    if not newer:
        return None
    names = ", ".join(str(f.relative_to(root)) for f in newer[:3])
    return (f"warning: relpos imported from {loaded} (library {lib}) is older than {names}"
            f"{f' and {len(newer) - 3} more' if len(newer) > 3 else ''}: these timings are of an "
            "old build (rerun scripts/build.sh and scripts/install-python.sh)")


if (_warning := stale_install_warning()) is not None:
    print(_warning, file=sys.stderr)


def timed_rounds(cases: Mapping[Hashable, Callable[[], object]], rounds: int, *,
                 setup: Mapping[Hashable, Callable[[], object] | None] | None = None,
                 seed: int = 0) -> dict[Hashable, list[float]]:
    """Runs every case once per round, in a fresh seeded random order, for `rounds` rounds; returns
    each case's times in ms, round by round (index r of two cases: the same round). `setup[case]`,
    when given, runs untimed right before the case's call."""
    order = list(cases)
    shuffler = random.Random(seed)
    times: dict[Hashable, list[float]] = {key: [] for key in order}
    for _ in range(rounds):
        shuffler.shuffle(order)
        for key in order:
            prepare = setup.get(key) if setup else None
            if prepare is not None:
                prepare()
            t0 = time.perf_counter()
            cases[key]()
            times[key].append((time.perf_counter() - t0) * 1e3)
    return times


def warm_and_cold(calls: Mapping[str, Callable[[], object]], make_cold: Callable[[], object], *,
                  rounds: int, warmup: int = 3) -> dict[tuple[str, str], float]:
    """Each call timed warm (right after the same call, untimed) and cold (right after
    `make_cold`, untimed: work whose temporaries leave the caches cold), every (call, state) once
    per round in random order after `warmup` untimed runs of each; returns the medians in ms by
    (name, "warm" | "cold")."""
    cases, setup = {}, {}
    for name, f in calls.items():
        for state in ("warm", "cold"):
            cases[(name, state)] = f
            setup[(name, state)] = make_cold if state == "cold" else f
    for f in [*calls.values(), make_cold]:
        for _ in range(warmup):
            f()
    times = timed_rounds(cases, rounds, setup=setup)
    return {key: statistics.median(t) for key, t in times.items()}


def per_round_ratio(num: list[float], den: list[float]) -> float:
    """Median over the rounds of num[r] / den[r]."""
    return statistics.median(x / y for x, y in zip(num, den))


def parse_shape(ap: argparse.ArgumentParser, text: str, multiple: int = 2) -> tuple[int, ...]:
    """B,H,T,D from a --shape value: positive sizes, D a multiple of `multiple` (pairs: 2; blocks
    of two pairs: 4); a bad value is the parser's error (exit 2, the option named)."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1 or shape[3] % multiple:
        ap.error(f"--shape takes B,H,T,D (positive, D a multiple of {multiple}), got {text!r}")
    return shape
