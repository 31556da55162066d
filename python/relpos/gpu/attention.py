"""Triton kernels of the fused attention operators (``relpos::fused_attention`` and
``relpos::fused_attention_backward``), registered as their CUDA kernels by :mod:`relpos.gpu`.

The semantics are the CPU kernel's (src/kernels/attention/attention.hpp, attention_ops.cpp):
visibility on float64 positions (causal, window, key_len / key_start padding, packed segments,
exclude_self), the additive biases of the nine slots (lag table, ALiBi slopes, per-token cq/ck,
gated slopes gq/gk, GRAPE-AP path integrals), grouped-query heads, lse ``[B, Hq, Tq]`` in the
compute dtype, rows without a visible key giving zeros and lse = -inf.

Kernels (FlashAttention-2 scheme, fp32 math; fp64 for float64 inputs, half storage read as is
and fed to ``tl.dot`` in its own dtype):

* ``_fwd_kernel``: online softmax over key tiles, one program per (query tile, batch x head).
  Every bias and mask is a ``tl.constexpr`` flag, so an absent one costs nothing. Key tiles are
  walked from the last toward the first: the path integral is a suffix sum over key slots
  carried per row (float64) in that order. In decode mode (few queries) the rows of one
  key/value head's query group are stacked into one tile (each kv head read once) and the keys
  are split across programs (flash-decoding), the partial results merged by ``_merge_splits``.
* ``_bwd_dkdv_kernel``: per key tile, dk, dv and the key-side bias gradients (ck, gk, the lag
  table by atomic scatter, slopes), walking its query heads and query tiles.
* ``_bwd_dq_kernel``: per query tile, dq and the query-side bias gradients (cq, gq). With a path
  integral it is the whole backward (``FUSED``): its gradients need per-row suffix sums over
  the key walk, so dk, dv and every key-side gradient are added atomically from there.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

SLOTS = ("lag_table", "slopes", "cq", "ck", "gq", "gk", "path_q", "path_k", "path_beta")
_LAG, _SLOPES, _CQ, _CK, _GQ, _GK, _PQ, _PK, _PB = range(9)
_HALF = (torch.bfloat16, torch.float16)
_STORABLE = (torch.float32, torch.float64) + _HALF
LOG2E = tl.constexpr(1.4426950408889634)  # (a global a kernel reads must be constexpr)


def _interpreted(t: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" or t.device.type != "cuda"


# ---- the kernels ---------------------------------------------------------------------------


@triton.jit
def _dot(a, b, ACC: tl.constexpr, DOT: tl.constexpr):
    """A tile product accumulated in ACC. DOT 1: fp32 operands in full precision (the CPU
    kernel's results to 1e-5, not TF32's 1e-3); 2: half operands widened first (Triton's
    interpreter multiplies bfloat16 tiles wrongly); 3: fp32 as three TF32 products; 0: the
    operands' own precision."""
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee", out_dtype=ACC)
    elif DOT == 3:
        return tl.dot(a, b, input_precision="tf32x3", out_dtype=ACC)
    elif DOT == 1:
        return tl.dot(a, b, input_precision="ieee", out_dtype=ACC)
    else:
        return tl.dot(a, b, out_dtype=ACC)


@triton.jit
def _log_sigmoid(z):
    # min(z, 0) - log1p(e^-|z|), log1p(x) = log(u) x / (u - 1) with u = 1 + x (accurate for tiny x)
    x = tl.exp(-tl.abs(z))
    u = 1.0 + x
    one = u == 1.0
    l1p = tl.where(one, x, tl.log(u) * x / tl.where(one, 1.0, u - 1.0))
    return tl.minimum(z, 0.0) - l1p


@triton.jit
def _lags(i2, j2, pq2, pk2, Tq, Tk, POS: tl.constexpr):
    """The lags p_q - p_k of a tile. POS 0: the default positions (queries the last Tq of the Tk
    key positions), 1: explicit float64 positions (subtracted in float64, as the CPU kernel), 2:
    explicit positions known to be integers below 2^24 (int32 on the device): exact integers
    without float64 work per pair."""
    if POS == 0:
        return (Tk - Tq + i2) - j2
    else:
        return pq2 - pk2


@triton.jit
def _lag_index(d, lag_len, POS: tl.constexpr):
    """attention_lag_index: the lag rounded to the nearest integer, clamped to the table (lags
    beyond use its last entry, negative ones its first)."""
    if POS == 1:
        return tl.minimum(tl.maximum(d + 0.5, 0.0), lag_len - 1).to(tl.int32)
    else:
        return tl.minimum(tl.maximum(d, 0), lag_len - 1)


@triton.jit
def _bias_and_mask(s, b, h2, i2, j2, row_ok2, key_ok2, d, qs2, ks2,
                   LAG_T, lag_len, SLOPES, CQ, CK, GQ, GK, window, Hq, Tq, Tk,
                   ACC: tl.constexpr, POS: tl.constexpr, CAUSAL: tl.constexpr,
                   EXCLUDE_SELF: tl.constexpr, WINDOW: tl.constexpr, SEGMENTS: tl.constexpr,
                   HAS_LAG: tl.constexpr,
                   HAS_SLOPES: tl.constexpr, HAS_TOKEN: tl.constexpr, HAS_GQ: tl.constexpr,
                   HAS_GK: tl.constexpr):
    """s (scaled q.k) plus the pairwise biases, in the CPU kernel's order; returns it with the
    visibility mask and the lags in the compute dtype. h2 is the query head (a scalar, or [BM, 1]
    when the rows of a tile belong to several heads)."""
    vis = row_ok2 & key_ok2
    if CAUSAL:
        if EXCLUDE_SELF:
            vis = vis & (d > 0)
        else:
            vis = vis & (d >= 0)
    if WINDOW:
        if POS == 1:
            vis = vis & (d < window)
        else:  # integer lags: lag < window iff lag < ceil(window)
            vis = vis & (d < tl.minimum(tl.ceil(window), 2147483647.0).to(tl.int32))
    if SEGMENTS:
        vis = vis & (qs2 == ks2)
    lag = d.to(ACC)
    if HAS_LAG:
        # the lag rounded to the nearest integer, clamped to the table (lags beyond use its last
        # entry, negative ones its first): attention_lag_index
        s += tl.load(LAG_T + h2 * lag_len + _lag_index(d, lag_len, POS)).to(ACC)
    if HAS_SLOPES:
        s -= tl.load(SLOPES + h2).to(ACC) * lag
    if HAS_TOKEN:
        # float64 cumulative sums subtracted in float64 first (their O(1) differences stay exact)
        cq = tl.load(CQ + (b * Hq + h2) * Tq + i2)
        ck = tl.load(CK + (b * Hq + h2) * Tk + j2, mask=j2 < Tk, other=0.0)
        s += (cq - ck).to(ACC)
    if HAS_GQ or HAS_GK:
        gate = tl.zeros_like(s)
        if HAS_GQ:
            gate += tl.load(GQ + (b * Hq + h2) * Tq + i2).to(ACC)
        if HAS_GK:
            gate += tl.load(GK + (b * Hq + h2) * Tk + j2, mask=j2 < Tk, other=0.0).to(ACC)
        s -= lag * gate
    return s, vis, lag


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@triton.jit
def _hides(row_ok2, key_ok2, n0, i_min, i_max, lo, hi_vis, pq2, pk2, qs2, ks2, Tq, Tk, window,
           BLOCK_N: tl.constexpr, POS: tl.constexpr, CAUSAL: tl.constexpr,
           EXCLUDE_SELF: tl.constexpr, WINDOW: tl.constexpr, SEGMENTS: tl.constexpr):
    """Whether a mask or the padding may hide some pair of this tile whose row and key exist:
    the pairs whose zero weight must not meet a non-finite operand (0 x NaN in a tile product).
    From the tile's bounds only (rows i_min..i_max, keys n0.., [lo, hi_vis) those padding leaves;
    the range of the positions and segment ids of its live rows and keys): no per-pair work, and
    false only when every pair is visible."""
    some = (n0 < lo) | (tl.minimum(n0 + BLOCK_N, Tk) > hi_vis)
    if POS:
        q_lo = tl.min(tl.where(row_ok2, pq2, float("inf")))
        q_hi = tl.max(tl.where(row_ok2, pq2, -float("inf")))
        k_lo = tl.min(tl.where(key_ok2, pk2, float("inf")))
        k_hi = tl.max(tl.where(key_ok2, pk2, -float("inf")))
    else:
        q_lo = Tk - Tq + i_min
        q_hi = Tk - Tq + i_max
        k_lo = n0
        k_hi = n0 + BLOCK_N - 1
    if CAUSAL:
        if EXCLUDE_SELF:
            some = some | (k_hi >= q_lo)
        else:
            some = some | (k_hi > q_lo)
    if WINDOW:
        some = some | ((q_hi - k_lo).to(tl.float64) >= window)
    if SEGMENTS:
        s_hi = tl.max(tl.where(row_ok2, qs2, -1))
        s_lo = tl.min(tl.where(row_ok2, qs2, s_hi))
        t_hi = tl.max(tl.where(key_ok2, ks2, s_hi))
        t_lo = tl.min(tl.where(key_ok2, ks2, s_hi))
        some = some | (s_lo != s_hi) | (t_lo != t_hi) | (t_lo != s_hi)
    return some


@triton.jit
def _unscreened(x, hidden):
    """Whether x (an operand tile) has a non-finite entry while some pair of the tile is hidden
    (only then is it read)."""
    bad = hidden != hidden
    if hidden:
        bad = tl.max(tl.where(_finite(x), 0, 1)) > 0
    return bad


@triton.jit
def _masked_product(acc, a, b, vis_ab, screen, ACC: tl.constexpr, DOT: tl.constexpr):
    """acc + a @ b where a is zero at the pairs the masks hide (vis_ab false). With screen (such
    a pair exists and b has a non-finite entry) b's non-finite entries enter as zero and every
    entry of the product that a visible pair takes one into is NaN: a hidden NaN or Inf changes
    nothing (0 x NaN would reach the rows that cannot see it), a visible one is never lost.
    The plain product stays unconditional (the loop's pipelined dot); a screened tile computes
    its product again."""
    out = acc + _dot(a.to(b.dtype), b, ACC, DOT)
    if screen:
        fin = _finite(b)
        out = acc + _dot(a.to(b.dtype), tl.where(fin, b, 0.0), ACC, DOT)
        hit = tl.dot(tl.where(vis_ab, 1.0, 0.0).to(tl.float16),
                     tl.where(fin, 0.0, 1.0).to(tl.float16))
        out = tl.where(hit > 0, float("nan"), out)
    return out


@triton.jit
def _path_edges(PQv, PK, b, h, i2, j, Hq, Tq, Tk, PD, beta, pscale,
                ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                PDOT: tl.constexpr):
    """The path integral's edges of a key tile, shifted by one: column c holds edge l = j + 1
    (the edge above key j), beta logsigmoid(path_scale pq_i . pk_l) where l <= slot(i) =
    Tk - Tq + i and l < Tk, else 0. Returns (edges, z, logsigmoid(z), whether the edge exists,
    the key probes [BLOCK_N, BLOCK_P])."""
    offs_p = tl.arange(0, BLOCK_P)
    l_1 = j + 1
    j2 = j[None, :]
    pk = tl.load(PK + ((b * Hq + h) * Tk + l_1[:, None]) * PD + offs_p[None, :],
                 mask=(l_1[:, None] < Tk) & (offs_p[None, :] < PD), other=0.0).to(ACC)
    z = _dot(PQv, tl.trans(pk), ACC, PDOT) * pscale
    ls = _log_sigmoid(z)
    on = (j2 + 1 <= Tk - Tq + i2) & (j2 + 1 < Tk)
    e = tl.where(on, beta * ls, 0.0)
    return e, z, ls, on, pk


@triton.jit
def _query_rows(b, i, i2, row_ok, row_ok2, PQP, QSEG, spq, Tq, POS: tl.constexpr,
                SEGMENTS: tl.constexpr):
    """A query tile's positions [BM, 1] with their range over the live rows (explicit
    positions), and its segment ids [BM, 1] (packed sequences)."""
    pq2 = 0.0
    pq_max = 0.0
    pq_min = 0.0
    if POS:
        pq = tl.load(PQP + b * spq + i, mask=row_ok, other=0)
        pq2 = pq[:, None]
        pq_max = tl.max(tl.where(row_ok, pq, -float("inf")), 0)
        pq_min = tl.min(tl.where(row_ok, pq, float("inf")), 0)
    qs2 = 0
    if SEGMENTS:
        qs2 = tl.load(QSEG + b * Tq + i2, mask=row_ok2, other=-1)
    return pq2, pq_max, pq_min, qs2


@triton.jit
def _key_tile(n0, offs_n, hi_vis, lo, PKP, b, spk, Tk, pq_max, pq_min, window,
              POS: tl.constexpr, PATH: tl.constexpr, CAUSAL: tl.constexpr,
              WINDOW: tl.constexpr):
    """A key tile's columns j, which of them padding leaves visible, their positions [1, BN]
    (explicit positions) and whether any row can see the tile: with explicit positions a tile no
    row sees is skipped here (no loop bound without order; not with a path, whose sums run on)."""
    j = n0 + offs_n
    key_ok = (j < hi_vis) & (j >= lo)
    pk2 = 0.0
    go = True
    if POS:
        pk = tl.load(PKP + b * spk + j, mask=j < Tk, other=0)
        pk2 = pk[None, :]
        if not PATH:
            if CAUSAL:
                go = tl.min(tl.where(key_ok, pk, float("inf")), 0) <= pq_max
            if WINDOW:
                go = go & (tl.max(tl.where(key_ok, pk, -float("inf")), 0) > pq_min - window)
    return j, key_ok, pk2, go


@triton.jit
def _key_bounds(b, i_min, i_max, KLEN, KSTART, window, Tq, Tk,
                POS: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                KEY_LEN: tl.constexpr, KEY_START: tl.constexpr, PATH: tl.constexpr):
    """The key range [lo, hi) a tile of query rows i_min..i_max walks, its scores' range
    [lo, hi_vis), and the clamped key_len / key_start: the skipped keys are invisible to every
    row (causal and window bounds need the default positions). A path integral's edges run up
    to the rows' slots whatever the keys' visibility (padding hides keys, not edges)."""
    zero = tl.program_id(0) * 0  # every bound a tensor (Tk may be a specialised constant)
    hi = zero + Tk
    if CAUSAL and not POS:
        hi = tl.minimum(hi, Tk - Tq + i_max + 1)
    kl = zero + Tk
    if KEY_LEN:
        kl = tl.minimum(tl.maximum(tl.load(KLEN + b), 0), Tk).to(tl.int32)
        hi = tl.minimum(hi, kl)
    lo = zero
    if WINDOW and not POS:
        first = tl.floor((Tk - Tq + i_min).to(tl.float64) - window).to(tl.int32) + 1
        lo = tl.maximum(lo, first)
    ks = zero
    if KEY_START:
        ks = tl.minimum(tl.maximum(tl.load(KSTART + b), 0), Tk).to(tl.int32)
        lo = tl.maximum(lo, ks)
    hi_vis = hi
    if PATH:
        hi = tl.maximum(hi, tl.minimum(Tk, Tk - Tq + i_max + 1))
    return lo, hi, hi_vis, kl, ks


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, M_PART, L_PART, PQP, PKP, KLEN, KSTART, QSEG, KSEG,
    LAG_T, SLOPES, CQ, CK, GQ, GK, PATHQ, PATHK, BETA, PARAMS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, spq, spk,
    Hq, Hk, Tq, Tk, D, lag_len, PD, n_rows, tiles_per_split,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, PDOT: tl.constexpr,
    GROUPED: tl.constexpr,
    SPLIT: tl.constexpr, POS: tl.constexpr, CAUSAL: tl.constexpr, EXCLUDE_SELF: tl.constexpr,
    WINDOW: tl.constexpr, KEY_LEN: tl.constexpr, KEY_START: tl.constexpr,
    SEGMENTS: tl.constexpr, HAS_LAG: tl.constexpr, HAS_SLOPES: tl.constexpr,
    HAS_TOKEN: tl.constexpr, HAS_GQ: tl.constexpr, HAS_GK: tl.constexpr, PATH: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_x = tl.program_id(1)
    pid_s = tl.program_id(2)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if GROUPED:
        # decode: the rows of one key/value head's query group stacked (head-major), so that the
        # group reads its keys and values once
        b = pid_x // Hk
        hk = pid_x % Hk
        row_ok = r < G * Tq
        # rows past the end read in range (their results are masked out)
        i = tl.where(row_ok, r % Tq, 0)
        h = tl.minimum(hk * G + r // Tq, Hq - 1)
        h2 = h[:, None]
    else:
        b = pid_x // Hq
        h = pid_x % Hq
        hk = h // G
        row_ok = r < Tq
        i = tl.minimum(r, Tq - 1)  # rows past the end read in range (masked out)
        h2 = h
    i2 = i[:, None]
    row_ok2 = row_ok[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    scale = tl.load(PARAMS + 0).to(ACC)
    window = tl.load(PARAMS + 1)
    pscale = tl.load(PARAMS + 2).to(ACC)

    q = tl.load(Q + b * sqb + h2 * sqh + i2 * sqt + offs_d[None, :],
                mask=row_ok2 & (offs_d[None, :] < D), other=0.0)
    pq2, pq_max, pq_min, qs2 = _query_rows(b, i, i2, row_ok, row_ok2, PQP, QSEG, spq, Tq, POS,
                                           SEGMENTS)
    i_min = tl.min(tl.where(row_ok, i, Tq), 0)
    i_max = tl.max(tl.where(row_ok, i, 0), 0)
    lo, hi, hi_vis, kl, ks = _key_bounds(b, i_min, i_max, KLEN, KSTART, window, Tq, Tk, POS,
                                         CAUSAL, WINDOW, KEY_LEN, KEY_START, PATH)
    t_lo = lo // BLOCK_N
    t_hi = tl.cdiv(hi, BLOCK_N)
    if SPLIT:
        t_lo = tl.maximum(t_lo, pid_s * tiles_per_split)
        t_hi = tl.minimum(t_hi, (pid_s + 1) * tiles_per_split)
    PQv = tl.zeros([BLOCK_M, BLOCK_P], dtype=ACC)
    beta = 0.0
    if PATH:
        offs_p = tl.arange(0, BLOCK_P)
        PQv = tl.load(PATHQ + ((b * Hq + h2) * Tq + i2) * PD + offs_p[None, :],
                      mask=row_ok2 & (offs_p[None, :] < PD), other=0.0).to(ACC)
        beta = tl.load(BETA + h).to(ACC)

    m_i = tl.full([BLOCK_M], -float("inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    carry = tl.zeros([BLOCK_M], dtype=tl.float64)  # the path edges above the current tile
    # from the last key tile toward the first (the path integral's suffix sums need it)
    for t in range(0, tl.maximum(t_hi - t_lo, 0)):
        n0 = (t_hi - 1 - t) * BLOCK_N
        j, key_ok, pk2, go = _key_tile(n0, offs_n, hi_vis, lo, PKP, b, spk, Tk, pq_max, pq_min,
                                       window, POS, PATH, CAUSAL, WINDOW)
        j2 = j[None, :]
        key_ok2 = key_ok[None, :]
        if go:
            ks2 = 0
            if SEGMENTS:
                ks2 = tl.load(KSEG + b * Tk + j2, mask=j2 < Tk, other=-2)
            # keys past the padding are not read (a cache's rows there may be garbage)
            k = tl.load(K + b * skb + hk * skh + j[:, None] * skt + offs_d[None, :],
                        mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            s = _dot(q, tl.trans(k), ACC, DOT) * scale
            d = _lags(i2, j2, pq2, pk2, Tq, Tk, POS)
            s, vis, lag = _bias_and_mask(s, b, h2, i2, j2, row_ok2, key_ok2, d, qs2, ks2, LAG_T,
                                         lag_len, SLOPES, CQ, CK, GQ, GK, window, Hq, Tq, Tk,
                                         ACC, POS, CAUSAL, EXCLUDE_SELF, WINDOW, SEGMENTS, HAS_LAG,
                                         HAS_SLOPES, HAS_TOKEN, HAS_GQ, HAS_GK)
            if PATH:
                e, z, ls, on, pkv = _path_edges(PQv, PATHK, b, h, i2, j, Hq, Tq, Tk, PD, beta,
                                                pscale, ACC, BLOCK_N, BLOCK_P, PDOT)
                # bias(i, j) = edges l = j+1 .. slot(i): this tile's suffix sums plus the carry
                suffix = tl.cumsum(e, axis=1, reverse=True)
                s += (carry[:, None] + suffix.to(tl.float64)).to(ACC)
                carry += tl.sum(e, 1).to(tl.float64)
            s = tl.where(vis, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.exp2((s - m_safe[:, None]) * LOG2E)
            alpha = tl.exp2((m_i - m_safe) * LOG2E)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + hk * svh + j[:, None] * svt + offs_d[None, :],
                        mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            hidden = _hides(row_ok2, key_ok2, n0, i_min, i_max, lo, hi_vis, pq2, pk2, qs2, ks2, Tq,
                            Tk, window, BLOCK_N, POS, CAUSAL, EXCLUDE_SELF, WINDOW, SEGMENTS)
            acc = _masked_product(acc * alpha[:, None], p, v, vis, _unscreened(v, hidden), ACC,
                                  DOT)
            m_i = m_new

    if SPLIT:
        # partial results of this key split: merged by _merge_splits
        row = pid_x * n_rows + r
        nrows_all = tl.num_programs(1) * n_rows
        tl.store(M_PART + pid_s * nrows_all + row, m_i, mask=row_ok)
        tl.store(L_PART + pid_s * nrows_all + row, l_i, mask=row_ok)
        tl.store(O + (pid_s * nrows_all + row[:, None]) * D + offs_d[None, :], acc,
                 mask=row_ok2 & (offs_d[None, :] < D))
    else:
        ok = l_i != 0  # (a NaN sum, from a non-finite score the row sees, stays NaN)
        out = acc / tl.where(ok, l_i, 1.0)[:, None]
        lse = tl.where(ok, m_i + tl.log(tl.where(ok, l_i, 1.0)), -float("inf"))
        tl.store(O + b * sob + h2 * soh + i2 * sot + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok2 & (offs_d[None, :] < D))
        tl.store(LSE + (b * Hq + h2) * Tq + i2, lse[:, None], mask=row_ok2)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DLSE, DQ, DK, DV, PQP, PKP, KLEN, KSTART, QSEG, KSEG,
    LAG_T, SLOPES, CQ, CK, GQ, GK, PATHQ, PATHK, BETA, PARAMS,
    DLAG, DSLOPES, DCQ, DCK, DGQ, DGK, DPQ, DPK, DBETA,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, spq, spk,
    Hq, Hk, Tq, Tk, D, lag_len, PD,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, PDOT: tl.constexpr,
    FUSED: tl.constexpr,
    POS: tl.constexpr, CAUSAL: tl.constexpr, EXCLUDE_SELF: tl.constexpr, WINDOW: tl.constexpr,
    KEY_LEN: tl.constexpr, KEY_START: tl.constexpr, SEGMENTS: tl.constexpr,
    HAS_LAG: tl.constexpr, HAS_SLOPES: tl.constexpr, HAS_TOKEN: tl.constexpr,
    HAS_GQ: tl.constexpr, HAS_GK: tl.constexpr, PATH: tl.constexpr,
    NEED_DQ: tl.constexpr, NEED_DK: tl.constexpr, NEED_DV: tl.constexpr,
    NEED_LAG: tl.constexpr, NEED_SLOPES: tl.constexpr, NEED_CQ: tl.constexpr,
    NEED_CK: tl.constexpr, NEED_GQ: tl.constexpr, NEED_GK: tl.constexpr,
    NEED_PQ: tl.constexpr, NEED_PK: tl.constexpr, NEED_PB: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_x = tl.program_id(1)
    b = pid_x // Hq
    h = pid_x % Hq
    hk = h // G
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < Tq
    i = tl.minimum(r, Tq - 1)  # rows past the end read in range (masked out)
    i2 = i[:, None]
    row_ok2 = row_ok[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dmask = offs_d[None, :] < D
    scale = tl.load(PARAMS + 0).to(ACC)
    window = tl.load(PARAMS + 1)
    pscale = tl.load(PARAMS + 2).to(ACC)

    q = tl.load(Q + b * sqb + h * sqh + i2 * sqt + offs_d[None, :], mask=row_ok2 & dmask,
                other=0.0)
    do = tl.load(DO + ((b * Hq + h) * Tq + i2) * D + offs_d[None, :], mask=row_ok2 & dmask,
                 other=0.0)
    lse = tl.load(LSE + (b * Hq + h) * Tq + i, mask=row_ok, other=0.0).to(ACC)
    delta = tl.load(DELTA + (b * Hq + h) * Tq + i, mask=row_ok, other=0.0).to(ACC)
    dlse = tl.zeros([BLOCK_M], dtype=tl.float64)
    if PATH:
        # dL/dlse (0 for rows without a visible key): the row sum of dS
        dlse = tl.load(DLSE + (b * Hq + h) * Tq + i, mask=row_ok, other=0.0).to(tl.float64)
    pq2, pq_max, pq_min, qs2 = _query_rows(b, i, i2, row_ok, row_ok2, PQP, QSEG, spq, Tq, POS,
                                           SEGMENTS)
    i_min = pid_m * BLOCK_M
    i_max = tl.minimum(i_min + BLOCK_M, Tq) - 1
    lo, hi, hi_vis, kl, ks = _key_bounds(b, i_min, i_max, KLEN, KSTART, window, Tq, Tk, POS,
                                         CAUSAL, WINDOW, KEY_LEN, KEY_START, PATH)
    t_lo = lo // BLOCK_N
    t_hi = tl.cdiv(hi, BLOCK_N)
    PQv = tl.zeros([BLOCK_M, BLOCK_P], dtype=ACC)
    beta = 0.0
    offs_p = tl.arange(0, BLOCK_P)
    if PATH:
        PQv = tl.load(PATHQ + ((b * Hq + h) * Tq + i2) * PD + offs_p[None, :],
                      mask=row_ok2 & (offs_p[None, :] < PD), other=0.0).to(ACC)
        beta = tl.load(BETA + h).to(ACC)
    win_first = 0
    if WINDOW and not POS:
        # edges at or below a row's first visible key have no visible key under them
        win_first = tl.floor((Tk - Tq + i2).to(tl.float64) - window).to(tl.int32) + 1

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    dcq = tl.zeros([BLOCK_M], dtype=ACC)
    dgq = tl.zeros([BLOCK_M], dtype=tl.float64)
    dpq = tl.zeros([BLOCK_M, BLOCK_P], dtype=ACC)
    carry = tl.zeros([BLOCK_M], dtype=tl.float64)  # path edges above the tile
    sufds = tl.zeros([BLOCK_M], dtype=tl.float64)  # dS summed over the keys above the tile
    sufp = tl.zeros([BLOCK_M], dtype=tl.float64)  # P summed over the keys above the tile
    wsum = tl.zeros([BLOCK_M], dtype=tl.float64)  # sum over edges of (P above) x logsigmoid
    dbeta = tl.zeros([BLOCK_M], dtype=tl.float64)
    dslope = tl.zeros([BLOCK_M], dtype=tl.float64)
    for t in range(0, tl.maximum(t_hi - t_lo, 0)):
        n0 = (t_hi - 1 - t) * BLOCK_N
        j, key_ok, pk2, go = _key_tile(n0, offs_n, hi_vis, lo, PKP, b, spk, Tk, pq_max, pq_min,
                                       window, POS, PATH, CAUSAL, WINDOW)
        j2 = j[None, :]
        key_ok2 = key_ok[None, :]
        if go:
            ks2 = 0
            if SEGMENTS:
                ks2 = tl.load(KSEG + b * Tk + j2, mask=j2 < Tk, other=-2)
            kmask = key_ok[:, None] & dmask
            k = tl.load(K + b * skb + hk * skh + j[:, None] * skt + offs_d[None, :], mask=kmask,
                        other=0.0)
            v = tl.load(V + b * svb + hk * svh + j[:, None] * svt + offs_d[None, :], mask=kmask,
                        other=0.0)
            s = _dot(q, tl.trans(k), ACC, DOT) * scale
            d = _lags(i2, j2, pq2, pk2, Tq, Tk, POS)
            s, vis, lag = _bias_and_mask(s, b, h, i2, j2, row_ok2, key_ok2, d, qs2, ks2, LAG_T,
                                         lag_len, SLOPES, CQ, CK, GQ, GK, window, Hq, Tq, Tk,
                                         ACC, POS, CAUSAL, EXCLUDE_SELF, WINDOW, SEGMENTS, HAS_LAG,
                                         HAS_SLOPES, HAS_TOKEN, HAS_GQ, HAS_GK)
            if PATH:
                e, z, ls, on, pkv = _path_edges(PQv, PATHK, b, h, i2, j, Hq, Tq, Tk, PD, beta,
                                                pscale, ACC, BLOCK_N, BLOCK_P, PDOT)
                suffix = tl.cumsum(e, axis=1, reverse=True)
                s += (carry[:, None] + suffix.to(tl.float64)).to(ACC)
                carry += tl.sum(e, 1).to(tl.float64)
            p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), ACC, DOT)
            ds = p * (dp - delta[:, None])
            hidden = _hides(row_ok2, key_ok2, n0, i_min, i_max, lo, hi_vis, pq2, pk2, qs2, ks2, Tq,
                            Tk, window, BLOCK_N, POS, CAUSAL, EXCLUDE_SELF, WINDOW, SEGMENTS)
            if hidden:  # a hidden pair's dS is 0 whatever v, dO or the row's delta hold
                ds = tl.where(vis, ds, 0.0)
            if NEED_DQ:
                dq = _masked_product(dq, ds, k, vis, _unscreened(k, hidden), ACC, DOT)
            if NEED_CQ:
                dcq += tl.sum(ds, 1)
            if NEED_GQ:  # lag-weighted sums in float64 (long lags times dS cancel)
                dgq -= tl.sum(ds.to(tl.float64) * d, 1)
            if PATH:
                # d e(i, l) = sum_{j<l} dS_ij = dlse_i - (dS summed over the keys >= l) (a row's
                # dS sums to dL/dlse_i); edge column c is l = j + 1
                ds_above = tl.cumsum(ds, axis=1, reverse=True) - ds  # keys > j in the tile
                de = dlse[:, None] - (sufds[:, None] + ds_above.to(tl.float64))
                edge = on
                if WINDOW and not POS:
                    edge = edge & (j2 + 1 >= win_first + 1)
                p_above = tl.cumsum(p, axis=1, reverse=True) - p
                wsum += tl.sum(tl.where(edge, (sufp[:, None] + p_above.to(tl.float64))
                                        * ls.to(tl.float64), 0.0), 1)
                sufds += tl.sum(ds, 1).to(tl.float64)
                sufp += tl.sum(p, 1).to(tl.float64)
                de = tl.where(edge, de, 0.0)
                dbeta += tl.sum(de * ls.to(tl.float64), 1)
                # through logsigmoid (its derivative sigmoid(-z) = e^{logsigmoid(z) - z})
                dz = de.to(ACC) * beta * pscale * tl.exp(ls - z)
                if NEED_PQ:
                    dpq += _dot(dz, pkv, ACC, PDOT)
                if NEED_PK:
                    l_1 = j + 1
                    tl.atomic_add(DPK + ((b * Hq + h) * Tk + l_1[:, None]) * PD + offs_p[None, :],
                                  _dot(tl.trans(dz), PQv, ACC, PDOT),
                                  mask=(l_1[:, None] < Tk) & (offs_p[None, :] < PD))
            if FUSED:
                # the key side from here (the path integral's suffix sums live on this walk)
                kv_row = ((b * Hk + hk) * Tk + j[:, None]) * D + offs_d[None, :]
                zero = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
                if NEED_DV:
                    tl.atomic_add(DV + kv_row,
                                  _masked_product(zero, tl.trans(p), do, tl.trans(vis),
                                                  _unscreened(do, hidden), ACC, DOT),
                                  mask=kmask)
                if NEED_DK:
                    tl.atomic_add(DK + kv_row,
                                  _masked_product(zero, tl.trans(ds), q, tl.trans(vis),
                                                  _unscreened(q, hidden), ACC, DOT) * scale,
                                  mask=kmask)
                if NEED_CK:
                    tl.atomic_add(DCK + (b * Hq + h) * Tk + j,
                                  (-tl.sum(ds, 0)).to(DCK.dtype.element_ty),
                                  mask=j < Tk)
                if NEED_GK:
                    tl.atomic_add(DGK + (b * Hq + h) * Tk + j,
                                  (-tl.sum(ds.to(tl.float64) * d, 0)).to(DGK.dtype.element_ty),
                                  mask=j < Tk)
                if NEED_LAG:
                    tl.atomic_add(DLAG + h * lag_len + _lag_index(d, lag_len, POS), ds, mask=vis)
                if NEED_SLOPES:  # in float64: long lags times dS cancel
                    dslope -= tl.sum(ds.to(tl.float64) * d, 1)

    if NEED_DQ:
        tl.store(DQ + ((b * Hq + h) * Tq + i2) * D + offs_d[None, :], dq * scale,
                 mask=row_ok2 & dmask)
    if NEED_CQ:
        tl.store(DCQ + (b * Hq + h) * Tq + i, dcq, mask=row_ok)
    if NEED_GQ:
        tl.store(DGQ + (b * Hq + h) * Tq + i, dgq, mask=row_ok)
    if NEED_PQ:
        tl.store(DPQ + ((b * Hq + h) * Tq + i2) * PD + offs_p[None, :], dpq,
                 mask=row_ok2 & (offs_p[None, :] < PD))
    if NEED_PB:
        # the CPU kernel's projection of each row's dS onto rows summing to dlse exactly (see
        # attention_isa.inc): removes the rounding residual that the long path sums amplify
        tl.atomic_add(DBETA + h, tl.sum(dbeta + (sufds - dlse) * wsum, 0)
                      .to(DBETA.dtype.element_ty))
    if FUSED and NEED_SLOPES:
        tl.atomic_add(DSLOPES + h, tl.sum(dslope, 0).to(DSLOPES.dtype.element_ty))


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, PQP, PKP, KLEN, KSTART, QSEG, KSEG,
    LAG_T, SLOPES, CQ, CK, GQ, GK, PARAMS, DLAG, DSLOPES, DCK, DGK,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, spq, spk,
    Hq, Hk, Tq, Tk, D, lag_len,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr, DOT: tl.constexpr,
    POS: tl.constexpr, CAUSAL: tl.constexpr, EXCLUDE_SELF: tl.constexpr, WINDOW: tl.constexpr,
    KEY_LEN: tl.constexpr, KEY_START: tl.constexpr, SEGMENTS: tl.constexpr,
    HAS_LAG: tl.constexpr, HAS_SLOPES: tl.constexpr, HAS_TOKEN: tl.constexpr,
    HAS_GQ: tl.constexpr, HAS_GK: tl.constexpr,
    NEED_DK: tl.constexpr, NEED_DV: tl.constexpr, NEED_LAG: tl.constexpr,
    NEED_SLOPES: tl.constexpr, NEED_CK: tl.constexpr, NEED_GK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_x = tl.program_id(1)
    b = pid_x // Hk
    hk = pid_x % Hk
    n0 = pid_n * BLOCK_N
    j = n0 + tl.arange(0, BLOCK_N)
    j2 = j[None, :]
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    dmask = offs_d[None, :] < D
    scale = tl.load(PARAMS + 0).to(ACC)
    window = tl.load(PARAMS + 1)
    kl = Tk
    ks = 0
    key_ok = j < Tk
    if KEY_LEN:
        kl = tl.minimum(tl.maximum(tl.load(KLEN + b), 0), Tk).to(tl.int32)
        key_ok = key_ok & (j < kl)
    if KEY_START:
        ks = tl.minimum(tl.maximum(tl.load(KSTART + b), 0), Tk).to(tl.int32)
        key_ok = key_ok & (j >= ks)
    key_ok2 = key_ok[None, :]
    kmask = key_ok[:, None] & dmask
    k = tl.load(K + b * skb + hk * skh + j[:, None] * skt + offs_d[None, :], mask=kmask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + j[:, None] * svt + offs_d[None, :], mask=kmask, other=0.0)
    pk2 = 0.0
    pk_min = 0.0
    pk_max = 0.0
    if POS:
        pk = tl.load(PKP + b * spk + j, mask=j < Tk, other=0)
        pk2 = pk[None, :]
        pk_min = tl.min(tl.where(key_ok, pk, float("inf")), 0)
        pk_max = tl.max(tl.where(key_ok, pk, -float("inf")), 0)
    ks2 = 0
    if SEGMENTS:
        ks2 = tl.load(KSEG + b * Tk + j2, mask=j2 < Tk, other=-2)
    # the query tiles that can see this key tile (bounds need the default positions)
    q_lo = 0
    q_hi = Tq
    if CAUSAL and not POS:
        q_lo = tl.maximum(n0 - (Tk - Tq), 0)
    if WINDOW and not POS:
        # lag = Tk - Tq + i - j < window for some key j < n0 + BLOCK_N
        q_hi = tl.minimum(q_hi, tl.floor((n0 + BLOCK_N - 1 - (Tk - Tq)).to(tl.float64)
                                         + window).to(tl.int32) + 1)
    q_hi = tl.where(tl.max(key_ok.to(tl.int32), 0) > 0, q_hi, q_lo)  # no key: nothing to walk
    t_lo = q_lo // BLOCK_M
    t_hi = tl.cdiv(tl.maximum(q_hi, 0), BLOCK_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    for g in range(0, G):
        h = hk * G + g
        dck = tl.zeros([BLOCK_N], dtype=ACC)
        dgk = tl.zeros([BLOCK_N], dtype=tl.float64)
        dslope = tl.zeros([BLOCK_N], dtype=tl.float64)
        for t in range(t_lo, t_hi):
            r = t * BLOCK_M + offs_m
            row_ok = r < Tq
            i = tl.minimum(r, Tq - 1)
            i2 = i[:, None]
            row_ok2 = row_ok[:, None]
            pq2 = 0.0
            go = True
            if POS:
                pq = tl.load(PQP + b * spq + i, mask=row_ok, other=0)
                pq2 = pq[:, None]
                if CAUSAL:
                    go = tl.max(tl.where(row_ok, pq, -float("inf")), 0) >= pk_min
                if WINDOW:
                    go = go & (tl.min(tl.where(row_ok, pq, float("inf")), 0) - window < pk_max)
            if go:
                qs2 = 0
                if SEGMENTS:
                    qs2 = tl.load(QSEG + b * Tq + i2, mask=row_ok2, other=-1)
                q = tl.load(Q + b * sqb + h * sqh + i2 * sqt + offs_d[None, :],
                            mask=row_ok2 & dmask, other=0.0)
                do = tl.load(DO + ((b * Hq + h) * Tq + i2) * D + offs_d[None, :],
                             mask=row_ok2 & dmask, other=0.0)
                lse = tl.load(LSE + (b * Hq + h) * Tq + i, mask=row_ok, other=0.0).to(ACC)
                delta = tl.load(DELTA + (b * Hq + h) * Tq + i, mask=row_ok, other=0.0).to(ACC)
                s = _dot(q, tl.trans(k), ACC, DOT) * scale
                d = _lags(i2, j2, pq2, pk2, Tq, Tk, POS)
                s, vis, lag = _bias_and_mask(s, b, h, i2, j2, row_ok2, key_ok2, d, qs2, ks2,
                                             LAG_T, lag_len, SLOPES, CQ, CK, GQ, GK, window, Hq,
                                             Tq, Tk, ACC, POS, CAUSAL, EXCLUDE_SELF, WINDOW,
                                             SEGMENTS,
                                             HAS_LAG, HAS_SLOPES, HAS_TOKEN, HAS_GQ, HAS_GK)
                p = tl.where(vis, tl.exp(s - lse[:, None]), 0.0)
                hidden = _hides(row_ok2, key_ok2, n0, t * BLOCK_M,
                                tl.minimum(t * BLOCK_M + BLOCK_M, Tq) - 1, ks, kl, pq2, pk2, qs2,
                                ks2, Tq, Tk, window, BLOCK_N, POS, CAUSAL, EXCLUDE_SELF, WINDOW,
                                SEGMENTS)
                if NEED_DV:
                    dv = _masked_product(dv, tl.trans(p), do, tl.trans(vis),
                                         _unscreened(do, hidden), ACC, DOT)
                dp = _dot(do, tl.trans(v), ACC, DOT)
                ds = p * (dp - delta[:, None])
                if hidden:  # a hidden pair's dS is 0 whatever v, dO or the row's delta hold
                    ds = tl.where(vis, ds, 0.0)
                if NEED_DK:
                    dk = _masked_product(dk, tl.trans(ds), q, tl.trans(vis),
                                         _unscreened(q, hidden), ACC, DOT)
                if NEED_CK:
                    dck -= tl.sum(ds, 0)
                if NEED_GK:  # lag-weighted sums in float64 (long lags times dS cancel)
                    dgk -= tl.sum(ds.to(tl.float64) * d, 0)
                if NEED_SLOPES:  # in float64: long lags times dS cancel
                    dslope -= tl.sum(ds.to(tl.float64) * d, 0)
                if NEED_LAG:
                    # scatter-add of dS over the lags (atomics: rows of many programs meet)
                    tl.atomic_add(DLAG + h * lag_len + _lag_index(d, lag_len, POS), ds, mask=vis)
        if NEED_CK:
            tl.store(DCK + (b * Hq + h) * Tk + j, dck, mask=j < Tk)
        if NEED_GK:
            tl.store(DGK + (b * Hq + h) * Tk + j, dgk, mask=j < Tk)
        if NEED_SLOPES:
            tl.atomic_add(DSLOPES + h, tl.sum(dslope, 0).to(DSLOPES.dtype.element_ty))
    row = ((b * Hk + hk) * Tk + j[:, None]) * D + offs_d[None, :]
    if NEED_DK:
        tl.store(DK + row, dk * scale, mask=(j[:, None] < Tk) & dmask)
    if NEED_DV:
        tl.store(DV + row, dv, mask=(j[:, None] < Tk) & dmask)


# ---- the host side ---------------------------------------------------------------------------


def _small_integers(p) -> bool:
    """Whether positions p (None: the default ones) are known, without a device sync, to be
    integers of magnitude below 2^24 (the lags are then exact in int32 and float32)."""
    if p is None:
        return True
    if p.device.type != "cpu" or p.is_complex():
        return False
    if p.numel() == 0:
        return True
    d = p.double()
    return bool((d == d.round()).all()) and float(d.abs().max()) < 2 ** 24


def _shape(t):
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _goes_with(t: torch.dtype, x: torch.dtype) -> bool:
    return t == x or t == _compute(x)


def _compute(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt in _HALF else dt


class _Call:
    """The checked operands of one call, as the kernels take them (the CPU op's `prepare`)."""

    def __init__(self, q, k, v, biases, q_positions, k_positions, causal, window, key_len, scale,
                 exclude_self, path_scale, key_start, q_segments, k_segments):
        if len(biases) > len(SLOTS):
            raise ValueError(f"attention: biases has {len(biases)} entries; the kernel has "
                             f"{len(SLOTS)} slots ({', '.join(SLOTS)})")
        bias = list(biases) + [None] * (len(SLOTS) - len(biases))
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is None:
                raise ValueError(f"attention: {name} is undefined")
            if t.dim() != 4:
                raise ValueError(f"attention: {name} must be [B, H, T, D], got {_shape(t)}")
            if t.dtype not in _STORABLE:
                raise ValueError(
                    f"attention: {name} must be float32, float64, bfloat16 or float16")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError("attention: q, k and v must have one dtype")
        if k.shape != v.shape:
            raise ValueError(f"attention: k {_shape(k)} and v {_shape(v)} differ in shape")
        B, Hq, Tq, D = q.shape
        Hk, Tk = k.shape[1], k.shape[2]
        if k.shape[0] != B or k.shape[3] != D:
            raise ValueError(f"attention: q {_shape(q)} and k {_shape(k)} differ in batch or "
                             "head dim")
        if Hk < 1 or Hq % Hk:
            raise ValueError(
                f"attention: key/value heads ({Hk}) must divide query heads ({Hq})")
        window, scale, path_scale = float(window), float(scale), float(path_scale)
        if not (window >= 0) or math.isinf(window):
            raise ValueError("attention: window must be >= 0 and finite")
        if not (scale >= 0) or math.isinf(scale):
            raise ValueError("attention: scale must be >= 0 (0: 1/sqrt(D))")
        dev = q.device
        self.dtype = q.dtype
        self.acc = _compute(q.dtype)
        self.B, self.Hq, self.Hk, self.Tq, self.Tk, self.D = B, Hq, Hk, Tq, Tk, D
        self.causal, self.exclude_self = bool(causal), bool(exclude_self)
        self.window = window
        self.scale = scale if scale > 0 else 1.0 / math.sqrt(D) if D > 0 else 1.0
        self.path_scale = path_scale
        self.q, self.k, self.v = (self._rows(t) for t in (q, k, v))

        def positions(p, T, name):
            if p is None:
                return None
            if not ((p.dim() == 1 and p.shape[0] == T) or
                    (p.dim() == 2 and p.shape[0] == B and p.shape[1] == T)):
                raise ValueError(f"attention: {name} must be [{T}] or [{B}, {T}], got {_shape(p)}")
            if p.is_complex() or p.dtype == torch.bool:
                raise ValueError(f"attention: {name} must be real numbers")
            d = p.to(dtype=torch.float64)
            if not bool(torch.isfinite(d).all()):  # on the host for host positions (no sync)
                raise ValueError(f"attention: {name} contain NaN or Inf")
            return d.to(dev).contiguous()

        qp = positions(q_positions, Tq, "q_positions")
        kp = positions(k_positions, Tk, "k_positions")
        # explicit positions: both (the default of a missing one made explicit), each with its
        # batch stride (0: shared by the batch)
        self.pos = qp is not None or kp is not None
        if self.pos:
            if qp is None:
                qp = torch.arange(Tk - Tq, Tk, dtype=torch.float64, device=dev)
            if kp is None:
                kp = torch.arange(Tk, dtype=torch.float64, device=dev)
            if _small_integers(q_positions) and _small_integers(k_positions):
                # known (on the host, no device sync) to be integers: int32 lags (POS 2)
                qp, kp = qp.to(torch.int32), kp.to(torch.int32)
                self.pos = 2
        self.qp, self.kp = qp, kp
        self.spq = Tq if qp is not None and qp.dim() == 2 else 0
        self.spk = Tk if kp is not None and kp.dim() == 2 else 0

        self.bias = [None] * len(SLOTS)
        self.bias_dtype = [None if t is None else t.dtype for t in bias]
        acc = self.acc
        t = bias[_LAG]
        if t is not None:
            if t.dim() != 2 or t.shape[0] != Hq or t.shape[1] < 1:
                raise ValueError(f"attention: lag_table must be [{Hq}, L] with L >= 1, got "
                                 f"{_shape(t)}")
            if not _goes_with(t.dtype, q.dtype):
                raise ValueError("attention: lag_table must have q's dtype (or float32 beside "
                                 "half q)")
            self.bias[_LAG] = t.to(device=dev, dtype=acc).contiguous()
        t = bias[_SLOPES]
        if t is not None:
            if t.dim() != 1 or t.shape[0] != Hq:
                raise ValueError(f"attention: slopes must be [{Hq}], got {_shape(t)}")
            if not _goes_with(t.dtype, q.dtype):
                raise ValueError("attention: slopes must have q's dtype (or float32 beside "
                                 "half q)")
            self.bias[_SLOPES] = t.to(device=dev, dtype=acc).contiguous()
        tcq, tck = bias[_CQ], bias[_CK]
        if (tcq is None) != (tck is None):
            raise ValueError("attention: the per-token bias needs both cq and ck")
        if tcq is not None:
            if tuple(tcq.shape) != (B, Hq, Tq):
                raise ValueError(f"attention: cq must be [{B}, {Hq}, {Tq}], got {_shape(tcq)}")
            if tuple(tck.shape) != (B, Hq, Tk):
                raise ValueError(f"attention: ck must be [{B}, {Hq}, {Tk}], got {_shape(tck)}")
            if not tcq.is_floating_point() or not tck.is_floating_point():
                raise ValueError("attention: cq and ck must be floating point")
            self.bias[_CQ] = tcq.to(device=dev, dtype=torch.float64).contiguous()
            self.bias[_CK] = tck.to(device=dev, dtype=torch.float64).contiguous()

        def ids(x, shape, name):
            if x is None:
                return None
            if (tuple(x.shape) != shape or x.is_floating_point() or x.is_complex()
                    or x.dtype == torch.bool):
                raise ValueError(f"attention: {name} must be an integer tensor "
                                 f"[{', '.join(map(str, shape))}], got {_shape(x)}")
            return x.to(device=dev, dtype=torch.int64).contiguous()

        self.key_len = ids(key_len, (B,), "key_len")
        self.key_start = ids(key_start, (B,), "key_start")
        self.q_seg = ids(q_segments, (B, Tq), "q_segments")
        self.k_seg = ids(k_segments, (B, Tk), "k_segments")
        if (self.q_seg is None) != (self.k_seg is None):
            raise ValueError("attention: packed sequences need both q_segments and k_segments")
        for seg, name in ((self.q_seg, "q_segments"), (self.k_seg, "k_segments")):
            if seg is None or seg.shape[1] == 0:
                continue
            # each document one contiguous run of its row: as many runs as distinct ids
            starts = torch.ones_like(seg, dtype=torch.bool)
            starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
            srt = seg.sort(1).values
            distinct = 1 + (srt[:, 1:] != srt[:, :-1]).sum(1)
            bad = (starts.sum(1) != distinct).nonzero()
            if bad.numel():
                row = int(bad[0, 0])
                r = seg[row].tolist()
                seen, dup = set(), None
                for jj, x in enumerate(r):
                    if jj == 0 or x != r[jj - 1]:
                        if x in seen:
                            dup = x
                            break
                        seen.add(x)
                raise ValueError(f"attention: {name} row {row}: segment {dup} appears in two "
                                 "runs; each packed document must be one contiguous run of "
                                 "its row")

        def per_token(t, shape, name):
            if t is None:
                return None
            if tuple(t.shape) != shape:
                raise ValueError(f"attention: {name} must be [{', '.join(map(str, shape))}], "
                                 f"got {_shape(t)}")
            if not _goes_with(t.dtype, q.dtype):
                raise ValueError(f"attention: {name} must have q's dtype (or float32 beside "
                                 "half q)")
            return t.to(device=dev, dtype=acc).contiguous()

        self.bias[_GQ] = per_token(bias[_GQ], (B, Hq, Tq), "gq")
        self.bias[_GK] = per_token(bias[_GK], (B, Hq, Tk), "gk")
        tpq, tpk, tpb = bias[_PQ], bias[_PK], bias[_PB]
        if (tpq is None) != (tpk is None) or (tpq is None) != (tpb is None):
            raise ValueError("attention: the path integral needs path_q, path_k and path_beta "
                             "together")
        self.P = 0
        if tpq is not None:
            P = tpq.shape[3] if tpq.dim() == 4 else 0
            if P < 1:
                raise ValueError(f"attention: path_q must be [{B}, {Hq}, {Tq}, P], got "
                                 f"{_shape(tpq)}")
            self.bias[_PQ] = per_token(tpq, (B, Hq, Tq, P), "path_q")
            self.bias[_PK] = per_token(tpk, (B, Hq, Tk, P), "path_k")
            self.bias[_PB] = per_token(tpb, (Hq,), "path_beta")
            if not math.isfinite(path_scale):
                raise ValueError("attention: path_scale must be finite")
            self.P = P
        self.params = torch.tensor([self.scale, window, path_scale], dtype=torch.float64,
                                   device=dev)
        self._dummy = torch.zeros(1, dtype=acc, device=dev)

    @staticmethod
    def _rows(t):
        # rows read through their strides (a decode cache's prefix in place); only the head dim
        # must be unit-stride
        return t if t.stride(3) == 1 or t.shape[3] <= 1 else t.contiguous()

    def ptr(self, t):
        return self._dummy if t is None else t

    def flags(self):
        b = self.bias
        return dict(
            POS=int(self.pos), CAUSAL=self.causal, EXCLUDE_SELF=self.causal and self.exclude_self,
            WINDOW=self.window > 0, KEY_LEN=self.key_len is not None,
            KEY_START=self.key_start is not None, SEGMENTS=self.q_seg is not None,
            HAS_LAG=b[_LAG] is not None, HAS_SLOPES=b[_SLOPES] is not None,
            HAS_TOKEN=b[_CQ] is not None, HAS_GQ=b[_GQ] is not None, HAS_GK=b[_GK] is not None)

    def masks(self):
        return [self.ptr(t) for t in (self.qp, self.kp, self.key_len, self.key_start, self.q_seg,
                                      self.k_seg)]

    def biases(self, upto=_PB + 1):
        return [self.ptr(t) for t in self.bias[:upto]]

    def strides(self):
        q, k, v = self.q, self.k, self.v
        return [q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2)]

    def config(self, backward=False):
        """(BLOCK_M, BLOCK_N, num_warps, num_stages): small tiles under the interpreter (each
        program runs in NumPy), FlashAttention-2-like ones on a GPU by head dim."""
        if _interpreted(self.q):
            if backward == "dq" and self.P == 0:
                return 64, 16, 4, 1
            if backward == "dkdv" and self.P == 0:
                return 16, 64, 4, 1
            return 32, 32, 4, 1
        return device_tiles(backward, self.block_d, self.acc != torch.float32
                            or self.dtype == torch.float32)

    @property
    def block_d(self):
        return max(16, triton.next_power_of_2(self.D))

    @property
    def block_p(self):
        return max(16, triton.next_power_of_2(max(self.P, 1)))

    @property
    def dot(self):
        """The tile products' mode (_dot): fp32 in full precision (RELPOS_GPU_FP32_DOT=tf32x3:
        three TF32 products on the tensor cores, nearly as precise); half operands as they are
        on a GPU, widened under the interpreter; fp64 as is."""
        if self.dtype == torch.float32:
            fast = os.environ.get("RELPOS_GPU_FP32_DOT") == "tf32x3" and not _interpreted(self.q)
            return 3 if fast else 1
        if self.dtype in _HALF:
            return 2 if _interpreted(self.q) else 0
        return 0

    @property
    def pdot(self):
        """The path probes' products (operands in the compute dtype)."""
        return 1 if self.acc == torch.float32 else 0

    @property
    def tl_acc(self):
        return tl.float64 if self.acc == torch.float64 else tl.float32


@functools.lru_cache(maxsize=None)
def device_tiles(backward, block_d: int, wide: bool):
    """A GPU's (BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward (backward False) or the
    backward kernel "dq" / "dkdv", by padded head dim; wide: fp32/fp64 operands. (The compile
    check compiles every interpreted launch at these tiles too: tests/python/gpu/gpu_compile.py.)"""
    BD = block_d
    if backward:
        # (The Triton tutorial's asymmetric Hopper tiles, 128/32 pipelined, measured slower here
        # on an H200: 57.5 ms against 44.1 ms at T 16384; docs/gpu.md)
        if BD <= 64 and not wide:
            return 64, 64, 4, 2
        return (32, 64, 4, 1) if BD <= 128 else (32, 32, 8, 1)
    if wide:  # fp32/fp64 operands: twice the bytes per tile
        return (64, 64, 4, 2) if BD <= 64 else (64, 32, 4, 2)
    if BD <= 64:
        return 128, 64, 4, 3
    if BD <= 128:
        return 128, 64, 8, 2
    return 64, 32, 8, 1


def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _splits(c: _Call, rows_per_head: int, block_n: int) -> int:
    """Key splits of a decode call: enough programs to fill the device, at least two key tiles
    each."""
    tiles = triton.cdiv(c.Tk, block_n)
    programs = c.B * c.Hk * triton.cdiv(rows_per_head, 16)
    if _interpreted(c.q):
        want = 4  # exercised under the interpreter too
    else:
        want = triton.cdiv(2 * _multiprocessors(c.q.device.index or 0), programs)
    return max(1, min(want, tiles // 2))


def fused_attention(q, k, v, biases, q_positions=None, k_positions=None, causal=True, window=0.0,
                    key_len=None, scale=0.0, exclude_self=False, path_scale=1.0, key_start=None,
                    q_segments=None, k_segments=None):
    c = _Call(q, k, v, biases, q_positions, k_positions, causal, window, key_len, scale,
              exclude_self, path_scale, key_start, q_segments, k_segments)
    B, Hq, Hk, Tq, Tk, D = c.B, c.Hq, c.Hk, c.Tq, c.Tk, c.D
    out = torch.empty((B, Hq, Tq, D), dtype=c.dtype, device=q.device)
    lse = torch.empty((B, Hq, Tq), dtype=c.acc, device=q.device)
    if out.numel() == 0:
        return out, lse
    if Tk == 0:  # no key at all: every row is empty
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    G = Hq // Hk
    path = c.P > 0
    # decode: few queries; the query group of a kv head in one tile, keys split across programs
    grouped = Tq <= 8 and G * Tq <= 64 and not path
    BM, BN, warps, stages = c.config()
    rows = G * Tq if grouped else Tq
    if grouped:
        BM = max(16, triton.next_power_of_2(rows))
    splits = _splits(c, rows, BN) if grouped else 1
    heads = B * Hk if grouped else B * Hq
    grid = (triton.cdiv(rows, BM), heads, splits)
    if splits > 1:
        n = heads * rows
        o_part = torch.empty((splits, n, D), dtype=c.acc, device=q.device)
        m_part = torch.empty((splits, n), dtype=c.acc, device=q.device)
        l_part = torch.empty((splits, n), dtype=c.acc, device=q.device)
        dest = (o_part, c._dummy, m_part, l_part)
    else:
        dest = (out, lse, c._dummy, c._dummy)
    tiles = triton.cdiv(Tk, BN)
    _fwd_kernel[grid](
        c.q, c.k, c.v, *dest, *c.masks(), *c.biases(), c.params,
        *c.strides(), out.stride(0), out.stride(1), out.stride(2), c.spq, c.spk,
        Hq, Hk, Tq, Tk, D, c.bias[_LAG].shape[1] if c.bias[_LAG] is not None else 1, max(c.P, 1),
        rows, triton.cdiv(tiles, splits),
        G=G, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=c.block_d, BLOCK_P=c.block_p, ACC=c.tl_acc,
        DOT=c.dot, PDOT=c.pdot, GROUPED=grouped, SPLIT=splits > 1, PATH=path, **c.flags(),
        num_warps=warps, num_stages=stages)
    if splits > 1:
        o, l_ = _merge_splits(o_part, m_part, l_part)
        out.copy_(o.view(B, Hq, Tq, D))
        lse.copy_(l_.view(B, Hq, Tq))
    return out, lse


def _merge_splits(o_part, m_part, l_part):
    """Flash-decoding's merge of per-split (max, sum, unnormalised output) into the output and
    lse; a row no split saw gives zeros and lse = -inf."""
    m = m_part.amax(0)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w = torch.exp(m_part - m_safe)  # 0 for splits that saw nothing
    total = (w * l_part).sum(0)
    ok = total != 0  # (NaN stays NaN)
    o = (w.unsqueeze(-1) * o_part).sum(0) / torch.where(ok, total, torch.ones_like(total))[:, None]
    lse = torch.where(ok, m_safe + torch.log(torch.where(ok, total, torch.ones_like(total))),
                      torch.full_like(total, -math.inf))
    return o, lse


def fused_attention_backward(grad_out, q, k, v, out, lse, biases, q_positions, k_positions,
                             causal, window, key_len, scale, exclude_self, path_scale, key_start,
                             q_segments, k_segments, output_mask, grad_lse=None):
    c = _Call(q, k, v, biases, q_positions, k_positions, causal, window, key_len, scale,
              exclude_self, path_scale, key_start, q_segments, k_segments)
    B, Hq, Hk, Tq, Tk, D = c.B, c.Hq, c.Hk, c.Tq, c.Tk, c.D
    dev, acc = q.device, c.acc
    mask = [bool(x) for x in output_mask]
    if len(mask) != 3 + len(SLOTS):
        raise ValueError("attention backward: output_mask needs 12 entries")
    outc = out.to(acc)
    dout = grad_out.to(acc) if grad_out is not None else torch.zeros_like(outc)
    dlse = grad_lse.to(acc) if grad_lse is not None else None
    stored_as = (acc,) + ((c.dtype,) if c.dtype in _HALF else ())
    if (dout.shape != outc.shape or tuple(lse.shape) != (B, Hq, Tq) or lse.dtype != acc
            or out.dtype not in stored_as
            or (grad_out is not None and grad_out.dtype not in stored_as)
            or (dlse is not None and (dlse.shape != lse.shape or grad_lse.dtype != lse.dtype))):
        raise ValueError("attention backward: grad_out, out, lse or grad_lse does not match q")
    empty = torch.empty(0, dtype=acc, device=dev)
    need = [mask[i] and (i < 3 or c.bias[i - 3] is not None) for i in range(12)]
    # the kernels accumulate in the compute dtype (fp32 for half storage; atomics need it)
    dq = torch.empty((B, Hq, Tq, D), dtype=acc, device=dev) if need[0] else empty
    dk = torch.zeros((B, Hk, Tk, D), dtype=acc, device=dev) if need[1] else empty
    dv = torch.zeros((B, Hk, Tk, D), dtype=acc, device=dev) if need[2] else empty
    db = [torch.zeros(c.bias[i].shape, dtype=c.bias[i].dtype, device=dev) if need[3 + i]
          else empty for i in range(len(SLOTS))]
    if Tk > 0 and q.numel() > 0 and any(need):
        # Delta_i = dO_i . O_i - dL/dlse_i (the lse gradient enters here)
        delta = (dout * outc).sum(-1)
        if dlse is not None:
            delta = delta - dlse
        delta = delta.contiguous()
        # dL/dlse per row for the path integral's edge gradients (0 where no key is visible)
        dlse_rows = c._dummy
        if c.P:
            dlse_rows = torch.zeros_like(lse) if dlse is None else \
                torch.where(torch.isinf(lse), torch.zeros_like(dlse), dlse).contiguous()
        dout = dout.to(c.dtype).contiguous()  # the dot operands in the storage dtype
        lsec = lse.contiguous()
        G = Hq // Hk
        path = c.P > 0
        L = c.bias[_LAG].shape[1] if c.bias[_LAG] is not None else 1
        ptr = lambda t: t if t.numel() else c._dummy  # noqa: E731
        flags = c.flags()

        def tiles(kernel):
            BM, BN, warps, stages = c.config(backward=kernel)
            return dict(G=G, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=c.block_d, ACC=c.tl_acc, DOT=c.dot,
                        num_warps=warps, num_stages=stages, **flags)
        need_dq_kernel = path or need[0] or need[3 + _CQ] or need[3 + _GQ]
        need_kv_kernel = not path and (need[1] or need[2] or need[3 + _LAG] or need[3 + _SLOPES]
                                       or need[3 + _CK] or need[3 + _GK])
        if need_dq_kernel:
            common = tiles("dq")
            _bwd_dq_kernel[(triton.cdiv(Tq, common["BLOCK_M"]), B * Hq)](
                c.q, c.k, c.v, dout, lsec, delta, dlse_rows, ptr(dq), ptr(dk), ptr(dv),
                *c.masks(),
                *c.biases(), c.params, *(ptr(t) for t in db), *c.strides(), c.spq, c.spk,
                Hq, Hk, Tq, Tk, D, L, max(c.P, 1), BLOCK_P=c.block_p, PDOT=c.pdot, FUSED=path,
                PATH=path,
                NEED_DQ=need[0], NEED_DK=need[1], NEED_DV=need[2], NEED_LAG=need[3 + _LAG],
                NEED_SLOPES=need[3 + _SLOPES], NEED_CQ=need[3 + _CQ], NEED_CK=need[3 + _CK],
                NEED_GQ=need[3 + _GQ], NEED_GK=need[3 + _GK], NEED_PQ=need[3 + _PQ],
                NEED_PK=need[3 + _PK], NEED_PB=need[3 + _PB], **common)
        if need_kv_kernel:
            common = tiles("dkdv")
            _bwd_dkdv_kernel[(triton.cdiv(Tk, common["BLOCK_N"]), B * Hk)](
                c.q, c.k, c.v, dout, lsec, delta, ptr(dk), ptr(dv), *c.masks(),
                *c.biases(_PQ), c.params, ptr(db[_LAG]), ptr(db[_SLOPES]), ptr(db[_CK]),
                ptr(db[_GK]), *c.strides(), c.spq, c.spk, Hq, Hk, Tq, Tk, D, L,
                NEED_DK=need[1], NEED_DV=need[2], NEED_LAG=need[3 + _LAG],
                NEED_SLOPES=need[3 + _SLOPES], NEED_CK=need[3 + _CK], NEED_GK=need[3 + _GK],
                **common)
    elif need[0] or need[1] or need[2]:
        for t in (dq, dk, dv):
            t.zero_()
    # every gradient back in its operand's dtype
    grads = [t.to(dt) if t.numel() else t for t, dt in ((dq, q.dtype), (dk, k.dtype),
                                                      (dv, v.dtype))]
    db = [t.to(c.bias_dtype[i]) if t.numel() else t for i, t in enumerate(db)]
    return grads[0], grads[1], grads[2], db


OPS = {"fused_attention": fused_attention, "fused_attention_backward": fused_attention_backward}
