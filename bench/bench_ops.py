"""Forward + backward of the position transforms from Python, in one process, round robin: the
relpos op as users get it (the default finiteness check on), and unchecked, against what a user
would write - the same math in eager PyTorch with the cos/sin table computed once, outside the
call (as Hugging Face's rotary embeddings cache it), and that code under torch.compile (the
strongest thing a user can write without relpos).

    .venv/bin/python bench/bench_ops.py [--rounds 15] [--threads N] [--dtype bfloat16] [--cases rope,...] [--shape B,H,T,D] [--json]

Shape (default) B=1, H=8, T=8192, D=64, float32 (16 MiB a tensor: past the last-level cache;
`--shape 4,4,1024,64`, the training step's q and k, stays within it), positions 0..T-1,
interleaved pairs; gradients for q, k and (Jordan) gamma and eta. Cases: rope; rope_half_split (Hugging Face's layout: pairs (j, j + D/2),
against its apply_rotary_pos_emb with rotate_half); jordan_m2 (raw chart, its damping and shear recomputed per
call from the trained parameters, as they change every step; the rotation's table once);
rotate_pairs (per-token angles [T, D/2], e.g. JoFormer's journey frames: every variant takes
the same cos/sin table, computed once); rotate_pairs_angles (relpos takes the angles and computes
their cos/sin in every call; the baselines keep the table). Each case is checked against the relpos op
before it is timed. Beside them, the memory floor: the same inputs and gradients copied into fresh
tensors (`copy`; compile / copy bounds what any op running at copy speed can show). Every round
runs every case once, in a fresh random order (seeded: bench/rounds.py); prints
medians (ms), the ratio of the medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import relpos
from rounds import parse_shape, per_round_ratio, timed_rounds

B, H, T, D = 1, 8, 8192, 64


def rope_table(pos, theta=10000.0):
    """cos, sin [T, D/2] in float32: what a model computes once and caches."""
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def rope_eager(q, k, cos, sin):
    def rot(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)

    return rot(q), rot(k)


def rotate_half(x):
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_hf(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb: half-split pairs, cos/sin [T, D] (each angle twice)."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_eager(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


def jordan_table(pos, center, theta=10000.0):
    """The order-2 blocks' rotation table [T, NB, 1] (angles -omega p), computed once."""
    nb = D // 4
    omega = theta ** (-2.0 * torch.arange(nb, dtype=torch.float64) / D)
    ang = -((pos - center)[:, None] * omega)
    return ang.cos().float()[..., None], ang.sin().float()[..., None]


def jordan2_eager(q, k, gamma, eta, pf, cs, sn, max_exp=30.0):
    """Raw-chart order-2 Jordan blocks (Jordan-RoPE 3.3): keys A(p) = e^{gamma p} R(-omega p) U(-p),
    queries A(p)^{-T}, U(t) = [[1, eta t], [0, 1]] on the two complex slots of each block; pf the
    centred positions [T] in float32."""
    nb = D // 4
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


def main():
    global B, H, T, D
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases",
                    default="rope,rope_half_split,jordan_m2,rotate_pairs,rotate_pairs_angles",
                    help="comma-separated subset of the transforms")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="q, k and the baselines' tables in this dtype (half: jordan_m2 left out, "
                         "its eager form mixes float32 parameters in)")
    ap.add_argument("--shape", default=f"{B},{H},{T},{D}",
                    help="B,H,T,D of q and k (default: 16 MiB per float32 tensor, past the cache; "
                         "4,4,1024,64 is the training step's, 4 MiB, within it)")
    a = ap.parse_args()
    B, H, T, D = parse_shape(ap, a.shape, multiple=4)  # jordan_m2: blocks of two pairs
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    pos = torch.arange(T, dtype=torch.float64)
    dt = getattr(torch, a.dtype)
    q = torch.randn(B, H, T, D).to(dt).requires_grad_()
    k = torch.randn(B, H, T, D).to(dt).requires_grad_()
    gq, gk = torch.randn(B, H, T, D).to(dt), torch.randn(B, H, T, D).to(dt)
    # half: relpos rounds once from float32, the eager forms at every op
    tol = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dt]
    # the eager Jordan composition turns in the paper's sense; builds with one rotation sense
    # across the catalog need direction=paper for it (bench/compare_builds.py runs older ones too)
    jordan_options = {o["key"] for m in relpos.mechanisms() if m["name"] == "jordan"
                      for o in m["options"]}
    paper = ", direction=paper" if "direction" in jordan_options else ""
    transforms = {}  # name -> {label: fn returning the tensors to differentiate}
    params = []
    cases = [("rope", "rope"), ("rope_half_split", "rope")]
    if dt == torch.float32:
        cases.append(("jordan_m2", f"jordan(m=2, regime=raw, eta0=0.05{paper})"))
    for name, spec in cases:
        layout = "half_split" if name.endswith("half_split") else "interleaved"
        encs = {c: relpos.PositionEncoding(spec, D, H, check_finite=c, pair_layout=layout)
                for c in (True, False)}
        torch.manual_seed(1)
        with torch.no_grad():  # varied parameters, as after training (the same in both)
            for p in encs[True].parameters():
                p.add_(0.3 * torch.randn_like(p))
            encs[False].load_state_dict(encs[True].state_dict())
        params += [p for e in encs.values() for p in e.parameters()]
        enc = encs[True]
        if name == "rope":
            cos, sin = (t.to(dt) for t in rope_table(pos))
            compiled_fn = torch.compile(rope_eager)
            base = {"eager": lambda: rope_eager(q, k, cos, sin),
                    "compiled": lambda c=compiled_fn: c(q, k, cos, sin)}
        elif name == "rope_half_split":
            cos2, sin2 = (torch.cat((t, t), -1).to(dt) for t in rope_table(pos))  # HF's [T, D]
            compiled_fn = torch.compile(rope_hf)
            base = {"eager": lambda: rope_hf(q, k, cos2, sin2),
                    "compiled": lambda c=compiled_fn: c(q, k, cos2, sin2)}
        else:
            center = enc.center_for(pos)
            cs, sn = jordan_table(pos, center)
            pf = (pos - center).float()
            compiled_fn = torch.compile(jordan2_eager)

            def kp(enc=enc):
                p = enc.kernel_params()
                return p["gamma"], p["eta"]

            base = {"eager": lambda kp=kp: jordan2_eager(q, k, *kp(), pf, cs, sn),
                    "compiled": lambda c=compiled_fn, kp=kp: c(q, k, *kp(), pf, cs, sn)}
        transforms[name] = {"relpos": lambda e=encs[True]: e(q, k, pos),
                            "relpos_unchecked": lambda e=encs[False]: e(q, k, pos), **base}
    angles = torch.randn(T, D // 2, dtype=torch.float64)
    cos_a, sin_a = angles.cos().to(dt), angles.sin().to(dt)
    rot_compiled = torch.compile(rotate_eager)
    rotate_base = {"eager": lambda: (rotate_eager(q, cos_a, sin_a),),
                   "compiled": lambda: (rot_compiled(q, cos_a, sin_a),)}
    # the same table as the baselines; and from the angles, their cos/sin in every call
    transforms["rotate_pairs"] = {
        "relpos": lambda: (relpos.rotate_pairs(q, cos=cos_a, sin=sin_a),), **rotate_base}
    transforms["rotate_pairs_angles"] = {
        "relpos": lambda: (relpos.rotate_pairs(q, angles),), **rotate_base}

    def fwd_bwd(f):
        def run():
            outs = f()
            torch.autograd.backward(outs, (gq, gk)[: len(outs)])
            q.grad = k.grad = None
            for p in params:
                p.grad = None
        return run

    def copy_floor(n):
        """The bytes every implementation moves, as plain copies: its n inputs read and n fresh
        outputs written (forward), n output gradients read and n fresh input gradients written
        (backward). At this floor an op is as fast as memory allows; compile / copy is the
        largest speedup any op running at copy speed could show."""
        def run():
            outs = [t.detach().clone() for t in (q, k)[:n]]
            grads = [g.clone() for g in (gq, gk)[:n]]
            del outs, grads
        return run

    wanted = set(a.cases.split(","))
    transforms = {n: c for n, c in transforms.items() if n in wanted}
    runs = {}
    for name, cases in transforms.items():
        ref = cases["relpos"]()
        for label, f in cases.items():
            for x, y in zip(f(), ref):
                torch.testing.assert_close(x, y, atol=tol, rtol=tol,
                                           msg=f"{name} {label} differs")
        for label, f in cases.items():
            runs[(name, label)] = fwd_bwd(f)
        runs[(name, "copy")] = copy_floor(len(ref))
    for f in runs.values():  # warm-up (compilation included)
        for _ in range(3):
            f()
    times = timed_rounds(runs, a.rounds)
    results = {}
    for name, cases in transforms.items():
        r = {label: statistics.median(times[(name, label)]) for label in [*cases, "copy"]}
        for base in ("eager", "compiled", "copy"):
            r[f"{base}_over_relpos"] = r[base] / r["relpos"]
            r[f"{base}_over_relpos_per_round"] = per_round_ratio(times[(name, base)],
                                                                 times[(name, "relpos")])
        r["compiled_over_copy"] = r["compiled"] / r["copy"]
        r["compiled_over_copy_per_round"] = per_round_ratio(times[(name, "compiled")],
                                                            times[(name, "copy")])
        if "relpos_unchecked" in cases:  # what the default finiteness check costs
            r["checked_over_unchecked"] = r["relpos"] / r["relpos_unchecked"]
            r["checked_over_unchecked_per_round"] = per_round_ratio(
                times[(name, "relpos")], times[(name, "relpos_unchecked")])
        results[name] = r
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": a.dtype,
            "shape": [B, H, T, D], "rounds": a.rounds}
    if a.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return
    print(f"torch {meta['torch']}, {meta['threads']} threads, B={B} H={H} T={T} D={D} {a.dtype}, "
          f"fwd+bwd, {a.rounds} rounds, each case once per round in random order (medians; "
          "per-round ratio in brackets)")
    print()
    print("| transform | relpos ms (checked) | unchecked ms | checked / unchecked | eager ms | "
          "torch.compile ms | eager / relpos | compile / relpos | copy ms | relpos / copy | "
          "compile / copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, r in results.items():
        unchecked, cost = "-", "-"
        if "relpos_unchecked" in r:
            unchecked = f"{r['relpos_unchecked']:.2f}"
            cost = (f"{r['checked_over_unchecked']:.2f} "
                    f"({r['checked_over_unchecked_per_round']:.2f})")
        print(f"| {n} | {r['relpos']:.2f} | {unchecked} | {cost} | {r['eager']:.2f} | "
              f"{r['compiled']:.2f} | "
              f"{r['eager_over_relpos']:.2f} ({r['eager_over_relpos_per_round']:.2f}) | "
              f"{r['compiled_over_relpos']:.2f} ({r['compiled_over_relpos_per_round']:.2f}) | "
              f"{r['copy']:.2f} | {1 / r['copy_over_relpos']:.2f} | "
              f"{r['compiled_over_copy']:.2f} ({r['compiled_over_copy_per_round']:.2f}) |")


if __name__ == "__main__":
    main()
