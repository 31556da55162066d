"""One attention module and its decode cache: :class:`Attention` and :class:`KVCache`.

``Attention`` owns a mechanism's parameters (``self.encoding``, a :class:`PositionEncoding` over
the key/value heads, so state-dict names are ``encoding.<name>``) and runs the fused kernel with the
mechanism's transforms and biases, with grouped-query attention, per-sequence positions and
lengths; terms a layer computes with its own parameters (content-dependent biases, rotations with
learned frequencies) run through their C++ runtimes via the ``relpos::content_*`` and
``relpos::rotat*`` ops, so the module has the C++ module's parameters and numbers. With a
:class:`KVCache` it decodes: the new tokens' keys are transformed at their positions once, stored,
and every later query scores against them. docs/engine.md.
"""

from __future__ import annotations

import json
import weakref

import torch
from torch import nn

from .attention import _alibi_slopes, _learned_lag_table, _transform_qk, fused_attention
from .encoding import (_HALF, _STORABLE, InputError, PositionEncoding, _compute_dtype, _flag,
                       _integer, _op, _real, _tensors_or_none)
from .frames import rotate_pairs


_CACHED_GRADIENTS = (
    "a cached call with autograd on would give partial gradients (the cache stores keys and "
    "values detached): run it under torch.no_grad() or torch.inference_mode(), or with k, v, "
    "inputs and the module's parameters not requiring grad; train without a cache")


class KVCache:
    """The decode state of :class:`Attention`: transformed keys, values (rotated into their
    frames for journey mechanisms) and their float64 positions, per sequence; for a content bias
    also its key-side tensors (``content``: key gates, forget-gate sums, rotated probes), and for
    per-token phases each row's phase after its last token.

    ``keys``/``values`` ``[B, Hk, length, D]`` and ``positions`` ``[B, length]`` are views of the
    used storage; row b holds ``lengths[b]`` tokens (rows may differ, e.g. after a padded prefill
    with ``key_len``); entries past a row's length are ignored and overwritten by its next append.
    Storage doubles as needed (``capacity``). Stored tensors are detached: the cache is for
    inference (train through ``Attention`` without a cache). Keys, values and content tensors
    live on ``device`` (the model's: ``"cuda"`` for the GPU kernels); positions and lengths stay
    on the host, where each step's bookkeeping runs.
    """

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, *, capacity: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        self.batch = _integer(batch, "batch")
        self.num_kv_heads = _integer(num_kv_heads, "num_kv_heads")
        self.head_dim = _integer(head_dim, "head_dim")
        for name, v in (("batch", self.batch), ("num_kv_heads", self.num_kv_heads),
                        ("head_dim", self.head_dim)):
            if v < 1:
                raise InputError(f"KVCache: {name} must be >= 1, got {v}")
        cap = 16 if capacity is None else _integer(capacity, "capacity")
        if cap < 0:
            raise InputError(f"KVCache: capacity must be >= 0, got {cap}")
        if dtype not in _STORABLE:
            raise InputError("KVCache: dtype must be torch.float32, float64, bfloat16 or float16, "
                             f"got {dtype}")
        self.dtype = dtype
        try:
            self.device = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as e:
            raise InputError(f"KVCache: device {device!r} is not a device ({e})") from None
        self._keys = torch.zeros(self.batch, self.num_kv_heads, cap, self.head_dim, dtype=dtype,
                                 device=self.device)
        self._values = torch.zeros_like(self._keys)
        self._positions = torch.zeros(self.batch, cap, dtype=torch.float64)
        self._content: list[torch.Tensor] = []  # content-bias side tensors [B, H, capacity, ...]
        self._phase: torch.Tensor | None = None  # per-token phases: each row's after its last token
        self.lengths = torch.zeros(self.batch, dtype=torch.int64)
        self._owner = None  # a weak reference to the Attention whose keys it holds

    @property
    def capacity(self) -> int:
        return self._keys.shape[2]

    @property
    def length(self) -> int:
        """The longest row's length: the key columns a query scores against."""
        return int(self.lengths.max())

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, :, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[:, : self.length]

    @property
    def content(self) -> list[torch.Tensor]:
        """The cached keys' content-bias side tensors ``[B, H, length, ...]`` (key gates, forget
        gate sums, rotated probes: whatever the mechanism's runtime keeps per key)."""
        return [c[:, :, : self.length] for c in self._content]

    def reset(self) -> None:
        """Empties every row (the storage is kept); any module may fill it next."""
        self.lengths.zero_()
        self._phase = None
        self._content = []  # (rebuilt by the next append, for the mechanism that fills it)
        self._owner = None

    def __getstate__(self) -> dict:
        # the owner is a weak reference (not picklable): a loaded cache belongs to the first
        # module that calls with it
        return {**self.__dict__, "_owner": None}

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i becomes the old row ``rows[i]`` (int64 ``[n]``, any n >= 1, rows may repeat):
        beam search reorders its beams so, and repeats a prompt's rows for them."""
        if (not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.numel() < 1
                or rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool):
            raise InputError("KVCache.select_rows: rows must be a 1-D integer tensor of row indices")
        rows = rows.to(device="cpu", dtype=torch.int64)
        if int(rows.min()) < 0 or int(rows.max()) >= self.batch:
            raise InputError(f"KVCache.select_rows: rows must be in [0, {self.batch}), got "
                             f"{int(rows.min())}..{int(rows.max())}")
        here = rows.to(self._keys.device)
        self._keys, self._values = self._keys.index_select(0, here), self._values.index_select(0, here)
        self._content = [c.index_select(0, rows.to(c.device)) for c in self._content]
        if self._phase is not None:
            self._phase = self._phase.index_select(0, rows.to(self._phase.device))
        self._positions = self._positions.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self.batch = rows.numel()

    def next_positions(self, n: int) -> torch.Tensor:
        """The default positions of n new tokens per row: ``lengths[b] + 0..n-1``, ``[B, n]``."""
        n = _integer(n, "n")
        if n < 0:
            raise InputError(f"KVCache.next_positions: n must be >= 0, got {n}")
        return self._step(None, None, n)[0]

    def _check(self, k: torch.Tensor) -> None:
        B, Hk, _, D = k.shape
        if (B, Hk, D) != (self.batch, self.num_kv_heads, self.head_dim):
            raise InputError(
                f"the cache holds batch {self.batch}, {self.num_kv_heads} key/value heads of dim "
                f"{self.head_dim}; this call has batch {B}, {Hk} heads of dim {D}")
        if k.dtype != self.dtype:
            raise InputError(f"the cache holds {self.dtype}; this call is {k.dtype}")
        if k.device != self._keys.device:
            raise InputError(f"the cache is on {self._keys.device}; this call's keys are on "
                             f"{k.device} (give KVCache(..., device=))")

    def _step(self, positions, key_len, n: int):
        """A call's new positions ``[B, n]`` (given ``[n]`` / ``[B, n]``, or each row's
        continuation) and valid counts ``[B]`` (key_len, default n): positions must increase
        along each row, past the row's last cached one (a decoded token never sees a later one;
        equal positions would in the full forward). The C++ DecodeCache's step."""
        return _op(torch.ops.relpos.cache_step, self.lengths, self._positions, positions, key_len, n)

    def _append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                counts: torch.Tensor, content: list[torch.Tensor] = ()) -> None:
        n = k.shape[2]
        if not self._content:
            self._content = [c.new_zeros(*c.shape[:2], self.capacity, *c.shape[3:]) for c in content]
        self._reserve(n)
        # (the C++ DecodeCache's append: each row's new tokens after its length, lengths += counts)
        _op(torch.ops.relpos.cache_append, self._keys, self._values, self._positions, self.lengths,
            self._content, k.detach(), v.detach(), pos, counts, [c.detach() for c in content])

    def _reserve(self, n: int) -> None:
        """Room for n more tokens in every row (the storage doubles as needed)."""

        def grown(t: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, t.new_zeros(shape)], dim)

        need = int(self.lengths.max()) + n
        if need > self.capacity:
            cap = max(self.capacity, 1)
            while cap < need:
                cap *= 2
            grow = cap - self.capacity
            self._keys = grown(self._keys, 2, grow)
            self._values = grown(self._values, 2, grow)
            self._positions = grown(self._positions, 1, grow)
            self._content = [grown(c, 2, grow) for c in self._content]


def _model_dim(model_dim) -> int:
    """The width of a layer's inputs as the runtimes take it (0: not given)."""
    if model_dim is None:
        return 0
    d = _integer(model_dim, "model_dim")
    if d < 1:
        raise InputError(f"model_dim must be >= 1, got {d}")
    return d


class Attention(nn.Module):
    """Causal (or not) softmax attention with a mechanism, through the fused kernel.

    Args:
        spec: a spec string (``relpos.mechanisms()``); its transforms act on q and k, its slope
            biases (ALiBi) enter the kernel, journey frames also rotate v and the output.
        head_dim, num_heads: query heads; num_kv_heads (default num_heads) must divide them
            (grouped-query attention: each query head uses its key/value head's map).
        pair_layout, rope_scaling, max_position_embeddings, check_finite: as
            :class:`PositionEncoding`; causal, window, scale: as :func:`relpos.fused_attention`.

    ``forward(q, k, v, *, positions=None, key_len=None, key_start=None, segments=None,
    inputs=None, cache=None, return_lse=False)``: q ``[B, Hq, T, D]``, k and v ``[B, Hk, T, D]``.
    Without a cache the result is :func:`relpos.attention` with ``self.encoding`` at
    ``positions`` (``[T]`` or ``[B, T]``, default 0..T-1). With a :class:`KVCache` the T tokens
    are appended (positions default to each row's length + 0..T-1 and must go forward) and their
    queries score against every cached key; ``key_len [B]`` then counts the valid new tokens per
    row. ``key_start [B]`` hides the keys (with a cache: the cache slots) before it in each row
    (left padding). ``segments [B, T]`` packs several documents in a row (a document id per
    token, each document one contiguous run): a key is visible only to its document's queries,
    so packed documents give what separate calls give (pass positions restarting per document
    for position-dependent state that is not relative); not with a cache. Phases scanned from
    ``inputs`` start at each row's first valid token and each document's first.

    Content-dependent biases (``fox``, ``grape_a``, ``grape_ap``) are computed by the mechanism's
    C++ runtime (the same as ``relpos::nn::Attention``'s, same parameter names and initial draws)
    with parameters this module owns: FoX's forget gates and GRAPE-AP's probes project ``inputs``
    (the layer's hidden states ``[B, T, model_dim]``, so give ``model_dim``), GRAPE-A's gates read
    the transformed q and k; GRAPE-M's content phases (``context=true``) scan ``inputs`` too.
    Other mechanisms ignore ``inputs`` (a model may pass them to every layer) but still check
    their B and T. A rotation by vector positions (``structured``) takes ``positions [T, d_c]``
    or ``[B, T, d_c]``; the kernel's causality and the cache then follow the token order.
    Mechanisms it cannot run honestly raise InputError at construction; with a cache, so do a
    per-call centre (``center=mid``) and a dynamic context-extension rule. A cache is for
    inference and for one module: a cached call with autograd on where k, v, the inputs a
    runtime reads or a parameter would record gradients is refused (the cache keeps detached
    keys; run it under ``torch.no_grad()``), and so is a cache holding another module's keys
    (``KVCache.reset()`` releases it).

    ``backend="favor"`` replaces the softmax kernel by FAVOR+ linear attention
    (:func:`relpos.favor_attention`) on ``features`` (default 4 x head_dim) positive orthogonal
    random features of the transformed q and k, drawn from ``feature_seed`` into the buffer
    ``favor_projection`` (the same values as C++): time linear in T, the softmax weights in
    expectation. It takes mechanisms that act on q and k only (no logit biases, no journey
    frames), no window, key_len or cache; causal in the token order.
    """

    def __init__(self, spec: str, head_dim: int, num_heads: int, num_kv_heads: int | None = None, *,
                 pair_layout: str = "interleaved", causal: bool = True, window: float = 0.0,
                 scale: float | None = None, rope_scaling: dict | None = None,
                 max_position_embeddings: float | None = None, check_finite: bool = True,
                 model_dim: int | None = None, backend: str = "softmax", features: int | None = None,
                 feature_seed: int = 0) -> None:
        super().__init__()
        self.num_heads = _integer(num_heads, "num_heads")
        self.num_kv_heads = self.num_heads if num_kv_heads is None else _integer(num_kv_heads, "num_kv_heads")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise InputError(f"num_kv_heads ({self.num_kv_heads}) must be >= 1 and divide "
                             f"num_heads ({self.num_heads})")
        # a learned lag table has a row per query head (bias_heads)
        self.encoding = PositionEncoding(spec, head_dim, self.num_kv_heads, pair_layout=pair_layout,
                                         check_finite=check_finite, rope_scaling=rope_scaling,
                                         max_position_embeddings=max_position_embeddings,
                                         bias_heads=self.num_heads)
        info = self.encoding._info
        self.spec = self.encoding.spec
        self.head_dim = self.encoding.head_dim
        why = _op(torch.ops.relpos.attention_refusal, self.spec, self.head_dim, self.num_kv_heads)
        if why:
            raise InputError(why)
        # a content-dependent bias: its runtime's parameters, registered under its names
        content = _op(torch.ops.relpos.content_params, self.spec, self.head_dim, self.num_heads)
        self._content = json.loads(content) if content else None
        self._path_bias = any(b["shape"] == "path_integral" for b in info["biases"])
        # a rotation with learned frequencies: its runtime's parameters
        rotation = _op(torch.ops.relpos.rotation_params, self.spec, self.head_dim, self.num_kv_heads)
        self._rotation = json.loads(rotation) if rotation else None
        # a rotation by vector positions [T, dc] (its runtime turns q and k; the kernel's
        # causality and window follow the token order)
        self._vector_dims = next((t["vector_dims"] for t in info["transforms"]
                                  if t["kind"] == "vector_rotation"), None)
        if self._rotation is not None:
            if self._rotation["reads_inputs"] and model_dim is None:
                raise InputError(f"{self.spec!r}: its rotation scans phases from the layer's "
                                 "hidden states: give model_dim (the width of inputs)")
            init = _op(torch.ops.relpos.rotation_initial, self.spec, self.head_dim,
                       self.num_kv_heads, _model_dim(model_dim))
            for name, t in zip(self._rotation["names"], init):
                self.register_parameter(name, nn.Parameter(t))
            s = _alibi_slopes(self.spec, self.head_dim, self.num_heads)
            self._slopes = None if s is None else torch.tensor(s, dtype=torch.float64)
        if self._content is not None:
            if self._content["reads_inputs"] and model_dim is None:
                raise InputError(f"{self.spec!r}: its bias projects the layer's hidden states: "
                                 "give model_dim (the width of inputs)")
            init = _op(torch.ops.relpos.content_initial, self.spec, self.head_dim,
                       self.num_heads, _model_dim(model_dim))
            for name, t in zip(self._content["names"], init):
                owner = self
                *parents, leaf = name.split(".")
                for part in parents:
                    if not hasattr(owner, part):
                        owner.add_module(part, nn.Module())
                    owner = getattr(owner, part)
                owner.register_parameter(leaf, nn.Parameter(t))
        # backend "favor": FAVOR+ linear attention on random features of the transformed q, k
        if backend not in ("softmax", "favor"):
            raise InputError(f"backend must be softmax or favor, got {backend!r}")
        self.backend = backend
        if backend == "favor":
            why = _op(torch.ops.relpos.favor_refusal, self.spec, self.head_dim, self.num_kv_heads)
            if why:
                raise InputError(why)
            if _real(window, "window", at_least=0) > 0:
                raise InputError(f"{self.spec!r}: backend favor has no sliding window")
            m = 4 * self.head_dim if features is None else _integer(features, "features")
            if m < 1:
                raise InputError(f"features must be >= 1, got {m}")
            # the same draw as C++ nn::Attention's buffer (float32, as created there)
            self.register_buffer("favor_projection", _op(
                torch.ops.relpos.random_projection, m, self.head_dim, True,
                _integer(feature_seed, "feature_seed")).float())
        elif features is not None or feature_seed != 0:
            raise InputError("features and feature_seed are options of backend favor; this module "
                             "is backend softmax")
        self.pair_layout = "half_split" if self.encoding.layout == 1 else "interleaved"
        self.causal, self.window = _flag(causal, "causal"), _real(window, "window", at_least=0)
        self.scale = None if scale is None else _real(scale, "scale", above=0)
        self.check_finite = _flag(check_finite, "check_finite")
        # frames the runtime returns (journey) turn values in and outputs back out
        term = info["transforms"][0] if self._rotation is not None else {}
        self._frame_values, self._frame_outputs = term.get("values", False), term.get("outputs", False)
        # a decode step in one C++ call (StepPlan.decode): one position term (or none), slope
        # biases or none, a content bias or none, no rotation runtime
        self._one_call_decode = (
            backend == "softmax" and self._rotation is None
            and self._vector_dims is None and not self.encoding._lag_names
            and [kind for kind, _ in self.encoding._terms] in ([], ["position"]))
        # with a cache, keys transformed in earlier calls must stay valid
        self._cache_refusal = None
        if backend == "favor":  # the features' prefix sums are not kept between calls
            self._cache_refusal = (f"{self.spec!r}: backend favor has no decode cache; decode with "
                                   "backend softmax")
        elif info["center"] == "mid":
            self._cache_refusal = (f"{self.spec!r}: center=mid puts the centre in the middle of "
                                   "each call, so keys cached in earlier calls would be off by the "
                                   "change; use a fixed centre (center=auto or a number) to decode")
        elif info.get("rope_scaling_dynamic"):
            self._cache_refusal = (f"{self.spec!r}: the context-extension rule "
                                   f"{info['rope_scaling']!r} is dynamic (its frequencies follow "
                                   "the context length), so cached keys' frequencies would change; "
                                   "freeze it with a static rule to decode")

    def extra_repr(self) -> str:
        return (f"spec={self.spec!r}, head_dim={self.head_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}")

    def _check(self, q, k, v, cache, key_len, positions, inputs, finite: bool = True) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"{name} must be a [B, H, T, D] tensor, got {shape}")
        B, Hq, T, D = q.shape
        if Hq != self.num_heads:
            raise InputError(f"q has {Hq} heads; the module was built for {self.num_heads}")
        for name, t in (("k", k), ("v", v)):
            if t.shape[1] != self.num_kv_heads:
                raise InputError(f"{name} has {t.shape[1]} heads; the module was built for "
                                 f"{self.num_kv_heads} key/value heads")
            if t.shape[0] != B or t.shape[2] != T or t.shape[3] != D:
                raise InputError(f"q {list(q.shape)} and {name} {list(t.shape)} differ in batch, "
                                 "tokens or head dim")
        if D != self.head_dim:
            raise InputError(f"q has head dim {D}; the module was built for {self.head_dim}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise InputError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.dtype not in _STORABLE:
            raise InputError(f"q, k, v must be float32, float64, bfloat16 or float16, got {q.dtype}")
        if inputs is not None and (not isinstance(inputs, torch.Tensor) or inputs.dim() != 3
                                   or tuple(inputs.shape[:2]) != (q.shape[0], q.shape[2])):
            # unread by most mechanisms (a model passes them to every layer), but never mismatched
            got = list(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise InputError(f"inputs must be [B, T, model_dim] with q's B and T "
                             f"({q.shape[0]}, {q.shape[2]}), got {got}")
        _tensors_or_none(positions=positions, key_len=key_len)
        if (finite and self.check_finite and not torch.compiler.is_compiling()
                and q.device.type != "meta"):
            bad = torch.ops.relpos.nonfinite([q, k, v])
            if bad >= 0:
                raise InputError(f"{'qkv'[bad]} contains NaN or Inf")
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise InputError(f"cache must be a relpos.KVCache, got {type(cache).__name__}")
            if self._cache_refusal is not None:
                raise InputError(self._cache_refusal)
            if not self.causal:  # a cached token would never see the later keys its forward sees
                raise InputError(f"{self.spec!r}: a cache decodes causal attention; this module "
                                 "is non-causal (causal=False)")
            cache._check(k)
            if cache._owner is None or cache._owner() is not self:
                # one cache per layer: another module's keys would be scored as this one's
                if cache._owner is not None and cache.length > 0:
                    raise InputError("this KVCache holds the keys of another relpos.Attention: "
                                     "give each module (layer) its own cache, or reset() it")
                cache._owner = weakref.ref(self)
            if (self._rotation is not None and self._rotation["reads_inputs"] and key_len is not None
                    and bool((key_len != q.shape[2]).any())):
                raise InputError(f"{self.spec!r}: per-token phases continue from each row's last "
                                 "token; key_len must count every new token")
            if self._path_bias:  # the kernel's path runs over key slots: rows of one length
                if bool((cache.lengths != cache.lengths[0]).any()) or (
                        key_len is not None and bool((key_len != q.shape[2]).any())):
                    raise InputError(f"{self.spec!r}: a path-integral bias decodes rows of one "
                                     "length; the cache rows differ or key_len leaves tokens out")
            reads_inputs = any(r is not None and r["reads_inputs"]
                               for r in (self._content, self._rotation))
            if torch.is_grad_enabled() and (
                    k.requires_grad or v.requires_grad
                    or (reads_inputs and isinstance(inputs, torch.Tensor) and inputs.requires_grad)
                    or any(p.requires_grad for p in self.parameters())):
                # the cache keeps its keys and values detached: this call's gradients of k, v,
                # inputs and the parameters would miss their paths through the stored keys
                raise InputError(_CACHED_GRADIENTS)

    def _rotate(self, q, k, pos, inputs, phase, key_start=None, segments=None, lengths=None):
        """q and k turned by the rotation runtime (frames, learned frequencies, basis, vector
        positions, phases from the inputs continuing from ``phase``, each scanned from its row's
        first valid token and its packed document's first: ``key_start``, ``segments``, the
        cache's ``lengths``); returns ``(q~, k~, phase after the last token, frame angles that
        turn values and outputs or None)``."""
        params = [getattr(self, n) for n in self._rotation["names"]]
        qt, kt, phase_end, frames = _op(torch.ops.relpos.rotate_learned, self.spec, self.head_dim,
                                        self.num_kv_heads, params, inputs, q, k, pos, phase,
                                        self.encoding.layout, key_start, segments, lengths)
        return qt, kt, phase_end, frames

    def _trains_parameters(self) -> bool:
        """Whether this call records gradients of the module's parameters."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    def _content_params(self) -> list[torch.Tensor]:
        # read from the registries directly (nn.Module.__getattr__ is the slow path: a fifth of
        # a decode step's Python on cold caches, bench/bench_step_parts.py)
        out = []
        for name in self._content["names"]:
            *path, leaf = name.split(".")
            m = self
            for part in path:
                m = m._modules[part]
            t = m._parameters.get(leaf)
            out.append(getattr(m, leaf) if t is None else t)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                positions: torch.Tensor | None = None, key_len: torch.Tensor | None = None,
                key_start: torch.Tensor | None = None, segments: torch.Tensor | None = None,
                inputs: torch.Tensor | None = None, cache: KVCache | None = None,
                return_lse: bool = False):
        if (isinstance(cache, KVCache) and self._one_call_decode and key_start is None
                and segments is None and isinstance(q, torch.Tensor)
                and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and q.is_cpu and q.dtype == cache._keys.dtype
                and not torch.compiler.is_compiling() and not self._needs_grad(q, k, v, inputs)):
            done = self._decode(q, k, v, positions, key_len, inputs, cache, return_lse)
            if done is not None:
                return done
        self._check(q, k, v, cache, key_len, positions, inputs)
        _tensors_or_none(key_start=key_start, segments=segments)
        if segments is not None and cache is not None:
            raise InputError("segments (packed sequences) are a mask of full sequences; a cache "
                             "decodes one sequence per row")
        stored_as = q.dtype
        # half storage: the mechanism computes in float32, the kernel's operands are rounded back
        # to half (below) and the output stored back (the cache keeps half). The transforms read
        # half as stored (fp32 math, one rounding: the same bits as float32 then rounded) on a
        # GPU, and on the CPU for bfloat16 whose kernel takes bf16 operands anyway (not while
        # the mechanism's parameters train, below); a runtime that computes gates, probes or
        # rotations from q and k computes in float32 everywhere
        reads_half = (q.device.type == "cuda" or (
            stored_as == torch.bfloat16 and self._vector_dims is None
            and not self._trains_parameters()))
        if stored_as in _HALF and (not reads_half or self._content is not None
                                   or self._rotation is not None):
            q, k, v = q.float(), k.float(), v.float()
            if isinstance(inputs, torch.Tensor) and inputs.dtype in _HALF:
                inputs = inputs.float()
        # the kernel's lag table: float32 beside half storage on the CPU (the GPU's half kernels
        # take it in the storage dtype), as _transform_qk's slopes
        param_dtype = q.dtype if q.device.type == "cuda" else _compute_dtype(q.dtype)
        B, _, T, _ = q.shape
        phase_end = frames = None
        if self._vector_dims is not None:
            if positions is None:
                dc = self._vector_dims
                raise InputError(f"{self.spec!r} rotates by vector positions: pass positions "
                                 f"[T, {dc}] or [B, T, {dc}] (the kernel's causality and window "
                                 "follow the token order)")
            # the runtime checks the vector positions; the kernel scores in token order
            qt, kt, _, _ = self._rotate(q, k, positions, inputs, None)
            slopes = None
            if cache is None:
                qpos = kpos = torch.arange(T, dtype=torch.float64)
                vt, klen = v, key_len
            else:
                qpos, counts = cache._step(None, key_len, T)
                vt = v
        elif cache is None:
            # one set of positions for queries and keys (the same object: one transform call)
            pos = torch.arange(T, dtype=torch.float64) if positions is None else positions
            if self._rotation is not None:
                pos = _op(torch.ops.relpos.encoding_positions, pos, B, T)
                qt, kt, phase_end, frames = self._rotate(q, k, pos, inputs, None, key_start,
                                                         segments)
                qpos = kpos = pos
                slopes = None if self._slopes is None else self._slopes.to(q.dtype)
            else:
                qt, kt, qpos, kpos, slopes = _transform_qk(self.encoding, q, k, pos, pos)
            vt, klen = v, key_len
        else:
            pos, counts = cache._step(positions, key_len, T)
            if self._rotation is not None:
                qt, kt, phase_end, frames = self._rotate(q, k, pos, inputs, cache._phase,
                                                         key_start, None, cache.lengths)
                qpos = pos
                slopes = None if self._slopes is None else self._slopes.to(q.dtype)
            else:
                qt, kt, qpos, _, slopes = _transform_qk(self.encoding, q, k, pos, pos, checked=True)
            vt = v
        if frames is not None and self._frame_values:  # v into its key's frame
            vt = rotate_pairs(vt, frames, pair_layout=self.pair_layout)
        if self.backend == "favor":
            if key_start is not None or segments is not None:
                raise InputError(f"{self.spec!r}: backend favor takes no key_start or segments "
                                 "(no padding mask)")
            return self._favor(qt, kt, vt, qpos, key_len, return_lse).to(stored_as)
        extra, side = {}, []
        if self._content is not None:
            # the runtime's query-side arguments and the new keys' side tensors
            outs = _op(torch.ops.relpos.content_bias, self.spec, self.head_dim, self.num_heads,
                       self._content_params(), inputs, qt, kt, qpos,
                       [] if cache is None else cache.content,
                       None if cache is None else cache.lengths)
            extra = dict(zip(("gq", "cq", "path_q", "path_beta"), outs[:4]))
            extra["path_scale"] = float(outs[4])
            side = list(outs[5:])
        if cache is None:
            kv_q, kv_k, kv_v, k_positions = qt, kt, vt, kpos
        else:
            cache._append(kt, vt, qpos, counts, side)
            if phase_end is not None:
                cache._phase = phase_end
            # the used prefix, read in place by the kernel (no copy); a half cache with the queries
            # rounded to its dtype, as its keys were
            L = cache.length
            kv_k, kv_v = cache._keys[:, :, :L], cache._values[:, :, :L]
            kv_q = qt.to(kv_k.dtype)
            k_positions = cache._positions[:, :L]
            klen = cache.lengths.clone()
            side = [c[:, :, :L] for c in cache._content]
        if self._content is not None:
            keys = torch.ops.relpos.content_keys(self.spec, self.head_dim, self.num_heads, side)
            extra.update(zip(("gk", "ck", "path_k"), keys))
        lag_table = None
        if self.encoding._lag_names:
            # the learned table over every lag of the call (its gradient reaches the parameters)
            lag_table = _learned_lag_table(self.encoding, qpos, k_positions, self.num_heads,
                                           self.num_kv_heads, param_dtype)
        if (stored_as == torch.bfloat16 and kv_q.dtype == torch.float32
                and not self._trains_parameters()):
            # the kernel reads its operands rounded once to bfloat16, as stored (bf16 pair
            # products: relpos.kernel_isa()); its output comes back float32. Not float16: a
            # transformed q or k may leave its range where float32 holds it, and it has no pair
            # products.
            # Not while the mechanism's parameters train: their gradients sum the kernel's q and
            # k gradients, which would be rounded to half too (a damping rate's came out 30% off
            # in bfloat16 that way)
            kv_q, kv_k, kv_v = kv_q.to(stored_as), kv_k.to(stored_as), kv_v.to(stored_as)
        out, lse = fused_attention(kv_q, kv_k, kv_v, q_positions=qpos, k_positions=k_positions,
                                   causal=self.causal, window=self.window, key_len=klen,
                                   scale=self.scale, slopes=slopes, lag_table=lag_table,
                                   key_start=key_start, q_segments=segments,
                                   k_segments=segments, **extra)
        out = out.to(qt.dtype)
        if frames is not None and self._frame_outputs:  # the output back out of the query's
            out = rotate_pairs(out, frames, inverse=True, pair_layout=self.pair_layout)
        out = out.to(stored_as)
        return (out, lse) if return_lse else out

    def _needs_grad(self, q, k, v, inputs=None) -> bool:
        """Whether autograd would record this call (the one-call decode step has no backward)."""
        return torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or (isinstance(inputs, torch.Tensor) and inputs.requires_grad)
            or any(p.requires_grad for p in self.parameters()))

    def _decode(self, q, k, v, positions, key_len, inputs, cache, return_lse):
        """A cached step in one C++ call: the checks, the cache's step and append, the new
        tokens' transform (and content side tensors) and the kernel (the general path's calls,
        without the interpreter between them). None when the step belongs to the general path
        (a content bias before the cache holds its side tensors, a half cache with one, a path
        integral over rows of different lengths)."""
        # _check's conditions for this call in a few comparisons; when one fails, _check runs
        # for the message (its Python costs several microseconds a step)
        kv = (q.shape[0], self.num_kv_heads, q.shape[2], self.head_dim) if q.dim() == 4 else None
        if not (kv is not None and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
                and q.shape[1] == self.num_heads and k.shape == kv
                and v.shape == kv and k.dtype == q.dtype and v.dtype == q.dtype
                and (inputs is None or (isinstance(inputs, torch.Tensor) and inputs.dim() == 3
                                        and inputs.shape[:2] == (kv[0], kv[2])))
                and (positions is None or isinstance(positions, torch.Tensor))
                and (key_len is None or isinstance(key_len, torch.Tensor))
                and self._cache_refusal is None and self.causal
                and cache._owner is not None and cache._owner() is self
                and cache.batch == kv[0] and cache.num_kv_heads == kv[1]
                and cache.head_dim == kv[3] and k.device == cache._keys.device):
            self._check(q, k, v, cache, key_len, positions, inputs, finite=False)
        enc = self._modules["encoding"]  # (nn.Module.__getattr__ is the slow path)
        decode = enc._step_call("decode")
        content = self._content_params() if self._content is not None else []
        # one call checks the inputs, compares the parameters' schema with the values the plan's
        # parameters came from, and the cache's room; a second only after the parameters changed
        # (or the dtype) or the storage grew
        for _ in range(3):
            out, lse, warned, status = _op(
                decode, q, k, v, cache._keys, cache._values, cache._positions, cache.lengths,
                positions, key_len, enc._schema_tensors(), self.num_heads, enc.layout, self.causal,
                self.window, 0.0 if self.scale is None else float(self.scale), self.check_finite,
                enc._warned, content, inputs, cache._content)
            if status == 0:
                break
            if status == 3:
                return None
            if status == 1:
                enc._refresh_step_plan(torch.float32 if q.dtype in _HALF else q.dtype)
            else:
                cache._reserve(q.shape[2])
        else:  # (never: one refresh and one growth are all a step can need)
            raise RuntimeError(f"relpos: the decode step did not run (status {status})")
        if warned != enc._warned:  # (nn.Module.__setattr__ is slow: only on a change)
            enc._warned = warned
        return (out, lse) if return_lse else out

    def _favor(self, qt, kt, vt, qpos, key_len, return_lse):
        """FAVOR+ on the transformed q and k (key/value heads repeated for their query groups)."""
        if key_len is not None:
            raise InputError(f"{self.spec!r}: backend favor takes no key_len (no padding mask)")
        if self.window > 0:  # (the attribute can be set after construction)
            raise InputError(f"{self.spec!r}: backend favor has no sliding window")
        if return_lse:
            raise InputError(f"{self.spec!r}: backend favor has no log-sum-exp to return")
        if self.causal and qpos.shape[-1] > 1 and not bool((qpos[..., 1:] > qpos[..., :-1]).all()):
            raise InputError(f"{self.spec!r}: backend favor is causal in the token order; positions "
                             "must increase along each sequence")
        g = self.num_heads // self.num_kv_heads
        kf, vf = (kt, vt) if g == 1 else (kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1))
        # its scale multiplies q and k: the square root of the logits' scale
        scale = 0.0 if self.scale is None else float(self.scale) ** 0.5
        return _op(torch.ops.relpos.favor_attention, qt, kf, vf, self.favor_projection, self.causal,
                   scale)
