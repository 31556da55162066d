"""relpos.attention / relpos.fused_attention: the fused kernel against a float64 composition and
PyTorch's SDPA, gradcheck of every differentiable input, mechanisms (transforms + ALiBi), grouped
queries, torch.compile, and named errors."""

import math

import pytest
import torch

import relpos
from bench_runs import bench_rows


def composed(q, k, v, qpos=None, kpos=None, causal=True, window=0.0, key_len=None, lag_table=None,
             slopes=None, cq=None, ck=None):
    """Materialised scores in float64, straight from the definition."""
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1)
    qp = torch.arange(Tk - Tq, Tk, dtype=torch.float64) if qpos is None else qpos.double()
    kp = torch.arange(Tk, dtype=torch.float64) if kpos is None else kpos.double()
    lag = qp[..., :, None] - kp[..., None, :]
    if lag.dim() == 2:
        lag = lag[None]
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)
    if lag_table is not None:
        idx = torch.floor(lag + 0.5).clamp(0, lag_table.shape[1] - 1).long()
        s = s + lag_table.double()[:, idx].transpose(0, 1)
    if slopes is not None:
        s = s - slopes.double()[None, :, None, None] * lag[:, None]
    if cq is not None:
        s = s + cq.double()[..., :, None] - ck.double()[..., None, :]
    vis = torch.ones(B, 1, Tq, Tk, dtype=torch.bool)
    if causal:
        vis = vis & (lag >= 0)[:, None]
    if window > 0:
        vis = vis & (lag < window)[:, None]
    if key_len is not None:
        vis = vis & (torch.arange(Tk)[None, :] < key_len[:, None])[:, None, None, :]
    vis = vis.expand(B, Hq, Tq, Tk)
    anyv = vis.any(-1, keepdim=True)
    s = torch.where(anyv, s.masked_fill(~vis, -math.inf), torch.zeros_like(s))
    return (torch.softmax(s, -1) * anyv) @ v.double()


def inputs(B, Hq, Hk, Tq, Tk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Tq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hk, Tk, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hk, Tk, D, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "B,Hq,Hk,Tq,Tk,D,window,padded",
    [(1, 2, 2, 1, 1, 32, 0, False), (2, 4, 2, 37, 37, 64, 0, False), (1, 2, 1, 3, 70, 32, 0, False),
     (2, 2, 2, 50, 50, 32, 9.0, True)],
)
def test_fused_matches_float64_composition(B, Hq, Hk, Tq, Tk, D, window, padded):
    q, k, v = inputs(B, Hq, Hk, Tq, Tk, D)
    lag = 0.3 * torch.randn(Hq, 20)
    slopes = 0.1 * torch.rand(Hq)
    c = torch.cumsum(-torch.rand(B, Hq, Tk, dtype=torch.float64), -1)
    cq, ck = c[..., Tk - Tq:].clone(), c
    key_len = torch.randint(0, Tk + 1, (B,)) if padded else None
    out, lse = relpos.fused_attention(q, k, v, window=window, key_len=key_len, lag_table=lag,
                                      slopes=slopes, cq=cq, ck=ck)
    ref = composed(q, k, v, window=window, key_len=key_len, lag_table=lag, slopes=slopes, cq=cq, ck=ck)
    assert lse.shape == (B, Hq, Tq)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def cache_storage(lead, rows, used, tail=(), dtype=torch.float32, scale=1.0):
    """A decode cache's storage [*lead, rows, *tail]: random in the first `used` rows, NaN past
    them (a kernel that reads past the used prefix gives NaN)."""
    s = torch.full(tuple(lead) + (rows,) + tuple(tail), float("nan"), dtype=dtype)
    s[:, :, :used] = scale * torch.randn(tuple(lead) + (used,) + tuple(tail), dtype=dtype)
    return s


@pytest.mark.parametrize("B,Hq,Hk,Tq,Tk,rows", [(1, 8, 8, 1, 300, 512), (2, 4, 2, 3, 70, 71),
                                                 (3, 2, 1, 1, 129, 200), (1, 4, 1, 5, 64, 64)])
def test_keys_read_in_place_from_a_cache_prefix(B, Hq, Hk, Tq, Tk, rows):
    """k and v as the used prefix of a decode cache's storage (a [B, Hk, Tk, D] view of
    [B, Hk, rows, D]) give what contiguous copies give, forward and backward; the storage past
    Tk (NaN here) is never read."""
    D = 32
    q, _, _ = inputs(B, Hq, Hk, Tq, Tk, D, seed=3)
    store_k, store_v = (cache_storage((B, Hk), rows, Tk, (D,)) for _ in range(2))
    k, v = store_k[:, :, :Tk], store_v[:, :, :Tk]
    lag = 0.3 * torch.randn(Hq, 20)
    want, want_lse = relpos.fused_attention(q, k.contiguous(), v.contiguous(), lag_table=lag)
    got, got_lse = relpos.fused_attention(q, k, v, lag_table=lag)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got_lse, want_lse, atol=0, rtol=0)
    ref = composed(q, k.contiguous(), v.contiguous(), lag_table=lag)
    torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=1e-5)
    # through autograd the same views give the contiguous gradients
    kk, vv = store_k.clone().requires_grad_(), store_v.clone().requires_grad_()
    out, _ = relpos.fused_attention(q, kk[:, :, :Tk], vv[:, :, :Tk], lag_table=lag)
    out.sum().backward()
    kc, vc = k.contiguous().requires_grad_(), v.contiguous().requires_grad_()
    relpos.fused_attention(q, kc, vc, lag_table=lag)[0].sum().backward()
    torch.testing.assert_close(kk.grad[:, :, :Tk], kc.grad)
    torch.testing.assert_close(vv.grad[:, :, :Tk], vc.grad)
    assert not kk.grad[:, :, Tk:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("B,Hq,Hk,T,D", [(2, 4, 2, 70, 32), (1, 2, 2, 130, 64), (3, 1, 1, 9, 8)])
def test_layer_layout_read_and_written_in_place(B, Hq, Hk, T, D, dtype):
    """v and the output's gradient as a layer hands them over (token-major views of one
    projection, [B, T, H, D] memory) give the contiguous call's output and gradients bit for bit;
    the output is stored token-major as SDPA's (its transpose back to [B, T, H D] a view), and
    under the meta device (torch.compile) with the same strides."""
    g = torch.Generator().manual_seed(11)
    proj = torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g).to(dtype)
    q = proj[..., :Hq * D].view(B, T, Hq, D).transpose(1, 2).contiguous()
    k = proj[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D).transpose(1, 2).contiguous()
    v = proj[..., (Hq + Hk) * D:].view(B, T, Hk, D).transpose(1, 2)  # strided rows
    w = torch.randn(B, T, Hq * D, generator=g).to(dtype)
    lag = 0.3 * torch.randn(Hq, 16, generator=g)
    lag = lag.to(dtype) if dtype == torch.float64 else lag

    def run(strided):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, proj)]
        p = leaves[2]
        v_in = p[..., (Hq + Hk) * D:].view(B, T, Hk, D).transpose(1, 2)  # a view of the leaf
        out, _ = relpos.fused_attention(leaves[0], leaves[1], v_in if strided else v_in.contiguous(),
                                        lag_table=lag)
        y = out if strided else out.contiguous()
        # the output's gradient arrives token-major (strided) unless the output was copied
        (y.transpose(1, 2).reshape(B, T, Hq * D).float() * w.float()).sum().backward()
        return out, [leaves[0].grad, leaves[1].grad, p.grad]

    out, grads = run(strided=True)
    want, want_grads = run(strided=False)
    assert not v.is_contiguous() and out.stride() == (T * Hq * D, D, Hq * D, 1)
    assert out.transpose(1, 2).reshape(B, T, Hq * D).data_ptr() == out.data_ptr()  # a view
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
    def to_meta(t):  # with its strides, as torch.compile's fake tensors keep them
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    meta, _ = relpos.fused_attention(to_meta(q), to_meta(k), to_meta(v), lag_table=to_meta(lag))
    assert meta.stride() == out.stride()
    # dv beside a strided v: token-major (the meta kernel's too)
    lse = torch.zeros(B, Hq, T, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    dv = torch.ops.relpos.fused_attention_backward(
        out, q, k, v, out, lse, [lag] + [None] * 8, None, None, True, 0.0, None, 0.0, False, 1.0,
        None, None, None, [False, False, True] + [False] * 9, None)[2]
    dv_meta = torch.ops.relpos.fused_attention_backward(
        *(to_meta(t) for t in (out, q, k, v, out, lse)), [to_meta(lag)] + [None] * 8, None,
        None, True, 0.0, None, 0.0, False, 1.0, None, None, None, [False, False, True] + [False] * 9,
        None)[2]
    assert dv.stride() == dv_meta.stride() == (T * Hk * D, D, Hk * D, 1)


@pytest.mark.parametrize("B,Hq,Hk,Tq,Tk,rows", [(1, 8, 8, 1, 300, 512), (2, 4, 2, 3, 70, 71),
                                                 (3, 2, 1, 1, 129, 200)])
def test_key_side_biases_read_in_place_from_a_cache_prefix(B, Hq, Hk, Tq, Tk, rows):
    """ck, gk and path_k as the used prefix of a decode cache's storage ([B, Hq, Tk(, P)] views of
    [B, Hq, rows(, P)], as DecodeCache.content() gives them) give what contiguous copies give,
    bit for bit, alone and together with the keys in place; the storage past Tk (NaN) is never
    read; a view of another layout is copied."""
    D, P = 32, 4
    q, _, _ = inputs(B, Hq, Hk, Tq, Tk, D, seed=5)
    store_k, store_v = (cache_storage((B, Hk), rows, Tk, (D,)) for _ in range(2))
    k, v = store_k[:, :, :Tk], store_v[:, :, :Tk]

    def stored(shape, dtype=torch.float32, scale=1.0):
        return cache_storage((B, Hq), rows, Tk, shape, dtype, scale)[:, :, :Tk]

    c = torch.cumsum(-torch.rand(B, Hq, Tk, dtype=torch.float64), -1)
    fox = dict(cq=c[..., Tk - Tq:].clone(), ck=stored((), torch.float64))
    grape_a = dict(gq=0.03 * torch.rand(B, Hq, Tq), gk=stored((), scale=0.03))
    path = dict(path_q=torch.randn(B, Hq, Tq, P), path_k=stored((P,)),
                path_beta=0.5 * torch.rand(Hq), path_scale=1.0 / P)
    for biases in (fox, grape_a, path, {**grape_a, **path}):
        contiguous = {n: t.contiguous() if torch.is_tensor(t) else t for n, t in biases.items()}
        want, want_lse = relpos.fused_attention(q, k.contiguous(), v.contiguous(), **contiguous)
        assert torch.isfinite(want).all()
        for kk, vv in ((k, v), (k.contiguous(), v.contiguous())):
            got, got_lse = relpos.fused_attention(q, kk, vv, **biases)
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            torch.testing.assert_close(got_lse, want_lse, atol=0, rtol=0)
        # a transposed (non-prefix) view is read through a copy, as before
        if "path_k" in biases:
            odd = dict(biases, path_k=biases["path_k"].transpose(0, 1).contiguous().transpose(0, 1))
            got, _ = relpos.fused_attention(q, k, v, **odd)
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_gradcheck_every_input():
    """Finite differences in float64 on the kernel itself: q, k, v, lag table, slopes, cq, ck."""
    q, k, v = inputs(1, 2, 1, 6, 9, 32, torch.float64, seed=3)
    lag = 0.3 * torch.randn(2, 5, dtype=torch.float64)
    slopes = 0.2 * torch.rand(2, dtype=torch.float64)
    cq, ck = torch.randn(1, 2, 6, dtype=torch.float64), torch.randn(1, 2, 9, dtype=torch.float64)
    kpos = torch.tensor([0, 1, 2.5, 3, 4, 6, 7, 8.25, 9], dtype=torch.float64)
    qpos = kpos[3:] + 0.5
    leaves = [t.requires_grad_() for t in (q, k, v, lag, slopes, cq, ck)]

    def f(q, k, v, lag, slopes, cq, ck):
        return relpos.fused_attention(q, k, v, q_positions=qpos, k_positions=kpos, window=5.0,
                                      lag_table=lag, slopes=slopes, cq=cq, ck=ck)[0]

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", ["rope", "alibi", "rope + alibi", "jordan(m=2, regime=raw)"])
def test_mechanism_attention_matches_sdpa(spec):
    """relpos.attention(q, k, v, spec) == the module's transforms then PyTorch's SDPA (with the
    ALiBi bias materialised as a float mask), in float64."""
    q, k, v = inputs(2, 4, 4, 33, 33, 32, torch.float64)
    enc = relpos.PositionEncoding(spec, 32, 4).double()
    tq, tk = enc(q, k)
    T = 33
    lag = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).double()
    mask = torch.zeros(4, T, T, dtype=torch.float64).masked_fill(lag < 0, -math.inf)
    slopes = [b for b in relpos.mechanism(spec, 32, 4)["biases"] if b["name"] == "alibi"]
    if slopes:
        mask = mask - torch.tensor(slopes[0]["slopes"], dtype=torch.float64)[:, None, None] * lag.clamp_min(0)
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, v, attn_mask=mask)
    out = relpos.attention(q, k, v, enc)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(relpos.attention(q, k, v, spec), ref, atol=1e-12, rtol=1e-10)


def test_mechanism_parameters_get_gradients_and_gqa_decode_rows_agree():
    enc = relpos.PositionEncoding("jordan(m=2, regime=scaled, c=1, eta0=0.05) + alibi", 32, 2)
    q, k, v = inputs(1, 4, 2, 20, 20, 32, seed=5)
    out = relpos.attention(q, k, v, enc)
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in enc.parameters())
    # the last 3 queries alone (decode convention: queries are the last Tq key positions)
    last = relpos.attention(q[:, :, -3:], k, v, enc)
    torch.testing.assert_close(last, out[:, :, -3:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    enc = relpos.PositionEncoding("rope + alibi", 32, 2)
    lag = torch.zeros(2, 64, requires_grad=True)

    def f(q, k, v):
        return relpos.attention(q, k, v, enc, lag_table=lag, check_finite=False)

    q, k, v = (t.requires_grad_() for t in inputs(1, 2, 2, 40, 40, 32, seed=6))
    eager = f(q, k, v)
    eager.sum().backward()
    g_eager = [t.grad.clone() for t in (q, k, v, lag)]
    for t in (q, k, v, lag):
        t.grad = None
    out = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    out.sum().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for a, t in zip(g_eager, (q, k, v, lag)):
        torch.testing.assert_close(t.grad, a, atol=1e-5, rtol=1e-5)


def test_named_errors():
    q, k, v = inputs(1, 4, 3, 8, 8, 32)
    with pytest.raises(relpos.InputError, match="must divide query heads"):
        relpos.fused_attention(q, k, v)
    q, k, v = inputs(1, 2, 2, 8, 8, 32)
    with pytest.raises(relpos.InputError, match=r"lag_table must be \[2, L\]"):
        relpos.fused_attention(q, k, v, lag_table=torch.zeros(3, 4))
    with pytest.raises(relpos.InputError, match="k_positions contain NaN"):
        relpos.fused_attention(q, k, v, k_positions=torch.full((8,), math.nan, dtype=torch.float64))
    with pytest.raises(relpos.InputError, match="encoding has 4 heads"):
        relpos.attention(q, k, v, relpos.PositionEncoding("rope", 32, 4))
    with pytest.raises(relpos.InputError, match="v contains NaN"):
        relpos.attention(q, k, v * math.nan, "rope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_in_query_or_key_gives_nan_rows_not_zeros(dtype):
    """Issue 23 item 5: NaN in one element of q makes that row (and its lse) NaN, NaN in a key the
    rows that see it; float32 used to give row 0 and lse -inf."""
    x = torch.randn(1, 1, 6, 4, dtype=dtype, generator=torch.Generator().manual_seed(0))
    q = x.clone()
    q[0, 0, 3, 0] = math.nan
    out, lse = relpos.fused_attention(q, x, x)
    assert torch.isnan(lse[0, 0]).tolist() == [i == 3 for i in range(6)]
    assert torch.isnan(out[0, 0]).any(-1).tolist() == [i == 3 for i in range(6)]
    k = x.clone()
    k[0, 0, 2, 1] = math.nan
    out, lse = relpos.fused_attention(x, k, x)
    assert torch.isnan(lse[0, 0]).tolist() == [i >= 2 for i in range(6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_nan_changes_nothing_forward_and_backward(dtype):
    """Issue 23 item 6: a NaN or Inf value the mask hides (causal, window, key padding; T = 300
    spans several tiles) changes no bit of the rows that cannot see it, nor of dq, dk, dv."""
    T, D = 300, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, T, D, dtype=dtype, generator=g) for _ in range(3))
    key_len = torch.tensor([T - 5])
    for bad, where, kw in ((math.nan, (T - 1,), {}), (math.inf, (T - 1,), {}),
                           (math.nan, (0,), {"window": 7.0}),
                           (math.nan, (T - 2,), {"key_len": key_len})):
        vb = v.clone()
        vb[0, 1, where[0], 3] = bad
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        leaves_b = [t.clone().requires_grad_() for t in (q, k, vb)]
        o1, _ = relpos.fused_attention(*leaves, **kw)
        o2, _ = relpos.fused_attention(*leaves_b, **kw)
        o1.sum().backward()
        o2.sum().backward()
        j = where[0]
        row = torch.arange(T)
        sees = row >= j
        if "window" in kw:
            sees = sees & (row - j < kw["window"])
        if "key_len" in kw:
            sees = sees & (j < kw["key_len"][0])
        assert torch.equal(o1[0, 0], o2[0, 0])  # the other head
        assert torch.equal(o1[0, 1, ~sees], o2[0, 1, ~sees])
        assert not torch.isfinite(o2[0, 1, sees]).all(-1).any()
        assert torch.equal(leaves[0].grad[0, 1, ~sees], leaves_b[0].grad[0, 1, ~sees])
        assert torch.equal(leaves[0].grad[0, 0], leaves_b[0].grad[0, 0])


def test_lse_is_differentiable():
    """Issue 23 item 14: a loss on lse reaches q, k, v and the biases; gradients against float64
    autograd of the materialised scores, and gradcheck."""
    q, k, v = inputs(2, 2, 1, 7, 9, 16, torch.float64, seed=4)
    slopes = 0.2 * torch.rand(2, dtype=torch.float64)
    key_len = torch.tensor([9, 5])

    def reference(q, k, v, slopes):
        B, Hq, Tq, D = q.shape
        Tk = k.shape[2]
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        lag = (torch.arange(Tk - Tq, Tk)[:, None] - torch.arange(Tk)[None, :]).double()
        s = q @ kk.transpose(-1, -2) / math.sqrt(D) - slopes[None, :, None, None] * lag
        vis = (lag >= 0)[None, None] & (torch.arange(Tk)[None, :] < key_len[:, None])[:, None, None]
        s = s.masked_fill(~vis, -math.inf)
        return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes)]
    out, lse = relpos.fused_attention(*leaves[:3], slopes=leaves[3], key_len=key_len)
    (out.sum() + (lse**2).sum()).backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes)]
    ro, rl = reference(*ref_leaves)
    torch.testing.assert_close(lse, rl)
    (ro.sum() + (rl**2).sum()).backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-8)

    def f(q, k, v, slopes):
        o, l = relpos.fused_attention(q, k, v, slopes=slopes, key_len=key_len, window=4.0)
        return o, torch.where(torch.isfinite(l), l, 0.0)  # rows that see no key: lse = -inf

    assert torch.autograd.gradcheck(f, [t.clone().requires_grad_() for t in (q, k, v, slopes)],
                                    eps=1e-6, atol=1e-7)
    # float32: the lse term changes the gradient (it used to be dropped)
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    o, l = relpos.fused_attention(q32, k32, v32)
    (o.sum() + (l**2).sum()).backward()
    g_both = q32.grad.clone()
    q32.grad = None
    relpos.fused_attention(q32, k32, v32)[0].sum().backward()
    assert (g_both - q32.grad).abs().max() > 1e-3


def test_every_mechanism_is_applied_or_refused():
    """Issue 23 item 11: for every catalogued mechanism, attention(q, k, v, spec) either differs
    from plain attention ("nope") or raises InputError; none silently computes plain attention
    (fox, grape_a, grape_ap and pj_bias used to)."""
    D, H = 32, 2
    q, k, v = inputs(1, H, H, 12, 12, D, torch.float64, seed=9)
    plain = relpos.attention(q, k, v, "nope")
    refused = []
    for info in relpos.mechanisms():
        name = info["name"]
        try:
            out = relpos.attention(q, k, v, name)
        except relpos.InputError as e:
            refused.append(name)
            assert name in str(e) or "'" in str(e)
            continue
        if not relpos.mechanism(name, D, H)["biases"]:
            continue  # transforms only (an orthogonal mix legitimately scores as plain attention)
        # a bias must change the result of the transforms alone
        try:
            tq, tk = relpos.PositionEncoding(name, D, H).double()(q, k)
            bare = composed(tq, tk, v)
        except relpos.InputError:
            bare = plain
        assert not torch.allclose(out, bare, atol=1e-9), f"{name}: its bias is dropped"
        # the C++ nn::attention (the relpos::attention op) applies the same biases
        try:
            cpp = torch.ops.relpos.attention(q, k, v, name)
        except ValueError:
            continue
        assert not torch.allclose(cpp, bare, atol=1e-9), f"{name}: the C++ path drops its bias"
    for name in ("fox", "grape_a", "grape_ap"):
        assert name in refused, name
        with pytest.raises(ValueError, match="content-gated bias"):
            torch.ops.relpos.attention(q, k, v, name)
    # the refusal names the missing inputs; given the gates, a per-token bias is applied
    with pytest.raises(relpos.InputError, match="cq and ck"):
        relpos.attention(q, k, v, "fox")
    with pytest.raises(relpos.InputError, match="path_q, path_k and path_beta"):
        relpos.attention(q, k, v, "grape_ap")
    c = torch.cumsum(-torch.rand(1, H, 12, dtype=torch.float64), -1)
    gated = relpos.attention(q, k, v, "fox", cq=c, ck=c)
    torch.testing.assert_close(gated, composed(q, k, v, cq=c, ck=c))
    # pj_bias from its spec: the initial learned table, as the C++ nn::attention; from a
    # PositionEncoding: the module's own table (enc.lag_table), applied, not refused
    pj = relpos.attention(q, k, v, "pj_bias")
    assert not torch.allclose(pj, plain)
    torch.testing.assert_close(pj, torch.ops.relpos.attention(q, k, v, "pj_bias"))
    enc = relpos.PositionEncoding("pj_bias", D, H).double()
    out = relpos.attention(q, k, v, enc)
    assert not torch.allclose(out, plain)
    torch.testing.assert_close(out, composed(q, k, v, lag_table=enc.lag_table(12).detach()))


def test_attention_input_errors_are_input_errors():
    """Issue 23 item 17 (attention.py): a 3-D q, meta tensors with check_finite, non-tensors."""
    q, k, v = inputs(1, 2, 2, 8, 8, 32)
    with pytest.raises(relpos.InputError, match=r"\[B, H, T, D\]"):
        relpos.attention(q[0], k, v, "rope")
    with pytest.raises(relpos.InputError):
        relpos.fused_attention(q[0], k, v)
    with pytest.raises(relpos.InputError, match="must be a tensor"):
        relpos.fused_attention([1.0], k, v)
    with pytest.raises(relpos.InputError, match="mechanism must be"):
        relpos.attention(q, k, v, 3)
    m = [t.to("meta") for t in (q, k, v)]
    out = relpos.attention(*m, "rope")  # no values to check: shapes only
    assert out.device.type == "meta" and out.shape == q.shape


def test_attention_prefetch_setting_is_checked(monkeypatch):
    """RELPOS_ATTENTION_PREFETCH (read at each kernel call) takes 0 or 1: both give the same
    output bits, forward and gradients; another value is an InputError that names it."""
    q, k, v = (torch.randn(1, 2, 200, 16, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    results = []
    for setting in ("0", "1"):
        monkeypatch.setenv("RELPOS_ATTENTION_PREFETCH", setting)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = relpos.attention(qq, kk, vv, None)
        out.square().sum().backward()
        results.append((out.detach(), qq.grad, kk.grad, vv.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    monkeypatch.setenv("RELPOS_ATTENTION_PREFETCH", "yes")
    with pytest.raises(relpos.InputError, match="RELPOS_ATTENTION_PREFETCH must be 0 or 1"):
        relpos.attention(q, k, v, None)


def test_attention_layout_benchmark_runs():
    """bench/bench_attention_layout.py at a toy size: it checks relpos against SDPA, then prints
    one row per layout, what the model layout adds to each and the strides each op hands back (the
    relpos output token-major); a bad shape is the parser's error."""
    rows = bench_rows("bench_attention_layout.py",
                      ["--shape", "1,2,40,8", "--rounds", "1", "--threads", "1"],
                      r"\| (separate|model) \||- (relpos|sdpa): ", ["--shape", "1,2,40"],
                      "--shape")
    assert len(rows) == 6, rows
    assert rows[4].startswith("- relpos: output strides (640, 8, 16, 1)"), rows[4]


def test_attention_prefetch_benchmark_runs():
    """bench/bench_attention_prefetch.py at a toy size: it checks both settings give the same
    bits, then prints one row per (T, mode); a bad option is the parser's error."""
    rows = bench_rows("bench_attention_prefetch.py",
                      ["--T", "64,130", "--heads", "2", "--rounds", "1", "--threads", "1"],
                      r"\| \d+ \| fwd(bwd)? \|", ["--modes", "bwd"], "--modes")
    assert len(rows) == 4, rows
