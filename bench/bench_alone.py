"""One transform's forward + backward called alone in a loop, each in its own fresh process: what a
user's loop gets from glibc's heap, with and without its trimming.

bench_ops.py times every case round robin in one process, whose heap the other cases' temporaries
keep large. A process that calls one op in a loop frees its outputs and gradients (4 x 16 MiB for
RoPE on q and k) at the end of every call; whether glibc returns that top of the heap to the OS
(it trims above a threshold that moves with the sizes freed) is decided by the process's heap
layout, and a trimmed heap is faulted in afresh on the next call. This runs each variant (the
relpos op; torch.compile of plain RoPE with the table made once, as bench_ops.py writes it) alone
in `--runs` fresh processes under glibc's defaults, and again with trimming and mmap for these
sizes switched off (`MALLOC_TRIM_THRESHOLD_`, and `MALLOC_MMAP_THRESHOLD_` at glibc's largest,
32 MiB: what tcmalloc, jemalloc or a caching allocator give), and prints per process the median ms
and the minor page faults per call.

    .venv/bin/python bench/bench_alone.py [--runs 6] [--calls 200] [--threads 2] [--shape B,H,T,D]

Each process checks its variant against eager RoPE before it times it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from rounds import parse_shape

B, H, T, D = 1, 8, 8192, 64  # (--shape; the default: 16 MiB a tensor, past the cache)
RETAIN = {"MALLOC_TRIM_THRESHOLD_": str(1 << 34), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def child(variant: str, calls: int, threads: int) -> dict:
    import torch

    import relpos

    def rope(q, k, cos, sin):  # what a user writes, the table made once
        def rot(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
        return rot(q), rot(k)

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, requires_grad=True)
    k = torch.randn(B, H, T, D, requires_grad=True)
    gq, gk = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    pos = torch.arange(T, dtype=torch.float64)
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos().float(), ang.sin().float()
    if variant == "relpos":
        enc = relpos.PositionEncoding("rope", D, H)  # as users get it: the finiteness check on

        def forward():
            return enc(q, k, pos)
    else:
        compiled = torch.compile(rope)

        def forward():
            return compiled(q, k, cos, sin)

    with torch.no_grad():
        for x, y in zip(forward(), rope(q, k, cos, sin)):
            torch.testing.assert_close(x, y, atol=2e-4, rtol=2e-4, msg=f"{variant} differs")

    def call():
        torch.autograd.backward(forward(), (gq, gk))
        q.grad = k.grad = None

    for _ in range(10):  # warm-up (compilation included)
        call()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return {"ms": statistics.median(times), "faults_per_call": faults / calls}


def main():
    global B, H, T, D
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--shape", default=f"{B},{H},{T},{D}", help="B,H,T,D of q and k")
    ap.add_argument("--child", choices=["relpos", "compiled"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    B, H, T, D = parse_shape(ap, a.shape)
    if a.child:
        print(json.dumps(child(a.child, a.calls, a.threads)))
        return
    if a.runs < 1 or a.calls < 1:
        ap.error("--runs and --calls must be at least 1")
    res = {}
    for run in range(a.runs):  # variants and heaps alternate, a fresh process each
        for heap, extra in (("glibc default", {}), ("no trim, no mmap", RETAIN)):
            for variant in ("relpos", "compiled"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", variant, "--calls", str(a.calls),
                     "--threads", str(a.threads), "--shape", a.shape],
                    check=True, capture_output=True, text=True, env={**os.environ, **extra}).stdout
                res.setdefault((heap, variant), []).append(json.loads(out.splitlines()[-1]))
        print(f"run {run + 1}/{a.runs} done", file=sys.stderr)
    print(f"RoPE fwd+bwd on q and k, B={B} H={H} T={T} D={D} float32, {a.threads} threads, "
          f"{a.calls} calls a process, one variant alone in each process, {a.runs} processes each")
    print()
    print("| heap | variant | median ms, process by process | page faults per call, process by "
          "process |")
    print("|---|---|---|---|")
    for (heap, variant), r in res.items():
        ms = " ".join(f"{x['ms']:.2f}" for x in r)
        faults = " ".join(f"{x['faults_per_call']:.0f}" for x in r)
        print(f"| {heap} | {variant} | {ms} | {faults} |")
    print()
    print("| heap | compile / relpos, process by process (the n-th processes of each) | min | "
          "median |")
    print("|---|---|---|---|")
    for heap in ("glibc default", "no trim, no mmap"):
        ratio = [c["ms"] / r["ms"] for c, r in zip(res[(heap, "compiled")], res[(heap, "relpos")])]
        print(f"| {heap} | {' '.join(f'{x:.2f}' for x in ratio)} | {min(ratio):.2f} | "
              f"{statistics.median(ratio):.2f} |")


if __name__ == "__main__":
    main()
