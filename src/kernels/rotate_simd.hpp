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

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "kernels/simd_ops.hpp"

#if defined(__AVX2__) && defined(__FMA__)
namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

namespace rot {

// A rotation whose inputs and outputs together fill this many bytes writes its outputs with
// streaming stores (rotate_tile's STREAM): they do not fit the last-level cache (32 MB on the
// hosts measured, shared with other cores), so the lines would leave it before anyone read them,
// and a plain store first reads each line from memory (a third of a rotation's traffic). Below it
// a consumer finds them in the cache: the training step's RoPE (2 x 4 MB written, 16 MB in all)
// ran 2-4% slower with them streamed.
constexpr int64_t kStreamFootprint = int64_t{32} << 20;

// Whether a rotation writing `bytes` to the outputs (null ones skipped), reading as many, streams
// them: at least kStreamFootprint, 64-byte aligned, `pairs` whole registers of pairs covering each
// row of D floats.
inline bool stream_rows(int64_t bytes, int pairs, int64_t D,
                        std::initializer_list<const float*> ys) {
  if (2 * bytes < kStreamFootprint || 2 * pairs != D || pairs % SimdOps::W) return false;
  for (const float* y : ys)
    if (y && reinterpret_cast<uintptr_t>(y) % 64) return false;
  return true;
}

// Streaming stores are weakly ordered: each thread that wrote with rotate_tile<_, true> calls this
// before the barrier after which others (or the caller) read the outputs.
inline void fence_streams(bool streamed) {
  if (streamed) _mm_sfence();
}

// W interleaved pairs (x0, x1) turned in registers into (y0, y1); c, s in pair order
// (V::to_pair_order). INVERSE: the transposed rotation (backward).
template <class V, bool INVERSE>
inline void turn_pairs(typename V::R x0, typename V::R x1, typename V::R c, typename V::R s,
                       typename V::R& y0, typename V::R& y1) {
  const auto re = V::template shuffle<0x88>(x0, x1), im = V::template shuffle<0xDD>(x0, x1);
  const auto yr = INVERSE ? V::fmadd(c, re, s * im) : V::fmsub(c, re, s * im);
  const auto yi = INVERSE ? V::fnmadd(s, re, c * im) : V::fmadd(s, re, c * im);
  y0 = V::unpacklo(yr, yi);
  y1 = V::unpackhi(yr, yi);
}

// W half-split pairs (re[j], im[j]) turned in registers into (yr, yi).
template <class V, bool INVERSE>
inline void turn_halves(typename V::R re, typename V::R im, typename V::R c, typename V::R s,
                        typename V::R& yr, typename V::R& yi) {
  yr = INVERSE ? V::fmadd(c, re, s * im) : V::fmsub(c, re, s * im);
  yi = INVERSE ? V::fnmadd(s, re, c * im) : V::fmadd(s, re, c * im);
}

// W pairs from x to y; `bad` gathers y * 0, NaN where y has a NaN or an infinity: the finiteness
// check of the outputs from the registers (two FMAs, where a pass over the outputs re-reads every
// line: it made a checked RoPE call 7-9% slower than an unchecked one on data in the cache).
// STREAM: streaming stores (y 64-byte aligned).
template <class V, bool INVERSE, bool STREAM = false>
inline void rotate_pairs(const float* x, float* y, typename V::R c, typename V::R s,
                         typename V::R* bad) {
  typename V::R y0, y1;
  turn_pairs<V, INVERSE>(V::load(x), V::load(x + V::W), c, s, y0, y1);
  *bad = V::fmadd(y0, V::zero(), V::fmadd(y1, V::zero(), *bad));
  if constexpr (STREAM) {
    V::stream(y, y0);
    V::stream(y + V::W, y1);
  } else {
    V::store(y, y0);
    V::store(y + V::W, y1);
  }
}

// Half-split pairs (x[j], x[j + half]) (GPT-NeoX's rotate_half): W pairs, no shuffles.
template <class V, bool INVERSE, bool STREAM = false>
inline void rotate_halves(const float* x, float* y, int64_t half, typename V::R c, typename V::R s,
                          typename V::R* bad) {
  typename V::R yr, yi;
  turn_halves<V, INVERSE>(V::load(x), V::load(x + half), c, s, yr, yi);
  *bad = V::fmadd(yr, V::zero(), V::fmadd(yi, V::zero(), *bad));
  if constexpr (STREAM) {
    V::stream(y, yr);
    V::stream(y + half, yi);
  } else {
    V::store(y, yr);
    V::store(y + half, yi);
  }
}

// Rows tt < n of a tile: a -> ya and b -> yb (either may be null), `pairs` pairs from the row
// start; cos/sin: the tile's first trig row at the segment's first block, rows trig_ld apart.
// Pairs interleaved, or with `half` > 0 half-split: (j, j + half).
// STREAM (where stream_rows allows it): the outputs bypass the cache, and the caller fences them
// (fence_streams) once its thread has written its last tile, before the threads' barrier: a fence
// per tile drains the write-combining buffers 2 x 1024 times in a 16 MiB rotation, and each drain
// idles the memory pipe. Returns bit 0 if ya got a NaN or an infinity, bit 1 for yb.
template <bool INVERSE, bool STREAM = false, class V = SimdOps>
int rotate_tile(int n, int pairs, const float* cos, const float* sin, int64_t trig_ld, int64_t D,
                int64_t rows_after, const float* a, const float* b, float* ya, float* yb,
                int64_t half = 0) {
  const RowPrefetcher ahead(D, rows_after, {a, b}, {STREAM ? nullptr : ya, STREAM ? nullptr : yb});
  const int full = pairs / V::W * V::W;
  typename V::R bad_a = V::zero(), bad_b = V::zero();
  bool tail_bad[2] = {false, false};
  for (int tt = 0; tt < n; ++tt) {
    ahead.row(tt);
    const float* cr = cos + tt * trig_ld;
    const float* sr = sin + tt * trig_ld;
    const int64_t o = tt * D;
    if (half)
      for (int j = 0; j < full; j += V::W) {
        const auto c = V::load(cr + j), s = V::load(sr + j);
        if (a) rotate_halves<V, INVERSE, STREAM>(a + o + j, ya + o + j, half, c, s, &bad_a);
        if (b) rotate_halves<V, INVERSE, STREAM>(b + o + j, yb + o + j, half, c, s, &bad_b);
      }
    else
      for (int j = 0; j < full; j += V::W) {
        const auto c = V::to_pair_order(V::load(cr + j)), s = V::to_pair_order(V::load(sr + j));
        if (a) rotate_pairs<V, INVERSE, STREAM>(a + o + 2 * j, ya + o + 2 * j, c, s, &bad_a);
        if (b) rotate_pairs<V, INVERSE, STREAM>(b + o + 2 * j, yb + o + 2 * j, c, s, &bad_b);
      }
    if constexpr (!STREAM)  // stream_rows leaves no pairs past the whole registers
      for (int j = full; j < pairs; ++j)
        for (int io = 0; io < 2; ++io) {
          const float* x = io ? b : a;
          float* y = io ? yb : ya;
          if (!x) continue;
          const int64_t re = half ? o + j : o + 2 * j, im = half ? re + half : re + 1;
          const float xr = x[re], xi = x[im], c = cr[j], s = INVERSE ? -sr[j] : sr[j];
          // explicit fmas: the same bits wherever the compiler inlines this
          y[re] = std::fma(xr, c, -(xi * s));
          y[im] = std::fma(xr, s, xi * c);
          tail_bad[io] |= !std::isfinite(y[re]) || !std::isfinite(y[im]);
        }
  }
  const auto has_nan = [](typename V::R v) {
    float lanes[V::W];
    V::store(lanes, v);
    for (float x : lanes)
      if (x != x) return true;
    return false;
  };
  return (tail_bad[0] || has_nan(bad_a) ? 1 : 0) | (tail_bad[1] || has_nan(bad_b) ? 2 : 0);
}

}  // namespace rot

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
#endif  // __AVX2__ && __FMA__
