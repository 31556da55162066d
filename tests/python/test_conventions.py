"""Conventions shared with the ecosystem, decided from the catalog: every rotary family with a
rotation-sense option, at zero damping and shear and order 1, scores exactly as rope (its default
sense is rope's), and with direction=paper as rope at negated positions."""

import pytest
import torch

import relpos

D, H, T = 16, 2, 12


def options(m):
    return {o["key"]: o for o in m["options"]}


# the catalog's families with a rotation-sense option
DIRECTED = [m for m in relpos.mechanisms() if "direction" in options(m)]


def spec_at_zero(m, direction):
    """The family at order 1 (where it has an order), no damping (zero_gamma or gamma0 = 0) and
    no shear (eta0 = 0, no gates), in the given sense; the default frequency grid."""
    o = options(m)
    parts = [f"direction={direction}"]
    if "m" in o:
        parts.append("m=1")
    if "zero_gamma" in o:
        parts.append("zero_gamma=true")
    if "eta0" in o:
        parts.append("eta0=0")
    return f"{m['name']}({', '.join(parts)})"


def logits(spec, q, k, pos):
    enc = relpos.PositionEncoding(spec, D, H, check_finite=False).double()
    qt, kt = enc(q, k, pos)
    return qt @ kt.transpose(-1, -2)


def test_the_catalog_has_directed_families():
    names = {m["name"] for m in DIRECTED}
    assert {"damped_rope", "jordan"} <= names, names


@pytest.mark.parametrize("m", DIRECTED, ids=lambda m: m["name"])
def test_zero_damping_and_shear_is_rope_exactly(m):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(T, dtype=torch.float64) * 3 + 5
    try:
        got = logits(spec_at_zero(m, "rope"), q, k, pos)
    except relpos.InputError as e:
        pytest.skip(f"{m['name']} has no order-1, undamped, unsheared form: {e}")
    rope = logits("rope", q, k, pos)
    torch.testing.assert_close(got, rope, rtol=0, atol=1e-12)
    # the papers' sense: rope at negated positions
    paper = logits(spec_at_zero(m, "paper"), q, k, pos)
    torch.testing.assert_close(paper, logits("rope", q, k, -pos), rtol=0, atol=1e-12)
    assert (paper - rope).abs().max() > 1e-3  # the two senses differ


def test_reference_names_keep_the_reference_sense():
    for alias in ("jordan_rope", "jordan_raw_tau", "jordan_exact_c010", "jordan_m3"):
        assert "direction=paper" in relpos.mechanism(alias, 24, 2)["spec"]
