// Vector traits of the hand-vectorised kernels (Avx2Ops: 8 float lanes, Avx512Ops: 16), the
// widest one this build has as SimdOps, and RowPrefetcher (software prefetch of the rows ahead).
// Kernel families write their fast paths once against these traits and get one instance per ISA
// build; none of this depends on the transforms (the attention kernels can use it as is). Empty
// in the baseline build. Internal header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE).
#pragma once

#ifndef RELPOS_ISA_NAMESPACE
#error "internal kernel header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set)"
#endif

#include <cstdint>
#include <initializer_list>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

// Asks for every cache line of bytes from p (a whole block, e.g. a tile of keys needed soon).
// volatile asm: GCC deletes loops whose only effect is __builtin_prefetch.
inline void prefetch_block(const void* p, int64_t bytes) {
  const auto base = reinterpret_cast<uintptr_t>(p);
  for (int64_t b = 0; b < bytes; b += 64)
    asm volatile("prefetcht0 (%0)" : : "r"(base + static_cast<uintptr_t>(b)));
}

// Asks for every cache line of the rows kAhead tokens ahead in the given tensors: on the
// development VM the hardware prefetchers alone leave the kernels far from memory speed (figures
// in docs/performance.md; every line has to be asked for, every second one is not enough).
// Addresses are formed as integers: the last rows reach past a tensor.
class RowPrefetcher {
 public:
  static constexpr int kAhead = 8;
  // rows of D floats; rows_after: rows from the first one to the end of the tensors
  RowPrefetcher(int64_t D, int64_t rows_after, std::initializer_list<const float*> reads,
                std::initializer_list<float*> writes)
      : bytes_(D * static_cast<int64_t>(sizeof(float))), rows_(rows_after) {
    for (const float* x : reads)
      if (x) base_[n_++] = reinterpret_cast<uintptr_t>(x);
    for (float* y : writes)
      if (y) base_[n_++] = reinterpret_cast<uintptr_t>(y);
  }
  void row(int tt) const {
    if (tt + kAhead >= rows_) return;
    const uintptr_t off = static_cast<uintptr_t>((tt + kAhead) * bytes_);
    for (int i = 0; i < n_; ++i)
      for (int64_t b = 0; b < bytes_; b += 64) line(base_[i] + off + static_cast<uintptr_t>(b));
  }

 private:
  // volatile asm: GCC deletes loops whose only effect is __builtin_prefetch
  static void line(uintptr_t address) { asm volatile("prefetcht0 (%0)" : : "r"(address)); }

  uintptr_t base_[6] = {};
  int n_ = 0;
  int64_t bytes_, rows_;
};

struct Avx2Ops {
  using R = __m256;
  using elem = float;  // what load reads (the row policies of a kernel loop: see HalfRows)
  static constexpr int W =
      8;  // floats per register = blocks per order-2 group = pairs per rotation step
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R zero() { return _mm256_setzero_ps(); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static void stream(float* p, R v) { _mm256_stream_ps(p, v); }  // p 32-byte aligned
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }    // a b + c
  static R fmsub(R a, R b, R c) { return _mm256_fmsub_ps(a, b, c); }    // a b - c
  static R fnmadd(R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  // masks of a partial group of r blocks: per data register j, and for W per-block values
  struct Mask {
    __m256i vec[4], blocks;
  };
  static Mask mask(int r) {
    Mask m;
    const __m256i rv = _mm256_set1_epi32(r);
    m.blocks = _mm256_cmpgt_epi32(rv, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int j = 0; j < 4; ++j) {  // register j holds blocks 2j (lanes 0-3) and 2j + 1
      const int a = 2 * j, b = 2 * j + 1;
      m.vec[j] = _mm256_cmpgt_epi32(rv, _mm256_setr_epi32(a, a, a, a, b, b, b, b));
    }
    return m;
  }
  static __m256i first(int n) {  // the mask of lanes < n
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static R load_masked(const float* p, __m256i m) { return _mm256_maskload_ps(p, m); }
  static void store_masked(float* p, __m256i m, R v) { _mm256_maskstore_ps(p, m, v); }
  static R to_lane_order(R v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
  }
  static R to_block_order(R v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  static int lane_slot(int b) {
    constexpr int slot[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    return (b & ~7) | slot[b & 7];
  }
  static R to_pair_order(R v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  }
  // the in-lane shuffles below are the same instructions at both widths
  static R unpacklo(R a, R b) { return _mm256_unpacklo_ps(a, b); }
  static R unpackhi(R a, R b) { return _mm256_unpackhi_ps(a, b); }
  template <int IMM>
  static R shuffle(R a, R b) {
    return _mm256_shuffle_ps(a, b, IMM);
  }
};

#if defined(__AVX512F__)
struct Avx512Ops {
  using R = __m512;
  using elem = float;
  static constexpr int W = 16;
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R zero() { return _mm512_setzero_ps(); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static void stream(float* p, R v) { _mm512_stream_ps(p, v); }  // p 64-byte aligned
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R fmsub(R a, R b, R c) { return _mm512_fmsub_ps(a, b, c); }
  static R fnmadd(R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); }
  struct Mask {
    __mmask16 vec[4], blocks;
  };
  static Mask mask(int r) {
    Mask m;
    m.blocks = static_cast<__mmask16>((1u << r) - 1);
    for (int j = 0; j < 4; ++j) {  // register j holds blocks 4j .. 4j + 3, one per 128-bit lane
      unsigned bits = 0;
      for (int l = 0; l < 4; ++l)
        if (4 * j + l < r) bits |= 0xFu << (4 * l);
      m.vec[j] = static_cast<__mmask16>(bits);
    }
    return m;
  }
  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1); }  // lanes < n
  static R load_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_masked(float* p, __mmask16 m, R v) { _mm512_mask_storeu_ps(p, m, v); }
  // lane l of a transposed register holds blocks l, l + 4, l + 8, l + 12: a 4x4 transpose of
  // the block index, its own inverse
  static R to_lane_order(R v) {
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
  }
  static R to_block_order(R v) { return to_lane_order(v); }
  static int lane_slot(int b) { return (b & ~15) | ((b & 3) * 4 + ((b & 15) >> 2)); }
  static R to_pair_order(R v) {
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15), v);
  }
  static R unpacklo(R a, R b) { return _mm512_unpacklo_ps(a, b); }
  static R unpackhi(R a, R b) { return _mm512_unpackhi_ps(a, b); }
  template <int IMM>
  static R shuffle(R a, R b) {
    return _mm512_shuffle_ps(a, b, IMM);
  }
};
using SimdOps = Avx512Ops;
#else
using SimdOps = Avx2Ops;
#endif

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
#endif  // __AVX2__ && __FMA__
