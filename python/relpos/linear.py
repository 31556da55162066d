"""FAVOR+ linear attention with positive (orthogonal) random features (issue 15; structured
rotations paper, section 3): ``phi(x) = exp(w^T x' - |x'|^2 / 2) / sqrt(m)``, ``x' = x D^(-1/4)``,
so that ``phi(q) . phi(k)`` estimates the softmax kernel ``exp(q . k / sqrt(D))`` without bias (the
paper's ``+|x|^2/2`` would be biased by ``exp(|x|^2 + |y|^2)``; tests/core/test_random_features).

``torch.ops.relpos.favor_attention(q, k, v, projection, causal, scale)`` runs the chunked kernel in
time linear in T (causal by prefix sums, exactly causal: stabilised by a running max of the keys),
differentiable in q, k, v, with Meta kernels for ``torch.compile``. Rotate q and k first
(:func:`relpos.structured_rotate`, a RoPE ``PositionEncoding``) to keep a relative law in
expectation.
"""

from __future__ import annotations

import torch

from .encoding import InputError, _flag, _integer, _op, _real


def random_projection(m: int, head_dim: int, *, orthogonal: bool = True, seed: int = 0) -> torch.Tensor:
    """``W [m, head_dim]`` float64: rows N(0, I), or orthogonal blocks with chi-distributed norms."""
    seed = _integer(seed, "seed")
    if seed < 0:  # (as the CLI's --seed)
        raise InputError(f"seed must be >= 0, got {seed}")
    return _op(torch.ops.relpos.random_projection, _integer(m, "m"), _integer(head_dim, "head_dim"),
               _flag(orthogonal, "orthogonal"), seed)


def favor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor, *,
                    causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Linear attention on the random features of q and k with ``projection [m, D]``; returns
    ``[B, H, T, Dv]``. ``scale`` multiplies q and k before the features (default ``D^(-1/4)``)."""
    return _op(torch.ops.relpos.favor_attention, q, k, v, projection, _flag(causal, "causal"),
               0.0 if scale is None else _real(scale, "scale", above=0))
