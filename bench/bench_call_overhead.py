"""Where a small RoPE call's time goes: the PositionEncoding module's forward against the transform
op it ends in (the same kernel, without the module's Python) and against copying q and k, each
timed warm (right after the same call, untimed) and cold (right after eager RoPE code, untimed,
whose temporaries leave the caches cold, as a model's other layers do), in one process, each case once
per round in random order (bench/rounds.py).

    .venv/bin/python bench/bench_call_overhead.py [--shape 4,4,1024,64] [--rounds 61] [--threads 2]
        [--moving]

Forward only, float32, positions 0..T-1 passed explicitly (as Hugging Face passes position ids),
the default finiteness check on. --moving: each call's positions follow the last call's (T
further on, as in decoding), so no table computed for earlier positions applies; the op then
builds its own cos/sin rows (cos and sin not passed). module - op is what the module's Python adds to a call: its
argument checks, the positions' check, the warnings, the table and parameter caches.
"""

from __future__ import annotations

import argparse
import itertools

import torch

import relpos
from rounds import parse_shape, warm_and_cold


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,4,1024,64", help="B,H,T,D of q and k")
    ap.add_argument("--rounds", type=int, default=61)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--moving", action="store_true",
                    help="each call at new positions (decoding), not at 0..T-1 every time")
    a = ap.parse_args()
    B, H, T, D = parse_shape(ap, a.shape)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    pos = torch.arange(T, dtype=torch.float64)
    enc = relpos.PositionEncoding("rope", D, H)
    kp = enc.kernel_params()
    params = [kp[n].detach() for n in ("gamma", "eta", "gates", "alpha0")]
    cos, sin = torch.ops.relpos.trig_table(pos, 0.0, 1, enc.spec, D, H, enc.layout, torch.float32)
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None] * inv[None, :]
    c_eager, s_eager = ang.cos().float(), ang.sin().float()
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()

    def eager_rope():  # what runs before a cold call: eager RoPE forward and backward
        def rot(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * c_eager - x2 * s_eager, x1 * s_eager + x2 * c_eager],
                               -1).flatten(-2)
        torch.autograd.backward((rot(qg), rot(kg)), (q, k))
        qg.grad = kg.grad = None

    # the positions of each call: the same tensor, or (--moving) each call T further on
    if a.moving:
        steps = itertools.cycle([pos + T * (i + 1) for i in range(256)])
    else:
        steps = itertools.repeat(pos)

    def module():
        with torch.no_grad():
            enc(q, k, next(steps))

    def op():
        p = next(steps)
        table = (None, None) if a.moving else (cos, sin)
        torch.ops.relpos.transform(q, k, *params, p, *table, 0.0, enc.spec, D, H, enc.layout,
                                   True)

    def copy():
        q.clone(), k.clone()

    torch.testing.assert_close(enc(q, k, pos)[0], torch.ops.relpos.transform(
        q, k, *params, pos, cos, sin, 0.0, enc.spec, D, H, enc.layout, True)[0], rtol=0, atol=0)
    calls = {"module": module, "op": op, "copy": copy}
    med = warm_and_cold(calls, eager_rope, rounds=a.rounds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, q and k [{B}, {H}, {T}, "
          f"{D}] float32, forward, positions {'moving' if a.moving else 'fixed'}, {a.rounds} "
          "rounds in random order (medians, ms)")
    print()
    print("| state | module | op | copy | module - op | op / copy |")
    print("|---|---|---|---|---|---|")
    for state in ("warm", "cold"):
        m, o, c = (med[(n, state)] for n in calls)
        print(f"| {state} | {m:.3f} | {o:.3f} | {c:.3f} | {m - o:.3f} | {o / c:.2f} |")


if __name__ == "__main__":
    main()
