"""Triton kernels of the position-wise transforms: ``relpos::trig_table``, ``relpos::transform``
and ``relpos::transform_backward`` (schemas in ``src/torch/ops.cpp``), the GPU counterpart of
``src/kernels/transform*.hpp``.

Every Jordan-block mechanism acts on each block of ``m`` consecutive complex coordinate pairs as
``N (x) R``: ``R`` the rotation by the angle ``-omega_b (p - c0)`` (the trig table, as the CPU
kernels' ``fill_trig_table``), ``N`` the ``m x m`` Toeplitz mixing of the block's pairs by a
per-(position, head, block) coefficient series (``tile_series`` in ``transform_tiles.hpp``)::

    keys     A      y_r = sum_{c>=r} ck_{c-r} (R x)_c     ck_k = e^{+gamma p} c_k(u)
    queries  A^-T   y_r = sum_{c<=r} cq_{r-c} (R x)_c     cq_k = e^{-gamma p} ic_k(u)
    A^T (key input gradients) and A^-1 (query input gradients): R^T and the other triangle,

``u = s sigma(-p)``, ``c_k`` the exponential shear ``(eta u)^k / k!`` or the jet gates
``alpha_0, g_k u^k / k!``, ``ic`` its power-series inverse, ``|gamma p|`` clamped at ``max_exp``.

The coefficient tables are computed here in torch (float64, then the compute dtype),
differentiably in gamma / eta / gates / alpha0; one Triton kernel applies them (or, for plain
rotations, only the cos/sin table) to a tensor, reading each element once from memory. The
backward runs the same kernel with the transposed roles for the input gradients, and a second
kernel reduces ``<R^T grad, x>`` products into gradients of the coefficient tables (summed over
the batch), which the chain rule of the table computation (``_coefficient_grads``) turns into
the parameter gradients: exact, with no per-parameter kernel code.

The block structure (which pairs form which block of which order, damping, shear mode, chart,
exponent clamp) is the position term's segments in the mechanism JSON (``_structure``), the same
data the CPU kernels' plan is built from; the frequencies come from ``relpos::frequencies`` at the
call's context length (a dynamic context-extension rule rescales them per call). What that data
cannot describe (a chart or shear this module does not know; a dynamic rule at a context length
<= 0) runs on the CPU operator (copies to the host and back).
"""

from __future__ import annotations

import functools
import json
import os

import torch
import triton
import triton.language as tl

from .common import compute

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_HALF = (torch.bfloat16, torch.float16)
_STORABLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_MAX_POSITION = 2.0 ** 53


def _compute_dtype(dtype):
    return torch.float32 if dtype in _HALF else dtype


# ---- the mechanism's block structure ----------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _info(spec: str, head_dim: int, heads: int) -> dict:
    try:
        return json.loads(torch.ops.relpos.mechanism(spec, head_dim, heads))
    except RuntimeError as e:  # the op's named errors are ValueErrors already
        raise ValueError(str(e)) from None


@functools.lru_cache(maxsize=256)
def _pair_frequencies(spec: str, head_dim: int, heads: int, length: float) -> torch.Tensor:
    """-omega per complex pair (0 where no segment covers it), float64 [D/2]; length > 0: the
    context-extension rule at that context length (the op's scaled_for_length)."""
    return torch.ops.relpos.frequencies(spec, head_dim, heads, length)


# The segments' charts sigma(t) with scale L (chart_value in core/charts.hpp) and shear modes, by
# their names in the mechanism JSON (core/types.hpp); a block's chart and shear codes below are
# indices in _CHARTS and _SHEARS.
_CHART_VALUES = {
    "raw": lambda t, L: t,
    "bounded_tau": lambda t, L: t / (1.0 + t.abs() / L),
    "lightcone_phi": lambda t, L: L * torch.asinh(t / L),
    "lightcone_beta": lambda t, L: t / torch.sqrt(t * t + L * L),
}
_CHARTS = tuple(_CHART_VALUES)
_SHEARS = ("none", "exponential", "gates")


class Structure:
    """The position term's Jordan blocks, from its segments in the mechanism JSON (JordanSegment
    in core/mechanism.hpp, read by the CPU kernels as kernels::TransformPlan). Per global block b:
    its pairs [first[b], first[b] + order[b]), damped, shear (index in _SHEARS), chart (index in
    _CHARTS) with its L, shear scale s (u = s sigma(-p)) and exponent clamp max_exp; per pair j:
    block (-1: untouched), rank in the block, block order."""

    def __init__(self, segments, head_dim):
        nb = max((s["first_block"] + s["blocks"] for s in segments), default=0)
        first, order, damped, shear = [None] * nb, [1] * nb, [False] * nb, [0] * nb
        chart, chart_l, scale, max_exp = [0] * nb, [1.0] * nb, [1.0] * nb, [30.0] * nb
        for s in segments:
            if s["shear"] not in _SHEARS or s["chart"] not in _CHARTS:
                raise Unsupported(f"a segment of chart {s['chart']!r}, shear {s['shear']!r}")
            shear_code, chart_code = _SHEARS.index(s["shear"]), _CHARTS.index(s["chart"])
            for i in range(s["blocks"]):
                b = s["first_block"] + i
                first[b], order[b] = s["first_pair"] + i * s["order"], s["order"]
                damped[b], shear[b] = bool(s["damped"]), shear_code
                chart[b], chart_l[b] = chart_code, float(s["L"])
                scale[b], max_exp[b] = float(s["shear_scale"]), float(s["max_exponent"])
        if None in first:
            raise Unsupported("a block index that no segment covers")
        self.nb = nb
        self.first, self.order, self.damped, self.shear = first, order, damped, shear
        self.chart, self.chart_l, self.scale, self.max_exp = chart, chart_l, scale, max_exp
        # the half-split layout pairs (j, j + covered) over the covered pairs (pair_span in
        # kernels/transform_driver.hpp)
        self.covered = max((s["first_pair"] + s["blocks"] * s["order"] for s in segments),
                           default=0)
        self.head_dim = head_dim
        self.max_order = max(order) if order else 1
        pairs = head_dim // 2
        blk, rin, ordp = [-1] * pairs, [0] * pairs, [1] * pairs
        for b in range(nb):
            for r in range(order[b]):
                blk[first[b] + r], rin[first[b] + r], ordp[first[b] + r] = b, r, order[b]
        self.pair_block, self.pair_rank, self.pair_order = blk, rin, ordp
        # a plain rotation everywhere: the cos/sin table alone (RoPE and its extensions)
        self.has_gates = 2 in shear
        self.plain = all(o == 1 and not d and s != 2 for o, d, s in zip(order, damped, shear))
        # plain, with pair j < covered turned by block j (every catalogue RoPE): _rotate_kernel
        self.rotation_only = self.plain and nb > 0 and blk == (
            list(range(self.covered)) + [-1] * (pairs - self.covered)) and nb == self.covered
        self._device_cache = {}

    def pair_tables(self, device):
        key = str(device)
        if key not in self._device_cache:
            t = torch.tensor([self.pair_block, self.pair_rank, self.pair_order], dtype=torch.int32)
            f = torch.tensor(self.first, dtype=torch.int64)
            blocks = torch.tensor(self.pair_block, dtype=torch.int64)
            self._device_cache[key] = (t.to(device), f.to(device), blocks.to(device))
        return self._device_cache[key]

    def block_tensors(self, device):
        key = ("blocks", str(device))
        if key not in self._device_cache:
            f64 = dict(dtype=torch.float64, device=device)
            self._device_cache[key] = dict(
                damped=torch.tensor(self.damped, dtype=torch.bool, device=device),
                shear=torch.tensor(self.shear, dtype=torch.int64, device=device),
                chart=torch.tensor(self.chart, dtype=torch.int64, device=device),
                chart_l=torch.tensor(self.chart_l, **f64),
                scale=torch.tensor(self.scale, **f64),
                max_exp=torch.tensor(self.max_exp, **f64),
                order=torch.tensor(self.order, dtype=torch.int64, device=device),
            )
        return self._device_cache[key]


class Unsupported(Exception):
    """What the mechanism JSON does not let this module describe: the op runs on the host."""


@functools.lru_cache(maxsize=256)
def _structure(spec: str, head_dim: int, heads: int) -> Structure:
    """The block structure of the spec's position term (the first Jordan-block term, as
    Mechanism::position_term), from its segments in the mechanism JSON."""
    info = _info(spec, head_dim, heads)
    term = next((t for t in info["transforms"] if t["kind"] == "jordan_blocks"), None)
    st = Structure(term["segments"] if term else [], head_dim)
    if st.nb != int(info["total_blocks"]):
        raise Unsupported(f"{st.nb} blocks in the segments, {info['total_blocks']} in the "
                          "mechanism")
    return st


def _chart_value(st, t, bt):
    """sigma(t) of each block's chart: t [..., 1] to [..., NB]."""
    L = bt["chart_l"]
    out = t.expand(*t.shape[:-1], st.nb)  # raw
    for code in set(st.chart) - {_CHARTS.index("raw")}:
        out = torch.where(bt["chart"] == code, _CHART_VALUES[_CHARTS[code]](t, L), out)
    return out


# ---- tables -------------------------------------------------------------------------------------


def _trig(st, freqs, pc, dtype):
    """cos / sin of -omega_b (p - c0), [rows, T, NB] in dtype (float64 angles)."""
    if st.nb == 0:
        z = torch.zeros(*pc.shape, 0, dtype=dtype, device=pc.device)
        return z, z
    _, first, _ = st.pair_tables(pc.device)
    f = freqs.to(pc.device)[first]  # -omega_b
    ang = pc[..., None] * f  # omega p with omega = -f: cos(-omega p) = cos(f p)
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def _series(st, gamma, eta, gates, alpha0, pc):
    """The unscaled series c_k, its inverse ic_k (lists of [R, T, H, NB], float64), the damping
    factors ek, eq, the unclamped damping exponent's mask and u, for positions pc [R, T]."""
    dev = pc.device
    bt = st.block_tensors(dev)
    M = st.max_order
    p = pc[:, :, None, None]  # [R, T, 1, 1]
    g = gamma.to(torch.float64)
    X = bt["max_exp"]  # per block
    zero_s = torch.zeros((), dtype=torch.float64, device=dev)
    a = torch.where(bt["damped"], g[None, None] * p, zero_s)  # [R, T, H, NB]
    free = bt["damped"] & (a.abs() <= X)  # where d exponent / d gamma = p (no binding clamp)
    a = torch.maximum(torch.minimum(a, X), -X)
    ek, eq = torch.exp(a), torch.exp(-a)
    u = bt["scale"] * _chart_value(st, -p, bt)  # [R, T, 1, NB]
    u = u.expand(ek.shape)
    one = torch.ones(ek.shape, dtype=torch.float64, device=dev)
    zero = torch.zeros(ek.shape, dtype=torch.float64, device=dev)
    is_exp = bt["shear"] == 1
    is_gate = bt["shear"] == 2
    x = torch.where(is_exp, eta.to(torch.float64)[None, None] * u, zero) if M > 1 else zero
    c = [torch.where(is_gate, alpha0.to(torch.float64)[None, None] + zero, one)]
    pw = one
    for kk in range(1, M):
        pw = pw * u / kk
        ce = c[-1] * x / kk
        cg = gates[kk - 1].to(torch.float64)[None, None] * pw if st.has_gates and gates.numel() else zero
        c.append(torch.where(bt["order"] > kk, torch.where(is_gate, cg, ce), zero))
    ic = [1.0 / c[0]]
    for kk in range(1, M):
        acc = zero
        for jj in range(1, kk + 1):
            acc = acc + c[jj] * ic[kk - jj]
        ic.append(-acc / c[0])
    return c, ic, ek, eq, free, u, x


def _coefficients(st, gamma, eta, gates, alpha0, pc, want_key, want_query, dtype=torch.float64):
    """The scaled coefficient series ck / cq [rows, T, H, NB, M] (float64 math, stored in
    dtype)."""
    c, ic, ek, eq, _, _, _ = _series(st, gamma, eta, gates, alpha0, pc)
    key = torch.stack([ci * ek for ci in c], -1).to(dtype) if want_key else None
    query = torch.stack([ci * eq for ci in ic], -1).to(dtype) if want_query else None
    return key, query


def _coefficient_grads(st, gamma, eta, gates, alpha0, pc, dck, dcq):
    """Gradients of gamma, eta, gates, alpha0 (float64, their shapes) from the gradients of the
    coefficient tables dck / dcq [R, T, H, NB, M] (either None): the chain rule of _series by
    hand (a backend kernel runs below autograd, so no graph is recorded here)."""
    c, ic, ek, eq, free, u, _ = _series(st, gamma, eta, gates, alpha0, pc)
    bt = st.block_tensors(pc.device)
    M = st.max_order
    f64 = torch.float64
    zero = torch.zeros(ek.shape, dtype=f64, device=pc.device)
    K = [dck[..., kk].to(f64) * ek for kk in range(M)] if dck is not None else None  # dL/dc_k
    Q = [dcq[..., kk].to(f64) * eq for kk in range(M)] if dcq is not None else None  # dL/dic_k
    # d exponent: d ek = ek d a, d eq = -eq d a
    da = zero
    for kk in range(M):
        if K is not None:
            da = da + K[kk] * c[kk]
        if Q is not None:
            da = da - Q[kk] * ic[kk]
    p = pc[:, :, None, None]
    dgamma = torch.where(free, da * p, zero).sum((0, 1))
    # the series: dL/dc_j from the keys, and through ic = c^{-1} (d ic = -ic dc ic) from the queries
    dc = [K[j] if K is not None else zero for j in range(M)]
    if Q is not None:
        p2 = [sum(ic[i] * ic[kk - i] for i in range(kk + 1)) for kk in range(M)]
        for j in range(M):
            for kk in range(j, M):
                dc[j] = dc[j] - Q[kk] * p2[kk - j]
    is_exp = bt["shear"] == 1
    is_gate = bt["shear"] == 2
    deta = zero
    if M > 1:
        # exponential shear: c_k = x^k / k!, dc_k / dx = c_{k-1}; x = eta u
        dx = zero
        for kk in range(1, M):
            dx = dx + torch.where(bt["order"] > kk, dc[kk] * c[kk - 1], zero)
        deta = torch.where(is_exp, dx * u, zero)
    deta = deta.sum((0, 1))
    dalpha0 = torch.where(is_gate, dc[0], zero).sum((0, 1))
    dgates = torch.zeros(gates.shape, dtype=f64, device=pc.device)
    if st.has_gates and gates.numel():
        pw = torch.ones(ek.shape, dtype=f64, device=pc.device)
        for kk in range(1, M):
            pw = pw * u / kk
            dgates[kk - 1] = torch.where(is_gate & (bt["order"] > kk), dc[kk] * pw, zero).sum((0, 1))
    return dgamma, deta, dgates, dalpha0


# ---- kernels ------------------------------------------------------------------------------------


@triton.jit
def _map_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, coef_ptr, pair_ptr, T, H, NB, NPAIRS, NCOV, D,
                PER_BATCH: tl.constexpr, M: tl.constexpr, HAS_COEF: tl.constexpr,
                UPPER: tl.constexpr, TRANSPOSED: tl.constexpr, HALF_SPLIT: tl.constexpr,
                F64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    """y = role(A) x for BLOCK_T tokens of one (batch, head): every pair of the head row at once,
    each pair's block partners gathered from the same rows (read from memory once)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_P)
    tmask = t < T
    jmask = j < NPAIRS
    m2 = tmask[:, None] & jmask[None, :]
    row = (bh.to(tl.int64) * T + t) * D
    prow = b * PER_BATCH
    trow = (prow.to(tl.int64) * T + t) * NB
    blk = tl.load(pair_ptr + j, mask=jmask, other=-1)
    cov = blk >= 0
    bidx = tl.maximum(blk, 0)
    mc = m2 & cov[None, :]
    c = tl.load(cos_ptr + trow[:, None] + bidx[None, :], mask=mc, other=1.0)
    s = tl.load(sin_ptr + trow[:, None] + bidx[None, :], mask=mc, other=0.0)
    c = compute(c, F64)
    s = compute(s, F64)
    if TRANSPOSED:
        s = -s
    if HALF_SPLIT:
        re = tl.where(j < NCOV, j, 2 * j)
        im = tl.where(j < NCOV, j + NCOV, 2 * j + 1)
    else:
        re = 2 * j
        im = 2 * j + 1
    crow = ((prow.to(tl.int64) * T + t) * H + h) * NB  # [BT]
    if M == 1:
        xr = tl.load(x_ptr + row[:, None] + re[None, :], mask=m2, other=0.0)
        xi = tl.load(x_ptr + row[:, None] + im[None, :], mask=m2, other=0.0)
        xr = compute(xr, F64)
        xi = compute(xi, F64)
        yr = xr * c - xi * s
        yi = xr * s + xi * c
        if HAS_COEF:
            w = tl.load(coef_ptr + crow[:, None] + bidx[None, :], mask=mc, other=1.0)
            w = compute(w, F64)
            yr = yr * w
            yi = yi * w
    else:
        rin = tl.load(pair_ptr + NPAIRS + j, mask=jmask, other=0)
        mord = tl.load(pair_ptr + 2 * NPAIRS + j, mask=jmask, other=1)
        if F64:
            yr = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float64)
        else:
            yr = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
        yi = yr
        for k in tl.static_range(M):
            if UPPER:
                jp = j + k
                ok = (rin + k) < mord
            else:
                jp = j - k
                ok = (rin - k) >= 0
            jp = tl.where(ok, jp, j)
            if HALF_SPLIT:
                rep = tl.where(jp < NCOV, jp, 2 * jp)
                imp = tl.where(jp < NCOV, jp + NCOV, 2 * jp + 1)
            else:
                rep = 2 * jp
                imp = 2 * jp + 1
            mk = m2 & ok[None, :]
            xr = tl.load(x_ptr + row[:, None] + rep[None, :], mask=mk, other=0.0)
            xi = tl.load(x_ptr + row[:, None] + imp[None, :], mask=mk, other=0.0)
            w = tl.load(coef_ptr + (crow[:, None] + bidx[None, :]) * M + k, mask=mk & cov[None, :],
                        other=0.0)
            xr = compute(xr, F64)
            xi = compute(xi, F64)
            w = compute(w, F64)
            if k == 0:
                w = tl.where(cov[None, :], w, 1.0)
            yr += w * (xr * c - xi * s)
            yi += w * (xr * s + xi * c)
    tl.store(y_ptr + row[:, None] + re[None, :], yr.to(y_ptr.dtype.element_ty), mask=m2)
    tl.store(y_ptr + row[:, None] + im[None, :], yi.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _rotate_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, flag_ptr, T, H, NB, NCOV, D,
                   PER_BATCH: tl.constexpr, TRANSPOSED: tl.constexpr, HALF_SPLIT: tl.constexpr,
                   CHECK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """The plain rotation (RoPE and its extensions: pair j < NCOV turned by table entry j, the
    rest copied) as a stream: whole rows read and written with affine, vectorisable addresses.
    CHECK: a non-finite output sets flag_ptr[0] (the finiteness check inside the one pass)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    row = (bh.to(tl.int64) * T + t) * D
    trow = ((b * PER_BATCH).to(tl.int64) * T + t) * NB
    if HALF_SPLIT:
        # pairs (j, j + NCOV): two contiguous halves, then the untouched tail [2 NCOV, D)
        j = tl.arange(0, BLOCK_P)
        m = tmask[:, None] & (j < NCOV)[None, :]
        c = tl.load(cos_ptr + trow[:, None] + j[None, :], mask=m, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + trow[:, None] + j[None, :], mask=m, other=0.0).to(tl.float32)
        if TRANSPOSED:
            s = -s
        xr = tl.load(x_ptr + row[:, None] + j[None, :], mask=m, other=0.0).to(tl.float32)
        xi = tl.load(x_ptr + row[:, None] + NCOV + j[None, :], mask=m, other=0.0).to(tl.float32)
        yr = xr * c - xi * s
        yi = xr * s + xi * c
        tl.store(y_ptr + row[:, None] + j[None, :], yr.to(y_ptr.dtype.element_ty), mask=m)
        tl.store(y_ptr + row[:, None] + NCOV + j[None, :], yi.to(y_ptr.dtype.element_ty), mask=m)
        bad = tl.sum(tl.sum(((yr != yr) | (tl.abs(yr) == float("inf")) | (yi != yi)
                             | (tl.abs(yi) == float("inf"))) & m, 1), 0)
        e = 2 * NCOV + tl.arange(0, BLOCK_D)
        me = tmask[:, None] & (e < D)[None, :]
        xt = tl.load(x_ptr + row[:, None] + e[None, :], mask=me, other=0.0)
        tl.store(y_ptr + row[:, None] + e[None, :], xt, mask=me)
        xtf = xt.to(tl.float32)
        bad += tl.sum(tl.sum(((xtf != xtf) | (tl.abs(xtf) == float("inf"))) & me, 1), 0)
    else:
        # interleaved pairs (2j, 2j + 1): the whole row at once, split into its pairs
        e = tl.arange(0, BLOCK_D)
        me = tmask[:, None] & (e < D)[None, :]
        x = tl.load(x_ptr + row[:, None] + e[None, :], mask=me, other=0.0).to(tl.float32)
        xr, xi = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_D // 2, 2)))
        j = tl.arange(0, BLOCK_D // 2)
        m = tmask[:, None] & (j < NCOV)[None, :]
        c = tl.load(cos_ptr + trow[:, None] + j[None, :], mask=m, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + trow[:, None] + j[None, :], mask=m, other=0.0).to(tl.float32)
        if TRANSPOSED:
            s = -s
        y = tl.reshape(tl.join(xr * c - xi * s, xr * s + xi * c), (BLOCK_T, BLOCK_D))
        tl.store(y_ptr + row[:, None] + e[None, :], y.to(y_ptr.dtype.element_ty), mask=me)
        bad = tl.sum(tl.sum(((y != y) | (tl.abs(y) == float("inf"))) & me, 1), 0)
    if CHECK:
        if bad > 0:
            tl.atomic_max(flag_ptr, 1)


@triton.jit
def _coef_grad_kernel(x_ptr, g_ptr, cos_ptr, sin_ptr, out_ptr, pair_ptr, T, H, NB, NPAIRS, NCOV,
                      D, NLOOP, PER_BATCH: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                      UPPER: tl.constexpr, HALF_SPLIT: tl.constexpr, F64: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    """out[row, t, h, j, k] = sum over the batch rows sharing positions row of
    <R^T g_j, x_{j+k}> (UPPER, keys) or <R^T g_j, x_{j-k}> (queries): the gradient of the
    coefficient table entry k of j's block, before the sum over the block's pairs."""
    pid_t = tl.program_id(0)
    rh = tl.program_id(1)
    prow = rh // H
    h = rh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_P)
    kk = tl.arange(0, MP)
    tmask = t < T
    jmask = j < NPAIRS
    m2 = tmask[:, None] & jmask[None, :]
    blk = tl.load(pair_ptr + j, mask=jmask, other=-1)
    rin = tl.load(pair_ptr + NPAIRS + j, mask=jmask, other=0)
    mord = tl.load(pair_ptr + 2 * NPAIRS + j, mask=jmask, other=1)
    cov = blk >= 0
    bidx = tl.maximum(blk, 0)
    mc = m2 & cov[None, :]
    trow = (prow.to(tl.int64) * T + t) * NB
    c = tl.load(cos_ptr + trow[:, None] + bidx[None, :], mask=mc, other=1.0)
    s = tl.load(sin_ptr + trow[:, None] + bidx[None, :], mask=mc, other=0.0)
    c = compute(c, F64)
    s = compute(s, F64)
    if HALF_SPLIT:
        re = tl.where(j < NCOV, j, 2 * j)
        im = tl.where(j < NCOV, j + NCOV, 2 * j + 1)
    else:
        re = 2 * j
        im = 2 * j + 1
    if UPPER:
        jp = j[:, None] + kk[None, :]
        ok = (rin[:, None] + kk[None, :]) < mord[:, None]
    else:
        jp = j[:, None] - kk[None, :]
        ok = (rin[:, None] - kk[None, :]) >= 0
    ok = ok & (kk[None, :] < M) & cov[:, None]
    jp = tl.where(ok, jp, j[:, None])  # [BP, MP]
    if HALF_SPLIT:
        rep = tl.where(jp < NCOV, jp, 2 * jp)
        imp = tl.where(jp < NCOV, jp + NCOV, 2 * jp + 1)
    else:
        rep = 2 * jp
        imp = 2 * jp + 1
    m3 = m2[:, :, None] & ok[None, :, :]
    if F64:
        acc = tl.zeros([BLOCK_T, BLOCK_P, MP], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_P, MP], dtype=tl.float32)
    for i in range(NLOOP):
        bb = prow * PER_BATCH + i  # PER_BATCH: NLOOP = 1
        row = ((bb.to(tl.int64) * H + h) * T + t) * D
        gr = tl.load(g_ptr + row[:, None] + re[None, :], mask=m2, other=0.0)
        gi = tl.load(g_ptr + row[:, None] + im[None, :], mask=m2, other=0.0)
        xr = tl.load(x_ptr + row[:, None, None] + rep[None, :, :], mask=m3, other=0.0)
        xi = tl.load(x_ptr + row[:, None, None] + imp[None, :, :], mask=m3, other=0.0)
        gr = compute(gr, F64)
        gi = compute(gi, F64)
        xr = compute(xr, F64)
        xi = compute(xi, F64)
        wr = gr * c + gi * s
        wi = gi * c - gr * s
        acc += wr[:, :, None] * xr + wi[:, :, None] * xi
    orow = ((prow.to(tl.int64) * T + t) * H + h) * NPAIRS
    optr = out_ptr + ((orow[:, None] + j[None, :]) * M)[:, :, None] + kk[None, None, :]
    tl.store(optr, acc, mask=m2[:, :, None] & (kk[None, None, :] < M))


def _blocks(D):
    bp = triton.next_power_of_2(max(D // 2, 1))
    if _INTERPRET:
        return 128, bp  # few, large programs: the interpreter runs each one in NumPy
    return max(1, min(64, 4096 // bp)), bp


def _warps(elements):
    return 4 if elements <= 2048 else 8


def _apply(st, x, cos, sin, coef, per_batch, *, upper, transposed, half_split, out_dtype,
           flag=None):
    B, H, T, D = x.shape
    y = torch.empty((B, H, T, D), dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return y
    if st.rotation_only and coef is None and x.dtype != torch.float64:
        # the common case (RoPE): a streaming kernel with the finiteness check inside its pass
        bd = triton.next_power_of_2(D)
        bt = 32 if _INTERPRET else max(1, min(64, 8192 // bd))
        _rotate_kernel[(triton.cdiv(T, bt), B * H)](
            x, y, cos, sin, flag if flag is not None else y, T, H, st.nb, st.covered, D,
            PER_BATCH=int(per_batch), TRANSPOSED=transposed, HALF_SPLIT=half_split,
            CHECK=flag is not None, BLOCK_T=bt, BLOCK_P=triton.next_power_of_2(max(st.covered, 1)),
            BLOCK_D=bd, num_warps=4 if bt * bd <= 4096 else 8)
        return y
    if flag is not None:
        raise AssertionError("the in-pass finiteness check is the rotation kernel's")
    pair, _, _ = st.pair_tables(x.device)
    bt, bp = _blocks(D)
    M = st.max_order
    has_coef = coef is not None
    f64 = x.dtype == torch.float64
    grid = (triton.cdiv(T, bt), B * H)
    _map_kernel[grid](x, y, cos, sin, coef if has_coef else cos, pair, T, H, st.nb, D // 2,
                      st.covered, D, PER_BATCH=int(per_batch), M=M, HAS_COEF=has_coef,
                      UPPER=upper, TRANSPOSED=transposed, HALF_SPLIT=half_split, F64=f64,
                      BLOCK_T=bt, BLOCK_P=bp, num_warps=_warps(bt * bp))
    return y


def _coef_grad(st, x, g, cos, sin, per_batch, *, upper, half_split):
    """d loss / d coefficient table [rows, T, H, NB, M] from the output gradient g and the input
    x of one role (summed over the batch rows that share positions)."""
    B, H, T, D = x.shape
    M = st.max_order
    rows = B if per_batch else 1
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    part = torch.empty((rows, T, H, D // 2, M), dtype=cdt, device=x.device)
    pair, _, blocks = st.pair_tables(x.device)
    bt, bp = _blocks(D)
    bt = max(1, bt // triton.next_power_of_2(M)) if not _INTERPRET else bt
    grid = (triton.cdiv(T, bt), rows * H)
    _coef_grad_kernel[grid](x, g, cos, sin, part, pair, T, H, st.nb, D // 2, st.covered, D,
                            1 if per_batch else B, PER_BATCH=int(per_batch), M=M,
                            MP=triton.next_power_of_2(M), UPPER=upper, HALF_SPLIT=half_split,
                            F64=cdt == torch.float64, BLOCK_T=bt, BLOCK_P=bp,
                            num_warps=_warps(bt * bp * triton.next_power_of_2(M)))
    idx = torch.where(blocks >= 0, blocks, st.nb)
    out = torch.zeros((rows, T, H, st.nb + 1, M), dtype=cdt, device=x.device)
    out.index_add_(3, idx, part)
    return out[:, :, :, : st.nb]


# ---- the operators ------------------------------------------------------------------------------


def _check_inputs(q, k, positions):
    if not (q.dim() == 4 and k.shape == q.shape):
        raise RuntimeError("relpos: q and k must be [B, H, T, D] of one shape")
    if q.dtype != k.dtype:
        raise RuntimeError("relpos: q and k must have one dtype")
    if q.dtype not in _STORABLE:
        raise RuntimeError("relpos: q and k must be float32, float64, bfloat16 or float16")
    if positions.dtype != torch.float64:
        raise RuntimeError("relpos: positions must be float64")
    if not ((positions.dim() == 1 and positions.shape[0] == q.shape[2])
            or (positions.dim() == 2 and positions.shape[0] == q.shape[0]
                and positions.shape[1] == q.shape[2])):
        raise RuntimeError("relpos: positions must be [T] or [B, T]")


def _checked_positions(positions):
    if positions.numel() and not bool(torch.isfinite(positions).all()):
        raise ValueError("positions contain NaN or Inf")
    if positions.numel() and float(positions.abs().max()) > _MAX_POSITION:
        raise ValueError(
            f"positions span [{float(positions.min())}, {float(positions.max())}], beyond +-2^53 = "
            f"{int(_MAX_POSITION)}, where float64 no longer holds every integer: shift them (only "
            "differences matter to an exact mechanism)")


def _frequencies_for(spec, head_dim, heads, positions):
    info = _info(spec, head_dim, heads)
    length = 0.0
    if info["rope_scaling_dynamic"] and positions.numel():
        length = float(positions.max()) + 1.0
        if not length > 0:  # the frequencies op reads a length <= 0 as "the rule as built"
            raise Unsupported("a dynamic context-extension rule at a context length <= 0")
    return _pair_frequencies(spec, head_dim, heads, length)


def _structure_or_none(spec, head_dim, heads):
    if head_dim <= 0 or heads <= 0:
        _info(spec, head_dim, heads)  # the op's named error
    try:
        return _structure(spec, head_dim, heads)
    except Unsupported:
        return None


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _on_cpu(name, args, device):
    """The CPU operator on host copies, the results moved back: the fallback for what the
    mechanism JSON and the frequencies op do not describe (Unsupported)."""
    with torch.no_grad():
        out = getattr(torch.ops.relpos, name)(*_to_cpu(args))
    if isinstance(out, (tuple, list)):
        return tuple(o.to(device) for o in out)
    return out.to(device)


def _trig_for(st, spec, head_dim, heads, pos, center, batch, dtype, cos_in, sin_in):
    rows = batch if pos.dim() == 2 else 1
    if cos_in is not None and sin_in is not None:
        n = rows * pos.shape[-1] * st.nb
        if cos_in.numel() != n or cos_in.dtype != dtype or sin_in.shape != cos_in.shape:
            raise RuntimeError("relpos: trig table does not match the inputs' positions, length "
                               "or dtype")
        T = pos.shape[-1]
        return (cos_in.contiguous().view(rows, T, st.nb), sin_in.contiguous().view(rows, T, st.nb))
    _checked_positions(pos)
    freqs = _frequencies_for(spec, head_dim, heads, pos) if st.nb else None
    pc = (pos if pos.dim() == 2 else pos[None]) - center
    return _trig(st, freqs, pc, dtype)


def _prepare(op, args, q, positions, cos, sin, center, spec, head_dim, heads):
    """A transform call's (structure, compute dtype, positions on q's device, cos, sin table), or
    (None, the CPU operator's answer) for what the mechanism JSON does not describe."""
    st = _structure_or_none(spec, head_dim, heads)
    if st is None:
        return None, _on_cpu(op, args, q.device)
    cdt = _compute_dtype(q.dtype)
    pos = positions.to(q.device).contiguous()
    try:
        cos_t, sin_t = _trig_for(st, spec, head_dim, heads, pos, center, q.shape[0], cdt, cos, sin)
    except Unsupported:
        return None, _on_cpu(op, args, q.device)
    return (st, cdt, pos, cos_t, sin_t), None


def trig_table(positions, center, batch, spec, head_dim, heads, layout, dtype):
    cdt = _compute_dtype(dtype)
    pos = positions.to(torch.float64).contiguous()
    if not ((pos.dim() == 1) or (pos.dim() == 2 and pos.shape[0] == batch)):
        raise ValueError(f"positions must be [T] or [B, T] = [{batch}, {pos.shape[-1]}], got "
                         f"[{', '.join(map(str, pos.shape))}]")
    st = _structure_or_none(spec, head_dim, heads)
    if st is None:
        return _on_cpu("trig_table", (positions, center, batch, spec, head_dim, heads, layout,
                                      dtype), positions.device)
    _checked_positions(pos)
    try:
        freqs = _frequencies_for(spec, head_dim, heads, pos) if st.nb else None
    except Unsupported:
        return _on_cpu("trig_table", (positions, center, batch, spec, head_dim, heads, layout,
                                      dtype), positions.device)
    pc = (pos if pos.dim() == 2 else pos[None]) - center
    cos, sin = _trig(st, freqs, pc, cdt)
    return cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous()


def _params(gamma, eta, gates, alpha0, cdt):
    return tuple(p.to(cdt) if p.dtype in _HALF else p for p in (gamma, eta, gates, alpha0))


def transform(q, k, gamma, eta, gates, alpha0, positions, cos, sin, center, spec, head_dim,
              heads, layout, check_finite=False):
    _check_inputs(q, k, positions)
    args = (q, k, gamma, eta, gates, alpha0, positions, cos, sin, center, spec, head_dim, heads,
            layout, check_finite)
    call, answer = _prepare("transform", args, q, positions, cos, sin, center, spec, head_dim,
                            heads)
    if call is None:
        return answer
    st, cdt, pos, cos_t, sin_t = call
    B, H, T, D = q.shape
    qc, kc = q.contiguous(), k.contiguous()
    per_batch = pos.dim() == 2
    ck = cq = None
    if not st.plain and st.nb:
        gm, et, gt, a0 = _params(gamma, eta, gates, alpha0, cdt)
        pc = (pos if per_batch else pos[None]) - center
        with torch.no_grad():
            ck, cq = _coefficients(st, gm, et, gt, a0, pc, True, True, cdt)
    hs = bool(layout)
    # the rotation kernel checks its outputs in its own pass: one flag per tensor
    flag = None
    if check_finite and st.nb and st.rotation_only and q.dtype != torch.float64:
        flag = torch.zeros(2, dtype=torch.int32, device=q.device)
    if st.nb == 0:
        qo, ko = qc.clone(), kc.clone()
    else:
        qo = _apply(st, qc, cos_t, sin_t, cq, per_batch, upper=False, transposed=False,
                    half_split=hs, out_dtype=q.dtype, flag=None if flag is None else flag[0:1])
        ko = _apply(st, kc, cos_t, sin_t, ck, per_batch, upper=True, transposed=False,
                    half_split=hs, out_dtype=k.dtype, flag=None if flag is None else flag[1:2])
    # (with the flag clear nothing is non-finite; set, the passes below name what is)
    if check_finite and (flag is None or bool(flag.any())):
        for name, out, inp in (("q", qo, qc), ("k", ko, kc)):
            if not bool(torch.isfinite(out).all()):
                if q.dtype == torch.float16 and bool(torch.isfinite(inp).all()):
                    continue  # reported below as the float16 overflow
                raise ValueError(f"{name} contains NaN or Inf")
        if q.dtype == torch.float16:
            for name, out in (("q", qo), ("k", ko)):
                if not bool(torch.isfinite(out).all()):
                    raise ValueError(f"{name} overflows float16 after the transform (above 65504): "
                                     "pass bfloat16 or float32")
    return qo, ko


def transform_backward(grad_q, grad_k, q, k, gamma, eta, gates, alpha0, positions, cos, sin,
                       center, spec, head_dim, heads, layout, output_mask):
    _check_inputs(q, k, positions)
    mask = list(output_mask)
    args = (grad_q, grad_k, q, k, gamma, eta, gates, alpha0, positions, cos, sin, center, spec,
            head_dim, heads, layout, mask)
    call, answer = _prepare("transform_backward", args, q, positions, cos, sin, center, spec,
                            head_dim, heads)
    if call is None:
        return answer
    st, cdt, pos, cos_t, sin_t = call
    B, H, T, D = q.shape
    per_batch = pos.dim() == 2
    hs = bool(layout)
    gqo = grad_q.contiguous() if grad_q is not None else None
    gko = grad_k.contiguous() if grad_k is not None else None

    def input_grad(g, like, key):
        if g is None:
            return torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        if st.nb == 0:
            return g.to(like.dtype).clone()
        return _apply(st, g, cos_t, sin_t, ck if key else cq, per_batch, upper=not key,
                      transposed=True, half_split=hs, out_dtype=like.dtype)

    params = (gamma, eta, gates, alpha0)
    want_params = any(mask[2:]) and not st.plain and st.nb > 0
    ck = cq = None
    if not st.plain and st.nb:
        pc = (pos if per_batch else pos[None]) - center
        cparams = _params(*params, cdt)
        ck, cq = _coefficients(st, *cparams, pc, True, True, cdt)
    gq = input_grad(gqo, q, False) if mask[0] else torch.zeros_like(q, memory_format=torch.contiguous_format)
    gk = input_grad(gko, k, True) if mask[1] else torch.zeros_like(k, memory_format=torch.contiguous_format)
    pgrads = [torch.zeros_like(p) for p in params]
    if want_params:
        d = {}
        for g, x, key in ((gqo, q, False), (gko, k, True)):
            if g is None:
                continue
            xc = x.contiguous()
            gc = g.to(xc.dtype).contiguous() if g.dtype != xc.dtype else g
            d[key] = _coef_grad(st, xc, gc, cos_t, sin_t, per_batch, upper=key, half_split=hs)
        if d:
            got = _coefficient_grads(st, *cparams, pc, d.get(True), d.get(False))
            for i in range(4):
                if mask[2 + i]:
                    pgrads[i] = got[i].to(params[i].dtype)
    return (gq, gk, *pgrads)


OPS = {"trig_table": trig_table, "transform": transform, "transform_backward": transform_backward}
