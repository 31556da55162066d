"""The relpos Python package: ops under autograd (gradcheck), equality with plain PyTorch RoPE in
both pair conventions, torch.compile(fullgraph=True), state dicts, and named errors."""

import io
import math

import pytest
import torch

import relpos
from module_checks import head_dim_for

# context-extension rules (kind "scaling") modify a rotary term: tested with one below
# (rotations by vector positions are refused by the encoding: relpos.Attention runs them,
# test_vector_positions.py)
def vector_positions(name):
    for d in range(8, 97, 2):
        try:
            return any(t["time"] == "vector_position" for t in relpos.mechanism(name, d, 2)["transforms"])
        except relpos.InputError:
            continue
    return False


SPECS = [m["name"] for m in relpos.mechanisms() if m["kind"] != "scaling" and not vector_positions(m["name"])]


def jitter(enc, scale=0.2):
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(scale * torch.randn_like(p))


@pytest.mark.parametrize("spec", SPECS)
def test_gradcheck_every_mechanism(spec):
    """float64 gradients of the op (q, k and the kernel parameters) and of the module's raw
    parameters against finite differences."""
    D = head_dim_for(spec, 2)
    enc = relpos.PositionEncoding(spec, D, 2).double()
    jitter(enc)
    q = torch.randn(1, 2, 5, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 5, D, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([0.0, 1.0, 4.5, 30.0, 31.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: enc(a, b, pos), (q, k), atol=1e-6, rtol=1e-5)
    params = dict(enc.named_parameters())
    if not params:
        return
    names = list(params)

    def f(*vals):
        out = torch.func.functional_call(enc, dict(zip(names, vals)), (q.detach(), k.detach(), pos))
        return out

    vals = tuple(p.detach().clone().requires_grad_(True) for p in params.values())
    assert torch.autograd.gradcheck(f, vals, atol=1e-6, rtol=1e-5)


def rope_reference(x, pos, theta=10000.0, half_split=False):
    """RoPE written the usual way: interleaved pairs, or Llama/NeoX rotate_half."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    if half_split:
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


@pytest.mark.parametrize("layout", ["interleaved", "half_split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_equals_plain_pytorch(layout, dtype):
    enc = relpos.PositionEncoding("rope", 64, 4, pair_layout=layout)
    q, k = torch.randn(2, 4, 33, 64, dtype=dtype), torch.randn(2, 4, 33, 64, dtype=dtype)
    pos = torch.arange(33, dtype=torch.float64) * 3.0 + 100.0
    qo, ko = enc(q, k, pos)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    hs = layout == "half_split"
    torch.testing.assert_close(qo, rope_reference(q, pos, half_split=hs), atol=tol, rtol=tol)
    torch.testing.assert_close(ko, rope_reference(k, pos, half_split=hs), atol=tol, rtol=tol)


def test_bthd_layout_equals_bhtd():
    a = relpos.PositionEncoding("jordan(m=2, regime=raw, eta0=0.05)", 32, 4)
    b = relpos.PositionEncoding("jordan(m=2, regime=raw, eta0=0.05)", 32, 4, tensor_layout="BTHD")
    q, k = torch.randn(2, 4, 9, 32), torch.randn(2, 4, 9, 32)
    qa, ka = a(q, k)
    qb, kb = b(q.transpose(1, 2), k.transpose(1, 2))
    torch.testing.assert_close(qa, qb.transpose(1, 2))
    torch.testing.assert_close(ka, kb.transpose(1, 2))


class Block(torch.nn.Module):
    """A small causal attention block with a relpos encoding."""

    def __init__(self, spec, d=64, heads=4):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.out = torch.nn.Linear(d, d, bias=False)
        self.enc = relpos.PositionEncoding(spec, self.hd, heads)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        q, k = self.enc(q, k)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize(
    "spec,backend",
    [
        ("rope", "aot_eager"),
        ("jordan(m=2, regime=scaled, c=1, eta0=0.05)", "aot_eager"),
        ("orthogonal_mix(seed=1) + jordan(m=2, regime=raw, eta0=0.05)", "inductor"),
    ],
)
def test_torch_compile_fullgraph_matches_eager(spec, backend):
    """fullgraph=True: the ops' fake kernels let dynamo and AOTAutograd trace the block with no
    graph break; inductor generates C++ for the surrounding ops around our kernels."""
    torch._dynamo.reset()
    block = Block(spec)
    x = torch.randn(2, 24, 64)
    eager = block(x)
    eager.sum().backward()
    g_eager = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_eager, [p.grad for p in block.parameters()]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_state_dict_round_trip():
    a = relpos.PositionEncoding("jetmixfull(m=4, alpha=1/0.5/0.3/0.2)", 32, 2)
    jitter(a)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = relpos.PositionEncoding("jetmixfull(m=4, alpha=1/0.5/0.3/0.2)", 32, 2)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    q, k = torch.randn(1, 2, 7, 32), torch.randn(1, 2, 7, 32)
    for x, y in zip(a(q, k), b(q, k)):
        torch.testing.assert_close(x, y)
    assert set(a.state_dict()) == set(b.state_dict())
    assert "raw_gamma" in dict(a.named_parameters())


@pytest.mark.parametrize("spec,learned", [
    ("jordan(m=2)", {"raw_gamma", "raw_eta"}),
    ("jordan(m=1)", {"raw_gamma"}),  # order-1 blocks have no nilpotent part: eta is unread
    ("jordan(m=2, learn_eta=false)", {"raw_gamma"}),
    ("damped_rope(learn_gamma=false)", set()),
])
def test_the_parameters_are_what_the_maps_read(spec, learned):
    """A schema tensor is a parameter where some block learns it and reads it, else a buffer under
    the same name (no parameter gets a gradient that is always zero, or none: DDP waits for it)."""
    enc = relpos.PositionEncoding(spec, 8, 2)
    assert {n for n, _ in enc.named_parameters()} == learned
    assert {"raw_gamma", "raw_eta"} <= set(enc.state_dict())
    q, k = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(2))
    sum(t.square().sum() for t in enc(q, k, torch.arange(5.0, dtype=torch.float64) * 3)).backward()
    for n, p in enc.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, n


def test_composed_spec_is_shift_invariant():
    enc = relpos.PositionEncoding("orthogonal_mix(seed=2) + rope", 16, 2).double()
    q, k = torch.randn(1, 2, 6, 16, dtype=torch.float64), torch.randn(1, 2, 6, 16, dtype=torch.float64)
    p = torch.tensor([0.0, 1, 3, 8, 20, 21], dtype=torch.float64)
    qa, ka = enc(q, k, p)
    qb, kb = enc(q, k, p + 1000)
    torch.testing.assert_close(qa @ ka.transpose(-1, -2), qb @ kb.transpose(-1, -2), atol=1e-11, rtol=0)


def test_bad_input_raises_named_errors():
    with pytest.raises(relpos.InputError, match="unknown mechanism 'bogus'"):
        relpos.PositionEncoding("bogus", 64, 4)
    with pytest.raises(relpos.InputError, match="divisible by 6"):
        relpos.PositionEncoding("jordan(m=3)", 64, 4)
    with pytest.raises(relpos.InputError, match="unknown token 'c05O'"):
        relpos.PositionEncoding("jordan_exact_m3_c05O", 48, 4)
    enc = relpos.PositionEncoding("rope", 16, 2)
    x = torch.randn(1, 2, 4, 16)
    with pytest.raises(relpos.InputError, match="head dim"):
        enc(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(relpos.InputError, match="NaN"):
        enc(x * math.nan, x)
    with pytest.raises(relpos.InputError, match="positions"):
        enc(x, x, torch.arange(3))
    with pytest.raises(relpos.InputError, match="float32"):
        enc(x, x.double())
    assert issubclass(relpos.InputError, ValueError)


def test_mechanisms_and_verify():
    names = {m["name"] for m in relpos.mechanisms()}
    assert {"rope", "jordan", "alibi", "orthogonal_mix"} <= names
    rows = relpos.verify("jordan(m=2, regime=raw)", max_lag=4096, positions=16, dtype="f64")
    assert [r["status"] for r in rows] == ["PASS", "PASS"]
    with pytest.raises(relpos.InputError):
        relpos.verify("jordan(L=0)")


def test_trig_cache_follows_position_changes():
    enc = relpos.PositionEncoding("rope", 16, 2).double()
    q = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    pos = torch.arange(5, dtype=torch.float64)
    first = enc(q, q, pos)[0]
    pos.add_(10.0)  # in place: the version counter moves, the cache must not be used
    moved = enc(q, q, pos)[0]
    fresh = relpos.PositionEncoding("rope", 16, 2).double()(q, q, pos.clone())[0]
    torch.testing.assert_close(moved, fresh)
    assert not torch.allclose(first, moved)
    torch.testing.assert_close(enc(q, q)[0], enc(q, q, torch.arange(5, dtype=torch.float64))[0])


@pytest.mark.parametrize("spec", SPECS)
def test_frozen_and_no_grad_calls_follow_parameter_writes(spec):
    """A call with nothing to train keeps the kernels' parameters while the schema's values stay:
    writes through .data (as EMA swaps do, no version bump) must reach the next call, frozen or
    under no_grad, and every such call equals the trainable module's."""
    D = head_dim_for(spec, 2)
    enc = relpos.PositionEncoding(spec, D, 2).double()
    q = torch.randn(1, 2, 6, D, dtype=torch.float64)
    k = torch.randn(1, 2, 6, D, dtype=torch.float64)
    pos = torch.tensor([0.0, 1.0, 2.0, 4.5, 9.0, 10.0], dtype=torch.float64)
    for step in range(3):
        trained = enc(q, k, pos)
        with torch.no_grad():
            inferred = enc(q, k, pos)
        enc.requires_grad_(False)
        frozen = enc(q, k, pos)
        enc.requires_grad_(True)
        for got in (inferred, frozen):
            for a, b in zip(got, trained):
                torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
        for t in [*enc.parameters(), *enc.buffers()]:  # a swap of values, no version bump
            if t.is_floating_point() and t.numel():
                t.data.add_(0.05 * (step + 1) * torch.randn_like(t))


@pytest.mark.parametrize("spec", SPECS)
def test_decode_steps_equal_the_cached_table_path(spec, monkeypatch):
    """A call with few positions (a decode step) leaves its cos/sin rows to the op; outputs and
    gradients must be the bits the module's cached table gives, for 1-D, per-batch and default
    positions, in float32, float64 and bfloat16, in both pair layouts."""
    import relpos.encoding as encoding

    D = head_dim_for(spec, 2)
    torch.manual_seed(0)
    for layout in ("interleaved", "half_split"):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            enc = relpos.PositionEncoding(spec, D, 2, pair_layout=layout)
            if dtype == torch.float64:
                enc = enc.double()
            for pos in (torch.tensor([5.0, 9.0], dtype=torch.float64),
                        torch.tensor([[5.0, 9.0], [1.0, 3.0], [7.0, 8.0]], dtype=torch.float64),
                        None):
                q = torch.randn(3, 2, 2, D).to(dtype).requires_grad_()
                k = torch.randn(3, 2, 2, D).to(dtype).requires_grad_()
                runs = []
                for rows in (encoding._OP_BUILT_TRIG_ROWS, 0):  # the op's rows, then the cache's
                    monkeypatch.setattr(encoding, "_OP_BUILT_TRIG_ROWS", rows)
                    enc._trig_cache = None
                    a, b = enc(q, k, pos)
                    (a.float().sum() + 2 * b.float().sum()).backward()
                    runs.append((a.detach(), b.detach(), q.grad, k.grad))
                    q.grad = k.grad = None
                for x, y in zip(*runs):
                    assert torch.equal(x, y), (layout, dtype, pos)


def test_rope_scaling_dict_equals_rope_at_the_yarn_frequencies():
    # HF _compute_yarn_parameters for dim 8, base 1e4, factor 4, original 16 (float64)
    D, base, s, L0 = 8, 10000.0, 4.0, 16
    cfg = {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L0}
    assert relpos.rope_scaling_spec(cfg).startswith("yarn(factor=4, original=16,")
    assert relpos.rope_scaling_spec(None) == ""

    def corr(rot):
        return D * math.log(L0 / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), D - 1)
    hi = hi + 0.001 if lo == hi else hi
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ramp = ((torch.arange(D // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    inv = inv / s * ramp + inv * (1 - ramp)
    af = 0.1 * math.log(s) + 1
    enc = relpos.PositionEncoding("rope", D, 2, rope_scaling=cfg).double()
    assert enc.spec.startswith("rope(theta=10000) + yarn(")
    q, k = torch.randn(1, 2, 24, D, dtype=torch.float64), torch.randn(1, 2, 24, D, dtype=torch.float64)
    pos = torch.arange(24, dtype=torch.float64)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()

    def rot(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2) * af

    qo, ko = enc(q, k)
    torch.testing.assert_close(qo, rot(q), rtol=0, atol=1e-12)
    torch.testing.assert_close(ko, rot(k), rtol=0, atol=1e-12)
    with pytest.raises(relpos.InputError, match="betafast"):
        relpos.rope_scaling_spec({"rope_type": "yarn", "factor": 4, "betafast": 3})
    with pytest.raises(relpos.InputError, match="no rotary term"):
        relpos.PositionEncoding("nope", D, 2, rope_scaling=cfg)


def test_alone_benchmark_runs():
    """bench/bench_alone.py at a toy size: every process checks its variant against eager RoPE,
    then one row per (heap, variant) and one ratio row per heap; a bad shape is the parser's
    error."""
    from bench_runs import bench_rows

    rows = bench_rows("bench_alone.py",
                      ["--shape", "1,2,8,8", "--runs", "1", "--calls", "2", "--threads", "1"],
                      r"\| (glibc default|no trim, no mmap) \|", ["--shape", "1,2,8"], "--shape")
    assert len(rows) == 6, rows
    assert sum("| relpos |" in r for r in rows) == 2 and sum("| compiled |" in r for r in rows) == 2


@pytest.mark.parametrize("moving", [False, True])
def test_call_overhead_benchmark_runs(moving):
    """bench/bench_call_overhead.py at a toy size, with fixed and with moving positions: it runs,
    says which, and prints its warm and cold rows."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_call_overhead.py"
    args = [sys.executable, str(script), "--shape", "1,2,3,8", "--rounds", "3", "--threads", "1"]
    r = subprocess.run(args + (["--moving"] if moving else []), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert ("positions moving" if moving else "positions fixed") in r.stdout
    assert sum(line.startswith(("| warm |", "| cold |")) for line in r.stdout.splitlines()) == 2
