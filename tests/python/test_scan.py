"""torch.ops.relpos.causal_scan: the causal phase scan (JoFormer per-token angles, GRAPE-M
contextual phase) against torch.cumsum in float64, gradcheck, torch.compile, named errors."""

import pytest
import torch

import relpos  # noqa: F401  (loads the operator library)


def composed(a, mode):
    c = torch.cumsum(a, -2)
    return c - a if mode == "exclusive" else torch.flip(c, [-2])


@pytest.mark.parametrize("mode", ["exclusive", "reversed_inclusive"])
def test_matches_cumsum_and_gradcheck(mode):
    a = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    out = torch.ops.relpos.causal_scan(a, mode)
    assert torch.allclose(out, composed(a, mode), atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: torch.ops.relpos.causal_scan(x, mode), (a,))


def test_compiles_fullgraph():
    a = torch.randn(2, 16, 4, requires_grad=True)
    f = torch.compile(lambda x: torch.ops.relpos.causal_scan(x).sin().sum(), fullgraph=True,
                      backend="aot_eager")
    f(a).backward()
    g = a.grad.clone()
    a.grad = None
    torch.ops.relpos.causal_scan(a).sin().sum().backward()
    assert torch.allclose(g, a.grad, atol=1e-6)


def test_named_errors():
    with pytest.raises(ValueError, match="mode"):
        torch.ops.relpos.causal_scan(torch.randn(2, 3), "inclusive")
    with pytest.raises(ValueError, match="float32, float64, bfloat16 or float16"):
        torch.ops.relpos.causal_scan(torch.ones(2, 3, dtype=torch.long))
