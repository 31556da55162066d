"""JoFormer's journey transform from Python: torch.ops.relpos.rotate_pairs against the rotation
written with plain ops (gradcheck in float64, torch.compile fullgraph), journey attention against
o_i = sum_j alpha_ij R(theta_j - theta_i) v_j from its definition, exact shift invariance of fixed
frames, per-token frames by the causal scan, named errors."""

import math

import pytest
import torch

import relpos


def rotate_composed(x, a, inverse=False):
    s = -1.0 if inverse else 1.0
    c, n = torch.cos(a).unsqueeze(1), s * torch.sin(a).unsqueeze(1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([c * x0 - n * x1, n * x0 + c * x1], -1).flatten(-2)


def by_definition(q, k, v, theta):
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    for i in range(T):
        rel = (theta[:, : i + 1] - theta[:, i : i + 1])  # [B, i+1, P]
        kj = rotate_composed(k[:, :, : i + 1], rel)
        vj = rotate_composed(v[:, :, : i + 1], rel)
        w = torch.softmax((q[:, :, i : i + 1] * kj).sum(-1) / math.sqrt(D), -1)
        out[:, :, i] = (w.unsqueeze(-1) * vj).sum(2)
    return out


@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_pairs_matches_composed_and_gradcheck(inverse):
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    a = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.allclose(relpos.rotate_pairs(x, a, inverse=inverse), rotate_composed(x, a, inverse),
                          atol=1e-13)
    c, s = torch.cos(a).detach().requires_grad_(), torch.sin(a).detach().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, c, s: torch.ops.relpos.rotate_pairs(x, c, s, inverse, 0), (x, c, s))
    assert torch.autograd.gradcheck(lambda x, a: relpos.rotate_pairs(x, a, inverse=inverse), (x, a))


@pytest.mark.parametrize("layout", ["interleaved", "half_split"])
def test_rotate_pairs_takes_a_table_computed_once(layout):
    """cos=, sin= (a fixed frame's table) is the angles' rotation, with the angles' gradients by
    the chain rule; anything but exactly one of the two forms is refused by name."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    a = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    want = relpos.rotate_pairs(x, a, inverse=True, pair_layout=layout)
    got = relpos.rotate_pairs(x, cos=a.cos(), sin=a.sin(), inverse=True, pair_layout=layout)
    assert torch.equal(got, want)
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (x, a), g)
    assert all(torch.allclose(u, w, atol=1e-13)
               for u, w in zip(torch.autograd.grad(got, (x, a), g), want_grads))
    for bad, match in ((dict(angles=a, cos=a.cos(), sin=a.sin()), "either angles or cos"),
                       (dict(), "either angles or cos"),
                       (dict(cos=a.cos()), "both be tensors"),
                       (dict(cos=a.cos(), sin=[0.0]), "both be tensors"),
                       (dict(angles=[0.0]), "must be a tensor"),
                       (dict(cos=a.cos(), sin=a.sin()[:4]), "differ in shape")):
        with pytest.raises(relpos.InputError, match=match):
            relpos.rotate_pairs(x, **bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cos_sin_op_matches_float64_and_differentiates(dtype):
    """A frame's table in one pass: float32 within 2 ulp of float64 cos/sin over the angles of
    long contexts, float64 to libm's rounding (torch's own differs in the last bit); NaN/inf angles give NaN there only; the gradient is
    -sin dcos + cos dsin."""
    a64 = torch.cat([torch.linspace(-7, 7, 1001, dtype=torch.float64),
                     3e4 * torch.randn(999, dtype=torch.float64),
                     torch.tensor([0.0, 1e-30, 6e8, -3e38, math.nan, math.inf], dtype=torch.float64)])
    a = a64.to(dtype).view(2, 1003)
    c, s = torch.ops.relpos.cos_sin(a)
    assert c.dtype == s.dtype == dtype and c.shape == s.shape == a.shape
    want_c, want_s = torch.cos(a.double()), torch.sin(a.double())
    finite = a.isfinite()
    assert c[~finite].isnan().all() and s[~finite].isnan().all()
    if dtype == torch.float64:
        for got, want in ((c, want_c), (s, want_s)):
            assert torch.allclose(got[finite], want[finite], rtol=0, atol=4e-16)
    else:
        ulp = lambda w: (torch.nextafter(w.abs().float(), torch.tensor(math.inf)) - w.abs().float()).double()
        for got, want in ((c, want_c), (s, want_s)):
            assert ((got.double() - want).abs() / ulp(want))[finite].max() <= 2.0
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: torch.ops.relpos.cos_sin(x), (x,))
    assert torch.autograd.gradcheck(lambda x: torch.ops.relpos.cos_sin(x)[1], (x,))
    with pytest.raises(ValueError, match="angles must be a real tensor"):
        torch.ops.relpos.cos_sin(torch.zeros(3, dtype=torch.complex64))


def test_rotate_pairs_compiles_fullgraph():
    x = torch.randn(2, 2, 6, 8, requires_grad=True)
    a = torch.randn(6, 4, requires_grad=True)
    f = torch.compile(lambda x, a: relpos.rotate_pairs(x, a).square().sum(), fullgraph=True,
                      backend="aot_eager")
    f(x, a).backward()
    gx, ga = x.grad.clone(), a.grad.clone()
    x.grad = a.grad = None
    relpos.rotate_pairs(x, a).square().sum().backward()
    assert torch.allclose(gx, x.grad, atol=1e-5) and torch.allclose(ga, a.grad, atol=1e-4)


@pytest.mark.parametrize("spec", ["journey", "journey(angles=integer)"])
def test_fixed_journey_attention_matches_definition_and_is_shift_invariant(spec):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64) for _ in range(3))
    out = relpos.attention(q, k, v, spec)
    theta = relpos.frame_angles(spec, 8, 2, length=7)
    assert torch.allclose(out, by_definition(q, k, v, theta.expand(2, 7, 4)), atol=1e-12)
    shifted = relpos.frame_angles(spec, 8, 2, positions=torch.arange(7, dtype=torch.float64) + 999.5)
    out2, _ = relpos.fused_attention(*(relpos.rotate_pairs(t, shifted) for t in (q, k, v)))
    assert torch.allclose(relpos.rotate_pairs(out2, shifted, inverse=True), out, atol=1e-12)


def test_per_token_journey_attention_uses_the_causal_scan():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 1, 6, 6, dtype=torch.float64) for _ in range(3))
    inc = torch.randn(1, 6, 3, dtype=torch.float64)
    out = relpos.journey_attention(q, k, v, "journey(angles=token)", increments=inc)
    phi = torch.cumsum(inc, 1) - inc
    assert torch.allclose(out, by_definition(q, k, v, phi), atol=1e-12)
    with pytest.raises(relpos.InputError, match="increments"):
        relpos.attention(q, k, v, "journey(angles=token)")
    with pytest.raises(relpos.InputError, match="pair_layout"):
        relpos.rotate_pairs(q, inc, pair_layout="zigzag")


@pytest.mark.parametrize("spec", ["orthogonal_mix(seed=3) + journey", "journey + orthogonal_mix(seed=3)"])
def test_journey_with_another_transform_is_refused(spec):
    """A fixed map composed with journey frames used to be dropped silently by relpos.attention
    (the output equalled plain "journey"); the C++ path refuses it, and so does Python now."""
    q = torch.randn(1, 2, 6, 16, dtype=torch.float64)
    with pytest.raises(relpos.InputError, match="composes with bias terms only"):
        relpos.attention(q, q, q, spec)
    with pytest.raises(ValueError, match="composes with bias terms only"):
        torch.ops.relpos.attention(q, q, q, spec)


def test_journey_attention_applies_the_specs_bias_terms():
    """journey_attention took the journey term alone: "journey + alibi" and "journey + t5_bias" gave
    plain journey's output bit for bit, and "journey + fox" ran without its gates. Now the bias
    terms apply as relpos.attention and the C++ paths apply them, or the call is refused."""
    torch.manual_seed(2)
    H, T, D = 2, 6, 8
    q, k, v = (torch.randn(1, H, T, D, dtype=torch.float64) for _ in range(3))
    plain = relpos.journey_attention(q, k, v, "journey")
    slopes = torch.tensor(relpos.mechanism("alibi", D, H)["biases"][0]["slopes"], dtype=torch.float64)
    alibi = relpos.journey_attention(q, k, v, "journey + alibi")
    assert not torch.allclose(alibi, plain)
    assert torch.equal(alibi, relpos.journey_attention(q, k, v, "journey", slopes=slopes))
    assert torch.equal(alibi, relpos.Attention("journey + alibi", D, H).double()(q, k, v))
    t5 = relpos.journey_attention(q, k, v, "journey + t5_bias")
    assert not torch.allclose(t5, plain)
    assert torch.equal(t5, relpos.attention(q, k, v, "journey + t5_bias"))  # the C++ op
    with pytest.raises(relpos.InputError, match="cq and ck"):
        relpos.journey_attention(q, k, v, "journey + fox")


@pytest.mark.parametrize("rule", ["yarn(factor=4, original=4)", "dynamic_ntk(factor=4, original=4)",
                                  "pj_pi(L=4)"])
def test_journey_frames_refuse_context_extension_rules(rule):
    """The frames ignored the rule (or, for YaRN, its attention factor): refused on every path, as
    relpos.Attention refuses them."""
    q = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    for call in (lambda: relpos.journey_attention(q, q, q, f"journey + {rule}"),
                 lambda: relpos.attention(q, q, q, f"journey + {rule}"),
                 lambda: relpos.Attention(f"journey + {rule}", 8, 2)):
        with pytest.raises(relpos.InputError, match="context-extension rules"):
            call()


def test_journey_attention_refuses_the_reversed_scan_when_causal():
    """The reference code's reversed inclusive scan reads later tokens: a causal call would leak
    them (row 0 moved with the last token's increment). Without causality it runs."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 1, 5, 6, dtype=torch.float64) for _ in range(3))
    inc = torch.randn(1, 5, 3, dtype=torch.float64)
    spec = "journey(angles=token, scan=reversed_inclusive)"
    with pytest.raises(relpos.InputError, match="reads later tokens"):
        relpos.journey_attention(q, k, v, spec, increments=inc)
    assert relpos.journey_attention(q, k, v, spec, increments=inc, causal=False).shape == q.shape


def test_journey_attention_returns_its_log_sum_exp():
    """relpos.attention(..., "journey", return_lse=True) returned (out, None)."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    out, lse = relpos.attention(q, k, v, "journey + alibi", return_lse=True)
    ref_out, ref_lse = relpos.Attention("journey + alibi", 8, 2).double()(q, k, v, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
