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
#include "kernels/simd_ops.hpp"

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

#if defined(__AVX2__)
// 8 bfloat16 words widened to float32 (exact).
inline __m256 widen8_bf16(const uint16_t* x) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// 8 floats rounded to bfloat16 words, to nearest-even (NaN stays NaN), as kernels/half.hpp.
inline __m128i narrow8_bf16(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(
          u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                              _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))),
      16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  const __m256i w = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // every lane is below 2^16: the unsigned saturating pack keeps it
  return _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

#if defined(__F16C__)
// 8 float16 words widened to float32 (exact), and 8 floats rounded to float16 words.
inline __m256 widen8_f16(const uint16_t* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
inline __m128i narrow8_f16(__m256 f) {
  return _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif
#endif

// y[0..n) = x[0..n) widened from half storage (exact); 16 (AVX-512) or 8 (AVX2) lanes
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
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, widen8_bf16(x + i));
#if defined(__F16C__)
  else
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, widen8_f16(x + i));
#endif
#endif
  for (; i < n; ++i) y[i] = half_to_float(t, x[i]);
}

// y[0..n) = x[0..n) rounded to half storage, to nearest-even (NaN stays NaN), as
// kernels/half.hpp; 16 (AVX-512) or 8 (AVX2) lanes at a time.
inline void narrow(HalfType t, const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const auto store = [&](__m256i w) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), w); };
  if (t == HalfType::BFloat16)
    for (; i + 16 <= n; i += 16) store(narrow16<HalfType::BFloat16>(_mm512_loadu_ps(x + i)));
  else
    for (; i + 16 <= n; i += 16) store(narrow16<HalfType::Float16>(_mm512_loadu_ps(x + i)));
#elif defined(__AVX2__)
  if (t == HalfType::BFloat16)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), narrow8_bf16(_mm256_loadu_ps(x + i)));
#if defined(__F16C__)
  else
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), narrow8_f16(_mm256_loadu_ps(x + i)));
#endif
#endif
  for (; i < n; ++i) y[i] = float_to_half(t, x[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
// A register of V::W float lanes read from and rounded to half words: the kernels' loops over half
// rows written once per vector width (HalfLanes<V, TYPE>::kAvailable where the build has it:
// both formats with AVX-512, and with AVX2 and F16C).
template <class V, HalfType TYPE>
struct HalfLanes {
  static constexpr bool kAvailable = false;
};

#if defined(__F16C__)
template <HalfType TYPE>
struct HalfLanes<Avx2Ops, TYPE> {
  static constexpr bool kAvailable = true;
  using Words = __m128i;
  static __m256 load(const uint16_t* p) {
    return TYPE == HalfType::BFloat16 ? widen8_bf16(p) : widen8_f16(p);
  }
  static Words round(__m256 f) {
    return TYPE == HalfType::BFloat16 ? narrow8_bf16(f) : narrow8_f16(f);
  }
  static void store(uint16_t* p, Words w) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), w); }
  static void stream(uint16_t* p, Words w) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), w); }
  static Words zero() { return _mm_setzero_si128(); }
  // acc with the lanes of w whose exponent bits are all ones (NaN or infinity) set
  static Words nonfinite(Words acc, Words w) {
    const __m128i e = _mm_set1_epi16(TYPE == HalfType::BFloat16 ? 0x7F80 : 0x7C00);
    return _mm_or_si128(acc, _mm_cmpeq_epi16(_mm_and_si128(w, e), e));
  }
  static bool any(Words acc) { return !_mm_testz_si128(acc, acc); }
};
#endif

#if defined(__AVX512F__)
template <HalfType TYPE>
struct HalfLanes<Avx512Ops, TYPE> {
  static constexpr bool kAvailable = true;
  using Words = __m256i;
  static __m512 load(const uint16_t* p) { return widen16<TYPE>(p); }
  static Words round(__m512 f) { return narrow16<TYPE>(f); }
  static void store(uint16_t* p, Words w) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w); }
  static void stream(uint16_t* p, Words w) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), w);
  }
  static Words zero() { return _mm256_setzero_si256(); }
  static Words nonfinite(Words acc, Words w) {
    const __m256i e = _mm256_set1_epi16(TYPE == HalfType::BFloat16 ? 0x7F80 : 0x7C00);
    return _mm256_or_si256(acc, _mm256_cmpeq_epi16(_mm256_and_si256(w, e), e));
  }
  static bool any(Words acc) { return !_mm256_testz_si256(acc, acc); }
};
#endif
#endif

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
