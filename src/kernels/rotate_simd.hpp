// Plain rotations of interleaved pairs on the vector path: float, AVX2+FMA or AVX-512 builds only
// (empty otherwise). Two shuffles split two registers into real and imaginary parts whose pairs
// are in "pair order" (AVX2: [0, 1, 4, 5 | 2, 3, 6, 7]), cos and sin are one permuted load shared
// by the tensors of a tile, and two unpacks interleave the result again. Used by the transform
// kernels' RoPE fast path (transform_fast.hpp) and by rotate_pairs (rotate_isa.inc).
// Internal header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set).
#pragma once

#ifndef RELPOS_ISA_NAMESPACE
#error "internal kernel header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set)"
#endif

#include <cstdint>

#include "kernels/simd_ops.hpp"

#if defined(__AVX2__) && defined(__FMA__)
namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

namespace rot {

// INVERSE: the transposed rotation (backward). W pairs from x to y.
template <class V, bool INVERSE>
inline void rotate_pairs(const float* x, float* y, typename V::R c, typename V::R s) {
  const auto x0 = V::load(x), x1 = V::load(x + V::W);
  const auto re = V::template shuffle<0x88>(x0, x1), im = V::template shuffle<0xDD>(x0, x1);
  const auto yr = INVERSE ? V::fmadd(c, re, s * im) : V::fmsub(c, re, s * im);
  const auto yi = INVERSE ? V::fnmadd(s, re, c * im) : V::fmadd(s, re, c * im);
  V::store(y, V::unpacklo(yr, yi));
  V::store(y + V::W, V::unpackhi(yr, yi));
}

// Rows tt < n of a tile: a -> ya and b -> yb (either may be null), `pairs` pairs from the row
// start; cos/sin: the tile's first trig row at the segment's first block, rows trig_ld apart.
template <bool INVERSE, class V = SimdOps>
void rotate_tile(int n, int pairs, const float* cos, const float* sin, int64_t trig_ld, int64_t D,
                 int64_t rows_after, const float* a, const float* b, float* ya, float* yb) {
  const RowPrefetcher ahead(D, rows_after, {a, b}, {ya, yb});
  const int full = pairs / V::W * V::W;
  for (int tt = 0; tt < n; ++tt) {
    ahead.row(tt);
    const float* cr = cos + tt * trig_ld;
    const float* sr = sin + tt * trig_ld;
    const int64_t o = tt * D;
    for (int j = 0; j < full; j += V::W) {
      const auto c = V::to_pair_order(V::load(cr + j)), s = V::to_pair_order(V::load(sr + j));
      if (a) rotate_pairs<V, INVERSE>(a + o + 2 * j, ya + o + 2 * j, c, s);
      if (b) rotate_pairs<V, INVERSE>(b + o + 2 * j, yb + o + 2 * j, c, s);
    }
    for (int j = full; j < pairs; ++j)
      for (int io = 0; io < 2; ++io) {
        const float* x = io ? b : a;
        float* y = io ? yb : ya;
        if (!x) continue;
        const float xr = x[o + 2 * j], xi = x[o + 2 * j + 1], c = cr[j],
                    s = INVERSE ? -sr[j] : sr[j];
        y[o + 2 * j] = xr * c - xi * s;
        y[o + 2 * j + 1] = xr * s + xi * c;
      }
  }
}

}  // namespace rot

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
#endif  // __AVX2__ && __FMA__
