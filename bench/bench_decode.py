"""Single-token decode against SDPA on a cached K/V, in one process, each case once per round in
random order (bench/rounds.py).

    .venv/bin/python bench/bench_decode.py [--ctx 4096,16384,32768] [--rounds 21] [--threads 2] [--general]
                                           [--spec rope] [--state mixed|cold|warm]

Per context length and head layout (MHA 8:8 and GQA 8:2, D 64, batch 1, float32), the time of
one decode step:
  ours_op      relpos.fused_attention(q [1, 8, 1, 64], K, V) on the cached keys and values
  ours_module  relpos.Attention(spec)(q, k, v, cache=KVCache) as users decode: the new token's
               transform, the finiteness check (on by default), the append and the kernel; the
               cache is reset to ctx - 1 keys before each call (untimed)
  module_general  (--general) the same module with the one-call step switched off: every step
               through the general path (the transform, cache and kernel ops called one by one
               from Python), as before the one-call step
  sdpa         torch's scaled_dot_product_attention(q, K, V, enable_gqa=...) on a copy of that
               cache (each case streams its own keys and values, as a decoder does), no mask
  sdpa_step    (--spec rope) the step a RoPE user writes in Python: HF's rotate_half RoPE from a
               cos/sin table computed once, on the new q and k, the new k and v written into a
               static cache (2 x ctx slots), SDPA on its used prefix: the module's baseline
and for a biased mechanism (--spec alibi, fox, grape_ap, ...): sdpa_bias, SDPA with the bias row
of the one query materialised ([1, H, 1, ctx], built outside the timed call; ALiBi's own row, a
random one for a bias computed from the tokens), on its own copy of the keys and values. A bias
computed from the tokens (FoX, GRAPE-A, GRAPE-AP) makes the module take the layer's inputs
([1, T, H D], random) and has no ours_op case. The module's cache also has 2 x ctx slots, so its used prefix is a strided view as in a
real cache. Prints medians, the ratio of medians and the median of the per-round ratios (each
round runs every case once, in a fresh random order).

--state sets what the caches hold when a call starts: mixed (the default) whatever the case before
left there (at 4k MHA the 16 MB of one case's keys and values are half of a 32 MB L3, so a case
finds part of its own still there); cold, a pass over twice the last-level cache first (the
step's code and data evicted, as for one layer's step in a decoder of many layers); warm, the
same call run untimed just before (its keys and values in the L3 when they fit).
"""

from __future__ import annotations

import argparse
import glob
import statistics

import torch
import torch.nn.functional as F

import relpos
from rounds import timed_rounds

H, D = 8, 64


def cases_for(spec, ctx, hk, g, general=False):
    """name -> (setup, call): setup runs untimed before each call."""
    k = torch.randn(1, hk, ctx, D, generator=g)
    v = torch.randn(1, hk, ctx, D, generator=g)
    q = torch.randn(1, H, 1, D, generator=g)
    qpos = torch.tensor([ctx - 1.0], dtype=torch.float64)
    biases = relpos.mechanism(spec, D, H)["biases"]
    # a bias computed from the tokens (FoX, GRAPE-A, GRAPE-AP) reads the layer's inputs
    content = any(b["shape"] in ("separable", "gated_slope", "path_integral") for b in biases)
    model_dim = H * D if content else None
    x = torch.randn(1, ctx, H * D, generator=g) if content else None
    attn = relpos.Attention(spec, D, H, hk, model_dim=model_dim)
    cache = relpos.KVCache(1, hk, D, capacity=2 * ctx)
    # the module's own keys for the first ctx - 1 tokens (its transform applied by prefill)
    with torch.no_grad():
        attn(torch.randn(1, H, ctx - 1, D, generator=g), k[:, :, :-1], v[:, :, :-1], cache=cache,
             inputs=None if x is None else x[:, :-1])
    prefill_len = cache.lengths.clone()
    kc, vc = cache.keys.clone(), cache.values.clone()
    kn, vn = k[:, :, -1:], v[:, :, -1:]
    xn = None if x is None else x[:, -1:]

    def reset():
        cache.lengths.copy_(prefill_len)

    if general:  # a second module and cache, same keys, every step on the general path
        attn_g = relpos.Attention(spec, D, H, hk, model_dim=model_dim)
        attn_g.load_state_dict(attn.state_dict())
        attn_g._one_call_decode = False
        cache_g = relpos.KVCache(1, hk, D, capacity=2 * ctx)
        with torch.no_grad():
            attn_g(torch.randn(1, H, ctx - 1, D, generator=g), k[:, :, :-1], v[:, :, :-1],
                   cache=cache_g, inputs=None if x is None else x[:, :-1])

        def reset_g():
            cache_g.lengths.copy_(prefill_len)

    s = [b["slopes"] for b in biases if b["slopes"]]
    slopes = torch.tensor(s[0], dtype=torch.float64) if s else None
    # the whole cache, as the op reads it; SDPA reads its own copy: every case streams its own
    # keys and values, as a decoder does (sharing them would hand one case the other's warm L3)
    kf, vf = torch.cat([kc, kn], 2), torch.cat([vc, vn], 2)
    ks_, vs_ = kf.clone(), vf.clone()
    out = {
        # (the kernel alone for slope biases; a token-computed bias needs its module's tensors)
        **({} if content else {"ours_op": (None, lambda: relpos.fused_attention(
            q, kf, vf, q_positions=qpos,
            slopes=None if slopes is None else slopes.float()))}),
        "ours_module": (reset, lambda: attn(q, kn, vn, cache=cache, inputs=xn)),
        **({"module_general": (reset_g, lambda: attn_g(q, kn, vn, cache=cache_g, inputs=xn))}
           if general else {}),
        "sdpa": (None, lambda: F.scaled_dot_product_attention(q, ks_, vs_, enable_gqa=hk != H)),
    }
    if spec == "rope":
        inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        ang = torch.outer(torch.arange(2 * ctx, dtype=torch.float32), inv)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        ks, vs = torch.zeros(1, hk, 2 * ctx, D), torch.zeros(1, hk, 2 * ctx, D)
        ks[:, :, : ctx - 1], vs[:, :, : ctx - 1] = kc, vc

        def rotate_half(x):
            return torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)

        def sdpa_step():
            p = ctx - 1
            c, s_ = cos[p], sin[p]
            qr, kr = q * c + rotate_half(q) * s_, kn * c + rotate_half(kn) * s_
            ks[:, :, p : p + 1] = kr
            vs[:, :, p : p + 1] = vn
            return F.scaled_dot_product_attention(qr, ks[:, :, : p + 1], vs[:, :, : p + 1],
                                                  enable_gqa=hk != H)

        out["sdpa_step"] = (None, sdpa_step)
    if biases:
        if slopes is not None:  # ALiBi's row itself
            lag = (ctx - 1) - torch.arange(ctx, dtype=torch.float64)
            bias = (-slopes[:, None] * lag[None, :]).float().view(1, H, 1, ctx)
        else:  # a row of the same shape (SDPA's time does not depend on its values)
            bias = 0.1 * torch.randn(1, H, 1, ctx, generator=g)
        kb, vb = kf.clone(), vf.clone()  # its own copy too (not sdpa's, warm in the L3)
        out["sdpa_bias"] = (None, lambda: F.scaled_dot_product_attention(
            q, kb, vb, attn_mask=bias, enable_gqa=hk != H))
    return out


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(f).read().strip()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=32 << 20)


def prepared(setup, call, state, flush):
    """What runs untimed before a call: its setup, after a pass over the flush buffer (cold) or
    with the call itself run once more before it (warm)."""
    def before():
        if state == "cold":
            flush.add_(1.0)  # (read and written: the last-level cache holds the buffer afterwards)
        elif state == "warm":
            if setup:
                setup()
            call()
        if setup:
            setup()
    return before if (setup or state != "mixed") else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="4096,16384,32768")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec", default="rope")
    ap.add_argument("--general", action="store_true",
                    help="also time the module with the one-call step switched off")
    ap.add_argument("--state", choices=("mixed", "cold", "warm"), default="mixed",
                    help="mixed: whatever the case before left in the caches; cold: a pass over "
                         "twice the last-level cache before every call (a layer's cache in a "
                         "many-layer decoder); warm: the same call run untimed just before")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, spec {a.spec!r}, "
          f"B 1, Hq {H}, D {D}, float32, {a.rounds} rounds (medians; per-round ratio in brackets), "
          f"caches {a.state}")
    print()
    step = a.spec == "rope"
    print("| ctx | heads | case | ms | / sdpa | / sdpa (per round) |"
          + (" / sdpa_step (per round) |" if step else ""))
    print("|---|---|---|---|---|---|" + ("---|" if step else ""))
    flush = torch.ones(2 * last_level_cache_bytes() // 4) if a.state == "cold" else None
    for ctx in (int(x) for x in a.ctx.split(",")):
        for hk in (H, 2):
            cases = cases_for(a.spec, ctx, hk, g, a.general)
            times = {n: [] for n in cases}
            with torch.no_grad():
                for _ in range(2):  # warm-up
                    for setup, call in cases.values():
                        if setup:
                            setup()
                        call()
                times = timed_rounds({n: call for n, (_, call) in cases.items()}, a.rounds,
                                     setup={n: prepared(setup, call, a.state, flush)
                                            for n, (setup, call) in cases.items()})
            base = "sdpa_bias" if "sdpa_bias" in cases else "sdpa"
            for n, ts in times.items():
                med = statistics.median(ts)
                per = statistics.median(x / y for x, y in zip(ts, times[base]))
                extra = ""
                if step:
                    extra = f" {statistics.median(x / y for x, y in zip(ts, times['sdpa_step'])):.2f} |"
                print(f"| {ctx} | {H}:{hk} | {n} | {med:.3f} | "
                      f"{med / statistics.median(times[base]):.2f} | {per:.2f} |" + extra)
    print()
    print(f"(ratios against {'sdpa_bias, the materialised bias row' if a.spec != 'rope' else 'sdpa'})")


if __name__ == "__main__":
    main()
