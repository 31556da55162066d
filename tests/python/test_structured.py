"""torch.ops.relpos.structured_rotate: the structured rotation by vector positions against the
same math composed from torch ops in float64, the relative law (Theorem 1) through the fused
attention, gradcheck through a learned Cayley basis, torch.compile, named errors."""

import math

import pytest
import torch

import relpos


def composed(x, U, lam, pos, inverse=False):
    """U [(+) R_2(theta_u)] U^T x on the first 2M columns of U (plane u = columns 2u, 2u+1)."""
    M = lam.shape[-1]
    th = torch.einsum("...tk,...km->...tm", pos.to(x.dtype), lam)  # [.., T, M]
    if inverse:
        th = -th
    Ua = U[..., : 2 * M]
    z = torch.einsum("...dj,bhtd->bhtj", Ua, x) if U.dim() == 2 else torch.einsum(
        "hdj,bhtd->bhtj", Ua, x)
    z0, z1 = z[..., 0::2], z[..., 1::2]
    c, s = torch.cos(th), torch.sin(th)
    if th.dim() == 2:  # [T, M]
        c, s = c[None, None], s[None, None]
    elif lam.dim() == 3 and pos.dim() == 2:  # per-head freqs: [H, T, M]
        c, s = c[None], s[None]
    r0, r1 = c * z0 - s * z1, s * z0 + c * z1
    dz = torch.stack([r0 - z0, r1 - z1], -1).flatten(-2)
    back = torch.einsum("dj,bhtj->bhtd", Ua, dz) if U.dim() == 2 else torch.einsum(
        "hdj,bhtj->bhtd", Ua, dz)
    return x + back


def random_setup(B=2, H=3, T=7, D=8, M=3, dc=2, per_head=False, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, dtype=dtype, generator=g)
    W = 0.3 * torch.randn(*((H,) if per_head else ()), D, D, dtype=dtype, generator=g)
    lam = torch.randn(*((H,) if per_head else ()), dc, M, dtype=dtype, generator=g)
    pos = 10 * torch.rand(T, dc, dtype=torch.float64, generator=g)
    return x, W, lam, pos


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_matches_composition(per_head, inverse):
    x, W, lam, pos = random_setup(per_head=per_head)
    U = relpos.cayley_basis(W)
    y = relpos.structured_rotate(x, U, lam, pos, inverse=inverse)
    assert torch.allclose(y, composed(x, U, lam, pos, inverse), atol=1e-12)
    back = relpos.structured_rotate(y, U, lam, pos, inverse=not inverse)
    assert torch.allclose(back, x, atol=1e-12)


def test_relative_law_through_attention():
    # Theorem 1: shifting every position by the same vector leaves the attention output unchanged
    x, W, lam, pos = random_setup(B=1, H=2, T=9, D=8, M=4, dc=3)
    U = relpos.cayley_basis(W)
    q, k, v = x, torch.roll(x, 1, 2), torch.roll(x, 2, 2)
    out = relpos.structured_attention(q, k, v, U, lam, pos)
    shifted = relpos.structured_attention(q, k, v, U, lam,
                                          pos + torch.tensor([3.25, -7.5, 1e3], dtype=torch.float64))
    assert torch.allclose(out, shifted, atol=1e-10)
    # and the scores are q . R(r_j - r_i) k
    qr = relpos.structured_rotate(q, U, lam, pos)
    kr = relpos.structured_rotate(k, U, lam, pos)
    s = qr[0, 0] @ kr[0, 0].T
    i, j = 2, 6
    kj = relpos.structured_rotate(k[:, :, j:j + 1], U, lam, (pos[j] - pos[i])[None])
    assert math.isclose(float(s[i, j]), float(q[0, 0, i] @ kj[0, 0, 0]), rel_tol=1e-12)


def test_gradcheck_through_a_learned_basis():
    x, W, lam, pos = random_setup(B=1, H=2, T=4, D=6, M=2, dc=2, per_head=True)
    for t in (x, W, lam):
        t.requires_grad_(True)
    f = lambda x, W, lam: relpos.structured_rotate(x, relpos.cayley_basis(W), lam, pos)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, W, lam))


def test_float32_and_compile():
    x, W, lam, pos = random_setup(dtype=torch.float32)
    U = relpos.cayley_basis(W.double()).float()
    x.requires_grad_(True)
    f = torch.compile(lambda x: relpos.structured_rotate(x, U, lam, pos).square().sum(),
                      fullgraph=True, backend="aot_eager")
    f(x).backward()
    g = x.grad.clone()
    want = composed(x.detach().double(), U.double(), lam.double(), pos)
    y = relpos.structured_rotate(x.detach(), U, lam, pos)
    assert torch.allclose(y.double(), want, atol=1e-5)
    assert torch.allclose(g, 2 * x.detach(), atol=1e-4)  # R orthogonal: d |R x|^2 / dx = 2 x


def test_named_errors():
    x, W, lam, pos = random_setup()
    U = relpos.cayley_basis(W)
    with pytest.raises(relpos.InputError, match="positions"):
        relpos.structured_rotate(x, U, lam, pos[:, :1])
    with pytest.raises(relpos.InputError, match="basis"):
        relpos.structured_rotate(x, U[:4, :4], lam, pos)
    with pytest.raises(relpos.InputError, match=r"\[B, H, T, D\]"):
        relpos.structured_rotate(x[0], U, lam, pos)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_inputs_take_a_float64_basis(dtype, tol):
    """A half x with an orthogonal float64 basis was refused as "not orthogonal": the basis was
    rounded to x's dtype before the check. It is computed in float32 now, as half storage is."""
    torch.manual_seed(6)
    U = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0]
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    f, p = torch.rand(2, 4, dtype=torch.float64), torch.rand(4, 2, dtype=torch.float64)
    out = relpos.structured_rotate(x.to(dtype), U, f, p)
    assert out.dtype == dtype
    assert (out.double() - relpos.structured_rotate(x, U, f, p)).abs().max() < tol
