"""The Attention module with bfloat16 inputs against itself on float32 inputs and against what a
user writes instead (HF-style RoPE: the cos/sin table computed once, the rotation in bf16, then
SDPA in bf16), in one process, each case once per round in random order (bench/rounds.py).

    .venv/bin/python bench/bench_module_half.py [--T 1024,2048,4096] [--rounds 11] [--threads 2]
                                                [--specs rope,damped_rope] [--json-out FILE]

Shape B=1, H=8, D=64, causal. Modes: fwd (under torch.no_grad(): inference) and fwdbwd (the
gradients of q, k, v and of the mechanism's parameters). Cases per spec:
  fp32      relpos.Attention(spec) on float32 q, k, v
  bf16      the same module on bfloat16 q, k, v (the mechanism in float32; the kernel reads its
            operands rounded to bf16 unless the call trains the mechanism's parameters)
  sdpa_bf16 (rope only) rotate_half RoPE with a float32 table cast to bf16, then
            F.scaled_dot_product_attention(is_causal=True) in bf16
Reported: medians over the rounds, the per-round spread (min..max of a case's times), and the
ratios of the medians; the thread count and the kernel build (relpos.kernel_isa()).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import relpos
from rounds import timed_rounds

B, H, D = 1, 8, 64


def rope_table(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    return emb.cos().bfloat16(), emb.sin().bfloat16()


def sdpa_rope(q, k, v, cos, sin):
    def rot(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin
    return F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", default="1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--specs", default="rope,damped_rope")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    print(f"# relpos.Attention, B {B} H {H} D {D} causal; kernel build {relpos.kernel_isa()}; "
          f"{torch.get_num_threads()} threads; {a.rounds} rounds (medians; spread min..max)")
    print("| spec | T | mode | case | median ms | spread ms | / fp32 | / sdpa_bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in a.specs.split(","):
        attn = relpos.Attention(spec, D, H)
        for T in (int(t) for t in a.T.split(",")):
            g = torch.Generator().manual_seed(0)
            q32, k32, v32 = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
            dout = torch.randn(B, H, T, D, generator=g)
            cos, sin = rope_table(T)
            cases = {"fp32": (q32, k32, v32), "bf16": tuple(t.bfloat16() for t in (q32, k32, v32))}
            for mode in ("fwd", "fwdbwd"):
                def run(name, ops):
                    if mode == "fwd":
                        with torch.no_grad():
                            return (attn(*ops) if name != "sdpa_bf16"
                                    else sdpa_rope(*ops, cos, sin))
                    leaves = [t.detach().requires_grad_() for t in ops]
                    out = attn(*leaves) if name != "sdpa_bf16" else sdpa_rope(*leaves, cos, sin)
                    out.backward(dout.to(out.dtype))
                    return out
                todo = dict(cases)
                if spec == "rope":
                    todo["sdpa_bf16"] = cases["bf16"]
                for name, ops in todo.items():  # warm-up
                    run(name, ops)
                times = timed_rounds({n: (lambda n=n, ops=ops: run(n, ops))
                                      for n, ops in todo.items()}, a.rounds)
                med = {n: statistics.median(t) for n, t in times.items()}
                for n, t in times.items():
                    sd = med[n] / med["sdpa_bf16"] if "sdpa_bf16" in med else None
                    print(f"| {spec} | {T} | {mode} | {n} | {med[n]:.2f} | {min(t):.1f}..{max(t):.1f} "
                          f"| {med[n] / med['fp32']:.2f} | {'-' if sd is None else f'{sd:.2f}'} |")
                    rows.append({"spec": spec, "T": T, "mode": mode, "case": n, "median_ms": med[n],
                                 "runs_ms": t})
    if a.json_out:
        with open(a.json_out + ".tmp", "w") as f:
            json.dump({"kernel_isa": relpos.kernel_isa(), "threads": torch.get_num_threads(),
                       "rows": rows}, f, indent=1)
        import os
        os.replace(a.json_out + ".tmp", a.json_out)


if __name__ == "__main__":
    main()
