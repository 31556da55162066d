"""The GPU benchmark (issue 27): relpos's Triton kernels against the strongest thing a user has on
the same GPU, in one process, round robin, medians with the per-round spread.

    python bench/bench_gpu.py --out runs/bench-gpu            # everything, JSON + Markdown
    python bench/bench_gpu.py --sections attention --T 1024,4096 --rounds 3

Sections:
- transforms: RoPE (and Jordan m=2) on q and k through `relpos.PositionEncoding` as users get it,
  forward and forward+backward, against the device's copy bandwidth (the same bytes moved by
  `copy_`) and Liger's RoPE kernel (`liger_kernel`, when installed);
- attention: causal attention without a bias against `scaled_dot_product_attention` on its flash
  backend; with an ALiBi slope, a lag table (T5-style), FoX gates and a GRAPE-AP path integral
  against SDPA with the bias materialised (its memory-efficient backend) and against
  FlexAttention compiled with the same `score_mod` (path integrals have no score_mod: they read
  sums over the keys between j and i, so Flex reads the materialised bias), forward and
  forward+backward;
- decode: one token per sequence against a cached prefix (GQA), ours vs SDPA on the same prefix,
  tokens/s.
Peak memory is recorded per case (one extra run after the timed rounds).

Everything runs in `--dtype` (bf16 default) on CUDA; without a GPU it exits 2 with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def cuda_time(fn, iters):
    """Seconds per call over `iters` calls, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def round_robin(cases, rounds, budget_s=0.05):
    """cases: name -> callable. Each warmed, given an iteration count worth ~budget_s, then timed
    once per round in turn. Returns name -> (median s, min s, max s)."""
    iters = {}
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        t = cuda_time(fn, 1)
        iters[name] = max(1, min(200, int(budget_s / max(t, 1e-6))))
    samples = {n: [] for n in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(cuda_time(fn, iters[name]))
    return {n: (statistics.median(s), min(s), max(s)) for n, s in samples.items()}


def peak_memory(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fwd_bwd(f, *leaves):
    """A callable running f(*leaves) and a backward of its output's sum."""
    def run():
        out = f(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        for t in leaves:
            t.grad = None
    return run


def record(rows, section, case, impl, T, timing, extra=None, mem=None):
    med, lo, hi = timing
    row = {"section": section, "case": case, "impl": impl, "T": T, "median_ms": med * 1e3,
           "min_ms": lo * 1e3, "max_ms": hi * 1e3, "peak_mib": mem}
    row.update(extra or {})
    rows.append(row)
    print(f"{section:10s} {case:22s} {impl:14s} T={T:6d} {med * 1e3:9.3f} ms "
          f"[{lo * 1e3:.3f}, {hi * 1e3:.3f}]" + (f" {mem:8.0f} MiB" if mem is not None else "")
          + "".join(f" {k}={v:.3g}" if isinstance(v, float) else f" {k}={v}"
                    for k, v in (extra or {}).items()), flush=True)


# ---- transforms ---------------------------------------------------------------------------------

def bench_transforms(rows, args, dtype):
    import relpos
    B, H, D = 4, 32, 128
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as e:  # noqa: BLE001 - an optional baseline
        LigerRopeFunction = None
        print(f"transforms: no Liger baseline ({type(e).__name__}: {e})")
    for T in args.T_transform:
        q = torch.randn(B, H, T, D, device="cuda", dtype=dtype)
        k = torch.randn_like(q)
        dst_q, dst_k = torch.empty_like(q), torch.empty_like(k)
        nbytes = 4 * q.numel() * q.element_size()  # read q, k; write q~, k~
        cases = {"copy": lambda: (dst_q.copy_(q), dst_k.copy_(k))}
        for spec in ("rope", "jordan(m=2)"):
            enc = relpos.PositionEncoding(spec, D, H, pair_layout="half_split").cuda()
            cases[spec] = (lambda e: lambda: e(q, k))(enc)
        if LigerRopeFunction is not None:
            pos = torch.arange(T, device="cuda", dtype=torch.float32)
            inv = 10000.0 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
            ang = torch.outer(pos, inv)
            cos = torch.cat([ang.cos(), ang.cos()], -1)[None].to(dtype)
            sin = torch.cat([ang.sin(), ang.sin()], -1)[None].to(dtype)
            cases["liger_rope"] = lambda: LigerRopeFunction.apply(q, k, cos, sin)
        res = round_robin(cases, args.rounds)
        copy_s = res["copy"][0]
        for name, t in res.items():
            record(rows, "transforms", name, "fwd", T, t,
                   {"GB_s": nbytes / t[0] / 1e9, "of_copy": copy_s / t[0]})
        # forward + backward (the backward moves the same bytes again)
        ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
        cases = {}
        for spec in ("rope", "jordan(m=2)"):
            enc = relpos.PositionEncoding(spec, D, H, pair_layout="half_split").cuda()
            cases[spec] = fwd_bwd(lambda a, b, e=enc: torch.cat(e(a, b), 0), ql, kl)
        if LigerRopeFunction is not None:
            cases["liger_rope"] = fwd_bwd(
                lambda a, b: torch.cat(LigerRopeFunction.apply(a, b, cos, sin), 0), ql, kl)
        for name, t in round_robin(cases, args.rounds).items():
            record(rows, "transforms", name, "fwd+bwd", T, t)


# ---- attention ----------------------------------------------------------------------------------

def attention_inputs(T, dtype, tokens, H, D):
    B = max(1, tokens // T)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    return B, q, k, v


def materialised(bias_fn, B, H, T, dtype, limit_gib):
    """The bias [B or 1, H, T, T] with -inf above the diagonal, or None past the memory limit."""
    if B * H * T * T * torch.finfo(dtype).bits / 8 / 2**30 > limit_gib:
        return None
    i = torch.arange(T, device="cuda").view(T, 1)
    j = torch.arange(T, device="cuda").view(1, T)
    bias = bias_fn(i, j).to(dtype)
    return bias.masked_fill(j > i, float("-inf"))


def bench_attention(rows, args, dtype):
    import relpos
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001
        flex = None
        print(f"attention: no FlexAttention ({type(e).__name__}: {e})")
    H, D = args.heads, 128
    for T in args.T:
        B, q, k, v = attention_inputs(T, dtype, args.tokens, H, D)
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda")
        L = min(T, 1024)
        table = torch.randn(H, L, device="cuda") * 0.5
        logf = F.logsigmoid(torch.randn(B, H, T, device="cuda", dtype=torch.float64) + 3)
        cum = logf.cumsum(-1)  # FoX: bias(i, j) = c_i - c_j
        cum32 = cum.float()
        P = 16
        probe_q = torch.randn(B, H, T, P, device="cuda", dtype=dtype) * 0.5
        probe_k = torch.randn(B, H, T, P, device="cuda", dtype=dtype) * 0.5
        beta = torch.full((H,), 0.5, device="cuda")
        # the bias of each case as (i, j) -> [.., T, T] (for SDPA) and Flex's score_mod
        biases = {
            "alibi": dict(ours={"slopes": slopes.to(dtype)},
                          dense=lambda i, j: -(slopes.view(1, H, 1, 1) * (i - j)),
                          mod=lambda s, b, h, qi, kj: s - slopes[h] * (qi - kj)),
            "lag_table": dict(ours={"lag_table": table.to(dtype)},
                              dense=lambda i, j: table[:, (i - j).clamp(0, L - 1)].unsqueeze(0),
                              mod=lambda s, b, h, qi, kj: s + table[h, (qi - kj).clamp(0, L - 1)]),
            "fox_gates": dict(ours={"cq": cum, "ck": cum},
                              dense=lambda i, j: (cum32.unsqueeze(-1) - cum32.unsqueeze(-2)),
                              mod=lambda s, b, h, qi, kj: s + cum32[b, h, qi] - cum32[b, h, kj]),
        }
        if T <= args.path_max_T:
            def path_dense(i, j):
                # sum_{l=j+1..i} beta logsigmoid(q_i . k_l / P): a reverse cumsum over l
                z = F.logsigmoid(torch.einsum("bhip,bhlp->bhil", probe_q.float(), probe_k.float()) / P)
                z = z * (j <= i)  # l <= i
                s = z.flip(-1).cumsum(-1).flip(-1)  # sum_{l >= j}
                return beta.view(1, H, 1, 1) * (s - z)  # l > j
            biases["grape_ap_path"] = dict(
                ours={"path_q": probe_q, "path_k": probe_k, "path_beta": beta.to(dtype),
                      "path_scale": 1.0 / P},
                dense=path_dense, mod=None)
        flops = 4 * B * H * T * T * D / 2  # causal: half the square, two products
        cases = {
            "ours": lambda: relpos.fused_attention(q, k, v),
        }
        cases["sdpa_flash"] = lambda: _flash(q, k, v)
        for name, t in round_robin(cases, args.rounds).items():
            record(rows, "attention", "no_bias", name, T, t, {"TFLOP_s": flops / t[0] / 1e12},
                   mem=peak_memory(cases[name]))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        cases = {"ours": fwd_bwd(lambda a, b, c: relpos.fused_attention(a, b, c)[0], *leaves),
                 "sdpa_flash": fwd_bwd(lambda a, b, c: _flash(a, b, c), *leaves)}
        for name, t in round_robin(cases, args.rounds).items():
            record(rows, "attention", "no_bias", name + "+bwd", T, t,
                   {"TFLOP_s": 3.5 * flops / t[0] / 1e12}, mem=peak_memory(cases[name]))
        block_mask = None
        if flex is not None:
            block_mask = create_block_mask(lambda b, h, qi, kj: qi >= kj, None, None, T, T,
                                           device="cuda")
        for bname, spec in biases.items():
            dense = materialised(spec["dense"], B, H, T, dtype, args.bias_gib)
            fwd, both = {}, {}
            fwd["ours"] = (lambda o: lambda: relpos.fused_attention(q, k, v, **o))(spec["ours"])
            both["ours"] = fwd_bwd(lambda a, b, c, o=spec["ours"]: relpos.fused_attention(a, b, c, **o)[0],
                                   *leaves)
            if dense is not None:
                fwd["sdpa_bias"] = lambda d=dense: _efficient(q, k, v, d)
                both["sdpa_bias"] = fwd_bwd(lambda a, b, c, d=dense: _efficient(a, b, c, d), *leaves)
            if flex is not None and T in args.flex_T and (spec["mod"] is not None or dense is not None):
                mod = spec["mod"]
                if mod is None:  # read the materialised bias
                    mod = (lambda d: lambda s, b, h, qi, kj: s + d[b, h, qi, kj])(dense)
                fwd["flex"] = (lambda m: lambda: flex(q, k, v, score_mod=m, block_mask=block_mask))(mod)
                both["flex"] = fwd_bwd(
                    lambda a, b, c, m=mod: flex(a, b, c, score_mod=m, block_mask=block_mask), *leaves)
            for label, cases, mult in (("", fwd, 1.0), ("+bwd", both, 3.5)):
                try:
                    res = round_robin(cases, args.rounds)
                except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
                    print(f"attention {bname} T={T}{label}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                ref = res["ours"][0]
                for name, t in res.items():
                    record(rows, "attention", bname, name + label, T, t,
                           {"TFLOP_s": mult * flops / t[0] / 1e12, "ours_over": ref / t[0]},
                           mem=peak_memory(cases[name]))
            del dense
            torch.cuda.empty_cache()


def _flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _efficient(q, k, v, bias):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(q.shape[0], -1, -1, -1))


# ---- decode -------------------------------------------------------------------------------------

def bench_decode(rows, args, dtype):
    import relpos
    Hq, Hk, D = 32, 8, 128
    for B in (1, 8):
        for ctx in args.T:
            cap = ctx + 64
            kc = torch.randn(B, Hk, cap, D, device="cuda", dtype=dtype)
            vc = torch.randn_like(kc)
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dtype)
            k, v = kc[:, :, :ctx], vc[:, :, :ctx]  # the cache's used prefix, read in place
            kpos = torch.arange(ctx, dtype=torch.float64)
            qpos = torch.tensor([float(ctx - 1)], dtype=torch.float64)
            cases = {
                "ours": lambda: relpos.fused_attention(q, k, v, q_positions=qpos, k_positions=kpos),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            }
            for name, t in round_robin(cases, args.rounds).items():
                record(rows, "decode", f"B{B}", name, ctx, t, {"tokens_s": B / t[0]})


def markdown(rows, device):
    out = [f"GPU benchmark on {device}; medians of round-robin rounds [min, max], ms.", ""]
    for section in ("transforms", "attention", "decode"):
        sel = [r for r in rows if r["section"] == section]
        if not sel:
            continue
        extra = sorted({k for r in sel for k in r if k not in (
            "section", "case", "impl", "T", "median_ms", "min_ms", "max_ms", "peak_mib")})
        out += [f"### {section}", "",
                "| case | impl | T | median ms | [min, max] | peak MiB | " + " | ".join(extra) + " |",
                "|---|---|---|---|---|---|" + "---|" * len(extra)]
        for r in sel:
            cells = [f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in extra]
            mem = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            out.append(f"| {r['case']} | {r['impl']} | {r['T']} | {r['median_ms']:.3f} | "
                       f"[{r['min_ms']:.3f}, {r['max_ms']:.3f}] | {mem} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for bench_gpu.json and bench_gpu.md")
    p.add_argument("--sections", default="transforms,attention,decode")
    p.add_argument("--T", default="1024,4096,16384,32768", help="attention lengths, decode contexts")
    p.add_argument("--T-transform", default="4096", help="transform lengths")
    p.add_argument("--tokens", type=int, default=32768, help="B x T of an attention case")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--path-max-T", type=int, default=4096, help="longest T with a path bias "
                   "(its materialised baseline is O(T^2 P))")
    p.add_argument("--flex-T", default=None, help="lengths with a FlexAttention baseline (default: "
                   "all; each length compiles each score_mod anew)")
    p.add_argument("--bias-gib", type=float, default=24.0, help="largest materialised bias")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a machine with a GPU", file=sys.stderr)
        return 2
    args.T = [int(t) for t in args.T.split(",")]
    args.flex_T = args.T if args.flex_T is None else [int(t) for t in args.flex_T.split(",")]
    args.T_transform = [int(t) for t in args.T_transform.split(",")]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    import relpos  # noqa: F401 - registers the GPU kernels
    device = torch.cuda.get_device_name()
    rows, t0 = [], time.time()
    def save():
        meta = {"device": device, "dtype": args.dtype, "torch": torch.__version__,
                "rounds": args.rounds, "seconds": time.time() - t0}
        md = markdown(rows, device)
        if args.out:  # after every section: a run cut short keeps what it measured
            os.makedirs(args.out, exist_ok=True)
            for name, text in (("bench_gpu.json", json.dumps({"meta": meta, "rows": rows}, indent=1)),
                               ("bench_gpu.md", md)):
                tmp = os.path.join(args.out, name + ".tmp")
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, os.path.join(args.out, name))
        return md

    for section in args.sections.split(","):
        t = time.time()
        {"transforms": bench_transforms, "attention": bench_attention,
         "decode": bench_decode}[section](rows, args, dtype)
        print(f"== {section}: {time.time() - t:.0f} s", flush=True)
        save()
    print(save())
    return 0


if __name__ == "__main__":
    sys.exit(main())
