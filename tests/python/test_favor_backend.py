"""relpos.Attention(backend="favor"): FAVOR+ linear attention on random features of the
transformed q and k, over every catalog mechanism it takes (read from the refusal op, no
per-mechanism code): the forward against the feature map and causal prefix sums written in plain
float64 torch, convergence to the softmax module as features grow, the same outputs as the C++
module, gradients, and the refusals."""

import math

import pytest
import torch

import relpos
from module_checks import grouped_qkv, jittered

HQ, HK, MODEL_DIM = 4, 2, 12
SPECS = [m["name"] if m["kind"] != "scaling" else f"rope + {m['name']}" for m in relpos.mechanisms()]


def shape_for(spec):
    """The smallest head dim the favor module takes for the spec, or None when it refuses it."""
    for d in range(8, 49, 2):
        try:
            relpos.Attention(spec, d, HQ, HK, backend="favor", model_dim=MODEL_DIM)
            return d
        except relpos.InputError:
            continue
    return None


DIMS = {s: shape_for(s) for s in SPECS}
RUN = [s for s in SPECS if DIMS[s] is not None]


def vector_dims(spec):
    return next((t["vector_dims"] for t in relpos.mechanism(spec, DIMS[spec], HK)["transforms"]
                 if t["time"] == "vector_position"), None)


def through_encoding(spec):
    """Mechanisms whose q and k maps the encoding computes (no runtime of the module's own)."""
    info = relpos.mechanism(spec, DIMS[spec], HK)
    return all(t["time"] == "position" and not t["learned_frequencies"] for t in info["transforms"])


pytestmark = pytest.mark.usefixtures("one_thread")


def module(spec, jitter=0.2, **kw):
    torch.manual_seed(3)
    a = relpos.Attention(spec, DIMS[spec], HQ, HK, model_dim=MODEL_DIM, **kw).double()
    return jittered(a, jitter)


def tensors(spec, B=2, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = DIMS[spec]
    q, k, v = grouped_qkv(g, B, T, D, HQ, HK)
    x = torch.randn(B, T, MODEL_DIM, generator=g, dtype=torch.float64)
    dc = vector_dims(spec)
    r = None if dc is None else 3 * torch.randn(B, T, dc, generator=g, dtype=torch.float64)
    return q, k, v, x, r


def linear_attention(qt, kt, v, W, causal):
    """phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m), x' = x D^(-1/4); out_i = sum_j phi_i.phi_j v_j /
    sum_j phi_i.phi_j over j <= i (causal) or all j."""
    D, m = qt.shape[-1], W.shape[0]

    def phi(x):
        xs = x * D ** -0.25
        return torch.exp(xs @ W.T - (xs * xs).sum(-1, keepdim=True) / 2) / math.sqrt(m)

    pq, pk = phi(qt), phi(kt)
    w = pq @ pk.transpose(-1, -2)
    if causal:
        w = torch.tril(w)
    return (w @ v) / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("spec", [s for s in RUN if through_encoding(s)])
def test_forward_is_the_feature_map_on_the_transformed_qk(spec):
    for causal in (True, False):
        attn = module(spec, causal=causal, backend="favor", features=32)
        q, k, v, x, _ = tensors(spec)
        B, _, T, D = q.shape
        g = HQ // HK
        pos = torch.arange(T, dtype=torch.float64).expand(B, T)
        # q~ group i and k~ from the encoding, one call each (one centre), as test_engine does
        qg = q.reshape(B, HK, g, T, D)
        parts = []
        for i in range(g):
            qi, kt = attn.encoding(qg[:, :, i], k, pos)
            parts.append(qi)
        qt = torch.stack(parts, 2).reshape(B, HQ, T, D)
        want = linear_attention(qt, kt.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                attn.favor_projection.double(), causal)
        torch.testing.assert_close(attn(q, k, v, inputs=x), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("spec", RUN)
def test_favor_approaches_the_softmax_module(spec):
    """The same parameters (same seed) under both backends: the error falls as the features grow
    (slowly where a non-orthogonal map far from its centre makes q~ and k~ long: the estimator's
    variance grows like exp(|q~ + k~|^2 / sqrt(D)); xpos needs ~65k features for 0.05)."""
    q, k, v, x, r = tensors(spec, B=1, T=6)
    q, k = 0.5 * q, 0.5 * k  # logits of order one: the estimator's variance stays small
    soft = module(spec)(q, k, v, inputs=x, positions=r)
    err = {m: (module(spec, backend="favor", features=m)(q, k, v, inputs=x, positions=r) - soft)
           .abs().max().item() for m in (16, 65536)}
    assert err[65536] < 0.1 and err[65536] < err[16], err


@pytest.mark.parametrize("spec", RUN)
def test_python_and_cpp_modules_agree(spec):
    q, k, v, x, r = tensors(spec)
    torch.manual_seed(7)
    py = relpos.Attention(spec, DIMS[spec], HQ, HK, model_dim=MODEL_DIM, backend="favor").double()
    out, names, _ = torch.ops.relpos.cpp_attention_module(spec, DIMS[spec], HQ, HK, 0, MODEL_DIM, 7,
                                                          q, k, v, x, [], r, "favor")
    torch.testing.assert_close(py(q, k, v, inputs=x, positions=r), out, rtol=0, atol=1e-12)


def test_gradients():
    spec = "rope"
    attn = module(spec, backend="favor", features=16)
    q, k, v, x, _ = tensors(spec, B=1, T=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v), (q, k, v))


def test_the_catalog_runs_and_refusals_name_the_reason():
    assert {"rope", "nope", "structured", "grape_m"} <= set(RUN)
    D = 16
    for spec, why in (("alibi", "bias 'alibi'"), ("rope + t5_bias", "bias"),
                      ("journey", "values and outputs")):
        with pytest.raises(relpos.InputError, match=why):
            relpos.Attention(spec, D, HQ, HK, backend="favor")
    with pytest.raises(relpos.InputError, match="backend must be"):
        relpos.Attention("rope", D, HQ, HK, backend="linear")
    with pytest.raises(relpos.InputError, match="backend favor"):  # never silently ignored
        relpos.Attention("rope", D, HQ, HK, features=64)
    with pytest.raises(relpos.InputError, match="window"):
        relpos.Attention("rope", D, HQ, HK, backend="favor", window=4.0)
    attn = relpos.Attention("rope", D, HQ, HK, backend="favor").double()
    q = torch.randn(1, HQ, 5, D, dtype=torch.float64)
    k = torch.randn(1, HK, 5, D, dtype=torch.float64)
    with pytest.raises(relpos.InputError, match="key_len"):
        attn(q, k, k, key_len=torch.tensor([3]))
    with pytest.raises(relpos.InputError, match="decode cache"):
        attn(q, k, k, cache=relpos.KVCache(1, HK, D, dtype=torch.float64))
    with pytest.raises(relpos.InputError, match="log-sum-exp"):
        attn(q, k, k, return_lse=True)
    attn.window = 2.0  # set after construction: still refused, never ignored
    with pytest.raises(relpos.InputError, match="window"):
        attn(q, k, k)
    attn.window = 0.0
    with pytest.raises(relpos.InputError, match="increase"):
        attn(q, k, k, positions=torch.tensor([0.0, 2, 1, 3, 4], dtype=torch.float64))
    assert attn.favor_projection.shape == (4 * D, D)
    assert "favor_projection" in attn.state_dict()
