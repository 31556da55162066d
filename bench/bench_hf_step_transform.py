"""A switched Hugging Face layer's decode-step transform against HF's own RoPE at that step, in one
process, each case once per round in random order (bench/rounds.py), warm (right after the same
call, untimed) and cold (right after a decoder layer's other work, untimed: the projections and
MLP of a hidden-512 Llama layer and a DynamicCache append of --ctx keys, whose temporaries leave
the caches cold, as in `generate`).

    .venv/bin/python bench/bench_hf_step_transform.py [--kv-heads 8,2] [--tokens 1] [--ctx 1024]
        [--rounds 201] [--threads 2]

Per layout (8 query heads of D 64, `--kv-heads` key/value heads), q [1, 8, T, 64] and k
[1, Hk, T, 64] float32, T = --tokens at position ctx:
  relpos_step      `RelposAttention.transform` without autograd, as the layer's forward calls it
                   in `generate`: one call of the C++ step (checks, grouping, kernels) on HF's
                   int64 position_ids [1, T], the operator library's `step_transform`
  relpos_method    the same through the StepPlan.transform TorchScript method, as the package
                   calls it when the library is no Python module (and did before it was one)
  relpos_encoding  the same layer's encoding path (the PositionEncoding module; grouped queries
                   concatenated with the keys), which such calls ran before the one-call step, on
                   the float64 positions [T] the forward then made of position_ids (converted in
                   the timed call, as the forward did)
  hf_rope          HF's `apply_rotary_pos_emb(q, k, cos, sin)` with the step's cos and sin made
                   beforehand (HF makes them once per step for all layers; not timed here)
Prints medians (us) and the ratios of the medians; the relpos cases give the same bits (checked).
"""

from __future__ import annotations

import argparse

import torch

import relpos
from rounds import warm_and_cold


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-heads", default="8,2", help="key/value heads (of 8), comma-separated")
    ap.add_argument("--tokens", type=int, default=1, help="new tokens per step (at most 8)")
    ap.add_argument("--ctx", type=int, default=1024, help="cached tokens before the step")
    ap.add_argument("--rounds", type=int, default=201)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    try:
        layouts = [int(h) for h in a.kv_heads.split(",")]
    except ValueError:
        layouts = []
    if not layouts or any(h < 1 or 8 % h for h in layouts):
        ap.error(f"--kv-heads takes divisors of 8, comma-separated, got {a.kv_heads!r}")
    if not 1 <= a.tokens <= 8 or a.ctx < 1 or a.rounds < 1:
        ap.error("--tokens must be 1..8, --ctx and --rounds positive")
    import transformers
    from transformers.models.llama import modeling_llama

    import relpos.transformers as rt

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    T, D, hidden = a.tokens, 64, 512
    pos_ids = torch.arange(a.ctx, a.ctx + T)[None]
    pos = pos_ids[0].to(torch.float64)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, {T} token(s) at position {a.ctx}, 8 query heads of "
          f"{D}, float32, {a.rounds} rounds in random order (medians, us)")
    print()
    print("| heads q:kv | state | relpos_step | relpos_method | relpos_encoding | hf_rope | "
          "step / method | step / encoding | step / hf_rope |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hk in layouts:
        cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                       num_attention_heads=8, num_key_value_heads=hk,
                                       num_hidden_layers=1, vocab_size=512)
        rotary = modeling_llama.LlamaRotaryEmbedding(cfg)
        layer = modeling_llama.LlamaDecoderLayer(cfg, 0).eval()
        x = torch.randn(1, T, hidden)
        q, k = torch.randn(1, 8, T, D), torch.randn(1, hk, T, D)
        cos, sin = rotary(x, pos_ids)
        step = rt.RelposAttention("rope", D, 8, hk, scale=D ** -0.5)
        encoding = rt.RelposAttention("rope", D, 8, hk, scale=D ** -0.5)
        encoding._step_transform = False  # the encoding path, as before the one-call step
        method = rt.RelposAttention("rope", D, 8, hk, scale=D ** -0.5)
        past = torch.randn(1, hk, a.ctx, D)

        with torch.no_grad():
            got, want = step.transform(q, k, pos_ids), encoding.transform(q, k, pos)
            steps, relpos._library.STEPS = relpos._library.STEPS, None
            try:  # (the layer's step call is made on its first step: here the method)
                by_method = method.transform(q, k, pos_ids)
            finally:
                relpos._library.STEPS = steps
        if steps is None:
            print("(the operator library is no Python module: relpos_step is the method too)\n")
        if not all(torch.equal(g, w) and torch.equal(g, m)
                   for g, w, m in zip(got, want, by_method)):
            raise SystemExit("the one-call step, the method and the encoding path gave different "
                             "bits")

        def layer_work():  # a decoder layer's other work at this step
            with torch.no_grad():
                h = layer.input_layernorm(x)
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj, layer.self_attn.o_proj):
                    proj(h)
                layer.mlp(layer.post_attention_layernorm(h))
                torch.cat([past, k], 2)

        def relpos_step():
            with torch.no_grad():
                step.transform(q, k, pos_ids)

        def relpos_method():
            with torch.no_grad():
                method.transform(q, k, pos_ids)

        def relpos_encoding():
            with torch.no_grad():
                encoding.transform(q, k, pos_ids.to(torch.float64)[0])

        def hf_rope():
            with torch.no_grad():
                modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)

        calls = {"relpos_step": relpos_step, "relpos_method": relpos_method,
                 "relpos_encoding": relpos_encoding, "hf_rope": hf_rope}
        med = {key: ms * 1e3
               for key, ms in warm_and_cold(calls, layer_work, rounds=a.rounds, warmup=5).items()}
        for state in ("warm", "cold"):
            s, m, e, h = (med[(n, state)] for n in calls)
            print(f"| 8:{hk} | {state} | {s:.1f} | {m:.1f} | {e:.1f} | {h:.1f} | {s / m:.2f} | "
                  f"{s / e:.2f} | {s / h:.2f} |")


if __name__ == "__main__":
    main()
