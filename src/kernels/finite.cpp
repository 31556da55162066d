#include "kernels/finite.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace relpos::kernels {

namespace {

// The least (~x & exponent) over the values, as integers (vectorised without fast-math): 0
// exactly when some value is NaN or Inf. One pass, no mask written (isfinite(t).all() writes one
// as large as t).
template <class Bits>
bool finite_bits(const unsigned char* x, int64_t n, Bits exponent) {
  Bits least = exponent;
  for (int64_t i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, x + i * static_cast<int64_t>(sizeof b), sizeof b);
    least = std::min<Bits>(least, static_cast<Bits>(~b & exponent));
  }
  return least != 0;
}

}  // namespace

bool finite_values(const void* x, int64_t n, int bytes, uint64_t exponent) {
  const auto* p = static_cast<const unsigned char*>(x);
  switch (bytes) {
    case 2:
      return finite_bits<uint16_t>(p, n, static_cast<uint16_t>(exponent));
    case 4:
      return finite_bits<uint32_t>(p, n, static_cast<uint32_t>(exponent));
    case 8:
      return finite_bits<uint64_t>(p, n, exponent);
    default:
      throw std::invalid_argument("finite_values: values of 2, 4 or 8 bytes");
  }
}

}  // namespace relpos::kernels
