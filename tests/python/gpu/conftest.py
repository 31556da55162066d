# Imported first so that TRITON_INTERPRET is set (without a GPU) before any test imports Triton.
import json
import os
import subprocess
import sys
import tempfile

import gpu_testing


def pytest_sessionfinish(session, exitstatus):
    """The compile check (gpu_testing): every interpreted launch of the session compiled for a GPU
    architecture in a fresh process; a kernel that does not compile fails the session."""
    if not gpu_testing.COMPILE_SM or gpu_testing.CUDA or not gpu_testing.LAUNCHES:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(list(gpu_testing.LAUNCHES.values()), f)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "gpu_compile.py"),
                        gpu_testing.COMPILE_SM, f.name], env=env, capture_output=True, text=True)
    os.unlink(f.name)
    sys.stdout.write("\n" + r.stdout[-20000:] + r.stderr[-5000:])
    if r.returncode:
        session.exitstatus = 1
