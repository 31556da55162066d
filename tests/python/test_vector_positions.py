"""relpos.Attention with a rotation by vector positions (every catalog transform whose JSON time is
``vector_position``, with its basis and dimension options), with no per-mechanism code: the
forward against R(r) = U [(+)_u R_2(lambda_u . r)] U^T written in plain float64 torch from the
JSON and the module's parameters, decoding through the cache against the full forward, gradients
of q, k, v and every parameter, translation invariance (Theorem 1), and the refusals."""

import copy
import math

import pytest
import torch

import relpos
from module_checks import catalog_term, check_decoding, check_parameter_gradients, grouped_qkv, jittered

HQ, HK, D = 4, 2, 12
CATALOG = [m["name"] for m in relpos.mechanisms() if m["kind"] != "scaling"]


def vector_term(spec):
    return catalog_term(spec, D, HK, lambda t: t["time"] == "vector_position")


BASE = [s for s in CATALOG if vector_term(s) is not None]
SPECS = [v for s in BASE for v in (s, f"{s}(basis=mixed)", f"{s}(basis=axial)",
                                   f"{s}(dims=3, basis=exp)", f"{s}(dims=1, basis=mixed)")]
LAYOUTS = ["interleaved", "half_split"]

pytestmark = pytest.mark.usefixtures("one_thread")


def module(spec, layout="interleaved", jitter=0.3, **kw):
    torch.manual_seed(5)
    a = relpos.Attention(spec, D, HQ, HK, pair_layout=layout, **kw).double()
    return jittered(a, jitter)


def tensors(spec, B=2, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = grouped_qkv(g, B, T, D, HQ, HK)
    r = 4 * torch.randn(B, T, vector_term(spec)["vector_dims"], generator=g, dtype=torch.float64)
    return q, k, v, r


def reference(attn, q, k, v, r, causal=True):
    """Per key/value head h: lambda (the module's ``freqs``, else the JSON's fixed values), U = E P
    with E = Cayley / exp of W - W^T (``basis_w``) or I and P the layout's planes; y = U R_2(theta)
    U^T x on each plane; query head i uses head i // (HQ / HK); softmax over the token order."""
    t = vector_term(attn.spec)
    dc, M = t["vector_dims"], t["planes"]
    lam = attn.freqs if hasattr(attn, "freqs") else torch.tensor(t["plane_freqs"], dtype=torch.float64).view(HK, dc, M)
    P = torch.zeros(D, D, dtype=torch.float64)
    for u in range(M):
        a, b = (u, u + M) if attn.pair_layout == "half_split" else (2 * u, 2 * u + 1)
        P[a, 2 * u], P[b, 2 * u + 1] = 1, 1
    U = P.expand(HK, D, D)
    if hasattr(attn, "basis_w"):
        A = attn.basis_w - attn.basis_w.transpose(-1, -2)
        eye = torch.eye(D, dtype=torch.float64).expand_as(A)
        E = torch.linalg.matrix_exp(A) if t["basis"] == "exp" else torch.linalg.solve(eye - A, eye + A)
        U = E @ P
    theta = torch.einsum("btk,hku->bhtu", r, lam.double())  # [B, HK, T, M]
    c, s = theta.cos(), theta.sin()

    def turn(x):  # x [B, HK, T, D]
        z = x @ U  # U^T x per row
        z0, z1 = z[..., 0::2], z[..., 1::2]
        z = torch.stack([c * z0 - s * z1, s * z0 + c * z1], -1).flatten(-2)
        return z @ U.transpose(-1, -2)

    g = HQ // HK
    B, _, T, _ = q.shape
    # query head h = kv * g + i turns with kv's rotation
    qg = q.reshape(B, HK, g, T, D)
    qt = torch.stack([turn(qg[:, :, i]) for i in range(g)], 2).reshape(B, HQ, T, D)
    kt = turn(k).repeat_interleave(g, 1)
    sc = qt @ kt.transpose(-1, -2) / math.sqrt(D)
    if causal:
        idx = torch.arange(T)
        sc = sc.masked_fill(idx[None, :] > idx[:, None], float("-inf"))
    return torch.softmax(sc, -1) @ v.repeat_interleave(g, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("spec", SPECS)
def test_forward_is_the_formula(spec, layout):
    for causal in (True, False):
        attn = module(spec, layout, causal=causal)
        q, k, v, r = tensors(spec)
        want = reference(attn, q, k, v, r, causal)
        torch.testing.assert_close(attn(q, k, v, positions=r), want, rtol=0, atol=1e-11)
        # positions shared by the batch
        torch.testing.assert_close(attn(q, k, v, positions=r[0]),
                                   reference(attn, q, k, v, r[0].expand_as(r), causal), rtol=0, atol=1e-11)
        a32 = copy.deepcopy(attn).float()
        torch.testing.assert_close(a32(q.float(), k.float(), v.float(), positions=r).double(), want,
                                   rtol=0, atol=2e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_through_the_cache_is_the_full_forward(spec):
    q, k, v, r = tensors(spec, T=9)
    check_decoding(module(spec, "half_split"), q, k, v, torch.zeros(2, 9, 1, dtype=torch.float64), r)


@pytest.mark.parametrize("spec", SPECS)
def test_gradients(spec):
    attn = module(spec)
    q, k, v, r = tensors(spec, B=1, T=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: attn(q, k, v, positions=r), (q, k, v))
    check_parameter_gradients(attn, q, k, v, None, positions=r)


@pytest.mark.parametrize("spec", SPECS)
def test_scores_are_relative_in_the_positions(spec):
    """Theorem 1: moving every position by one vector leaves a non-causal output unchanged; the
    positions are not ignored."""
    attn = module(spec, causal=False)
    q, k, v, r = tensors(spec)
    out = attn(q, k, v, positions=r)
    shift = 100 * torch.randn(r.shape[-1], dtype=torch.float64)
    torch.testing.assert_close(attn(q, k, v, positions=r + shift), out, rtol=0, atol=1e-10)
    assert (attn(q, k, v, positions=2 * r) - out).abs().max() > 1e-3


def test_parameters_are_the_runtimes_and_seeded():
    for spec in BASE:
        assert [n for n, _ in relpos.Attention(f"{spec}(basis=axial)", D, HQ, HK).named_parameters()] == []
        assert [n for n, _ in relpos.Attention(f"{spec}(basis=mixed)", D, HQ, HK).named_parameters()] == ["freqs"]
        cay = relpos.Attention(f"{spec}(basis=cayley)", D, HQ, HK)
        assert sorted(n for n, _ in cay.named_parameters()) == ["basis_w", "freqs"]
        assert cay.freqs.shape == (HK, 2, D // 2) and cay.basis_w.shape == (HK, D, D)
        # the initial values come from the spec (its seed), not from torch's generator
        torch.manual_seed(0)
        a = relpos.Attention(f"{spec}(basis=mixed, seed=3)", D, HQ, HK).freqs.detach().clone()
        torch.manual_seed(1)
        b = relpos.Attention(f"{spec}(basis=mixed, seed=3)", D, HQ, HK).freqs
        assert torch.equal(a, b)
        assert not torch.equal(a, relpos.Attention(f"{spec}(basis=mixed, seed=4)", D, HQ, HK).freqs)


def test_bad_calls_raise_input_errors():
    spec = BASE[0]
    attn = module(spec)
    q, k, v, r = tensors(spec)
    with pytest.raises(relpos.InputError, match="vector positions"):
        attn(q, k, v)
    with pytest.raises(relpos.InputError, match="vector positions"):
        attn(q, k, v, positions=torch.arange(7.0))
    with pytest.raises(relpos.InputError, match="vector positions"):
        attn(q, k, v, positions=r[..., :1])
    bad = r.clone()
    bad[0, 3, 1] = float("nan")
    with pytest.raises(relpos.InputError, match="NaN"):
        attn(q, k, v, positions=bad)
    # the encoding alone and the functional call cannot take vector positions: named errors
    with pytest.raises(relpos.InputError, match="relpos.Attention"):
        relpos.PositionEncoding(spec, D, HK)(k, k)
    with pytest.raises(relpos.InputError, match="vector positions"):
        relpos.attention(q, k, v, spec)
    with pytest.raises(relpos.InputError, match="composes with no other term"):
        relpos.Attention(f"{spec} + alibi", D, HQ, HK)
    cache = relpos.KVCache(2, HK, D, dtype=torch.float64)
    with torch.no_grad(), pytest.raises(relpos.InputError, match="vector positions"):
        attn(q, k, v, cache=cache)
    assert cache.length == 0
