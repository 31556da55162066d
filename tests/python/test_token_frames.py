"""relpos.Attention with per-token frames (every catalog transform that takes ``angles=token``:
JoFormer's journey with angles scanned from the tokens), with no per-mechanism code beyond that
option: the forward against the frames' formula in plain float64 torch (q, k and v turned by
Phi_t = sum_{s<t} x_s A, the output turned back), decoding through the cache against the full
forward, gradients of q, k, v, the inputs and the angle table, and the refusals."""

import math

import pytest
import torch

import relpos
from module_checks import catalog_term, check_decoding, check_parameter_gradients, grouped_qkv

HQ, HK, MODEL_DIM, D = 4, 2, 12, 8
CATALOG = [m["name"] for m in relpos.mechanisms() if m["kind"] != "scaling"]


def token_term(spec):
    """The term of per-token frames (a content phase that may turn values and outputs)."""
    return catalog_term(spec, D, HK, lambda t: t["time"] == "content_phase"
                        and "frame_frequencies" in t and not t["learned_frequencies"])


BASE = [f"{s}(angles=token)" for s in CATALOG
        if (t := token_term(f"{s}(angles=token)")) is not None and t["values"]]
SPECS = BASE + [f"{s[:-1]}, values=false)" for s in BASE] + [f"{s} + alibi" for s in BASE]

pytestmark = pytest.mark.usefixtures("one_thread")


def module(spec, **kw):
    torch.manual_seed(5)
    return relpos.Attention(spec, D, HQ, HK, model_dim=MODEL_DIM, **kw).double()


def tensors(B=2, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = grouped_qkv(g, B, T, D, HQ, HK)
    x = torch.randn(B, T, MODEL_DIM, generator=g, dtype=torch.float64)
    return q, k, v, x


def turn(y, theta, inverse=False):
    """Interleaved pairs (2m, 2m+1) of y [B, H, T, D] turned by theta [B, T, D/2]."""
    t = (-theta if inverse else theta)[:, None]
    c, s = t.cos(), t.sin()
    y0, y1 = y[..., 0::2], y[..., 1::2]
    return torch.stack([c * y0 - s * y1, s * y0 + c * y1], -1).flatten(-2)


def reference(attn, q, k, v, x):
    term = token_term(attn.spec)
    inc = x @ attn.angle_table  # [B, T, D/2]
    phi = torch.cumsum(inc, 1) - inc  # exclusive: sum_{s<t}
    g = HQ // HK
    qt, kt = turn(q, phi), turn(k, phi).repeat_interleave(g, 1)
    vt = (turn(v, phi) if term["values"] else v).repeat_interleave(g, 1)
    T = q.shape[2]
    pos = torch.arange(T, dtype=torch.float64)
    lag = pos[:, None] - pos[None, :]
    sc = qt @ kt.transpose(-1, -2) / math.sqrt(D)
    for b in relpos.mechanism(attn.spec, D, HQ)["biases"]:
        if b["slopes"]:
            sc = sc - torch.tensor(b["slopes"], dtype=sc.dtype)[None, :, None, None] * lag
    out = torch.softmax(sc.masked_fill(lag < 0, float("-inf")), -1) @ vt
    return turn(out, phi, inverse=True) if term["outputs"] else out


@pytest.mark.parametrize("spec", SPECS)
def test_forward_is_the_formula(spec):
    attn = module(spec)
    q, k, v, x = tensors()
    torch.testing.assert_close(attn(q, k, v, inputs=x), reference(attn, q, k, v, x), rtol=0, atol=1e-11)
    a32 = module(spec).float()
    torch.testing.assert_close(a32(q.float(), k.float(), v.float(), inputs=x.float()).double(),
                               reference(attn, q, k, v, x), rtol=0, atol=2e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_through_the_cache_is_the_full_forward(spec):
    check_decoding(module(spec), *tensors(T=9))


@pytest.mark.parametrize("spec", SPECS)
def test_gradients(spec):
    attn = module(spec)
    q, k, v, x = (t.requires_grad_() for t in tensors(B=1, T=4))
    assert torch.autograd.gradcheck(lambda q, k, v, x: attn(q, k, v, inputs=x), (q, k, v, x))
    check_parameter_gradients(attn, q, k, v, x)


def test_causality_and_the_refusals():
    spec = BASE[0]
    attn = module(spec)
    q, k, v, x = tensors()
    out = attn(q, k, v, inputs=x)
    x2 = x.clone()
    x2[:, -1] += 3.0  # a later token's increment changes no earlier frame
    assert torch.equal(attn(q, k, v, inputs=x2)[:, :, :-1], out[:, :, :-1])
    assert [n for n, _ in attn.named_parameters()] == ["angle_table"]
    with pytest.raises(relpos.InputError, match="inputs="):
        attn(q, k, v)
    with pytest.raises(relpos.InputError, match="model_dim"):
        relpos.Attention(spec, D, HQ, HK)
    with pytest.raises(relpos.InputError, match="reversed inclusive scan"):
        relpos.Attention(f"{spec[:-1]}, scan=reversed_inclusive)", D, HQ, HK, model_dim=MODEL_DIM)
