"""The structured rotation by vector positions (torch.ops.relpos.structured_rotate, the O(D M)
kernel) against the same math composed from plain torch ops, in one process:

    .venv/bin/python bench/bench_structured.py [--T 4096,16384] [--dc 2] [--repeats 7] [--threads N]

Shape B=1, H=8, D=64, float32, M=32 planes (all active), a learned per-head basis U = Cayley(W)
[H, D, D], per-head freqs [H, dc, M], positions [T, dc]. Cases:
  relpos     torch.ops.relpos.structured_rotate(x, U, lam, pos)  (U's gradient through the op)
  composed   z = U^T x (einsum), angles from pos @ lam, the plane rotation on z, back with U, as a
             user would write it (autograd through torch ops)
Both are checked against each other before timing (max |diff| printed). Forward, and forward +
backward with gradients to x and U. Medians of --repeats calls, round-robin, after warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import relpos


def composed(x, U, lam, pos):
    M = lam.shape[-1]
    th = torch.einsum("tk,hkm->htm", pos.to(x.dtype), lam)[None]  # [1, H, T, M]
    Ua = U[..., : 2 * M]
    z = torch.einsum("hdj,bhtd->bhtj", Ua, x)
    z0, z1 = z[..., 0::2], z[..., 1::2]
    c, s = torch.cos(th), torch.sin(th)
    dz = torch.stack([c * z0 - s * z1 - z0, s * z0 + c * z1 - z1], -1).flatten(-2)
    return x + torch.einsum("hdj,bhtj->bhtd", Ua, dz)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="4096,16384")
    ap.add_argument("--dc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    B, H, D, M = 1, 8, 64, 32
    g = torch.Generator().manual_seed(0)
    W = 0.2 * torch.randn(H, D, D, generator=g, dtype=torch.float64)
    U0 = relpos.cayley_basis(W).float()
    lam = torch.rand(H, a.dc, M, generator=g)
    print(f"B={B} H={H} D={D} M={M} dc={a.dc} float32; torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}; medians of {a.repeats}")
    print("| T | pass | relpos ms | composed ms | composed / relpos | max diff |")
    print("|---|---|---:|---:|---:|---:|")
    for T in [int(t) for t in a.T.split(",")]:
        x0 = torch.randn(B, H, T, D, generator=g)
        pos = torch.rand(T, a.dc, generator=g, dtype=torch.float64) * 64
        for mode in ("fwd", "fwdbwd"):
            def run(f):
                x = x0.clone().requires_grad_(mode == "fwdbwd")
                U = U0.clone().requires_grad_(mode == "fwdbwd")
                if mode == "fwd":
                    with torch.no_grad():
                        return f(x, U, lam, pos)
                y = f(x, U, lam, pos)
                y.backward(torch.ones_like(y))
                return y

            cases = {"relpos": lambda x, U, l, p: torch.ops.relpos.structured_rotate(x, U, l, p, False),
                     "composed": composed}
            diff = (run(cases["relpos"]) - run(cases["composed"])).abs().max().item()
            times = {k: [] for k in cases}
            for _ in range(a.repeats):
                for k, f in cases.items():
                    t0 = time.perf_counter()
                    run(f)
                    times[k].append(1e3 * (time.perf_counter() - t0))
            r, c = statistics.median(times["relpos"]), statistics.median(times["composed"])
            print(f"| {T} | {mode} | {r:.1f} | {c:.1f} | {c / r:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
