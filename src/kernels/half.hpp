// Half-precision storage formats (bfloat16, IEEE float16) as the kernels read and write them:
// raw 16-bit words, widened to float32 exactly and rounded back to nearest-even (as PyTorch's
// own conversions round, so a kernel's half output equals its float32 output stored by
// PyTorch). Scalar forms here; the kernels' vectorised forms give the same bits.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace relpos::kernels {

enum class HalfType : uint8_t { BFloat16, Float16 };

inline float half_to_float(HalfType t, uint16_t h) {
  return t == HalfType::BFloat16 ? std::bit_cast<float>(static_cast<uint32_t>(h) << 16)
                                 : static_cast<float>(std::bit_cast<_Float16>(h));
}

inline uint16_t float_to_half(HalfType t, float x) {
  if (t == HalfType::Float16) return std::bit_cast<uint16_t>(static_cast<_Float16>(x));
  if (std::isnan(x)) return 0x7FC0;  // PyTorch's quiet NaN
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // nearest, ties to even
}

}  // namespace relpos::kernels
