"""Attention through the fused CPU kernel, with a mechanism's transforms and biases.

``torch.ops.relpos.fused_attention`` is the kernel (forward + an autograd kernel whose backward is
``fused_attention_backward``, Meta kernels for ``torch.compile``); :func:`attention` adds a
mechanism: its transforms (a :class:`PositionEncoding`, so learnable parameters train) on q and k,
its biases (ALiBi slopes) handed to the kernel. The C++ ``relpos::nn::attention`` does the same.
"""

from __future__ import annotations

import functools

import torch

from .encoding import (_HALF, _LAYOUTS, _STORABLE, InputError, PositionEncoding, _all_finite,
                       _compute_dtype, _raise_wrong_type, _tensors_or_none)
from .frames import _journey, _journey_info

# the names of the kernel's bias slots, in the order of the op's ``biases`` list
_BIAS_SLOTS = tuple(torch.ops.relpos.attention_bias_slots())


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    causal: bool = True,
    window: float = 0.0,
    key_len: torch.Tensor | None = None,
    scale: float | None = None,
    lag_table: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
    cq: torch.Tensor | None = None,
    ck: torch.Tensor | None = None,
    gq: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    path_q: torch.Tensor | None = None,
    path_k: torch.Tensor | None = None,
    path_beta: torch.Tensor | None = None,
    path_scale: float = 1.0,
    key_start: torch.Tensor | None = None,
    q_segments: torch.Tensor | None = None,
    k_segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused softmax attention; returns ``(out, lse)``.

    q ``[B, Hq, Tq, D]``, k and v ``[B, Hk, Tk, D]`` (Hk divides Hq: grouped-query attention),
    float32, float64, bfloat16 or float16 on the CPU (half storage: computed in float32, the output
    in q's dtype and ``lse`` float32; docs/engine.md, "Half precision"). Positions ``[T]`` or ``[B, T]`` (float64 keeps them exact;
    default: queries are the last Tq of the Tk key positions). Key j is visible to query i when
    ``key_start[b] <= j < key_len[b]`` (left and right padding, int ``[B]``), ``p_j <= p_i``
    (causal), ``p_i - p_j < window`` (window > 0) and, for packed sequences,
    ``k_segments[b, j] == q_segments[b, i]`` (document ids ``[B, Tk]`` and ``[B, Tq]``, each
    document one contiguous run of a row: biases then never cross a document boundary).
    Biases, all optional and summed: ``lag_table [Hq, L]`` indexed by the rounded lag (clamped to
    the table), ``- slopes[h] (p_i - p_j)``, and ``cq[b,h,i] - ck[b,h,j]`` (FoX / GRAPE-A gates;
    pass float64 cumulative sums: the kernel subtracts them in float64), GRAPE's gated slopes
    ``- (p_i - p_j) (gq[b,h,i] + gk[b,h,j])`` (``[B, Hq, Tq]``, ``[B, Hq, Tk]``, either optional)
    and path integrals ``sum_{l=j+1..slot(i)} path_beta[h] logsigmoid(path_scale path_q[b,h,i] .
    path_k[b,h,l])`` (probes ``[B, Hq, T, P]``, slot(i) = Tk - Tq + i; default positions). A row
    with no visible key gives zeros. Differentiable in q, k, v and every bias tensor; ``lse`` is
    differentiable too (a loss term on it reaches q, k and the biases).

    Layout (CPU): v and the output's gradient are read where they lie when their last dimension
    is contiguous (a layer's ``proj(x).view(B, T, H, D).transpose(1, 2)``, no copy); ``out`` is
    stored token-major (``[B, Tq, Hq, D]`` memory seen as ``[B, Hq, Tq, D]``), so
    ``out.transpose(1, 2).reshape(B, Tq, Hq * D)`` is a view (use ``reshape``, not ``view``, on
    ``out`` itself), and so is v's gradient beside such a v.

    Values are not checked: NaN in q, in a visible key or value, or in a visible pair's bias makes
    that row NaN, and a NaN or Inf that the mask hides changes nothing (docs/errors.md).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a tensor, got {type(t).__name__}")
    given = {"lag_table": lag_table, "slopes": slopes, "cq": cq, "ck": ck, "gq": gq, "gk": gk,
             "path_q": path_q, "path_k": path_k, "path_beta": path_beta}
    try:
        return torch.ops.relpos.fused_attention(
            q, k, v, [given[name] for name in _BIAS_SLOTS], q_positions, k_positions, causal,
            float(window), key_len, 0.0 if scale is None else float(scale), False,
            float(path_scale), key_start, q_segments, k_segments,
        )
    except ValueError as e:
        raise InputError(str(e)) from None
    except RuntimeError as e:
        _raise_wrong_type(e, dict(given, q_positions=q_positions, k_positions=k_positions,
                                  key_len=key_len, key_start=key_start, q_segments=q_segments,
                                  k_segments=k_segments))
        raise


@functools.lru_cache(maxsize=64)
def _fixed_encoding(spec: str, head_dim: int, heads: int, pair_layout: str, dtype) -> PositionEncoding:
    """A mechanism with its initial parameters, frozen (a spec string names a fixed mechanism), in
    the inputs' dtype so that float64 calls keep float64 parameters."""
    enc = PositionEncoding(spec, head_dim, heads, pair_layout=pair_layout, check_finite=False)
    enc.requires_grad_(False)
    return enc.to(dtype)


_SLOPES: dict = {}  # (spec, head_dim, heads) -> ALiBi slopes or None
_BIASES: dict = {}  # (spec, head_dim, heads) -> ((name, shape, has slopes), ...)


def _biases(spec: str, head_dim: int, heads: int) -> tuple:
    key = (spec, head_dim, heads)
    if key not in _BIASES:
        from . import mechanism  # late: the package imports this module

        _BIASES[key] = tuple(
            (b["name"], b["shape"], bool(b["slopes"]))
            for b in mechanism(spec, head_dim, heads)["biases"]
        )
    return _BIASES[key]


@torch.compiler.assume_constant_result  # a function of the spec and head count only
def _alibi_slopes(spec: str, head_dim: int, heads: int):
    key = (spec, head_dim, heads)
    if key not in _SLOPES:
        from . import mechanism  # late: the package imports this module

        # the slope form of a lag bias (ALiBi), as the C++ Mechanism::alibi()
        biases = [b for b in mechanism(spec, head_dim, heads)["biases"]
                  if b["shape"] == "lag_table" and b["slopes"]]
        _SLOPES[key] = tuple(biases[0]["slopes"]) if biases else None
    return _SLOPES[key]


# what a content-dependent bias needs from the caller, by its shape
_NEEDS = {
    "separable": "the per-token gates' cumulative sums cq and ck",
    "gated_slope": "the per-token gates gq and gk (relpos.fused_attention)",
    "path_integral": "the probes path_q, path_k and path_beta (relpos.fused_attention)",
}


def _check_biases(spec: str, head_dim: int, heads: int, *, cq, ck, lag_table):
    """Refuses a mechanism whose bias terms this call cannot apply (InputError naming the missing
    inputs): attention applies slope-form lag biases (ALiBi) and learned lag tables (the
    initial table of a spec string, a PositionEncoding's own table) itself, and a
    per-token (FoX / GRAPE-A) bias only when its cq and ck are given; silently leaving a bias out
    would be plain attention under the mechanism's name.
    Returns whether the mechanism has a learned lag table."""
    learned = False
    for name, shape, slopes in _biases(spec, head_dim, heads):
        if shape == "lag_table" and slopes:
            continue  # ALiBi's slopes: handed to the kernel below
        if shape == "lag_table":
            if lag_table is not None:
                raise InputError(
                    f"{spec!r}: an explicit lag_table together with the mechanism's own learned "
                    f"table ({name!r}) is not supported; add them into one table"
                )
            learned = True
            continue
        if shape == "separable" and cq is not None and ck is not None:
            continue  # the caller supplies the gates
        raise InputError(
            f"{spec!r}: bias {name!r} ({shape.replace('_', '-')}) is computed from the tokens and "
            f"needs {_NEEDS.get(shape, 'inputs this call does not take')}; attention() would "
            "otherwise compute plain attention. Compute them with the model (e.g. the C++ "
            "nn::GrapeAttention) and call relpos.fused_attention"
        )
    return learned


def _learned_lag_table(enc, qpos, kpos, Hq, Hk, dtype):
    """The encoding's learned lag table over every lag of the call (differentiable in its
    parameters), bounded as the C++ nn::attention bounds it."""
    if Hq != enc.bias_heads:
        raise InputError(
            f"{enc.spec!r} has a learned lag table of {enc.bias_heads} rows, one per query head; "
            f"q has {Hq} heads (an encoding for {Hk} key/value heads takes bias_heads={Hq})"
        )
    if qpos.numel() == 0 or kpos.numel() == 0:
        return None
    return enc.attention_lag_table(float(qpos.max() - kpos.min())).to(dtype)


def _transform_qk(enc: PositionEncoding, q, k, q_positions, k_positions, checked: bool = False):
    """The encoding's transforms on q ``[B, Hq, Tq, D]`` and k ``[B, Hk, Tk, D]`` at their
    positions (default: the kernel's, queries the last Tq of 0..Tk-1), every query head through
    its key/value head's map; returns ``(q~, k~, q_positions, k_positions, slopes)`` with the
    positions as float64 and the mechanism's ALiBi slopes for the Hq query heads (or None).
    Shared by :func:`attention` and :class:`relpos.Attention` (``checked``: the positions are a
    decode cache's, checked float64 already)."""
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    if enc.num_heads != Hk:
        raise InputError(
            f"the encoding has {enc.num_heads} heads; it must have the key/value heads ({Hk})"
        )
    if enc.tensor_layout != "BHTD":
        raise InputError("attention takes [B, H, T, D] tensors: build the encoding with tensor_layout='BHTD'")
    if Hq % Hk:
        raise InputError(f"key/value heads ({Hk}) must divide query heads ({Hq})")
    # the kernel's default positions, made explicit: transforms and visibility see one set
    # one transform call when queries and keys share heads and positions (decided from the
    # arguments, not the values, so that it traces under torch.compile)
    g = Hq // Hk
    shared = g == 1 and Tq == Tk and (
        (q_positions is None and k_positions is None) or q_positions is k_positions
    )
    def as_float64(p, T, name):
        # real, finite, within +-2^53 (int64 checked before its conversion), [T] or [B, T]: the
        # encoding's checks, before float64 could round a bool, complex or huge position away
        if checked or torch.compiler.is_compiling():
            return p.to(torch.float64)
        try:
            return torch.ops.relpos.encoding_positions(p, B, T)
        except ValueError as e:
            raise InputError(str(e) if name == "positions" else f"{name}: {e}") from None

    qpos = (torch.arange(Tk - Tq, Tk, dtype=torch.float64) if q_positions is None
            else as_float64(q_positions, Tq, "positions" if shared else "q_positions"))
    kpos = qpos if shared else (
        torch.arange(Tk, dtype=torch.float64) if k_positions is None
        else as_float64(k_positions, Tk, "k_positions")
    )
    if shared and checked:
        q, k = enc._encode(q, k, qpos, checked=True)
    elif shared:
        q, k = enc(q, k, qpos)
    else:
        # queries grouped onto their key/value head and keys in one call: one centre for both
        per_batch = qpos.dim() == 2 or kpos.dim() == 2
        qr = qpos.expand(B, Tq) if per_batch and qpos.dim() == 1 else qpos
        kr = kpos.expand(B, Tk) if per_batch and kpos.dim() == 1 else kpos
        both = torch.cat([q.reshape(B, Hk, g * Tq, D), k], 2)
        pos = torch.cat([qr.repeat(1, g) if per_batch else qr.repeat(g), kr], -1)
        tq, tk = enc._encode(both, both, pos, checked=True) if checked else enc(both, both, pos)
        q, k = tq[:, :, : g * Tq].reshape(B, Hq, Tq, D), tk[:, :, g * Tq :]
    s = _alibi_slopes(enc.spec, D, Hq)
    # float32 beside half storage on the CPU (the GPU's half kernels take the storage dtype)
    dtype = q.dtype if q.device.type == "cuda" else _compute_dtype(q.dtype)
    return q, k, qpos, kpos, (None if s is None else torch.tensor(s, dtype=dtype))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mechanism: str | PositionEncoding | None = None,
    *,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    causal: bool = True,
    window: float = 0.0,
    key_len: torch.Tensor | None = None,
    scale: float | None = None,
    lag_table: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
    cq: torch.Tensor | None = None,
    ck: torch.Tensor | None = None,
    pair_layout: str | None = None,
    return_lse: bool = False,
    check_finite: bool = True,
    key_start: torch.Tensor | None = None,
    q_segments: torch.Tensor | None = None,
    k_segments: torch.Tensor | None = None,
    tensor_layout: str = "BHTD",
):
    """Attention with a mechanism: ``mechanism`` is a spec string (its initial parameters, frozen),
    a :class:`PositionEncoding` built for the key/value heads (its parameters train), or None
    (no position encoding). Other arguments as :func:`fused_attention`. With grouped-query
    attention every query head uses the transform of its key/value head (the relative law needs one
    map per scored pair). ``tensor_layout="BTHD"`` takes q, k, v ``[B, T, H, D]`` (HF's and
    flash-attention's layout) and returns ``out`` in it. ``pair_layout``: a spec string's pairs
    (default interleaved); a PositionEncoding has its own (a different one is an error). Returns
    ``out`` (and ``lse [B, H, T]`` with ``return_lse``).
    """
    if tensor_layout not in ("BHTD", "BTHD"):
        raise InputError(f"unknown tensor layout '{tensor_layout}' (valid: BHTD, BTHD)")
    if pair_layout is not None and pair_layout not in _LAYOUTS:
        raise InputError(f"unknown pair layout '{pair_layout}' (valid: {', '.join(_LAYOUTS)})")
    if isinstance(mechanism, PositionEncoding):
        # the encoding's own layout: another one asked for here would be ignored
        if pair_layout is not None and _LAYOUTS[pair_layout] != mechanism.layout:
            raise InputError(f"pair_layout {pair_layout!r} differs from the encoding's (built with "
                             f"{'half_split' if mechanism.layout else 'interleaved'}); omit it")
        pair_layout = "half_split" if mechanism.layout else "interleaved"
    elif pair_layout is None:
        pair_layout = "interleaved"
    if tensor_layout == "BTHD":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"{name} must be a [B, T, H, D] tensor, got {shape}")
        if isinstance(mechanism, PositionEncoding) and mechanism.tensor_layout != "BHTD":
            raise InputError("attention transposes BTHD inputs itself: build the encoding with "
                             "tensor_layout='BHTD'")
        res = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mechanism,
                        q_positions=q_positions, k_positions=k_positions, causal=causal,
                        window=window, key_len=key_len, scale=scale, lag_table=lag_table,
                        slopes=slopes, cq=cq, ck=ck, pair_layout=pair_layout,
                        return_lse=return_lse, check_finite=check_finite, key_start=key_start,
                        q_segments=q_segments, k_segments=k_segments)
        return (res[0].transpose(1, 2), res[1]) if return_lse else res.transpose(1, 2)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{name} must be a [B, H, T, D] tensor, got {shape}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _STORABLE:
            raise InputError(f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")
    _tensors_or_none(q_positions=q_positions, k_positions=k_positions, key_len=key_len,
                     lag_table=lag_table, slopes=slopes, cq=cq, ck=ck, key_start=key_start,
                     q_segments=q_segments, k_segments=k_segments)
    if q.dtype in _HALF and k.dtype == q.dtype and v.dtype == q.dtype and q.device.type != "cuda":
        # half storage on the CPU: the mechanism and the kernel compute in float32 copies, the
        # output is stored back (the GPU kernels read half tiles as stored, fp32 math)
        def up(t):
            return t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALF else t
        res = attention(q.float(), k.float(), v.float(), mechanism, q_positions=q_positions,
                        k_positions=k_positions, causal=causal, window=window, key_len=key_len,
                        scale=scale, lag_table=up(lag_table), slopes=up(slopes), cq=cq, ck=ck,
                        pair_layout=pair_layout, return_lse=return_lse, check_finite=check_finite,
                        key_start=key_start, q_segments=q_segments, k_segments=k_segments)
        return (res[0].to(q.dtype), res[1]) if return_lse else res.to(q.dtype)
    # meta and fake tensors (tracing) have no values to check
    if check_finite and not torch.compiler.is_compiling():
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.device.type != "meta" and not _all_finite(t):
                raise InputError(f"{name} contains NaN or Inf")
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    if mechanism is not None and not isinstance(mechanism, (str, PositionEncoding)):
        raise InputError("mechanism must be a spec string, a PositionEncoding or None")
    spec = mechanism.spec if isinstance(mechanism, PositionEncoding) else mechanism
    learned = False
    if isinstance(spec, str):
        learned = _check_biases(spec, D, Hq, cq=cq, ck=ck, lag_table=lag_table)
        if learned and isinstance(mechanism, str):
            # a learned lag table at its initial parameters: the C++ op builds it over the call's
            # lags, as nn::attention does
            if return_lse:
                raise InputError(f"{spec!r}: return_lse is not available with a learned lag table")
            if key_start is not None or q_segments is not None or k_segments is not None:
                raise InputError(f"{spec!r}: key_start and segments with a learned lag table: "
                                 "use relpos.Attention")
            layout = _LAYOUTS[pair_layout]
            try:
                return torch.ops.relpos.attention(
                    q, k, v, spec, q_positions, k_positions, causal, float(window), key_len,
                    0.0 if scale is None else float(scale), lag_table, slopes, cq, ck, layout,
                )
            except ValueError as e:
                raise InputError(str(e)) from None
    if isinstance(spec, str) and _journey_info(spec, D, Hk) is not None:
        # journey terms rotate v and the output too: one sequence at positions 0..T-1
        if q_positions is not None or k_positions is not None or Tq != Tk or Hq != Hk:
            raise InputError(
                f"{spec!r}: journey attention here scores one sequence at its own positions; "
                "use relpos.journey_attention (or the C++ nn::attention) for other calls"
            )
        if _journey_info(spec, D, Hk)[1]:
            raise InputError(f"{spec!r} has per-token angles: call relpos.journey_attention "
                             "with the increments")
        # (a learned table of a spec string went to the C++ op above: here it is the encoding's)
        out, lse = _journey(q, k, v, spec, None, pair_layout,
                            mechanism if learned else None,
                            dict(causal=causal, window=window, key_len=key_len, scale=scale,
                                 lag_table=lag_table, slopes=slopes, cq=cq, ck=ck,
                                 key_start=key_start, q_segments=q_segments,
                                 k_segments=k_segments))
        return (out, lse) if return_lse else out
    if isinstance(mechanism, str):
        enc = _fixed_encoding(mechanism, D, Hk, pair_layout, q.dtype)
    elif isinstance(mechanism, PositionEncoding) or mechanism is None:
        enc = mechanism
    else:
        raise InputError("mechanism must be a spec string, a PositionEncoding or None")
    if enc is not None:
        q, k, q_positions, k_positions, s = _transform_qk(enc, q, k, q_positions, k_positions)
        if s is not None:
            slopes = s if slopes is None else slopes + s
        if learned:
            lag_table = _learned_lag_table(enc, q_positions, k_positions, Hq, Hk, q.dtype)
    out, lse = fused_attention(
        q, k, v, q_positions=q_positions, k_positions=k_positions, causal=causal, window=window,
        key_len=key_len, scale=scale, lag_table=lag_table, slopes=slopes, cq=cq, ck=ck,
        key_start=key_start, q_segments=q_segments, k_segments=k_segments,
    )
    return (out, lse) if return_lse else out
