"""relpos.transformers: Hugging Face models switched to relpos attention (docs/transformers.md).

Tiny random models built here (no downloads). Against HF's own outputs before the switch: logits
(float64 to 1e-10 once HF's float32 shortcuts are removed from the reference, float32 to 1e-4),
greedy generation of 20 tokens on a left-padded batch, a training step's gradients; and the
rope dictionaries of every HF rope type against HF's frequencies.
"""

import logging
import pathlib
import re
import types

import pytest
import torch

import module_checks
from bench_runs import bench_rows
import relpos
import relpos.transformers as rt
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 101
ROOT = pathlib.Path(__file__).resolve().parents[2]

def _config(family: str, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                  initializer_range=0.2)
    if family == "llama":
        c = transformers.LlamaConfig(intermediate_size=128, num_key_value_heads=2, **common)
    elif family == "mistral":  # every layer slides, window 5
        c = transformers.MistralConfig(intermediate_size=128, num_key_value_heads=2, sliding_window=5,
                                       **common)
    elif family == "qwen2":  # layer 0 full, layer 1 slides with window 6
        c = transformers.Qwen2Config(intermediate_size=128, num_key_value_heads=2,
                                     use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                     **common)
    elif family == "gpt_neox":  # rotary_pct 0.25: 4 of 16 dims rotate
        c = transformers.GPTNeoXConfig(intermediate_size=128, **common)
    elif family == "phi":  # partial_rotary_factor 0.5, q/k layer norms
        c = transformers.PhiConfig(intermediate_size=128, num_key_value_heads=2, qk_layernorm=True,
                                   **common)
    elif family == "bloom":
        renamed = ("num_hidden_layers", "num_attention_heads", "max_position_embeddings")
        common = {k: v for k, v in common.items() if k not in renamed}
        c = transformers.BloomConfig(n_layer=2, n_head=4, **common)
    elif family == "falcon_alibi":  # the original architecture: ALiBi, one key/value head per head
        c = transformers.FalconConfig(alibi=True, multi_query=False, new_decoder_architecture=False,
                                      parallel_attn=False, num_kv_heads=4, **common)
    elif family == "falcon":  # the new decoder architecture: RoPE, grouped heads
        c = transformers.FalconConfig(alibi=False, new_decoder_architecture=True, num_kv_heads=2,
                                      **common)
    else:
        raise AssertionError(family)
    for k, v in extra.items():
        setattr(c, k, v)
    return c


_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "gpt_neox": "GPTNeoXForCausalLM", "phi": "PhiForCausalLM", "bloom": "BloomForCausalLM",
           "falcon_alibi": "FalconForCausalLM", "falcon": "FalconForCausalLM"}


def _model(family: str, dtype=torch.float64, seed=0, **extra):
    torch.manual_seed(seed)
    model = getattr(transformers, _MODELS[family])(_config(family, **extra))
    model = model.to(dtype).eval()
    if dtype == torch.float64:
        _exact_norms(model)
    return model


def _exact_norms(model):
    """HF's RMSNorm computes in float32 whatever the model's dtype: float64 models keep float64
    here (part of the model, before and after the switch; _model does it)."""
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            def forward(self, x):
                rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
                return self.weight * (x * rms)
            m.forward = types.MethodType(forward, m)


def _exact_rotary(model):
    """HF computes RoPE angles in float32 (float32 inv_freq, position x inv_freq in float32) for
    every model dtype: the reference run gets them in float64 (default rope type)."""
    for m in model.modules():
        rot = getattr(m, "rotary_emb", None)
        if rot is None:
            continue
        rp = m.config.rope_parameters
        assert rp["rope_type"] == "default"
        D = getattr(m.config, "head_dim", None) or m.config.hidden_size // m.config.num_attention_heads
        R = int(D * rp.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, R, 2, dtype=torch.float64) / R))

        def forward(self, x, position_ids, inv=inv):
            f = position_ids[..., None].double() * inv
            emb = torch.cat((f, f), -1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        rot.forward = types.MethodType(forward, rot)


class _Float64Softmax:
    """torch.nn.functional for modeling_bloom, whose attention casts its softmax to float32."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def softmax(x, dim=None, dtype=None):
        return torch.softmax(x, dim)


def _hf_reference(model, monkeypatch, exact: bool):
    """The HF model as the reference: for float64, without HF's float32 shortcuts."""
    if exact:
        _exact_rotary(model)
        monkeypatch.setattr(transformers.models.bloom.modeling_bloom, "F", _Float64Softmax())


def _left_padded(seed=1, lengths=(12, 7, 3)):
    """Three prompts of different lengths, left-padded with token 0."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _labels(ids, mask):
    """Language-model labels that score only tokens predicted from a real token: padding and each
    row's first token are -100 (the first would be predicted from a pad, whose attention row is
    empty: HF and relpos fill such rows differently)."""
    first = mask.argmax(1)
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(len(ids)), first] = -100
    return labels


def _loss(model, ids, mask, labels):
    """The causal LM loss in the model's dtype (HF's own loss casts the logits to float32)."""
    logits = model(ids, attention_mask=mask).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


FAMILIES = [
    "llama", "mistral", "qwen2",
    "gpt_neox", "phi",
    "bloom", "falcon_alibi", "falcon",
]


# ---------------------------------------------------------------------------------------------
# the model's own encoding: same logits, generation and gradients as HF


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_hf_float64(family, monkeypatch):
    model = _model(family)
    _hf_reference(model, monkeypatch, exact=True)
    ids, mask = _left_padded()
    holed = mask.clone()
    holed[0, 5] = 0  # a hole inside row 0 (the materialised path)
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        plain = model(ids).logits  # no padding mask
        before_holed = model(ids, attention_mask=holed).logits
        rt.apply(model)
        monkeypatch.undo()
        after = model(ids, attention_mask=mask).logits
        after_plain = model(ids).logits
        after_holed = model(ids, attention_mask=holed).logits
    valid = mask.bool()
    assert (after[valid] - before[valid]).abs().max() < 1e-10
    assert (after_plain - plain).abs().max() < 1e-10
    valid = holed.bool()
    if family in ("bloom", "falcon_alibi"):
        # HF's ALiBi counts unmasked tokens (cumsum of the mask), relpos the cache slots: after
        # a hole the lags differ by the hole's width (docs/transformers.md, "Padding")
        valid[0, 6:] = False
    assert (after_holed[valid] - before_holed[valid]).abs().max() < 1e-10


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_hf_float32(family):
    model = _model(family, dtype=torch.float32)
    ids, mask = _left_padded()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        rt.apply(model)
        after = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (after[valid] - before[valid]).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_models_are_as_close_as_hf_and_generate(family):
    """A bf16 model switched to relpos (half storage, float32 compute): its logits are as close
    to the float32 model's as HF's own bf16 path is (within 1.5x of HF's error plus 1% of the
    logits' scale), they come back bf16, and generate() runs on a left-padded batch."""
    ids, mask = _left_padded()
    valid = mask.bool()
    with torch.no_grad():
        exact = _model(family, dtype=torch.float32)(ids, attention_mask=mask).logits
        half = _model(family, dtype=torch.bfloat16)
        hf = half(ids, attention_mask=mask).logits.float()
        rt.apply(half)
        ours = half(ids, attention_mask=mask).logits
        assert ours.dtype == torch.bfloat16
        err_hf = (hf - exact)[valid].abs().max()
        err_ours = (ours.float() - exact)[valid].abs().max()
        assert err_ours <= 1.5 * err_hf + 1e-2 * exact.abs().max(), (err_ours, err_hf)
        out = half.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert out.shape == (3, ids.shape[1] + 5)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_left_padded_equals_hf(family, monkeypatch):
    model = _model(family)
    _hf_reference(model, monkeypatch, exact=True)
    ids, mask = _left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
    with torch.no_grad():
        before = model.generate(ids, **kw)
        rt.apply(model)
        monkeypatch.undo()
        after = model.generate(ids, **kw)
    assert before.shape == (3, ids.shape[1] + 20)
    assert torch.equal(after, before)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradients_equal_hf(family, monkeypatch):
    model = _model(family)
    _hf_reference(model, monkeypatch, exact=True)
    model.train()
    ids, mask = _left_padded()
    labels = _labels(ids, mask)

    def grads():
        model.zero_grad()
        loss = _loss(model, ids, mask, labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}

    loss0, g0 = grads()
    rt.apply(model)
    monkeypatch.undo()
    loss1, g1 = grads()
    assert abs(float(loss1 - loss0)) < 1e-10
    assert set(g1) == set(g0) and len(g0) > 5
    for n in g0:
        scale = g0[n].abs().max().clamp_min(1e-30)
        assert (g1[n] - g0[n]).abs().max() / scale < 1e-9, n


# ---------------------------------------------------------------------------------------------
# other mechanisms: parameters, decoding, padding paths


# Jordan-RoPE and damped RoPE started from a RoPE checkpoint: at order 1 without damping they
# are RoPE exactly (one rotation sense across the catalog); with learnable damping started at
# gamma0 = 0 its softplus parameterisation starts at its floor (logits within 1e-5). (Order 2
# cannot be RoPE: its D/4 frequencies each turn two pairs, RoPE's D/2 are distinct.)
@pytest.mark.parametrize("spec,tol", [("jordan(m=1, zero_gamma=true)", 1e-10),
                                      ("damped_rope(m=1, zero_gamma=true)", 1e-10),
                                      ("jordan(m=1, gamma0=0, gamma_min=0)", 1e-5)])
def test_jordan_from_a_rope_checkpoint_equals_rope_at_initialisation(monkeypatch, spec, tol):
    model = _model("llama")
    _hf_reference(model, monkeypatch, exact=True)
    ids, mask = _left_padded()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        rt.apply(model, spec)
        monkeypatch.undo()
        after = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (after[valid] - before[valid]).abs().max() < tol


MECHANISMS = ["jordan(m=2, regime=scaled, c=1)", "rope + alibi", "t5_bias", "xpos",
              "rope(theta=500000) + yarn(factor=4, original=64)",
              # runtime state: relpos.Attention's decode cache inside HF's
              "fox", "grape_a", "grape_ap", "grape_m", "journey"]
MHA_ONLY = {"t5_bias", "fox", "grape_a", "grape_ap"}  # a row per key/value or per query head


@pytest.mark.parametrize("spec", MECHANISMS)
def test_decoding_a_left_padded_batch_equals_the_full_forward(spec):
    """Each generated token's logits (prefill, then one token per step through HF's cache, rows
    left-padded) equal the full forward of the finished sequences."""
    model = _model("llama", num_key_value_heads=4 if spec in MHA_ONLY else 2)
    rt.apply(model, spec)
    ids, mask = _left_padded()
    cache = transformers.DynamicCache(config=model.config)
    steps = []
    with torch.no_grad():  # generate's loop, keeping float64 logits (generate returns float32)
        seq, m = ids, mask
        out = model(ids, attention_mask=m, position_ids=(m.cumsum(1) - 1).clamp_min(0), cache=cache)
        for _ in range(6):
            steps.append(out.logits[:, -1])
            token = steps[-1].argmax(-1, keepdim=True)
            seq, m = torch.cat([seq, token], 1), torch.cat([m, torch.ones_like(token)], 1)
            out = model(token, attention_mask=m, position_ids=m.sum(1, keepdim=True) - 1, cache=cache)
        assert cache.get_seq_length() == seq.shape[1]
        full = model(seq, attention_mask=m, position_ids=(m.cumsum(1) - 1).clamp_min(0),
                     use_cache=False).logits
    T = ids.shape[1]
    for i, step in enumerate(steps):
        assert (step - full[:, T - 1 + i]).abs().max() < 1e-10, i


@pytest.mark.parametrize("spec", ["fox", "grape_ap", "grape_m", "journey"])
def test_beam_search_reorders_the_runtime_state(spec):
    """Beam search through HF's cache reorders the EngineCacheLayer's state with HF's beams: the
    same sequences as beam search without a cache (it fails for all of these when reorder_cache
    leaves the state as it was); grouped heads."""
    model = _model("llama")
    rt.apply(model, spec)
    ids, mask = _left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
              num_beams=3)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("family,spec", [("bloom", "grape_ap"), ("gpt_neox", "fox"),
                                         ("falcon_alibi", "grape_a"), ("phi", "journey"),
                                         ("llama", "fox"), ("mistral", "grape_ap"),
                                         ("qwen2", "grape_a"), ("llama", "grape_m(context=true)"),
                                         ("gpt_neox", "journey(angles=token)")])
def test_runtime_mechanisms_generate_in_every_family(family, spec):
    """A mechanism with runtime state in each family's layer (its own q/k/v layout; Bloom
    passes no position_ids, so positions count each row's tokens after its padding, which
    GRAPE-AP's probes are not invariant to; the others get each row's positions after its padding
    as generate gives them; Llama, Mistral and Qwen2 with grouped heads, two query heads a
    key/value head; phases scanned from the hidden states start at each row's first real token):
    each left-padded row's logits equal the row alone, and greedy generate through HF's cache
    gives the tokens of generate without one."""
    model = _model(family, num_key_value_heads=4) if family == "phi" else _model(family)
    rt.apply(model, spec)
    ids, mask = _left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    pos = {} if family == "bloom" else {"position_ids": (mask.cumsum(1) - 1).clamp_min(0)}
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=False, **pos).logits
        for b, n in enumerate(mask.sum(1).tolist()):
            alone = model(ids[b:b + 1, -n:], use_cache=False).logits[0]
            assert (padded[b, -n:] - alone).abs().max() < 1e-9, b
        assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_runtime_state_refusals():
    """What a mechanism with runtime state cannot do with a cache is refused by name: dropping
    cached tokens, right padding at the prompt, a hole; a cache filled elsewhere; a step over
    cached tokens with autograd on. What it can: a reset cache takes a new prompt of other rows,
    a row of padding only decodes beside the others."""
    model = _model("llama", num_key_value_heads=4)
    rt.apply(model, "fox")
    ids, mask = _left_padded()
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(ids, attention_mask=mask, cache=cache)
        assert isinstance(cache.layers[0], rt.EngineCacheLayer) and cache.get_seq_length() == 12
        cache.crop(0)  # HF's no-op crop passes
        with pytest.raises(relpos.InputError, match="crop"):
            cache.crop(-1)
        right = torch.ones_like(mask)
        right[1, 9:] = 0
        with pytest.raises(relpos.InputError, match="right"):
            model(ids, attention_mask=right, cache=transformers.DynamicCache(config=model.config))
        holed = torch.ones_like(mask)
        holed[0, 4] = 0
        with pytest.raises(relpos.InputError, match="hole"):
            model(ids, attention_mask=holed, use_cache=False)
        filled = transformers.DynamicCache(config=model.config)
        filled.update(torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16), 0)
        with pytest.raises(relpos.InputError, match="empty cache"):
            model(ids, attention_mask=mask, cache=filled)
    # a step over cached tokens with autograd on (their gradients would be lost)
    step = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    with pytest.raises(relpos.InputError, match="torch.no_grad"):
        model(ids[:, -1:], attention_mask=step, cache=cache)
    with torch.no_grad():
        # an emptied cache (reset) takes a new prompt of other rows
        cache.reset()
        other = ids[:2, 3:]
        assert (model(other, cache=cache).logits
                - model(other, use_cache=False).logits).abs().max() < 1e-10
        # a row of padding only decodes beside the others
        empty = mask.clone()
        empty[2] = 0
        kw = dict(attention_mask=empty, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("spec", ["jordan(m=2, regime=scaled, c=1)", "t5_bias", "kerple"])
def test_mechanism_parameters_train_and_are_saved(spec):
    model = _model("llama", num_key_value_heads=4)
    rt.apply(model, spec)
    names = [n for n, _ in model.named_parameters() if ".relpos.encoding." in n]
    assert len(names) >= 2 and all(n.startswith("model.layers.") for n in names)
    assert model.config.relpos_spec == model.model.layers[0].self_attn.relpos.spec
    model.train()
    ids, mask = _left_padded()
    labels = _labels(ids, mask)
    _loss(model, ids, mask, labels).backward()
    p = dict(model.named_parameters())[names[0]]
    assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0
    # the gradient of one element against a central difference of the loss
    idx = tuple(int(i) for i in torch.nonzero(p.grad.abs() == p.grad.abs().max())[0])
    h = 1e-5
    with torch.no_grad():
        def loss_at(delta):
            p[idx] += delta
            v = float(_loss(model, ids, mask, labels))
            p[idx] -= delta
            return v
        fd = (loss_at(h) - loss_at(-h)) / (2 * h)
    assert abs(fd - float(p.grad[idx])) <= 1e-6 * abs(fd) + 1e-9, (fd, float(p.grad[idx]))
    # saved and loaded with the model's state dict
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(names) <= set(state)
    other = rt.apply(_model("llama", seed=5, num_key_value_heads=4), spec)
    other.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(other(ids, attention_mask=mask).logits,
                           model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("spec", ["rope + alibi", "t5_bias"])
def test_materialised_and_right_padded_paths_equal_the_kernel(spec):
    """A boolean 4-D mask runs the plain-torch path, right padding the kernel's key_len: against
    the kernel without a mask (biases: ALiBi slopes, a learned lag table; grouped heads)."""
    model = _model("llama", num_key_value_heads=4 if spec == "t5_bias" else 2)
    rt.apply(model, spec)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(ids).logits
        causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 1, 9, 9)
        assert (model(ids, attention_mask=causal).logits - plain).abs().max() < 1e-10
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 5:] = 0  # row 1: 5 tokens, right-padded
        out = model(ids, attention_mask=mask).logits
        assert (out[1, :5] - plain[1, :5]).abs().max() < 1e-10
        assert (out[0] - plain[0]).abs().max() < 1e-10


def test_materialised_path_equals_a_plain_reference():
    """The materialised path (SDPA with one additive mask) against softmax written out: a random
    mask with an empty row, ALiBi slopes and a lag table at explicit slots, grouped heads; outputs
    and every gradient in float64, the empty row zero and finite."""
    g = torch.Generator().manual_seed(7)
    B, Hq, Hk, Tq, Tk, D = 2, 4, 2, 5, 9, 8
    q = torch.randn(B, Hq, Tq, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, Hk, Tk, D, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    table = torch.randn(Hq, 12, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(Hq, generator=g, dtype=torch.float64)
    visible = torch.rand(B, Tq, Tk, generator=g) < 0.6
    visible[1, 2] = False  # a row without a visible key
    qslot = torch.arange(4.0, 4.0 + Tq, dtype=torch.float64)
    kslot = torch.arange(Tk, dtype=torch.float64)
    kw = dict(scale=0.3, slopes=slopes, lag_table=table)
    out = rt._masked_attention(q, k, v, visible, qslot, kslot, kw)
    lag = qslot[:, None] - kslot[None, :]
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3 - slopes[:, None, None] * lag
    s = s + table[:, lag.round().clamp(0, 11).long()]
    p = torch.softmax(s.masked_fill(~visible[:, None], float("-inf")), -1).nan_to_num()
    ref = p @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert torch.equal(out[1, :, 2], torch.zeros(Hq, D, dtype=torch.float64))
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v, table)),
                    torch.autograd.grad((ref * w).sum(), (q, k, v, table))):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_materialised_path_keeps_nonfinite_values_to_the_rows_that_see_them():
    """A NaN in a key and an Inf in a value, each visible to some rows only (a hole mask with
    grouped heads): those rows are non-finite, every other row equals the clean call."""
    g = torch.Generator().manual_seed(8)
    B, Hq, Hk, T, D = 1, 4, 2, 8, 8
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    visible = torch.ones(T, T, dtype=torch.bool).tril()[None].clone()
    visible[:, :, 2] = False  # a hole: key 2 seen by no row
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[0, 1, 2, 3] = float("nan")  # the hole's key: seen by no row
    bad_k[0, 0, 5, 0] = float("nan")  # key 5 of head 0: rows 5.. of query heads 0, 1
    bad_v[0, 1, 6, 4] = float("inf")  # value 6 of head 1: rows 6.. of query heads 2, 3, column 4
    kw = dict(scale=0.35, slopes=torch.rand(Hq, generator=g, dtype=torch.float64))
    clean = rt._masked_attention(q, k, v, visible, None, None, kw)
    out = rt._masked_attention(q, bad_k, bad_v, visible, None, None, kw)
    sees = torch.zeros_like(out, dtype=torch.bool)
    sees[0, :2, 5:] = True
    sees[0, 2:, 6:, 4] = True
    assert not torch.isfinite(out[sees]).any()
    torch.testing.assert_close(out[~sees], clean[~sees], rtol=0, atol=1e-12)


@pytest.mark.parametrize("family,spec", [("llama", "rope + alibi"), ("mistral", None),
                                         ("qwen2", None), ("gpt_neox", "rope + kerple")])
def test_packed_sequences_equal_separate_documents(family, spec, monkeypatch):
    """Documents packed in a row (position_ids restart, no mask, no cache: HF detects the packing)
    run through the kernel with document ids, not the materialised path, and give each document's
    own logits; the gradients of every parameter equal the materialised path's. Mistral's window
    (5) and Qwen2's mixed full and sliding layers fall inside the 9-token documents; KERPLE's
    learned lag table is a bias the documents must cut."""
    model = _model(family)
    rt.apply(model, spec)
    g = torch.Generator().manual_seed(4)
    rows = [(5, 3, 9), (9, 8)]
    docs = [[torch.randint(1, VOCAB, (1, n), generator=g) for n in lens] for lens in rows]
    packed = torch.cat([torch.cat(d, 1) for d in docs])
    pos = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])

    def materialised(*args):
        raise AssertionError("packed documents took the materialised path")

    def packed_run():
        model.zero_grad()
        # without a cache, as in training: HF looks for packing only then
        out = model(packed, position_ids=pos, use_cache=False).logits
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with monkeypatch.context() as m:
        m.setattr(rt, "_masked_attention", materialised)
        out, grads = packed_run()
        with torch.no_grad():
            for r, row in enumerate(docs):
                start = 0
                for d in row:
                    alone = model(d).logits[0]
                    assert (out[r, start: start + d.shape[1]] - alone).abs().max() < 1e-10
                    start += d.shape[1]
    monkeypatch.setattr(rt, "_documents", lambda full, standard: None)
    ref_out, ref_grads = packed_run()
    assert (out - ref_out).abs().max() < 1e-10
    assert len(grads) == len(ref_grads) > 0
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_mask_forms_are_exact():
    """relpos_mask returns a compact form only where it is the very mask HF asked for: document ids
    for causal runs (with or without a window), HF's boolean mask for ids that come back (a
    document split in two runs), for a hole, and for a mask function that is not causal inside
    the runs."""
    from transformers.masking_utils import and_masks, causal_mask_function, \
        packed_sequence_mask_function, sliding_window_causal_mask_function

    def form(ids, base=causal_mask_function, attention_mask=None, local_size=None):
        ids = torch.tensor(ids)
        fn = and_masks(base, packed_sequence_mask_function(ids))
        return rt.relpos_mask(ids.shape[0], ids.shape[1], ids.shape[1], mask_function=fn,
                              attention_mask=attention_mask, local_size=local_size)

    docs = form([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert docs.dtype == torch.int32 and docs.shape == (2, 1, 1, 6)
    assert docs.view(2, 6).tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    windowed = form([[0, 0, 0, 0, 1, 1]], base=sliding_window_causal_mask_function(2),
                    local_size=2)  # as HF passes a sliding window
    assert windowed.dtype == torch.int32 and windowed.view(-1).tolist() == [0, 0, 0, 0, 1, 1]
    for mask in (form([[0, 0, 1, 1, 0, 0]]),  # id 0 in two runs: rows 4, 5 see keys 0, 1
                 form([[0, 0, 0, 0, 1, 1]], base=sliding_window_causal_mask_function(2)),
                 form([[0, 0, 0, 1, 1, 1]], base=lambda b, h, i, j: j <= i + 1),  # not causal
                 form([[0, 0, 0, 1, 1, 1]], attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1]]).bool())):
        assert mask.dtype == torch.bool and mask.shape == (1, 1, 6, 6)


def test_torch_compile_runs_a_forward():
    """torch.compile(model) with the aot_eager backend (dynamo graphs, fake tensors through the
    relpos ops' meta kernels, AOT autograd; inductor's C++ build is too slow for CI) gives the
    eager logits."""
    torch._dynamo.reset()
    model = _model("llama", dtype=torch.float32)
    rt.apply(model)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="aot_eager")(ids, use_cache=False).logits
    assert (compiled - eager).abs().max() < 1e-5


def _switched(spec):
    """The catalog tests' Llama (head dim 24, grouped heads) switched to spec; the switch draws
    from torch's generator right after the model's seeded build, so two calls give one model."""
    model = _model("llama", hidden_size=96, head_dim=24, num_key_value_heads=2)
    rt.apply(model, spec)
    return model


def _lm_grads(model, forward, ids):
    """The parameters' gradients of the mean next-token loss of ids (every row whole)."""
    logits = forward(ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                      ids[:, 1:].reshape(-1)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# one mechanism per path of a switched layer: the fused kernel with a learned transform, a
# learned lag table, a bias computed from the tokens (relpos.Attention), learned frequencies
@pytest.mark.parametrize("spec", ["jordan", "pj_bias", "fox", "grape_m"])
def test_torch_compile_trains_through_each_path(spec):
    """torch.compile(model) (aot_eager: dynamo graphs, the ops' fake kernels, AOT autograd; the
    mask's data-dependent choice of kernel path is a graph break) gives the eager gradients."""
    torch._dynamo.reset()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    models = [_switched(spec) for _ in range(2)]
    eager = _lm_grads(models[0], models[0], ids)
    compiled = _lm_grads(models[1], torch.compile(models[1], backend="aot_eager"), ids)
    assert compiled.keys() == eager.keys()
    for n, g in eager.items():
        torch.testing.assert_close(compiled[n], g, rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("shards", [None, "60KB"], ids=["one_file", "shards"])
def test_from_pretrained_loads_a_switched_checkpoint_in_one_call(tmp_path, shards):
    """save_pretrained of a switched model (the mechanism's tensors trained away from their
    initial values), then relpos.transformers.from_pretrained: the same logits, the relpos
    tensors not reported unexpected; a plain checkpoint and one missing a relpos tensor are
    refused by name."""
    from safetensors.torch import load_file, save_file
    model = _model("llama", dtype=torch.float32, hidden_size=96, head_dim=24, num_key_value_heads=2)
    rt.apply(model, "pj_bias")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".relpos." in n:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "switched", **({"max_shard_size": shards} if shards else {}))
    reports = []  # HF's load reports (warnings of the transformers logger)

    class Keep(logging.Handler):
        def emit(self, record):
            reports.append(record.getMessage())

    keep = Keep()
    logging.getLogger("transformers").addHandler(keep)
    try:
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "switched")  # the report it gives
        assert any("UNEXPECTED" in r and ".relpos." in r for r in reports)
        reports.clear()
        again = rt.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "switched")
    finally:
        logging.getLogger("transformers").removeHandler(keep)
    assert not any("UNEXPECTED" in r for r in reports)
    assert "_keys_to_ignore_on_load_unexpected" not in vars(transformers.LlamaForCausalLM)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, model.eval()(ids).logits)
    plain = _model("llama", dtype=torch.float32)
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(relpos.InputError, match="records no relpos_spec"):
        rt.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "plain")
    if shards is None:  # one relpos tensor dropped from the file
        f = tmp_path / "switched" / "model.safetensors"
        tensors = load_file(f)
        gone = next(k for k in tensors if ".relpos." in k)
        del tensors[gone]
        save_file(tensors, f, metadata={"format": "pt"})
        with pytest.raises(relpos.InputError, match=f"missing {gone}"):
            rt.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "switched")


# how a switched model was made and how its checkpoint is read back: (family, apply's spec and
# options, save_pretrained's arguments, the class from_pretrained is given, its arguments)
RELOADS = {
    "falcon_own_alibi": ("falcon_alibi", None, {}, {}, "FalconForCausalLM", {}),  # slopes / sqrt(D)
    # saved by a relpos that did not record relpos_own: the model's own spec is its own encoding
    "falcon_own_alibi_older": ("falcon_alibi", None, {}, {}, "FalconForCausalLM", {}),
    "interleaved_pairs": ("llama", "rope", {"pair_layout": "interleaved"}, {}, "LlamaForCausalLM", {}),
    "auto_class": ("llama", "pj_bias", {}, {}, "AutoModelForCausalLM", {}),
    "base_from_head": ("llama", "pj_bias", {}, {}, "LlamaModel", {}),
    "variant": ("llama", "t5_bias", {}, {"variant": "v2"}, "LlamaForCausalLM", {"variant": "v2"}),
    "loading_info": ("llama", "fox", {}, {}, "LlamaForCausalLM", {"output_loading_info": True}),
}


@pytest.mark.parametrize("case", RELOADS)
def test_from_pretrained_switches_a_checkpoint_as_it_was_saved(tmp_path, case):
    """Every way of switching and of reading back that a checkpoint does not show in its tensor
    names: the model's own ALiBi (Falcon scales its slopes), an apply() option, an Auto class, a
    base model from a checkpoint with a head, a weights variant, HF's loading info; the reloaded
    model computes what the saved one did."""
    family, spec, options, save, cls, load = RELOADS[case]
    model = _model(family, dtype=torch.float32)
    rt.apply(model, spec, **options)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".relpos." in n:
                p.add_(0.3 * torch.randn_like(p))
    if case.endswith("_older"):
        del model.config.relpos_own
    model.save_pretrained(tmp_path, **save)
    loaded = rt.from_pretrained(getattr(transformers, cls), tmp_path, **load)
    if load.get("output_loading_info"):
        loaded, info = loaded
        assert not info["unexpected_keys"] and not info["missing_keys"]
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        if cls == "LlamaModel":
            want, got = model.eval().model(ids).last_hidden_state, loaded.eval()(ids).last_hidden_state
        else:
            want, got = model.eval()(ids).logits, loaded.eval()(ids).logits
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# refusals


CATALOG = [m["name"] if isinstance(m, dict) else m for m in relpos.mechanisms()]
# what a switched layer may refuse, by the mechanism's nature: positions that are vectors, a
# context-extension rule with no rotation to extend (it composes: "rope + yarn(...)")
STRUCTURAL = r"vector positions|no rotary term to extend"


@pytest.mark.parametrize("name", CATALOG)
def test_activation_checkpointing_gives_the_same_gradients(name):
    """HF's activation checkpointing (each decoder layer's forward run again in the backward)
    over every mechanism a Llama switches to: the gradients of the run without it, exactly (a
    layer's recomputation reads the same parameters, caches and positions)."""
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    try:
        models = [_switched(name) for _ in range(2)]
    except relpos.InputError as e:
        assert re.search(STRUCTURAL, str(e)), str(e)
        return
    models[1].activation_checkpointing_enable()
    for m in models:  # (both in training mode; the models have no dropout)
        m.train()
    plain = _lm_grads(models[0], models[0], ids)
    checkpointed = _lm_grads(models[1], models[1], ids)
    assert checkpointed.keys() == plain.keys()
    for n, g in plain.items():
        assert torch.equal(checkpointed[n], g), n


@pytest.mark.parametrize("name", CATALOG)
def test_every_mechanism_switches_a_model_and_pads_exactly(name):
    """Every mechanism of `relpos list` (its default spec) switches a Llama (head dim 24, grouped
    heads: two query heads a key/value head) unless it cannot by its nature (STRUCTURAL): each left-padded row's logits equal the row run
    alone, and documents packed in a row each document run alone (fp64 1e-9); the loss
    backpropagates to finite gradients of the mechanism's parameters (some nonzero); greedy
    `generate` through HF's cache gives the tokens of `generate` without one. Mechanisms with
    runtime state (content biases, learned frequencies, journey frames) run through
    relpos.Attention and decode through an EngineCacheLayer."""
    model = _model("llama", hidden_size=96, head_dim=24, num_key_value_heads=2)
    try:
        rt.apply(model, name)
    except relpos.InputError as e:
        assert re.search(STRUCTURAL, str(e)), str(e)
        return
    ids, mask = _left_padded()
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        for b, n in enumerate(mask.sum(1).tolist()):
            alone = model(ids[b:b + 1, -n:], use_cache=False).logits[0]
            assert (padded[b, -n:] - alone).abs().max() < 1e-9, b
        # documents packed in one row (restarting positions): each document's own logits
        docs = [ids[0, :5], ids[0, 5:8], ids[0, 8:]]
        packed = model(ids[:1], position_ids=torch.cat([torch.arange(len(d)) for d in docs])[None],
                       use_cache=False).logits[0]
        start = 0
        for d in docs:
            alone = model(d[None], use_cache=False).logits[0]
            assert (packed[start: start + len(d)] - alone).abs().max() < 1e-9, start
            start += len(d)
    model.train()
    labels = _labels(ids, mask)
    _loss(model, ids, mask, labels).backward()  # HF's default use_cache=True: a cache at the prompt
    grads = {n: p.grad for n, p in model.named_parameters() if ".relpos." in n}
    # every parameter is read (a part the spec leaves off, e.g. pj_bias's light-cone sector, keeps
    # buffers): one without a gradient would stop torch's DistributedDataParallel
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert not grads or any(g.abs().max() > 0 for g in grads.values())
    # every parameter's gradient as without a cache
    with_cache = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                      labels[:, 1:].reshape(-1), ignore_index=-100).backward()
    without = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert with_cache.keys() == without.keys()
    for n, g in without.items():
        torch.testing.assert_close(with_cache[n], g, rtol=1e-9, atol=1e-12, msg=n)
    # greedy decoding through HF's cache gives the tokens of decoding without one (each step a
    # full forward), unless the mechanism cannot decode by its nature (a centre per call, a
    # context-extension rule that changes with the length)
    model.eval()
    kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        try:
            cached = model.generate(ids, **kw)
        except relpos.InputError as e:
            assert re.search(r"center=mid|dynamic", str(e)), str(e)
            return
        assert torch.equal(cached, model.generate(ids, use_cache=False, **kw))


def test_unsupported_models_and_mechanisms_are_refused():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1,
                                                                  n_head=2, n_positions=32))
    supported = r"bloom, falcon, gpt_neox, llama, mistral, phi, qwen2"
    with pytest.raises(relpos.InputError, match=r"GPT2LMHeadModel.*'gpt2'.*" + supported):
        rt.apply(gpt2)
    with pytest.raises(relpos.InputError, match="GPT2Config"):
        rt.spec_for(gpt2.config)
    model = _model("llama")
    for spec, why in (("structured(dims=2, basis=axial)", "vector positions"),
                      ("nonsense", "nonsense")):
        with pytest.raises(relpos.InputError, match=why):
            rt.apply(model, spec)
    with pytest.raises(relpos.InputError, match="unknown option"):
        rt.apply(model, window=4)
    with pytest.raises(relpos.InputError, match="spec must be"):
        rt.apply(model, 3)
    assert not hasattr(model.model.layers[0].self_attn, "relpos")  # refusals change nothing
    rt.apply(model)
    with pytest.raises(relpos.InputError, match="already switched"):
        rt.apply(model)
    drop = rt.apply(_model("llama", attention_dropout=0.1)).train()
    with pytest.raises(relpos.InputError, match="attention dropout"):
        drop(torch.ones(1, 3, dtype=torch.long))
    model = rt.apply(_model("llama"))
    with pytest.raises(relpos.InputError, match="static cache"):
        model.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, do_sample=False,
                       cache_implementation="static")


def test_supported_and_spec_for():
    assert set(rt.supported()) == {"bloom", "falcon", "gpt_neox", "llama", "mistral", "phi", "qwen2"}
    assert rt.spec_for(_config("llama")) == "rope(theta=10000)"
    assert rt.spec_for(_config("gpt_neox")) == "partial_rope(fraction=0.25, theta=10000)"
    assert rt.spec_for(_config("phi")) == "partial_rope(fraction=0.5, theta=10000)"
    assert rt.spec_for(_config("bloom")) == "alibi"
    assert rt.spec_for(_config("falcon_alibi")) == "alibi"
    assert rt.spec_for(_config("falcon")) == "rope(theta=10000)"
    c = _config("llama")
    c.rope_parameters = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    assert rt.spec_for(c) == "partial_rope(fraction=0.5, grid=head, theta=10000)"
    c.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3125}
    with pytest.raises(relpos.InputError, match="odd"):  # 5 of 16 dims: HF's odd grid
        relpos.PositionEncoding(rt.spec_for(c), 16, 2)
    assert "relpos" in transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS


def test_core_package_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, relpos; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# rope dictionaries: every HF rope type, HF's frequencies against relpos's

D, HEADS, MAXPOS = 32, 2, 64
ROPE_CASES = {
    "default": ({"rope_type": "default"}, [20]),
    "default_partial": ({"rope_type": "default", "partial_rotary_factor": 0.5}, [20]),
    "linear": ({"rope_type": "linear", "factor": 4.0}, [20]),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, [40, 100, 300]),
    "yarn": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
              "beta_fast": 16.0, "beta_slow": 2.0}, [20]),
    "yarn_without_factor": ({"rope_type": "yarn", "factor": None,
                             "original_max_position_embeddings": 16}, [20]),
    "longrope": ({"rope_type": "longrope", "original_max_position_embeddings": 32,
                  "short_factor": [1.0 + 0.1 * i for i in range(D // 2)],
                  "long_factor": [2.0 + 0.5 * i for i in range(D // 2)]}, [20, 100]),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}, [20]),
    "proportional": ({"rope_type": "proportional", "partial_rotary_factor": 0.5}, [20]),
}


def test_rope_cases_cover_every_hf_rope_type():
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} <= {c[0]["rope_type"] for c in ROPE_CASES.values()}


def _rope_config(params):
    return transformers.LlamaConfig(hidden_size=D * HEADS, num_attention_heads=HEADS,
                                    num_key_value_heads=HEADS, max_position_embeddings=MAXPOS,
                                    rope_parameters={"rope_theta": 50000.0, **params})


def _hf_frequencies(config, length):
    """HF's inverse frequencies (float32) and attention factor for a call of this length."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

        inv, af = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv, af = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=length)
    return inv.double(), float(af)


def _relpos_frequencies(spec, length):
    """relpos's frequencies (relpos.frequencies, rope's sense = HF's inv_freq) and attention
    factor for a call of positions 0..length-1."""
    return (relpos.frequencies(spec, D, length),
            relpos.attention_factor(spec, D, float(length)))


def _compare(spec, config, lengths):
    for L in lengths:
        hf, hf_af = _hf_frequencies(config, L)
        ours, af = _relpos_frequencies(spec, L)
        # HF lists the rotated pairs only (partial rotary); relpos every pair, the rest at 0
        assert (ours[hf.numel():] == 0).all(), (L, ours, hf)
        ours = ours[:hf.numel()]
        # HF computes the frequencies in float32; the pairs that stand still are 0 in both
        assert ((ours - hf).abs() / hf.abs().clamp_min(1e-300)).max() < 2e-6, (L, ours, hf)
        assert abs(af - hf_af) < 1e-6, (L, af, hf_af)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_relpos_reads_hf_rope_parameters_as_they_are(case):
    """The core's own reading of ``config.rope_parameters`` (``PositionEncoding(rope_scaling=...)``)."""
    params, lengths = ROPE_CASES[case]
    config = _rope_config(params)
    enc = relpos.PositionEncoding("rope", D, HEADS, pair_layout="half_split",
                                  rope_scaling=config.rope_parameters,
                                  max_position_embeddings=config.max_position_embeddings)
    _compare(enc.spec, config, lengths)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_spec_for_gives_hf_frequencies(case):
    """relpos.transformers.spec_for(config): the spec apply() runs for the model's own RoPE."""
    params, lengths = ROPE_CASES[case]
    config = _rope_config(params)
    _compare(rt.spec_for(config), config, lengths)


# ---------------------------------------------------------------------------------------------
# docs/transformers.md: its scripts run as written


def _doc_block(name):
    text = (ROOT / "docs" / "transformers.md").read_text()
    blocks = re.findall(rf"<!-- test: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, name
    return blocks[0]


def test_doc_ten_line_script_runs():
    code = _doc_block("ten-line-script")
    assert len(code.strip().splitlines()) <= 12
    exec(compile(code, "docs/transformers.md", "exec"), {})


def test_doc_fine_tuning_example_runs():
    exec(compile(_doc_block("fine-tune"), "docs/transformers.md", "exec"), {})


def _bench_rows(script, toy_args, row_pattern, bad_args, bad_option):
    """bench_rows for the HF benches: `toy_args` on a one-layer hidden-64 model, one round, one
    thread."""
    return bench_rows(script, [*toy_args, "--rounds", "1", "--layers", "1", "--hidden", "64",
                               "--threads", "1"], row_pattern, bad_args, bad_option)


def test_generate_benchmark_runs_and_checks_tokens():
    """bench/bench_hf_generate.py at a toy size: it checks the switched model generates HF's
    tokens before timing, and prints one row per (ctx, heads) case."""
    rows = _bench_rows("bench_hf_generate.py", ["--ctx", "24,40", "--kv-heads", "8,2", "--new", "2"],
                       r"\| \d+ \| 8:\d \|", ["--kv-heads", "3"], "--kv-heads")
    assert len(rows) == 4, rows


def test_step_transform_benchmark_runs_and_checks_bits():
    """bench/bench_hf_step_transform.py at a toy size: it checks the step op gives the encoding
    path's bits before timing, and prints a warm and a cold row per heads case."""
    rows = bench_rows("bench_hf_step_transform.py", ["--rounds", "2", "--ctx", "16", "--threads", "1"],
                      r"\| 8:[82] \| (warm|cold) \|", ["--kv-heads", "3"], "--kv-heads")
    assert len(rows) == 4, rows


def test_packed_benchmark_runs_and_checks_gradients():
    """bench/bench_hf_packed.py at a toy size: it checks the loss and gradients of the switched
    model (kernel and materialised paths) against HF's before timing, one row per heads case."""
    rows = _bench_rows("bench_hf_packed.py", ["--tokens", "40", "--docs", "3", "--kv-heads", "8,2"],
                       r"\| 8:\d \|", ["--docs", "50", "--tokens", "40"], "--docs")
    assert len(rows) == 2, rows


def test_grouped_transform_names_bad_positions():
    """A grouped layer's transform expands the positions over the query group: positions of
    another length or batch are refused by name (InputError), not by torch's expand."""
    layer = rt.RelposAttention("rope", 16, 4, 2, scale=0.25)
    q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16)
    good = layer.transform(q, k, torch.arange(3.0, dtype=torch.float64))
    assert good[0].shape == q.shape and good[1].shape == k.shape
    for bad in (torch.arange(4.0, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64),
                torch.tensor(1.0, dtype=torch.float64)):
        with pytest.raises(relpos.InputError, match="position_ids"):
            layer.transform(q, k, bad)


def _step_layer(spec, hq, hk):
    """A switched layer for spec with its encoding's parameters jittered (nontrivial damping,
    couplings and gates), or None when the layer runs an engine or the spec does not build."""
    try:
        dim = module_checks.head_dim_for(spec, hk)
        layer = rt.RelposAttention(spec, dim, hq, hk, scale=dim ** -0.5)
    except (relpos.InputError, AssertionError):
        return None
    if layer.engine is not None:
        return None
    torch.manual_seed(3)
    module_checks.jittered(layer.encoding, 0.05)
    return layer


@pytest.fixture(params=["direct", "method"])
def step_call(request, monkeypatch):
    """The step op called as the operator library's Python function (the package's default) or
    as TorchScript's StepPlan.transform method (its fallback without one)."""
    if request.param == "method":
        monkeypatch.setattr(relpos._library, "STEPS", None)
    elif relpos._library.STEPS is None:
        pytest.fail("the operator library is no Python module (built without Python's headers)")
    return request.param


def test_step_transform_gives_the_encodings_bits(monkeypatch, step_call):
    """A switched layer's step of at most 8 tokens without autograd runs one StepPlan.transform
    call (the checks, the query grouping and the kernels in C++); with autograd on it runs the
    encoding. Across the catalog, for every mechanism the op takes (at least RoPE, its scaled
    forms, Jordan and the damped and coupled maps), MHA and GQA 4:2, float64, float32, bfloat16
    and float16, positions [T] and [B, T] far from 0, contiguous and strided q and k: the same
    bits as the encoding's path, or the same InputError."""
    step, calls = rt.RelposAttention._step, []
    monkeypatch.setattr(rt.RelposAttention, "_step",
                        lambda self, *a: calls.append(1) or step(self, *a))
    taken = []
    for spec in module_checks.CATALOG_SPECS:
        for hq, hk in ((2, 2), (4, 2)):
            layer = _step_layer(spec, hq, hk)
            if layer is None or not layer._step_transform:
                continue
            taken.append(spec)
            D = layer.head_dim
            g = torch.Generator().manual_seed(1)
            for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
                for pos in (torch.tensor([4093.0, 4094.5, 4100.0], dtype=torch.float64),
                            1000 * torch.rand(2, 3, generator=g, dtype=torch.float64),
                            torch.randint(0, 5000, (2, 3), generator=g)):  # HF's position_ids
                    # (with [B, T] positions, q and k as HF's layers make them: [B, T, H, D]
                    # projections viewed as [B, H, T, D], not contiguous)
                    q = torch.randn(2, 3, hq, D, generator=g).to(dtype).transpose(1, 2)
                    k = torch.randn(2, 3, hk, D, generator=g).to(dtype).transpose(1, 2)
                    if pos.dim() == 1:
                        q, k = q.contiguous(), k.contiguous()
                    outcome = []
                    for grad in (False, True):  # the op, then the encoding (autograd on)
                        qi, ki = q.clone().requires_grad_(grad), k.clone().requires_grad_(grad)
                        try:
                            with torch.set_grad_enabled(grad):
                                outcome.append(tuple(t.detach() for t in layer.transform(qi, ki, pos)))
                        except relpos.InputError as e:
                            outcome.append(type(e))
                    if not pos.is_floating_point() and isinstance(outcome[0], tuple):
                        # integers: as their float64 values
                        with torch.no_grad():
                            want = layer.transform(q.clone(), k.clone(), pos.to(torch.float64))
                        assert all(torch.equal(a, b) for a, b in zip(outcome[0], want)), spec
                    if isinstance(outcome[0], tuple) and isinstance(outcome[1], tuple):
                        for a, b in zip(*outcome):
                            assert a.dtype == dtype and a.is_contiguous()
                            assert torch.equal(a, b), (spec, hq, hk, dtype)
                    else:
                        assert outcome[0] == outcome[1], (spec, dtype, outcome)
    assert {"rope", "jordan", "damped_rope"} <= set(taken) and len(set(taken)) >= 8, sorted(set(taken))
    # every no-grad call (4 dtypes x 3 positions, and the integers' float64 twin) took the op
    assert len(calls) == 16 * len(taken)


def test_step_transform_follows_parameter_writes(step_call):
    """The step's op computes with kernel parameters cached from the schema's values; a write
    to a parameter (through ``.data``, which bumps no version counter, as EMA swaps do) is seen
    at the next step: the op finds the cached values stale and the layer recomputes them."""
    layer = _step_layer("damped_rope", 4, 2)
    q, k = torch.randn(1, 4, 2, layer.head_dim), torch.randn(1, 2, 2, layer.head_dim)
    pos = torch.tensor([50.0, 51.0], dtype=torch.float64)
    with torch.no_grad():
        before = layer.transform(q, k, pos)
        for p in layer.encoding.parameters():
            p.data.mul_(1.5).add_(0.01)
        after = layer.transform(q, k, pos)
    with torch.enable_grad():
        want = layer.transform(q.requires_grad_(), k.requires_grad_(), pos)
    assert not torch.equal(before[0], after[0])
    for a, b in zip(after, want):
        assert torch.equal(a, b.detach())


def test_step_transform_refuses_bad_input_by_name(step_call):
    """The step's op names NaN in q or k, and a shape the layer was not built for, as InputError
    (and changes nothing: the inputs are not written)."""
    layer = rt.RelposAttention("rope", 16, 4, 2, scale=0.25)
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16)
    pos = torch.tensor([7.0], dtype=torch.float64)
    for name in ("q", "k"):
        bad_q, bad_k = q.clone(), k.clone()
        (bad_q if name == "q" else bad_k)[0, 1, 0, 3] = float("nan")
        kept = (bad_q.clone(), bad_k.clone())
        with torch.no_grad(), pytest.raises(relpos.InputError, match=f"{name} contains NaN or Inf"):
            layer.transform(bad_q, bad_k, pos)
        for now, before in zip((bad_q, bad_k), kept):
            torch.testing.assert_close(now, before, rtol=0, atol=0, equal_nan=True)
    with torch.no_grad():
        with pytest.raises(relpos.InputError, match="transform step"):
            layer.transform(torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), pos)
        with pytest.raises(relpos.InputError, match="position_ids"):
            layer.transform(q, k, torch.tensor([1.0, 2.0], dtype=torch.float64))
        with pytest.raises(relpos.InputError, match="NaN or Inf"):
            layer.transform(q, k, torch.tensor([float("nan")], dtype=torch.float64))


def test_step_transform_warns_as_the_encoding(step_call):
    """Positions in float32 far out lose resolution: the step's op warns as the encoding does
    (once per layer), from the positions the caller gave, not from their float64 copy."""
    import warnings

    for grad in (False, True):
        layer = rt.RelposAttention("rope", 16, 4, 2, scale=0.25)
        q, k = torch.randn(1, 4, 1, 16, requires_grad=grad), torch.randn(1, 2, 1, 16, requires_grad=grad)
        pos = torch.tensor([3.0e6], dtype=torch.float32)
        with warnings.catch_warnings(record=True) as seen, torch.set_grad_enabled(grad):
            warnings.simplefilter("always")
            layer.transform(q, k, pos)
            layer.transform(q, k, pos)
        assert sum("resolves only steps" in str(w.message) for w in seen) == 1, (grad, seen)


def test_runtime_mechanisms_refuse_positions_that_would_let_tokens_see_later_ones():
    """relpos.Attention's causality follows the positions, HF's mask the token order: packed
    documents under an attention_mask of ones (positions restarting in a row) let a token see
    later ones (the first token's logits moved with the last token). Refused; without the mask
    HF finds the documents and nothing leaks; increasing positions run."""
    model = _model("llama", num_key_value_heads=4)
    rt.apply(model, "fox")
    torch.manual_seed(1)
    ids = torch.randint(1, 50, (1, 6))
    ones = torch.ones(1, 6, dtype=torch.long)
    later = ids.clone()
    later[0, 5] += 1
    with torch.no_grad():
        for pos in ([0, 1, 2, 0, 1, 2], [5, 6, 7, 0, 1, 2], [0, 1, 1, 2, 3, 4]):
            p = torch.tensor([pos])
            with pytest.raises(relpos.InputError, match="must increase"):
                model(ids, position_ids=p, attention_mask=ones, use_cache=False)
            if pos[3] == 0:  # packed documents without a mask: HF's per-document masks
                a = model(ids, position_ids=p, use_cache=False).logits
                b = model(later, position_ids=p, use_cache=False).logits
                assert torch.equal(a[0, :5], b[0, :5])
        p = torch.tensor([[3, 4, 6, 7, 9, 10]])
        a = model(ids, position_ids=p, attention_mask=ones, use_cache=False).logits
        b = model(later, position_ids=p, attention_mask=ones, use_cache=False).logits
        assert torch.equal(a[0, :5], b[0, :5])


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_attention_weights_are_refused_not_returned_empty(family):
    """HF returns the attention weights with output_attentions=True; a switched model never forms
    them and returned () or (None, None) silently. Refused, from the model, its base model and
    generate."""
    model = _model(family)
    rt.apply(model)
    ids = torch.randint(1, 50, (1, 5))
    for call in (lambda: model(ids, output_attentions=True),
                 lambda: model.base_model(ids, output_attentions=True),
                 lambda: model.generate(ids, max_new_tokens=2, output_attentions=True,
                                        return_dict_in_generate=True)):
        with pytest.raises(relpos.InputError, match="output_attentions"):
            call()
    assert model(ids).logits.shape[:2] == (1, 5)


def test_the_models_own_encoding_keeps_its_pairs():
    """spec=None promises the model's own encoding; interleaved pairs were accepted and gave
    another model (logits 1.5e-3 off HF's in float64)."""
    with pytest.raises(relpos.InputError, match="rotate_half"):
        rt.apply(_model("llama"), pair_layout="interleaved")
    rt.apply(_model("llama"), pair_layout="half_split")
