"""Issue 23, the Python front door: the trig-table cache follows the positions' values, the
documented warnings reach Python, RoPE stays a rotation at huge positions (or refuses them by
name), journey attention refuses inputs it cannot honour, and bad arguments raise
relpos.InputError (never TypeError, ValueError or RuntimeError from inside)."""

import math
import warnings

import pytest
import torch

import relpos

F64 = torch.float64


def fresh_call(spec, D, H, q, k, positions):
    return relpos.PositionEncoding(spec, D, H).to(q.dtype)(q, k, positions)


# ---- item 8: the cache is keyed on values ------------------------------------------------------


def test_trig_cache_sees_numpy_writes():
    np = pytest.importorskip("numpy")
    enc = relpos.PositionEncoding("rope", 8, 1).double()
    x = torch.randn(1, 1, 8, 8, dtype=F64)
    a = np.arange(8.0)
    p = torch.from_numpy(a)
    enc(x, x, p)
    a += 100  # NumPy's write does not bump the tensor's version counter
    got = enc(x, x, p)
    want = fresh_call("rope", 8, 1, x, x, torch.arange(8, dtype=F64) + 100)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_trig_cache_sees_writes_through_data():
    enc = relpos.PositionEncoding("jordan(m=2, regime=raw, eta0=0.05)", 8, 1).double()
    x = torch.randn(2, 1, 6, 8, dtype=F64)
    p = torch.arange(6, dtype=F64).repeat(2, 1)
    enc(x, x, p)
    p.data.add_(3.5)
    got = enc(x, x, p)
    want = fresh_call("jordan(m=2, regime=raw, eta0=0.05)", 8, 1, x, x, p.clone())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- item 9: the documented warnings reach Python ---------------------------------------------


def test_binding_clamp_warns_instead_of_breaking_the_law_silently():
    spec = "jordan(m=2, regime=scaled, c=1)"
    x = torch.randn(1, 1, 8, 8)
    far = torch.arange(8) + 1e5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="exponent clamp"):
            relpos.PositionEncoding(spec, 8, 1)(x, x, far)
    # once per module, as the C++ module
    enc = relpos.PositionEncoding(spec, 8, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        enc(x, x, far)
        enc(x, x, far)
    assert [str(w.message).count("exponent clamp") for w in seen] == [1]


def test_clamp_check_follows_the_damping_it_reads():
    """Zero damping cannot bind the clamp (the check is skipped while gamma's tensors keep their
    versions); once the damping changes in place, the next call checks it again and warns."""
    enc = relpos.PositionEncoding("damped_rope(gamma0=0, gamma_min=0, learn_gamma=false, center=0)",
                                  8, 1)
    x = torch.randn(1, 1, 8, 8)
    far = torch.arange(8, dtype=F64) * 1e3  # a span the clamp binds on with damping 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc(x, x, far)
        enc(x, x, far)
    with torch.no_grad():  # its fixed damping (a buffer) changed in place, e.g. by a loader
        enc.gamma_fixed.fill_(2.0)
    assert float(enc.kernel_params()["gamma"].min()) == 2.0
    with pytest.warns(UserWarning, match="exponent clamp"):
        enc(x, x, far)


def test_float32_resolution_and_moving_mid_centre_warn():
    x = torch.randn(1, 1, 4, 8)
    rope = relpos.PositionEncoding("rope", 8, 1)
    with pytest.warns(UserWarning, match="resolves only steps"):
        rope(x, x, torch.tensor([1e7, 1e7 + 0.25, 1e7 + 0.5, 1e7 + 0.75], dtype=torch.float32))
    mid = relpos.PositionEncoding("damped_rope(center=mid)", 8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mid(x, x)  # the first call has nothing to move from
    with pytest.warns(UserWarning, match="center=mid moved"):
        mid(x[:, :, :1], x[:, :, :1], torch.tensor([8.0]))


# ---- item 10: huge positions -----------------------------------------------------------------


@pytest.mark.parametrize(
    "positions",
    [
        torch.arange(6, dtype=F64) + 1e15,
        torch.arange(2**53 - 5, 2**53 + 1),  # int64 up to 2^53 exactly
        torch.arange(6, dtype=F64) * 1e9 + (2.0**53 - 5e9),
    ],
)
def test_rope_stays_a_rotation_and_relative_at_huge_positions(positions):
    D = 64
    enc = relpos.PositionEncoding("rope", D, 2).double()
    q = torch.randn(1, 2, 6, D, dtype=F64)
    k = torch.randn(1, 2, 6, D, dtype=F64)
    qt, kt = enc(q, k, positions)
    assert ((qt.norm(dim=-1) / q.norm(dim=-1)) - 1).abs().max() < 1e-12
    assert ((kt.norm(dim=-1) / k.norm(dim=-1)) - 1).abs().max() < 1e-12
    # the scores are those at the same lags near 0
    lags = (positions - positions[0]).to(F64)
    q0, k0 = enc(q, k, lags)
    s, s0 = qt @ kt.transpose(-1, -2), q0 @ k0.transpose(-1, -2)
    assert (s - s0).abs().max() < 1e-9 * s0.abs().max()


@pytest.mark.parametrize(
    "positions",
    [torch.tensor([0, 2**53 + 1]), torch.tensor([-(2**53) - 1, 0]), torch.tensor([0.0, 1e20], dtype=F64),
     torch.tensor([0.0, -3.8e55], dtype=F64)],
)
def test_positions_beyond_2_to_53_are_refused_by_name(positions):
    enc = relpos.PositionEncoding("rope", 8, 1).double()
    x = torch.randn(1, 1, 2, 8, dtype=F64)
    with pytest.raises(relpos.InputError, match=r"2\^53"):
        enc(x, x, positions)


# ---- item 12: journey attention refuses what it cannot honour ------------------------------------


def test_journey_increments_of_the_wrong_width_are_refused():
    q = torch.randn(1, 2, 5, 16)
    for width in (3, 9):
        with pytest.raises(relpos.InputError, match=r"increments must be \[B, T, 8\]"):
            relpos.journey_attention(q, q, q, "journey(angles=token)",
                                     increments=torch.randn(1, 5, width))
    # fixed frames take no increments: passing some is not silently ignored
    with pytest.raises(relpos.InputError, match="fixed frames"):
        relpos.journey_attention(q, q, q, "journey", increments=torch.randn(1, 5, 8))


def test_journey_refuses_positions_it_cannot_honour():
    q = torch.randn(1, 2, 5, 16)
    p = torch.arange(5, dtype=F64) * 2
    for kw in ({"q_positions": p}, {"k_positions": p}, {"q_positions": p, "k_positions": p}):
        with pytest.raises(relpos.InputError, match="cannot honour"):
            relpos.journey_attention(q, q, q, "journey", **kw)
    with pytest.raises(relpos.InputError, match="unknown keyword"):
        relpos.journey_attention(q, q, q, "journey", windwo=3.0)
    # what it does honour still works
    out = relpos.journey_attention(q, q, q, "journey", window=3.0)
    assert out.shape == q.shape


# ---- item 17: every bad argument is an InputError ---------------------------------------------


def test_journey_attention_without_a_journey_term():
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(relpos.InputError, match="no journey term"):
        relpos.journey_attention(x, x, x, "rope")


@pytest.mark.parametrize("layout", ["BHTD", "BTHD"])
@pytest.mark.parametrize("shape", [(1, 4, 8), (4, 8), (8,)])
def test_wrong_rank_q_is_an_input_error(layout, shape):
    enc = relpos.PositionEncoding("rope", 8, 1, tensor_layout=layout)
    x = torch.randn(*shape)
    with pytest.raises(relpos.InputError, match="must be"):
        enc(x, x)
    with pytest.raises(relpos.InputError, match="must be"):
        relpos.journey_attention(x, x, x, "journey")


@pytest.mark.parametrize(
    "spec, head_dim, heads, match",
    [
        (None, 8, 1, "spec must be a string"),
        (b"rope", 8, 1, "spec must be a string"),
        ("rope\ud800", 8, 1, "not valid text"),
        ("rope", 2**70, 1, "head_dim"),
        ("rope", 8, -(2**70), "num_heads"),
        ("rope", 64.7, 1, "head_dim must be an integer"),
        ("rope", 64.0, 1, "head_dim must be an integer"),
        ("rope", True, 1, "head_dim must be an integer"),
        ("rope", "64", 1, "head_dim must be an integer"),
    ],
)
def test_bad_constructor_arguments_are_input_errors(spec, head_dim, heads, match):
    with pytest.raises(relpos.InputError, match=match):
        relpos.PositionEncoding(spec, head_dim, heads)
    with pytest.raises(relpos.InputError, match=match):
        relpos.mechanism(spec, head_dim, heads)


def test_integer_like_sizes_are_still_accepted():
    enc = relpos.PositionEncoding("rope", torch.tensor(8), 1)
    assert enc.head_dim == 8 and isinstance(enc.head_dim, int)


def test_surrogate_spec_elsewhere_is_an_input_error():
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(relpos.InputError, match="not valid text"):
        relpos.verify("rope\udc80")
    with pytest.raises(relpos.InputError, match="not valid text"):
        relpos.journey_attention(x, x, x, "journey\ud800")
    with pytest.raises(relpos.InputError, match="not valid text"):
        relpos.frame_angles("journey\ud800", 8, 1, length=4)


def test_meta_tensors_with_check_finite_are_input_errors():
    enc = relpos.PositionEncoding("rope", 8, 1)
    m = torch.empty(1, 1, 4, 8, device="meta")
    with pytest.raises(relpos.InputError, match="meta"):
        enc(m, m)
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(relpos.InputError, match="meta"):
        enc(x, x, torch.empty(4, device="meta"))
    # without check_finite a meta call still gives shapes
    shapes = relpos.PositionEncoding("rope", 8, 1, check_finite=False)(m, m)
    assert shapes[0].shape == m.shape and shapes[0].is_meta


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.complex128])
def test_bool_and_complex_positions_are_refused(dtype):
    enc = relpos.PositionEncoding("rope", 8, 1)
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(relpos.InputError, match="real numbers"):
        enc(x, x, torch.ones(4, dtype=dtype))
    # as fused_attention refuses them, and every path that converts positions to float64 (before
    # the conversion: it would make them 0/1 or drop the imaginary part)
    p = torch.ones(4, dtype=dtype)
    for call in (lambda: relpos.fused_attention(x, x, x, q_positions=p),
                 lambda: relpos.attention(x, x, x, "rope", q_positions=p),
                 lambda: relpos.attention(x, x, x, "alibi", k_positions=p),
                 lambda: relpos.Attention("rope", 8, 1)(x, x, x, positions=p),
                 lambda: relpos.Attention("alibi", 8, 1)(x, x, x, positions=p)):
        with pytest.raises(relpos.InputError, match="real numbers"):
            call()


@pytest.mark.parametrize("first", [2**53 + 1, 2**60])
def test_int64_positions_past_2_to_53_are_refused_on_every_path(first):
    """An int64 position past 2^53 would round in float64 (2^53 + 1 to 2^53): neighbours merge and
    the causal mask breaks. Checked before the conversion on every path."""
    x = torch.randn(1, 1, 4, 8)
    p = torch.tensor([first + i for i in range(4)])
    for call in (lambda: relpos.fused_attention(x, x, x, q_positions=p, k_positions=p),
                 lambda: relpos.attention(x, x, x, None, q_positions=p, k_positions=p),
                 lambda: relpos.attention(x, x, x, "rope", q_positions=p, k_positions=p),
                 lambda: relpos.attention(x, x, x, "alibi", q_positions=p),
                 lambda: relpos.Attention("rope", 8, 1)(x, x, x, positions=p),
                 lambda: relpos.Attention("t5_bias", 8, 1)(x, x, x, positions=p)):
        with pytest.raises(relpos.InputError, match="2\\^53"):
            call()


@pytest.mark.parametrize("W", [torch.randn(3, 4), torch.randn(2, 5, 4), torch.randn(4),
                               torch.ones(3, 3, dtype=torch.long), [[0.0]]])
def test_cayley_basis_needs_square_floating_matrices(W):
    with pytest.raises(relpos.InputError, match="cayley_basis"):
        relpos.cayley_basis(W)


def test_cayley_basis_still_orthogonal():
    U = relpos.cayley_basis(torch.randn(2, 6, 6, dtype=F64))
    eye = torch.eye(6, dtype=F64)
    assert (U @ U.transpose(-1, -2) - eye).abs().max() < 1e-12
    assert math.isclose(torch.linalg.det(U[0]).item(), 1.0, rel_tol=1e-9)


def test_structured_rotate_needs_tensors():
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(relpos.InputError, match="basis must be a tensor"):
        relpos.structured_rotate(x, [[1.0]], torch.ones(2, 4), torch.zeros(4, 2))


# ---- arguments that are not tensors ------------------------------------------------------------

_B, _H, _T, _D = 1, 2, 4, 8


def _qkv():
    torch.manual_seed(0)
    return [torch.randn(_B, _H, _T, _D) for _ in range(3)]


def _fused(name, bad):
    return relpos.fused_attention(*_qkv(), **{name: bad})


def _composed(name, bad):
    return relpos.attention(*_qkv(), "rope", **{name: bad})


def _module(name, bad, cached):
    q, k, v = _qkv()
    kw = {"cache": relpos.KVCache(_B, _H, _D)} if cached else {}
    kw[name] = bad
    return relpos.Attention("rope", _D, _H)(q, k, v, **kw)


_NOT_TENSORS = [[0, 1, 2, 3], 3, "x"]


@pytest.mark.parametrize("bad", _NOT_TENSORS, ids=["list", "int", "str"])
@pytest.mark.parametrize("call, name", [
    *[(_fused, n) for n in ("q_positions", "k_positions", "key_len", "key_start", "q_segments",
                            "k_segments", "lag_table", "slopes", "cq", "ck", "gq", "gk", "path_q",
                            "path_k", "path_beta")],
    *[(_composed, n) for n in ("q_positions", "k_positions", "key_len", "key_start", "lag_table",
                               "slopes", "cq", "ck", "q_segments", "k_segments")],
    *[(lambda n, b: _module(n, b, False), n) for n in ("positions", "key_len", "key_start",
                                                        "segments")],
    *[(lambda n, b: _module(n, b, True), n) for n in ("positions", "key_len", "key_start",
                                                       "segments")],
])
def test_an_optional_tensor_argument_that_is_not_a_tensor_is_named(call, name, bad):
    """A key_len, position, mask or bias argument given as a list, a number or a string is an
    InputError that names the argument, on every path (fused kernel, composed attention, the
    module with and without a cache; the dispatcher's own refusal was a RuntimeError)."""
    with pytest.raises(relpos.InputError, match=f"^{name} must be a tensor or None, got "
                                                f"{type(bad).__name__}$"):
        call(name, bad)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: relpos.Attention("rope", _D, _H)(q, k, [1.0], cache=relpos.KVCache(_B, _H, _D)),
     r"v must be a \[B, H, T, D\] tensor, got list"),
    (lambda q, k, v: relpos.Attention("rope", _D, _H)(q, k, v, cache=[1.0]),
     "cache must be a relpos.KVCache, got list"),
    (lambda q, k, v: relpos.rotate_pairs([1.0], torch.zeros(_T, _D // 2)),
     "x must be a tensor, got list"),
    (lambda q, k, v: relpos.favor_attention(q, k, v, [1.0]), "argument 'projection'"),
])
def test_required_arguments_that_are_not_tensors_are_input_errors(call, match):
    with pytest.raises(relpos.InputError, match=match):
        call(*_qkv())


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("call, match", [
    # numbers a call cannot honour: NaN, infinities, negatives, strings (a NaN passed every range
    # comparison; a negative length returned the frequencies as built)
    (lambda: relpos.frequencies("rope + yarn(factor=4, original=4)", 8, float("nan")), "length"),
    (lambda: relpos.frequencies("rope", 8, -5), "length"),
    (lambda: relpos.frequencies("rope", 8, "x"), "length"),
    (lambda: relpos.attention_factor("rope + pj_yarn(L=4)", 8, float("inf")), "length"),
    (lambda: relpos.attention_factor("rope", 8, None), "length"),
    (lambda: relpos.rope_scaling_spec({"rope_type": "linear", "factor": torch.tensor(2.0)}),
     "rope_scaling"),
    (lambda: relpos.rope_scaling_spec({"rope_type": "linear", "factor": 2.0}, "x"),
     "max_position_embeddings"),
    (lambda: relpos.Attention("rope", 8, 2, window=float("nan")), "window"),
    (lambda: relpos.Attention("rope", 8, 2, window=-1), "window"),
    (lambda: relpos.Attention("rope", 8, 2, window="x"), "window"),
    (lambda: relpos.Attention("rope", 8, 2, scale=-1.0), "scale"),
    (lambda: relpos.Attention("rope", 8, 2, causal="no"), "causal"),
    (lambda: relpos.Attention("rope", 8, 2, causal=None), "causal"),
    (lambda: relpos.Attention("rope", 8, 2, max_position_embeddings="x",
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "max_position_embeddings"),
    (lambda: relpos.Attention("fox", 8, 2, model_dim=0), "model_dim"),
    (lambda: relpos.Attention("fox", 8, 2, model_dim=-1), "model_dim"),
    (lambda: relpos.PositionEncoding("rope", 8, 2, check_finite="yes"), "check_finite"),
    (lambda: relpos.rotate_pairs(_x(1, 1, 4, 8), _x(4, 4), inverse="x"), "inverse"),
    (lambda: relpos.rotate_pairs(_x(1, 1, 4, 8), torch.ones(4, 4, dtype=torch.bool)), "real"),
    (lambda: relpos.rotate_pairs(_x(1, 1, 4, 8), torch.ones(4, 4, dtype=torch.complex64)), "real"),
    (lambda: relpos.structured_rotate(_x(1, 1, 4, 8), torch.eye(8), torch.ones(2, 4),
                                      torch.zeros(4, 2), inverse="x"), "inverse"),
    (lambda: relpos.structured_rotate(_x(1, 1, 4, 8), torch.eye(8, dtype=torch.complex64),
                                      torch.ones(2, 4), torch.zeros(4, 2)), "basis"),
    (lambda: relpos.KVCache(1, 1, 8).next_positions(-1), "n must be >= 0"),
    (lambda: relpos.KVCache(1, 1, 8, device="bogus"), "device"),
    (lambda: relpos.frame_angles("journey", 8, 2, length=-1), "length"),
    (lambda: relpos.cayley_basis(_x(4, 4).bfloat16()), "float32 or float64"),
    # q, k, v of a dtype no kernel computes in
    (lambda: relpos.attention(*(torch.ones(1, 2, 4, 8, dtype=torch.long) for _ in range(3)), "rope"),
     "float32, float64"),
    (lambda: relpos.attention(*(_x(1, 2, 4, 8, dtype=torch.complex64) for _ in range(3))),
     "float32, float64"),
    (lambda: relpos.Attention("rope", 8, 2)(*(_x(1, 2, 4, 8, dtype=torch.complex64) for _ in range(3))),
     "float32, float64"),
    # a layout the call would ignore
    (lambda: relpos.attention(*(_x(1, 2, 4, 8) for _ in range(3)), None, pair_layout="bogus"),
     "pair layout"),
    (lambda: relpos.attention(*(_x(1, 2, 4, 8) for _ in range(3)), relpos.PositionEncoding("rope", 8, 2),
                              pair_layout="half_split"), "differs from the encoding's"),
    # per-token angles the encoding never sees (it rotated by position instead)
    (lambda: relpos.PositionEncoding("journey(angles=token)", 8, 2)(_x(1, 2, 4, 8), _x(1, 2, 4, 8)),
     "per-token angles"),
    (lambda: relpos.PositionEncoding("grape_m(context=true)", 8, 2)(_x(1, 2, 4, 8), _x(1, 2, 4, 8)),
     "per-token angles"),
])
def test_arguments_a_call_cannot_honour_are_input_errors(call, match):
    """Found by probing every public call with wrong values: each was a silent no-op, a wrong
    result, or a TypeError / RuntimeError / plain ValueError from inside."""
    with pytest.raises(relpos.InputError, match=match):
        call()


def test_attention_takes_the_encodings_pair_layout():
    """relpos.attention ignored pair_layout beside a PositionEncoding; the encoding's own applies
    (and a journey encoding built half-split was rotated interleaved)."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    for spec in ("rope", "journey"):
        enc = relpos.PositionEncoding(spec, 8, 2, pair_layout="half_split").double()
        assert torch.equal(relpos.attention(q, k, v, enc),
                           relpos.attention(q, k, v, spec, pair_layout="half_split"))


@pytest.mark.parametrize("call, match", [
    (lambda: relpos.random_projection(4, 8, orthogonal="no"), "orthogonal"),
    (lambda: relpos.random_projection(4, 8, seed=-1), "seed"),
    (lambda: relpos.favor_attention(*(_x(1, 1, 4, 8) for _ in range(3)),
                                    relpos.random_projection(4, 8).float(), causal="no"), "causal"),
    (lambda: relpos.favor_attention(*(_x(1, 1, 4, 8) for _ in range(3)),
                                    relpos.random_projection(4, 8).float(), scale=float("nan")), "scale"),
    (lambda: relpos.PositionEncoding("rope", 8, 2, max_position_embeddings="x"),
     "max_position_embeddings"),
])
def test_feature_and_config_arguments_are_checked(call, match):
    with pytest.raises(relpos.InputError, match=match):
        call()
