"""GRAPE's biases through relpos.fused_attention: gated slopes and path integrals against a float64
composition written from the definitions, gradcheck of every input, and torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as F

import relpos


def composed(q, k, v, gq=None, gk=None, path_q=None, path_k=None, path_beta=None, path_scale=1.0):
    """Causal attention with materialised scores in float64: -(i - j)(gq_i + gk_j) and
    sum_{l=j+1..slot(i)} beta logsigmoid(s p_i . p_l), slot(i) = Tk - Tq + i."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    qi = torch.arange(Tk - Tq, Tk, dtype=torch.float64)[:, None]
    kj = torch.arange(Tk, dtype=torch.float64)[None, :]
    lag = qi - kj
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    if gq is not None or gk is not None:
        g = (0 if gq is None else gq.double()[..., :, None]) + (0 if gk is None else gk.double()[..., None, :])
        s = s - lag * g
    if path_q is not None:
        z = path_scale * path_q.double() @ path_k.double().transpose(-1, -2)
        e = path_beta.double()[None, :, None, None] * F.logsigmoid(z) * (kj <= qi)
        # sum over l in (j, slot(i)]: suffix sums of each row
        suffix = e.flip(-1).cumsum(-1).flip(-1) - e
        s = s + suffix
    s = s.masked_fill(lag < 0, float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def inputs(T=45, P=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, D = 2, 3, 8
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=dtype) * scale).requires_grad_()
    return dict(q=r(B, H, T, D), k=r(B, H, T, D), v=r(B, H, T, D), gq=r(B, H, T, scale=0.05),
                gk=r(B, H, T, scale=0.05), path_q=r(B, H, T, P), path_k=r(B, H, T, P),
                path_beta=(torch.rand(H, generator=g, dtype=dtype) * 0.5 + 0.05).requires_grad_())


def test_matches_composition_float32():
    x = inputs(T=130, P=8, dtype=torch.float32, seed=1)
    out, _ = relpos.fused_attention(**x, path_scale=0.125)
    ref = composed(**x, path_scale=0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    out.square().sum().backward()
    grads = {k: t.grad.clone() for k, t in x.items()}
    for t in x.values():
        t.grad = None
    ref.square().sum().backward()
    for name, t in x.items():
        err = (grads[name].double() - t.grad).abs().max() / t.grad.abs().max()
        assert err < 1e-4, name


def test_gradcheck_every_input():
    x = inputs(T=21, P=4, seed=2)
    names = list(x)
    f = lambda *a: relpos.fused_attention(**dict(zip(names, a)), path_scale=0.5)[0]
    assert torch.autograd.gradcheck(f, tuple(x.values()), atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile(backend):
    torch._dynamo.reset()
    x = inputs(T=40, P=4, dtype=torch.float32, seed=3)
    f = lambda **a: relpos.fused_attention(**a, path_scale=0.25)[0]
    eager = f(**x)
    out = torch.compile(f, fullgraph=True, backend=backend)(**x)
    torch.testing.assert_close(out, eager)


def test_path_needs_all_three_probes():
    x = inputs(T=10)
    with pytest.raises(relpos.InputError, match="path_q, path_k and path_beta"):
        relpos.fused_attention(x["q"], x["k"], x["v"], path_q=x["path_q"])
