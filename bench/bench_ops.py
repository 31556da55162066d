"""Forward + backward of the position transforms from Python, in one process: the relpos op
against what a user would write - the same math in eager PyTorch, and that composition under
torch.compile (the strongest thing a user can write without relpos).

    .venv/bin/python bench/bench_ops.py [--repeats 15] [--threads N] [--json]

Shape B=1, H=8, T=8192, D=64, float32, positions 0..T-1, interleaved pairs; gradients for q, k and
(Jordan) gamma and eta. Each case is checked against the relpos op before it is timed. Prints
medians (ms) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import relpos

B, H, T, D = 1, 8, 8192, 64


def rope_eager(q, k, pos, theta=10000.0):
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos().to(q.dtype), ang.sin().to(q.dtype)

    def rot(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)

    return rot(q), rot(k)


def jordan2_eager(q, k, gamma, eta, pos, center, max_exp=30.0, theta=10000.0):
    """Raw-chart order-2 Jordan blocks (Jordan-RoPE 3.3): keys A(p) = e^{gamma p} R(-omega p) U(-p),
    queries A(p)^{-T}, U(t) = [[1, eta t], [0, 1]] on the two complex slots of each block."""
    nb = D // 4
    omega = theta ** (-2.0 * torch.arange(nb, dtype=torch.float64) / D)
    p = (pos - center)[:, None]  # [T, 1] float64
    ang = -(p * omega)  # [T, NB]
    cs, sn = ang.cos().to(q.dtype)[..., None], ang.sin().to(q.dtype)[..., None]
    pf = p.to(q.dtype)
    a = gamma.view(1, H, 1, nb) * pf.view(1, 1, T, 1)
    ek = torch.exp(a.clamp(-max_exp, max_exp))[..., None]
    eq = torch.exp((-a).clamp(-max_exp, max_exp))[..., None]
    c1 = (eta.view(1, H, 1, nb) * (-pf).view(1, 1, T, 1))

    def split(x):  # [B, H, T, NB, 2 slots] real and imaginary parts
        v = x.view(B, H, T, nb, 2, 2)
        return v[..., 0], v[..., 1]

    def join(yr, yi):
        return torch.stack([yr, yi], -1).reshape(B, H, T, D)

    def rotate(xr, xi):
        return xr * cs - xi * sn, xr * sn + xi * cs

    kr, ki = rotate(*split(k))
    qr, qi = rotate(*split(q))
    # keys: upper triangular [[1, c1], [0, 1]]; queries: its inverse transpose [[1, 0], [-c1, 1]]
    k0r, k0i = (kr[..., 0] + c1 * kr[..., 1]), (ki[..., 0] + c1 * ki[..., 1])
    q1r, q1i = (qr[..., 1] - c1 * qr[..., 0]), (qi[..., 1] - c1 * qi[..., 0])
    ko = join(torch.stack([k0r, kr[..., 1]], -1) * ek, torch.stack([k0i, ki[..., 1]], -1) * ek)
    qo = join(torch.stack([qr[..., 0], q1r], -1) * eq, torch.stack([qi[..., 0], q1i], -1) * eq)
    return qo, ko


def median_ms(fn, repeats):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    pos = torch.arange(T, dtype=torch.float64)
    q = torch.randn(B, H, T, D, requires_grad=True)
    k = torch.randn(B, H, T, D, requires_grad=True)
    gq, gk = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    results = {}
    # the eager Jordan composition turns in the paper's sense; builds with one rotation sense
    # across the catalog need direction=paper for it (bench/compare_builds.py runs older ones too)
    jordan_options = {o["key"] for m in relpos.mechanisms() if m["name"] == "jordan"
                      for o in m["options"]}
    paper = ", direction=paper" if "direction" in jordan_options else ""
    for name, spec in [("rope", "rope"), ("jordan_m2", f"jordan(m=2, regime=raw, eta0=0.05{paper})")]:
        enc = relpos.PositionEncoding(spec, D, H, check_finite=False)  # as the C++ benchmark
        with torch.no_grad():  # varied parameters, as after training
            for p in enc.parameters():
                p.add_(0.3 * torch.randn_like(p))
        center = enc.center_for(pos)

        def params():
            kp = enc.kernel_params()
            return kp["gamma"], kp["eta"]

        if name == "rope":
            ours = lambda: enc(q, k, pos)  # noqa: E731
            eager = lambda: rope_eager(q, k, pos)  # noqa: E731
        else:
            ours = lambda: enc(q, k, pos)  # noqa: E731
            eager = lambda: jordan2_eager(q, k, *params(), pos, center)  # noqa: E731
        compiled_fn = torch.compile(rope_eager if name == "rope" else jordan2_eager)
        compiled = (
            (lambda: compiled_fn(q, k, pos))
            if name == "rope"
            else (lambda: compiled_fn(q, k, *params(), pos, center))
        )
        ref = ours()
        for label, f in [("eager", eager), ("compiled", compiled)]:
            out = f()
            for x, y in zip(out, ref):
                torch.testing.assert_close(x, y, atol=2e-4, rtol=2e-4, msg=f"{name} {label} differs")

        def fwd_bwd(f):
            def run():
                qo, ko = f()
                torch.autograd.backward((qo, ko), (gq, gk))
                q.grad = k.grad = None
                for p in enc.parameters():
                    p.grad = None

            return run

        r = {lab: median_ms(fwd_bwd(f), a.repeats) for lab, f in [("relpos", ours), ("eager", eager), ("compiled", compiled)]}
        r["speedup_vs_eager"] = r["eager"] / r["relpos"]
        r["speedup_vs_compiled"] = r["compiled"] / r["relpos"]
        results[name] = r
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "shape": [B, H, T, D], "repeats": a.repeats}
    if a.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return
    print(f"torch {meta['torch']}, {meta['threads']} threads, B={B} H={H} T={T} D={D} float32, fwd+bwd, median of {a.repeats}")
    print("| transform | relpos ms | eager ms | torch.compile ms | vs eager | vs compile |")
    print("|---|---|---|---|---|---|")
    for n, r in results.items():
        print(f"| {n} | {r['relpos']:.2f} | {r['eager']:.2f} | {r['compiled']:.2f} | {r['speedup_vs_eager']:.1f}x | {r['speedup_vs_compiled']:.1f}x |")


if __name__ == "__main__":
    main()
