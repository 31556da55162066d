"""A training step on packed documents (several documents in one row, position_ids restarting at
each, no padding: the padding-free collators' format), a Hugging Face model switched to relpos
against the same model on Hugging Face's own path, in one process, each case once per round in
random order (bench/rounds.py).

    .venv/bin/python bench/bench_hf_packed.py [--tokens 2048] [--docs 8] [--batch 2]
        [--kv-heads 8,2] [--rounds 5] [--threads 2] [--layers 4] [--hidden 512]

The model: a randomly initialised Llama (`--layers`, `--hidden`, 8 query heads of D = hidden / 8,
`--kv-heads` key/value heads each, MLP 2 x hidden, vocabulary 512). Each of `--batch` rows holds
`--tokens` tokens in `--docs` documents of random lengths (seeded). Without an attention mask or a
cache, HF finds the documents from the restarting position_ids and builds a block-diagonal causal
mask. Cases:

- `hf`: the model on `attn_implementation="sdpa"` (torch's SDPA with that boolean mask: HF's
  fastest CPU path for packed rows; `"flex_attention"`, which would skip the blocks masked out
  across documents, has no backward on the CPU: "FlexAttention does not support backward on
  CPU", torch 2.15);
- `relpos`: a deep copy after `relpos.transformers.apply(model)` (the model's own RoPE), the
  documents passed to the fused kernel as document ids;
- `relpos_materialised`: the same switched model with the document detection turned off, as
  before it existed: HF's boolean mask on relpos's materialised path.

The step: forward, cross-entropy over next tokens, backward (the gradients of every parameter).
Before timing, the three give the same loss (relative 1e-5) and gradients (1e-3 of the largest).
Prints medians (ms) and ratios against `hf` (median of the per-round ratios in brackets).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings

import torch

from rounds import per_round_ratio, timed_rounds


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def document_positions(tokens: int, docs: int, gen: torch.Generator) -> torch.Tensor:
    """Positions [tokens] of `docs` documents of random lengths (each at least 1), each from 0."""
    cuts = torch.randperm(tokens - 1, generator=gen)[: docs - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, tokens]
    return torch.cat([torch.arange(e - s) for s, e in zip(bounds, bounds[1:])])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per row")
    ap.add_argument("--docs", type=int, default=8, help="documents per row")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--kv-heads", type=ints, default=[8, 2], help="key/value heads (of 8)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    a = ap.parse_args()
    if (a.tokens < 2 or not 1 <= a.docs <= a.tokens or a.batch < 1 or a.rounds < 1
            or a.hidden % 16 or any(8 % h for h in a.kv_heads)):
        ap.error("--tokens >= 2, 1 <= --docs <= --tokens, --batch and --rounds positive, --hidden "
                 "a multiple of 16, --kv-heads divisors of 8")
    import transformers

    import relpos.transformers as rt

    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 512, (a.batch, a.tokens), generator=gen)
    pos = torch.stack([document_positions(a.tokens, a.docs, gen) for _ in range(a.batch)])
    detect = rt._documents

    def step(model, materialised=False):
        """Forward, loss, backward; returns the loss and the gradients."""
        rt._documents = (lambda full, standard: None) if materialised else detect
        try:
            model.zero_grad(set_to_none=True)
            logits = model(ids, position_ids=pos, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                     ids[:, 1:].flatten())
            loss.backward()
        finally:
            rt._documents = detect
        return loss.detach(), [p.grad for p in model.parameters()]

    cases = {}
    for hk in a.kv_heads:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
            num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=hk,
            max_position_embeddings=a.tokens, attn_implementation="sdpa")
        hf = transformers.LlamaForCausalLM(cfg).train()
        ours = copy.deepcopy(hf)
        rt.apply(ours)
        runs = {"hf": lambda m=hf: step(m), "relpos": lambda m=ours: step(m),
                "relpos_materialised": lambda m=ours: step(m, materialised=True)}
        ref_loss, ref_grads = runs["hf"]()
        for name in ("relpos", "relpos_materialised"):
            loss, grads = runs[name]()
            worst = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
                        for g, r in zip(grads, ref_grads))
            if abs(float(loss / ref_loss) - 1) > 1e-5 or worst > 1e-3:
                raise SystemExit(f"{hk} kv heads: {name} gives loss {float(loss):.6f} against HF's "
                                 f"{float(ref_loss):.6f}, gradients off by {worst:.2e} of the "
                                 "largest")
        for name, f in runs.items():
            cases[(hk, name)] = f
    for f in cases.values():  # warm-up
        f()
    times = timed_rounds(cases, a.rounds)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {a.threads} "
          f"threads, Llama {a.layers} layers, hidden {a.hidden}, 8 heads of {a.hidden // 8}, "
          f"float32; {a.batch} rows of {a.tokens} tokens in {a.docs} documents each; training "
          f"step (forward, loss, backward), {a.rounds} rounds in random order (medians, ms; "
          "per-round ratio in brackets)")
    print()
    print("| heads q:kv | HF (SDPA, boolean mask) | relpos | relpos / HF | relpos materialised | "
          "materialised / HF |")
    print("|---|---|---|---|---|---|")
    for hk in a.kv_heads:
        t = {n: times[(hk, n)] for n in ("hf", "relpos", "relpos_materialised")}
        m = {n: statistics.median(v) for n, v in t.items()}
        print(f"| 8:{hk} | {m['hf']:.1f} | {m['relpos']:.1f} | {m['relpos'] / m['hf']:.2f} "
              f"({per_round_ratio(t['relpos'], t['hf']):.2f}) | {m['relpos_materialised']:.1f} | "
              f"{m['relpos_materialised'] / m['hf']:.2f} "
              f"({per_round_ratio(t['relpos_materialised'], t['hf']):.2f}) |")


if __name__ == "__main__":
    main()
