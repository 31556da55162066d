"""Structured rotations by vector positions (issue 15; "Equivariant Structured Positional
Rotations"): ``y_t = R(r_t) x_t`` with ``R(r) = U [(+)_u R_2(theta_u(r)) (+) I] U^T`` and
``theta_u(r) = sum_k lambda[k, u] r_k``, for positions ``r`` in ``R^dc`` (2-D images, 3-D volumes).

``torch.ops.relpos.structured_rotate(x, basis, freqs, positions, inverse)`` is the CPU kernel
(O(D M) per token, differentiable in x, U and lambda; Meta kernels for ``torch.compile``).
:func:`cayley_basis` gives an orthogonal U from an unconstrained W (``W = 0``: the identity), so a
learned basis trains through ordinary autograd. Queries and keys take the same rotation, so scores
depend on ``r_j - r_i`` only (Theorem 1); :func:`structured_attention` rotates both and runs the
fused kernel, non-causal by default (2-D and 3-D data has no order).
"""

from __future__ import annotations

import torch

from .attention import fused_attention
from .encoding import InputError, _compute_dtype, _flag


def structured_rotate(x: torch.Tensor, basis: torch.Tensor, freqs: torch.Tensor,
                      positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """``R(+-r_t) x_t``. x ``[B, H, T, D]``; basis ``[D, D]`` or ``[H, D, D]`` orthogonal (its
    first 2M columns span the rotation planes); freqs ``[dc, M]`` or ``[H, dc, M]``; positions
    ``[T, dc]`` or ``[B, T, dc]``."""
    for name, t in (("x", x), ("basis", basis), ("freqs", freqs), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"structured_rotate: {name} must be a tensor, got {type(t).__name__}")
    for name, t in (("basis", basis), ("freqs", freqs)):  # (a complex one would lose its imaginary part)
        if not t.is_floating_point():
            raise InputError(f"structured_rotate: {name} must be real floating point, got {t.dtype}")
    # half x: the basis and frequencies in float32, as computed (a basis rounded to half is no
    # longer orthogonal to the check's tolerance)
    dtype = x.dtype if x.device.type == "cuda" else _compute_dtype(x.dtype)
    try:
        return torch.ops.relpos.structured_rotate(x, basis.to(dtype), freqs.to(dtype),
                                                  positions, _flag(inverse, "inverse"))
    except ValueError as e:
        raise InputError(str(e)) from None


def cayley_basis(W: torch.Tensor) -> torch.Tensor:
    """``U = (I - A)^{-1} (I + A)`` with ``A = W - W^T`` (last two dims): orthogonal, det +1."""
    if not isinstance(W, torch.Tensor) or W.dim() < 2 or W.shape[-1] != W.shape[-2]:
        shape = list(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
        raise InputError(f"cayley_basis: W must be square matrices [..., D, D], got {shape}")
    if W.dtype not in (torch.float32, torch.float64):  # (the solve has no half kernels)
        raise InputError(f"cayley_basis: W must be float32 or float64, got {W.dtype}")
    A = W - W.transpose(-1, -2)
    eye = torch.eye(W.shape[-1], dtype=W.dtype, device=W.device).expand_as(A)
    return torch.linalg.solve(eye - A, eye + A)


def structured_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor,
                         freqs: torch.Tensor, positions: torch.Tensor, *,
                         causal: bool = False) -> torch.Tensor:
    """Softmax attention over tokens at vector positions: q and k rotated by ``R(r)``, then the
    fused kernel (``causal`` follows the token order). Returns the output ``[B, H, T, D]``."""
    qr = structured_rotate(q, basis, freqs, positions)
    kr = structured_rotate(k, basis, freqs, positions)
    return fused_attention(qr, kr, v, causal=causal)[0]
