"""relpos.Attention with content-dependent biases (every mechanism of the catalog whose bias is
computed from the tokens, and their options), with no per-mechanism code: the forward against a
float64 composition from the bias shape's formula in plain torch ops (read from the mechanism
JSON), decoding through the cache against the full forward, causality, gradients of q, k, v, the
inputs and every parameter, and the refusals."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import relpos
from module_checks import check_decoding, check_parameter_gradients

H, MODEL_DIM = 2, 12
CATALOG = [m["name"] for m in relpos.mechanisms() if m["kind"] != "scaling"]


def content_bias_of(spec, d=8, heads=H):
    try:
        info = relpos.mechanism(spec, d, heads)
    except relpos.InputError:
        return None
    return next((b for b in info["biases"] if b["shape"] != "lag_table"), None)


# the catalog's content-bias mechanisms, their options, and compositions with a transform / slopes
SPECS = [s for s in CATALOG if content_bias_of(s) is not None] + [
    "grape_a(gate=k)", "grape_a(gate=q)", "grape_a(form=paper)", "grape_ap(form=paper, probe=4)",
    "rope + fox", "alibi + grape_a", "rope + grape_ap"]
D = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def module(spec, jitter=0.3, heads=H, kv_heads=None):
    torch.manual_seed(5)
    a = relpos.Attention(spec, D, heads, kv_heads, model_dim=MODEL_DIM).double()
    with torch.no_grad():
        for p in a.parameters():
            p.add_(jitter * torch.randn_like(p))
    return a


def tensors(B=2, T=7, dtype=torch.float64, seed=0, heads=H, kv_heads=H):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    x = torch.randn(B, T, MODEL_DIM, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, x


def rms(x):
    eps = torch.finfo(x.dtype).eps
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def content_reference(attn, qt, kt, x, pos):
    """The bias [B, H, T, T] of the mechanism's content term from its shape's formula (GRAPE
    spec grape-joformer.md 2.5-2.8): parameters in the runtime's order, options from the JSON."""
    b = content_bias_of(attn.spec, D, attn.num_heads)
    params = attn._content_params()
    m = torch.tensor(b["slopes"], dtype=torch.float64)
    lag = pos[:, None, :, None] - pos[:, None, None, :]
    if b["shape"] == "separable":  # c_i - c_j, c_t = sum_{s<=t} log sigmoid(w.x_s + b)
        c = F.logsigmoid(x @ params[0].T + params[1]).cumsum(1).transpose(1, 2)  # [B, H, T]
        return c[..., :, None] - c[..., None, :]
    if b["shape"] == "gated_slope":  # -(p_i - p_j)(gq_i + gk_j)
        omega = F.softplus(params[-1]) * (1 if b["paper_form"] else m)
        def gate(direction, y):
            u = direction if b["paper_form"] else direction / direction.norm(dim=-1, keepdim=True)
            return omega[None, :, None] * F.softplus(torch.einsum("bhtd,hd->bht", y, u) / math.sqrt(D))
        gk = gate(params[0], kt) if b["gate"] != "q" else torch.zeros(qt.shape[:3], dtype=qt.dtype)
        gq = gate(params[1 if b["gate"] == "qk" else 0], qt) if b["gate"] != "k" else torch.zeros_like(gk)
        return -lag * (gq[..., :, None] + gk[..., None, :])
    assert b["shape"] == "path_integral"  # sum_{l=j+1..i} beta log sigmoid(p_i . R_l p^_l / P)
    B, T = x.shape[:2]
    P = b["probe_dim"]
    p = (x @ params[0].T).view(B, T, attn.num_heads, P).transpose(1, 2)  # [B, H, T, P]
    half = P // 2
    c, s = pos.cos()[:, None, :, None], pos.sin()[:, None, :, None]
    pk = rms(p)
    pk = torch.cat([c * pk[..., :half] - s * pk[..., half:], s * pk[..., :half] + c * pk[..., half:]], -1)
    pq = rms(p) if b["paper_form"] else p
    beta = F.softplus(params[1]) if b["paper_form"] else m
    edge = beta[None, :, None, None] * F.logsigmoid(pq @ pk.transpose(-1, -2) / P)  # [B, H, i, l]
    out = torch.zeros(B, attn.num_heads, T, T, dtype=x.dtype)
    for i in range(T):
        for j in range(i):
            out[:, :, i, j] = edge[:, :, i, j + 1 : i + 1].sum(-1)
    return out


def reference(attn, q, k, v, x, pos):
    """Each query head through its key/value head's map and against its keys and values (g
    query heads a group); the per-token terms per query head."""
    B, Hq, T, _ = q.shape
    g = Hq // k.shape[1]
    pos = pos.expand(B, T).to(torch.float64)
    # q [B, Hk g, ...] as g rows of Hk heads, each beside its row's keys
    qg = q.unflatten(1, (-1, g)).transpose(1, 2).flatten(0, 1)
    qt, kt = attn.encoding(qg, k.repeat_interleave(g, 0), pos.repeat_interleave(g, 0))
    qt = qt.unflatten(0, (B, g)).transpose(1, 2).flatten(1, 2)
    kt, v = kt[::g].repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = qt @ kt.transpose(-1, -2) / math.sqrt(D) + content_reference(attn, qt, kt, x, pos)
    lag = pos[:, None, :, None] - pos[:, None, None, :]
    info = relpos.mechanism(attn.spec, D, Hq)
    for b in info["biases"]:
        if b["shape"] == "lag_table" and b["slopes"]:
            s = s - torch.tensor(b["slopes"], dtype=s.dtype)[None, :, None, None] * lag
    return torch.softmax(s.masked_fill(lag < 0, float("-inf")), -1) @ v


@pytest.mark.parametrize("spec", SPECS)
def test_forward_is_the_formula(spec):
    attn = module(spec)
    q, k, v, x = tensors()
    pos = torch.arange(q.shape[2], dtype=torch.float64)
    torch.testing.assert_close(attn(q, k, v, inputs=x), reference(attn, q, k, v, x, pos),
                               rtol=0, atol=1e-11)
    # float32 parameters and inputs against the same float64 formula
    a32 = copy.deepcopy(attn).float()
    q32, k32, v32, x32 = tensors(dtype=torch.float32)
    torch.testing.assert_close(a32(q32, k32, v32, inputs=x32).double(),
                               reference(attn, q, k, v, x, pos), rtol=0, atol=2e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_grouped_heads_are_the_formula(spec):
    """4 query heads on 2 key/value heads: the per-token terms per query head, a query head's
    key gates from its key/value head's keys: the formula, every parameter's gradient against
    finite differences, and decoding through the cache."""
    attn = module(spec, heads=4, kv_heads=2)
    q, k, v, x = tensors(heads=4, kv_heads=2)
    pos = torch.arange(q.shape[2], dtype=torch.float64)
    torch.testing.assert_close(attn(q, k, v, inputs=x), reference(attn, q, k, v, x, pos),
                               rtol=0, atol=1e-11)
    check_decoding(attn, *tensors(T=9, heads=4, kv_heads=2))
    check_parameter_gradients(attn, *(t[:1, :, :4] if t.dim() == 4 else t[:1, :4]
                                      for t in (q, k, v, x)))


@pytest.mark.parametrize("spec", SPECS)
def test_decode_through_the_cache_is_the_full_forward(spec):
    check_decoding(module(spec), *tensors(T=9))


@pytest.mark.parametrize("spec", SPECS)
def test_a_later_token_leaves_earlier_outputs_unchanged(spec):
    attn = module(spec)
    q, k, v, x = tensors(T=6)
    q2, k2, v2, x2 = (t.clone() for t in (q, k, v, x))
    for t in (q2, k2, v2):
        t[:, :, -1] += 3.0
    x2[:, -1] += 3.0
    torch.testing.assert_close(attn(q2, k2, v2, inputs=x2)[:, :, :-1],
                               attn(q, k, v, inputs=x)[:, :, :-1], rtol=0, atol=0)


@pytest.mark.parametrize("spec", SPECS)
def test_gradcheck_inputs_and_parameters(spec):
    attn = module(spec)
    q, k, v, x = (t.requires_grad_() for t in tensors(B=1, T=4))
    assert torch.autograd.gradcheck(lambda q, k, v, x: attn(q, k, v, inputs=x), (q, k, v, x))
    # every parameter reaches the output, with the finite-difference gradient
    check_parameter_gradients(attn, q, k, v, x)


def test_parameters_are_the_runtimes_with_their_names():
    a = relpos.Attention("fox", D, H, model_dim=MODEL_DIM)
    assert sorted(a.state_dict()) == ["fox.bias", "fox.weight"]
    assert a.fox.weight.shape == (H, MODEL_DIM) and not a.fox.bias.detach().any()
    # the initial draws come from torch's generator in the runtime's order: seeded, reproducible
    torch.manual_seed(1)
    w1 = relpos.Attention("grape_a", D, H).state_dict()
    torch.manual_seed(1)
    w2 = relpos.Attention("grape_a", D, H).state_dict()
    assert list(w1) == ["gate_u", "gate_v", "gate_rho"]
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
    assert sorted(relpos.Attention("grape_ap(form=paper)", D, H, model_dim=4).state_dict()) == [
        "probe.weight", "probe_rho"]


def test_a_reset_cache_takes_another_mechanism():
    """reset() empties the key-side tensors too: a cache FoX filled, once reset, decodes GRAPE-A
    (other side tensors), then GRAPE-M (none), each equal to its full forward."""
    q, k, v, x = tensors()
    cache = relpos.KVCache(2, H, D, dtype=torch.float64)
    for spec in ("fox", "grape_a", "grape_m"):
        attn = module(spec)
        with torch.no_grad():
            out = torch.cat([attn(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                  inputs=x[:, t:t + 1], cache=cache) for t in range(q.shape[2])], 2)
        torch.testing.assert_close(out, attn(q, k, v, inputs=x), rtol=0, atol=1e-12)
        cache.reset()


def test_bad_calls_raise_input_errors():
    q, k, v, x = tensors()
    with pytest.raises(relpos.InputError, match="model_dim"):
        relpos.Attention("fox", D, H)
    fox = relpos.Attention("fox", D, H, model_dim=MODEL_DIM).double()
    with pytest.raises(relpos.InputError, match="inputs="):
        fox(q, k, v)
    with pytest.raises(relpos.InputError, match="model_dim"):
        fox(q, k, v, inputs=x[..., :5])
    with pytest.raises(relpos.InputError, match=r"\[B, T, model_dim\]"):
        fox(q, k, v, inputs=x[:, :3])
    with pytest.raises(relpos.InputError, match=r"\[B, T, model_dim\]"):
        relpos.Attention("grape_a", D, H).double()(q, k, v, inputs=x[:1])
    # a path-integral bias decodes rows of one length
    ap = relpos.Attention("grape_ap", D, H, model_dim=MODEL_DIM).double()
    cache = relpos.KVCache(2, H, D, dtype=torch.float64)
    with pytest.raises(relpos.InputError, match="one length"):
        ap(q, k, v, inputs=x, cache=cache, key_len=torch.tensor([7, 5]))
    assert cache.length == 0


@pytest.mark.parametrize("spec", SPECS)
def test_a_parameter_of_another_shape_is_refused(spec):
    """A content parameter a user replaced with one of another shape is an InputError naming it,
    in a forward recording gradients and in a cached step without autograd (whose host loops
    would read past its end), and the cache is left as it was."""
    q, k, v, x = tensors()
    names = module(spec)._content["names"]
    for name in names:
        for dim in range(module(spec).get_parameter(name).dim()):
            a = module(spec)
            *path, leaf = name.split(".")
            owner = a.get_submodule(".".join(path))
            shape = list(getattr(owner, leaf).shape)
            shape[dim] += 1
            cache = relpos.KVCache(2, H, D, dtype=torch.float64)
            with torch.no_grad():
                a(q[:, :, :3], k[:, :, :3], v[:, :, :3], inputs=x[:, :3], cache=cache)
            setattr(owner, leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)))
            want = rf"{leaf}|model_dim" if dim > 0 else leaf
            with pytest.raises(relpos.InputError, match=want):
                a(q, k, v, inputs=x)
            with torch.no_grad(), pytest.raises(relpos.InputError, match=want):
                a(q[:, :, 3:4], k[:, :, 3:4], v[:, :, 3:4], inputs=x[:, 3:4], cache=cache)
            assert cache.length == 3
