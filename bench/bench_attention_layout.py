"""Causal attention forward + backward, relpos against SDPA, with the operands laid out two ways,
in one process, every case once per round in random order (bench/rounds.py), after a warm-up.
    .venv/bin/python bench/bench_attention_layout.py [--shape 4,4,1024,64] [--rounds 31]
        [--threads 2]
Layouts:
  separate  q, k, v contiguous [B, H, T, D] leaves, the output's gradient contiguous [B, H, T, D]
            (the operator alone, as `relpos bench attention` times it)
  model     as a transformer layer hands them over: one fused projection [B, T, 3 H D] (a leaf)
            split into q, k, v as the models split it (models::split_qkv: unbind over the q/k/v
            axis of a [B, T, 3, H, D] view, each transposed; q and k then made new contiguous
            tensors, as a position transform does; v stays a strided view), the output turned
            back into [B, T, H D], the gradient flowing to the projection
Prints each case's median (ms), the per-round median of relpos / SDPA in each layout, and what the
model layout adds to each (model - separate, medians), then the strides of each op's output and
gradients in the model layout. relpos reads a strided v and the output's strided gradient in
place, stores its output in the [B, T, H, D] order (the layer's transpose back a view) and dv
beside a strided v in that order too; SDPA's CPU kernel (as of torch 2.15) returns its output in
the [B, H, T, D] order and its three gradients in the [B, T, H, D] one.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from rounds import parse_shape, per_round_ratio, timed_rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,4,1024,64", help="B,H,T,D")
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    B, H, T, D = parse_shape(ap, a.shape, multiple=1)
    if a.rounds < 1 or a.threads < 1:
        ap.error("--rounds and --threads take positive values")
    import relpos

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    attend = {
        "relpos": lambda q, k, v: relpos.attention(q, k, v, None),
        "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True),
    }
    proj = torch.randn(B, T, 3 * H * D, requires_grad=True)
    grad = torch.randn(B, T, H * D)
    separate = [t.transpose(1, 2).detach().contiguous().requires_grad_()
                for t in proj.view(B, T, 3, H, D).unbind(2)]
    grad_separate = grad.view(B, T, H, D).transpose(1, 2).contiguous()

    def run_separate(f):
        f(*separate).backward(grad_separate)

    def run_model(f):
        q, k, v = (t.transpose(1, 2) for t in proj.view(B, T, 3, H, D).unbind(2))
        q, k = q.contiguous(), k.contiguous()
        f(q, k, v).transpose(1, 2).reshape(B, T, H * D).backward(grad)

    cases = {(name, layout): (lambda f=f, run=run: run(f))
             for name, f in attend.items()
             for layout, run in (("separate", run_separate), ("model", run_model))}
    with torch.no_grad():  # both give one attention (float32 rounding apart)
        q, k, v = separate
        err = (attend["relpos"](q, k, v) - attend["sdpa"](q, k, v)).abs().max().item()
    if not err < 1e-3:
        raise SystemExit(f"relpos and SDPA differ by {err}")
    for f in cases.values():
        f()
    times = timed_rounds(cases, a.rounds)
    med = {key: statistics.median(t) for key, t in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernels "
          f"{relpos.kernel_isa()}, shape B {B} H {H} T {T} D {D}, float32, causal, forward + "
          f"backward, {a.rounds} rounds in random order (medians, ms)")
    print()
    print("| layout | relpos | sdpa | relpos / sdpa (per round) |")
    print("|---|---|---|---|")
    for layout in ("separate", "model"):
        r, s = med[("relpos", layout)], med[("sdpa", layout)]
        ratio = per_round_ratio(times[("relpos", layout)], times[("sdpa", layout)])
        print(f"| {layout} | {r:.2f} | {s:.2f} | {r / s:.3f} ({ratio:.3f}) |")
    print()
    for name in attend:
        extra = med[(name, "model")] - med[(name, "separate")]
        print(f"- {name}: the model layout adds {extra:.2f} ms")
    # the layouts each op hands back in the model layout (q, k contiguous, v a strided view)
    q, k, v = (t.transpose(1, 2) for t in proj.detach().view(B, T, 3, H, D).unbind(2))
    q, k = q.contiguous().requires_grad_(), k.contiguous().requires_grad_()
    v = v.requires_grad_()
    for name, f in attend.items():
        out = f(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        print(f"- {name}: output strides {tuple(out.stride())}, gradient strides (q, k, v) "
              f"{', '.join(str(tuple(g.stride())) for g in grads)}")


if __name__ == "__main__":
    main()
