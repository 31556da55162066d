"""GPU kernels of the rotation operators: ``relpos::rotate_pairs`` (journey frames,
``src/torch/journey_ops.cpp``, ``src/kernels/rotate.hpp``), ``relpos::structured_rotate``
(``U R(theta(r)) U^T`` per token, ``src/torch/mechanisms/structured.cpp``, ``src/kernels/structured.hpp``),
``relpos::causal_scan`` (``src/torch/scan_ops.cpp``) and ``relpos::favor_attention``
(``src/torch/linear_attention_ops.cpp``), each with its backward operator.

rotate_pairs is one streaming Triton kernel (and a second for the angle gradients, summed over
heads and shared batch rows); structured_rotate runs the basis products as torch matmuls around
a Triton plane-rotation kernel (``R z - z``, as the CPU kernel forms it); the causal scan runs in
float64 torch ops; FAVOR+ is chunked causal linear attention in float64 torch ops, its backward
torch.autograd through the same expression (the stabilisers held constant, which is exact: they
cancel identically).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .common import compute

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_HALF = (torch.bfloat16, torch.float16)
_STORABLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _compute_dtype(dtype):
    return torch.float32 if dtype in _HALF else dtype


def _computed(t):
    return (t.float() if t.dtype in _HALF else t).contiguous()


def _fmt_shape(s):
    return "[" + ", ".join(str(int(v)) for v in s) + "]"


# ---- rotate_pairs -------------------------------------------------------------------------------


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, T, D, P, SIGN, MINUS_INPUT: tl.constexpr,
                   ANGLES_PER_BATCH: tl.constexpr, ANGLES_PER_HEAD: tl.constexpr,
                   TRANSPOSED: tl.constexpr, HALF_SPLIT: tl.constexpr, F64: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    """y = R(SIGN phi) x (or its transpose) on the first P pairs of each row, the other
    coordinates copied (or, with MINUS_INPUT, y = R x - x, 0 past P)."""
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_P)
    tmask = t < T
    jmask = j < D // 2
    m2 = tmask[:, None] & jmask[None, :]
    rot = j < P
    nh = H * ANGLES_PER_HEAD + (1 - ANGLES_PER_HEAD)  # angle rows per batch row
    arow = ((b * ANGLES_PER_BATCH).to(tl.int64) * nh + h * ANGLES_PER_HEAD) * T + t
    ma = m2 & rot[None, :]
    c = tl.load(cos_ptr + arow[:, None] * P + j[None, :], mask=ma, other=1.0)
    s = tl.load(sin_ptr + arow[:, None] * P + j[None, :], mask=ma, other=0.0)
    c = compute(c, F64)
    s = compute(s, F64)
    s = s * SIGN
    if TRANSPOSED:
        s = -s
    if HALF_SPLIT:
        i0 = j
        i1 = j + D // 2
    else:
        i0 = 2 * j
        i1 = 2 * j + 1
    row = (bh.to(tl.int64) * T + t) * D
    x0 = tl.load(x_ptr + row[:, None] + i0[None, :], mask=m2, other=0.0)
    x1 = tl.load(x_ptr + row[:, None] + i1[None, :], mask=m2, other=0.0)
    x0 = compute(x0, F64)
    x1 = compute(x1, F64)
    y0 = c * x0 - s * x1
    y1 = s * x0 + c * x1
    if MINUS_INPUT:
        y0 = y0 - x0
        y1 = y1 - x1
    tl.store(y_ptr + row[:, None] + i0[None, :], y0.to(y_ptr.dtype.element_ty), mask=m2)
    tl.store(y_ptr + row[:, None] + i1[None, :], y1.to(y_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _rotate_angle_grad_kernel(x_ptr, g_ptr, dc_ptr, ds_ptr, H, T, D, P, SIGN, NLOOP,
                              PER_BATCH: tl.constexpr, HALF_SPLIT: tl.constexpr,
                              F64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    """dcos = sum (g0 x0 + g1 x1), dsin = SIGN sum (g1 x0 - g0 x1) over heads (and the batch rows
    that share the angles)."""
    pid_t = tl.program_id(0)
    ba = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_P)
    m2 = (t < T)[:, None] & (j < P)[None, :]
    if HALF_SPLIT:
        i0 = j
        i1 = j + D // 2
    else:
        i0 = 2 * j
        i1 = 2 * j + 1
    if F64:
        ac = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float64)
    else:
        ac = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
    asn = ac
    for i in range(NLOOP):  # (batch rows sharing the angles) x heads
        b = ba * PER_BATCH + (i // H) * (1 - PER_BATCH)
        h = i % H
        row = ((b.to(tl.int64) * H + h) * T + t) * D
        x0 = tl.load(x_ptr + row[:, None] + i0[None, :], mask=m2, other=0.0)
        x1 = tl.load(x_ptr + row[:, None] + i1[None, :], mask=m2, other=0.0)
        g0 = tl.load(g_ptr + row[:, None] + i0[None, :], mask=m2, other=0.0)
        g1 = tl.load(g_ptr + row[:, None] + i1[None, :], mask=m2, other=0.0)
        x0 = compute(x0, F64)
        x1 = compute(x1, F64)
        g0 = compute(g0, F64)
        g1 = compute(g1, F64)
        ac += g0 * x0 + g1 * x1
        asn += g1 * x0 - g0 * x1
    out = (ba.to(tl.int64) * T + t)[:, None] * P + j[None, :]
    tl.store(dc_ptr + out, ac.to(dc_ptr.dtype.element_ty), mask=m2)
    tl.store(ds_ptr + out, (asn * SIGN).to(ds_ptr.dtype.element_ty), mask=m2)


def _blocks(D):
    bp = triton.next_power_of_2(max(D // 2, 1))
    if _INTERPRET:
        return 128, bp
    return max(1, min(64, 4096 // bp)), bp


def _rotate_check(x, cos, sin):
    if x is None or x.dim() != 4:
        raise ValueError("rotate_pairs: x must be [B, H, T, D]")
    for name, t in (("cos", cos), ("sin", sin)):
        if t is None or t.dim() not in (2, 3):
            raise ValueError(f"rotate_pairs: {name} must be [B, T, P] or [T, P]")
        if t.device != x.device:
            raise ValueError(f"rotate_pairs: {name} must be on x's device ({x.device})")
        if t.dtype != x.dtype and t.dtype != _compute_dtype(x.dtype):
            raise ValueError(f"rotate_pairs: {name} must have x's dtype (or float32 for a "
                             "bfloat16/float16 x)")
    if cos.shape != sin.shape:
        raise ValueError("rotate_pairs: cos and sin differ in shape")
    if x.dtype not in _STORABLE:
        raise ValueError("rotate_pairs: x must be float32, float64, bfloat16 or float16")
    c = cos[None] if cos.dim() == 2 else cos
    s = sin[None] if sin.dim() == 2 else sin
    B, H, T, D = x.shape
    if c.shape[1] != T or (c.shape[0] != B and c.shape[0] != 1) or 2 * c.shape[2] > D:
        raise ValueError(f"rotate_pairs: angles {_fmt_shape(cos.shape)} do not fit x "
                         f"{_fmt_shape(x.shape)} (need [B or 1, T, P] with 2 P <= D)")
    if D % 2:
        raise ValueError(f"rotate_pairs: head dim {D} is odd")
    cdt = _compute_dtype(x.dtype)
    per_batch = c.shape[0] == B and B != 1
    return _computed(x), c.to(cdt).contiguous(), s.to(cdt).contiguous(), per_batch


def _launch_rotate(x, c, s, y, *, sign, per_batch, per_head=False, transposed, half_split,
                   minus_input=False, P=None):
    B, H, T, D = x.shape
    if x.numel() == 0:
        return y
    bt, bp = _blocks(D)
    _rotate_kernel[(triton.cdiv(T, bt), B * H)](
        x, c, s, y, H, T, D, c.shape[-1] if P is None else P, float(sign),
        MINUS_INPUT=minus_input, ANGLES_PER_BATCH=int(per_batch), ANGLES_PER_HEAD=int(per_head),
        TRANSPOSED=transposed, HALF_SPLIT=half_split, F64=x.dtype == torch.float64,
        BLOCK_T=bt, BLOCK_P=bp, num_warps=4 if bt * bp <= 2048 else 8)
    return y


def rotate_pairs(x, cos, sin, inverse=False, layout=0):
    xc, c, s, per_batch = _rotate_check(x, cos, sin)
    y = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    return _launch_rotate(xc, c, s, y, sign=-1.0 if inverse else 1.0, per_batch=per_batch,
                          transposed=False, half_split=bool(layout))


def rotate_pairs_backward(grad, x, cos, sin, inverse, layout, angle_grads=True):
    xc, c, s, per_batch = _rotate_check(x, cos, sin)
    g = _computed(grad)
    if g.shape != xc.shape or g.dtype != xc.dtype:
        raise ValueError("rotate_pairs_backward: grad must have x's shape and dtype")
    sign = -1.0 if inverse else 1.0
    dx = torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    _launch_rotate(g, c, s, dx, sign=sign, per_batch=per_batch, transposed=True,
                   half_split=bool(layout))
    if not angle_grads:
        e = torch.empty(0, dtype=c.dtype, device=x.device)
        return dx, e.to(cos.dtype), e.to(sin.dtype)
    B, H, T, D = xc.shape
    Ba, P = c.shape[0], c.shape[2]
    dc = torch.empty((Ba, T, P), dtype=c.dtype, device=x.device)
    ds = torch.empty((Ba, T, P), dtype=c.dtype, device=x.device)
    if dc.numel():
        if xc.numel() == 0:
            dc.zero_()
            ds.zero_()
        else:
            bt, bp = _blocks(D)
            nloop = H if per_batch else B * H
            _rotate_angle_grad_kernel[(triton.cdiv(T, bt), Ba)](
                xc, g, dc, ds, H, T, D, P, sign, nloop, PER_BATCH=int(per_batch),
                HALF_SPLIT=bool(layout), F64=xc.dtype == torch.float64, BLOCK_T=bt,
                BLOCK_P=triton.next_power_of_2(max(P, 1)))
    if cos.dim() == 2:
        dc, ds = dc[0], ds[0]
    return dx, dc.to(cos.dtype), ds.to(sin.dtype)


# ---- structured_rotate --------------------------------------------------------------------------


def _structured_operands(x, basis, freqs, positions):
    op = "structured_rotate"
    if x is None or x.dim() != 4:
        raise ValueError(f"{op}: x must be [B, H, T, D]")
    for t in (x, basis, freqs, positions):
        if t is None or t.device != x.device:
            raise ValueError(f"{op}: every tensor must be defined and on x's device")
    if x.dtype not in _STORABLE:
        raise ValueError(f"{op}: x must be float32, float64, bfloat16 or float16")
    cdt = _compute_dtype(x.dtype)
    for t in (basis, freqs):
        if not (t.dtype == x.dtype or t.dtype == cdt):
            raise ValueError(f"{op}: basis and freqs must have x's dtype ({x.dtype}; float32 "
                             "beside a bfloat16/float16 x)")
    B, H, T, D = x.shape
    if basis.dim() not in (2, 3):
        raise ValueError(f"{op}: basis must be [D, D] or [H, D, D]")
    if basis.shape[-1] != D or basis.shape[-2] != D:
        raise ValueError(f"{op}: basis must be {D} x {D} (the head dim), got "
                         f"{' x '.join(map(str, basis.shape))}")
    if basis.dim() == 3 and basis.shape[0] != H:
        raise ValueError(f"{op}: a per-head basis needs H = {H} leading rows, got {basis.shape[0]}")
    if freqs.dim() not in (2, 3):
        raise ValueError(f"{op}: freqs must be [dc, M] or [H, dc, M]")
    if freqs.dim() == 3 and freqs.shape[0] != H:
        raise ValueError(f"{op}: per-head freqs need H = {H} leading rows, got {freqs.shape[0]}")
    DC, M = freqs.shape[-2], freqs.shape[-1]
    if positions.dim() not in (2, 3):
        raise ValueError(f"{op}: positions must be [T, dc] or [B, T, dc]")
    if positions.shape[-1] != DC or positions.shape[-2] != T:
        raise ValueError(f"{op}: positions must end in [T = {T}, dc = {DC}], got "
                         f"{' x '.join(map(str, positions.shape))}")
    if positions.dim() == 3 and positions.shape[0] != B:
        raise ValueError(f"{op}: per-batch positions need B = {B} rows, got {positions.shape[0]}")
    if not positions.is_floating_point() and positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: positions must be real or integer")
    if D % 2:
        raise ValueError(f"structured: head dim {D} is odd")
    if M < 1 or 2 * M > D:
        raise ValueError(f"structured: {M} planes do not fit head dim {D} (need 1 <= 2m <= D)")
    if DC < 1 or DC > 3:
        raise ValueError(f"structured: {DC} position axes (d_c must be 1..3)")
    xc = _computed(x)
    U = basis.to(cdt).contiguous()
    lam = freqs.to(cdt).contiguous()
    pos = positions.to(torch.float64).contiguous()
    if pos.numel() and not bool(torch.isfinite(pos).all()):
        raise ValueError("structured: a position is not finite")
    if lam.numel() and not bool(torch.isfinite(lam).all()):
        raise ValueError("structured: a frequency lambda is not finite")
    if U.numel() and not bool(torch.isfinite(U).all()):
        raise ValueError("structured: a basis entry U is not finite")
    A = 2 * M
    Ua = (U if U.dim() == 3 else U[None])[:, :, :A]  # [HU, D, 2M]
    gram = Ua.double().transpose(1, 2) @ Ua.double()
    tol = 1e-4 if cdt == torch.float32 else 1e-10
    err = float((gram - torch.eye(A, dtype=torch.float64, device=x.device)).abs().max()) if A else 0.0
    if not err <= tol:
        raise ValueError(f"structured: the basis' first {A} columns are not orthonormal "
                         f"(|U^T U - I| = {err:.3g} > {tol:g})")
    return xc, U, lam, pos, Ua


def _structured_angles(lam, pos, inverse, cdt):
    """theta [PB, HL, T, M] in float64 (negated when inverse) and its cos / sin in cdt."""
    lamd = lam.double()
    lamd = lamd if lamd.dim() == 3 else lamd[None]  # [HL, DC, M]
    p = pos if pos.dim() == 3 else pos[None]  # [PB, T, DC]
    th = torch.einsum("btk,hkm->bhtm", p, lamd)
    if inverse:
        th = -th
    return th, torch.cos(th).to(cdt).contiguous(), torch.sin(th).to(cdt).contiguous()


def _plane_delta(z, c, s, *, transposed):
    """R z - z (or R^T z - z) on the planes (2u, 2u+1) of z [B, H, T, 2M], angles [PB, HL, T, M]
    broadcast over the batch / heads where shared."""
    B, H, T, A = z.shape
    PB, HL = c.shape[0], c.shape[1]
    per_batch, per_head = PB == B and B > 1, HL == H and H > 1
    if (PB != 1 and not per_batch) or (HL != 1 and not per_head):
        c = c.expand(B, H, T, A // 2).contiguous()
        s = s.expand(B, H, T, A // 2).contiguous()
        per_batch = per_head = True
    out = torch.empty_like(z)
    # one launch: angles indexed [b if per batch][h if per head]
    _launch_rotate(z, c, s, out, sign=1.0, per_batch=per_batch, per_head=per_head,
                   transposed=transposed, half_split=False, minus_input=True, P=A // 2)
    return out


def structured_rotate(x, basis, freqs, positions, inverse=False):
    xc, U, lam, pos, Ua = _structured_operands(x, basis, freqs, positions)
    if xc.numel() == 0:
        return torch.empty(xc.shape, dtype=x.dtype, device=x.device)
    _, c, s = _structured_angles(lam, pos, inverse, xc.dtype)
    Ub = Ua[None]  # [1, HU, D, 2M]: broadcast over [B, H]
    z = (xc @ Ub).contiguous()
    dz = _plane_delta(z, c, s, transposed=False)
    y = xc + dz @ Ub.transpose(-1, -2)
    return y.to(x.dtype)


def structured_rotate_backward(grad, x, basis, freqs, positions, inverse, output_mask):
    xc, U, lam, pos, Ua = _structured_operands(x, basis, freqs, positions)
    mask = list(output_mask)
    g = grad.to(xc.dtype).contiguous()
    if g.shape != xc.shape:
        raise ValueError("structured_rotate_backward: grad must have x's shape")
    B, H, T, D = xc.shape
    A = Ua.shape[-1]
    th, c, s = _structured_angles(lam, pos, inverse, xc.dtype)
    Ub = Ua[None]
    gp = (g @ Ub).contiguous()  # g' = U_act^T dy
    delta = _plane_delta(gp, c, s, transposed=True)  # R^T g' - g'
    dx = (g + delta @ Ub.transpose(-1, -2)).to(x.dtype) if mask[0] else None
    dU = dl = None
    if mask[1] or mask[2]:
        z = (xc @ Ub).contiguous()
        wz = _plane_delta(z, c, s, transposed=False)  # w - z
        if mask[2]:
            w = (wz + z).double()
            gd = gp.double()
            dth = gd[..., 1::2] * w[..., 0::2] - gd[..., 0::2] * w[..., 1::2]  # [B, H, T, M]
            p = pos if pos.dim() == 3 else pos[None].expand(B, T, pos.shape[-1])
            dlam = torch.einsum("btk,bhtm->hkm", p, dth)  # [H, DC, M]
            if inverse:
                dlam = -dlam
            if lam.dim() == 2:
                dlam = dlam.sum(0)
            dl = dlam.to(freqs.dtype)
        if mask[1]:
            # dU_act = dy^T (w - z) + x^T (R^T g' - g'), summed over tokens (and shared rows)
            du = (torch.einsum("bhtd,bhta->hda", g.double(), wz.double())
                  + torch.einsum("bhtd,bhta->hda", xc.double(), delta.double()))
            if U.dim() == 2:
                du = du.sum(0)
            full = torch.zeros(U.shape, dtype=torch.float64, device=x.device)
            full[..., :A] = du
            dU = full.to(basis.dtype)
    return dx, dU, dl


# ---- causal_scan --------------------------------------------------------------------------------


def _scan_input(x, what):
    if x is None or x.dim() not in (2, 3):
        raise ValueError(f"causal_scan: {what} must be [B, T, C] or [T, C]")
    if x.dtype not in _STORABLE:
        raise ValueError(f"causal_scan: {what} must be float32, float64, bfloat16 or float16")


def _scan_mode(mode):
    if mode not in ("exclusive", "reversed_inclusive"):
        raise ValueError(
            f"causal_scan: mode '{mode}' is not one of: exclusive, reversed_inclusive")
    return mode


def _exclusive(a, dim):
    c = torch.cumsum(a, dim)
    return c - a


def causal_scan(increments, mode="exclusive"):
    _scan_input(increments, "increments")
    mode = _scan_mode(mode)
    a = increments.double()
    dim = a.dim() - 2  # the T axis
    if mode == "exclusive":
        # Phi_t = sum_{s<t} a_s (float64 sums: at least the CPU's compensated accuracy)
        phi = torch.cumsum(a, dim).narrow(dim, 0, max(a.shape[dim] - 1, 0))
        phi = torch.cat([torch.zeros_like(a.narrow(dim, 0, min(1, a.shape[dim]))), phi], dim)
    else:
        # Phi_t = c_{T-1-t}, c_u = sum_{s<=u} a_s
        phi = torch.flip(torch.cumsum(a, dim), [dim])
    return phi.to(increments.dtype).contiguous()


def causal_scan_backward(grad, mode):
    _scan_input(grad, "grad")
    mode = _scan_mode(mode)
    g = grad.double()
    dim = g.dim() - 2
    if mode == "exclusive":
        # da_s = sum_{t>s} dphi_t
        rev = torch.flip(torch.cumsum(torch.flip(g, [dim]), dim), [dim])
        da = rev - g
    else:
        # da_s = sum_{t <= T-1-s} dphi_t
        da = torch.flip(torch.cumsum(g, dim), [dim])
    return da.to(grad.dtype).contiguous()


# ---- favor_attention ----------------------------------------------------------------------------


def _favor_check(q, k, v, projection, causal, scale):
    op = "favor_attention"
    for t in (q, k, v, projection):
        if t is None or t.device != q.device:
            raise ValueError(f"{op}: every tensor must be defined and on q's device")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{op}: q, k and v must be [B, H, T, D]")
    if q.shape != k.shape:
        raise ValueError(f"{op}: q and k must have the same shape (got "
                         f"{' x '.join(map(str, q.shape))} and {' x '.join(map(str, k.shape))})")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{op}: v must be [B, H, T, Dv] with q's B, H, T")
    if q.dtype not in _STORABLE:
        raise ValueError(f"{op}: q must be float32, float64, bfloat16 or float16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{op}: q, k and v must have one dtype")
    if projection.dim() != 2 or projection.shape[1] != q.shape[3] or projection.shape[0] < 1:
        raise ValueError(f"{op}: projection must be [m, D = {q.shape[3]}] with m >= 1, got "
                         f"{' x '.join(map(str, projection.shape))}")
    if not (scale >= 0) or not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite and >= 0 (0: D^-1/4), got {scale}")


def _features(x, W, sc, per_token):
    """Positive features exp(w.x' - |x'|^2/2 - c) (float64) and x' = sc x; c the max per token
    (queries) or per (batch, head) (keys): a constant that cancels between numerator and
    denominator, so held fixed in the backward (exactly)."""
    xs = x * sc
    u = xs @ W.T - 0.5 * (xs * xs).sum(-1, keepdim=True)
    c = u.amax(-1, keepdim=True) if per_token else u.amax(dim=(-2, -1), keepdim=True)
    return torch.exp(u - c), xs


def _tril(n, device):
    return torch.ones(n, n, dtype=torch.float64, device=device).tril()


def _favor_forward(q, k, v, W, causal, scale, chunk=64):
    """FAVOR+ attention in float64: out [B, H, T, Dv], the features and the denominators."""
    D = q.shape[-1]
    sc = scale if scale > 0 else D ** -0.25
    fq, _ = _features(q, W, sc, True)
    fk, _ = _features(k, W, sc, False)
    B, H, T, m = fq.shape
    Dv = v.shape[-1]
    if not causal:
        num = fq @ (fk.transpose(-1, -2) @ v)
        den = (fq * fk.sum(-2)[..., None, :]).sum(-1, keepdim=True)
    else:
        S = torch.zeros(B, H, m, Dv, dtype=torch.float64, device=q.device)
        z = torch.zeros(B, H, m, dtype=torch.float64, device=q.device)
        num = torch.empty(B, H, T, Dv, dtype=torch.float64, device=q.device)
        den = torch.empty(B, H, T, 1, dtype=torch.float64, device=q.device)
        for t0 in range(0, T, chunk):
            a, b, vc = fq[:, :, t0:t0 + chunk], fk[:, :, t0:t0 + chunk], v[:, :, t0:t0 + chunk]
            inner = (a @ b.transpose(-1, -2)) * _tril(a.shape[2], q.device)
            num[:, :, t0:t0 + chunk] = a @ S + inner @ vc
            den[:, :, t0:t0 + chunk] = (a * z[..., None, :]).sum(-1, keepdim=True) + inner.sum(-1, keepdim=True)
            S = S + b.transpose(-1, -2) @ vc
            z = z + b.sum(-2)
    ok = den > 0  # a row whose features all underflowed: zero output and gradients
    out = torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))
    return out, den, fq, fk, sc


def _favor_backward(q, k, v, W, causal, scale, dout, chunk=64):
    """dq, dk, dv (float64) by the adjoint of _favor_forward: with G_i = dout_i / den_i and
    c_i = dout_i . out_i / den_i, dA_ij = G_i . v_j - c_i for the scores A_ij = fq_i . fk_j."""
    out, den, fq, fk, sc = _favor_forward(q, k, v, W, causal, scale, chunk)
    ok = den > 0
    safe = torch.where(ok, den, torch.ones_like(den))
    G = torch.where(ok, dout / safe, torch.zeros_like(dout))
    cc = torch.where(ok, (dout * out).sum(-1, keepdim=True) / safe, torch.zeros_like(den))
    B, H, T, m = fq.shape
    Dv = v.shape[-1]
    if not causal:
        S, z = fk.transpose(-1, -2) @ v, fk.sum(-2)
        dfq = G @ S.transpose(-1, -2) - cc * z[..., None, :]
        R, r = fq.transpose(-1, -2) @ G, (fq * cc).sum(-2)
        dfk = v @ R.transpose(-1, -2) - r[..., None, :]
        dv = fk @ R
    else:
        dfq = torch.empty_like(fq)
        dfk = torch.empty_like(fk)
        dv = torch.empty_like(v)
        S = torch.zeros(B, H, m, Dv, dtype=torch.float64, device=q.device)
        z = torch.zeros(B, H, m, dtype=torch.float64, device=q.device)
        for t0 in range(0, T, chunk):  # forward in time: dfq
            sl = slice(t0, t0 + chunk)
            b, vc, g, c = fk[:, :, sl], v[:, :, sl], G[:, :, sl], cc[:, :, sl]
            low = _tril(b.shape[2], q.device)
            dfq[:, :, sl] = (g @ S.transpose(-1, -2) + ((g @ vc.transpose(-1, -2)) * low) @ b
                             - c * (z[..., None, :] + low @ b))
            S = S + b.transpose(-1, -2) @ vc
            z = z + b.sum(-2)
        R = torch.zeros(B, H, m, Dv, dtype=torch.float64, device=q.device)
        r = torch.zeros(B, H, m, dtype=torch.float64, device=q.device)
        starts = list(range(0, T, chunk))
        for t0 in reversed(starts):  # backward in time: dfk, dv
            sl = slice(t0, t0 + chunk)
            a, b, vc, g, c = fq[:, :, sl], fk[:, :, sl], v[:, :, sl], G[:, :, sl], cc[:, :, sl]
            up = _tril(a.shape[2], q.device).T  # [j, i]: i >= j
            dfk[:, :, sl] = (vc @ R.transpose(-1, -2) + ((vc @ g.transpose(-1, -2)) * up) @ a
                             - (r[..., None, :] + up @ (c * a)))
            dv[:, :, sl] = b @ R + ((b @ a.transpose(-1, -2)) * up) @ g
            R = R + a.transpose(-1, -2) @ g
            r = r + (c * a).sum(-2)

    def to_input(df, f, x):
        du = df * f  # d exp(u - c) / du
        xs = x * sc
        return sc * (du @ W - xs * du.sum(-1, keepdim=True))

    return to_input(dfq, fq, q), to_input(dfk, fk, k), dv


def favor_attention(q, k, v, projection, causal=True, scale=0.0):
    _favor_check(q, k, v, projection, causal, scale)
    W = projection.to(device=q.device, dtype=torch.float64)
    out = _favor_forward(q.double(), k.double(), v.double(), W, causal, float(scale))[0]
    return out.to(v.dtype).contiguous()


def favor_attention_backward(grad, q, k, v, projection, causal, scale, output_mask):
    _favor_check(q, k, v, projection, causal, scale)
    if grad.shape != v.shape:
        raise ValueError("favor_attention_backward: grad must have v's shape")
    W = projection.to(device=q.device, dtype=torch.float64)
    grads = _favor_backward(q.double(), k.double(), v.double(), W, causal, float(scale),
                            grad.double())
    return tuple(g.to(t.dtype).contiguous() if m else None
                 for g, t, m in zip(grads, (q, k, v), output_mask))


OPS = {
    "rotate_pairs": rotate_pairs,
    "rotate_pairs_backward": rotate_pairs_backward,
    "structured_rotate": structured_rotate,
    "structured_rotate_backward": structured_rotate_backward,
    "causal_scan": causal_scan,
    "causal_scan_backward": causal_scan_backward,
    "favor_attention": favor_attention,
    "favor_attention_backward": favor_attention_backward,
}
