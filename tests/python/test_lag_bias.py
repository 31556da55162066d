"""Learned lag tables in Python, for every mechanism of relpos.mechanisms() that has one (no
per-family code): the module's parameters are the C++ module's (names and shapes of the mechanism's
lag_params, which the C++ module registers: tests/torch/test_lag_bias.cpp), enc.lag_table is
differentiable (gradcheck in float64), and relpos.attention with the module applies its table
(equal to a plain-torch float64 composition, forward and parameter gradients)."""

import math

import pytest
import torch

import relpos

H = 2


def _learned():
    out = []
    for info in relpos.mechanisms():
        if info["kind"] != "bias":
            continue
        biases = relpos.mechanism(info["name"], 8, H)["biases"]
        params = [p for b in biases for p in b.get("lag_params", [])]
        if params:
            out.append((info["name"], params))
    return out


LEARNED = _learned()


def test_the_catalog_has_learned_tables():
    assert len(LEARNED) >= 3


@pytest.mark.parametrize("spec,params", LEARNED, ids=[s for s, _ in LEARNED])
def test_state_dict_names_and_shapes(spec, params):
    enc = relpos.PositionEncoding(spec, 8, H)
    sd = enc.state_dict()
    for p in params:
        assert p["name"] in sd, p["name"]
        assert list(sd[p["name"]].shape) == p["shape"], p["name"]
        # learnable where the table reads it; a part the spec leaves off keeps a buffer
        assert isinstance(getattr(enc, p["name"]), torch.nn.Parameter) == p["trained"], p["name"]
    t = enc.lag_table(5)
    assert t.dtype == torch.float64 and t.shape == (H, 5)
    assert relpos.PositionEncoding("rope", 8, H).lag_table(5) is None
    with pytest.raises(relpos.InputError):
        enc.lag_table(0)


@pytest.mark.parametrize("spec,params", LEARNED, ids=[s for s, _ in LEARNED])
def test_lag_table_gradcheck(spec, params):
    enc = relpos.PositionEncoding(spec, 8, H).double()
    names = [p["name"] for p in params]
    with torch.no_grad():
        for n in names:
            getattr(enc, n).add_(torch.rand_like(getattr(enc, n)) - 0.5)

    leaves = tuple(getattr(enc, n).detach().clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(
        lambda *ps: torch.ops.relpos.lag_table(enc.spec, 8, H, list(ps), 12), leaves
    )
    # enc.lag_table itself reaches every parameter the table uses
    out = enc.lag_table(12)
    out.sum().backward()
    assert all(getattr(enc, p["name"]).grad is not None for p in params if p["trained"])


# PJ-RoPE's sectors, each alone and together, and the damped light-cone term
PJ_SECTORS = ["pj_bias(sectors=fj)", "pj_bias(sectors=affine)", "pj_bias(sectors=lc)",
              "pj_bias(sectors=lc, lc_damping=true)", "pj_bias(sectors=affine/lc)",
              "pj_bias(sectors=fj/affine/lc)", "pj_bias(R=0)"]


@pytest.mark.parametrize("spec", PJ_SECTORS + [s for s, _ in LEARNED])
def test_a_table_trains_exactly_what_it_reads(spec):
    """The module's parameters are the tensors the table depends on: each gets a nonzero gradient
    from it (torch's DistributedDataParallel refuses a parameter that gets none), and every tensor
    it keeps as a buffer (a part the spec leaves off, a softmax over one entry) leaves the table
    bit-equal when changed. The state-dict names are the mechanism's whatever the parts
    (checkpoints load across them)."""
    enc = relpos.PositionEncoding(spec, 8, H).double()
    lag = [p["name"] for b in relpos.mechanism(spec, 8, H)["biases"]
           for p in b.get("lag_params", [])]
    assert set(lag) <= set(enc.state_dict())
    trained = {n for n, _ in enc.named_parameters()}
    with torch.no_grad():  # off the initial values, where some gradients vanish (zero zetas)
        for n in trained:
            enc.get_parameter(n).add_(torch.rand_like(enc.get_parameter(n)) - 0.5)
    (enc.lag_table(12) * torch.randn(H, 12, dtype=torch.float64)).sum().backward()
    for n in trained:
        g = enc.get_parameter(n).grad
        assert g is not None and g.abs().max() > 0, n
    before = enc.lag_table(12)
    for n in set(lag) - trained:
        with torch.no_grad():
            enc.get_buffer(n).add_(0.5)
        assert torch.equal(enc.lag_table(12), before), n
    if spec == "pj_bias":  # the default sectors fj/affine: the light-cone tensors are kept
        assert set(lag) - trained == {n for n in lag if n.startswith("pj_lc_")}


@pytest.mark.parametrize("spec,params", LEARNED, ids=[s for s, _ in LEARNED])
def test_attention_applies_the_module_table(spec, params):
    T, D = 10, 8
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    enc = relpos.PositionEncoding(spec, D, H).double()
    with torch.no_grad():
        for p in params:
            getattr(enc, p["name"]).add_(torch.rand_like(getattr(enc, p["name"])) - 0.5)
    out = relpos.attention(q, k, v, enc)
    names = [p["name"] for p in params if p["trained"]]
    leaves = [getattr(enc, n) for n in names]
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * dout).sum(), leaves, allow_unused=True)
    # plain torch: softmax(q k^T / sqrt(D) + table[i - j]) v over j <= i
    i = torch.arange(T)
    lag = (i[:, None] - i[None, :]).clamp_min(0)
    table = enc.lag_table(T)
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + table[:, lag][None]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    ref = torch.softmax(s, -1) @ v
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-11)
    ref_grads = torch.autograd.grad((ref * dout).sum(), leaves, allow_unused=True)
    for n, a, b in zip(names, grads, ref_grads):
        a = torch.zeros_like(getattr(enc, n)) if a is None else a
        b = torch.zeros_like(getattr(enc, n)) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=n)
    # grouped-query attention needs a table row per query head: refused, naming it, unless the
    # encoding has them (bias_heads); then each query head reads its own row
    q2 = torch.randn(1, 2 * H, T, D, generator=g, dtype=torch.float64)
    with pytest.raises(relpos.InputError, match="learned lag table"):
        relpos.attention(q2, k, v, enc)
    grouped = relpos.PositionEncoding(spec, D, H, bias_heads=2 * H).double()
    with torch.no_grad():
        for p in params:
            getattr(grouped, p["name"]).add_(torch.rand_like(getattr(grouped, p["name"])) - 0.5)
    table = grouped.lag_table(T)
    assert table.shape == (2 * H, T)
    s = q2 @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(D) + table[:, lag][None]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(relpos.attention(q2, k, v, grouped),
                               torch.softmax(s, -1) @ v.repeat_interleave(2, 1),
                               rtol=1e-10, atol=1e-11)
    with pytest.raises(relpos.InputError, match="divide"):
        relpos.PositionEncoding(spec, D, H, bias_heads=H + 1)
    with pytest.raises(relpos.InputError, match="bias_heads"):
        relpos.PositionEncoding(spec, D, H, bias_heads=0)


def test_journey_with_a_learned_table_applies_the_table():
    """relpos.attention with a PositionEncoding of a journey spec plus a learned lag table used to
    take the journey branch without the table (plain journey attention under the name)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 16, dtype=torch.float64) for _ in range(3))
    enc = relpos.PositionEncoding("journey + t5_bias(init_std=0.5)", 16, 2).double()
    got = relpos.attention(q, k, v, enc)
    plain = relpos.attention(q, k, v, "journey")
    assert not torch.allclose(got, plain, atol=1e-6)
    # the same as the spec string, whose initial table is the module's (no torch RNG in t5_bias)
    torch.testing.assert_close(got, relpos.attention(q, k, v, "journey + t5_bias(init_std=0.5)"))


def _bounded():
    out = []
    for spec, params in LEARNED:
        info = relpos.mechanism(spec, 8, H)
        bounds = [b["constant_from"] for b in info["biases"] if b["learned"]]
        if all(b is not None for b in bounds):
            out.append((spec, params, max(bounds)))
    return out


BOUNDED = _bounded()


def test_some_learned_table_stops_changing():
    assert BOUNDED  # t5_bias: its last bucket holds every lag from some point on


@pytest.mark.parametrize("spec,params,bound", BOUNDED, ids=[s for s, _, _ in BOUNDED])
def test_tables_stop_changing_where_the_mechanism_says(spec, params, bound):
    """A table reporting constant_from n is constant from lag n (whatever its parameters) and
    changes between n - 1 and n at random parameters; attention reads only lags up to n (the
    kernel reads longer ones at the table's last entry), with the same result as the full table,
    forward, parameter gradients and decode through the cache."""
    T, D = bound + 30, 8
    enc = relpos.PositionEncoding(spec, D, H).double()
    with torch.no_grad():
        for p in params:
            getattr(enc, p["name"]).copy_(torch.randn_like(getattr(enc, p["name"])))
    full = enc.lag_table(T).detach()
    assert torch.equal(full[:, bound:], full[:, bound:bound + 1].expand(-1, T - bound))
    assert not torch.equal(full[:, bound - 1], full[:, bound])
    assert enc.attention_lag_table(T - 1).shape == (H, bound + 1)

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    names = [p["name"] for p in params]
    leaves = [getattr(enc, n) for n in names]
    out = relpos.attention(q, k, v, enc)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * dout).sum(), leaves)
    ref = relpos.fused_attention(q, k, v, lag_table=enc.lag_table(T))[0]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    ref_grads = torch.autograd.grad((ref * dout).sum(), leaves)
    for n, a, b in zip(names, grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=n)

    attn = relpos.Attention(spec, D, H).double()
    attn.encoding.load_state_dict(enc.state_dict())
    with torch.no_grad():
        whole = attn(q, k, v)
        cache = relpos.KVCache(1, H, D, dtype=torch.float64)
        steps = [attn(q[:, :, :T - 4], k[:, :, :T - 4], v[:, :, :T - 4], cache=cache)]
        for t in range(T - 4, T):
            steps.append(attn(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, 2), whole, rtol=1e-12, atol=1e-12)
