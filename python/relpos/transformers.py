"""Hugging Face transformers models on relpos attention (an optional extra: ``import
relpos.transformers`` needs the ``transformers`` package; ``import relpos`` does not).

    import relpos.transformers
    relpos.transformers.apply(model)                                      # the model's own encoding
    relpos.transformers.apply(model, "jordan(m=2, regime=scaled, c=1)")   # any relpos mechanism
    model = relpos.transformers.from_pretrained(LlamaForCausalLM, path)   # a switched checkpoint

:func:`apply` switches every attention layer of a loaded model (``supported()`` lists the
families) to relpos: the layer's projections are kept, the model's own position encoding
(rotary embedding, ALiBi tensor) is no longer applied, and each layer runs the mechanism's
transforms (a :class:`relpos.PositionEncoding` over the key/value heads, registered as the layer's
``relpos`` submodule so its parameters train and are saved) on q and k at the model's positions,
stores the transformed keys in Hugging Face's own cache (``DynamicCache``), and scores them with
:func:`relpos.fused_attention` (causal, grouped-query heads, sliding windows, ALiBi slopes and
learned lag tables, padding, packed documents). Mechanisms with runtime state run through
:class:`relpos.Attention` instead, decoding through its cache inside HF's. docs/transformers.md.
"""

from __future__ import annotations

import json
import math

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.cache_utils import CacheLayerMixin
    from transformers.masking_utils import (
        AttentionMaskInterface,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
except ImportError as e:  # pragma: no cover - the optional dependency is missing
    raise ImportError(
        "relpos.transformers needs Hugging Face transformers 5.x (pip install transformers==5.24.0, "
        "the version requirements.txt pins); the relpos package itself does not"
    ) from e

import torch
from torch import nn

from . import mechanism
from .attention import fused_attention
from .encoding import (_OP_BUILT_TRIG_ROWS, InputError, PositionEncoding, _compute_dtype, _op,
                       rope_parameters_spec)
from .engine import Attention, KVCache

__all__ = ["apply", "from_pretrained", "spec_for", "supported", "RelposAttention", "EngineCacheLayer"]

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover - an old install
    raise ImportError(f"relpos.transformers needs transformers >= 5 (its AttentionMaskInterface and "
                      f"Cache API); found {transformers.__version__}")

# The name under which the mask function below (and a guard attention function) are registered;
# apply() sets it as the model's attention implementation, so HF builds masks with our function.
IMPLEMENTATION = "relpos"



# ---------------------------------------------------------------------------------------------
# masks: what HF's create_causal_mask hands the layers when the implementation is "relpos"


def _intervals(valid: torch.Tensor) -> torch.Tensor | None:
    """Per row, the key range [start, end) where ``valid [B, Tk]`` is true, as int64 [B, 1, 1, 2]
    (empty rows: 0, 0), or None when some row's valid keys are not one contiguous range."""
    B, Tk = valid.shape
    idx = torch.arange(Tk, device=valid.device)
    count = valid.sum(-1)
    start = torch.where(valid, idx, Tk).amin(-1)
    end = torch.where(valid, idx + 1, 0).amax(-1)
    empty = count == 0
    if not bool(((end - start == count) | empty).all()):
        return None
    start, end = torch.where(empty, 0, start), torch.where(empty, 0, end)
    return torch.stack([start, end], -1).to(torch.int64).view(B, 1, 1, 2)


def _documents(full: torch.Tensor, standard: torch.Tensor) -> torch.Tensor | None:
    """Packed documents: when the boolean mask ``full [B, 1, T, T]`` (queries and keys at the
    same slots) is ``standard [T, T]`` (causal, the window) within runs of consecutive tokens and
    nothing across them, the runs' ids as int32 [B, 1, 1, T] (each row's documents numbered
    from 0); else None. A run starts at token i when query i does not see key i - 1."""
    B, _, T, _ = full.shape
    if T < 2:
        return None
    starts = torch.ones(B, T, dtype=torch.int32, device=full.device)
    starts[:, 1:] = (~full[:, 0].diagonal(-1, -2, -1)).to(torch.int32)
    ids = starts.cumsum(-1, dtype=torch.int32) - 1
    for b in range(B):  # a row at a time: one more [T, T] mask at most beside HF's
        if not torch.equal(full[b, 0], standard & (ids[b, :, None] == ids[b, None, :])):
            return None
    return ids.view(B, 1, 1, T)


def _compact_form(mask, B: int, Tk: int):
    """The compact forms relpos_mask returns, read back by a layer: ``("ranges", [B, 2])`` for
    int64 ``[B, 1, 1, 2]``, ``("documents", [B, Tk] int64)`` for int32 ``[B, 1, 1, Tk]``; None for
    anything else."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and tuple(mask.shape[:3]) == (B, 1, 1):
        if mask.dtype == torch.int64 and mask.shape[3] == 2:
            return "ranges", mask.view(B, 2)
        if mask.dtype == torch.int32 and mask.shape[3] == Tk:
            return "documents", mask.view(B, Tk).to(torch.int64)
    return None


def relpos_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=None, local_size=None,
                use_vmap=False, device="cpu", **kwargs):
    """HF mask interface for relpos layers (registered as ``"relpos"``). Returns

    - ``None``: causal (and the layer's sliding window) over every key, no padding;
    - an int64 tensor ``[B, 1, 1, 2]``: the same, restricted to the keys ``start <= j < end`` of
      each row (left and right padding), which the kernel runs with ``key_start`` / ``key_len``;
    - an int32 tensor ``[B, 1, 1, T]``: the same within packed documents (HF detects them from
      position_ids that restart, without a cache or padding mask), document ids of the tokens,
      which the kernel runs with ``q_segments`` / ``k_segments``;
    - a boolean tensor ``[B, 1, Tq, Tk]`` (HF's sdpa mask) for any other pattern (holes in the
      padding, custom mask functions), which the layer runs on a slower materialised path
      (SDPA with an additive mask).

    The shape is 4-D so that masks prepared in advance (``generate`` with a compileable cache)
    pass through HF's mask creation untouched; the dtype tells the forms apart.
    """
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    valid = None if padding is None else padding[:, kv_offset: kv_offset + kv_length].bool()
    if mask_function is causal_mask_function and local_size is None:
        if valid is None or bool(valid.all()):
            return None
        ranges = _intervals(valid)
        if ranges is not None:
            return ranges
    full = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap,
                     device=device)
    # the standard pattern (valid keys, causal, window of local_size) runs through the kernel
    qi = torch.arange(q_length, device=full.device) + q_offset
    kj = torch.arange(kv_length, device=full.device) + kv_offset
    standard = kj[None, :] <= qi[:, None]
    if local_size is not None:
        standard = standard & (kj[None, :] > qi[:, None] - local_size)
    keys = (torch.ones(batch_size, kv_length, dtype=torch.bool, device=full.device) if valid is None
            else valid)
    if torch.equal(full, (standard[None, None] & keys[:, None, None, :]).expand_as(full)):
        if bool(keys.all()):
            return None
        ranges = _intervals(keys)
        if ranges is not None:
            return ranges
    if q_length == kv_length and q_offset == kv_offset and bool(keys.all()):
        documents = _documents(full, standard)
        if documents is not None:
            return documents
    return full


def _unswitched_attention(module, *args, **kwargs):
    raise InputError(f"{type(module).__name__} asked for the '{IMPLEMENTATION}' attention function: "
                     "relpos.transformers.apply() switches whole attention layers, and this one was "
                     "not switched (unsupported layer type)")


AttentionMaskInterface.register(IMPLEMENTATION, relpos_mask)
AttentionInterface.register(IMPLEMENTATION, _unswitched_attention)


# ---------------------------------------------------------------------------------------------
# the per-layer module


def _spec_refusal(info: dict) -> str | None:
    """Why the HF layers cannot run this mechanism at all, or None."""
    for t in info["transforms"]:
        if t["kind"] == "vector_rotation":
            return (f"{info['spec']!r} rotates by vector positions [T, d_c]; a language model's "
                    "tokens have scalar positions")
    return None


def _runtime_state(info: dict) -> str | None:
    """What of this mechanism lives in relpos.Attention's runtime rather than in a position
    transform of q and k plus ALiBi slopes and lag tables (None: nothing). Such layers run
    through relpos.Attention and decode through an EngineCacheLayer."""
    for t in info["transforms"]:
        if t.get("learned_frequencies") or t.get("basis", "none") != "none":
            return "learns its frequencies or basis in the layer"
        if t.get("values") or t.get("outputs"):
            return "turns values and outputs by frames along the sequence (journey)"
    for b in info["biases"]:
        if b["shape"] != "lag_table":
            return f"computes bias {b['name']!r} ({b['shape'].replace('_', '-')}) from the tokens"
    return None


class EngineCacheLayer(CacheLayerMixin):
    """One layer of a Hugging Face cache for a mechanism with runtime state: the layer's decode
    state is a :class:`relpos.KVCache` (transformed keys, values, positions and the runtime's
    per-token state, e.g. FoX's forget-gate sums), with each row's first visible slot
    (``key_start``, left padding). HF's cache holds it in place of its own layer for that index
    (RelposAttention installs it into an empty cache), so HF's bookkeeping (lengths for masks and
    positions, beam reordering, batch expansion) reaches relpos's state. Cropping (assisted
    decoding) is refused: the runtime's scanned state cannot be rewound."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, kv: KVCache, key_start: torch.Tensor | None):
        super().__init__()
        self.kv, self.key_start, self.tokens = kv, key_start, 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise InputError("this cache layer holds a relpos mechanism's decode state; only its "
                         "relpos attention layer appends to it")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        """Empties the layer; the next prompt builds a new one for its own rows."""
        self.kv.reset()
        self.tokens, self.key_start = 0, None

    def _select(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)
        if self.key_start is not None:
            self.key_start = self.key_start.index_select(0, rows.to(self.key_start.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx.to(torch.int64))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(torch.arange(self.kv.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = indices.nonzero().flatten() if indices.dtype == torch.bool else indices
        self._select(rows.to(torch.int64))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise InputError("a relpos mechanism with runtime state cannot drop cached tokens "
                             "(crop: assisted or speculative decoding); generate without them")


class RelposAttention(nn.Module):
    """The relpos part of one switched HF attention layer (registered on it as ``relpos``).

    Owns ``encoding``, a :class:`relpos.PositionEncoding` over the key/value heads (its
    parameters, state-dict names ``<layer>.relpos.encoding.<name>``). ``forward(q, k, v, cache,
    layer_idx, position_ids, mask)`` takes the new tokens' untransformed q ``[B, Hq, T, D]``, k
    and v ``[B, Hk, T, D]``, transforms q and k at ``position_ids`` (HF's positions; default the
    cache slots), appends the transformed k and v to ``cache`` (an HF ``DynamicCache``) and
    returns the attention output ``[B, Hq, T, D]`` over every cached key, with the mask's
    visibility. The kernel scores at the cache slots (HF's causal and sliding-window masks are
    defined on them), so ALiBi slopes and lag tables see the slot lag, which is the position lag
    whenever each row's visible tokens are consecutive (padding on either side, packed documents).

    A mechanism with runtime state (``runtime_state`` says which) owns ``engine`` instead, a
    :class:`relpos.Attention` (``<layer>.relpos.engine.<name>``), and ``forward(...,
    inputs=hidden_states)`` runs it; with a cache its decode state is an
    :class:`EngineCacheLayer` in HF's cache.
    """

    def __init__(self, spec: str, head_dim: int, num_heads: int, num_kv_heads: int, *,
                 scale: float, window: float = 0.0, dropout: float = 0.0, slope_scale: float = 1.0,
                 pair_layout: str = "half_split", check_finite: bool = True,
                 model_dim: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise InputError(f"key/value heads ({num_kv_heads}) must divide query heads ({num_heads})")
        # a learned lag table: a row per query head
        encoding = PositionEncoding(spec, head_dim, num_kv_heads, pair_layout=pair_layout,
                                    check_finite=check_finite, bias_heads=num_heads)
        self.spec = encoding.spec
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        info = mechanism(self.spec, head_dim, num_heads)
        why = _spec_refusal(info) or torch.ops.relpos.attention_refusal(
            self.spec, head_dim, num_kv_heads)
        if why:
            raise InputError(why)
        self.runtime_state = _runtime_state(info)
        self.scale, self.window, self.dropout = float(scale), float(window or 0.0), float(dropout)
        if self.runtime_state is not None:
            # the engine's layer: its encoding, gates, probes and frames (parameters under
            # ``<layer>.relpos.engine.``), the hidden states as its inputs
            self.engine = Attention(self.spec, head_dim, num_heads, num_kv_heads,
                                    pair_layout=pair_layout, window=self.window, scale=self.scale,
                                    check_finite=check_finite, model_dim=model_dim)
            return
        self.engine = None
        self.encoding = encoding
        self._has_transform = bool(info["transforms"])
        # a step's few tokens without autograd in one op call (transform_step): one position term
        self._step_transform = self._has_transform and not torch.ops.relpos.transform_step_refusal(
            self.spec, head_dim, num_kv_heads)
        self._center_mid = info["center"] == "mid"
        slopes = [s for b in info["biases"] if b["slopes"] for s in b["slopes"]]
        self._slopes = ([float(s) * slope_scale for s in slopes] if slopes else None)
        self._lag_table = any(b["learned"] for b in info["biases"])

    def extra_repr(self) -> str:
        return (f"spec={self.spec!r}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"window={self.window:g}")

    def _step(self, q, k, positions):
        """The transform of a step's few tokens in one C++ call (StepPlan.transform; a second
        only after the parameters changed)."""
        enc = self._modules["encoding"]
        transform = enc._step_call("transform")
        for _ in range(2):
            qt, kt, warned, stale = _op(transform, q, k, positions, enc._schema_tensors(),
                                        enc.layout, enc.check_finite, enc._warned)
            if not stale:
                break
            enc._refresh_step_plan(_compute_dtype(q.dtype))
        else:  # (never: the plan holds the present parameters after one refresh)
            raise RuntimeError("relpos: the step transform found its parameters stale twice")
        if warned != enc._warned:  # (nn.Module.__setattr__ is slow: only on a change)
            enc._warned = warned
        return qt, kt

    def transform(self, q, k, positions):
        """q ``[B, Hq, T, D]`` and k ``[B, Hk, T, D]`` through the encoding at ``positions``
        (``[T]`` or ``[B, T]``; float64, or int64 as HF's position_ids), every query head through
        its key/value head's map (HF's grouping: query head h uses key/value head h // (Hq / Hk));
        one call, so one centre and one context length for both."""
        if self.engine is not None:
            raise InputError(f"{self.spec!r} {self.runtime_state}: its transform runs inside "
                             "relpos.Attention (this layer's engine), not alone")
        if not self._has_transform:
            return q, k
        B, Hq, T, D = q.shape
        Hk = k.shape[1]
        g = Hq // Hk
        enc = self.encoding
        step = (self._step_transform and T <= _OP_BUILT_TRIG_ROWS and q.device.type == "cpu"
                and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and (
                    q.requires_grad or k.requires_grad
                    or any(p.requires_grad for p in enc.parameters()))))
        if g == 1 and not step:
            return self.encoding(q, k, positions)
        if positions.dim() not in (1, 2) or positions.shape[-1] != T or (
                positions.dim() == 2 and positions.shape[0] != B):
            raise InputError(f"position_ids: expected [{T}] or [{B}, {T}] positions, got "
                             f"{list(positions.shape)}")
        if step:
            # a decode step: the checks, the grouping and the kernels in one C++ call (the
            # module's Python and dispatch cost more than the transform of a few tokens)
            return self._step(q, k, positions)
        both = torch.cat([q.reshape(B, Hk, g * T, D), k], 2)
        # the positions once per query head of the group and once for the keys (expanded, not
        # repeat: aten::repeat costs several times a copy at a decode step's sizes)
        pos = (positions.expand(g + 1, T).reshape(-1) if positions.dim() == 1
               else positions.unsqueeze(1).expand(B, g + 1, T).reshape(B, -1))
        tq, tk = self.encoding(both, both, pos)
        return tq[:, :, : g * T].reshape(B, Hq, T, D), tk[:, :, g * T:]

    def forward(self, q, k, v, cache=None, layer_idx: int = 0, position_ids=None, mask=None,
                inputs=None):
        if self.training and self.dropout > 0:
            raise InputError(f"attention dropout {self.dropout:g}: the fused kernel has none; set "
                             "the config's attention dropout to 0 to train through relpos")
        if self.engine is not None:
            return self._engine_forward(q, k, v, cache, layer_idx, position_ids, mask, inputs)
        B, Hq, T, D = q.shape
        q_offset = kv_offset = 0
        if cache is not None:
            if getattr(cache, "is_compileable", False):
                raise InputError(f"{type(cache).__name__}: relpos.transformers decodes with "
                                 "DynamicCache (generate's default), not a static cache")
            if self._center_mid:
                raise InputError(f"{self.spec!r}: center=mid puts the centre in the middle of each "
                                 "call, so keys cached in earlier calls would be off; use a fixed "
                                 "centre to decode")
            # HF's own mask geometry for this layer, read before the update (as create_causal_mask)
            q_offset = int(cache.get_query_offset(layer_idx))
            _, kv_offset = cache.get_mask_sizes(T, layer_idx)
            kv_offset = int(kv_offset)
        # (HF's int64 position_ids go as they are: the checks widen them exactly, and a
        # conversion op per layer and step costs more than the step's transform)
        pos = (torch.arange(q_offset, q_offset + T, dtype=torch.float64) if position_ids is None
               else position_ids)
        if pos.dim() == 2 and pos.shape[0] == 1 and B != 1:
            pos = pos[0]  # (HF's one row of positions for every row)
        q, k = self.transform(q, k, pos)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        Tk = k.shape[2]
        if kv_offset == 0 and q_offset + T == Tk:
            # the kernel's default geometry (keys at slots 0..Tk-1, queries the last T): no
            # position tensors to build and check per layer and step
            return self.attend(q, k, v, None, None, mask)
        qslot = torch.arange(q_offset, q_offset + T, dtype=torch.float64)
        kslot = torch.arange(kv_offset, kv_offset + Tk, dtype=torch.float64)
        return self.attend(q, k, v, qslot, kslot, mask)

    def _engine_forward(self, q, k, v, cache, layer_idx, position_ids, mask, inputs):
        """A mechanism with runtime state (``runtime_state``) through relpos.Attention, with HF's
        padding and packed documents as the kernel's masks. With a cache, the layer's decode state
        lives in an :class:`EngineCacheLayer` installed into HF's cache at the prompt."""
        B, _, T, _ = q.shape
        pos = None if position_ids is None else position_ids.to(torch.float64)
        if pos is not None and pos.dim() == 2 and pos.shape[0] == 1:
            pos = pos[0]
        start = end = segments = None  # each row's visible keys [start, end) (host int64)
        form = _compact_form(mask, B, T)
        if form is not None and form[0] == "ranges":
            ranges = form[1].to("cpu")
            start, end = ranges[:, 0].clone(), ranges[:, 1].clone()
        elif form is not None:
            segments = form[1]
        elif mask is not None:
            got = (f"a {mask.dtype} {list(mask.shape)} mask" if isinstance(mask, torch.Tensor)
                   else type(mask).__name__)
            raise InputError(f"{self.spec!r} {self.runtime_state}, so it runs through the kernel "
                             f"only; {got} (a hole in the padding, a custom mask) needs the "
                             "materialised path")
        if cache is None:
            pos = self._padded_positions(pos, start, 0, B, T)
            self._refuse_unordered(pos, start, end, segments)
            return self.engine(q, k, v, positions=pos, inputs=inputs, segments=segments,
                               key_start=None if start is None or not bool((start > 0).any()) else start,
                               key_len=end)
        if getattr(cache, "is_compileable", False):
            raise InputError(f"{type(cache).__name__}: relpos.transformers decodes with "
                             "DynamicCache (generate's default), not a static cache")
        layer = self._engine_layer(cache, layer_idx, q, k)
        past = layer.tokens
        # relpos's cache keeps detached keys (it is for inference): a step over cached tokens
        # would lose their gradients, and a prompt's gradients come from a call without it
        grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k, v, *self.engine.parameters(),
                                      *([inputs] if isinstance(inputs, torch.Tensor) else [])))
        if past and grad:
            raise InputError(f"{self.spec!r} {self.runtime_state}: a step over cached tokens with "
                             "autograd on would lose the cached tokens' gradients (relpos's cache "
                             "keeps detached keys); decode under torch.no_grad(), or train on whole "
                             "sequences (use_cache=False)")
        Tk = past + T
        if start is None:
            start, end = torch.zeros(B, dtype=torch.int64), torch.full((B,), Tk, dtype=torch.int64)
        if past == 0:
            empty = end == 0  # a row of padding only: all of it hidden, later tokens visible
            start, end = torch.where(empty, Tk, start), torch.where(empty, Tk, end)
            layer.key_start = start
        # the keys this call sees are the cache's slots 0..Tk-1: HF's mask must be the causal one
        # over them with each row's first visible slot the prompt's
        if segments is not None or not bool((end == Tk).all()) or not torch.equal(start, layer.key_start):
            raise InputError(f"{self.spec!r} {self.runtime_state}: with a cache it takes left "
                             "padding set at the prompt and causal masks after it (no right "
                             "padding, packed documents or a changed padding mask)")
        left = bool((layer.key_start > 0).any())
        pos = self._padded_positions(pos, layer.key_start if left else None, past, B, T)
        padding = {"key_start": layer.key_start} if left else {}
        if grad:  # the output with its gradients, then the decode state without them
            out = self.engine(q, k, v, positions=pos, inputs=inputs, **padding)
            with torch.no_grad():
                self.engine(q, k, v, positions=pos, inputs=inputs, cache=layer.kv, **padding)
        else:
            out = self.engine(q, k, v, positions=pos, inputs=inputs, cache=layer.kv, **padding)
        layer.tokens += T
        return out

    def _refuse_unordered(self, pos, start, end, segments):
        """The engine's causality is by position (p_j <= p_i), HF's mask by token order: they
        agree only where positions increase along each row's visible tokens (within each packed
        document). Anywhere else a token would see later ones: refused."""
        if pos is None or pos.shape[-1] < 2:
            return
        rows = pos if pos.dim() == 2 else pos[None]
        ahead = rows[:, 1:] > rows[:, :-1]  # [b, t]: slot t + 1 after slot t
        T = rows.shape[1]
        pair = torch.arange(1, T)  # the later slot of each adjacent pair
        seen = torch.ones_like(ahead)
        if start is not None:
            seen &= (pair[None, :] - 1 >= start[:, None]) & (pair[None, :] < end[:, None])
        if segments is not None:
            seen &= segments[:, 1:] == segments[:, :-1]
        if bool((seen & ~ahead).any()):
            raise InputError(f"{self.spec!r} {self.runtime_state}, so it runs relpos.Attention, "
                             "whose causality follows the positions: position_ids must increase "
                             "along each row's visible tokens (packed documents under an "
                             "attention_mask of ones would let a token see later ones; pass them "
                             "without the mask, and HF masks each document)")

    def _padded_positions(self, pos, start, past, B, T):
        """The positions of a call's tokens at slots past..past+T-1 for the engine, with left
        padding up to ``start [B]``: HF's where given (the padding's, which HF sets to 1, moved
        below each row's first real position, so that they increase along the row as a cache
        requires; the padding stays hidden), else each slot minus its row's padding (the
        model's own count, as Bloom's ALiBi counts unmasked tokens)."""
        if start is None or not bool((start > 0).any()):
            return pos
        slots = torch.arange(past, past + T, dtype=torch.float64)
        if pos is None:
            return slots[None, :] - start[:, None].to(torch.float64)
        pos = (pos if pos.dim() == 2 else pos.expand(B, T)).clone()
        for b, s0 in enumerate((start - past).tolist()):
            if s0 > 0:
                first = float(pos[b, s0]) if s0 < T else 0.0
                pos[b, : min(s0, T)] = first - torch.arange(min(s0, T), 0, -1, dtype=torch.float64)
        return pos

    def _engine_layer(self, cache, layer_idx, q, k):
        """This layer's EngineCacheLayer in HF's cache, installed into an empty slot at the
        prompt (a cache that HF or another user filled otherwise is refused; an emptied one, e.g.
        by ``cache.reset()``, is built anew for the new prompt's rows)."""
        layers = cache.layers
        if (layer_idx < len(layers) and isinstance(layers[layer_idx], EngineCacheLayer)
                and layers[layer_idx].tokens > 0):
            return layers[layer_idx]
        if layer_idx < len(layers) and not isinstance(layers[layer_idx], EngineCacheLayer) and (
                layers[layer_idx].get_seq_length() > 0):
            raise InputError(f"{self.spec!r} {self.runtime_state}: this cache already holds keys "
                             "that were not cached through relpos; start from an empty cache")
        make = getattr(cache, "layer_class_to_replicate", None)
        while len(layers) <= layer_idx:
            if make is None:
                raise InputError(f"{type(cache).__name__} has no layer {layer_idx}")
            layers.append(make())
        kv = KVCache(q.shape[0], k.shape[1], k.shape[3], dtype=k.dtype, device=k.device,
                     capacity=q.shape[2])
        layer = EngineCacheLayer(kv, None)
        layers[layer_idx] = layer
        return layer

    # -- scoring

    def _bias_args(self, qslot, kslot, Tq, Tk, dtype) -> dict:
        out = {}
        if self._slopes is not None:
            out["slopes"] = torch.tensor(self._slopes, dtype=dtype)
        if self._lag_table:
            if not (Tq and Tk):
                span = 0.0
            elif qslot is None:  # the default geometry: the last query at Tk - 1, keys from 0
                span = float(Tk - 1)
            else:
                span = float(qslot.max() - kslot.min())
            out["lag_table"] = self.encoding.attention_lag_table(span).to(dtype)
        return out

    def attend(self, q, k, v, qslot, kslot, mask):
        """Softmax attention of the transformed q over the transformed k at the slot positions
        (both None: the kernel's default, keys at 0..Tk-1 and queries the last Tq), with the mask
        HF built (see :func:`relpos_mask`)."""
        kw = dict(q_positions=qslot, k_positions=kslot, causal=True, window=self.window,
                  scale=self.scale,
                  **self._bias_args(qslot, kslot, q.shape[2], k.shape[2], q.dtype))
        if mask is None:
            return fused_attention(q, k, v, **kw)[0]
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise InputError(f"attention mask: expected a 2-D padding mask on the model (HF builds the "
                             f"layers' masks) or a boolean [B, 1, Tq, Tk] mask, got {got}")
        B, _, Tq, _ = q.shape
        Tk = k.shape[2]
        form = _compact_form(mask, B, Tk)
        if form is not None and form[0] == "ranges":
            return _padded_attention(q, k, v, form[1], kw)
        if form is not None:  # packed documents: queries at the keys' slots
            if Tq != Tk:
                raise InputError(f"attention mask: document ids [B, 1, 1, T] for {Tq} queries "
                                 f"over {Tk} keys (they take queries and keys at the same slots)")
            return fused_attention(q, k, v, q_segments=form[1], k_segments=form[1], **kw)[0]
        if mask.dtype != torch.bool:
            raise InputError(f"attention mask: a {mask.dtype} 4-D mask is not read (additive masks "
                             "may carry biases); pass a boolean one (True: visible)")
        if mask.shape[1] != 1 or mask.shape[0] != B or tuple(mask.shape[2:]) != (Tq, Tk):
            raise InputError(f"attention mask: expected [B, 1, Tq, Tk] = [{B}, 1, {Tq}, {Tk}], "
                             f"got {list(mask.shape)}")
        return _masked_attention(q, k, v, mask[:, 0], qslot, kslot, kw)


def _padded_attention(q, k, v, ranges, kw):
    """The kernel over the keys ``ranges[b, 0] <= j < ranges[b, 1]`` of each row (left and right
    padding), in one call."""
    start, end = ranges[:, 0].contiguous(), ranges[:, 1].contiguous()
    return fused_attention(q, k, v, key_start=start, key_len=end, **kw)[0]


def _masked_attention(q, k, v, visible, qslot, kslot, kw):
    """Any boolean mask ``visible [B, Tq, Tk]``: torch's SDPA with the mask and the kernel's biases
    (``- slope_h (p_i - p_j) + table_h[p_i - p_j]``) as one additive mask, as HF runs such masks.
    Rows without a visible key give zeros (SDPA sees every key there, and the rows are zeroed:
    no NaN in the output or the gradients). A NaN or Inf in a key or value makes the rows that see
    it NaN and no other. Slower than the kernel; differentiable."""
    B, Hq, Tq, D = q.shape
    Tk = k.shape[2]
    empty = ~visible.any(-1)  # [B, Tq]
    vis = (visible | empty[..., None])[:, None]  # [B, 1, Tq, Tk]
    mask = vis
    if "slopes" in kw or "lag_table" in kw:
        if qslot is None:  # the default geometry
            kslot = torch.arange(Tk, dtype=torch.float64)
            qslot = kslot[Tk - Tq:]
        lag = (qslot[:, None] - kslot[None, :]).to(q.device)
        bias = torch.zeros(Hq, Tq, Tk, dtype=q.dtype, device=q.device)
        if "slopes" in kw:
            bias = bias - kw["slopes"].to(q.device)[:, None, None] * lag.to(q.dtype)
        if "lag_table" in kw:
            table = kw["lag_table"]
            idx = lag.round().clamp(0, table.shape[1] - 1).long().to(table.device)
            bias = bias + table[:, idx].to(q.device)
        mask = bias.masked_fill(~vis, float("-inf"))
    # a NaN or Inf in a key or value would reach rows that do not see it (a masked score is
    # NaN + -inf, a zero weight times NaN is NaN): SDPA takes them as zeros, and the rows that
    # see one become NaN (in every column for a key, in its column for a value)
    bad_k, bad_v = ~torch.isfinite(k).all(-1), ~torch.isfinite(v)  # [B, Hk, Tk], [B, Hk, Tk, D]
    nonfinite = bool(bad_k.any()) or bool(bad_v.any())
    if nonfinite:
        k, v = k.masked_fill(bad_k[..., None], 0), v.masked_fill(bad_v, 0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=kw["scale"], enable_gqa=Hq != k.shape[1])
    if nonfinite:
        g = Hq // k.shape[1]
        seen = visible[:, None].to(q.dtype)  # [B, 1, Tq, Tk]
        rows = ((seen @ bad_k.to(q.dtype)[..., None]) > 0).repeat_interleave(g, 1)
        cols = ((seen @ bad_v.to(q.dtype)) > 0).repeat_interleave(g, 1)
        out = out.masked_fill(rows | cols, float("nan"))
    return out.masked_fill(empty[:, None, :, None], 0) if bool(empty.any()) else out


# ---------------------------------------------------------------------------------------------
# the families: how each one's attention layer projects q, k, v and finishes


def _projected_forward(self, hidden_states, attention_mask, cache, kwargs, out_proj, qk_norm=None):
    """q, k, v from separate projections (Llama-like layers), relpos attention, the output
    projection; ``qk_norm`` normalises q and k first (Phi's q/k layer norms)."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if qk_norm is not None:
        q, k = qk_norm(q, k)
    out = self.relpos(q, k, v, cache, self.layer_idx, kwargs.get("position_ids"), attention_mask,
                      hidden_states)
    out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
    return out_proj(out), None


def _llama_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                   **kwargs):
    return _projected_forward(self, hidden_states, attention_mask, cache, kwargs, self.o_proj)


def _phi_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                 **kwargs):
    norm = (lambda q, k: (self.q_layernorm(q), self.k_layernorm(k))) if self.qk_layernorm else None
    return _projected_forward(self, hidden_states, attention_mask, cache, kwargs, self.dense, norm)


def _neox_forward(self, hidden_states, attention_mask=None, layer_past=None,
                  position_embeddings=None, **kwargs):
    input_shape = hidden_states.shape[:-1]
    qkv = self.query_key_value(hidden_states).view(*input_shape, -1, 3 * self.head_size).transpose(1, 2)
    q, k, v = qkv.chunk(3, dim=-1)
    out = self.relpos(q, k, v, layer_past, self.layer_idx, kwargs.get("position_ids"), attention_mask,
                      hidden_states)
    out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
    return self.dense(out), None


def _bloom_forward(self, hidden_states, residual, attention_mask=None, layer_past=None,
                   use_cache=False, output_attentions=False, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add

    B, T, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))
    out = self.relpos(q, k, v, layer_past, self.layer_idx, None, attention_mask, hidden_states)
    context = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:  # as BloomAttention
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            lo, hi = int(i * slices), int((i + 1) * slices)
            output = output + nn.functional.linear(context[:, :, lo:hi], self.dense.weight[:, lo:hi])
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


def _falcon_forward(self, hidden_states, attention_mask=None, position_ids=None,
                    layer_past=None, use_cache=False, output_attentions=False,
                    position_embeddings=None, **kwargs):
    B, T, _ = hidden_states.shape
    fused = self.query_key_value(hidden_states)
    if self.new_decoder_architecture:
        qkv = fused.view(B, T, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
        q, k, v = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    elif not self.multi_query:
        qkv = fused.view(B, T, self.num_heads, 3, self.head_dim)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    else:
        qkv = fused.view(B, T, self.num_heads + 2, self.head_dim)
        q, k, v = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = self.relpos(q, k, v, layer_past, self.layer_idx, position_ids, attention_mask,
                      hidden_states)
    out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
    return self.dense(out), None


def _llama_heads(m, config):
    return m.head_dim, config.num_attention_heads, config.num_key_value_heads


def _family(model_type: str):
    """(attention class, forward, heads(module, config) -> (D, Hq, Hk), scale(module), window,
    dropout) of a supported family, importing its HF module lazily."""
    import importlib

    def cls(mod, name):
        return getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), name)

    if model_type in ("llama", "mistral", "qwen2"):
        name = {"llama": "LlamaAttention", "mistral": "MistralAttention", "qwen2": "Qwen2Attention"}
        return dict(
            cls=cls(model_type, name[model_type]), forward=_llama_forward, heads=_llama_heads,
            scale=lambda m: m.scaling, dropout=lambda m: float(m.attention_dropout),
            # Mistral's window is the config's (all layers); Qwen2's is per layer (layer_types)
            window=lambda m, c: (m.sliding_window if hasattr(m, "sliding_window")
                                 else getattr(c, "sliding_window", None) if model_type == "mistral"
                                 else None),
        )
    if model_type == "phi":
        return dict(
            cls=cls("phi", "PhiAttention"), forward=_phi_forward, heads=_llama_heads,
            scale=lambda m: m.scaling, dropout=lambda m: float(m.attention_dropout),
            window=lambda m, c: None,
        )
    if model_type == "gpt_neox":
        return dict(
            cls=cls("gpt_neox", "GPTNeoXAttention"), forward=_neox_forward,
            heads=lambda m, c: (m.head_size, c.num_attention_heads, c.num_attention_heads),
            scale=lambda m: m.scaling, dropout=lambda m: float(m.attention_dropout),
            window=lambda m, c: None,
        )
    if model_type == "bloom":
        return dict(
            cls=cls("bloom", "BloomAttention"), forward=_bloom_forward,
            heads=lambda m, c: (m.head_dim, m.num_heads, m.num_heads),
            scale=lambda m: m.inv_norm_factor, dropout=lambda m: float(m.attention_dropout.p),
            window=lambda m, c: None,
        )
    if model_type == "falcon":
        return dict(
            cls=cls("falcon", "FalconAttention"), forward=_falcon_forward,
            heads=lambda m, c: (m.head_dim, m.num_heads, m.num_kv_heads),
            scale=lambda m: m.inv_norm_factor, dropout=lambda m: float(m.attention_dropout.p),
            window=lambda m, c: None,
        )
    return None


# model_type -> the model classes transformers has for it (documentation and error messages)
_SUPPORTED = {
    "bloom": "Bloom (ALiBi)",
    "falcon": "Falcon (RoPE, or ALiBi with alibi=True; multi-query and new decoder architecture)",
    "gpt_neox": "GPT-NeoX (partial RoPE)",
    "llama": "Llama (RoPE with its rope_parameters, grouped-query heads)",
    "mistral": "Mistral (RoPE, grouped-query heads, sliding window)",
    "phi": "Phi (partial RoPE, grouped-query heads, optional q/k layer norms)",
    "qwen2": "Qwen2 (RoPE, grouped-query heads, per-layer sliding window)",
}


def supported() -> dict[str, str]:
    """The supported families: HF ``config.model_type`` -> what relpos runs for it with
    ``spec=None``. Every model class of a family (``...ForCausalLM``, ``...Model``,
    ``...ForSequenceClassification``, ...) is switched the same way."""
    return dict(_SUPPORTED)


def _refuse_unsupported(model_or_config) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED:
        what = type(model_or_config).__name__
        raise InputError(f"{what} (model_type {model_type!r}) is not supported by relpos.transformers; "
                         f"supported model types: {', '.join(sorted(_SUPPORTED))}")
    return model_type


def spec_for(config) -> str:
    """The relpos spec of a supported model config's own position encoding: ``"alibi"`` for
    Bloom and Falcon with ``alibi=True`` (Falcon divides the slopes by sqrt(head_dim), which
    :func:`apply` passes to the kernel: relpos's ``alibi`` has no slope scale yet); otherwise
    ``rope`` with ``config.rope_parameters`` applied as HF writes them
    (:func:`relpos.rope_parameters_spec`: ``rope_theta``, ``partial_rotary_factor``, the
    rope type's rule; the config's ``rope_theta`` when the dictionary has none). Raises InputError
    for an unsupported family or dictionary."""
    model_type = _refuse_unsupported(config)
    if model_type == "bloom" or (model_type == "falcon" and getattr(config, "alibi", False)):
        return "alibi"
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        raise InputError(f"{type(config).__name__} has no rope_parameters")
    if any(isinstance(v, dict) for v in params.values()):
        raise InputError(f"{type(config).__name__}: rope_parameters per layer type are not supported")
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return rope_parameters_spec("rope", params, getattr(config, "max_position_embeddings", None))


def _neutralise(model, model_type: str) -> None:
    """Stops the model computing its own encoding for layers that no longer read it."""

    class _NoRotary(nn.Module):
        """Stands in for the model's rotary embedding: relpos layers transform q and k
        themselves and ignore position_embeddings."""

        def forward(self, x, position_ids=None, *args, **kwargs):
            return None

    for module in list(model.modules()):
        if hasattr(module, "rotary_emb") and isinstance(module.rotary_emb, nn.Module) and not isinstance(
                module.rotary_emb, _NoRotary):
            module.rotary_emb = _NoRotary()
        if model_type == "falcon" and hasattr(module, "use_alibi"):
            module.use_alibi = False  # else FalconModel folds its ALiBi tensor into the mask


_SWITCHED: dict[type, type] = {}


def _switched_class(cls: type, forward) -> type:
    """A subclass of the HF attention class whose forward runs relpos (kept per class; named so
    that pickling finds it in this module)."""
    if cls not in _SWITCHED:
        name = f"Relpos{cls.__name__}"
        new = type(name, (cls,), {"forward": forward, "__module__": __name__})
        globals()[name] = new
        _SWITCHED[cls] = new
    return _SWITCHED[cls]


_OPTIONS = {"pair_layout", "check_finite"}


def _refuse_attention_weights(module, args, kwargs):
    """A switched model has no attention weights to return (the kernel never forms them): asking
    for them is refused rather than answered with empty ones."""
    asked = kwargs.get("output_attentions")
    if asked is None:
        asked = getattr(module.config, "output_attentions", False)
    if asked:
        raise InputError("output_attentions: a model switched to relpos attention runs a fused "
                         "kernel that never forms the attention weights; call without them")


def apply(model, spec: str | None = None, **options):
    """Switches a loaded HF model (``supported()``) to relpos attention, in place; returns it.

    ``spec=None`` runs the model's own encoding (:func:`spec_for`), so outputs, ``generate`` and
    gradients stay those of the model (docs/transformers.md: tolerances and exceptions); any other
    relpos spec (``"jordan(m=2, regime=scaled, c=1)"``, ``"rope + alibi"``, ``"t5_bias"``) replaces
    it, its learnable parameters added to every attention layer (``<layer>.relpos.encoding.*``:
    they train and are saved with the model). Options: ``pair_layout`` (default ``"half_split"``,
    HF's rotate_half pairs (j, j + D/2)) and ``check_finite`` (default True) of
    :class:`relpos.PositionEncoding`.

    Mechanisms with runtime state (content biases, learned frequencies, journey frames) run
    through :class:`relpos.Attention` (``<layer>.relpos.engine``); they decode through its
    :class:`relpos.KVCache`, kept in HF's cache (:class:`EngineCacheLayer`).

    Raises InputError for an unsupported model, a mechanism the layers cannot run (vector
    positions; a learned lag table or a per-token bias with grouped-query heads), an unknown
    option. bfloat16 and float16 models run with half storage and float32 compute
    (docs/engine.md, "Half precision").
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"apply() takes a transformers model (torch.nn.Module), got "
                         f"{type(model).__name__}")
    unknown = set(options) - _OPTIONS
    if unknown:
        raise InputError(f"unknown option(s) {sorted(unknown)} (valid: {sorted(_OPTIONS)})")
    model_type = _refuse_unsupported(model)
    config = model.config
    family = _family(model_type)
    layers = [m for m in model.modules() if isinstance(m, family["cls"])]
    if not layers:
        raise InputError(f"{type(model).__name__}: found no {family['cls'].__name__} layer to switch")
    if any(hasattr(m, "relpos") for m in layers):
        raise InputError(f"{type(model).__name__} is already switched to relpos")
    own = spec is None
    if own and options.get("pair_layout", "half_split") not in ("half_split", "neox", "rotate_half"):
        # (interleaved pairs would be another model than the one spec=None promises)
        raise InputError(f"spec=None runs the model's own encoding, whose pairs are HF's "
                         f"rotate_half (half_split); pair_layout={options['pair_layout']!r} is for "
                         "a spec you give")
    if own:
        spec = spec_for(config)
    elif not isinstance(spec, str):
        raise InputError(f"spec must be a relpos spec string or None, got {type(spec).__name__}")
    slope_scale = 1.0
    if own and model_type == "falcon" and getattr(config, "alibi", False):
        D = config.hidden_size // config.num_attention_heads
        slope_scale = 1.0 / math.sqrt(D)  # FalconModel: alibi / sqrt(head_dim)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    states = []
    for m in layers:  # built first: a refused spec leaves the model as it was
        D, Hq, Hk = family["heads"](m, config)
        window = family["window"](m, config)
        state = RelposAttention(spec, D, Hq, Hk, scale=family["scale"](m), window=window or 0.0,
                                dropout=family["dropout"](m), slope_scale=slope_scale,
                                model_dim=config.hidden_size, **options)
        if dtype in (torch.float32, torch.float64):
            state.to(dtype)
        # on the layer's device (a model moved to a GPU before the switch); a layer on the meta
        # device (weights not loaded yet) keeps its relpos tensors where they were built
        device = next((p.device for p in m.parameters()), None)
        if device is not None and device.type != "meta":
            state.to(device)
        states.append(state)
    for m, state in zip(layers, states):
        m.relpos = state
        m.__class__ = _switched_class(type(m), family["forward"])
    _neutralise(model, model_type)
    for m in model.modules():  # the model and its base model, whichever the caller runs
        if isinstance(m, transformers.PreTrainedModel):
            m.register_forward_pre_hook(_refuse_attention_weights, with_kwargs=True)
    config._attn_implementation_internal = IMPLEMENTATION
    # what from_pretrained needs to switch a saved copy alike (saved with the config): the spec,
    # whether it was the model's own encoding (its slope scale follows from the config), options
    config.relpos_spec = states[0].spec
    config.relpos_own = own
    config.relpos_options = dict(options)
    return model


_INHERITED = object()  # a class attribute the class itself does not set
# the checkpoint reader's own arguments among from_pretrained's (where the files come from)
_FILE_ARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
              "proxies")


def _concrete_class(model_class, pretrained, files: dict):
    """model_class, or for an Auto class the class it builds for the checkpoint's config (the one
    whose instance reads the load-time ignore pattern)."""
    mapping = getattr(model_class, "_model_mapping", None)
    if mapping is None:
        return model_class
    config = transformers.AutoConfig.from_pretrained(pretrained, **files)
    try:
        return mapping[type(config)]
    except KeyError:
        raise InputError(f"{pretrained}: {model_class.__name__} has no model class for "
                         f"{type(config).__name__}") from None


def _checkpoint_keys(pretrained, variant, files: dict) -> dict:
    """Every tensor name of the checkpoint's safetensors files -> the file that holds it."""
    from safetensors import safe_open
    from transformers.modeling_utils import _add_variant
    from transformers.utils import cached_file

    index = cached_file(pretrained, _add_variant("model.safetensors.index.json", variant), **files,
                        _raise_exceptions_for_missing_entries=False)
    if index is not None:
        with open(index) as f:
            return json.load(f)["weight_map"]
    name = _add_variant("model.safetensors", variant)
    single = cached_file(pretrained, name, **files, _raise_exceptions_for_missing_entries=False)
    if single is None:
        raise InputError(f"{pretrained}: no {name} (or its index): relpos reads the mechanism's "
                         "tensors from safetensors checkpoints (save_pretrained's default)")
    with safe_open(single, framework="pt") as f:
        return {k: name for k in f.keys()}


def from_pretrained(model_class, pretrained, *args, relpos_options: dict | None = None, **kwargs):
    """A checkpoint saved from a switched model (``save_pretrained``), loaded switched, in one call:
    ``model_class.from_pretrained(pretrained, *args, **kwargs)`` (an Auto class too) builds the
    model and loads its own weights, :func:`apply` switches it as the saved model was (the spec,
    model's-own-encoding flag and options its config records; ``relpos_options`` override the
    options), and the mechanism's tensors are read from the same safetensors files (one file or
    shards, ``variant`` included; a base model from a checkpoint with a head, or the reverse, by
    HF's ``base_model_prefix``). HF's load report does not list them as unexpected (they are
    loaded here). A relpos tensor the model has and the checkpoint lacks, or the reverse, raises
    InputError naming it, and so does a checkpoint from an unswitched model (switch one with
    ``apply(model_class.from_pretrained(...), spec)``). With ``output_loading_info=True`` the
    result is HF's ``(model, info)``."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    files = {k: kwargs[k] for k in _FILE_ARGS if k in kwargs}
    concrete = _concrete_class(model_class, pretrained, files)
    key = "_keys_to_ignore_on_load_unexpected"
    ignored = concrete.__dict__.get(key, _INHERITED)
    # read by the instance as HF builds it; restored at once (the loaded model keeps the pattern)
    setattr(concrete, key, [*(getattr(concrete, key, None) or []), r"\.relpos\."])
    try:
        loaded = model_class.from_pretrained(pretrained, *args, **kwargs)
    finally:
        if ignored is _INHERITED:
            delattr(concrete, key)
        else:
            setattr(concrete, key, ignored)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    config = model.config
    spec = getattr(config, "relpos_spec", None)
    if not spec:
        raise InputError(f"{pretrained}: the config records no relpos_spec (a checkpoint saved from a "
                         "model switched with relpos.transformers.apply); to switch this one, "
                         "apply(model_class.from_pretrained(...), spec)")
    options = {**(getattr(config, "relpos_options", None) or {}), **(relpos_options or {})}
    # a config saved before relpos_own was recorded: its own encoding when the spec is the one
    # spec_for gives (what differs is Falcon's ALiBi, scaled by 1/sqrt(D) as the model's own)
    own = getattr(config, "relpos_own", None)
    if own is None:
        own = spec == spec_for(config)
    apply(model, None if own else spec, **options)
    wanted = {k for k in model.state_dict() if ".relpos." in k}
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    stored = {}  # the model's name -> (the checkpoint's name, its file)
    for k, f in _checkpoint_keys(pretrained, kwargs.get("variant"), files).items():
        if ".relpos." not in k:
            continue
        name = (k if k in wanted or prefix == "." else k[len(prefix):] if k.startswith(prefix)
                else prefix + k)
        stored[name] = (k, f)
    if stored.keys() != wanted:
        missing, extra = sorted(wanted - stored.keys()), sorted(stored.keys() - wanted)
        raise InputError(f"{pretrained}: the checkpoint's relpos tensors are not {spec!r}'s: "
                         + "; ".join(part for part in (
                             f"missing {', '.join(missing[:4])}" if missing else "",
                             f"unexpected {', '.join(extra[:4])}" if extra else "") if part))
    tensors = {}
    for shard in sorted({f for _, f in stored.values()}):
        with safe_open(cached_file(pretrained, shard, **files), framework="pt") as f:
            tensors.update({name: f.get_tensor(k) for name, (k, s) in stored.items() if s == shard})
    try:
        model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # shapes that are not the model's (another head count, say)
        raise InputError(f"{pretrained}: {e}") from None
    return loaded
