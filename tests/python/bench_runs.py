"""Runs a bench/ script at a toy size, as the tests of the bench scripts do."""

import pathlib
import re
import subprocess
import sys


def bench_rows(script, args, row_pattern, bad_args, bad_option):
    """Runs bench/<script> with `args`: exit 0; returns its output lines matching `row_pattern`.
    `bad_args` must be refused by the parser (exit 2, `bad_option` named)."""
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / script
    r = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    bad = subprocess.run([sys.executable, str(path), *bad_args], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad_option in bad.stderr, bad.stderr
    return [line for line in r.stdout.splitlines() if re.match(row_pattern, line)]
