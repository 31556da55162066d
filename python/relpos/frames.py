"""JoFormer's journey transform from Python (core/mechanisms/journey.cpp, torch/journey.hpp).

``torch.ops.relpos.rotate_pairs(x, cos, sin, inverse, layout)`` rotates every coordinate pair of
``x [B, H, T, D]`` by per-token angles given as their cosines and sines ``[B, T, P]`` or ``[T, P]``
(differentiable in all three; Meta kernels for ``torch.compile``). :func:`journey_attention`
rotates q, k and v into their frames, runs the fused kernel and rotates the output back:
``o_i = sum_j alpha_ij R(theta_j - theta_i) v_j``. Frames are fixed (``journey``,
``journey(angles=integer)``: theta = p f) or per token (``journey(angles=token)``): the causal scan
``Phi_t = sum_{s<t} a_s`` of the angle increments a you pass (the rows of your angle table for
each token). :func:`relpos.attention` routes journey mechanisms here.
"""

from __future__ import annotations

import inspect
import math

import torch

from .encoding import InputError, _flag, _integer, _spec_text

_INFO: dict = {}


@torch.compiler.assume_constant_result  # a function of the spec and head shape only
def _journey_info(spec: str, head_dim: int, heads: int):
    """(frame frequencies, per_token, values, outputs, scan) of the spec's journey term, or None."""
    spec, head_dim, heads = _spec_text(spec), _integer(head_dim, "head_dim"), _integer(heads, "heads")
    key = (spec, head_dim, heads)
    if key not in _INFO:
        from . import mechanism  # late: the package imports this module

        info = None
        transforms = mechanism(spec, head_dim, heads)["transforms"]
        for t in transforms:
            if "frame_frequencies" in t:
                info = (tuple(t["frame_frequencies"]), t["time"] == "content_phase", t["values"],
                        t["outputs"], t["scan"])
        if info is not None and len(transforms) != 1:
            # as the C++ journey_term: the frames would be applied and the other maps dropped
            raise InputError(f"{spec}: a journey term composes with bias terms only (not with other transforms)")
        if info is not None and mechanism(spec, head_dim, heads)["rope_scaling"]:
            # as the C++ journey_term: the frames would ignore the rule (or its attention factor)
            raise InputError(f"{spec}: context-extension rules are not implemented for journey "
                             "frames yet")
        _INFO[key] = info
    return _INFO[key]


def rotate_pairs(x: torch.Tensor, angles: torch.Tensor | None = None, *,
                 cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                 inverse: bool = False, pair_layout: str = "interleaved") -> torch.Tensor:
    """Rotates pair p of every head vector by ``angles[..., t, p]`` (``-angles`` when inverse).

    Instead of the angles, their cosines and sines may be given (``cos=``, ``sin=``, both
    ``[B, T, P]`` or ``[T, P]``): a table computed once for fixed frames, as models cache RoPE's.
    They are taken as given (gradients flow to each), so they must be the cosines and sines of
    the same angles for the map to be a rotation."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"rotate_pairs: x must be a tensor, got {type(x).__name__}")
    layout = {"interleaved": 0, "half_split": 1}.get(pair_layout)
    if layout is None:
        raise InputError(f"pair_layout must be interleaved or half_split, got {pair_layout!r}")
    table = cos is not None or sin is not None
    if table == (angles is not None):
        raise InputError("rotate_pairs: pass either angles or cos= and sin=, not both")
    if table and not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        raise InputError("rotate_pairs: cos= and sin= must both be tensors")
    if not table and not isinstance(angles, torch.Tensor):
        raise InputError(f"rotate_pairs: angles must be a tensor, got {type(angles).__name__}")
    if not table and (angles.is_complex() or angles.dtype == torch.bool):
        raise InputError(f"rotate_pairs: angles must be real numbers, got {angles.dtype}")
    try:
        if not table:
            # angles of half tensors stay float32: in bfloat16 an angle of 100 rad is off by 0.25
            a = angles.to(torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype)
            cos, sin = torch.ops.relpos.cos_sin(a)
        return torch.ops.relpos.rotate_pairs(x, cos, sin, _flag(inverse, "inverse"), layout)
    except ValueError as e:
        raise InputError(str(e)) from None


def frame_angles(spec: str, head_dim: int, heads: int, *, positions: torch.Tensor | None = None,
                 increments: torch.Tensor | None = None, length: int | None = None) -> torch.Tensor:
    """The frames of a journey mechanism: positions ``[T]`` times its frequencies (reduced mod
    2 pi in float64), or the causal scan of per-token ``increments [B, T, D/2]``."""
    info = _journey_info(spec, head_dim, heads)
    if info is None:
        raise InputError(f"{spec!r} has no journey term")
    freqs, per_token, _, _, scan = info
    if per_token:
        P = len(freqs)
        if positions is not None:  # (the scan's angles do not depend on them)
            raise InputError(f"{spec!r} has per-token angles: they come from the increments, "
                             "not positions")
        if increments is None:
            raise InputError(f"{spec!r} has per-token angles: pass increments [B, T, {P}]")
        # one increment per rotated pair: a narrower table would leave pairs unrotated
        if not isinstance(increments, torch.Tensor) or increments.dim() != 3 or increments.shape[-1] != P:
            got = list(increments.shape) if isinstance(increments, torch.Tensor) else type(increments).__name__
            raise InputError(f"journey: angle increments must be [B, T, {P}], got {got}")
        try:
            return torch.ops.relpos.causal_scan(increments, scan)
        except ValueError as e:
            raise InputError(str(e)) from None
    if increments is not None:
        raise InputError(f"{spec!r} has fixed frames (angle = position x frequency): increments "
                         "are for journey(angles=token)")
    if positions is not None and length is not None:
        raise InputError("frame_angles: pass positions or length, not both")
    if positions is None:
        if length is None:
            raise InputError("frame_angles: pass positions or length")
        n = _integer(length, "length")
        if n < 0:
            raise InputError(f"frame_angles: length must be >= 0, got {n}")
        positions = torch.arange(n, dtype=torch.float64)
    elif not isinstance(positions, torch.Tensor):
        raise InputError(f"positions must be a tensor, got {type(positions).__name__}")
    else:
        if positions.dim() not in (1, 2):
            raise InputError(f"frame_angles: positions must be [T] or [B, T], got "
                             f"{list(positions.shape)}")
        try:  # real, finite, within +-2^53 (the PositionEncoding checks)
            rows = positions.shape[0] if positions.dim() == 2 else 1
            positions = torch.ops.relpos.encoding_positions(positions, rows, positions.shape[-1])
        except ValueError as e:
            raise InputError(str(e)) from None
    f = torch.tensor(freqs, dtype=torch.float64)
    return torch.remainder(positions.unsqueeze(-1) * f, 2 * math.pi)


def journey_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mechanism: str, *,
                      increments: torch.Tensor | None = None, pair_layout: str = "interleaved",
                      **kwargs) -> torch.Tensor:
    """Causal journey attention over one sequence (queries and keys at 0..T-1): q, k, v
    ``[B, H, T, D]``; ``increments [B, T, D/2]`` for per-token angles. The spec's bias terms apply
    as in :func:`relpos.attention` (ALiBi's slopes, a learned lag table at its initial values; a
    per-token bias needs its ``cq`` / ``ck``). Other keyword arguments go to
    :func:`relpos.fused_attention` (masks, scale, biases of your own)."""
    return _journey(q, k, v, mechanism, increments, pair_layout, None, kwargs)[0]


def _journey(q, k, v, mechanism: str, increments, pair_layout: str, encoding, kwargs: dict):
    """journey_attention's (out, lse); ``encoding``: a PositionEncoding whose learned lag table
    the call uses (relpos.attention), else the spec's initial table."""
    from .attention import (_alibi_slopes, _check_biases, _fixed_encoding, _learned_lag_table,
                            fused_attention)

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"journey_attention: {name} must be [B, H, T, D], got {got}")
    # the frames are built at 0..T-1: positions given for the mask alone would disagree with them
    positional = sorted({"q_positions", "k_positions"} & kwargs.keys())
    if positional:
        raise InputError(f"journey_attention scores one sequence at positions 0..T-1 and cannot "
                         f"honour {', '.join(positional)}")
    unknown = sorted(kwargs.keys() - inspect.signature(fused_attention).parameters.keys())
    if unknown:
        raise InputError(f"journey_attention: unknown keyword arguments {', '.join(unknown)}")
    B, H, T, D = q.shape
    if k.shape[2] != T:
        raise InputError("journey_attention scores one sequence: q and k need the same length")
    Hk = k.shape[1]
    info = _journey_info(mechanism, D, Hk)
    if info is None:
        raise InputError(f"{mechanism!r} has no journey term: call relpos.attention for it")
    _, _, values, outputs, scan = info
    if scan != "exclusive" and kwargs.get("causal", True):
        raise InputError(f"{mechanism!r}: the reversed inclusive scan reads later tokens (the "
                         "reference code's leak); causal journey attention runs the exclusive scan")
    # the spec's bias terms, as relpos.attention applies them (never dropped)
    spec = _spec_text(mechanism)
    learned = _check_biases(spec, D, H, cq=kwargs.get("cq"), ck=kwargs.get("ck"),
                            lag_table=None if encoding is not None else kwargs.get("lag_table"))
    slopes = _alibi_slopes(spec, D, H)
    if slopes is not None:
        s = torch.tensor(slopes, dtype=q.dtype)
        kwargs = dict(kwargs, slopes=s if kwargs.get("slopes") is None else kwargs["slopes"] + s)
    if learned:
        enc = encoding if encoding is not None else _fixed_encoding(spec, D, Hk, pair_layout,
                                                                    q.dtype)
        pos = torch.arange(T, dtype=torch.float64)
        kwargs = dict(kwargs, lag_table=_learned_lag_table(enc, pos, pos, H, Hk, q.dtype))
    theta = frame_angles(mechanism, D, Hk, increments=increments, length=T)
    qt = rotate_pairs(q, theta, pair_layout=pair_layout)
    kt = rotate_pairs(k, theta, pair_layout=pair_layout)
    vt = rotate_pairs(v, theta, pair_layout=pair_layout) if values else v
    out, lse = fused_attention(qt, kt, vt, **kwargs)
    if outputs:
        out = rotate_pairs(out, theta, inverse=True, pair_layout=pair_layout)
    return out, lse
