"""torch.ops.relpos.favor_attention: FAVOR+ linear attention against the same random features
composed from torch ops in float64 (materialised T x T), gradcheck, exact causality,
torch.compile, composition with a structured rotation, named errors."""

import pytest
import torch

import relpos


def composed(q, k, v, W, causal):
    D = q.shape[-1]
    s = D ** -0.25
    m = W.shape[0]

    def phi(x):
        x = x * s
        return torch.exp(x @ W.T.to(x.dtype) - 0.5 * (x * x).sum(-1, keepdim=True)) / m ** 0.5

    A = phi(q) @ phi(k).transpose(-1, -2)
    if causal:
        A = torch.tril(A)
    return (A @ v) / A.sum(-1, keepdim=True)


@pytest.mark.parametrize("causal", [True, False])
def test_matches_materialised_features(causal):
    g = torch.Generator().manual_seed(0)
    q, k = (0.5 * torch.randn(2, 3, 77, 16, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(2, 3, 77, 8, dtype=torch.float64, generator=g)
    W = relpos.random_projection(64, 16, seed=3)
    out = relpos.favor_attention(q, k, v, W, causal=causal)
    assert torch.allclose(out, composed(q, k, v, W, causal), rtol=1e-10, atol=1e-12)
    out32 = relpos.favor_attention(q.float(), k.float(), v.float(), W, causal=causal)
    assert (out32.double() - out).abs().max() / out.abs().max() < 1e-5


def test_gradcheck_and_causality():
    g = torch.Generator().manual_seed(1)
    q, k, v = (0.5 * torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=g) for _ in range(3))
    W = relpos.random_projection(8, 4, orthogonal=False, seed=5)
    for t in (q, k, v):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b, c: relpos.favor_attention(a, b, c, W), (q, k, v))
    out = relpos.favor_attention(q, k, v, W)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 6:] += 10.0  # a much larger later key moves no earlier output, not even in the last bit
    v2[:, :, 6:] -= 3.0
    out2 = relpos.favor_attention(q.detach(), k2, v2, W)
    assert torch.equal(out.detach()[:, :, :6], out2[:, :, :6])


def test_compile_and_rotation():
    g = torch.Generator().manual_seed(2)
    q, k, v = (0.5 * torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    W = relpos.random_projection(32, 8)
    U = torch.eye(8)
    lam = torch.rand(2, 4, generator=g)
    pos = torch.rand(32, 2, dtype=torch.float64, generator=g) * 5

    def f(q, k, v):
        qr = relpos.structured_rotate(q, U, lam, pos)
        kr = relpos.structured_rotate(k, U, lam, pos)
        return relpos.favor_attention(qr, kr, v, W, causal=False)

    q.requires_grad_(True)
    cf = torch.compile(lambda q: f(q, k, v).sum(), fullgraph=True, backend="aot_eager")
    cf(q).backward()
    g1 = q.grad.clone()
    q.grad = None
    f(q, k, v).sum().backward()
    assert torch.allclose(g1, q.grad, atol=1e-5)


def test_named_errors():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(relpos.InputError, match="projection"):
        relpos.favor_attention(q, q, q, torch.randn(16, 4))
    with pytest.raises(relpos.InputError, match="same shape"):
        relpos.favor_attention(q, q[:, :, :2], q, torch.randn(16, 8))
    with pytest.raises(relpos.InputError):
        relpos.random_projection(0, 8)
