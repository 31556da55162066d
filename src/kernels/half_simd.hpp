// Half storage (bfloat16, float16) widened to float32 and rounded back, a row of words at a
// time, vectorised: the kernels' forms of kernels/half.hpp (the same bits). Used by the attention
// kernels' half operands and the rotations of half tensors.
// Internal header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set).
#pragma once

#ifndef RELPOS_ISA_NAMESPACE
#error "internal kernel header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set)"
#endif

#include <immintrin.h>

#include <cstdint>

#include "kernels/half.hpp"

namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

#if defined(__AVX512F__)
// 16 half words widened to float32 (exact).
template <HalfType TYPE>
inline __m512 widen16(const uint16_t* x) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  if constexpr (TYPE == HalfType::BFloat16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
  else
    return _mm512_cvtph_ps(w);
}

// 16 floats rounded to half words, to nearest-even (NaN stays NaN), as kernels/half.hpp.
template <HalfType TYPE>
inline __m256i narrow16(__m512 f) {
  if constexpr (TYPE == HalfType::BFloat16) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(
            u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))),
        16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
  } else {
    return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}
#endif

// y[0..n) = x[0..n) widened from half storage (exact); 16 (AVX-512) or 8 (AVX2, bfloat16) lanes
// at a time, the rest as kernels/half.hpp.
inline void widen(HalfType t, const uint16_t* x, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (t == HalfType::BFloat16)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, widen16<HalfType::BFloat16>(x + i));
  else
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, widen16<HalfType::Float16>(x + i));
#elif defined(__AVX2__)
  if (t == HalfType::BFloat16)
    for (; i + 8 <= n; i += 8) {
      const __m256i w =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
      _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
  for (; i < n; ++i) y[i] = half_to_float(t, x[i]);
}

// y[0..n) = x[0..n) rounded to half storage, to nearest-even (NaN stays NaN), as
// kernels/half.hpp.
inline void narrow(HalfType t, const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const auto store = [&](__m256i w) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), w); };
  if (t == HalfType::BFloat16)
    for (; i + 16 <= n; i += 16) store(narrow16<HalfType::BFloat16>(_mm512_loadu_ps(x + i)));
  else
    for (; i + 16 <= n; i += 16) store(narrow16<HalfType::Float16>(_mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) y[i] = float_to_half(t, x[i]);
}

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
