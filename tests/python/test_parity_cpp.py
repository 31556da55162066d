"""relpos.Attention (Python) and relpos::nn::Attention (C++) give the same outputs and parameter
names for every mechanism of the catalog, created from the same seed, without a cache and
decoding through their caches in chunks (the C++ module is run by the `cpp_attention_module`
op). No per-mechanism code: each spec runs with grouped heads where the module takes them."""

import pytest
import torch

import relpos

MODEL_DIM = 12
SPECS = [m["name"] if m["kind"] != "scaling" else f"rope + {m['name']}" for m in relpos.mechanisms()]
# compositions of the layer-computed terms with transforms and slopes
COMPOSED = ["rope + fox", "alibi + grape_a(gate=k)", "grape_m(context=true) + fox",
            "grape_m(basis=cayley) + grape_ap(form=paper)", "journey(angles=token)",
            "journey(angles=token, values=false) + alibi"]


def call_positions(spec, d, B, T):
    """Vector positions [B, T, dc] for a rotation by vector positions (read from the JSON), else
    None (the default 0..T-1)."""
    dims = [t["vector_dims"] for t in relpos.mechanism(spec, d, 2)["transforms"]
            if t["time"] == "vector_position"]
    g = torch.Generator().manual_seed(3)
    return 3 * torch.randn(B, T, dims[0], generator=g, dtype=torch.float64) if dims else None


def shape_for(spec):
    """(head_dim, query heads, key/value heads, layout) the module takes for the spec, trying
    grouped heads and the interleaved layout first; None when Attention refuses it."""
    for hq, hk in ((4, 2), (2, 2)):
        for layout in ("interleaved", "half_split"):
            for d in range(8, 49, 2):
                try:
                    a = relpos.Attention(spec, d, hq, hk, pair_layout=layout, model_dim=MODEL_DIM)
                    a(*(torch.zeros(1, h, 2, d) for h in (hq, hk, hk)), inputs=torch.zeros(1, 2, MODEL_DIM),
                      positions=call_positions(spec, d, 1, 2))
                    return d, hq, hk, layout
                except relpos.InputError:
                    continue
    return None


SHAPES = {s: shape_for(s) for s in SPECS + COMPOSED}
RUN = [s for s in SPECS + COMPOSED if SHAPES[s] is not None]


pytestmark = pytest.mark.usefixtures("one_thread")


def test_most_of_the_catalog_runs():
    refused = [s for s in SPECS if SHAPES[s] is None]
    assert not refused, refused
    assert all(SHAPES[s] is not None for s in COMPOSED)


@pytest.mark.parametrize("spec", RUN)
def test_python_and_cpp_modules_agree(spec):
    D, HQ, HK, layout = SHAPES[spec]
    g = torch.Generator().manual_seed(11)
    B, T = 2, 6
    q = torch.randn(B, HQ, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, HK, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    x = torch.randn(B, T, MODEL_DIM, generator=g, dtype=torch.float64)
    r = call_positions(spec, D, B, T)
    torch.manual_seed(7)
    py = relpos.Attention(spec, D, HQ, HK, pair_layout=layout, model_dim=MODEL_DIM).double()
    lay = 1 if layout == "half_split" else 0
    out, names, values = torch.ops.relpos.cpp_attention_module(spec, D, HQ, HK, lay, MODEL_DIM, 7,
                                                               q, k, v, x, [], r)
    cpp_params = dict(zip(names.split(",") if names else [], values))
    assert sorted(cpp_params) == sorted(n for n, _ in py.named_parameters())
    for n, p in py.named_parameters():  # the same initial values, bit for bit
        assert torch.equal(p.detach(), cpp_params[n]), n
    torch.testing.assert_close(py(q, k, v, inputs=x, positions=r), out, rtol=0, atol=1e-12)
    if py._cache_refusal is None:
        cache = relpos.KVCache(B, HK, D, dtype=torch.float64)
        with torch.no_grad():
            outs = [py(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], inputs=x[:, a:b],
                       positions=None if r is None else r[:, a:b], cache=cache)
                    for a, b in ((0, 3), (3, 4), (4, 6))]
        cpp = torch.ops.relpos.cpp_attention_module(spec, D, HQ, HK, lay, MODEL_DIM, 7, q, k, v, x,
                                                    [3, 1, 2], r)[0]
        torch.testing.assert_close(torch.cat(outs, 2), cpp, rtol=0, atol=1e-12)
