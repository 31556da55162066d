// Whether a buffer of floating-point values holds no NaN or Inf, for the modules' check_finite.
#pragma once

#include <cstdint>

namespace relpos::kernels {

// n values of `bytes` bytes each (2: bfloat16 or float16, 4: float32, 8: float64) with exponent
// mask `exponent`: true when no value has every exponent bit set (NaN or Inf).
bool finite_values(const void* x, int64_t n, int bytes, uint64_t exponent);

}  // namespace relpos::kernels
