"""The GPU backend's transform operators (python/relpos/gpu/transform.py) against the CPU
operators: every mechanism of the catalogue whose encoding runs ``relpos::transform``, forward
and all six gradients of ``transform_backward``, both pair layouts, positions [T] and [B, T],
with and without the caller's trig table; float32 to 1e-5 (relative to the largest value),
float64 to 1e-11, bfloat16 / float16 storage to 1 ulp of the storage type (2e-2 relative: both
compute in float32 and round once, so outputs differ by at most one rounding); check_finite.
Under Triton's interpreter without a GPU, on the registered CUDA kernels with one."""

import pytest
import torch
from gpu_testing import catalog_specs, cpu_call, gpu_call

import relpos
from relpos.gpu import transform as gt

D, H = 48, 2  # 48: divisible by every catalogue order's block width (2, 4, 6, 8)

def _catalog_specs():
    """The catalogue (gpu_testing.catalog_specs) and higher orders, other regimes, compositions."""
    return catalog_specs() + [
        "jordan(m=3)", "damped_rope(m=1)", "orthogonal_mix(seed=3) + rope",
        "jordan(m=2) + pj_dynamic_ntk(L=16)", "jordan(m=2, regime=scaled)", "jordan(m=2, regime=raw)"]


def _position_specs():
    out = []
    for spec in _catalog_specs():
        enc = relpos.PositionEncoding(spec, D, H)
        if any(kind == "position" for kind, _ in enc._terms):
            out.append(spec)
    return out


SPECS = _position_specs()


def _rel_err(a, b):
    if b.numel() == 0:
        return 0.0
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def _args(spec, *, B=2, T=37, layout=0, per_batch=False, dtype=torch.float32, tables=False,
          seed=0, spread=3.0, param_dtype=None):
    """The exact arguments PositionEncoding passes to relpos::transform, with its parameters
    moved off their initial values (so that every gradient is non-trivial)."""
    g = torch.Generator().manual_seed(seed)
    enc = relpos.PositionEncoding(spec, D, H)
    kp = {k: v.detach().double() for k, v in enc.kernel_params().items()}
    if kp["gamma"].numel():
        kp["gamma"] = kp["gamma"] + 0.002 * torch.rand(kp["gamma"].shape, generator=g, dtype=torch.float64)
        kp["eta"] = kp["eta"] + 0.05 * torch.randn(kp["eta"].shape, generator=g, dtype=torch.float64)
        kp["alpha0"] = kp["alpha0"] + 0.1 * torch.rand(kp["alpha0"].shape, generator=g, dtype=torch.float64)
    if kp["gates"].numel():
        kp["gates"] = kp["gates"] + 0.3 * torch.randn(kp["gates"].shape, generator=g, dtype=torch.float64)
    pdt = param_dtype or (torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype)
    kp = {k: v.to(pdt) for k, v in kp.items()}
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, H, T, D, generator=g).to(dtype)
    if per_batch:
        pos = (torch.rand(B, T, generator=g, dtype=torch.float64) * spread * T - 7).round()
    else:
        pos = torch.arange(T, dtype=torch.float64) * spread - 5
    center = enc.center_for(pos)
    layout_code = int(layout)
    cos = sin = None
    if tables:
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        cos, sin = torch.ops.relpos.trig_table(pos, center, B if per_batch else 1, enc.spec, D,
                                               H, layout_code, cdt)
    return (q, k, kp["gamma"], kp["eta"], kp["gates"], kp["alpha0"], pos, cos, sin, center,
            enc.spec, D, H, layout_code)


def _compare(args, tol, mask=(True,) * 6, grad_tol=None):
    out = gpu_call("transform", *args, False)
    ref = cpu_call("transform", *args, False)
    for a, b, name in zip(out, ref, ("q", "k")):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _rel_err(a, b) <= tol, (args[10], name, _rel_err(a, b))
    g = torch.Generator().manual_seed(1)
    gq = torch.randn(args[0].shape, generator=g).to(args[0].dtype)
    gk = torch.randn(args[1].shape, generator=g).to(args[1].dtype)
    bargs = (gq, gk) + tuple(args) + (list(mask),)
    got = gpu_call("transform_backward", *bargs)
    want = cpu_call("transform_backward", *bargs)
    names = ("grad_q", "grad_k", "gamma", "eta", "gates", "alpha0")
    for a, b, name in zip(got, want, names):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert _rel_err(a, b) <= (grad_tol or tol), (args[10], name, _rel_err(a, b))
    return out, got


def test_every_catalogue_transform_is_built_from_the_json(monkeypatch):
    # the block structure is the position term's segments in the mechanism JSON; no mechanism of
    # the catalogue may take the host fallback
    assert len(SPECS) >= 20

    def no_fallback(name, *args):
        raise AssertionError(f"{name} took the host fallback")

    monkeypatch.setattr(gt, "_on_cpu", no_fallback)
    for spec in SPECS:
        enc = relpos.PositionEncoding(spec, D, H)
        st = gt._structure(enc.spec, D, H)  # raises Unsupported otherwise
        assert st.nb == gt._info(enc.spec, D, H)["total_blocks"] > 0, spec
        gpu_call("transform", *_args(spec, T=5), False)


@pytest.mark.parametrize("spec", SPECS)
def test_catalogue_float32(spec):
    # interleaved with shared positions and the caller's table; half-split with per-batch
    # positions and the op's own table
    _compare(_args(spec, layout=0, tables=True), 1e-5)
    _compare(_args(spec, layout=1, per_batch=True, seed=2), 1e-5)


@pytest.mark.parametrize("spec", ["rope", "jordan", "jetmixfull", "damped_rope", "partial_rope"])
def test_requested_gradients_only(spec):
    args = _args(spec, layout=1, T=20)
    for mask in ([True, False, False, False, False, False], [False, True, True, False, False, True],
                 [False, False, False, True, True, False]):
        _, got = _compare(args, 1e-5, mask=mask)
        for m, g in zip(mask, got):
            if not m:
                assert not g.any()


@pytest.mark.parametrize("spec", ["rope", "xpos", "jordan(m=2, regime=raw)", "damped_rope(m=1)",
                                  "jordan(m=2, max_exp=5)"])
def test_long_positions_and_the_exponent_clamp(spec):
    # positions to ~6000: gamma p passes max_exp (30, or the spec's) for the damped maps (no
    # gradient through a binding clamp), and the angles are large
    args = list(_args(spec, T=24, spread=250.0, layout=0))
    if args[2].numel():
        args[2] = args[2] + 0.01
    _compare(tuple(args), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ["rope", "jordan", "jetmixfull", "xpos", "partial_rope"])
def test_half_storage(spec, dtype):
    # one rounding to the storage type apart: 2^-7 relative for bfloat16, 2^-10 for float16;
    # the parameter gradients are float32 sums of products of the same stored values
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    _compare(_args(spec, dtype=dtype, layout=1, per_batch=True), tol, grad_tol=tol)


@pytest.mark.parametrize("spec", ["rope", "jordan", "jetmixfull", "direct_sum"])
def test_float64(spec):
    _compare(_args(spec, dtype=torch.float64, tables=True), 1e-11)
    _compare(_args(spec, dtype=torch.float64, layout=1, per_batch=True), 1e-11)


@pytest.mark.parametrize("spec", ["rope", "jordan", "partial_rope"])
def test_check_finite(spec):
    args = list(_args(spec, T=12))
    for which, name in ((0, "q"), (1, "k")):
        bad = list(args)
        bad[which] = bad[which].clone()
        bad[which][1, 0, 3, 5] = float("nan")
        for call in (gpu_call, cpu_call):
            with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
                call("transform", *bad, True)
        # without the check the NaN propagates exactly as on the CPU
        a = gpu_call("transform", *bad, False)[which].cpu()
        b = cpu_call("transform", *bad, False)[which]
        assert torch.equal(a.isnan(), b.isnan())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_float16_overflow_is_named():
    args = list(_args("damped_rope(m=1)", dtype=torch.float16, T=16, spread=200.0))
    args[2] = torch.full_like(args[2], 0.05)  # e^{0.05 p}: past 65504 within float32's range
    for call in (gpu_call, cpu_call):
        with pytest.raises(ValueError, match="overflows float16"):
            call("transform", *args, True)


@pytest.mark.parametrize("spec", ["rope", "jordan", "partial_rope", "rope + dynamic_ntk(original=16)",
                                  "xpos"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_trig_table(spec, dtype):
    enc = relpos.PositionEncoding(spec, D, H)
    for pos, rows in ((torch.arange(40, dtype=torch.float64) - 3, 1),
                      (torch.rand(3, 40, dtype=torch.float64) * 500, 3)):
        for layout in (0, 1):
            got = gpu_call("trig_table", pos, 7.0, rows, enc.spec, D, H, layout, dtype)
            want = cpu_call("trig_table", pos, 7.0, rows, enc.spec, D, H, layout, dtype)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert _rel_err(a, b) <= (1e-13 if dtype == torch.float64 else 1e-7)


def test_nonfinite_positions_are_refused():
    args = list(_args("rope", T=8))
    args[6] = args[6].clone()
    args[6][2] = float("inf")
    for call in (gpu_call, cpu_call):
        with pytest.raises(ValueError, match="NaN or Inf"):
            call("transform", *args, False)


def test_empty_and_identity():
    # T = 0, and a spec whose transform has no Jordan block (the op copies)
    args = list(_args("rope", T=0))
    out = gpu_call("transform", *args, False)
    assert out[0].shape == args[0].shape
    args = list(_args("orthogonal_mix", T=5))
    for a, b in zip(gpu_call("transform", *args, False), cpu_call("transform", *args, False)):
        assert _rel_err(a, b) == 0.0


def test_the_rotation_moves_values():
    # guards against a silently skipped kernel: the outputs differ from the inputs
    args = _args("partial_rope", T=16)
    qo, ko = gpu_call("transform", *args, False)
    assert _rel_err(qo, args[0]) > 1e-2 and _rel_err(ko, args[1]) > 1e-2


def test_host_fallback_matches(monkeypatch):
    # a structure the mechanism JSON cannot describe runs the CPU operator on host copies: same
    # values
    def refuse(*a):
        raise gt.Unsupported("test")
    monkeypatch.setattr(gt, "_structure", refuse)
    args = _args("jordan", T=9, layout=1)
    _compare(args, 0.0)
    got = gpu_call("trig_table", args[6], 0.0, 1, args[10], D, H, 1, torch.float32)
    want = cpu_call("trig_table", args[6], 0.0, 1, args[10], D, H, 1, torch.float32)
    assert all(_rel_err(a, b) == 0.0 for a, b in zip(got, want))


def test_larger_head_dim():
    # D = 128 (a model's usual head), T = 256: the block sizes of a real run's shapes
    for spec in ("rope", "jordan"):
        enc = relpos.PositionEncoding(spec, 128, 1)
        g = torch.Generator().manual_seed(3)
        q, k = (torch.randn(1, 1, 256, 128, generator=g) for _ in range(2))
        kp = {n: v.detach() for n, v in enc.kernel_params().items()}
        pos = torch.arange(256, dtype=torch.float64)
        args = (q, k, kp["gamma"], kp["eta"], kp["gates"], kp["alpha0"], pos, None, None,
                enc.center_for(pos), enc.spec, 128, 1, 0)
        _compare(args, 1e-5)
