"""The float32 attention kernels with their software prefetches on and off
(RELPOS_ATTENTION_PREFETCH=1 / 0, read at each kernel call; the default depends on the CPU's
vendor, kernels/isa.hpp), in one process, each case once per round in random order
(bench/rounds.py), after a warm-up.
    .venv/bin/python bench/bench_attention_prefetch.py [--T 1024,4096,16384] [--heads 8]
        [--rounds 15] [--threads 2] [--modes fwd,fwdbwd]
Per T and mode: causal relpos.attention without a mechanism on q, k, v [1, heads, T, 64],
forward (no autograd) or forward + backward; checks first that both settings give the same
output bits. Prints each setting's median (ms) and the median of the per-round ratios off / on,
with the CPU's vendor and the default it gets.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch

from rounds import per_round_ratio, timed_rounds

VAR = "RELPOS_ATTENTION_PREFETCH"


def cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="1024,4096,16384", help="sequence lengths, comma-separated")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="fwd,fwdbwd", help="fwd and/or fwdbwd, comma-separated")
    a = ap.parse_args()
    try:
        lengths = [int(t) for t in a.T.split(",")]
    except ValueError:
        lengths = []
    modes = a.modes.split(",")
    if not lengths or min(lengths) < 1 or a.heads < 1 or a.rounds < 1 or a.threads < 1:
        ap.error("--T takes positive lengths, comma-separated; --heads, --rounds, --threads > 0")
    if not modes or any(m not in ("fwd", "fwdbwd") for m in modes):
        ap.error(f"--modes takes fwd and/or fwdbwd, got {a.modes!r}")
    import relpos

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    vendor = cpu_vendor()
    saved = os.environ.pop(VAR, None)
    try:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {vendor} "
              f"(default: prefetch {'off' if vendor == 'GenuineIntel' else 'on'}), kernels "
              f"{relpos.kernel_isa()}, {a.rounds} rounds in random order (medians, ms)")
        print()
        print("| T | mode | prefetch on | prefetch off | off / on (per round) |")
        print("|---|---|---|---|---|")
        for T in lengths:
            q, k, v = (torch.randn(1, a.heads, T, 64) for _ in range(3))
            for mode in modes:
                def call(setting, mode=mode, q=q, k=k, v=v):
                    os.environ[VAR] = setting
                    if mode == "fwd":
                        with torch.no_grad():
                            relpos.attention(q, k, v, None, check_finite=False)
                    else:
                        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                        relpos.attention(qq, kk, vv, None, check_finite=False).sum().backward()

                cases = {s: (lambda s=s: call(s)) for s in ("1", "0")}
                outs = []
                for setting in ("1", "0"):  # a prefetch is a hint: the same bits either way
                    os.environ[VAR] = setting
                    with torch.no_grad():
                        outs.append(relpos.attention(q, k, v, None, check_finite=False))
                if not torch.equal(*outs):
                    raise SystemExit(f"T {T}: the prefetch setting changed the output")
                for f in cases.values():
                    f()
                times = timed_rounds(cases, a.rounds)
                on, off = (statistics.median(times[s]) for s in ("1", "0"))
                print(f"| {T} | {mode} | {on:.1f} | {off:.1f} | {off / on:.3f} "
                      f"({per_round_ratio(times['0'], times['1']):.3f}) |")
    finally:
        os.environ.pop(VAR, None)
        if saved is not None:
            os.environ[VAR] = saved


if __name__ == "__main__":
    main()
