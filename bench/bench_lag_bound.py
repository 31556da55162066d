"""A learned lag table bounded where it stops changing, against the table over every lag, in one
process, each case once per round in random order: one decode step of relpos.Attention(spec)
through its KVCache (B 1, H 8, D 64, float32), the cache reset to ctx - 1 keys before each step
(untimed).

    .venv/bin/python bench/bench_lag_bound.py [--spec t5_bias] [--ctx 4096,16384] [--threads 2]

  bounded     the module as users get it: its table stops at the mechanism's constant_from
              (T5: the first lag of the last bucket), the kernel reading longer lags there
  full_table  the same module building the table over every lag of the step (what it did before
              the bound; the encoding's bound set to the kernel's longest table)

Both give the same output (checked). Prints medians in ms and the median of per-round ratios."""

from __future__ import annotations

import argparse
import statistics

import torch

import relpos
from rounds import timed_rounds

H, D = 8, 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="t5_bias")
    ap.add_argument("--ctx", default="4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    info = relpos.mechanism(a.spec, D, H)
    bound = max(b["constant_from"] for b in info["biases"] if b["learned"])
    print(f"{a.spec}: table bounded at lag {bound}; {a.threads} threads, {a.rounds} rounds")
    print("| ctx | bounded ms | full_table ms | bounded / full_table |")
    print("|---|---:|---:|---:|")
    for ctx in (int(c) for c in a.ctx.split(",")):
        g = torch.Generator().manual_seed(0)
        prefill = [torch.randn(1, H, ctx - 1, D, generator=g) for _ in range(3)]
        step = [torch.randn(1, H, 1, D, generator=g) for _ in range(3)]
        cases = {}
        for name in ("bounded", "full_table"):
            attn = relpos.Attention(a.spec, D, H)
            if name == "full_table":
                attn.encoding._lag_bound = 1 << 20  # kernels::kMaxLagTable
            cache = relpos.KVCache(1, H, D, capacity=2 * ctx)
            with torch.no_grad():
                attn(*prefill, cache=cache)
            cases[name] = (attn, cache, cache.lengths.clone())
        outs = {}

        def call(n):
            with torch.no_grad():
                outs[n] = cases[n][0](*step, cache=cases[n][1])

        times = timed_rounds({n: (lambda n=n: call(n)) for n in cases}, a.rounds,
                             setup={n: (lambda c=c: c[1].lengths.copy_(c[2]))
                                    for n, c in cases.items()})
        torch.testing.assert_close(outs["bounded"], outs["full_table"], rtol=1e-6, atol=1e-6)
        ratio = statistics.median(b / f for b, f in zip(times["bounded"], times["full_table"]))
        print(f"| {ctx} | {statistics.median(times['bounded']):.3f} | "
              f"{statistics.median(times['full_table']):.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
