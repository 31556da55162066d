"""Non-finite inputs on the GPU backend's fused attention: a NaN or Inf in q, k, v or the
output gradient reaches exactly the entries of out, lse, dq, dk and dv that the CPU operator's
reach (the rows that see it), and every other entry stays the CPU operator's value. Inside a
tile that some row sees, a key (or query) the masks hide from another row meets that row's zero
weight in a tile product, and 0 x NaN is NaN: the kernels screen such tiles."""

import math

import pytest
import torch
from gpu_testing import cpu_call, gpu_call
from test_gpu_attention import _bias, op_args, qkv

B, HQ, HK, T, D = 1, 2, 1, 80, 16

MASKS = {
    "causal": {},
    "window": {"window": 9.0},
    "noncausal_window": {"causal": False, "window": 9.0},
    "exclude_self": {"exclude_self": True},
    "key_len": {"key_len": torch.tensor([T - 7])},
    "key_start": {"key_start": torch.tensor([11])},
    "segments": {"q_segments": torch.tensor([[0] * 37 + [1] * (T - 37)]),
                 "k_segments": torch.tensor([[0] * 37 + [1] * (T - 37)])},
    "positions": {"q_positions": torch.arange(T, dtype=torch.float64) * 2,
                  "k_positions": torch.arange(T, dtype=torch.float64) * 2},
}


def _pattern_and_values(got, want, what, superset=False):
    """got's non-finite entries are want's (with superset, include them), and its finite
    entries are close to want's."""
    got, want = got.detach().cpu().double(), want.detach().double()
    fin = torch.isfinite(want)
    leaked = (torch.isfinite(got) & ~fin) if superset else (torch.isfinite(got) != fin)
    fin = fin & torch.isfinite(got)
    assert not leaked.any(), f"{what}: {int(leaked.sum())} entries differ in finiteness"
    if fin.any():
        err = float((got - want)[fin].abs().max())
        assert err <= 1e-5 * max(1.0, float(want[fin].abs().max())), f"{what}: error {err:.3g}"


def _forward_backward(call, args, dout):
    out, lse = call("fused_attention", *args)
    mask = [True] * 3 + [b is not None for b in list(args[3]) + [None] * (9 - len(args[3]))]
    grads = call("fused_attention_backward", dout, *args[:3], out, lse, *args[3:], mask, None)
    return [out, lse, *grads[:3]]


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("where", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_reaches_what_the_cpu_op_reaches(mask, where, bad):
    q, k, v = qkv(B, HQ, HK, T, T, D, seed=3)
    dout = torch.randn(B, HQ, T, D, generator=torch.Generator().manual_seed(4))
    t = {"q": q, "k": k, "v": v, "dout": dout}
    # early, middle and late rows / keys (several tiles); one entry each, one head
    for row in (5, 40, T - 2):
        t[where][0, 0, row, 3] = bad
    args = op_args(t["q"], t["k"], t["v"], _bias("slopes", T, T, Hq=HQ, B=B), **MASKS[mask])
    want = _forward_backward(cpu_call, args, t["dout"])
    got = _forward_backward(gpu_call, args, t["dout"])
    # An infinite query entry makes some scores of its row +inf and others -inf (its lse NaN):
    # which of that row's seen keys then get finite dk, dv depends on the CPU kernel's tiles (in
    # a tile with masked pairs it gives a -inf score P = 0); the GPU's are non-finite for all.
    superset = where == "q" and math.isinf(bad)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        _pattern_and_values(a, b, f"{where}={bad} {mask}: {name}", superset and name in ("dk", "dv"))


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nonfinite_with_a_path_integral(where):
    """The path integral's fused backward (dk and dv added from the query walk)."""
    q, k, v = qkv(B, HQ, HK, T, T, D, seed=5)
    t = {"q": q, "k": k, "v": v}
    t[where][0, 0, 30, 2] = math.nan
    args = op_args(t["q"], t["k"], t["v"], _bias("path", T, T, Hq=HQ, B=B), window=13.0)
    dout = torch.randn(B, HQ, T, D, generator=torch.Generator().manual_seed(6))
    want = _forward_backward(cpu_call, args, dout)
    got = _forward_backward(gpu_call, args, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        _pattern_and_values(a, b, f"path {where}: {name}")


def test_nonfinite_value_in_decode():
    """Few queries, keys split across programs, a window hiding a NaN value from some of them."""
    q, k, v = qkv(2, 4, 2, 3, 200, 32, seed=7)
    v[1, 0, 150, 5] = math.nan  # hidden from every query by the window
    v[0, 1, 197, 0] = math.inf  # seen by the last two queries of batch 0's second group only
    pos = torch.arange(200, dtype=torch.float64)
    args = op_args(q, k, v, (), q_positions=pos[-3:], k_positions=pos, window=2.0)
    want = cpu_call("fused_attention", *args)
    got = gpu_call("fused_attention", *args)
    for name, a, b in zip(("out", "lse"), got, want):
        _pattern_and_values(a, b, f"decode: {name}")
    assert not torch.isfinite(want[0][0, 2:4, 1:]).all()  # the Inf is seen
