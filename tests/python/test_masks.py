"""Masks besides causality over the whole catalog, with no per-mechanism code: packed sequences
(segments) equal separate calls and left padding (key_start) equals the unpadded call, forward and
every gradient, also for phases scanned from the layer's inputs (each document's and each row's
scan starts at its first valid token); the refusals are decided from the mechanism JSON."""

import pytest
import torch

import relpos
from module_checks import CATALOG_SPECS, catalog_shapes, vector_dims

# and the rotations whose phases are scanned from the inputs (not a catalog default)
SPECS = CATALOG_SPECS + ["grape_m(context=true)", "journey(angles=token)"]
H, M = 2, 12  # heads (query = key/value: every mechanism runs), model_dim of the inputs
DOCS = (5, 7, 4)  # packed document lengths

pytestmark = pytest.mark.usefixtures("one_thread")


DIMS, INFO = catalog_shapes(SPECS, H)


def module(spec):
    torch.manual_seed(5)
    a = relpos.Attention(spec, DIMS[spec], H, H, model_dim=M).double()
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return a


def data(spec, T, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, DIMS[spec], generator=g, dtype=torch.float64)
               for _ in range(3))
    x = torch.randn(B, T, M, generator=g, dtype=torch.float64)
    return q, k, v, x


def positions(spec, lengths, g):
    """Per document: 0..n-1, or random grid cells for vector positions; concatenated."""
    dc = vector_dims(INFO[spec])
    parts = [torch.arange(n, dtype=torch.float64) if dc is None
             else torch.randint(0, 6, (n, dc), generator=g).to(torch.float64) for n in lengths]
    return parts


def grads(out, w, tensors, attn):
    params = list(attn.parameters())
    gs = torch.autograd.grad((out * w).sum(), tensors + params, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(t) if x is None else x for x, t in zip(gs, tensors + params)]


@pytest.mark.parametrize("spec", SPECS)
def test_packed_documents_equal_separate_calls(spec):
    attn = module(spec)
    T = sum(DOCS)
    q, k, v, x = data(spec, T)
    seg = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(DOCS)])[None]
    pos = positions(spec, DOCS, torch.Generator().manual_seed(1))
    leaves = [t.requires_grad_() for t in (q, k, v, x)]
    packed = attn(q, k, v, positions=torch.cat(pos), inputs=x, segments=seg)
    w = torch.randn_like(packed)
    g_packed = grads(packed, w, leaves, attn)
    outs, g_sep, t0 = [], None, 0
    for n, p in zip(DOCS, pos):
        s = slice(t0, t0 + n)
        o = attn(q[:, :, s], k[:, :, s], v[:, :, s], positions=p, inputs=x[:, s])
        outs.append(o)
        t0 += n
    sep = torch.cat(outs, 2)
    g_sep = grads(sep, w, leaves, attn)
    torch.testing.assert_close(packed, sep, rtol=0, atol=1e-10)
    for a, b in zip(g_packed, g_sep):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("spec", SPECS)
def test_left_padding_equals_the_unpadded_call(spec):
    """Row b padded with pad[b] tokens on the left: its valid outputs and their gradients are the
    unpadded row's (positions start at 0 at the first valid token)."""
    attn = module(spec)
    T, pads = 9, torch.tensor([3, 0])
    q, k, v, x = data(spec, T, B=2, seed=2)
    dc = vector_dims(INFO[spec])
    pos = (torch.arange(T, dtype=torch.float64)[None] - pads[:, None]).to(torch.float64)
    if dc is not None:
        pos = torch.randint(0, 6, (2, T, dc), generator=torch.Generator().manual_seed(3)).double()
    leaves = [t.requires_grad_() for t in (q, k, v, x)]
    out = attn(q, k, v, positions=pos, inputs=x, key_start=pads)
    for b in range(2):
        p = int(pads[b])
        s = slice(p, T)
        w = torch.randn_like(out[b:b + 1, :, s])
        ref = attn(q[b:b + 1, :, s], k[b:b + 1, :, s], v[b:b + 1, :, s], positions=pos[b:b + 1, s],
                   inputs=x[b:b + 1, s])
        torch.testing.assert_close(out[b:b + 1, :, s], ref, rtol=0, atol=1e-10)
        for a, c in zip(grads(out[b:b + 1, :, s], w, leaves, attn), grads(ref, w, leaves, attn)):
            torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-10)


def test_fused_attention_masks_against_a_materialised_reference():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hk, T, D = 2, 4, 2, 70, 16
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    seg = torch.tensor([[0] * 30 + [1] * 25 + [2] * 15, [4] * 70])
    start, slopes = torch.tensor([0, 11]), torch.rand(Hq, generator=g, dtype=torch.float64)
    out, _ = relpos.fused_attention(q, k, v, key_start=start, q_segments=seg, k_segments=seg,
                                    slopes=slopes)
    j = torch.arange(T)
    vis = ((j[None, :, None] >= j[None, None, :]) & (j[None, None, :] >= start[:, None, None])
           & (seg[:, :, None] == seg[:, None, :]))[:, None]
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    lag = (j[:, None] - j[None, :]).double()
    s = q @ kk.transpose(-1, -2) / D ** 0.5 - slopes[None, :, None, None] * lag
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num()
    ref = p @ vv
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                    torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_bad_masks_raise_input_errors():
    q = k = v = torch.randn(1, 2, 6, 8)
    seg = torch.tensor([[0, 0, 1, 1, 0, 0]])
    with pytest.raises(relpos.InputError, match="two runs"):
        relpos.fused_attention(q, k, v, q_segments=seg, k_segments=seg)
    with pytest.raises(relpos.InputError, match="both"):
        relpos.fused_attention(q, k, v, q_segments=seg)
    with pytest.raises(relpos.InputError, match="key_start"):
        relpos.fused_attention(q, k, v, key_start=torch.tensor([0.5]))
    with pytest.raises(relpos.InputError, match="k_segments"):
        relpos.fused_attention(q, k, v, q_segments=seg, k_segments=seg[:, :5])
    attn = relpos.Attention("rope", 8, 2)
    cache = relpos.KVCache(1, 2, 8)
    with pytest.raises(relpos.InputError, match="cache"):
        attn(q, k, v, segments=torch.zeros(1, 6, dtype=torch.int64), cache=cache)


def test_nonfinite_values_the_masks_hide_change_nothing():
    """NaN and Inf in the left padding and in another document reach no output or gradient."""
    g = torch.Generator().manual_seed(4)
    B, H, T, D = 2, 2, 100, 16
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    seg = torch.tensor([[0] * 70 + [1] * 30, [3] * 100])
    start = torch.tensor([0, 37])
    bad_k, bad_v = k.clone(), v.clone()
    for t in (bad_k, bad_v):
        t[0, :, 5] = float("nan")    # document 0 of row 0: hidden from document 1
        t[1, :, 20] = float("inf")   # left padding of row 1
    kw = dict(key_start=start, q_segments=seg, k_segments=seg, slopes=torch.full((H,), 0.1,
                                                                                   dtype=torch.float64))
    seen = [(0, slice(70, T)), (1, slice(37, T))]  # the rows that see none of them

    def run(kk, vv):
        leaves = [x.clone().requires_grad_() for x in (q, kk, vv)]
        out, _ = relpos.fused_attention(*leaves, **kw)
        w = torch.ones_like(out)
        grads = torch.autograd.grad((out[0, :, 70:] * w[0, :, 70:]).sum()
                                    + (out[1, :, 37:] * w[1, :, 37:]).sum(), leaves)
        return out, grads

    clean, gclean = run(k, v)
    dirty, gdirty = run(bad_k, bad_v)
    for b, rows in seen:
        torch.testing.assert_close(dirty[b, :, rows], clean[b, :, rows], rtol=0, atol=0)
    torch.testing.assert_close(gdirty[0][0, :, 70:], gclean[0][0, :, 70:], rtol=0, atol=0)
    torch.testing.assert_close(gdirty[0][1, :, 37:], gclean[0][1, :, 37:], rtol=0, atol=0)


@pytest.mark.parametrize("spec", ["grape_m(context=true)", "journey(angles=token)"])
def test_nonfinite_hidden_states_the_masks_hide_change_nothing(spec):
    """Phases scanned from the hidden states: a NaN or Inf in a padding token's hidden state, or
    in another packed document's, reaches no output of the rows and documents that do not see it
    (each run is scanned on its own, not as a difference of one scan)."""
    attn = module(spec)
    T = sum(DOCS)
    q, k, v, x = data(spec, T, B=2, seed=5)
    seg = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(DOCS)])
    pos = torch.cat([torch.arange(n, dtype=torch.float64) for n in DOCS])
    bad = x.clone()
    bad[:, 2] = float("nan")  # document 0 (row 0), padding (row 1: key_start 4)
    bad[:, 3, 0] = float("inf")
    packed = [attn(q[:1], k[:1], v[:1], positions=pos, inputs=h[:1], segments=seg[None])
              for h in (x, bad)]
    torch.testing.assert_close(packed[1][:, :, DOCS[0]:], packed[0][:, :, DOCS[0]:], rtol=0, atol=0)
    assert not torch.isfinite(packed[1][:, :, 2:DOCS[0]]).all()  # the document that sees it
    start = torch.tensor([0, 4])
    padded = [attn(q, k, v, inputs=h, key_start=start) for h in (x, bad)]
    torch.testing.assert_close(padded[1][1, :, 4:], padded[0][1, :, 4:], rtol=0, atol=0)
