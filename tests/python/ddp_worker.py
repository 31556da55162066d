"""One rank of test_distributed.py: every mechanism of `relpos list` switched into a small Llama,
trained for two SGD steps under torch's own data parallelism (c10d, Gloo), each rank on its share
of the batch: DistributedDataParallel with its defaults (find_unused_parameters=False), and
FSDP2 (`fully_shard` on each decoder layer and the model: parameters sharded across the ranks,
gathered for each layer's forward and backward). Saves the trained (full) parameters per mode and
mechanism to $RELPOS_DDP_OUT/rank<r>.pt, or the mode, mechanism and error of the first failure.

    RANK=r WORLD_SIZE=n RELPOS_DDP_OUT=dir python ddp_worker.py

The ranks meet through a file in that folder (torch's FileStore: no port to race for), and a rank
whose peer is gone gives up after 120 s instead of Gloo's 30 minutes.

The test builds the same models and batch with build() and batch() and trains them on the whole
batch in one process: with equal token counts per rank, the mean of the ranks' gradients is the
whole batch's, so the parameters must agree."""

import datetime
import os
import pathlib
import traceback

import torch
from torch.distributed.fsdp import fully_shard

import relpos
import relpos.transformers as rt
import transformers

VOCAB, ROWS, LENGTH, STEPS, LR = 53, 4, 10, 2, 0.5


def names():
    """Every mechanism of `relpos list` (its default spec; a context-extension rule on RoPE)."""
    return [m["name"] if m["kind"] != "scaling" else f"rope + {m['name']}"
            for m in relpos.mechanisms()]


def build(name):
    """A float64 Llama (head dim 24, grouped heads) switched to the spec, or None where the
    switch refuses it by the mechanism's nature (positions that are vectors); any other refusal
    raises."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    try:
        rt.apply(model, name)
    except relpos.InputError as e:
        if "vector positions" in str(e):
            return None
        raise
    return model.train()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g)


def train(model, ids, forward=None):
    """STEPS steps of SGD on the mean next-token loss of ids (every row full: equal counts)."""
    forward = forward or model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        logits = forward(ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    folder = pathlib.Path(os.environ["RELPOS_DDP_OUT"])
    out = folder / f"rank{rank}.pt"
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{folder / 'store'}",
                                         rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=120))
    results, mode, name = {"ddp": {}, "fsdp": {}}, None, None
    try:
        shard = batch().chunk(world)[rank]
        for mode in results:
            for name in names():
                model = build(name)
                if model is None:
                    continue
                if mode == "ddp":
                    ddp = torch.nn.parallel.DistributedDataParallel(model)
                    results[mode][name] = train(model, shard, forward=ddp)
                else:
                    for layer in model.model.layers:
                        fully_shard(layer)
                    fully_shard(model)
                    train(model, shard)
                    results[mode][name] = {n: p.full_tensor() for n, p in model.named_parameters()}
        torch.save({"params": results}, out)
    except Exception:  # the test reports it with the mode and the mechanism's name
        torch.save({"failed": f"{mode} {name}", "error": traceback.format_exc()}, out)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
