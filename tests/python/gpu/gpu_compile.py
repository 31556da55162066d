"""Compiles recorded Triton launches for an NVIDIA architecture without a GPU (gpu_testing's
compile check): `python gpu_compile.py SM LAUNCHES.json` prints one line per failure and exits 1
if any kernel does not compile or needs more shared memory than the architecture has. The
attention kernels are compiled at the interpreter's tiles and at the GPU's (device_tiles). Runs in its own process: without TRITON_INTERPRET the kernels are
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


# shared memory a block may use (the opt-in maximum) per architecture
_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}
# the attention kernels whose tiles differ between the interpreter and a GPU (device_tiles' kind)
_TILED = {"_fwd_kernel": False, "_bwd_dq_kernel": "dq", "_bwd_dkdv_kernel": "dkdv"}
# flags that add masks or bias loads (no tile operand, no shared memory): one GPU-tile compile
# stands for every combination of them
_LIGHT = {"CAUSAL", "EXCLUDE_SELF", "WINDOW", "KEY_LEN", "KEY_START", "SEGMENTS", "POS",
          "HAS_LAG", "HAS_SLOPES", "HAS_TOKEN", "HAS_GQ", "HAS_GK"}


def _at_device_tiles(launch):
    """The launch with a GPU's tiles, warps and stages (relpos.gpu.attention.device_tiles) in
    place of the interpreter's small tiles; None for other kernels. A decode launch keeps its
    row tile (sized by the query group)."""
    if launch["module"] != "relpos.gpu.attention" or launch["kernel"] not in _TILED:
        return None
    from relpos.gpu.attention import device_tiles

    kw = launch["kwargs"]
    wide = kw["ACC"]["tl_dtype"] != "fp32" or launch["args"][0]["tensor"] == "float32"
    bm, bn, warps, stages = device_tiles(_TILED[launch["kernel"]], kw["BLOCK_D"]["value"], wide)
    out = json.loads(json.dumps(launch))
    if not kw.get("GROUPED", {}).get("value"):
        out["kwargs"]["BLOCK_M"] = {"value": bm}
    out["kwargs"].update(BLOCK_N={"value": bn}, num_warps={"value": warps},
                         num_stages={"value": stages})
    return out


def _compile(job):
    """One launch compiled (and its shared memory within the architecture's); the failure's
    text, or None."""
    sm, launch = job
    driver.set_active(_Target(int(sm)))
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    what = f"{launch['module']}.{launch['kernel']} {launch['kwargs']}"
    try:
        compiled = kernel.warmup(*[_value(a) for a in launch["args"]], grid=(1,),
                                 **{k: _value(v) for k, v in launch["kwargs"].items()})
    except Exception as e:  # noqa: BLE001 - each failure is reported, then the exit status
        return f"FAILED {what}:\n{''.join(traceback.format_exception_only(e))[-3000:]}"
    shared, limit = compiled.metadata.shared, _SHARED.get(int(sm))
    if limit is not None and shared > limit:
        return f"FAILED {what}: {shared} bytes of shared memory, sm_{sm} has {limit}"
    return None


def main(sm, path):
    launches = json.load(open(path))
    # at the GPU's tiles: one launch per kernel, dtypes and tile-shaping flags
    seen = set()
    for x in list(launches):
        y = _at_device_tiles(x)
        if y is None:
            continue
        key = json.dumps([y["kernel"], y["args"][0], {k: v for k, v in y["kwargs"].items()
                                                      if k not in _LIGHT}], sort_keys=True)
        if key not in seen:
            seen.add(key)
            launches.append(y)
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
