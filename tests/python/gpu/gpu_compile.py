"""Compiles recorded Triton launches for an NVIDIA architecture without a GPU (gpu_testing's
compile check): `python gpu_compile.py SM LAUNCHES.json` prints one line per failure and exits 1
if any kernel does not compile. Runs in its own process: without TRITON_INTERPRET the kernels are
JITFunctions, and a stand-in driver names the target (nothing is launched)."""

import importlib
import json
import multiprocessing
import os
import sys
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends import backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class _Target:
    """The driver calls a compile makes; nothing is launched."""

    def __init__(self, sm):
        self.sm = sm
        self.backend = backends["nvidia"]

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.sm, 32)

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self):
        return torch.device("cpu")


def _value(d):
    if "tensor" in d:
        return torch.empty(4, dtype=getattr(torch, d["tensor"]))
    if "int" in d:
        return d["int"]
    if "float" in d:
        return d["float"]
    if "tl_dtype" in d:
        return tl.dtype(d["tl_dtype"])
    return d["value"]


def _compile(job):
    """One launch compiled; the failure's text, or None."""
    sm, launch = job
    driver.set_active(_Target(int(sm)))
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    try:
        kernel.warmup(*[_value(a) for a in launch["args"]], grid=(1,),
                      **{k: _value(v) for k, v in launch["kwargs"].items()})
        return None
    except Exception as e:  # noqa: BLE001 - each failure is reported, then the exit status
        return (f"FAILED {launch['module']}.{launch['kernel']} {launch['kwargs']}:\n"
                f"{''.join(traceback.format_exception_only(e))[-3000:]}")


def main(sm, path):
    launches = json.load(open(path))
    t0 = time.time()
    # compiles are CPU-bound and independent: one process per core
    with multiprocessing.get_context("spawn").Pool(os.cpu_count() or 1) as pool:
        failures = [f for f in pool.map(_compile, [(sm, x) for x in launches], chunksize=4) if f]
    for f in failures:
        print(f)
    print(f"compile check (sm_{sm}): {len(launches) - len(failures)} of {len(launches)} kernel "
          f"specialisations compiled in {time.time() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
