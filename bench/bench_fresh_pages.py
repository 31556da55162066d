"""What fresh pages cost a call: the RoPE encoding called in a loop, as a model calls it, with the
page faults and kernel time each call takes, beside the same bytes copied with torch.

    .venv/bin/python bench/bench_fresh_pages.py [--T 4096] [--calls 30] [--repeats 3]

glibc returns a large freed block to the OS (munmap, or a trim of the heap's top) and the next
call of the same size faults its pages in again, zeroed by the kernel: the time then goes to
the faults, not to the op. Whether a loop falls into that pattern depends on the heap's layout in
that process, so run it a few times; `GLIBC_TUNABLES=glibc.malloc.trim_threshold=4000000000:\
glibc.malloc.mmap_threshold=4000000000` (or jemalloc / tcmalloc) keeps the blocks. Shape B 1,
H 8, D 64, float32. Cases: `encode` (forward under torch.no_grad()), `encode_bwd` (forward and
backward), `copy` (q and k cloned: the forward's bytes). Per case and repeat: median ms over the
calls, minor page faults per call, kernel (system) CPU ms per call.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import relpos


def measure(f, calls):
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (statistics.median(times), (r1.ru_minflt - r0.ru_minflt) / calls,
            (r1.ru_stime - r0.ru_stime) * 1e3 / calls)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    H, D = 8, 64
    torch.manual_seed(0)
    enc = relpos.PositionEncoding("rope", D, H)
    q = torch.randn(1, H, a.T, D, requires_grad=True)
    k = torch.randn(1, H, a.T, D, requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def encode():
        with torch.no_grad():
            enc(q, k)

    def encode_bwd():
        torch.autograd.backward(enc(q, k), (gq, gk))
        q.grad = k.grad = None

    def copy():
        q.detach().clone(), k.detach().clone()

    cases = {"encode": encode, "encode_bwd": encode_bwd, "copy": copy}
    for f in cases.values():
        f()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, T {a.T}, float32, "
          f"{a.calls} calls per cell")
    print()
    print("| case | repeat | median ms | minor faults / call | system ms / call |")
    print("|---|---|---|---|---|")
    for name, f in cases.items():
        for r in range(a.repeats):
            ms, faults, sys_ms = measure(f, a.calls)
            print(f"| {name} | {r + 1} | {ms:.2f} | {faults:.0f} | {sys_ms:.2f} |")


if __name__ == "__main__":
    main()
