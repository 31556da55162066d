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


def test_rope_dictionaries_as_hf_writes_them():
    spec = relpos.rope_parameters_spec
    assert spec("rope", {"rope_type": "default", "rope_theta": 5e5}) == "rope(theta=500000)"
    assert spec("rope", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}) \
        == "partial_rope(fraction=0.25, theta=10000)"
    assert spec("rope", {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                         "factor": 2.0}).startswith("partial_rope(fraction=0.5, grid=head, theta=10000) + linear(")
    # YaRN without factor: max_position_embeddings / original (HF)
    assert "factor=4," in spec("rope", {"rope_type": "yarn", "rope_theta": 1e4,
                                         "original_max_position_embeddings": 1024}, 4096)
    assert spec("rope", None) == "rope"
    with pytest.raises(relpos.InputError, match="disagrees"):
        spec("rope(theta=10000)", {"rope_type": "default", "rope_theta": 5e5})
    with pytest.raises(relpos.InputError, match="applies to rope"):
        spec("jordan(m=2)", {"rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(relpos.InputError, match="not read"):
        spec("rope", {"rope_type": "linear", "factor": 2.0, "beta_fast": 3})
    with pytest.raises(relpos.InputError, match="rotary term"):
        spec("alibi", {"rope_type": "default", "rope_theta": 5e5})


def test_frequencies_and_attention_factor_are_public():
    f = relpos.frequencies("rope(theta=10000)", 8)
    torch.testing.assert_close(f, 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    half = relpos.frequencies("rope + linear(factor=2)", 8)
    torch.testing.assert_close(half, f / 2)
    assert relpos.attention_factor("rope", 8, 100.0) == 1.0
    assert relpos.attention_factor("rope + yarn(factor=4, original=64)", 8, 256.0) > 1.0
    with pytest.raises(relpos.InputError, match="no rotary term"):
        relpos.frequencies("alibi", 8)


def test_attention_takes_bthd_like_the_encoding():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 16, generator=g, dtype=torch.float64) for _ in range(2))
    want = relpos.attention(q, k, v, "rope + alibi")
    got = relpos.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "rope + alibi",
                           tensor_layout="BTHD")
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-13)
    with pytest.raises(relpos.InputError, match="tensor layout"):
        relpos.attention(q, k, v, "rope", tensor_layout="THBD")
