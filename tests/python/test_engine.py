"""relpos.Attention and relpos.KVCache over the whole catalog, with no per-mechanism code: the
forward against a float64 composition from plain torch ops, decoding through the cache against the
full forward, causality, gradients, and the refusals (decided from the mechanism JSON)."""

import copy
import math
import pickle

import pytest
import torch

import relpos
from module_checks import CATALOG_SPECS, grouped_qkv, head_dim_for, jittered

# every mechanism; a context-extension rule (kind "scaling") on RoPE
SPECS = CATALOG_SPECS
HQ, HK = 4, 2


DIMS = {s: head_dim_for(s, HQ) for s in SPECS}


def needs_more_than_positions(info):
    """What the module's runtimes compute, tested in their own files: a bias computed from the
    tokens (test_content_bias.py), a transform not driven by positions alone or whose frequencies
    or basis a layer learns (test_learned_rotation.py, test_vector_positions.py,
    test_token_frames.py). Slopes and learned lag tables (a row per query head) run here."""
    return (any(b["shape"] != "lag_table" for b in info["biases"])
            or any(t["time"] != "position" or t["learned_frequencies"] or t["basis"] != "none"
                   for t in info["transforms"]))


INFO = {s: relpos.mechanism(s, DIMS[s], HQ) for s in SPECS}
ACCEPTED = [s for s in SPECS if not needs_more_than_positions(INFO[s])]


def decodes(info):
    return info["center"] != "mid" and not info["rope_scaling_dynamic"]


DECODED = [s for s in ACCEPTED if decodes(INFO[s])]


pytestmark = pytest.mark.usefixtures("one_thread")


def module(spec, dtype=torch.float64, jitter=0.2, **kw):
    torch.manual_seed(3)
    a = relpos.Attention(spec, DIMS[spec], HQ, HK, **kw).to(dtype)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(jitter * torch.randn_like(p))
    return a


def qkv(spec, B=2, T=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = DIMS[spec]
    q = torch.randn(B, HQ, T, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, HK, T, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, HK, T, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def rotate(x, theta, inverse=False):
    """Interleaved pairs (2p, 2p+1) of x [B, H, T, D] rotated by theta [B, T, P] (first P pairs)."""
    P = theta.shape[-1]
    t = (-theta if inverse else theta)[:, None].to(x.dtype)
    c, s = t.cos(), t.sin()
    x0, x1 = x[..., 0 : 2 * P : 2], x[..., 1 : 2 * P : 2]
    out = x.clone()
    out[..., 0 : 2 * P : 2] = c * x0 - s * x1
    out[..., 1 : 2 * P : 2] = s * x0 + c * x1
    return out


def reference(attn, q, k, v, pos, key_len=None, window=0.0):
    """softmax(q~ k~^T / sqrt(D) - slope (p_i - p_j) + b_h(p_i - p_j)) v with the causal, window
    and length masks, q~ and k~ from the module's encoding (query group i with the keys, one call
    each), slopes and journey frames from the mechanism JSON, a learned table b_h (a row per query
    head, at the rounded lag) from the encoding; plain torch ops otherwise."""
    B, Hq, T, D = q.shape
    Hk = k.shape[1]
    g = Hq // Hk
    pos = (pos if pos.dim() == 2 else pos.expand(B, T)).to(torch.float64)
    qg = q.reshape(B, Hk, g, T, D)
    parts = []
    for i in range(g):
        qi, kt = attn.encoding(qg[:, :, i], k, pos)
        parts.append(qi)
    qt = torch.stack(parts, 2).reshape(B, Hq, T, D)
    info = relpos.mechanism(attn.spec, D, Hq)
    kt, vt = kt.repeat_interleave(g, 1), v
    frames = [t for t in info["transforms"] if "frame_frequencies" in t]
    theta = None
    if frames:
        f = torch.tensor(frames[0]["frame_frequencies"], dtype=torch.float64)
        theta = torch.remainder(pos[..., None] * f, 2 * math.pi)
        if frames[0]["values"]:
            vt = rotate(v, theta)
    vt = vt.repeat_interleave(g, 1)
    s = qt @ kt.transpose(-1, -2) / math.sqrt(D)
    lag = pos[:, None, :, None] - pos[:, None, None, :]  # p_i - p_j
    for b in info["biases"]:
        if b["slopes"]:
            s = s - torch.tensor(b["slopes"], dtype=s.dtype)[None, :, None, None] * lag.to(s.dtype)
    table = attn.encoding.lag_table(int(lag.max()) + 1)  # a learned table: a row per query head
    if table is not None:
        idx = (lag + 0.5).floor().clamp(0, table.shape[1] - 1).long()  # [B, 1, T, T]
        s = s + table[torch.arange(Hq)[None, :, None, None], idx].to(s.dtype)
    visible = lag >= 0
    if window > 0:
        visible = visible & (lag < window)
    if key_len is not None:
        visible = visible & (torch.arange(T)[None, None, None, :] < key_len[:, None, None, None])
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.softmax(s, -1) @ vt
    if frames and frames[0]["outputs"]:
        out = rotate(out, theta, inverse=True)
    return out


@pytest.mark.parametrize("spec", ACCEPTED)
def test_forward_is_the_plain_torch_composition(spec):
    pos = torch.tensor([[0.0, 1, 2, 5, 9, 10], [3, 4, 6, 7, 8, 12]], dtype=torch.float64)
    for dtype, tol in ((torch.float64, 1e-11), (torch.float32, 1e-5)):
        a = module(spec, dtype)
        q, k, v = qkv(spec, dtype=dtype)
        for window, positions in ((0.0, None), (3.0, pos), (0.0, pos[0])):
            a.window = window
            got = a(q, k, v, positions=positions)
            want = reference(a.double(), q.double(), k.double(), v.double(),
                             torch.arange(6.0) if positions is None else positions, window=window)
            a.to(dtype)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=tol,
                                       msg=f"{dtype} window {window}")
    # and it is relpos.attention with the module's encoding, where that function takes the call
    a = module(spec)
    q, k, v = qkv(spec)
    try:
        want = relpos.attention(q, k, v, a.encoding)
    except relpos.InputError:
        return
    torch.testing.assert_close(a(q, k, v), want, rtol=0, atol=0)


CONTENT_SHAPES = ("separable", "gated_slope", "path_integral")  # FoX, GRAPE-A, GRAPE-AP


def one_call(info):
    """Whether a cached step runs as one C++ call (StepPlan.decode): at most one transform, driven
    by positions alone, biases of slope form or computed from the tokens (no learned lag table)."""
    return (len(info["transforms"]) <= 1
            and all(t["kind"] not in ("fixed_linear", "vector_rotation") and t["time"] == "position"
                    and not t["learned_frequencies"] and t["basis"] == "none"
                    and not t.get("values") and not t.get("outputs") for t in info["transforms"])
            and all((b["shape"] == "lag_table" and b["slopes"]) or b["shape"] in CONTENT_SHAPES
                    for b in info["biases"]))


def has_content(info):
    return any(b["shape"] in CONTENT_SHAPES for b in info["biases"])


def counting_one_call_steps(a):
    """Replaces a._decode by a wrapper; returns the list it appends to for every step that ran
    as one call (None: the step went to the general path)."""
    calls, decode = [], a._decode

    def counted(*args):
        out = decode(*args)
        if out is not None:
            calls.append(1)
        return out

    a._decode = counted
    return calls


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("spec", DECODED)
def test_decode_through_the_cache_is_the_full_forward(spec, grad):
    # without autograd a cached step is one op call (Attention._decode); with it (q recording
    # gradients, the parameters frozen: test_a_cached_call_refuses_the_gradients_it_would_lose)
    # the general path: both against the same full forward
    with torch.set_grad_enabled(grad):
        check_decode(spec, grad)


@pytest.mark.parametrize("spec", DECODED)
def test_selecting_cache_rows_commutes_with_decoding(spec):
    """KVCache.select_rows (beam search's reorder, a prompt repeated for beams) then more steps
    equals decoding the selected rows from the start, bit for bit; bad rows are refused."""
    a = module(spec).requires_grad_(False)
    q, k, v = qkv(spec)
    rows = torch.tensor([1, 0, 1])
    cache, picked = (relpos.KVCache(n, HK, DIMS[spec], dtype=torch.float64) for n in (2, 3))
    for t in range(6):
        x = [y[:, :, t: t + 1] for y in (q, k, v)]
        if t == 3:
            cache.select_rows(rows)
        out = a(*(y[rows] if t >= 3 else y for y in x), cache=cache)
        want = a(*(y[rows] for y in x), cache=picked)
        if t >= 3:
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.equal(cache.keys, picked.keys) and torch.equal(cache.lengths, picked.lengths)
    for bad in (torch.tensor([3]), torch.tensor([-1]), torch.tensor([[0]]), torch.tensor([0.0]),
                torch.tensor([], dtype=torch.int64)):
        with pytest.raises(relpos.InputError, match="select_rows"):
            cache.select_rows(bad)


@pytest.mark.parametrize("spec", DECODED)
def test_the_one_call_decode_step_is_the_general_path(spec):
    a = module(spec, torch.float32).requires_grad_(False)
    q, k, v = qkv(spec, dtype=torch.float32)
    calls = counting_one_call_steps(a)
    caches = [relpos.KVCache(2, HK, DIMS[spec], capacity=2) for _ in range(2)]
    for t in range(6):
        got = []
        for cache, grad in zip(caches, (False, True)):
            x = [y[:, :, t : t + 1] for y in (q, k, v)]
            if grad:  # the general path: autograd records the step
                x[0] = x[0].clone().requires_grad_(True)
            with torch.set_grad_enabled(grad):
                got.append(a(*x, cache=cache, return_lse=True))
        for one, general in zip(*got):
            torch.testing.assert_close(one, general.detach(), rtol=0, atol=0)
    torch.testing.assert_close(caches[0].keys, caches[1].keys, rtol=0, atol=0)
    assert torch.equal(caches[0].positions, caches[1].positions)
    # (a content bias's first step makes the cache's side tensors on the general path)
    assert len(calls) == (0 if not one_call(INFO[spec]) else 5 if has_content(INFO[spec]) else 6)


def test_the_operator_library_is_its_python_module():
    """The library the package loaded is also the Python module relpos._relpos_ops (built with
    Python's headers, as scripts/build.sh and the wheel build it), whose direct step calls the
    modules make."""
    steps = relpos._library.STEPS
    assert steps is not None and steps.__file__ == str(relpos._library.LIB)
    assert callable(steps.step_decode) and callable(steps.step_transform)


def test_a_library_of_any_file_name_is_its_module_once(tmp_path):
    """RELPOS_OPS_LIBRARY may name the library by any file name (the operators load, and the
    module with them); importing relpos._relpos_ops by name then finds that loaded module, not a
    second copy of the library (whose operators would register twice)."""
    import os
    import shutil
    import subprocess
    import sys

    lib = tmp_path / "ops.so.old"
    shutil.copy(relpos._library.LIB, lib)
    code = ("import relpos, relpos._relpos_ops as m; "
            "print(m is relpos._library.STEPS, m.__file__, len(relpos.mechanisms()) > 0)")
    env = dict(os.environ, RELPOS_OPS_LIBRARY=str(lib),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", str(lib), "True"], r.stdout


@pytest.mark.parametrize("spec", [s for s in DECODED if one_call(INFO[s])])
def test_the_direct_step_call_is_the_torchscript_method(spec, monkeypatch):
    """The operator library's direct call of a cached step (relpos._relpos_ops.step_decode) and
    the StepPlan.decode method it replaces give the same outputs, log-sum-exps and cache bit for
    bit (over a prompt, single tokens and a chunk, the storage grown inside the step, a content
    bias's inputs), and the same refusal of a non-finite token, appending nothing."""
    D = DIMS[spec]
    content = has_content(INFO[spec])
    a = module(spec, torch.float32, model_dim=8 if content else None).requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    B, T = 2, 7
    q, k, v = (t.float() for t in grouped_qkv(g, B, T, D, HQ, HK))
    x = torch.randn(B, T, 8, generator=g) if content else None
    runs = []
    for steps in (relpos._library.STEPS, None):
        monkeypatch.setattr(relpos._library, "STEPS", steps)
        b = copy.deepcopy(a)  # (a new plan, its calls made with this STEPS)
        cache = relpos.KVCache(B, HK, D, capacity=1)
        outs = []
        with torch.no_grad():
            for t0, t1 in ((0, 3), (3, 4), (4, 6), (6, 7)):
                y = [z[:, :, t0:t1] for z in (q, k, v)]
                outs += b(*y, cache=cache, inputs=None if x is None else x[:, t0:t1],
                          return_lse=True)
            bad = [z[:, :, :1].clone() for z in (q, k, v)]
            bad[1][0, 0, 0, 0] = float("nan")
            with pytest.raises(relpos.InputError) as refused:
                b(*bad, cache=cache, inputs=None if x is None else x[:, :1])
        assert cache.length == T
        call = b.encoding._plan_calls["decode"]  # (the call each run made)
        assert (getattr(call, "func", None) is getattr(steps, "step_decode", 0)) == (steps is not None)
        runs.append((outs, cache, str(refused.value)))
    (direct, c1, e1), (method, c2, e2) = runs
    assert all(torch.equal(o1, o2) for o1, o2 in zip(direct, method))
    assert torch.equal(c1.keys, c2.keys) and torch.equal(c1.values, c2.values)
    assert torch.equal(c1.positions, c2.positions) and torch.equal(c1.lengths, c2.lengths)
    assert all(torch.equal(s1, s2) for s1, s2 in zip(c1._content, c2._content))
    assert e1 == e2 and "NaN" in e1


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "method"])
def test_a_step_attribute_of_another_type_is_refused(direct, monkeypatch):
    """A module attribute set after construction to another type (window, causal) reaches the
    C++ step as an argument it cannot take: InputError through either call, the cache
    unchanged."""
    if not direct:
        monkeypatch.setattr(relpos._library, "STEPS", None)
    for name, value in (("window", "wide"), ("causal", "yes")):
        a = relpos.Attention("alibi", 16, 4, 2)
        cache = relpos.KVCache(1, 2, 16)
        step = [torch.randn(1, h, 1, 16) for h in (4, 2, 2)]
        with torch.no_grad():
            a(*step, cache=cache)
            setattr(a, name, value)
            with pytest.raises(relpos.InputError):
                a(*step, cache=cache)
        assert cache.length == 1


CONTENT = [s for s in SPECS if has_content(INFO[s])] + [
    "rope + fox", "alibi + grape_a", "rope + grape_ap(form=paper)", "grape_m + fox"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("heads", [HK, 2 * HK], ids=["mha", "gqa"])
@pytest.mark.parametrize("spec", CONTENT)
def test_the_one_call_decode_step_takes_content_biases(spec, heads, dtype):
    """A content bias (gates or probes from the layer's inputs, or from q and k) decodes in one
    C++ call once the cache holds its side tensors: bit for bit the general path's outputs,
    log-sum-exps, keys and side tensors without autograd, and within rounding of the general path
    with q recording gradients (GRAPE-A's gates of q then come from the ATen ops, not the host
    loops), over a prompt and chunks of 1 and 2 tokens. A step it cannot take is refused by name
    and appends nothing (no inputs; a path integral over rows of different lengths)."""
    D = head_dim_for(spec, HK)
    torch.manual_seed(3)
    a = jittered(relpos.Attention(spec, D, heads, HK, model_dim=8), 0.2).to(dtype)
    a.requires_grad_(False)
    general_path = copy.deepcopy(a)
    general_path._one_call_decode = False
    info = relpos.mechanism(spec, D, heads)
    g = torch.Generator().manual_seed(1)
    B, T = 2, 7
    q, k, v = (t.to(dtype) for t in grouped_qkv(g, B, T, D, heads, HK))
    x = torch.randn(B, T, 8, generator=g, dtype=dtype)
    calls = counting_one_call_steps(a)
    caches = [relpos.KVCache(B, HK, D, dtype=dtype, capacity=2) for _ in range(3)]
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-13}
    for t0, t1 in ((0, 3), (3, 4), (4, 6), (6, 7)):
        got = []
        for cache, module, grad in zip(caches, (a, general_path, a), (False, False, True)):
            y = [z[:, :, t0:t1] for z in (q, k, v)]
            if grad:  # the general path of the same module: autograd records the step
                y[0] = y[0].clone().requires_grad_(True)
            with torch.set_grad_enabled(grad):
                got.append(module(*y, inputs=x[:, t0:t1], cache=cache, return_lse=True))
        for one, general, recorded in zip(*got):
            torch.testing.assert_close(one, general, rtol=0, atol=0)
            torch.testing.assert_close(one, recorded.detach(), **tol)
    assert len(calls) == (3 if one_call(info) else 0)
    one, general, _ = caches
    assert torch.equal(one.keys, general.keys) and torch.equal(one.lengths, general.lengths)
    assert len(one._content) == len(general._content) > 0
    for c1, c2 in zip(one._content, general._content):
        assert torch.equal(c1[:, :, :T], c2[:, :, :T])
    step = [z[:, :, :1] for z in (q, k, v)]
    reads_inputs = a._content["reads_inputs"]
    with torch.no_grad():
        if reads_inputs:
            with pytest.raises(relpos.InputError, match="inputs"):
                a(*step, cache=one)
        if any(b["shape"] == "path_integral" for b in info["biases"]):
            with pytest.raises(relpos.InputError, match="one length"):
                a(*step, inputs=x[:, :1], cache=one, key_len=torch.tensor([1, 0]))
    assert one.length == T and torch.equal(one.lengths, general.lengths)


@pytest.mark.parametrize("spec", ["fox", "grape_a", "grape_ap", "rope + fox"])
def test_a_non_finite_token_in_a_one_call_content_step_stays_in_its_row(spec):
    """A NaN or Inf in one row's new token (its hidden state, or its q and k for GRAPE-A's gates,
    the finiteness check off) makes that row's output non-finite and leaves the other row's
    output and cached side tensors bit for bit as without it."""
    D = head_dim_for(spec, HK)
    torch.manual_seed(3)
    a = jittered(relpos.Attention(spec, D, 2 * HK, HK, model_dim=8, check_finite=False), 0.2)
    a = a.double().requires_grad_(False)
    reads_inputs = a._content["reads_inputs"]
    g = torch.Generator().manual_seed(2)
    B, T = 2, 5
    q, k, v = grouped_qkv(g, B, T, D, 2 * HK, HK)
    x = torch.randn(B, T, 8, generator=g, dtype=torch.float64)
    outs = []
    for bad in (None, float("nan"), float("inf")):
        calls = counting_one_call_steps(a)
        cache = relpos.KVCache(B, HK, D, dtype=torch.float64)
        qq, kk, xx = q.clone(), k.clone(), x.clone()
        if bad is not None:  # row 1, token 3 (a one-call step)
            if reads_inputs:
                xx[1, 3, 0] = bad
            else:
                qq[1, :, 3, 0] = bad
                kk[1, :, 3, 0] = bad
        with torch.no_grad():
            out = torch.cat([a(qq[:, :, t0:t1], kk[:, :, t0:t1], v[:, :, t0:t1],
                               inputs=xx[:, t0:t1], cache=cache)
                             for t0, t1 in ((0, 3), (3, 4), (4, 5))], 2)
        assert len(calls) == 2
        outs.append((out, [c[:, :, :T].clone() for c in cache._content]))
    (clean, side), rest = outs[0], outs[1:]
    for out, dirty_side in rest:
        torch.testing.assert_close(out[0], clean[0], rtol=0, atol=0)
        torch.testing.assert_close(out[1, :, :3], clean[1, :, :3], rtol=0, atol=0)
        assert not torch.isfinite(out[1, :, 3:]).all()
        for c, d in zip(side, dirty_side):
            torch.testing.assert_close(d[0], c[0], rtol=0, atol=0)


def cacheable(spec):
    """Every spec a cache decodes (with a model width for the runtimes that read inputs)."""
    D = head_dim_for(spec, HK)
    a = relpos.Attention(spec, D, HK, HK, model_dim=8)
    return a._cache_refusal is None


@pytest.mark.parametrize("heads", [HK, 2 * HK], ids=["mha", "gqa"])
@pytest.mark.parametrize("spec", [s for s in SPECS if cacheable(s)])
def test_a_cached_call_refuses_the_gradients_it_would_lose(spec, heads):
    """The cache keeps its keys and values detached. A cached call with autograd on is refused
    when k, v, the inputs a runtime reads or a parameter would record gradients (they would miss
    their paths through the stored keys), and appends nothing; when only q records them, its
    output and q's gradient are the full forward's."""
    D = head_dim_for(spec, HK)
    torch.manual_seed(3)
    a = jittered(relpos.Attention(spec, D, heads, HK, model_dim=8).double(), 0.2)
    g = torch.Generator().manual_seed(1)
    B, T, P = 2, 5, 3  # a prompt of P tokens under no_grad, then the rest
    q, k, v = grouped_qkv(g, B, T, D, heads, HK)
    x = torch.randn(B, T, 8, generator=g, dtype=torch.float64)
    vector = [t["vector_dims"] for t in INFO[spec]["transforms"] if t["time"] == "vector_position"]
    pos = torch.randn(B, T, vector[0], generator=g, dtype=torch.float64) if vector else None

    def call(qq, kk, vv, xx, sl, cache=None):
        return a(qq[:, :, sl], kk[:, :, sl], vv[:, :, sl], inputs=xx[:, sl], cache=cache,
                 positions=None if pos is None else pos[:, sl])

    cache = relpos.KVCache(B, HK, D, dtype=torch.float64)
    with torch.no_grad():
        call(q, k, v, x, slice(0, P), cache)
    rest = slice(P, T)
    reads_inputs = any(r is not None and r["reads_inputs"] for r in (a._content, a._rotation))
    recording = {"k": (q, k.clone().requires_grad_(), v, x),
                 "v": (q, k, v.clone().requires_grad_(), x),
                 **({"inputs": (q, k, v, x.clone().requires_grad_())} if reads_inputs else {})}
    for name, args in recording.items():
        with pytest.raises(relpos.InputError, match="partial gradients"):
            call(*args, rest, cache)
    for p in a.parameters():  # each parameter alone
        a.requires_grad_(False)
        p.requires_grad_(True)
        with pytest.raises(relpos.InputError, match="partial gradients"):
            call(q, k, v, x, rest, cache)
    assert cache.length == P
    a.requires_grad_(False)
    qg = q.clone().requires_grad_()
    full = call(qg, k, v, x, slice(0, T))[:, :, rest]
    w = torch.randn(full.shape, generator=g, dtype=torch.float64)
    (want,) = torch.autograd.grad((full * w).sum(), qg)
    qg = q.clone().requires_grad_()
    out = call(qg, k, v, x, rest, cache)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-12)
    (got,) = torch.autograd.grad((out * w).sum(), qg)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_one_call_decode_step_reads_parameters_written_through_data():
    # an EMA swap writes parameters through .data, which bumps no version counter: the step's
    # cached kernel parameters must follow the values
    a = relpos.Attention("jordan(m=2)", 16, 2, 2).requires_grad_(False)
    q, k, v = (torch.randn(1, 2, 1, 16) for _ in range(3))

    def step(grad):
        cache = relpos.KVCache(1, 2, 16)
        x = q.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):  # no grad: the one-call step; grad: the general path
            a(x, k, v, cache=cache)
            return a(x, k, v, cache=cache).detach()

    before = step(False)
    for p in a.parameters():
        p.data.add_(0.3)
    after = step(False)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, step(True), rtol=0, atol=0)


def test_the_one_call_decode_step_survives_copies_pickles_and_dtypes():
    """The step's plan (StepPlan: the parsed mechanism and its kernel parameters) is a cache of
    the module: a deep copy or a pickled module decodes the next token as the original does, and
    one module decodes float32 and float64 caches in turn (its parameters recomputed per dtype),
    growing each cache from capacity 1 inside the step."""
    import copy
    import io

    a = relpos.Attention("alibi + rope", 16, 4, 2).requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    toks = [tuple(torch.randn(1, h, 1, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
            for _ in range(6)]

    def run(module, cache, steps, dtype):
        with torch.no_grad():
            return [module(*(t.to(dtype) for t in x), cache=cache) for x in steps]

    caches = {dt: relpos.KVCache(1, 2, 16, capacity=1, dtype=dt)
              for dt in (torch.float32, torch.float64)}
    for dt, cache in caches.items():  # interleaved dtypes: the plan's parameters follow
        run(a, cache, toks[:3], dt)
    assert caches[torch.float32].capacity == 4 and caches[torch.float32].length == 3
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    for other in (copy.deepcopy(a), torch.load(buf, weights_only=False)):
        for dt, cache in caches.items():
            mine, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
            want = run(a, mine, toks[3:], dt)
            got = run(other, theirs, toks[3:], dt)
            assert all(torch.equal(x, y) for x, y in zip(got, want)), dt


def test_the_one_call_decode_step_names_inputs_that_are_not_tensors():
    a = relpos.Attention("rope", 16, 4, 2)
    cache = relpos.KVCache(1, 2, 16)
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16)
    for args, name in (((q, [1.0], k), "k"), ((q, k, "v"), "v"), (([0.0], k, k), "q")):
        with torch.no_grad(), pytest.raises(relpos.InputError, match=f"{name} must be"):
            a(*args, cache=cache)
    assert cache.length == 0


def check_decode(spec, grad=False):
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        a = module(spec, dtype).requires_grad_(not grad)
        q, k, v = qkv(spec, dtype=dtype)
        q.requires_grad_(grad)
        for prefill, window in ((1, 0.0), (3, 2.5)):  # token by token; a prefill, then decode
            a.window = window
            full = a(q, k, v)
            cache = relpos.KVCache(2, HK, DIMS[spec], capacity=1, dtype=dtype)
            outs = [a(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], cache=cache)]
            for t in range(prefill, 6):
                outs.append(a(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], cache=cache))
            assert cache.length == 6 and cache.capacity >= 6
            torch.testing.assert_close(torch.cat(outs, 2), full, rtol=0, atol=tol,
                                       msg=f"{dtype} prefill {prefill} window {window}")
        a.window = 0.0
        # rows of different lengths: a padded prefill (key_len 3 and 2), then each row decodes
        # its own next tokens at its own positions
        full = a(q, k, v, key_len=torch.tensor([6, 5]))
        cache = relpos.KVCache(2, HK, DIMS[spec], dtype=dtype)
        first = a(q[:, :, :3], k[:, :, :3], v[:, :, :3], cache=cache, key_len=torch.tensor([3, 2]))
        rows = [[first[0, :, :3]], [first[1, :, :2]]]
        for step in range(3):
            idx = torch.tensor([3 + step, 2 + step])
            pick = lambda x: x[torch.arange(2), :, idx].unsqueeze(2)  # noqa: E731
            out = a(pick(q), pick(k), pick(v), cache=cache)
            rows[0].append(out[0])
            rows[1].append(out[1])
        assert cache.lengths.tolist() == [6, 5]
        torch.testing.assert_close(torch.cat(rows[0], 1), full[0], rtol=0, atol=tol)
        torch.testing.assert_close(torch.cat(rows[1], 1), full[1, :, :5], rtol=0, atol=tol)


@pytest.mark.parametrize("spec", ACCEPTED)
def test_a_later_token_leaves_earlier_outputs_unchanged(spec):
    a = module(spec)
    q, k, v = qkv(spec)
    before = a(q, k, v)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, -1] += 3.0
    after = a(q2, k2, v2)
    assert torch.equal(after[:, :, :-1], before[:, :, :-1])
    assert not torch.allclose(after[:, :, -1], before[:, :, -1])


@pytest.mark.parametrize("spec", ACCEPTED)
def test_gradcheck_q_k_v_and_parameters(spec):
    a = relpos.Attention(spec, DIMS[spec], 2, 1).double()
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.2 * torch.randn_like(p))
    D = DIMS[spec]
    q = torch.randn(1, 2, 3, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 3, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 3, D, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([0.0, 2.0, 3.5], dtype=torch.float64)
    # fast mode: random directional derivatives (any wrong gradient fails them), the full
    # Jacobian of ~100 inputs would cost the catalog seconds
    assert torch.autograd.gradcheck(lambda x, y, z: a(x, y, z, positions=pos), (q, k, v),
                                    atol=1e-6, rtol=1e-5, fast_mode=True)
    params = dict(a.named_parameters())
    if not params:
        return
    names = list(params)

    def f(*vals):
        return torch.func.functional_call(a, dict(zip(names, vals)), (q.detach(), k.detach(), v.detach()),
                                          {"positions": pos})

    vals = tuple(p.detach().clone().requires_grad_(True) for p in params.values())
    assert torch.autograd.gradcheck(f, vals, atol=1e-6, rtol=1e-5)


def test_every_mechanism_builds_with_grouped_heads():
    """Every mechanism of the catalog (given a width for the runtimes that read the hidden
    states), with 4 query heads on 2 key/value heads; the ones this file runs include learned lag
    tables."""
    assert any(INFO[s]["biases"] and not INFO[s]["biases"][0]["slopes"] for s in ACCEPTED)
    for spec in SPECS:
        relpos.Attention(spec, DIMS[spec], HQ, HK, model_dim=8)


def test_the_cache_refuses_per_call_centres_and_dynamic_rules():
    # from the catalog: dynamic context-extension rules, and every family with a centre option
    # at center=mid
    cases = [s for s in ACCEPTED if not decodes(INFO[s])]
    for m in relpos.mechanisms():
        if m["kind"] != "scaling" and any(o["key"] == "center" for o in m["options"]):
            cases.append(f"{m['name']}(center=mid)")
    assert any("center=mid" in s for s in cases) and any(s.startswith("rope + ") for s in cases)
    for spec in cases:
        D = head_dim_for(spec, HQ)
        a = relpos.Attention(spec, D, HQ, HK).double()
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, HQ, 2, D, generator=g, dtype=torch.float64)
        k = torch.randn(1, HK, 2, D, generator=g, dtype=torch.float64)
        a(q, k, k)  # without a cache it runs
        with pytest.raises(relpos.InputError, match="center=mid|dynamic"):
            a(q, k, k, cache=relpos.KVCache(1, HK, D, dtype=torch.float64))


def test_state_dict_names_are_the_encodings():
    a = relpos.Attention("jordan(m=2, regime=scaled)", 8, 4, 2)
    enc = relpos.PositionEncoding("jordan(m=2, regime=scaled)", 8, 2)
    assert sorted(a.state_dict()) == sorted(f"encoding.{n}" for n in enc.state_dict())
    assert [n for n, _ in a.named_parameters()] == [f"encoding.{n}" for n, _ in enc.named_parameters()]


def test_bad_calls_raise_input_errors():
    a = relpos.Attention("rope + alibi", 8, 4, 2)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(relpos.InputError, match="divide"):
        relpos.Attention("rope", 8, 4, 3)
    with pytest.raises(relpos.InputError, match="q has 2 heads"):
        a(q[:, :2], k, v)
    with pytest.raises(relpos.InputError, match="k has 4 heads"):
        a(q, q, v)
    # hidden states go to every mechanism (a model passes them uniformly): unread, but checked
    torch.testing.assert_close(a(q, k, v, inputs=torch.randn(1, 3, 32)), a(q, k, v))
    with pytest.raises(relpos.InputError, match=r"inputs must be \[B, T, model_dim\]"):
        a(q, k, v, inputs=torch.randn(1, 4, 32))
    for cache, what in ((relpos.KVCache(2, 2, 8), "batch 2"), (relpos.KVCache(1, 1, 8), "1 key/value"),
                        (relpos.KVCache(1, 2, 8, dtype=torch.float64), "float64")):
        with pytest.raises(relpos.InputError, match=what):
            a(q, k, v, cache=cache)
    cache = relpos.KVCache(1, 2, 8)
    a(q, k, v, cache=cache)
    with pytest.raises(relpos.InputError, match="backwards"):
        a(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache=cache, positions=torch.tensor([1.0]))
    with pytest.raises(relpos.InputError, match="increase"):
        a(q[:, :, :2], k[:, :, :2], v[:, :, :2], cache=cache, positions=torch.tensor([7.0, 7.0]))
    with pytest.raises(relpos.InputError, match="key_len"):
        a(q, k, v, cache=cache, key_len=torch.tensor([4]))
    a.causal = False  # a cache decodes causal attention only
    with pytest.raises(relpos.InputError, match="causal"):
        a(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache=cache)
    a.causal = True
    assert cache.length == 3  # refused calls append nothing
    out = a(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache=cache, positions=torch.tensor([3.0]))
    assert out.shape == (1, 4, 1, 8) and cache.length == 4
    # one cache per layer: another module's call on a cache holding this one's keys is refused;
    # after reset() any module may fill it
    other_layer = relpos.Attention("rope + alibi", 8, 4, 2)
    with pytest.raises(relpos.InputError, match="another relpos.Attention"):
        other_layer(q, k, v, cache=cache)
    assert cache.length == 4
    cache.reset()
    assert cache.length == 0 and cache.capacity >= 4
    other_layer(q, k, v, cache=cache)
    with pytest.raises(relpos.InputError, match="another relpos.Attention"):
        a(q, k, v, cache=cache)
    # a cache is saved and loaded without its owner (the first module to call takes it)
    loaded = pickle.loads(pickle.dumps(cache))
    assert loaded.length == cache.length
    a(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache=loaded)
    assert loaded.length == cache.length + 1
    with pytest.raises(relpos.InputError, match="dtype"):
        relpos.KVCache(1, 2, 8, dtype=torch.int64)
    with pytest.raises(relpos.InputError, match="batch"):
        relpos.KVCache(0, 2, 8)


LEARNED = [s for s in SPECS if any(b["shape"] == "lag_table" and not b["slopes"] for b in INFO[s]["biases"])]


@pytest.mark.parametrize("kv", [2, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("spec", LEARNED)
def test_learned_lag_tables_have_a_row_per_query_head(spec, kv):
    """A learned lag table has a row per query head, with grouped heads too: forward =
    softmax(q k^T / sqrt(D) + table[h, round(p_i - p_j)]) v with each key/value head repeated
    for its query group (the catalog's tables come without transforms), decoding equals the full
    forward, and the table's parameters get gradients."""
    D, H = DIMS[spec], 2
    assert not INFO[spec]["transforms"]
    torch.manual_seed(3)
    a = relpos.Attention(spec, D, H, kv).double()
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.2 * torch.randn_like(p))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, H, 7, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv, 7, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.tensor([0.0, 1, 2, 4, 7, 8, 12], dtype=torch.float64)
    out = a(q, k, v, positions=pos)
    lag = pos[:, None] - pos[None, :]
    table = a.encoding.lag_table(int(lag.max()) + 1)
    assert table.shape[0] == H
    bias = table[:, torch.round(lag).clamp_min(0).long()]  # [H, T, T]
    s = q @ k.repeat_interleave(H // kv, 1).transpose(-1, -2) / math.sqrt(D) + bias
    want = torch.softmax(s.masked_fill(lag < 0, float("-inf")), -1) @ v.repeat_interleave(H // kv, 1)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-11)
    out.square().sum().backward()
    lag_params = [p for n, p in a.named_parameters() if n.split(".")[-1] in a.encoding._lag_names]
    # the table's parameters are reached (a disabled sector's, e.g. PJ's light cone, is not)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lag_params)
    cache = relpos.KVCache(2, kv, D, dtype=torch.float64)
    with torch.no_grad():
        steps = [a(q[:, :, :3], k[:, :, :3], v[:, :, :3], positions=pos[:3], cache=cache)]
        steps += [a(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                    positions=pos[t : t + 1], cache=cache) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 2), out.detach(), rtol=0, atol=1e-12)


def test_same_values_compares_dtype_shape_and_every_byte():
    """relpos::same_values (the one-call step's check that its cached kernel parameters are still
    the module's): equal lists are equal, and any one difference of dtype, shape, length or a
    single element (a NaN included, strided views too) is found."""
    a = [torch.randn(3, 5, dtype=torch.float64), torch.zeros(0), torch.arange(7.0)]
    b = [t.clone() for t in a]
    assert torch.ops.relpos.same_values(a, b)
    assert torch.ops.relpos.same_values(a[:1] + [torch.zeros(0)] + a[2:], b)
    assert not torch.ops.relpos.same_values(a, b[:2])
    assert not torch.ops.relpos.same_values(a, [b[0].float()] + b[1:])
    assert not torch.ops.relpos.same_values(a, [b[0].reshape(5, 3)] + b[1:])
    for i in range(15):
        c = b[0].clone()
        x = c.view(-1)[i]
        c.view(-1)[i] = math.nan if i % 2 else torch.nextafter(x, x + 1)  # one unit in the last place
        assert not torch.ops.relpos.same_values(a, [c] + b[1:]), i
    big = torch.randn(4, 9)
    assert torch.ops.relpos.same_values([big[:, ::2]], [big[:, ::2].clone()])
    other = big.clone()
    other[3, 7] += 1
    assert torch.ops.relpos.same_values([big[:, ::2]], [other[:, ::2]])  # outside the view
    other[3, 6] += 1
    assert not torch.ops.relpos.same_values([big[:, ::2]], [other[:, ::2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_finiteness_check_finds_every_non_finite_value(dtype):
    """relpos::nonfinite (the modules' check_finite): every NaN, +Inf or -Inf is found wherever
    it sits, in the parallel chunks of a large tensor and in a strided view (the min/max path);
    large finite values are not flagged."""
    big = torch.full((3, 70_001), 0.5, dtype=dtype)  # more than one parallel chunk
    big[1, 5] = torch.finfo(dtype).max  # finite, the type's largest
    small = torch.randn(4, 5).to(dtype)
    assert torch.ops.relpos.nonfinite([small, big, big[:, ::3]]) == -1
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, 70_000, 123_456, big.numel() - 1):
            t = big.clone()
            t.view(-1)[where] = bad
            assert torch.ops.relpos.nonfinite([small, t]) == 1, (bad, where)
            assert torch.ops.relpos.nonfinite([t[:, ::3]]) == (0 if where % 70_001 % 3 == 0 else -1)
    # the module names the first bad tensor and appends nothing to its cache
    a = relpos.Attention("rope", 8, 2)
    q, k, v = (torch.randn(1, 2, 3, 8).to(dtype) for _ in range(3))
    cache = relpos.KVCache(1, 2, 8, dtype=dtype)
    v[0, 1, 2, 3] = math.nan
    with pytest.raises(relpos.InputError, match="v contains NaN or Inf"):
        a(q, k, v, cache=cache)
    assert cache.length == 0
