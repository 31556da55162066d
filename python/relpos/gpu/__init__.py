"""The GPU backend: Triton kernels registered as the CUDA kernels of the relpos operators.

``relpos`` imports this package only when ``torch.cuda.is_available()``; on a CPU-only machine
nothing here (Triton included) is imported. Each module below exports ``OPS``, a dict from an
operator name of ``TORCH_LIBRARY(relpos)`` to a Python function with that operator's schema;
:func:`register` makes them the operators' CUDA kernels, so autograd (the C++ Autograd kernels),
``torch.compile`` (the Meta kernels) and every module see one operator on every device.

The functions run on CPU tensors too under Triton's interpreter (``TRITON_INTERPRET=1``), which
is how CI checks them without a GPU (``tests/python/gpu``).
"""

from __future__ import annotations

import importlib

import torch

_MODULES = ("attention", "transform", "rotations")
_LIBRARY: list[torch.library.Library] = []  # keeps the registration alive


def ops() -> dict:
    """Every operator the GPU backend implements: name -> function with the operator's schema."""
    table = {}
    for name in _MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for op, fn in module.OPS.items():
            if op in table:
                raise RuntimeError(f"relpos.gpu: {op} is implemented twice")
            table[op] = fn
    return table


def register(dispatch_key: str = "CUDA") -> None:
    """Registers the Triton implementations as the ``dispatch_key`` kernels of the relpos ops
    (once per key)."""
    if any(getattr(lib, "_relpos_key", None) == dispatch_key for lib in _LIBRARY):
        return
    lib = torch.library.Library("relpos", "IMPL")
    for op, fn in ops().items():
        lib.impl(op, fn, dispatch_key)
    lib._relpos_key = dispatch_key
    _LIBRARY.append(lib)
