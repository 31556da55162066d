"""The cost of PositionEncoding's default finiteness check: RoPE forward + backward with
check_finite=True (the default) against check_finite=False, in one process, rounds in random order.

    .venv/bin/python bench/bench_check_finite.py [--rounds 31] [--threads 2] [--shape B,H,T,D]

Shape (default) B=1, H=8, T=8192, D=64, float32, positions 0..T-1 (bench/bench_ops.py's;
`--shape 4,4,1024,64` stays in the cache). Prints the medians, their ratio, and the median and
quartiles of the per-round ratios. The check runs in the transform kernel: a plain rotation over
whole rows checks its outputs in the registers, other maps each output tile while it is in cache
(kernels/transform_driver.hpp).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import relpos
from rounds import parse_shape, timed_rounds

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="1,8,8192,64", help="B,H,T,D of q and k")
    a = ap.parse_args()
    B, H, T, D = parse_shape(ap, a.shape)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, requires_grad=True)
    k = torch.randn(B, H, T, D, requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    pos = torch.arange(T, dtype=torch.float64)
    encs = {c: relpos.PositionEncoding("rope", D, H, check_finite=c) for c in (True, False)}

    def run(enc):
        qo, ko = enc(q, k, pos)
        torch.autograd.backward((qo, ko), (gq, gk))
        q.grad = k.grad = None

    for enc in encs.values():
        for _ in range(3):
            run(enc)
    times = timed_rounds({c: (lambda c=c: run(encs[c])) for c in (True, False)}, a.rounds)
    m = {c: statistics.median(v) for c, v in times.items()}
    # the ratio within each round (the two calls ran back to back): its median and quartiles
    per_round = sorted(x / y for x, y in zip(times[True], times[False]))
    q1, q3 = statistics.quantiles(per_round, n=4)[0::2]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, [{B}, {H}, {T}, {D}], {a.rounds} rounds "
          f"(random order): check_finite=True {m[True]:.2f} ms, False {m[False]:.2f} ms, "
          f"ratio of medians {m[True] / m[False]:.2f}; per-round ratio median "
          f"{statistics.median(per_round):.2f} (quartiles {q1:.2f}-{q3:.2f})")


if __name__ == "__main__":
    main()
