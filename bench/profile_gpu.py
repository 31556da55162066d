"""Where the GPU time of relpos's calls goes (torch.profiler tables: CUDA kernels and CPU-side
ops), for tuning on a lent GPU: the RoPE encoding, a decode step, attention forward+backward.

    python bench/profile_gpu.py [--rows 25]
"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def show(name, fn, rows, warm=3, reps=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    print(f"==== {name} ({reps} calls)")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows // 2, max_name_column_width=60))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_gpu: no CUDA device here", file=sys.stderr)
        return 2
    import relpos
    dt = torch.bfloat16
    q = torch.randn(4, 32, 4096, 128, device="cuda", dtype=dt)
    k = torch.randn_like(q)
    enc = relpos.PositionEncoding("rope", 128, 32, pair_layout="half_split").cuda()
    show("rope encoding, check_finite (default)", lambda: enc(q, k), args.rows)
    enc2 = relpos.PositionEncoding("rope", 128, 32, pair_layout="half_split", check_finite=False).cuda()
    show("rope encoding, check_finite=False", lambda: enc2(q, k), args.rows)
    kc = torch.randn(1, 8, 4096 + 64, 128, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    q1 = torch.randn(1, 32, 1, 128, device="cuda", dtype=dt)
    kpos = torch.arange(4096, dtype=torch.float64)
    qpos = torch.tensor([4095.0], dtype=torch.float64)
    show("decode step (1 x 32 heads, 8 kv heads, ctx 4096)",
         lambda: relpos.fused_attention(q1, kc[:, :, :4096], vc[:, :, :4096], q_positions=qpos,
                                        k_positions=kpos), args.rows)
    qa, ka, va = (torch.randn(8, 16, 4096, 128, device="cuda", dtype=dt, requires_grad=True)
                  for _ in range(3))

    def fwd_bwd():
        out, _ = relpos.fused_attention(qa, ka, va)
        out.backward(torch.ones_like(out))
    show("attention forward+backward (8 x 16 x 4096 x 128)", fwd_bwd, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
