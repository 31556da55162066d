"""The GPU backend's rotation operators (python/relpos/gpu/rotations.py) against the CPU
operators: rotate_pairs (journey frames), structured_rotate (U R(theta(r)) U^T), causal_scan and
favor_attention, forward and backward, at random shapes; float32 to 1e-5 relative to the largest
value, float64 to 1e-11, bfloat16 storage to one bfloat16 rounding (2e-2). Under Triton's
interpreter without a GPU, on the registered CUDA kernels with one."""

import itertools

import pytest
import torch
from gpu_testing import cpu_call, gpu_call


def _rel_err(a, b):
    if b is None or b.numel() == 0:
        return 0.0 if (a is None or a.numel() == 0) else float("inf")
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float64: 1e-11, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]


def _same(got, want, tol, what=""):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None, (what, i)
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, b.dtype, a.shape, b.shape)
        assert _rel_err(a, b) <= tol, (what, i, _rel_err(a, b))


# ---- rotate_pairs -------------------------------------------------------------------------------

_ROT_CASES = list(itertools.product(
    [(2, 3, 17, 16, 8), (1, 2, 40, 32, 5), (3, 1, 9, 20, 10)],  # B, H, T, D, P
    ["batch", "shared", "2d"],
    [0, 1],
    [False, True],
))


@pytest.mark.parametrize("shape,angles,layout,inverse", _ROT_CASES)
def test_rotate_pairs(shape, angles, layout, inverse):
    B, H, T, D, P = shape
    g = torch.Generator().manual_seed(B * 100 + T + layout)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        adt = torch.float32 if dtype == torch.bfloat16 else dtype
        x = torch.randn(B, H, T, D, generator=g).to(dtype)
        rows = {"batch": B, "shared": 1, "2d": None}[angles]
        phi = torch.rand((rows, T, P) if rows else (T, P), generator=g, dtype=torch.float64) * 20 - 10
        cos, sin = torch.cos(phi).to(adt), torch.sin(phi).to(adt)
        tol = _tol(dtype)
        _same(gpu_call("rotate_pairs", x, cos, sin, inverse, layout),
              cpu_call("rotate_pairs", x, cos, sin, inverse, layout), tol, "forward")
        dy = torch.randn(B, H, T, D, generator=g).to(dtype)
        for angle_grads in (True, False):
            args = (dy, x, cos, sin, inverse, layout, angle_grads)
            # the angle gradients are sums over heads and batch rows: bfloat16 inputs, float32 sums
            got = gpu_call("rotate_pairs_backward", *args)
            want = cpu_call("rotate_pairs_backward", *args)
            _same(got[:1], want[:1], tol, "dx")
            _same(got[1:], want[1:], tol if dtype != torch.bfloat16 else 1e-5, "dcos, dsin")


def test_rotate_pairs_refusals():
    x = torch.randn(2, 2, 5, 8)
    bad = [
        (x, torch.ones(5, 5), torch.ones(5, 5)),  # 2 P > D
        (x, torch.ones(3, 5, 2), torch.ones(3, 5, 2)),  # batch rows
        (x, torch.ones(5, 2), torch.ones(5, 3)),  # cos / sin differ
        (x[..., :7].contiguous(), torch.ones(5, 2), torch.ones(5, 2)),  # odd head dim
        (x, torch.ones(5, 2, dtype=torch.float64), torch.ones(5, 2, dtype=torch.float64)),  # dtype
    ]
    for args in bad:
        for call in (gpu_call, cpu_call):
            with pytest.raises(ValueError):
                call("rotate_pairs", *args, False, 0)


# ---- structured_rotate --------------------------------------------------------------------------


def _orthogonal(n, g, dtype):
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    return (qm * torch.sign(torch.diagonal(r))).to(dtype)


_STRUCT_SHAPES = [(2, 3, 19, 16, 5, 2), (1, 2, 33, 12, 6, 3), (3, 2, 8, 8, 2, 1)]  # B H T D M dc
# every sharing pattern (basis per head, freqs per head, positions per batch) on the first shape,
# two on the others
_STRUCT_CASES = ([(_STRUCT_SHAPES[0], *flags) for flags in itertools.product([False, True], repeat=3)]
                 + [(_STRUCT_SHAPES[1], True, False, True), (_STRUCT_SHAPES[1], False, True, False),
                    (_STRUCT_SHAPES[2], False, False, True), (_STRUCT_SHAPES[2], True, True, False)])


@pytest.mark.parametrize("shape,basis_per_head,freqs_per_head,pos_per_batch", _STRUCT_CASES)
def test_structured_rotate(shape, basis_per_head, freqs_per_head, pos_per_batch):
    B, H, T, D, M, DC = shape
    g = torch.Generator().manual_seed(T * 7 + D)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        pdt = torch.float32 if dtype == torch.bfloat16 else dtype
        x = torch.randn(B, H, T, D, generator=g).to(dtype)
        U = (torch.stack([_orthogonal(D, g, pdt) for _ in range(H)]) if basis_per_head
             else _orthogonal(D, g, pdt))
        lam = (torch.randn((H, DC, M) if freqs_per_head else (DC, M), generator=g) * 0.3).to(pdt)
        if pos_per_batch:
            pos = torch.randint(-20, 40, (B, T, DC), generator=g)
        else:
            pos = torch.rand(T, DC, generator=g, dtype=torch.float64) * 50 - 10
        tol = _tol(dtype)
        for inverse in (False, True):
            _same(gpu_call("structured_rotate", x, U, lam, pos, inverse),
                  cpu_call("structured_rotate", x, U, lam, pos, inverse), tol, "forward")
            dy = torch.randn(B, H, T, D, generator=g).to(dtype)
            for mask in ([True, True, True], [True, False, False], [False, True, False],
                         [False, False, True]):
                args = (dy, x, U, lam, pos, inverse, mask)
                # dU and dlambda are sums over tokens of products: float32 sums in both
                ptol = tol if dtype != torch.bfloat16 else 1e-4
                got = gpu_call("structured_rotate_backward", *args)
                want = cpu_call("structured_rotate_backward", *args)
                _same(got[:1], want[:1], tol, "dx")
                _same(got[1:], want[1:], ptol, "dU, dlambda")


def test_structured_rotate_refusals():
    x = torch.randn(1, 2, 4, 8)
    U = torch.eye(8)
    lam = torch.ones(2, 3)
    pos = torch.zeros(4, 2)
    bad = [
        (x, U * 2, lam, pos),  # not orthonormal
        (x, U, torch.ones(2, 5), pos),  # 2 M > D
        (x, U, lam, torch.zeros(5, 2)),  # T
        (x, U[:7, :7], lam, pos),  # basis size
        (x, U, lam, torch.full((4, 2), float("nan"))),  # positions
    ]
    for args in bad:
        for call in (gpu_call, cpu_call):
            with pytest.raises(ValueError):
                call("structured_rotate", *args, False)


# ---- causal_scan --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exclusive", "reversed_inclusive"])
@pytest.mark.parametrize("shape", [(2, 37, 5), (50, 3), (1, 1, 4), (3, 200, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_causal_scan(mode, shape, dtype):
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    a = (torch.randn(shape, generator=g) * 3).to(dtype)
    # bfloat16: both sum in at least float32 and round once
    tol = _tol(dtype) if dtype != torch.bfloat16 else 1e-2
    _same(gpu_call("causal_scan", a, mode), cpu_call("causal_scan", a, mode), tol, "forward")
    d = torch.randn(shape, generator=g).to(dtype)
    _same(gpu_call("causal_scan_backward", d, mode), cpu_call("causal_scan_backward", d, mode), tol,
          "backward")


def test_causal_scan_refusals():
    for call in (gpu_call, cpu_call):
        with pytest.raises(ValueError, match="mode"):
            call("causal_scan", torch.zeros(2, 3), "inclusive")
        with pytest.raises(ValueError):
            call("causal_scan", torch.zeros(3), "exclusive")


# ---- favor_attention ----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 2, 150, 16, 8, 32), (1, 3, 17, 8, 12, 5)])  # B H T D Dv m
@pytest.mark.parametrize("scale", [0.0, 0.4])
def test_favor_attention(causal, shape, scale):
    B, H, T, D, Dv, m = shape
    g = torch.Generator().manual_seed(T + m)
    W = torch.ops.relpos.random_projection(m, D, True, 3)
    for dtype in (torch.float32, torch.float64):
        q = torch.randn(B, H, T, D, generator=g).to(dtype)
        k = torch.randn(B, H, T, D, generator=g).to(dtype)
        v = torch.randn(B, H, T, Dv, generator=g).to(dtype)
        tol = _tol(dtype) if dtype == torch.float32 else 1e-10
        _same(gpu_call("favor_attention", q, k, v, W, causal, scale),
              cpu_call("favor_attention", q, k, v, W, causal, scale), tol, "forward")
        dy = torch.randn(B, H, T, Dv, generator=g).to(dtype)
        for mask in ([True, True, True], [False, True, False], [True, False, True]):
            args = (dy, q, k, v, W, causal, scale, mask)
            _same(gpu_call("favor_attention_backward", *args),
                  cpu_call("favor_attention_backward", *args), tol, "backward")


def test_favor_attention_bfloat16():
    g = torch.Generator().manual_seed(5)
    W = torch.ops.relpos.random_projection(16, 8, True, 1)
    q, k, v = (torch.randn(1, 2, 70, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    _same(gpu_call("favor_attention", q, k, v, W, True, 0.0),
          cpu_call("favor_attention", q, k, v, W, True, 0.0), 2e-2, "bf16")


def test_favor_attention_refusals():
    q = torch.randn(1, 1, 4, 8)
    for call in (gpu_call, cpu_call):
        with pytest.raises(ValueError):
            call("favor_attention", q, q, q, torch.ones(3, 5), True, 0.0)
        with pytest.raises(ValueError):
            call("favor_attention", q, q, q, torch.ones(3, 8), True, -1.0)
