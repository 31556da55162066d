"""Data-parallel training through PyTorch's own distributed backend (c10d, Gloo; two ranks in two
processes): every mechanism of `relpos list` that switches a Hugging Face model trains under
DistributedDataParallel with its defaults and under FSDP2 (`fully_shard`), and each rank's
parameters equal those of the same steps on the whole batch in one process. DDP refuses a model
with a parameter that gets no gradient (its reducer waits for it), so this also holds every
registered parameter to being read."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import ddp_worker as w

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' saved results (the worker runs every mechanism in one process per rank)."""
    out = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, WORLD_SIZE="2", RELPOS_DDP_OUT=str(out), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    if "GLOO_SOCKET_IFNAME" not in env and pathlib.Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the loopback pair, whatever the hostname resolves to
    procs = [subprocess.Popen([sys.executable, str(HERE / "ddp_worker.py")],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:  # none left running (a rank that hangs is killed with the other)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{log[-4000:]}"
    saved = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for r, s in enumerate(saved):
        assert "failed" not in s, f"rank {r}, mechanism {s.get('failed')}:\n{s.get('error')}"
    return [s["params"] for s in saved]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_every_switchable_mechanism_trains_data_parallel(ranks, mode):
    switched = [n for n in w.names() if w.build(n) is not None]
    assert len(switched) == len(w.names()) - 1  # all but `structured` (vector positions)
    assert sorted(ranks[0][mode]) == sorted(switched) == sorted(ranks[1][mode])
    ids = w.batch()
    for name in switched:
        whole = w.train(w.build(name), ids)
        for r in range(2):
            got = ranks[r][mode][name]
            assert got.keys() == whole.keys(), name
            for n, p in whole.items():
                torch.testing.assert_close(got[n], p, rtol=1e-9, atol=1e-12,
                                           msg=f"{mode} {name} rank {r}: {n}")
        # the steps moved every parameter of the mechanism: each is read, none gets a gradient
        # that is always zero (order-1 Jordan blocks keep their unread eta as a buffer)
        start = dict(w.build(name).named_parameters())
        still = [n for n in whole if ".relpos." in n and torch.equal(whole[n], start[n])]
        assert not still, (name, still)
