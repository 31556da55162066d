"""Where the Python module's decode step spends its time, on cold and on warm caches: the layers
of one cached step of relpos.Attention, each timed alone, in one process, round robin.

    .venv/bin/python bench/bench_step_parts.py [--spec fox] [--ctx 64,4096] [--heads 8:8,8:2]
                                               [--rounds 41] [--threads 2]

Cases (B 1, Hq 8, D 64, float32, no autograd; the cache reset to ctx - 1 keys before each call):
  module         attn(q, k, v, cache=cache, inputs=x): the step as users call it
  _decode        the module's one-call step (Attention._decode) without forward's preamble
  plan_decode    the module's call of the C++ step (the operator library's step_decode, or the
                 StepPlan.decode method when the library is no Python module) with the
                 arguments _decode builds: the C++ step with its argument conversion
  plan_refused   the same call handed a schema whose values differ from the plan's, so that it
                 returns at once: the call's own cost (argument conversion, the first checks, the
                 returned tuple)
  method_refused plan_refused through the StepPlan.decode method (bound once): TorchScript's
                 method call, which the module makes when the library is no Python module
  sdpa_bias      SDPA on its own copy of ctx keys and values with a bias row (the baseline of
                 bench_decode.py)
The differences between neighbours are what each layer adds: module - _decode is forward's
preamble and nn.Module's call, _decode - plan_decode the step's Python, plan_decode -
plan_refused the C++ step. Cold: a pass over twice the last-level cache before every call (code
and data evicted, as between two steps of one layer in a many-layer decoder); warm: the same call
run untimed just before.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import relpos
from bench_decode import last_level_cache_bytes
from rounds import timed_rounds

H, D = 8, 64


def cases_for(spec, ctx, hk, g):
    """name -> call, and the setup that resets the cache."""
    biases = relpos.mechanism(spec, D, H)["biases"]
    content = any(b["shape"] in ("separable", "gated_slope", "path_integral") for b in biases)
    x = torch.randn(1, ctx, H * D, generator=g) if content else None
    attn = relpos.Attention(spec, D, H, hk, model_dim=H * D if content else None)
    cache = relpos.KVCache(1, hk, D, capacity=2 * ctx)
    with torch.no_grad():
        attn(torch.randn(1, H, ctx - 1, D, generator=g), torch.randn(1, hk, ctx - 1, D, generator=g),
             torch.randn(1, hk, ctx - 1, D, generator=g), cache=cache,
             inputs=None if x is None else x[:, :-1])
    prefill_len = cache.lengths.clone()
    q = torch.randn(1, H, 1, D, generator=g)
    kn, vn = torch.randn(1, hk, 1, D, generator=g), torch.randn(1, hk, 1, D, generator=g)
    xn = None if x is None else x[:, -1:]
    enc = attn._modules["encoding"]
    content_params = attn._content_params() if attn._content is not None else []

    def method(schema, decode=enc._step_call("decode")):  # (the call the module makes)
        return lambda: decode(
            q, kn, vn, cache._keys, cache._values, cache._positions, cache.lengths, None, None,
            schema, attn.num_heads, enc.layout, attn.causal, attn.window,
            0.0 if attn.scale is None else float(attn.scale), attn.check_finite, enc._warned,
            content_params, xn, cache._content)

    schema = enc._schema_tensors()
    other = [t + 1 for t in schema] if schema else [torch.ones(1)]  # (stale: returns at once)
    kb, vb = torch.randn(1, hk, ctx, D, generator=g), torch.randn(1, hk, ctx, D, generator=g)
    bias = 0.1 * torch.randn(1, H, 1, ctx, generator=g)
    calls = {
        "module": lambda: attn(q, kn, vn, cache=cache, inputs=xn),
        "_decode": lambda: attn._decode(q, kn, vn, None, None, xn, cache, False),
        "plan_decode": method(schema),
        "plan_refused": method(other),
        "method_refused": method(other, enc._step_plan().decode),
        "sdpa_bias": lambda: F.scaled_dot_product_attention(q, kb, vb, attn_mask=bias,
                                                            enable_gqa=hk != H),
    }
    with torch.no_grad():  # the plan holds its kernel parameters and the cache its side tensors
        attn(q, kn, vn, cache=cache, inputs=xn)
    return calls, lambda: cache.lengths.copy_(prefill_len)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="fox")
    ap.add_argument("--ctx", default="64,4096")
    ap.add_argument("--heads", default="8:8,8:2")
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    flush = torch.ones(2 * last_level_cache_bytes() // 4)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, spec {a.spec!r}, B 1, "
          f"Hq {H}, D {D}, float32, {a.rounds} rounds, medians in us; the module's step call: "
          + ("TorchScript's method (no Python module in the library)"
             if relpos._library.STEPS is None else "the library's step_decode"))
    print()
    names = ["module", "_decode", "plan_decode", "plan_refused", "method_refused", "sdpa_bias"]
    print("| ctx | heads | caches | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for ctx in (int(x) for x in a.ctx.split(",")):
        for heads in a.heads.split(","):
            hk = int(heads.split(":")[1])
            calls, reset = cases_for(a.spec, ctx, hk, g)
            for state in ("cold", "warm"):
                def before(call, state=state):
                    def run():
                        if state == "cold":
                            flush.add_(1.0)
                        else:
                            reset()
                            call()
                        reset()
                    return run
                with torch.no_grad():
                    times = timed_rounds(calls, a.rounds,
                                         setup={n: before(c) for n, c in calls.items()})
                print(f"| {ctx} | {H}:{hk} | {state} | "
                      + " | ".join(f"{1e3 * statistics.median(times[n]):.0f}" for n in names)
                      + " |")


if __name__ == "__main__":
    main()
