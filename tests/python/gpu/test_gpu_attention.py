"""The GPU backend's fused attention (python/relpos/gpu/attention.py) against the CPU operators:
``fused_attention`` (out and lse) and ``fused_attention_backward`` (dq, dk, dv and every bias
gradient, with a gradient on lse too) for no bias, each bias slot alone and together, every mask,
grouped-query heads, positions shared and per batch, decode shapes (split keys, keys read in
place from a cache prefix), and for every mechanism of the catalogue that ``relpos.Attention``
runs, on exactly the arguments its forward passes to the kernel (prefill and a cached decode
step). Tolerances relative to the largest reference value: float32 1e-5, float64 1e-10,
bfloat16 / float16 storage 2e-2 (both sides round the inputs alike, but the GPU kernels feed half
operands to the tile products, where the CPU kernel computes in float32). Under Triton's
interpreter without a GPU; on the registered CUDA kernels (and through autograd) with one."""

import math

import pytest
import torch
from gpu_testing import CUDA, DEVICE, catalog_specs, cpu_call, gpu_call

import relpos
import relpos.engine as engine
from relpos.gpu import attention as ga

SLOTS = ga.SLOTS
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _err(got, want):
    """(max |got - want| over want's finite entries, max |want| there) after checking shape,
    dtype and the non-finite entries (lse = -inf of rows without a visible key)."""
    got, want = got.detach().cpu().double(), want.detach().double()
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert torch.equal(got[~fin], want[~fin])
    if not fin.any():
        return 0.0, 0.0
    return float((got - want)[fin].abs().max()), float(want[fin].abs().max())


def close(got, want, tol, what="", exact=None):
    """got (any device) equals want within tol x max(1, max |want|), with want's shape, dtype
    and non-finite entries. Given exact (the float64 result), a larger difference passes when got
    is within twice want's distance of exact (the CPU kernel's own float32 rounding)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    err, ref = _err(got, want)
    if err <= tol * max(1.0, ref):
        return
    assert exact is not None, f"{what}: error {err:.3g} vs max {ref:.3g}"
    mine, _ = _err(got, exact)
    theirs, ref = _err(want, exact)
    assert mine <= max(2 * theirs, tol * max(1.0, ref)), \
        f"{what}: error {err:.3g} vs the CPU op; {mine:.3g} vs float64, the CPU op's {theirs:.3g}"


def _wide(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    if isinstance(x, list):
        return [_wide(t) for t in x]
    return x


def qkv(B, Hq, Hk, Tq, Tk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Tq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, Tk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hk, Tk, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def op_args(q, k, v, biases=(), q_positions=None, k_positions=None, causal=True, window=0.0,
            key_len=None, scale=0.0, exclude_self=False, path_scale=1.0, key_start=None,
            q_segments=None, k_segments=None):
    """The positional arguments of the fused_attention op."""
    return [q, k, v, list(biases), q_positions, k_positions, causal, float(window), key_len,
            float(scale), exclude_self, float(path_scale), key_start, q_segments, k_segments]


def _has_path(args):
    return len(args[3]) > 6 and args[3][6] is not None


def check(args, tol=None, seed=1, lse_grad=True):
    """Forward and backward of the GPU backend against the CPU op on the same arguments (with a
    gradient on lse too, except with a path integral: the CPU op's path gradients leave that
    term out; test_path_lse_gradient checks it against the float64 definition)."""
    q = args[0]
    tol = TOL[q.dtype] if tol is None else tol
    lse_grad = lse_grad and not _has_path(args)
    out, lse = cpu_call("fused_attention", *args)
    gout, glse = gpu_call("fused_attention", *args)
    close(gout, out, tol, "out")
    close(glse, lse, tol, "lse")
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype) if lse_grad \
        else None
    mask = [True] * 3 + [b is not None for b in list(args[3]) + [None] * (9 - len(args[3]))]
    bargs = [dout, *args[:3], out, lse, *args[3:], mask, dlse]
    want = cpu_call("fused_attention_backward", *bargs)
    got = gpu_call("fused_attention_backward", *bargs)
    exact = [None] * 12
    if q.dtype == torch.float32:  # the float64 gradients (for close's second criterion)
        wide = [_wide(x) for x in args]
        o64, l64 = cpu_call("fused_attention", *wide)
        r = cpu_call("fused_attention_backward", _wide(dout), *wide[:3], o64, l64, *wide[3:],
                     mask, _wide(dlse))
        exact = [t.to(q.dtype) for t in r[:3]] + [t.to(b.dtype) if t.numel() else None
                                                   for t, b in zip(r[3], want[3])]
    for name, a, b, e in zip(("dq", "dk", "dv"), got[:3], want[:3], exact[:3]):
        close(a, b, tol, name, e)
    assert len(got[3]) == len(want[3]) == len(SLOTS)
    for name, a, b, e in zip(SLOTS, got[3], want[3], exact[3:]):
        close(a, b, tol, "d" + name, e)
    return out


# ---- each bias and mask on its own and together -------------------------------------------------

B, HQ, HK, T, D = 2, 4, 2, 70, 16


def _bias(name, Tq=T, Tk=T, Hq=HQ, P=3, dtype=torch.float32, seed=5, B=B):
    """The biases list with the named slots filled (random values of a realistic size)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    b = [None] * len(SLOTS)
    parts = name.split("+")
    if "lag" in parts:
        b[0] = (0.5 * r(Hq, 33)).to(dtype)  # shorter than the lags: the clamp to its last entry
    if "slopes" in parts:
        b[1] = (0.05 * r(Hq).abs()).to(dtype)
    if "token" in parts:  # cumulative log-gates (FoX), float64
        b[2] = (-0.1 * r(B, Hq, Tq).abs()).cumsum(-1)
        b[3] = (-0.1 * r(B, Hq, Tk).abs()).cumsum(-1)
    if "gq" in parts:
        b[4] = (0.02 * r(B, Hq, Tq).abs()).to(dtype)
    if "gk" in parts:
        b[5] = (0.02 * r(B, Hq, Tk).abs()).to(dtype)
    if "path" in parts:
        b[6] = r(B, Hq, Tq, P).to(dtype)
        b[7] = r(B, Hq, Tk, P).to(dtype)
        b[8] = (0.5 * r(Hq).abs()).to(dtype)
    while b and b[-1] is None:
        b.pop()
    return b


BIASES = ["none", "lag", "slopes", "token", "gq", "gk", "gq+gk", "path",
          "lag+slopes+token+gq+gk", "path+gq+gk+lag"]


@pytest.mark.parametrize("bias", BIASES)
def test_each_bias(bias):
    q, k, v = qkv(B, HQ, HK, T, T, D)
    check(op_args(q, k, v, _bias(bias), path_scale=0.7))


def _masks(name, Tq, Tk):
    g = torch.Generator().manual_seed(3)
    if name == "non_causal":
        return dict(causal=False)
    if name == "window":
        return dict(window=9.5)
    if name == "key_len":
        return dict(key_len=torch.tensor([Tk - 23, Tk], dtype=torch.int32))
    if name == "key_start":
        return dict(key_start=torch.tensor([5, 40]))
    if name == "padding_both":
        return dict(key_start=torch.tensor([3, 0]), key_len=torch.tensor([Tk - 2, 30]),
                    causal=False)
    if name == "segments":
        seg_q = torch.tensor([[0] * (Tq // 3) + [1] * (Tq - Tq // 3), [4] * 10 + [2] * (Tq - 10)])
        seg_k = torch.tensor([[0] * (Tk - Tq + Tq // 3) + [1] * (Tq - Tq // 3),
                              [4] * (Tk - Tq + 10) + [2] * (Tq - 10)])
        return dict(q_segments=seg_q, k_segments=seg_k)
    if name == "exclude_self":
        return dict(exclude_self=True)
    if name == "positions":  # real positions, not sorted (no loop bound applies)
        return dict(q_positions=torch.randn(Tq, generator=g, dtype=torch.float64) * 20 + 50,
                    k_positions=torch.randn(Tk, generator=g, dtype=torch.float64) * 20 + 40)
    if name == "positions_per_batch":
        return dict(q_positions=torch.arange(Tk - Tq, Tk, dtype=torch.float64) * 1.5 + 3.25,
                    k_positions=torch.stack([torch.arange(Tk) * 1.5, torch.arange(Tk) + 7.0]),
                    window=40.0)
    if name == "sorted_positions":  # integer positions with a gap: the engine's (explicit) kind
        p = torch.cat([torch.arange(Tk // 2), torch.arange(Tk - Tk // 2) + 100]).double()
        return dict(q_positions=p[Tk - Tq:], k_positions=p, window=30.0)
    raise AssertionError(name)


MASKS = ["non_causal", "window", "key_len", "key_start", "padding_both", "segments",
         "exclude_self", "positions", "positions_per_batch", "sorted_positions"]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("bias", ["none", "lag+slopes+token+gq+gk", "path"])
def test_masks(mask, bias):
    Tq, Tk = 50, 75  # queries the last 50 of 75 key positions
    q, k, v = qkv(B, HQ, HK, Tq, Tk, D, seed=2)
    check(op_args(q, k, v, _bias(bias, Tq, Tk), **_masks(mask, Tq, Tk)))


def test_rows_without_keys():
    """Rows that see no key: zeros, lse = -inf, zero gradients (never NaN)."""
    Tq, Tk = 20, 20
    q, k, v = qkv(2, 2, 2, Tq, Tk, 16)
    out = check(op_args(q, k, v, _bias("lag+token", Tq, Tk, Hq=2), key_start=torch.tensor([8, 0]),
                        key_len=torch.tensor([20, 0])))
    assert float(out[1].abs().max()) == 0


def test_more_queries_than_keys():
    """Tq > Tk: the first queries (slots before the first key) see nothing, path edges included."""
    q, k, v = qkv(1, 2, 2, 45, 30, 16)
    check(op_args(q, k, v, _bias("lag+path", 45, 30, Hq=2, B=1)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bias", ["none", "lag+slopes+gq+gk", "path+token"])
def test_dtypes(dtype, bias):
    q, k, v = qkv(1, 2, 1, 64, 64, 32, dtype=dtype)
    b = _bias(bias, 64, 64, Hq=2, dtype=dtype, B=1)
    check(op_args(q, k, v, b, window=40.0, scale=0.2))


def test_half_with_float32_biases():
    """Half storage takes float32 parameters beside it (as the CPU op)."""
    q, k, v = qkv(1, 2, 2, 40, 40, 16, dtype=torch.bfloat16)
    check(op_args(q, k, v, _bias("lag+slopes+gq+gk+path", 40, 40, Hq=2, B=1)))


@pytest.mark.parametrize("D", [16, 40, 64])
def test_head_dims(D):
    q, k, v = qkv(1, 2, 2, 48, 48, D)
    check(op_args(q, k, v, _bias("slopes", 48, 48, Hq=2, B=1)))


def _path_reference(q, k, v, pq, pk, beta, path_scale, key_start):
    """Causal attention with a GRAPE-AP path integral straight from its definition (float64,
    dense, default positions): bias(i, j) = sum_{l=j+1..slot(i)} beta logsigmoid(s pq_i . pk_l)."""
    B_, H, Tq, D_ = q.shape
    Tk = k.shape[2]
    g = H // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ ke.transpose(-1, -2) / math.sqrt(D_)
    z = path_scale * pq @ pk.transpose(-1, -2)
    slot = torch.arange(Tk - Tq, Tk).view(Tq, 1)
    col = torch.arange(Tk).view(1, Tk)
    e = torch.where((col <= slot) & (col >= 1),
                    beta.view(1, H, 1, 1) * torch.nn.functional.logsigmoid(z), 0.0)
    c = e.cumsum(-1)
    s = s + (c[..., -1:] - c)
    vis = (col <= slot) & (col.view(1, 1, 1, Tk) >= key_start.view(B_, 1, 1, 1))
    s = s.masked_fill(~vis, -math.inf)
    return torch.softmax(s, -1) @ ve, torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_path_lse_gradient(dtype):
    """The path integral's gradients with a loss on out and lse against the float64 definition
    (d e(i, l) = sum_{j<l} dS_ij, whose row sums are dL/dlse_i, not 0)."""
    Tq, Tk = 50, 75
    q, k, v = qkv(B, HQ, HK, Tq, Tk, D, dtype=torch.float64, seed=2)
    b = _bias("path", Tq, Tk, dtype=torch.float64)
    ks = torch.tensor([5, 25])  # every row sees a key (the dense reference has no empty rows)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(B, HQ, Tq, D, generator=g, dtype=torch.float64)
    wl = torch.randn(B, HQ, Tq, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, b[6], b[7], b[8])]
    out, lse = _path_reference(*leaves, 0.7, ks)
    want = torch.autograd.grad((out * w).sum() + (lse * wl).sum(), leaves)
    args = op_args(*(x.to(dtype) for x in (q, k, v)), [None if x is None else x.to(dtype)
                                                       for x in b], path_scale=0.7, key_start=ks)
    o, lg = gpu_call("fused_attention", *args)
    close(o, out.to(dtype), TOL[dtype], "out")
    close(lg.cpu(), lse.to(dtype), TOL[dtype], "lse")
    got = gpu_call("fused_attention_backward", w.to(dtype), *args[:3], o, lg, *args[3:],
                   [True] * 12, wl.to(dtype))
    for name, a, r in zip(("dq", "dk", "dv", "dpath_q", "dpath_k", "dpath_beta"),
                          list(got[:3]) + list(got[3][6:]), want):
        close(a, r.to(dtype), 10 * TOL[dtype], name)
    # the CPU kernel against the same definition (its edge gradients once assumed zero row sums)
    cpu = cpu_call("fused_attention_backward", w.to(dtype), *args[:3], o, lg, *args[3:],
                   [True] * 12, wl.to(dtype))
    for name, a, r in zip(("dq", "dk", "dv", "dpath_q", "dpath_k", "dpath_beta"),
                          list(cpu[:3]) + list(cpu[3][6:]), want):
        close(a, r.to(dtype), 10 * TOL[dtype], "cpu " + name)


# ---- decode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("Tq,Tk", [(1, 300), (3, 100), (4, 257)])
@pytest.mark.parametrize("bias", ["none", "lag+slopes+token+gq+gk", "path"])
def test_decode(Tq, Tk, bias):
    """Few queries against many keys (split across programs, the query group of a key/value head
    in one tile; the path integral walks its keys whole), keys and values read in place from a
    cache's storage prefix with per-row lengths."""
    Bd, Hq, Hk, Dd, cap = 2, 4, 2, 32, Tk + 37
    q, _, _ = qkv(Bd, Hq, Hk, Tq, Tk, Dd, seed=4)
    _, ks, vs = qkv(Bd, Hq, Hk, Tq, cap, Dd, seed=6)
    ks[:, :, Tk:] = float("nan")  # past the used prefix: never read
    k, v = ks[:, :, :Tk], vs[:, :, :Tk]
    assert not k.is_contiguous()
    pos = torch.arange(Tk, dtype=torch.float64).expand(Bd, Tk)
    kl = None if bias == "path" else torch.tensor([Tk - 17, Tk])
    if kl is not None:
        ks[0, :, Tk - 17:Tk] = float("nan")  # past row 0's length
    check(op_args(q, k, v, _bias(bias, Tq, Tk, Hq=Hq), q_positions=pos[:, Tk - Tq:],
                  k_positions=pos, key_len=kl), lse_grad=False)


def test_decode_window_gqa_default_positions():
    q, k, v = qkv(1, 8, 1, 2, 200, 64, seed=8)
    check(op_args(q, k, v, _bias("slopes", 2, 200, Hq=8, B=1), window=50.0))


def test_decode_bf16():
    q, k, v = qkv(2, 4, 2, 1, 150, 32, dtype=torch.bfloat16)
    check(op_args(q, k, v, _bias("lag", 1, 150, Hq=4, dtype=torch.bfloat16, B=2)))


# ---- every mechanism of the catalogue, on the arguments relpos.Attention passes ---------------

MODEL_DIM = 8


def _head_dim(spec, heads):
    for d in range(16, 49, 2):
        try:
            relpos.mechanism(spec, d, heads)
            return d
        except relpos.InputError:
            pass
    return None


def _module(spec, hq, hk):
    """relpos.Attention for spec with hq query and hk key/value heads, or None when it refuses
    (e.g. a learned lag table per head with grouped queries)."""
    d = _head_dim(spec, hk)
    if d is None:
        return None
    try:
        torch.manual_seed(0)
        a = relpos.Attention(spec, d, hq, hk, model_dim=MODEL_DIM, check_finite=False)
    except relpos.InputError:
        return None
    with torch.no_grad():  # parameters off their initial values (gates, tables away from 0)
        for p in a.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return a


def _captured(a, hq, hk, T=40, decode=False):
    """The op arguments of a's kernel calls: a forward over T tokens, or (decode) a prefill of
    T - 1 tokens into a cache and one decode step (keys read in place from the cache)."""
    d = a.head_dim
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, hq, T, d, generator=g)
    k, v = (torch.randn(2, hk, T, d, generator=g) for _ in range(2))
    x = torch.randn(2, T, MODEL_DIM, generator=g)
    info = relpos.mechanism(a.spec, d, hk)
    dc = next((t["vector_dims"] for t in info["transforms"] if t["time"] == "vector_position"),
              None)
    pos = None if dc is None else torch.randn(2, T, dc, generator=g, dtype=torch.float64)
    calls = []
    original = engine.fused_attention
    # the path a GPU module takes: the one-call decode step (StepPlan.decode) is the CPU's, and
    # its kernel call happens inside C++ where it cannot be captured
    a._one_call_decode = False

    def capture(q_, k_, v_, **kw):
        calls.append(op_args(q_.detach(), k_.detach(), v_.detach(),
                             [None if kw.get(n) is None else kw[n].detach() for n in SLOTS],
                             kw.get("q_positions"), kw.get("k_positions"), kw.get("causal", True),
                             kw.get("window", 0.0), kw.get("key_len"),
                             0.0 if kw.get("scale") is None else kw["scale"], False,
                             kw.get("path_scale", 1.0), kw.get("key_start"),
                             kw.get("q_segments"), kw.get("k_segments")))
        return original(q_, k_, v_, **kw)

    engine.fused_attention = capture
    try:
        with torch.no_grad():
            if not decode:
                a(q, k, v, inputs=x, positions=pos)
            else:
                cache = relpos.KVCache(2, hk, d, capacity=T + 8)
                sl = slice(0, T - 1)
                a(q[:, :, sl], k[:, :, sl], v[:, :, sl], inputs=x[:, sl],
                  positions=None if pos is None else pos[:, sl], cache=cache)
                calls.clear()
                sl = slice(T - 1, T)
                a(q[:, :, sl], k[:, :, sl], v[:, :, sl], inputs=x[:, sl],
                  positions=None if pos is None else pos[:, sl], cache=cache)
    finally:
        engine.fused_attention = original
    return calls


CATALOG = catalog_specs()


@pytest.mark.parametrize("spec", CATALOG)
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_catalog(spec, decode):
    """For every mechanism (grouped-query heads where its module takes them), the kernel's
    forward and backward on exactly the arguments relpos.Attention passes to it."""
    for hq, hk in ((4, 2), (2, 2)):
        a = _module(spec, hq, hk)
        if a is not None:
            break
    assert a is not None, f"relpos.Attention refuses {spec}"
    try:
        calls = _captured(a, hq, hk, decode=decode)
    except relpos.InputError as e:  # a mechanism without a decode cache (documented refusals)
        assert decode and ("decode" in str(e) or "cache" in str(e)), str(e)
        return
    assert calls, spec
    for args in calls:
        if decode:  # every key of the cache, read in place from its storage
            assert args[2].shape[2] == 40 and not args[1].is_contiguous()
        check(args)


def test_catalog_covers_every_bias_policy():
    """The catalogue's bias mechanisms reach every slot family through the module."""
    seen = set()
    for spec in ("alibi", "t5_bias", "kerple", "pj_bias", "fox", "grape_a", "grape_ap"):
        a = _module(spec, 2, 2)
        for args in _captured(a, 2, 2, T=12):
            seen |= {SLOTS[i] for i, b in enumerate(args[3]) if b is not None}
    assert {"lag_table", "slopes", "path_q", "path_k", "path_beta"} <= seen
    assert {"cq", "ck"} & seen and {"gq", "gk"} & seen, seen


# ---- through autograd ---------------------------------------------------------------------------


class _Kernel(torch.autograd.Function):
    """Without a GPU: the GPU backend's forward and backward as the C++ Autograd kernel calls
    them (its output_mask from the inputs that need gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, rest, *biases):
        present = [i for i, t in enumerate(biases) if t is not None]
        out, lse = gpu_call("fused_attention", q, k, v, list(biases), *rest)
        ctx.save_for_backward(q, k, v, out, lse, *[biases[i] for i in present])
        ctx.present, ctx.n, ctx.rest = present, len(biases), rest
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *present = ctx.saved_tensors
        biases = [None] * ctx.n
        for i, t in zip(ctx.present, present):
            biases[i] = t
        mask = list(ctx.needs_input_grad[:3]) + [t is not None and t.requires_grad
                                                 for t in biases + [None] * (9 - ctx.n)]
        dq, dk, dv, db = gpu_call("fused_attention_backward", dout, q, k, v, out, lse, biases,
                                  *ctx.rest, mask, dlse)
        return (dq, dk, dv, None) + tuple(t if t.numel() else None for t in db[:ctx.n])


def _autograd_grads(fn, q, k, v, biases, rest, w_out, w_lse):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    bl = [None if t is None else t.detach().clone().requires_grad_() for t in biases]
    out, lse = fn(*leaves, bl, rest)
    live = lse.isfinite()
    loss = (out.float() * w_out).sum() + (torch.where(live, lse, 0) * w_lse).sum()
    grads = torch.autograd.grad(loss, leaves + [t for t in bl if t is not None])
    return out, grads


def test_autograd():
    """A loss on out and lse: the gradients autograd gets from the GPU backend (the registered
    CUDA op with a GPU) equal the CPU op's."""
    q, k, v = qkv(1, 4, 2, 40, 40, 16)
    biases = _bias("lag+slopes+token+gq+gk", 40, 40, Hq=4)
    biases = [b[:1] if b is not None and b.shape[0] == B else b for b in biases]
    rest = [torch.arange(40.0).double(), None, True, 0.0, torch.tensor([33]), 0.0, False, 1.0,
            None, None, None]
    g = torch.Generator().manual_seed(2)
    w_out = torch.randn(1, 4, 40, 16, generator=g)
    w_lse = torch.randn(1, 4, 40, generator=g)

    def cpu_fn(q_, k_, v_, bl, r):
        return torch.ops.relpos.fused_attention(q_, k_, v_, bl, *r)

    def gpu_fn(q_, k_, v_, bl, r):
        if CUDA:
            return torch.ops.relpos.fused_attention(q_, k_, v_, bl, *r)
        return _Kernel.apply(q_, k_, v_, r, *bl)

    def dev(x):
        return x.to(DEVICE) if isinstance(x, torch.Tensor) else x

    want_out, want = _autograd_grads(cpu_fn, q, k, v, biases, rest, w_out, w_lse)
    got_out, got = _autograd_grads(gpu_fn, dev(q), dev(k), dev(v), [dev(b) for b in biases],
                                   [dev(r) for r in rest], dev(w_out), dev(w_lse))
    close(got_out, want_out, 1e-5, "out")
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        close(a, b, 1e-5, f"grad {i}")


# ---- argument checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad,match", [
    (dict(biases=[torch.zeros(3, 4)]), "lag_table must be"),
    (dict(biases=[None, None, torch.zeros(1, 2, 8)]), "needs both cq and ck"),
    (dict(biases=[None] * 6 + [torch.zeros(1, 2, 8, 2)]), "path_q, path_k and path_beta"),
    (dict(window=-1.0), "window must be"),
    (dict(key_len=torch.zeros(2, dtype=torch.int64)), "key_len must be"),
    (dict(q_segments=torch.tensor([[0, 1, 0, 0, 0, 0, 0, 0]]),
          k_segments=torch.zeros(1, 8, dtype=torch.int64)), "two runs"),
    (dict(q_positions=torch.zeros(3)), "q_positions must be"),
])
def test_argument_checks(bad, match):
    """The GPU backend refuses what the CPU op refuses, with a ValueError naming the problem."""
    q, k, v = qkv(1, 2, 2, 8, 8, 16)
    kw = dict(biases=[])
    kw.update(bad)
    args = op_args(q, k, v, **kw)
    with pytest.raises(ValueError, match=match):
        cpu_call("fused_attention", *args)
    with pytest.raises(ValueError, match=match):
        gpu_call("fused_attention", *args)
