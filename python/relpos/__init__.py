"""relpos: relative positional encodings for attention, as PyTorch ops and modules.

The operators live in the compiled library ``relpos/_relpos_ops.so`` (``TORCH_LIBRARY(relpos)``):
``torch.ops.relpos.transform`` (CPU kernels, a Meta kernel for ``torch.compile``, an autograd
kernel whose backward is ``torch.ops.relpos.transform_backward``), ``trig_table``, the fused
attention kernel ``torch.ops.relpos.fused_attention`` (same scheme) with :func:`attention` adding a
mechanism's transforms and biases, and the model and diagnostics as JSON (``mechanism``,
``mechanisms``, ``verify``). The C++ ``PositionEncoding`` module and ``relpos::nn::attention`` call
the same ops.

    import torch, relpos
    enc = relpos.PositionEncoding("jordan(m=2, regime=scaled, c=1)", head_dim=64, num_heads=8)
    q, k = enc(torch.randn(1, 8, 128, 64), torch.randn(1, 8, 128, 64))
    x = torch.randn(1, 8, 128, 64)
    out = relpos.attention(x, x, x, "rope + alibi")  # fused causal attention
"""

from __future__ import annotations

import json

import torch

from ._library import LIB as _LIB  # noqa: F401  (loads the operators)
from .attention import attention, fused_attention  # noqa: E402
from .encoding import (  # noqa: E402
    InputError, PositionEncoding, _integer, _spec_text, attention_factor, frequencies,
    rope_parameters_spec, rope_scaling_spec,
)
from .engine import Attention, KVCache  # noqa: E402
from .frames import frame_angles, journey_attention, rotate_pairs  # noqa: E402
from .linear import favor_attention, random_projection  # noqa: E402
from .vector_rotation import cayley_basis, structured_attention, structured_rotate  # noqa: E402

__all__ = [
    "Attention",
    "InputError",
    "KVCache",
    "PositionEncoding",
    "attention",
    "fused_attention",
    "frame_angles",
    "journey_attention",
    "rotate_pairs",
    "cayley_basis",
    "favor_attention",
    "random_projection",
    "structured_attention",
    "structured_rotate",
    "mechanisms",
    "mechanism",
    "rope_scaling_spec",
    "rope_parameters_spec",
    "frequencies",
    "attention_factor",
    "kernel_isa",
    "verify",
]


def kernel_isa() -> str:
    """The CPU kernels' instruction-set build in use: "baseline", "avx2+fma", "avx512",
    "avx512+bf16" (bfloat16 attention products by AVX512-BF16 dot products) or "avx512+amx" (on
    AMX tiles); both round the probabilities to bfloat16 for P V. The best this CPU runs, capped by
    the environment variable RELPOS_KERNEL_ISA (baseline | avx2 | avx512 | avx512bf16 | amx), read
    once per process."""
    return torch.ops.relpos.kernel_isa()


def mechanisms() -> list[dict]:
    """Every mechanism, as ``relpos list --format json`` shows it: name, kind, options with
    defaults and ranges, exactness, paper section, reference aliases."""
    return json.loads(torch.ops.relpos.mechanisms())


def mechanism(spec: str, head_dim: int, num_heads: int) -> dict:
    """The mechanism a spec builds for this head shape: canonical spec, transform terms, bias
    terms, parameter schema with initial values, centre rule. Raises InputError (a ValueError)
    naming the problem for a bad spec."""
    spec, head_dim, num_heads = _spec_text(spec), _integer(head_dim, "head_dim"), _integer(num_heads, "num_heads")
    try:
        return json.loads(torch.ops.relpos.mechanism(spec, head_dim, num_heads))
    except ValueError as e:
        raise InputError(str(e)) from None


def verify(
    spec: str | list[str] | None = None,
    *,
    max_lag: int = 32768,
    dtype: str = "both",
    head_dim: int = 64,
    num_heads: int = 4,
    positions: int = 80,
    seed: int = 1,
    layout: str = "interleaved",
) -> list[dict]:
    """``relpos verify`` from Python: one dict per (spec, parameters, dtype) row with the
    residuals, growth, clamp flags, status (PASS, FAIL, CLAMPED, APPROX, INFO) and reason."""
    specs = [] if spec is None else [spec] if isinstance(spec, str) else list(spec)
    specs = [_spec_text(s) for s in specs]
    ints = {n: _integer(v, n) for n, v in (("max_lag", max_lag), ("head_dim", head_dim),
                                             ("num_heads", num_heads), ("positions", positions),
                                             ("seed", seed))}
    try:
        out = torch.ops.relpos.verify(
            specs, ints["max_lag"], _spec_text(dtype), ints["head_dim"], ints["num_heads"],
            ints["positions"], ints["seed"], _layout_code(layout)
        )
    except ValueError as e:
        raise InputError(str(e)) from None
    return json.loads(out)


def _layout_code(layout: str) -> int:
    if layout in ("interleaved",):
        return 0
    if layout in ("half_split", "neox", "rotate_half"):
        return 1
    raise InputError(f"unknown pair layout '{layout}' (valid: interleaved, half_split)")


if torch.cuda.is_available():
    # The Triton kernels become the CUDA kernels of the relpos ops (relpos/gpu); without a GPU
    # nothing of it, Triton included, is imported.
    from .gpu import register as _register_gpu

    _register_gpu()
