"""relpos.Attention with a rotation whose frequencies the layer learns (GRAPE-M: every catalog
transform with ``learned_frequencies``, its options and compositions), with no per-mechanism code:
the forward against the rotation's formula in plain float64 torch, decoding through the cache
against the full forward, gradients of q, k, v, the inputs and every parameter, the state-dict
names, and the refusals."""

import copy
import math

import pytest
import torch

import relpos
from module_checks import catalog_term, check_decoding, check_parameter_gradients, grouped_qkv, jittered

HQ, HK, MODEL_DIM, D = 4, 2, 12, 8
CATALOG = [m["name"] for m in relpos.mechanisms() if m["kind"] != "scaling"]


def learned(spec):
    # (learned rotations of vector positions: test_vector_positions.py)
    return catalog_term(spec, D, HK,
                        lambda t: t["learned_frequencies"] and t["time"] != "vector_position")


BASE = [s for s in CATALOG if learned(s) is not None]
SPECS = BASE + [f"{s}(context=true)" for s in BASE] + [f"{s} + alibi" for s in BASE]
BASIS = [f"{s}(basis=cayley)" for s in BASE] + [f"{s}(basis=exp, context=true)" for s in BASE]


pytestmark = pytest.mark.usefixtures("one_thread")


def module(spec, jitter=0.3, **kw):
    torch.manual_seed(5)
    a = relpos.Attention(spec, D, HQ, HK, model_dim=MODEL_DIM, **kw).double()
    return jittered(a, jitter)


def tensors(B=2, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = grouped_qkv(g, B, T, D, HQ, HK)
    x = torch.randn(B, T, MODEL_DIM, generator=g, dtype=torch.float64)
    return q, k, v, x


def reference(attn, q, k, v, x):
    """Interleaved pairs (2m, 2m+1) turned by angle_t,m = time_t exp(lambda_m / s), time_t the
    position or the content phase sum_{s<t} sigmoid((w.x_s + b) / 16); ALiBi slopes from the
    JSON; softmax over the causal mask."""
    t = learned(attn.spec)
    B, _, T, _ = q.shape
    theta = torch.exp(attn.log_freq / t["frequency_scale"])
    if t["time"] == "content_phase":
        om = torch.sigmoid((x @ attn.ctx_w + attn.ctx_b) / 16)  # [B, T]
        time = torch.cumsum(om, 1) - om  # exclusive
    else:
        time = torch.arange(T, dtype=torch.float64).expand(B, T)
    ang = time[:, None, :, None] * theta  # [B, 1, T, D/2]
    c, s = ang.cos(), ang.sin()

    def turn(y):
        y0, y1 = y[..., 0::2], y[..., 1::2]
        return torch.stack([c * y0 - s * y1, s * y0 + c * y1], -1).flatten(-2)

    qt, kt = turn(q), turn(k).repeat_interleave(HQ // HK, 1)
    pos = torch.arange(T, dtype=torch.float64)
    lag = pos[:, None] - pos[None, :]
    sc = qt @ kt.transpose(-1, -2) / math.sqrt(D)
    for b in relpos.mechanism(attn.spec, D, HQ)["biases"]:
        if b["slopes"]:
            sc = sc - torch.tensor(b["slopes"], dtype=sc.dtype)[None, :, None, None] * lag
    return torch.softmax(sc.masked_fill(lag < 0, float("-inf")), -1) @ v.repeat_interleave(HQ // HK, 1)


@pytest.mark.parametrize("spec", SPECS)
def test_forward_is_the_formula(spec):
    attn = module(spec)
    q, k, v, x = tensors()
    torch.testing.assert_close(attn(q, k, v, inputs=x), reference(attn, q, k, v, x), rtol=0, atol=1e-11)
    a32 = copy.deepcopy(attn).float()
    torch.testing.assert_close(a32(q.float(), k.float(), v.float(), inputs=x.float()).double(),
                               reference(attn, q, k, v, x), rtol=0, atol=2e-5)


@pytest.mark.parametrize("spec", SPECS + BASIS)
def test_decode_through_the_cache_is_the_full_forward(spec):
    check_decoding(module(spec, pair_layout="half_split"), *tensors(T=9))


@pytest.mark.parametrize("spec", SPECS + BASIS)
def test_gradients(spec):
    attn = module(spec, pair_layout="half_split")
    q, k, v, x = (t.requires_grad_() for t in tensors(B=1, T=4))
    assert torch.autograd.gradcheck(lambda q, k, v, x: attn(q, k, v, inputs=x), (q, k, v, x))
    check_parameter_gradients(attn, q, k, v, x)


def test_initial_frequencies_are_rope_and_names_are_the_runtimes():
    for spec in BASE:
        a = relpos.Attention(spec, D, HQ, HK).double()
        assert [n for n, _ in a.named_parameters()] == ["log_freq"]
        q, k, v, _ = tensors()
        rope = relpos.Attention("rope", D, HQ, HK).double()
        # (log_freq is created in float32, as the reference's parameter: RoPE to ~1e-7)
        torch.testing.assert_close(a(q, k, v), rope(q, k, v), rtol=0, atol=1e-7)
        assert sorted(n for n, _ in relpos.Attention(f"{spec}(context=true, basis=cayley)", D, HQ,
                                                     HK, model_dim=MODEL_DIM).named_parameters()) == [
            "basis_w", "ctx_b", "ctx_w", "log_freq"]


def test_bad_calls_raise_input_errors():
    spec = BASE[0]
    q, k, v, x = tensors()
    with pytest.raises(relpos.InputError, match="model_dim"):
        relpos.Attention(f"{spec}(context=true)", D, HQ, HK)
    ctx = relpos.Attention(f"{spec}(context=true)", D, HQ, HK, model_dim=MODEL_DIM).double()
    with pytest.raises(relpos.InputError, match="inputs="):
        ctx(q, k, v)
    with pytest.raises(relpos.InputError, match="half-split"):
        relpos.Attention(f"{spec}(basis=cayley)", D, HQ, HK).double()(q, k, v)
    with pytest.raises(relpos.InputError, match="other transforms"):
        relpos.Attention(f"orthogonal_mix + {spec}", D, HQ, HK)
    cache = relpos.KVCache(2, HK, D, dtype=torch.float64)
    with pytest.raises(relpos.InputError, match="key_len"):
        ctx(q, k, v, inputs=x, cache=cache, key_len=torch.tensor([7, 5]))
    assert cache.length == 0
