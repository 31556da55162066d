"""Causal attention with an ALiBi-shaped lag bias from Python, in one process: FlexAttention
compiled for the CPU against SDPA with the bias materialised as a mask, and relpos's fused kernel
when the Python op exists.

    .venv/bin/python bench/bench_attention.py [--T 1024,4096,8192] [--repeats 5] [--threads N]
                                              [--modes fwd,fwdbwd] [--json]
                                              [--relpos-bench build/relpos-bench]

Shape B=1, H=8, D=64, float32, causal; the bias b_h(d) = -slope_h d (d = i - j), slopes
2^(-8 (h + 1) / H), the same numbers in every form:
  sdpa_mask  F.scaled_dot_product_attention with a float mask [1, H, T, T] (-inf above the
             diagonal), built once per T (untimed)
  flex       torch.compile(flex_attention) with score_mod = score - slope_h (q_idx - kv_idx) and
             a causal block mask (created once per T, untimed); compile time reported apart
  relpos     torch.ops.relpos.fused_attention(q, k, v, lag_table=[H, T], causal=True) when the
             installed relpos package registers it (the lag table form of the same bias)
  sdpa       F.scaled_dot_product_attention(is_causal=True) without bias, as a yardstick
Each case is checked against sdpa_mask before it is timed (max |diff| printed). Timing: medians
of --repeats calls, round-robin over the cases of one T, after warm-up calls.

Without torch.ops.relpos.fused_attention the script reports flex vs SDPA only; with
--relpos-bench PATH it also runs `relpos-bench attention` (our kernel through C++) for the same
sizes and prints that process's own ratio ours_lag / sdpa_mask next to this one's (HOOK: a
separate process, so compare ratios, not milliseconds).

Inductor on this machine: Debian's libtorch-dev (1.13) in /usr/lib/x86_64-linux-gnu shadows the
wheel's libtorch_cpu when Inductor links its C++ kernels (it passes -L <python LIBDIR> before
-L <torch/lib>), so every compiled CPU kernel, and the vector-ISA probe, fails to load
(undefined at::cpu::init_amx / Sleef_expf16_u10) and flex_attention's lowering then refuses
("trans_b requires AVX512 or AVX2 vec ISA"). Unless --no-inductor-fix, the script puts torch/lib
first on that link line and uses its own Inductor cache (--inductor-cache, default
/tmp/relpos-bench-inductor-UID), so that no kernel linked the wrong way is reused. FlexAttention
has no CPU backward in this PyTorch: flex fwdbwd is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

B, H, D = 1, 8, 64


def relpos_attention_op():
    """torch.ops.relpos.fused_attention if the relpos package provides it, else None."""
    try:
        import relpos  # noqa: F401  (loads the operator library)
    except Exception as e:  # noqa: BLE001 - any import problem means: no op
        print(f"# relpos package not importable ({type(e).__name__}: {e}); no relpos case",
              file=sys.stderr)
        return None
    try:
        return torch.ops.relpos.fused_attention
    except (AttributeError, RuntimeError):
        print("# torch.ops.relpos.fused_attention is not registered (yet); no relpos case",
              file=sys.stderr)
        return None


def alibi_slopes(h: int) -> torch.Tensor:
    return torch.exp2(-8.0 * (torch.arange(h, dtype=torch.float32) + 1) / h)


def make_mask(slopes: torch.Tensor, t: int) -> torch.Tensor:
    i = torch.arange(t, dtype=torch.float32)
    d = i[:, None] - i[None, :]
    m = -slopes.view(-1, 1, 1) * d
    m.masked_fill_(d < 0, float("-inf"))
    return m.unsqueeze(0)


def flex_setup(slopes: torch.Tensor, t: int):
    """(compiled flex_attention call, compile seconds) or (None, reason)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001
        return None, f"torch.nn.attention.flex_attention unavailable: {e}"

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).to(score.dtype)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    try:
        # a fresh Dynamo state per size: without it the recompilations for each new T (new
        # closure, new block mask) and the failed backward attempts reach Dynamo's recompile
        # limit, and flex_attention silently runs eagerly (10x slower here at T=4096)
        torch._dynamo.reset()
        block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)

        def call(q, k, v):
            return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

        return call, None
    except Exception as e:  # noqa: BLE001
        return None, f"flex_attention setup failed: {type(e).__name__}: {str(e)[:300]}"


def run_case(fn, q, k, v, dout, mode):
    if mode == "fwd":
        with torch.no_grad():
            return (fn(q, k, v),)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = fn(qg, kg, vg)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    return (out.detach(), *grads)


def inductor_fix(cache_dir: str) -> None:
    """See the module docstring: torch/lib first when Inductor links, a private cache."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
    import torch._inductor.cpp_builder as cb
    from torch.utils.cpp_extension import TORCH_LIB_PATH

    original = cb._get_python_related_args

    def torch_lib_first():
        include_dirs, lib_dirs = original()
        return include_dirs, [TORCH_LIB_PATH] + [d for d in lib_dirs if d != TORCH_LIB_PATH]

    cb._get_python_related_args = torch_lib_first


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def bench_size(t, args, relpos_op):
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, t, D) for _ in range(4))
    slopes = alibi_slopes(H)
    lag = (-slopes[:, None] * torch.arange(t, dtype=torch.float32)[None, :]).contiguous()
    mask = make_mask(slopes, t)
    cases = {
        "sdpa_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    notes = []
    flex, why = flex_setup(slopes, t)
    if flex is None:
        notes.append(f"flex skipped: {why}")
    else:
        cases["flex"] = flex
    if relpos_op is not None:
        cases["relpos"] = lambda q, k, v: relpos_op(q, k, v, lag_table=lag, causal=True)[0]
    rows = []
    for mode in args.modes:
        live = {}
        ref = run_case(cases["sdpa_mask"], q, k, v, dout, mode)
        for name, fn in cases.items():
            t0 = time.perf_counter()
            try:
                got = run_case(fn, q, k, v, dout, mode)
            except Exception as e:  # noqa: BLE001 - e.g. flex backward unsupported on the CPU
                notes.append(f"{name} {mode} skipped: {type(e).__name__}: {str(e)[:300]}")
                continue
            first = time.perf_counter() - t0
            diff = max_diff(got, ref) if name != "sdpa" else None
            live[name] = {"fn": fn, "first_call_s": first, "max_abs_diff_vs_sdpa_mask": diff,
                          "runs_ms": []}
        for _ in range(args.warmup):
            for c in live.values():
                run_case(c["fn"], q, k, v, dout, mode)
        for _ in range(args.repeats):
            for c in live.values():
                t0 = time.perf_counter()
                run_case(c["fn"], q, k, v, dout, mode)
                c["runs_ms"].append((time.perf_counter() - t0) * 1e3)
        for name, c in live.items():
            flops = 4.0 * B * H * t * t * D / 2 * (1.0 if mode == "fwd" else 3.5)
            med = statistics.median(c["runs_ms"])
            rows.append({
                "T": t, "mode": mode, "case": name, "runs_ms": c["runs_ms"], "median_ms": med,
                "gflops": flops / (med * 1e6), "first_call_s": c["first_call_s"],
                "max_abs_diff_vs_sdpa_mask": c["max_abs_diff_vs_sdpa_mask"],
            })
    return rows, notes


def relpos_bench_hook(path, sizes, args):
    """HOOK until torch.ops.relpos.fused_attention exists: our kernel through relpos-bench (a
    separate process) for the same sizes; returns its rows (ratios within that process)."""
    cmd = [path, "attention", "--T", ",".join(map(str, sizes)), "--repeats", str(args.repeats),
           "--modes", ",".join(args.modes), "--cases", "ours_lag,sdpa_mask", "--format", "json",
           "--no-memory", "--no-scaling", "--long-T", "0"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"# relpos-bench hook failed: {e}", file=sys.stderr)
        return []
    return json.loads(out)["ratios"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", default="1024,4096,8192")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-inductor-fix", action="store_true",
                    help="leave Inductor's link line and cache alone (see the module docstring)")
    ap.add_argument("--inductor-cache", default=f"/tmp/relpos-bench-inductor-{os.getuid()}")
    ap.add_argument("--relpos-bench", default=None,
                    help="path of relpos-bench: also report our kernel's ratio from it (hook)")
    args = ap.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    if any(m not in ("fwd", "fwdbwd") for m in args.modes):
        ap.error("--modes: fwd and/or fwdbwd")
    sizes = [int(x) for x in args.T.split(",") if x]
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.no_inductor_fix:
        inductor_fix(args.inductor_cache)
    relpos_op = relpos_attention_op()
    rows, notes = [], []
    for t in sizes:
        r, n = bench_size(t, args, relpos_op)
        rows += r
        notes += [f"T={t}: {x}" for x in n]
    hook = []
    if relpos_op is None and args.relpos_bench:
        hook = relpos_bench_hook(args.relpos_bench, sizes, args)
    med = {(r["T"], r["mode"], r["case"]): r["median_ms"] for r in rows}
    ratios = []
    for t in sizes:
        for mode in args.modes:
            base = med.get((t, mode, "sdpa_mask"))
            row = {"T": t, "mode": mode}
            for name in ("flex", "relpos", "sdpa"):
                if base and (t, mode, name) in med:
                    row[f"{name}_over_sdpa_mask"] = med[(t, mode, name)] / base
            for h in hook:
                if h["T"] == t and h["mode"] == mode:
                    row["relpos_bench_ours_lag_over_sdpa_mask (other process)"] = (
                        h["ours_lag_over_sdpa_mask"])
            ratios.append(row)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "B": B, "H": H,
              "D": D, "results": rows, "ratios": ratios, "notes": notes,
              "relpos_op": relpos_op is not None}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={B} H={H} D={D} "
          f"fp32 causal, ALiBi lag bias; medians of {args.repeats}")
    print("| T | pass | case | median ms | runs ms | GFLOP/s | first call s | max diff vs mask |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["max_abs_diff_vs_sdpa_mask"]
        print(f"| {r['T']} | {r['mode']} | {r['case']} | {r['median_ms']:.1f} | "
              f"{' / '.join(f'{x:.1f}' for x in r['runs_ms'])} | {r['gflops']:.1f} | "
              f"{r['first_call_s']:.2f} | {'-' if d is None else f'{d:.1e}'} |")
    print()
    for r in ratios:
        print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) and not math.isnan(v) else f"{k} {v}"
                        for k, v in r.items()))
    for n in notes:
        print(f"note: {n}")
    if relpos_op is None and not hook:
        print("note: no relpos case (torch.ops.relpos.fused_attention missing; "
              "--relpos-bench PATH reports our kernel from relpos-bench)")


if __name__ == "__main__":
    main()
