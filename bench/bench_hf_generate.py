"""A Hugging Face model switched to relpos against the same model on Hugging Face's own path, as an
engineer runs it: `model.generate()`, in one process, each case once per round in random order
(bench/rounds.py).

    .venv/bin/python bench/bench_hf_generate.py [--ctx 1024,4096] [--kv-heads 8,2] [--new 32]
        [--rounds 5] [--threads 2] [--layers 8] [--hidden 512] [--dtype float32] [--spec SPEC]
        [--hole]

The model: a randomly initialised Llama (`--layers`, `--hidden`, 8 query heads of D = hidden / 8,
`--kv-heads` key/value heads each: 8 is MHA, 2 is GQA 8:2, MLP 2 x hidden, vocabulary 512).
Baseline: the model as Hugging Face builds it, `attn_implementation="sdpa"` (its fastest CPU
attention: torch's SDPA with its own rotary embedding and `DynamicCache`). Ours: a deep copy of it
after `relpos.transformers.apply(model[, spec])` - the model's own RoPE by default, so both must
generate the same tokens (checked before timing: greedy decoding, 8 tokens), or `--spec`, another
mechanism (no token check: a different model).

Per context length (the prompt: random tokens 1-511 with an all-ones attention mask, as a
tokenizer returns it, or with `--hole` token ctx/2 masked out; batch 1) each model runs
`generate` for 1 + `--new` tokens once per round.
A logits processor stamps the time at every step: the prefill is the time from the call to the
first stamp (the prompt's forward), the decode time per token the mean interval between the first
and the last stamp (`--new` steps, each a one-token forward over the cache). Prints medians (ms),
ours / HF's and the median of the per-round ratios. Greedy decoding with `min_new_tokens` so every
call makes the same number of steps.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

from rounds import per_round_ratio, timed_rounds


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=ints, default=[1024, 4096], help="prompt lengths")
    ap.add_argument("--kv-heads", type=ints, default=[8, 2], help="key/value heads (of 8)")
    ap.add_argument("--new", type=int, default=32, help="decode steps timed per call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--spec", default=None,
                    help="a relpos mechanism instead of the model's own RoPE (no token check)")
    ap.add_argument("--hole", action="store_true",
                    help="a hole in the attention mask (token ctx/2 masked: relpos's "
                         "materialised path for the prefill)")
    a = ap.parse_args()
    if (min(a.ctx) < 1 or a.new < 1 or a.rounds < 1 or a.hidden % 16
            or any(8 % h for h in a.kv_heads)):
        ap.error("--ctx, --new and --rounds must be positive, --hidden a multiple of 16, "
                 "--kv-heads divisors of 8")
    import transformers

    import relpos.transformers

    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)

    class Stamps(transformers.LogitsProcessor):
        """The time of every step (generate calls it once per new token)."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(model, prompt, new, stamps=None):
        # as a tokenizer's output: the ids and an all-ones attention mask (token 0, the pad
        # token, never occurs in the prompt), or with --hole one token masked in the middle
        mask = torch.ones_like(prompt)
        if a.hole:
            mask[:, prompt.shape[1] // 2] = 0
        with torch.no_grad():
            return model.generate(prompt, attention_mask=mask,
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=0,
                                  logits_processor=transformers.LogitsProcessorList(
                                      [stamps] if stamps else []))

    measured = {}  # (hk, ctx, name) -> [(prefill ms, per-token ms)] by round

    def timed_generate(key, model, prompt):
        stamps = Stamps()
        t0 = time.perf_counter()
        generate(model, prompt, 1 + a.new, stamps)
        ts = stamps.times
        measured.setdefault(key, []).append(((ts[0] - t0) * 1e3,
                                             (ts[-1] - ts[0]) * 1e3 / (len(ts) - 1)))

    cases, models = {}, {}
    for hk in a.kv_heads:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
            num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=hk,
            max_position_embeddings=2 * max(a.ctx) + a.new + 1, attn_implementation="sdpa")
        hf = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
        ours = copy.deepcopy(hf)
        relpos.transformers.apply(ours, *([a.spec] if a.spec else []))
        models[hk] = {"hf": hf, "relpos": ours}
        for ctx in a.ctx:
            prompt = torch.randint(1, 512, (1, ctx), generator=torch.Generator().manual_seed(ctx))
            if not a.spec:
                same = torch.equal(generate(hf, prompt, 8), generate(ours, prompt, 8))
                if not same:
                    raise SystemExit(f"ctx {ctx}, {hk} kv heads: relpos generated other tokens "
                                     "than Hugging Face's model with the same weights")
            for name, model in models[hk].items():
                cases[(hk, ctx, name)] = (lambda k=(hk, ctx, name), m=model, p=prompt:
                                          timed_generate(k, m, p))
    for f in cases.values():  # warm-up
        f()
    measured.clear()
    timed_rounds(cases, a.rounds)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {a.threads} "
          f"threads, Llama {a.layers} layers, hidden {a.hidden}, 8 heads of "
          f"{a.hidden // 8}, {a.dtype}, {a.spec or 'its own RoPE'}"
          f"{', a hole in the mask' if a.hole else ''}; {a.rounds} rounds in random "
          "order (medians, ms; per-round ratio in brackets)")
    print()
    print("| ctx | heads q:kv | HF prefill | relpos prefill | relpos / HF | HF per token | "
          "relpos per token | relpos / HF |")
    print("|---|---|---|---|---|---|---|---|")
    for hk in a.kv_heads:
        for ctx in a.ctx:
            pre = {n: [p for p, _ in measured[(hk, ctx, n)]] for n in ("hf", "relpos")}
            tok = {n: [t for _, t in measured[(hk, ctx, n)]] for n in ("hf", "relpos")}
            med = {k: {n: statistics.median(v[n]) for n in v} for k, v in (("pre", pre),
                                                                             ("tok", tok))}
            print(f"| {ctx} | 8:{hk} | {med['pre']['hf']:.1f} | {med['pre']['relpos']:.1f} | "
                  f"{med['pre']['relpos'] / med['pre']['hf']:.2f} "
                  f"({per_round_ratio(pre['relpos'], pre['hf']):.2f}) | "
                  f"{med['tok']['hf']:.2f} | {med['tok']['relpos']:.2f} | "
                  f"{med['tok']['relpos'] / med['tok']['hf']:.2f} "
                  f"({per_round_ratio(tok['relpos'], tok['hf']):.2f}) |")


if __name__ == "__main__":
    main()
