"""Half-precision storage over the whole catalog, with no per-mechanism code: bf16 and fp16
inputs, outputs and caches, computed in float32 (angles, products, accumulation), against the
float64 module; the ops keep their callers' dtype; and the finiteness check the transform kernel
runs on its own outputs."""

import pytest
import torch

import relpos
from module_checks import CATALOG_SPECS, catalog_shapes, decode_in_chunks, jittered, vector_dims

H, M, T = 2, 12, 11
# Stated tolerances, relative to the largest reference entry: a few units in the last place of
# the storage format (bf16 keeps 8 bits, fp16 11): q, k, v and the output are each rounded once.
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
HALF = list(TOL)

pytestmark = pytest.mark.usefixtures("one_thread")

DIMS, INFO = catalog_shapes(CATALOG_SPECS, H)


def module(spec):
    torch.manual_seed(3)
    return jittered(relpos.Attention(spec, DIMS[spec], H, H, model_dim=M), 0.2)


def operands(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, T, DIMS[spec], generator=g, dtype=torch.float64) for _ in range(3))
    x = torch.randn(1, T, M, generator=g, dtype=torch.float64)
    dc = vector_dims(INFO[spec])
    pos = None if dc is None else torch.randint(0, 6, (T, dc), generator=g).to(torch.float64)
    return q, k, v, x, pos


def rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("spec", CATALOG_SPECS)
def test_half_storage_matches_float64(spec, dtype):
    """Output and the q, k, v and parameter gradients of half inputs within TOL of the float64
    module (parameters float32, as mixed-precision training keeps them)."""
    attn = module(spec)
    q, k, v, x, pos = operands(spec)
    ref_attn = attn.double()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = ref_attn(*leaves, inputs=x, positions=pos)
    w = torch.randn(ref.shape, dtype=ref.dtype)  # the same weights whatever ref's layout
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves + list(ref_attn.parameters()),
                                    allow_unused=True)
    attn = ref_attn.float()
    half = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = attn(*half, inputs=x.to(dtype), positions=pos)
    assert out.dtype == dtype
    grads = torch.autograd.grad((out.double() * w).sum(), half + list(attn.parameters()),
                                allow_unused=True)
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    for name, g, r in zip(["q", "k", "v"] + [n for n, _ in attn.named_parameters()], grads,
                          ref_grads):
        if r is None or not r.abs().max() > 0:
            continue
        assert g is not None and g.dtype == (dtype if name in "qkv" else torch.float32), name
        assert rel_err(g, r) < TOL[dtype], (name, rel_err(g, r))


@pytest.mark.parametrize("spec", CATALOG_SPECS)
def test_bf16_tiles_match_float64(spec):
    """The same check at a tiled shape, T 80 and head dim 64, where the fused kernel runs its tile
    products (in bf16 pairs under the avx512+bf16 and avx512+amx kernels, the probabilities and dS
    rounded to bf16)."""
    try:
        relpos.mechanism(spec, 64, H)
    except relpos.InputError as e:
        pytest.skip(f"{spec} at head dim 64: {e}")
    torch.manual_seed(3)
    attn = jittered(relpos.Attention(spec, 64, H, H, model_dim=M), 0.2).double()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, H, 80, 64, generator=g, dtype=torch.float64) for _ in range(3))
    x = torch.randn(1, 80, M, generator=g, dtype=torch.float64)
    dc = vector_dims(relpos.mechanism(spec, 64, H))
    pos = None if dc is None else torch.randint(0, 6, (80, dc), generator=g).to(torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attn(*leaves, inputs=x, positions=pos)
    w = torch.randn(ref.shape, dtype=ref.dtype)  # the same weights whatever ref's layout
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
    attn = attn.float()
    half = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = attn(*half, inputs=x.bfloat16(), positions=pos)
    grads = torch.autograd.grad((out.double() * w).sum(), half)
    assert rel_err(out, ref) < TOL[torch.bfloat16], rel_err(out, ref)
    for name, got, r in zip("qkv", grads, ref_grads):
        assert rel_err(got, r) < TOL[torch.bfloat16], (name, rel_err(got, r))


def test_float16_module_keeps_the_float32_kernel_past_its_range():
    """A float16 module call whose rotated q leaves float16's range (a pair at 6e4 turned by pi/4:
    8.5e4) still attends in float32 (only bfloat16 operands are rounded back for the kernel)."""
    attn = relpos.Attention("rope", 8, 1)
    q = torch.zeros(1, 1, 2, 8)
    q[..., :2] = 6e4
    with torch.no_grad():
        out = attn(q.half(), q.half(), torch.ones(1, 1, 2, 8).half(),
                   positions=torch.tensor([0.0, torch.pi / 4], dtype=torch.float64))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("spec", CATALOG_SPECS)
def test_half_module_and_cache(spec):
    """A module cast to bf16 as a whole runs (its parameters bf16, its output and gradients bf16)
    and decoding through a bf16 cache equals its full forward to bf16 rounding."""
    attn = module(spec).to(torch.bfloat16)
    q, k, v, x, pos = (None if t is None else t.to(torch.bfloat16) for t in operands(spec, 1))
    if pos is not None:
        pos = pos.double()
    q.requires_grad_()
    out = attn(q, k, v, inputs=x, positions=pos)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()
    if attn._cache_refusal is not None or pos is not None:
        return
    with torch.no_grad():
        full = attn(q, k, v, inputs=x)
        got = decode_in_chunks(attn, q, k, v, x, [4, 1, 3, 1, 2])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), full.float(), rtol=0, atol=3e-2 * full.abs().max())


def test_cache_keeps_half_storage():
    cache = relpos.KVCache(1, 2, 8, dtype=torch.float16)
    attn = relpos.Attention("rope", 8, 2)
    q = torch.randn(1, 2, 3, 8, dtype=torch.float16)
    attn(q, q, q, cache=cache)
    assert cache.keys.dtype == torch.float16 and cache.length == 3
    with pytest.raises(relpos.InputError, match="the cache holds torch.float16"):
        attn(q.float(), q.float(), q.float(), cache=cache)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_ops_keep_the_callers_dtype(dtype):
    """Each op takes half operands, returns them in their dtype (lse in float32) and agrees with
    its float64 result; angles and bases may stay float32 beside them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64)
    ang = torch.randn(9, 4, generator=g, dtype=torch.float64)
    cases = {
        "rotate_pairs": lambda t, a: relpos.rotate_pairs(t, a.to(torch.float32 if t.dtype in HALF
                                                                 else t.dtype)),
        "attention": lambda t, a: relpos.attention(t, t, t, "rope + alibi"),
        "encoding": lambda t, a: torch.cat(
            relpos.PositionEncoding("jordan(m=2)", 8, 2).to(
                torch.float64 if t.dtype == torch.float64 else torch.float32)(t, t), -1),
        "favor": lambda t, a: relpos.Attention("rope", 8, 2, backend="favor").to(
            torch.float64 if t.dtype == torch.float64 else torch.float32)(t, t, t),
        "scan": lambda t, a: torch.ops.relpos.causal_scan(t[0, 0], "exclusive"),
    }
    for name, f in cases.items():
        ref = f(x, ang)
        got = f(x.to(dtype), ang)
        assert got.dtype == dtype, name
        assert rel_err(got, ref) < TOL[dtype], (name, rel_err(got, ref))
    out, lse = relpos.fused_attention(x.to(dtype), x.to(dtype), x.to(dtype))
    assert out.dtype == dtype and lse.dtype == torch.float32


@pytest.mark.parametrize("spec", [s for s in CATALOG_SPECS
                                  if any(t["time"] == "position" for t in INFO[s]["transforms"])])
def test_transform_kernel_checks_finiteness(spec):
    """Every encoding with a position term: a NaN or Inf anywhere in q or k is refused by name
    (the kernel checks its outputs), with the check on by default."""
    try:
        enc = relpos.PositionEncoding(spec, DIMS[spec], H)
    except relpos.InputError:
        pytest.skip("not an encoding on its own")
    x = torch.randn(2, H, 70, DIMS[spec])
    enc(x, x)
    for name, bad in (("q", float("nan")), ("k", float("inf")), ("k", -float("inf"))):
        y = x.clone()
        y[1, 1, 67, -1] = bad
        with pytest.raises(relpos.InputError, match=f"{name} contains NaN or Inf"):
            enc(y, x) if name == "q" else enc(x, y)


@pytest.mark.parametrize("D", [8, 64])  # a tile widened in a float buffer; rows turned in registers
def test_float16_overflow_is_refused(D):
    """A rotation turns (6e4, 6e4) into (0, 8.5e4), past float16's 65504: the encoding refuses
    it by name instead of returning an infinity; bfloat16 holds it."""
    enc = relpos.PositionEncoding("rope", D, 1)
    q = torch.zeros(1, 1, 1, D)
    q[..., :2] = 6e4
    pos = torch.tensor([torch.pi / 4], dtype=torch.float64)  # pair 0 turns by 1 rad per position
    with pytest.raises(relpos.InputError, match="q overflows float16"):
        enc(q.half(), q.half(), pos)
    out, _ = enc(q.bfloat16(), q.bfloat16(), pos)
    assert torch.isfinite(out).all() and out.float().abs().max() > 8e4
    with pytest.raises(ValueError, match="overflows float16"):  # the op with its check
        kp = enc.kernel_params()
        torch.ops.relpos.transform(q.half(), q.half(), kp["gamma"], kp["eta"], kp["gates"],
                                   kp["alpha0"], pos, None, None, 0.0, enc.spec, D, 1, 0, True)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("Hq,Hk,Tq,Tk,D", [(4, 4, 1, 200, 64), (4, 2, 3, 90, 32),
                                           (2, 2, 70, 70, 48), (2, 1, 1, 130, 24),
                                           (2, 1, 100, 130, 64)])
def test_fused_attention_reads_half_storage_as_the_float_op_rounded_once(dtype, Hq, Hk, Tq, Tk,
                                                                          D):
    """The fused op on half q, k, v reads them as stored (no float32 copies): its output is the
    float32 op on the widened operands rounded once, bit for bit, and its gradients the float32
    backward's on the widened operands (the half output, as saved) rounded once; keys and values
    as the used prefix of a half cache's storage (NaN past it) give the same bits. Under the
    avx512+bf16 and avx512+amx kernels a bfloat16 call with D a multiple of 32 multiplies bf16
    pairs (dot products or AMX tiles) and rounds the probabilities (and dS) to bfloat16 for their products: the tiled forward's output is
    then within 2^-8 of max |v| plus a rounding of the float32 op's, lse within 1e-5 relative,
    and the gradients within 2^-7 of their largest entry plus 2^-7 relative."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, Hq, Tq, D, generator=g).to(dtype)
    store = torch.full((2, 1, Hk, Tk + 9, D), float("nan"), dtype=dtype)
    store[:, :, :, :Tk] = torch.randn(2, 1, Hk, Tk, D, generator=g).to(dtype)
    k, v = store[0, :, :, :Tk], store[1, :, :, :Tk]
    slopes = 0.1 * torch.rand(Hq, generator=g)
    out, lse = relpos.fused_attention(q, k, v, slopes=slopes)
    want, want_lse = relpos.fused_attention(q.float(), k.float(), v.float(), slopes=slopes)
    assert out.dtype == dtype and lse.dtype == torch.float32
    amx = dtype == torch.bfloat16 and D % 32 == 0 and relpos.kernel_isa() in ("avx512+bf16",
                                                                       "avx512+amx")
    tiled = Tq * (Hq // Hk) > 16  # (more rows than the decode kernel takes)
    if amx and tiled:
        vmax = v.float().abs().max().item()
        torch.testing.assert_close(out.float(), want, atol=2**-8 * vmax, rtol=2**-7)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out, want.to(dtype), atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    # the backward (contiguous operands: the backward copies a strided cache prefix)
    qh, kh, vh = (t.contiguous().requires_grad_() for t in (q, k, v))
    out, lse = relpos.fused_attention(qh, kh, vh, slopes=slopes)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, (qh, kh, vh), dout)
    f = [t.detach().float() for t in (qh, kh, vh)]
    want = torch.ops.relpos.fused_attention_backward(
        dout.float(), *f, out.detach().float(), lse, [None, slopes] + [None] * 7, None, None,
        True, 0.0, None, 0.0, False, 1.0, None, None, None, [True] * 3 + [False] * 9, None)
    for a, b in zip(got, want[:3]):
        assert a.dtype == dtype
        if amx:
            top = b.abs().max().item()
            torch.testing.assert_close(a.float(), b, atol=2**-7 * top, rtol=2**-7)
        else:
            torch.testing.assert_close(a, b.to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("layout", ["interleaved", "half_split"])
def test_half_rotations_are_the_float_kernel_rounded_once(dtype, layout):
    """RoPE and rotate_pairs read and write half tensors in one pass over their words: the same
    bits as the float32 op on the widened input, rounded to the dtype, forward and backward
    (head dims with whole and partial vector groups, a partial 64-row tile); a NaN or Inf in q or
    k is still refused by name."""
    g = torch.Generator().manual_seed(5)
    for D, T in ((64, 70), (24, 9), (80, 130)):
        x = torch.randn(2, 3, T, D, generator=g).to(dtype)
        w = torch.randn(2, 3, T, D, generator=g).to(dtype)
        ang = torch.randn(T, D // 2, generator=g)
        enc = relpos.PositionEncoding("rope", D, 3, pair_layout=layout)
        pos = torch.arange(T, dtype=torch.float64) * 1.5 - 4
        cases = {"encoding": lambda t: enc(t, t, pos)[0],
                 "rotate_pairs": lambda t: relpos.rotate_pairs(t, ang, pair_layout=layout)}
        for name, f in cases.items():
            xh, xf = x.clone().requires_grad_(), x.float().requires_grad_()
            yh, yf = f(xh), f(xf)
            assert yh.dtype == dtype and torch.equal(yh, yf.to(dtype)), (name, D)
            yh.backward(w)
            yf.backward(w.float())
            assert xh.grad.dtype == dtype and torch.equal(xh.grad, xf.grad.to(dtype)), (name, D)
        for name, bad in (("q", float("nan")), ("k", float("inf"))):
            y = x.clone()
            y[1, 2, T - 1, D - 1] = bad
            with pytest.raises(relpos.InputError, match=f"{name} contains NaN or Inf"):
                enc(y, x, pos) if name == "q" else enc(x, y, pos)


@pytest.mark.parametrize("spec", ["rope", "rope + alibi", "jordan(m=2)", "rope(theta=500000)",
                                  "rope + t5_bias"])
def test_bf16_module_transforms_as_stored(spec):
    """Without parameters to train, a bfloat16 module call on the CPU transforms q and k as stored
    (float32 math, one rounding) and hands them to the kernel with v as given: the same bits as
    transforming float32 copies and rounding them for the kernel, as it did before."""
    from relpos.attention import _learned_lag_table, _transform_qk

    attn = relpos.Attention(spec, 64, 12)  # (12 heads: ALiBi slopes 2^-(k/2), rounded in bf16)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 12, 80, 64, generator=g).bfloat16() for _ in range(3))
    pos = torch.arange(80, dtype=torch.float64)
    with torch.no_grad():
        got = attn(q, k, v)
        qt, kt, _, _, slopes = _transform_qk(attn.encoding, q.float(), k.float(), pos, pos)
        lag = (_learned_lag_table(attn.encoding, pos, pos, 12, 12, torch.float32)
               if attn.encoding._lag_names else None)
        want, _ = relpos.fused_attention(qt.bfloat16(), kt.bfloat16(), v, q_positions=pos,
                                         k_positions=pos, slopes=slopes, lag_table=lag)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
