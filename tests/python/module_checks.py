"""Checks shared by the relpos.Attention test files: the catalog's terms of a kind, decoding in
chunks through a KVCache against the full forward, and every parameter's gradient against a
central finite difference."""

import torch

import relpos


def jittered(attn, scale):
    """attn with every parameter moved off its initial value by scale x N(0, 1) (torch's global
    generator, seeded by the caller)."""
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(scale * torch.randn_like(p))
    return attn


def grouped_qkv(g, B, T, D, hq, hk):
    """float64 q [B, hq, T, D], k and v [B, hk, T, D] from the generator g, in that order."""
    q = torch.randn(B, hq, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, hk, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def catalog_term(spec, head_dim, heads, wanted):
    """The first transform term of the spec's JSON for which ``wanted(term)`` holds; None when
    there is none or the spec does not build at this head shape."""
    try:
        info = relpos.mechanism(spec, head_dim, heads)
    except relpos.InputError:
        return None
    return next((t for t in info["transforms"] if wanted(t)), None)


def check_decoding(attn, q, k, v, x, positions=None):
    """Decoding the 9 tokens one at a time and in chunks of 4, 1, 3, 1 equals the full forward
    (1e-12)."""
    full = attn(q, k, v, inputs=x, positions=positions)
    for chunks in ([1] * 9, [4, 1, 3, 1]):
        got = decode_in_chunks(attn, q, k, v, x, chunks, positions=positions)
        torch.testing.assert_close(got, full, rtol=0, atol=1e-12)


def decode_in_chunks(attn, q, k, v, x, chunks, capacity=2, positions=None):
    """The module's outputs for q, k, v (inputs x, positions [B, T, ...] or none) fed through a
    fresh cache `chunks` tokens at a time, concatenated along time (without autograd: the
    cache is for inference)."""
    cache = relpos.KVCache(q.shape[0], k.shape[1], k.shape[3], dtype=q.dtype, capacity=capacity)
    outs, t = [], 0
    for n in chunks:
        sl = slice(t, t + n)
        pos = None if positions is None else positions[:, sl]
        with torch.no_grad():
            outs.append(attn(q[:, :, sl], k[:, :, sl], v[:, :, sl], inputs=x[:, sl],
                             positions=pos, cache=cache))
        t += n
    return torch.cat(outs, 2)


def check_parameter_gradients(attn, q, k, v, x, eps=1e-6, tol=1e-6, positions=None):
    """Each parameter's first entry: autograd's gradient of a random projection of the output
    equals the central difference."""
    out = attn(q, k, v, inputs=x, positions=positions)
    w = torch.randn_like(out)
    params = list(attn.parameters())
    if not params:  # (nothing learned: a fixed map)
        return
    for p, g in zip(params, torch.autograd.grad((out * w).sum(), params)):
        idx = (0,) * p.dim()
        with torch.no_grad():
            p[idx] += eps
            up = (attn(q, k, v, inputs=x, positions=positions) * w).sum()
            p[idx] -= 2 * eps
            down = (attn(q, k, v, inputs=x, positions=positions) * w).sum()
            p[idx] += eps
        fd = float((up - down) / (2 * eps))
        assert abs(fd - float(g[idx])) < tol * max(1.0, abs(float(g[idx]))), (p.shape, fd, float(g[idx]))


# every mechanism of the catalog; a context-extension rule (kind "scaling") on RoPE
CATALOG_SPECS = [m["name"] if m["kind"] != "scaling" else f"rope + {m['name']}"
                 for m in relpos.mechanisms()]


def head_dim_for(spec, heads, lo=8, hi=48):
    """The smallest even head dim in [lo, hi] at which the spec builds with `heads` heads."""
    for d in range(lo, hi + 1, 2):
        try:
            relpos.mechanism(spec, d, heads)
            return d
        except relpos.InputError:
            pass
    raise AssertionError(f"no head dim fits {spec}")


def catalog_shapes(specs, heads):
    """Each spec's head dim (head_dim_for) and its mechanism JSON at `heads` heads."""
    dims = {s: head_dim_for(s, heads) for s in specs}
    return dims, {s: relpos.mechanism(s, dims[s], heads) for s in specs}


def vector_dims(info):
    """d_c of a mechanism JSON's rotation by vector positions, or None when it has none."""
    return next((t["vector_dims"] for t in info["transforms"] if t["time"] == "vector_position"),
                None)
