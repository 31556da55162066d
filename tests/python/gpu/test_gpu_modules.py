"""relpos.Attention and relpos.KVCache through the GPU backend, over the whole catalog with no
per-mechanism code: the forward, every gradient (q, k, v and the module's parameters) and decoding
through the cache equal the same module on the CPU kernels. With a GPU the module runs on CUDA
tensors; without one its relpos ops run the Triton functions in the interpreter
(gpu_testing.triton_backend)."""

import copy

import pytest
import torch

import relpos
from gpu_testing import CUDA, DEVICE, triton_backend
from module_checks import CATALOG_SPECS, head_dim_for, vector_dims

H, B, T, MODEL_DIM = 2, 2, 12, 16
DIMS = {s: head_dim_for(s, H, lo=16) for s in CATALOG_SPECS}
INFO = {s: relpos.mechanism(s, DIMS[s], H) for s in CATALOG_SPECS}


def decodes(info):
    return info["center"] != "mid" and not info["rope_scaling_dynamic"]


def case(spec, seed=0):
    """The module (parameters jittered off their initial values), q, k, v, inputs and positions
    (vector positions for a rotation by them), float32 on the CPU."""
    torch.manual_seed(seed)
    attn = relpos.Attention(spec, DIMS[spec], H, H, model_dim=MODEL_DIM)
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.2 * torch.randn_like(p))
    D = DIMS[spec]
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    x = torch.randn(B, T, MODEL_DIM)
    dc = vector_dims(INFO[spec])
    pos = torch.randn(T, dc) * 3 if dc else None
    return attn, q, k, v, x, pos


def run(attn, q, k, v, x, pos, device):
    """Output and the gradients of a fixed projection of it: q, k, v, then each parameter."""
    attn = copy.deepcopy(attn).to(device)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out = attn(*leaves, inputs=x.to(device), positions=None if pos is None else pos.to(device))
    w = torch.linspace(-1, 1, out.numel(), device=device).view_as(out)
    params = list(attn.parameters())
    # (allow_unused: a parameter of a branch the spec switches off, e.g. pj_bias's sectors)
    grads = torch.autograd.grad((out * w).sum(), leaves + params, allow_unused=True)
    return [out.detach().cpu()] + [None if g is None else g.cpu() for g in grads]


@pytest.mark.parametrize("spec", CATALOG_SPECS)
def test_forward_and_gradients_match_the_cpu_kernels(spec):
    attn, q, k, v, x, pos = case(spec)
    expected = run(attn, q, k, v, x, pos, "cpu")
    with triton_backend() as backend:
        got = run(attn, q, k, v, x, pos, DEVICE)
    if backend.calls is not None:  # the Triton functions ran (in the interpreter)
        assert backend.calls, f"{spec}: no relpos op went through the GPU backend"
    names = ["out", "dq", "dk", "dv"] + [n for n, _ in attn.named_parameters()]
    for name, a, b in zip(names, got, expected):
        assert (a is None) == (b is None), f"{spec} {name}: unused on one backend only"
        if a is None:
            continue
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{spec} {name}: {m}")


@pytest.mark.parametrize("spec", [s for s in CATALOG_SPECS if decodes(INFO[s])])
def test_decoding_through_the_cache_matches_the_full_forward(spec):
    attn, q, k, v, x, pos = case(spec, seed=1)
    with torch.no_grad():
        full = attn(q, k, v, inputs=x, positions=pos)
        dev = copy.deepcopy(attn).to(DEVICE)
        with triton_backend():
            cache = relpos.KVCache(B, H, DIMS[spec], capacity=4, device=DEVICE)
            outs, t = [], 0
            for n in (5, 1, 1, 4, 1):
                sl = slice(t, t + n)
                p = None if pos is None else pos[sl].to(DEVICE)
                outs.append(dev(q[:, :, sl].to(DEVICE), k[:, :, sl].to(DEVICE),
                                v[:, :, sl].to(DEVICE), inputs=x[:, sl].to(DEVICE), positions=p,
                                cache=cache).cpu())
                t += n
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("spec", ["rope", "alibi", "fox", "t5_bias", "grape_ap"])
def test_bfloat16_modules_stay_close_to_float32(spec):
    attn, q, k, v, x, pos = case(spec)
    dev = copy.deepcopy(attn).to(DEVICE)
    with torch.no_grad():
        ref = dev(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), inputs=x.to(DEVICE))
        half = dev(q.to(DEVICE, torch.bfloat16), k.to(DEVICE, torch.bfloat16),
                   v.to(DEVICE, torch.bfloat16), inputs=x.to(DEVICE, torch.bfloat16))
    torch.testing.assert_close(half.float(), ref, rtol=3e-2, atol=3e-2)
