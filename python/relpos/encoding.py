"""PositionEncoding: a mechanism as an nn.Module whose parameters are the mechanism's.

Parameters are built from the mechanism's schema (``torch.ops.relpos.mechanism``), with the same
names as the C++ module (``raw_<name>`` learnable or buffer, ``<name>_fixed``, ``<name>_bound``,
``<name>_learn`` buffers, ``fixed<i>_m`` / ``fixed<i>_m_inv_t`` for fixed linear terms, a learned
lag table's parameters under their kernel's names), so state dicts carry over.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import operator

import torch
from torch import nn

from . import _library


class InputError(ValueError):
    """Bad input to relpos (malformed spec, wrong shape or dtype, NaN, ...): the message names the
    problem, as the command-line tool's does."""


_LAYOUTS = {"interleaved": 0, "half_split": 1, "neox": 1, "rotate_half": 1}
# Half-precision storage: bf16 / fp16 tensors are computed in float32 (angles, products,
# accumulation) and the results stored back in their dtype, as the C++ ops do.
_HALF = (torch.bfloat16, torch.float16)
_MAX_LAG_TABLE = 1 << 20  # kernels::kMaxLagTable: the kernel's longest lag table
_STORABLE = (torch.float32, torch.float64) + _HALF
# calls with at most this many positions (decode and speculative steps) leave the cos/sin table to
# the transform op instead of the module's table cache
_OP_BUILT_TRIG_ROWS = 8


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def _spec_text(spec) -> str:
    """The spec as the operators take it (UTF-8 text), or InputError naming what it is instead."""
    if not isinstance(spec, str):
        raise InputError(f"spec must be a string, got {type(spec).__name__}")
    try:
        spec.encode("utf-8")
    except UnicodeEncodeError as e:  # an unpaired surrogate has no UTF-8 form
        raise InputError(f"spec {spec!r} is not valid text ({e.reason} at character {e.start})") from None
    return spec


def _integer(value, name: str) -> int:
    """A whole-number argument as a Python int: no float (64.7 is not silently 64), no bool, and
    within int64, where the operators check its range."""
    if isinstance(value, bool):
        raise InputError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be an integer, got {value!r}") from None
    if not -(2**63) <= v < 2**63:
        raise InputError(f"{name}={v} is out of range")
    return v


def _real(value, name: str, *, above: float | None = None, at_least: float | None = None) -> float:
    """A real-number argument as a float: no bool, string or tensor, finite, and above / at least
    the bound given (InputError naming it otherwise: NaN would slip past a range comparison)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or (above is not None and not v > above) or (
            at_least is not None and not v >= at_least):
        bound = f" > {above:g}" if above is not None else f" >= {at_least:g}" if at_least is not None else ""
        raise InputError(f"{name} must be a finite number{bound}, got {value!r}")
    return v


def _flag(value, name: str) -> bool:
    """A yes/no argument: a bool (or 0 / 1), never a string's truthiness ("no" is not True)."""
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise InputError(f"{name} must be True or False, got {value!r}")


def _all_finite(t: torch.Tensor) -> bool:
    """Whether t holds no NaN or Inf: one pass over its exponent bits in C++ (the C++ modules'
    check; ``isfinite(t).all()`` writes a mask as large as t first, ~5x the time)."""
    return torch.ops.relpos.nonfinite([t]) < 0


def _op(op, *args):
    """A relpos operator call with its bad-input errors (ValueError) as InputError, and the
    dispatcher's refusal of an argument's type too (it names the argument)."""
    try:
        return op(*args)
    except ValueError as e:
        raise InputError(str(e)) from None
    except RuntimeError as e:
        _raise_wrong_type(e)
        raise
    except TypeError as e:  # the operator library's direct step calls (pybind11) refuse a type so
        if "incompatible function arguments" not in str(e):
            raise
        raise InputError(f"relpos: an argument of the wrong type (a module attribute set to "
                         f"another type?): {e}") from None


# The dispatcher's words when an operator argument has the wrong type (a RuntimeError)
_WRONG_TYPE = "Expected a value of type"


def _raise_wrong_type(error: RuntimeError, named: dict | None = None) -> None:
    """Raises InputError when `error` is the dispatcher's refusal of an argument's type: naming the
    first of `named` (the caller's own argument names) that is neither None nor a tensor, else in
    the dispatcher's words. Returns for any other error (the caller re-raises it). Called only
    after a call failed: a valid call pays nothing for it."""
    if _WRONG_TYPE not in str(error):
        return
    _tensors_or_none(**(named or {}))
    raise InputError(str(error).split("\n")[0]) from None


def _tensors_or_none(**named) -> None:
    """InputError naming the first argument that is neither None nor a tensor."""
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a tensor or None, got {type(t).__name__}")


def _call(op, *args):
    """A relpos operator call as it is (traceable by torch.compile)."""
    return op(*args)


def rope_scaling_spec(rope_scaling: dict | None, max_position_embeddings: float | None = None) -> str:
    """The spec term of a model config's ``rope_scaling`` dictionary (Hugging Face keys; ``""`` for
    ``None`` or ``{"rope_type": "default"}``), e.g. ``"yarn(factor=4, original=4096, ...)"``: add it
    to a rotary spec with ``+``. Unknown keys and bad values raise InputError naming them."""
    return _op(torch.ops.relpos.rope_scaling_spec, _json(rope_scaling, "rope_scaling"),
               _context(max_position_embeddings))


def _json(d, name: str) -> str:
    """A config dictionary as the operators read it, or InputError naming what JSON cannot hold."""
    try:
        return json.dumps(d)
    except (TypeError, ValueError) as e:
        raise InputError(f"{name}: {e}") from None


def _context(max_position_embeddings) -> float:
    """A config's max_position_embeddings as the operators take it (None or 0: not given)."""
    if max_position_embeddings is None:
        return 0.0
    return _real(max_position_embeddings, "max_position_embeddings", at_least=0)


def rope_parameters_spec(spec: str, rope_parameters: dict | None,
                         max_position_embeddings: float | None = None) -> str:
    """``spec`` with a model config's rope dictionary applied, as Hugging Face writes it (5.x
    ``rope_parameters`` or 4.x ``rope_scaling``): ``rope_theta`` sets the rotary term's theta,
    ``partial_rotary_factor`` < 1 makes ``rope`` a ``partial_rope`` (GPT-NeoX / Phi layout in
    ``half_split``), ``rope_type: proportional`` is ``partial_rope(grid=head)``, YaRN without
    ``factor`` takes ``max_position_embeddings / original_max_position_embeddings``, and the
    rule's keys become its term, e.g. ``rope_parameters_spec("rope", cfg.rope_parameters, 4096)``
    -> ``"rope(theta=500000) + yarn(...)"``. Conflicts and unread keys raise InputError."""
    return _op(torch.ops.relpos.rope_parameters_spec, _spec_text(spec),
               _json(rope_parameters, "rope_parameters"), _context(max_position_embeddings))


def frequencies(spec: str, head_dim: int, length: float | None = None) -> torch.Tensor:
    """The rotary frequencies of ``spec`` per coordinate pair, float64 ``[head_dim / 2]``, in
    rope's sense (pair j of a key at position p turns by ``+f_j p``; HF's ``inv_freq`` for RoPE),
    with its context-extension rule evaluated at context ``length`` (max position + 1; None: as
    built). Pairs no rotary term turns are 0; learned frequencies are left at their spec values."""
    return _op(torch.ops.relpos.frequencies, _spec_text(spec), _integer(head_dim, "head_dim"), 1,
               0.0 if length is None else _real(length, "length", above=0))


def attention_factor(spec: str, head_dim: int, length: float) -> float:
    """The factor a context-extension rule applies to q and k (logits scale by its square) at
    context ``length``; 1.0 without a rule (HF's ``attention_scaling``)."""
    return _op(torch.ops.relpos.attention_factor, _spec_text(spec), _integer(head_dim, "head_dim"),
               1, _real(length, "length", above=0))


class PositionEncoding(nn.Module):
    """Applies a mechanism's position-wise transforms to queries and keys.

    Args:
        spec: a spec string (``relpos.mechanisms()`` lists them), e.g. ``"rope"``,
            ``"jordan(m=2, regime=scaled, c=1)"``, ``"orthogonal_mix(seed=1) + rope"``.
        head_dim, num_heads: the head shape.
        pair_layout: ``"interleaved"`` (coordinates 2j, 2j+1: the Jordan-RoPE and JoFormer
            convention) or ``"half_split"`` (j, j + D/2: GPT-NeoX / Llama ``rotate_half``).
        tensor_layout: ``"BHTD"`` ([batch, heads, tokens, head_dim]) or ``"BTHD"`` (the layout
            of most model code; transposed around the kernel).
        check_finite: reject NaN / Inf in q and k (the transform kernel checks its own outputs,
            which every non-finite input reaches: in registers for a plain rotation, else tile by
            tile while they are in cache; 0.98-1.02x the unchecked time for RoPE in
            bench/bench_check_finite.py; a separate pass for an encoding without a position
            term).
        rope_scaling: a model config's ``rope_scaling`` dictionary (Hugging Face keys, e.g.
            ``{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}``):
            its context-extension rule is added to the spec (docs/rope-scaling.md); the same as
            writing the spec term, e.g. ``"rope + yarn(factor=4, original=4096)"``.
        max_position_embeddings: the config's value, where the dictionary relies on it.
        bias_heads: rows of a learned lag table (default num_heads): a grouped-query layer's
            query heads, each with its own row, while the transforms act on its key/value heads
            (``relpos.Attention`` passes them); a multiple of num_heads.

    ``forward(q, k, positions=None)`` returns ``(q~, k~)``; positions are ``[T]`` or ``[B, T]``
    (real values within +-2^53; float64 and int64 keep them exact), default ``0..T-1``. Warns
    (``UserWarning``, once per module) as the C++ module does: docs/errors.md, "Warnings".
    """

    def __init__(
        self,
        spec: str,
        head_dim: int,
        num_heads: int,
        *,
        pair_layout: str = "interleaved",
        tensor_layout: str = "BHTD",
        check_finite: bool = True,
        rope_scaling: dict | None = None,
        max_position_embeddings: float | None = None,
        bias_heads: int | None = None,
    ) -> None:
        super().__init__()
        if pair_layout not in _LAYOUTS:
            raise InputError(f"unknown pair layout '{pair_layout}' (valid: interleaved, half_split)")
        if tensor_layout not in ("BHTD", "BTHD"):
            raise InputError(f"unknown tensor layout '{tensor_layout}' (valid: BHTD, BTHD)")
        spec = _spec_text(spec)
        head_dim, num_heads = _integer(head_dim, "head_dim"), _integer(num_heads, "num_heads")
        if rope_scaling is not None:
            spec = rope_parameters_spec(spec, rope_scaling, max_position_embeddings)
        elif max_position_embeddings is not None:
            # (a config's value passed along with its rope_scaling of None: no rule reads it)
            _context(max_position_embeddings)
        try:
            info = json.loads(torch.ops.relpos.mechanism(spec, head_dim, num_heads))
        except ValueError as e:
            raise InputError(str(e)) from None
        self.spec = info["spec"]
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.bias_heads = num_heads if bias_heads is None else _integer(bias_heads, "bias_heads")
        if self.bias_heads < 1:
            raise InputError(f"bias_heads must be >= 1 (or None: num_heads), got {self.bias_heads}")
        self.layout = _LAYOUTS[pair_layout]
        self.tensor_layout = tensor_layout
        self.check_finite = _flag(check_finite, "check_finite")
        self._info = info
        self._scaled = bool(info.get("rope_scaling"))  # a context-extension rule
        self._trig_cache: tuple | None = None  # (key, positions, cos, sin) of the last eager call
        # the once-per-module warnings (docs/errors.md), issued by the op the C++ module shares
        self._warned = 0  # bits of torch.ops.relpos.encoding_warnings
        self._zero_gamma: tuple | None = None  # (versions of gamma's tensors, all zero)
        self._inference_cache: tuple | None = None  # (dtype, schema values, params, gamma all zero)
        self._last_center: float | None = None
        self._terms = []  # ("position" | "fixed" | "vector", index of the term)
        for i, t in enumerate(info["transforms"]):
            kind = {"fixed_linear": "fixed", "vector_rotation": "vector"}.get(t["kind"], "position")
            self._terms.append((kind, i))
        # read on every call (a decode step's Python is its cost): the term kinds, once
        self._has_position_term = any(kind == "position" for kind, _ in self._terms)
        self._only_position_term = [kind for kind, _ in self._terms] == ["position"]
        self._vector_term = next((i for kind, i in self._terms if kind == "vector"), None)
        # a rotation by per-token angles (journey(angles=token), grape_m(context=true)): its phases
        # come from the tokens, which the encoding never sees
        self._phase_term = next((t["name"] for t in info["transforms"]
                                 if t["time"] == "content_phase"), None)
        # the C++ module's parameters and buffers as it creates them (fixed maps fixed<i>_m, the
        # schema's raw_<name> / <name>_fixed / _bound / _learn, a learned lag table's tensors drawn
        # from torch's generator in the same order): the same names and bits
        state, values = _op(torch.ops.relpos.encoding_state, self.spec, head_dim, num_heads,
                            self.bias_heads)
        state = json.loads(state)
        learnable = set(state["parameters"])
        for name, t in zip(state["names"], values):
            if name in learnable:
                self.register_parameter(name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)
        forms = (("raw_", ""), ("", "_fixed"), ("", "_bound"), ("", "_learn"))
        self._schema = [f"{pre}{p['name']}{post}" for p in info["params"] for pre, post in forms]
        self._gamma_names = [f"{pre}{p['name']}{post}" for p in info["params"]
                             if p["slot"] == "gamma" for pre, post in forms]
        self._center_mode = info["center"]
        self._center_value = float(info["center_value"])
        self._max_exp = float(info["max_exp"])
        self._lag_names = [p["name"] for b in info["biases"] for p in b.get("lag_params", [])]
        # kernels::lag_table_bound: past it the learned tables stop changing (or the kernel's
        # longest table); the kernel reads longer lags at a table's last entry
        self._lag_bound = max([_MAX_LAG_TABLE if b.get("constant_from") is None
                               else min(int(b["constant_from"]), _MAX_LAG_TABLE)
                               for b in info["biases"] if b.get("learned")] or [0])

    def extra_repr(self) -> str:
        rows = f", bias_heads={self.bias_heads}" if self.bias_heads != self.num_heads else ""
        return f"spec={self.spec!r}, head_dim={self.head_dim}, num_heads={self.num_heads}{rows}"

    def kernel_params(self) -> dict[str, torch.Tensor]:
        """gamma, eta, alpha0 [H, NB] and gates [rows, H, NB] as the kernels take them: the C++
        reparameterisation (softplus + floor, bounded tanh, softmax) of the schema's tensors,
        differentiable in the raw parameters."""
        gamma, eta, gates, alpha0 = torch.ops.relpos.encoding_kernel_params(
            self.spec, self.head_dim, self.num_heads, self._schema_tensors())
        return {"gamma": gamma, "eta": eta, "gates": gates, "alpha0": alpha0}

    def _schema_tensors(self) -> list[torch.Tensor]:
        # the registered tensors read directly (nn.Module.__getattr__ is the slow path; a decode
        # step reads the schema every call)
        p, b = self._parameters, self._buffers
        return [p[n] if n in p else b[n] for n in self._schema]

    def _inference_params(self, dtype) -> list[torch.Tensor]:
        """kernel_params() detached, in dtype, contiguous: [gamma, eta, gates, alpha0], kept while
        the schema's tensors hold the same values (compared, not versioned: a write through
        ``.data``, as EMA swaps do, bumps no version counter), so a decode step does not
        recompute them."""
        schema = self._schema_tensors()
        c = self._inference_cache
        if c is None or c[0] != dtype or not torch.ops.relpos.same_values(schema, c[1]):
            with torch.no_grad():
                kp = self.kernel_params()
            params = [kp[n].to(dtype).contiguous() for n in ("gamma", "eta", "gates", "alpha0")]
            # whether gamma is all zero, read once per rebuild (_damping_is_zero)
            self._inference_cache = (dtype, [t.detach().clone() for t in schema], params,
                                     bool((params[0] == 0).all()))
        return self._inference_cache[2]

    def _step_plan(self):
        """The ``torch.classes.relpos.StepPlan`` of this encoding's cached steps (the mechanism
        parsed once; made on first use, not pickled: __getstate__)."""
        plan = self.__dict__.get("_plan")
        if plan is None:
            plan = _op(torch.classes.relpos.StepPlan, self.spec, self.head_dim, self.num_heads)
            self._plan = plan
        return plan

    def _step_call(self, name: str):
        """The step plan's ``decode`` or ``transform`` as a callable of the method's arguments,
        made once: the operator library's direct call when it is a Python module (TorchScript's
        method call cost several times as much on cold caches: bench/bench_step_parts.py), else
        the method, bound once (looking it up costs about a fifth of its call)."""
        calls = self.__dict__.get("_plan_calls")
        if calls is None:
            calls = self._plan_calls = {}
        call = calls.get(name)
        if call is None:
            plan, steps = self._step_plan(), _library.STEPS
            call = calls[name] = (getattr(plan, name) if steps is None else
                                  functools.partial(getattr(steps, "step_" + name), plan))
        return call

    def _refresh_step_plan(self, dtype) -> None:
        """Hands the step plan the kernel parameters of the schema's present values in dtype
        (after one of its methods found those it holds stale)."""
        self._inference_params(dtype)
        c = self._inference_cache
        self._step_plan().set_params(c[1], c[2])

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for name in ("_plan", "_plan_calls"):  # (TorchScript objects: made again when needed)
            state.pop(name, None)
        return state

    def lag_table(self, length: int) -> torch.Tensor | None:
        """The learned lag table ``b_h(d)``, ``d = 0..length-1``: float64 ``[bias_heads, length]``,
        differentiable in its parameters (built by the C++ runtime's LibTorch ops); None when the
        mechanism has no learned lag table."""
        if not self._lag_names:
            return None
        length = _integer(length, "length")
        try:
            return torch.ops.relpos.lag_table(
                self.spec, self.head_dim, self.bias_heads, [getattr(self, n) for n in self._lag_names],
                length
            )
        except ValueError as e:
            raise InputError(str(e)) from None

    def attention_lag_table(self, span: float) -> torch.Tensor | None:
        """The learned lag table that attention over lags up to ``span`` reads: lags
        ``0..min(ceil(span), bound)``, where the bound is the lag from which the table no
        longer changes (T5's last bucket) or the kernel's longest table (the kernel reads longer
        lags at its last entry; C++ kernels::lag_table_length)."""
        if not self._lag_names:
            return None
        return self.lag_table(int(min(math.ceil(span), self._lag_bound)) + 1 if span > 0 else 1)

    def center_for(self, positions: torch.Tensor) -> float:
        if self._center_mode == "fixed":
            return self._center_value
        if self._center_mode == "mid":  # per call (a host sync; not for torch.compile)
            if positions.numel() == 0:
                return 0.0
            return float(math.floor(0.5 * (positions.min().item() + positions.max().item())))
        return 0.0

    def _trig(self, pos, default_pos, center, batch, dtype):
        """The kernels' cos/sin table for these positions: built once per call (the backward reuses
        it), and in eager mode kept while the positions repeat (training calls 0..T-1 each step)."""
        rows = batch if pos.dim() == 2 else 1
        if torch.compiler.is_compiling():
            return torch.ops.relpos.trig_table(
                pos, center, rows, self.spec, self.head_dim, self.num_heads, self.layout, dtype
            )
        # keyed on the values (a copy is kept): a tensor's identity and version counter miss
        # writes through NumPy or .data, which would leave stale angles
        shape = ("arange", pos.shape[-1]) if default_pos else tuple(pos.shape)
        key = (shape, pos.device, center, dtype, rows)
        c = self._trig_cache
        if c is not None and c[0] == key and (default_pos or torch.equal(c[1], pos)):
            return c[2], c[3]
        cos, sin = torch.ops.relpos.trig_table(
            pos, center, rows, self.spec, self.head_dim, self.num_heads, self.layout, dtype
        )
        self._trig_cache = (key, None if default_pos else pos.clone(), cos, sin)
        return cos, sin

    def _may_warn(self, positions, gamma) -> bool:
        """Whether a warning not yet issued could apply to this call (skips the op otherwise:
        plain RoPE at default positions never pays for it)."""
        if not self._has_position_term:
            return False
        narrow = positions is not None and positions.dtype in (torch.float32, torch.float16, torch.bfloat16)
        return ((gamma.numel() > 0 and not self._warned & 1 and not self._damping_is_zero(gamma))
                or (narrow and not self._warned & 2)
                or (self._center_mode == "mid" and not self._warned & 4))

    def _damping_is_zero(self, gamma) -> bool:
        """Whether the kernels' gamma is all zero (no exponent, so the clamp cannot bind): read
        once per version of the tensors it comes from (RoPE's never change, so a decode step on a
        GPU does not copy gamma to the host for the clamp check)."""
        c = self._inference_cache
        if c is not None and gamma is c[2][0]:  # the inference cache's gamma: read at its rebuild
            return c[3]
        key = tuple((id(t), t._version) for t in self._gamma_sources())
        if self._zero_gamma is None or self._zero_gamma[0] != key:
            self._zero_gamma = (key, bool((gamma.detach() == 0).all()))
        return self._zero_gamma[1]

    def _gamma_sources(self):
        """The schema tensors kernel_params() computes gamma from (read from the module's dicts,
        as _schema_tensors does: nn.Module.__getattr__ is the slow path)."""
        p, b = self._parameters, self._buffers
        return [p[n] if n in p else b[n] for n in self._gamma_names]

    def _check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name} must be a tensor")
            if t.dim() != 4:
                raise InputError(f"{name} must be [B, H, T, D] (or [B, T, H, D]), got {list(t.shape)}")
            if t.dtype not in _STORABLE:
                raise InputError(f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")
            if t.device.type not in ("cpu", "meta", "cuda"):
                raise InputError(f"{name} is on {t.device}; the kernels run on the CPU and on "
                                 "CUDA GPUs")
            if self.check_finite and t.device.type == "meta":
                raise InputError(f"{name} is a meta tensor: check_finite has no values to check "
                                 "(pass check_finite=False for shapes only)")
            heads, dim = (t.shape[2], t.shape[3]) if self.tensor_layout == "BTHD" else t.shape[1::2]
            if dim != self.head_dim:
                raise InputError(f"{name} has head dim {dim}, the encoding was built for {self.head_dim}")
            if heads != self.num_heads:
                raise InputError(f"{name} has {heads} heads, the encoding was built for {self.num_heads}")
        if q.shape != k.shape:
            raise InputError(f"q {list(q.shape)} and k {list(k.shape)} differ in shape")
        if q.dtype != k.dtype:
            raise InputError(f"q is {q.dtype} but k is {k.dtype}: pass both in one dtype")
        if _compute_dtype(q.dtype) == torch.float32 and self._max_exp > 88:
            raise InputError(f"max_exp={self._max_exp:g} overflows float32 (at most 88); use float64")

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None):
        return self._encode(q, k, positions, checked=False)

    def _encode(self, q, k, positions, *, checked: bool):
        """forward; ``checked``: positions are float64 [T] / [B, T] that the caller has checked
        already (a decode cache's step), so their checks are not run twice."""
        eager = not torch.compiler.is_compiling()
        if eager:
            self._check(q, k)  # before the layout transpose, which needs 4 dims
        if self.tensor_layout == "BTHD":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        # with a position term the transform kernel checks its outputs tile by tile (every
        # non-finite input reaches one; no extra pass over q and k), else one pass here
        kernel_checks = eager and self.check_finite and self._has_position_term
        if eager and self.check_finite and not kernel_checks:
            for name, t in (("q", q), ("k", k)):
                if not _all_finite(t):
                    raise InputError(f"{name} contains NaN or Inf")
        stored_as = q.dtype
        # half storage: every term in float32, one rounding at the end (one position term reads
        # and writes half itself, fp32 math inside: the same single rounding)
        rounded_here = stored_as in _HALF and (self._scaled or not self._only_position_term)
        if rounded_here:
            q, k = q.float(), k.float()
        # the op's tables and parameters: float32 beside half storage on the CPU (the GPU's half
        # kernels take them in the storage dtype)
        table_dtype = q.dtype if q.device.type == "cuda" else _compute_dtype(q.dtype)
        B, H, T, D = q.shape
        if self._vector_term is not None:
            dc = self._info["transforms"][self._vector_term]["vector_dims"]
            raise InputError(f"{self.spec!r} rotates by vector positions [T, {dc}]: run it "
                             f"through relpos.Attention with positions [T, {dc}], not "
                             "through the encoding")
        if self._phase_term is not None:  # (as the C++ module refuses it)
            raise InputError(f"{self.spec!r}: term '{self._phase_term}' is driven by per-token "
                             "angles, not positions: run it through relpos.Attention (inputs=) or "
                             "relpos.journey_attention (increments=), not through the encoding")
        if positions is None:
            pos = torch.arange(T, dtype=torch.float64, device=q.device)
        elif checked:
            pos = positions
        elif eager:
            if not isinstance(positions, torch.Tensor):
                raise InputError(f"positions must be a tensor, got {type(positions).__name__}")
            try:  # shape, real dtype, finite, within +-2^53: the C++ module's checks
                pos = torch.ops.relpos.encoding_positions(positions, B, T)
            except ValueError as e:
                raise InputError(str(e)) from None
        else:
            pos = positions.to(torch.float64)
        if q.device.type == "cuda" and pos.device != q.device:
            pos = pos.to(q.device)  # (checked on the host) the trig table is built on the GPU
        if T == 0 or not self._terms:
            out = (q, k)
        else:
            # nothing trains (RoPE, ALiBi, frozen or no-grad calls): the kernels' parameters kept
            # while the schema's values stay (one comparison instead of the reparameterisation's
            # ops, which cost more than the transform itself on a cold cache at small sizes)
            if eager and q.device.type != "meta" and not (
                    torch.is_grad_enabled()
                    and any(t.requires_grad for t in self._schema_tensors())):
                gamma, eta, gates, alpha0 = self._inference_params(table_dtype)
            else:
                kp = self.kernel_params()
                gamma, eta, gates, alpha0 = (kp[n].to(table_dtype)
                                             for n in ("gamma", "eta", "gates", "alpha0"))
            center = self.center_for(pos)
            if eager and pos.device.type != "meta" and self._may_warn(positions, gamma):
                self._warned = torch.ops.relpos.encoding_warnings(
                    positions, pos, center, gamma.detach(), self.spec, self.head_dim,
                    self.num_heads, self._last_center, self._warned,
                )
                if self._center_mode == "mid":
                    self._last_center = center
            if eager and q.device.type == "cpu" and pos.numel() <= _OP_BUILT_TRIG_ROWS:
                # a decode step's few rows, at positions that move every call: the op builds
                # them (no table op, no cache compare and copy); the backward builds them again
                cos = sin = None
            else:
                cos, sin = self._trig(pos, positions is None, center, B, table_dtype)
            for kind, i in self._terms:
                if kind == "fixed":
                    m = getattr(self, f"fixed{i}_m").to(q.dtype)
                    mit = getattr(self, f"fixed{i}_m_inv_t").to(q.dtype)
                    q, k = q @ mit.T, k @ m.T
                else:
                    q, k = (_op if kernel_checks else _call)(
                        torch.ops.relpos.transform,
                        q,
                        k,
                        gamma,
                        eta,
                        gates,
                        alpha0,
                        pos,
                        cos,
                        sin,
                        center,
                        self.spec,
                        self.head_dim,
                        self.num_heads,
                        self.layout,
                        kernel_checks,
                    )
            if self._scaled:
                # the rule's attention factor on q and k (logits scale by its square) at this
                # call's context length, max position + 1; its frequencies are the op's
                length = float(pos.max()) + 1.0
                af = torch.ops.relpos.attention_factor(self.spec, self.head_dim, self.num_heads, length)
                if af != 1.0:
                    q, k = q * af, k * af
            out = (q, k)
        if out[0].dtype != stored_as:
            out = tuple(t.to(stored_as) for t in out)
        # float16 tops out at 65504: a damped map's growth that float32 holds can overflow (the
        # CPU op checks the words it stores itself, so there only a rounding done here needs a
        # pass)
        if (eager and self.check_finite and stored_as == torch.float16
                and (rounded_here or not kernel_checks or out[0].device.type != "cpu")):
            for name, t in zip(("q", "k"), out):
                if not _all_finite(t):
                    raise InputError(f"{name} overflows float16 after the transform (above 65504): "
                                     "pass bfloat16 or float32")
        if self.tensor_layout == "BTHD":
            return out[0].transpose(1, 2), out[1].transpose(1, 2)
        return out
