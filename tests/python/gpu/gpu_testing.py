"""What the GPU backend's tests share. With a GPU they call the relpos operators on CUDA tensors
(the Triton kernels registered as their CUDA kernels); without one they call the same Triton
functions on CPU tensors through Triton's interpreter. Either way the expected values are the CPU
operators' (and, where a test says so, the float64 references')."""

import os

import torch

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not CUDA:
    # Triton reads this when a kernel is defined: it must be set before relpos.gpu is imported.
    os.environ["TRITON_INTERPRET"] = "1"

import relpos  # noqa: E402
import relpos.gpu  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _ops():
    if not hasattr(_ops, "table"):
        _ops.table = relpos.gpu.ops()
    return _ops.table


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


def catalog_specs():
    """Every mechanism of the catalogue as a spec; a context-extension rule (kind "scaling") on
    RoPE, with original / L of 16 so that the dynamic rules act at the tests' lengths."""
    specs = []
    for m in relpos.mechanisms():
        if m["kind"] != "scaling":
            specs.append(m["name"])
            continue
        keys = {o["key"] for o in m["options"]}
        opt = "original=16" if "original" in keys else ("L=16" if "L" in keys else "")
        specs.append(f"rope + {m['name']}({opt})")
    return specs


def gpu_call(name, *args):
    """The GPU backend's `name` on `args` (moved to DEVICE): the registered CUDA kernel through
    the dispatcher with a GPU, the Triton function under the interpreter without one."""
    args = _to(args, DEVICE)
    if CUDA:
        return getattr(torch.ops.relpos, name)(*args)
    return _ops()[name](*args)


def cpu_call(name, *args):
    """The CPU operator `name` on CPU copies of `args`: what the GPU backend must match."""
    return getattr(torch.ops.relpos, name)(*_to(args, torch.device("cpu")))



class _TritonOnCPU(torch.utils._python_dispatch.TorchDispatchMode):
    """Without a GPU: every relpos op the GPU backend implements runs its Triton function (in the
    interpreter, on the CPU tensors) in place of the CPU kernel, below autograd as a CUDA kernel
    would; `calls` counts them, so a test can tell the Triton path ran. Inside a handler the mode
    is off, so a Triton function's own calls reach the CPU kernels."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "relpos":
            name = func._schema.name.split("::", 1)[1]
            fn = _ops().get(name)
            if fn is not None:
                self.calls[name] = self.calls.get(name, 0) + 1
                return fn(*args, **kwargs)
        return func(*args, **kwargs)


class _OnCuda:
    """With a GPU: the registered CUDA kernels run for CUDA tensors; nothing to intercept."""

    calls = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def triton_backend():
    """A context in which relpos ops on DEVICE tensors run the GPU backend: on a GPU the CUDA
    dispatch itself, without one a dispatch mode sending them to the Triton functions."""
    return _OnCuda() if CUDA else _TritonOnCPU()


# ---- the compile check: the interpreter runs what a GPU compiler would refuse -------------------
#
# Triton's interpreter executes a kernel's Python directly, so it accepts code the compiler
# rejects (a global that is not constexpr, a construct a backend lacks). With
# RELPOS_TRITON_COMPILE=SM (e.g. 90) and no GPU, every interpreted launch is recorded by its
# specialisation (tensor dtypes, integer classes, constexpr values), and at the end of the session
# gpu_compile.py compiles each for that NVIDIA architecture down to a cubin (ptxas ships with
# Triton) in a fresh process, without a GPU or a driver (conftest.py runs it).
COMPILE_SM = os.environ.get("RELPOS_TRITON_COMPILE", "")
LAUNCHES: dict = {}


def _describe(value, constexpr):
    """What a launch argument contributes to a compiled kernel's specialisation."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if constexpr or value is None or isinstance(value, (bool, str)):
        return {"value": value}
    if isinstance(value, int):  # Triton specialises on == 1, divisibility by 16 and width
        wide = not -(2**31) <= value < 2**31
        return {"int": 1 if value == 1 else (2**33 if wide else (16 if value % 16 == 0 else 17))}
    if isinstance(value, float):
        return {"float": 0.5}
    raise TypeError(f"compile check: cannot describe a launch argument {value!r}")


def _record(interpreted, args, kwargs):
    import inspect

    import triton.language as tl

    fn = interpreted.fn
    params = inspect.signature(fn).parameters
    names = list(params)
    is_const = {n: params[n].annotation is tl.constexpr or params[n].annotation == "tl.constexpr"
                for n in names}
    launch = {
        "module": fn.__module__, "kernel": fn.__name__,
        "args": [_describe(a, is_const[names[i]]) for i, a in enumerate(args)],
        "kwargs": {k: _describe(v, is_const.get(k, True)) for k, v in sorted(kwargs.items())},
    }
    import json

    LAUNCHES[json.dumps(launch, sort_keys=True, default=str)] = launch


if COMPILE_SM and not CUDA:
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted

    _interpreted_run = _Interpreted.run

    def _run_and_record(self, *args, grid, warmup, **kwargs):
        _record(self, args, kwargs)
        return _interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    _Interpreted.run = _run_and_record
