"""Small Triton helpers the GPU kernels share."""

import triton
import triton.language as tl


@triton.jit
def compute(x, F64: tl.constexpr):
    """x in a call's compute dtype: float64 for float64 inputs, float32 for every other."""
    if F64:
        y = x.to(tl.float64)
    else:
        y = x.to(tl.float32)
    return y
