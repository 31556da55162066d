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
