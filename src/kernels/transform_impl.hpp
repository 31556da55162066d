// Implementation of the transform kernels, included once per instruction set (transform_isa.inc):
// the same code is compiled for the baseline x86-64 and for AVX2+FMA, and transform.cpp picks the
// best at run time. Internal header: include kernels/transform.hpp instead.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "core/charts.hpp"
#include "kernels/transform.hpp"

namespace relpos::kernels {
namespace RELPOS_ISA_NAMESPACE {

constexpr int kMaxOrder = 8;
constexpr int64_t kTrigAnchor = 32;

template <Layout LY>
struct Addr {
  static int re(int j, int /*D*/) { return LY == Layout::Interleaved ? 2 * j : j; }
  static int im(int j, int D) { return LY == Layout::Interleaved ? 2 * j + 1 : j + D / 2; }
};

int covered_pairs(const TransformPlan& plan) {
  int n = 0;
  for (const auto& s : plan.segments) n = std::max(n, s.first_pair + s.blocks * s.order);
  return n;
}

#if defined(__AVX2__) && defined(__FMA__)
// Hand-vectorised order-2 blocks in the interleaved layout, float: a block's four floats
// (re0, im0, re1, im1) fill one 128-bit lane, so two blocks fill an AVX register and every
// step is an in-lane shuffle. One routine serves the forward maps and the transposed (backward)
// ones, ggml-style: INVERSE rotates by the opposite angle, UPPER mixes slot 1 into slot 0
// (keys forward, queries backward) and !UPPER slot 0 into slot 1.
namespace avx2_m2 {

// [v[b], v[b], v[b], v[b], v[b+1] x 4]
inline __m256 lanes_of(const float* v, int b) {
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(v + b)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two),
                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

template <bool INVERSE>
inline __m256 rotate(__m256 v, __m256 c, __m256 s) {
  // forward: (re c - im s, re s + im c); inverse: (re c + im s, -re s + im c)
  const __m256 sign = INVERSE ? _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1)
                              : _mm256_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1);
  return _mm256_fmadd_ps(v, c, _mm256_mul_ps(_mm256_permute_ps(v, 0xB1), _mm256_mul_ps(s, sign)));
}

template <bool UPPER>
inline __m256 mix(__m256 z, __m256 a0, __m256 a1) {
  // UPPER: (a0 z0 + a1 z1, a0 z1); lower: (a0 z0, a0 z1 + a1 z0), z_r = (re, im) of slot r
  const __m256 other = _mm256_permute_ps(z, UPPER ? 0xEE : 0x44);
  const __m256 mask = UPPER ? _mm256_setr_ps(1, 1, 0, 0, 1, 1, 0, 0)
                            : _mm256_setr_ps(0, 0, 1, 1, 0, 0, 1, 1);
  return _mm256_fmadd_ps(_mm256_mul_ps(a1, mask), other, _mm256_mul_ps(a0, z));
}

// y = mix(rotate(x)) over blocks [0, nb & ~1); returns the first block left to the caller.
template <bool INVERSE, bool UPPER>
inline int apply(const float* x, float* y, const float* cs, const float* sn, const float* c0,
                 const float* c1, int nb) {
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m256 z = rotate<INVERSE>(_mm256_loadu_ps(x + 4 * b), lanes_of(cs, b), lanes_of(sn, b));
    _mm256_storeu_ps(y + 4 * b, mix<UPPER>(z, lanes_of(c0, b), lanes_of(c1, b)));
  }
  return b;
}

// Parameter-gradient reductions of the backward pass for the same blocks: with w = R^T g,
// dser0 = <w0, x0> + <w1, x1>, dser1 = <w0, x1> (key) or <w1, x0> (query),
// dl = c0 dser0 + c1 dser1, de = c0 dser1. Also writes the input gradient when o is given.
template <bool KEY>
inline int backward(const float* x, const float* g, float* o, const float* cs, const float* sn,
                    const float* c0, const float* c1, int nb, float* dl, float* de,
                    float* dser0, float* dser1) {
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m256 w = rotate<true>(_mm256_loadu_ps(g + 4 * b), lanes_of(cs, b), lanes_of(sn, b));
    const __m256 a0 = lanes_of(c0, b), a1 = lanes_of(c1, b);
    if (o) _mm256_storeu_ps(o + 4 * b, mix<!KEY>(w, a0, a1));
    if (!x) continue;
    const __m256 xv = _mm256_loadu_ps(x + 4 * b);
    const __m256 p0 = _mm256_mul_ps(w, xv);  // w0r x0r, w0i x0i, w1r x1r, w1i x1i
    const __m256 p1 = _mm256_mul_ps(
        _mm256_mul_ps(w, _mm256_permute_ps(xv, KEY ? 0xEE : 0x44)),
        KEY ? _mm256_setr_ps(1, 1, 0, 0, 1, 1, 0, 0) : _mm256_setr_ps(0, 0, 1, 1, 0, 0, 1, 1));
    // two horizontal adds leave (dser0, dser1) in elements 0, 1 of each lane
    const __m256 h = _mm256_hadd_ps(p0, p1);
    const __m256 h2 = _mm256_hadd_ps(h, h);
    const __m128 lo = _mm256_castps256_ps128(h2), hi = _mm256_extractf128_ps(h2, 1);
    dser0[b] = _mm_cvtss_f32(lo);
    dser1[b] = _mm_cvtss_f32(_mm_movehdup_ps(lo));
    dser0[b + 1] = _mm_cvtss_f32(hi);
    dser1[b + 1] = _mm_cvtss_f32(_mm_movehdup_ps(hi));
  }
  if (x)
    for (int i = 0; i < b; ++i) {
      dl[i] = c0[i] * dser0[i] + c1[i] * dser1[i];
      de[i] = c0[i] * dser1[i];
    }
  return b;
}

// Backward with the parameter-gradient reduction kept in vector form: per element of each
// block's lane, G += sp (c0 w.x + c1 w.x_shift) and E += su c0 w.x_shift, summed over the tile's
// tokens; the lane sums (done once per tile by the caller) are dL/dgamma and dL/deta.
// nb must be even.
template <bool KEY>
inline void backward_reduce(const float* x, const float* g, float* o, const float* cs,
                            const float* sn, const float* c0, const float* c1, int nb, float sp,
                            float su, float* G, float* E) {
  const __m256 vsp = _mm256_set1_ps(sp), vsu = _mm256_set1_ps(su);
  const __m256 shift_mask = KEY ? _mm256_setr_ps(1, 1, 0, 0, 1, 1, 0, 0)
                                : _mm256_setr_ps(0, 0, 1, 1, 0, 0, 1, 1);
  for (int b = 0; b + 2 <= nb; b += 2) {
    const __m256 w = rotate<true>(_mm256_loadu_ps(g + 4 * b), lanes_of(cs, b), lanes_of(sn, b));
    const __m256 a0 = lanes_of(c0, b), a1 = lanes_of(c1, b);
    if (o) _mm256_storeu_ps(o + 4 * b, mix<!KEY>(w, a0, a1));
    const __m256 xv = _mm256_loadu_ps(x + 4 * b);
    const __m256 p0 = _mm256_mul_ps(w, xv);
    const __m256 p1 = _mm256_mul_ps(_mm256_mul_ps(w, _mm256_permute_ps(xv, KEY ? 0xEE : 0x44)), shift_mask);
    const __m256 dl = _mm256_fmadd_ps(a1, p1, _mm256_mul_ps(a0, p0));
    _mm256_storeu_ps(G + 4 * b, _mm256_fmadd_ps(vsp, dl, _mm256_loadu_ps(G + 4 * b)));
    _mm256_storeu_ps(E + 4 * b, _mm256_fmadd_ps(vsu, _mm256_mul_ps(a0, p1), _mm256_loadu_ps(E + 4 * b)));
  }
}

}  // namespace avx2_m2
#endif

// Tokens of one (batch, head) processed together: the per-token, per-block scalars (damping,
// coefficient series) are computed for a whole tile in loops of kTile * blocks elements, which
// vectorise well and amortise loop overheads that dominated when done token by token.
constexpr int kTile = 16;
constexpr int kTileRun = 8;  // tiles between exact re-anchorings of the damping recurrence

// Per-thread scratch, structure-of-arrays: series[k][tt][b], per-token scalars [tt][b].
template <class T>
struct Scratch {
  int nb;
  std::vector<T> ek, eq, x, ck, cq, dl, de, dser, part, red_g, red_e;
  bool tile_clamped = false;  // did the exponent clamp bind anywhere in this tile's segment
  std::vector<double> ekd, eqd, pos, u;
  std::vector<unsigned char> clamped;
  // Damping carried from tile to tile of one (batch, head): e^{+-gamma p} of the last token and
  // the step ratios e^{+-gamma d}, per global block; re-anchored exactly every kTileRun tiles.
  std::vector<double> ek_last, eq_last, rk, rq, rk_d;
  std::vector<int64_t> rk_bh;  // (bh, d) the ratios of each block were computed for
  int64_t last_tile = -2, last_bh = -1, bh = -1;
  double last_p = 0, d = 0, last_d = std::numeric_limits<double>::quiet_NaN();
  int run = 0;
  bool even = false, contiguous = false, force_fresh = true;
  explicit Scratch(int blocks)
      : nb(std::max(1, blocks)),
        ek(kTile * nb), eq(kTile * nb), x(kTile * nb), ck(kMaxOrder * kTile * nb),
        cq(kMaxOrder * kTile * nb), dl(kTile * nb), de(kTile * nb), dser(kMaxOrder * kTile * nb), part(nb), red_g(2 * kMaxOrder * nb), red_e(2 * kMaxOrder * nb),
        ekd(kTile * nb), eqd(kTile * nb), pos(kTile), u(kTile), clamped(kTile * nb),
        ek_last(nb), eq_last(nb), rk(nb), rq(nb), rk_d(nb), rk_bh(nb, -1) {}

  // Called once per tile after pos[0..n) is filled: may the damping continue the last tile's?
  void begin_tile(int64_t tile, int64_t tile_bh, int n) {
    bh = tile_bh;
    even = n > 1;
    d = n > 1 ? pos[1] - pos[0] : 0.0;
    for (int tt = 2; tt < n && even; ++tt) even = pos[tt] - pos[tt - 1] == d;
    contiguous = even && bh == last_bh && d == last_d && tile == last_tile + 1 && pos[0] - last_p == d && run < kTileRun &&
                 !force_fresh;
    run = contiguous ? run + 1 : 0;
    force_fresh = false;
    last_tile = tile;
    last_bh = bh;
    last_p = pos[n - 1];
    last_d = even ? d : std::numeric_limits<double>::quiet_NaN();
  }
};

// Scaled coefficient series of every (token, block) of the tile for one segment:
//   ck[k][tt][b] = e^{+gamma p} c_k (keys),  cq[k][tt][b] = e^{-gamma p} ic_k (queries),
// c_k = x^k/k!, ic_k = (-x)^k/k!, x = eta s sigma(-p) (exponential shear), or the jet-gate series
// and its power-series inverse. Damping: exact exp at the tile's first token, then float64
// recurrences e^{gamma (p + d)} = e^{gamma p} e^{gamma d} when positions step evenly; exact
// (clamped) values wherever the exponent clamp binds.
template <class T, int M>
void tile_series(const SegmentDesc& s, const Params<T>& P, int64_t h, int64_t H, int NB, int n,
                 Scratch<T>& sc) {
  const int nb = s.blocks, stride = n * nb;
  const int64_t off = h * NB + s.first_block;
  for (int tt = 0; tt < n; ++tt) sc.u[tt] = s.shear_scale * chart_value(s.chart, -sc.pos[tt], s.L);
  T* ek = sc.ek.data();
  T* eq = sc.eq.data();
  sc.tile_clamped = false;
  if (s.damped) {
    const double X = s.max_exponent;
    const T* g = P.gamma + off;
    double* ekd = sc.ekd.data();
    double* eqd = sc.eqd.data();
    // clamp flags per entry, skipped when a bound shows none can bind in this tile
    double gmax = 0, pmax = 0;
    for (int b = 0; b < nb; ++b) gmax = std::max(gmax, std::abs(static_cast<double>(g[b])));
    for (int tt = 0; tt < n; ++tt) pmax = std::max(pmax, std::abs(sc.pos[tt]));
    bool any_clamped = false;
    if (gmax * pmax * (1 + 1e-12) <= X) {
      std::fill(sc.clamped.begin(), sc.clamped.begin() + stride, static_cast<unsigned char>(0));
    } else {
      for (int tt = 0; tt < n; ++tt)
        for (int b = 0; b < nb; ++b) {
          const bool cl = std::abs(static_cast<double>(g[b]) * sc.pos[tt]) > X;
          sc.clamped[tt * nb + b] = cl;
          any_clamped |= cl;
        }
    }
    if (sc.even && !any_clamped) {
      double* rk = sc.rk.data() + s.first_block;
      double* rq = sc.rq.data() + s.first_block;
      double* ekl = sc.ek_last.data() + s.first_block;
      double* eql = sc.eq_last.data() + s.first_block;
      if (sc.rk_bh[s.first_block] != sc.bh || sc.rk_d[s.first_block] != sc.d) {
        for (int b = 0; b < nb; ++b) {
          rk[b] = std::exp(static_cast<double>(g[b]) * sc.d);
          rq[b] = 1.0 / rk[b];
        }
        sc.rk_bh[s.first_block] = sc.bh;
        sc.rk_d[s.first_block] = sc.d;
      }
      if (sc.contiguous) {
        for (int b = 0; b < nb; ++b) {
          ekd[b] = ekl[b] * rk[b];
          eqd[b] = eql[b] * rq[b];
        }
      } else {
        for (int b = 0; b < nb; ++b) {
          const double gb = static_cast<double>(g[b]);
          ekd[b] = std::exp(gb * sc.pos[0]);
          eqd[b] = std::exp(-gb * sc.pos[0]);
        }
      }
      for (int tt = 1; tt < n; ++tt)
        for (int b = 0; b < nb; ++b) {
          ekd[tt * nb + b] = ekd[(tt - 1) * nb + b] * rk[b];
          eqd[tt * nb + b] = eqd[(tt - 1) * nb + b] * rq[b];
        }
      std::copy(ekd + (n - 1) * nb, ekd + n * nb, ekl);
      std::copy(eqd + (n - 1) * nb, eqd + n * nb, eql);
    } else {  // irregular positions or a binding clamp: exact (clamped) values everywhere
      sc.force_fresh = true;
      sc.tile_clamped = any_clamped;
      for (int tt = 0; tt < n; ++tt)
        for (int b = 0; b < nb; ++b) {
          const double a = static_cast<double>(g[b]) * sc.pos[tt];
          ekd[tt * nb + b] = std::exp(std::min(std::max(a, -X), X));
          eqd[tt * nb + b] = std::exp(std::min(std::max(-a, -X), X));
        }
    }
    for (int i = 0; i < stride; ++i) {
      ek[i] = static_cast<T>(ekd[i]);
      eq[i] = static_cast<T>(eqd[i]);
    }
  } else {
    std::fill(ek, ek + stride, T(1));
    std::fill(eq, eq + stride, T(1));
  }
  T* ck = sc.ck.data();
  T* cq = sc.cq.data();
  std::copy(ek, ek + stride, ck);
  std::copy(eq, eq + stride, cq);
  if (M == 1) return;
  if (s.shear == ShearMode::Gates) {
    for (int tt = 0; tt < n; ++tt)
      for (int b = 0; b < nb; ++b) {
        double gates[kMaxOrder], c[kMaxOrder], ic[kMaxOrder];
        for (int k = 1; k < M; ++k)
          gates[k - 1] = static_cast<double>(P.gates[(k - 1) * H * NB + off + b]);
        shear_coefficients(ShearMode::Gates, M, 0.0, gates, 1,
                           static_cast<double>(P.alpha0[off + b]), sc.u[tt], c);
        inverse_series(M, c, ic);
        const int i = tt * nb + b;
        for (int k = 0; k < M; ++k) {
          ck[k * stride + i] = static_cast<T>(c[k]) * ek[i];
          cq[k * stride + i] = static_cast<T>(ic[k]) * eq[i];
        }
      }
    return;
  }
  T* x = sc.x.data();
  if (s.shear == ShearMode::Exponential) {
    const T* e = P.eta + off;
    for (int tt = 0; tt < n; ++tt) {
      const T ut = static_cast<T>(sc.u[tt]);
      for (int b = 0; b < nb; ++b) x[tt * nb + b] = e[b] * ut;
    }
  } else {
    std::fill(x, x + stride, T(0));
  }
  for (int k = 1; k < M; ++k) {
    const T inv = T(1) / static_cast<T>(k);
    T* cur = ck + k * stride;
    const T* prev = ck + (k - 1) * stride;
    T* curq = cq + k * stride;
    const T* prevq = cq + (k - 1) * stride;
    for (int i = 0; i < stride; ++i) {
      cur[i] = prev[i] * x[i] * inv;
      curq[i] = -prevq[i] * x[i] * inv;
    }
  }
}

// Forward of one segment on one token row for q and k, with the tile's series at token tt.
// key:   y_r = e_k sum_{c>=r} c_{c-r}  R z_c      query: y_r = e_q sum_{c<=r} ic_{r-c} R z_c
template <class T, int M, Layout LY>
void forward_segment(const SegmentDesc& s, int D, const T* cosr, const T* sinr,
                     const T* ck, const T* cq, int stride, const T* q, const T* k, T* qo, T* ko) {
  using A = Addr<LY>;
  const T* cs = cosr + s.first_block;
  const T* sn = sinr + s.first_block;
  const int nb = s.blocks;
  for (int io = 0; io < 2; ++io) {
    const bool key = io == 1;
    const T* x = key ? k : q;
    T* y = key ? ko : qo;
    if (!x) continue;
    if (M == 1 && !ck) {  // plain rotation: the RoPE hot loop (in place is fine: no overlap)
#pragma GCC ivdep
      for (int b = 0; b < nb; ++b) {
        const int j = s.first_pair + b;
        const T xr = x[A::re(j, D)], xi = x[A::im(j, D)];
        y[A::re(j, D)] = xr * cs[b] - xi * sn[b];
        y[A::im(j, D)] = xr * sn[b] + xi * cs[b];
      }
      continue;
    }
    const T* coef = key ? ck : cq;
    int b0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<T, float> && M == 2 && LY == Layout::Interleaved) {
      const float* xs = x + 2 * s.first_pair;
      float* ys = y + 2 * s.first_pair;
      b0 = key ? avx2_m2::apply<false, true>(xs, ys, cs, sn, coef, coef + stride, nb)
               : avx2_m2::apply<false, false>(xs, ys, cs, sn, coef, coef + stride, nb);
    }
#endif
    // one fused pass per block: load the m slots, rotate, mix with the token's series, store.
    // The slot loops are unrolled by hand (pragma) so that the block loop vectorises.
    const auto block_loop = [&]<bool KEY>() {
#pragma GCC ivdep
      for (int b = b0; b < nb; ++b) {
        const int j0 = s.first_pair + b * M;
        T zr[M], zi[M];
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const T xr = x[A::re(j0 + r, D)], xi = x[A::im(j0 + r, D)];
          zr[r] = xr * cs[b] - xi * sn[b];
          zi[r] = xr * sn[b] + xi * cs[b];
        }
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          T ar = 0, ai = 0;
#pragma GCC unroll 8
          for (int c = 0; c < M; ++c) {
            if (KEY ? c < r : c > r) continue;
            const T w = coef[(KEY ? c - r : r - c) * stride + b];
            ar += w * zr[c];
            ai += w * zi[c];
          }
          y[A::re(j0 + r, D)] = ar;
          y[A::im(j0 + r, D)] = ai;
        }
      }
    };
    if (key) {
      block_loop.template operator()<true>();
    } else {
      block_loop.template operator()<false>();
    }
  }
}

// Index of the parameter-gradient accumulators: [gamma | eta | alpha0 | gates rows] x (H*NB).
struct GradSlots {
  size_t hb;
  size_t gamma(size_t i) const { return i; }
  size_t eta(size_t i) const { return hb + i; }
  size_t alpha0(size_t i) const { return 2 * hb + i; }
  size_t gate(int k, size_t i) const { return (3 + k - 1) * hb + i; }
};

// Backward of one segment on one token row: input gradients by the transposed maps and, when
// xin is given, dser'_k = sum_r <w_r, x_{r+k}> (key) or <w_r, x_{r-k}> (query) with w = R^T gy,
// reduced with the scaled series coef = e * series into dl = sum_k coef_k dser'_k
// (dL/dexponent) and de = sum_{k>=1} coef_{k-1} dser'_k (dL/deta up to +-u).
template <class T, int M, Layout LY>
void backward_segment(const SegmentDesc& s, int D, const T* cosr, const T* sinr, const T* coef,
                      int stride, bool key, const T* x, const T* g, T* o, T* dl, T* de, T* dser) {
  using A = Addr<LY>;
  const T* cs = cosr + s.first_block;
  const T* sn = sinr + s.first_block;
  const int nb = s.blocks;
  if (M == 1 && !coef) {  // transpose of a rotation
    if (!o) return;
#pragma GCC ivdep
    for (int b = 0; b < nb; ++b) {
      const int j = s.first_pair + b;
      const T gr = g[A::re(j, D)], gi = g[A::im(j, D)];
      o[A::re(j, D)] = gr * cs[b] + gi * sn[b];
      o[A::im(j, D)] = -gr * sn[b] + gi * cs[b];
    }
    return;
  }
  int b0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float> && M == 2 && LY == Layout::Interleaved) {
    const int off = 2 * s.first_pair;
    b0 = key ? avx2_m2::backward<true>(x ? x + off : nullptr, g + off, o ? o + off : nullptr, cs,
                                       sn, coef, coef + stride, nb, dl, de, dser, dser + stride)
             : avx2_m2::backward<false>(x ? x + off : nullptr, g + off, o ? o + off : nullptr, cs,
                                        sn, coef, coef + stride, nb, dl, de, dser, dser + stride);
  }
#endif
#pragma GCC ivdep
  for (int b = b0; b < nb; ++b) {
    const int j0 = s.first_pair + b * M;
    T wr[M], wi[M];
    for (int r = 0; r < M; ++r) {
      const T gr = g[A::re(j0 + r, D)], gi = g[A::im(j0 + r, D)];
      wr[r] = gr * cs[b] + gi * sn[b];
      wi[r] = -gr * sn[b] + gi * cs[b];
    }
    if (o) {
      for (int c = 0; c < M; ++c) {
        T ar = 0, ai = 0;
        if (key) {
          for (int r = 0; r <= c; ++r)
            ar += coef[(c - r) * stride + b] * wr[r], ai += coef[(c - r) * stride + b] * wi[r];
        } else {
          for (int r = c; r < M; ++r)
            ar += coef[(r - c) * stride + b] * wr[r], ai += coef[(r - c) * stride + b] * wi[r];
        }
        o[A::re(j0 + c, D)] = ar;
        o[A::im(j0 + c, D)] = ai;
      }
    }
    if (x) {
      T xr[M], xi[M];
      for (int c = 0; c < M; ++c) xr[c] = x[A::re(j0 + c, D)], xi[c] = x[A::im(j0 + c, D)];
      T dlb = 0, deb = 0;
      for (int kk = 0; kk < M; ++kk) {
        T d = 0;
        for (int r = 0; r < M; ++r) {
          const int c = key ? r + kk : r - kk;
          if (c >= 0 && c < M) d += wr[r] * xr[c] + wi[r] * xi[c];
        }
        dser[kk * stride + b] = d;
        dlb += coef[kk * stride + b] * d;
        if (kk >= 1) deb += coef[(kk - 1) * stride + b] * d;
      }
      dl[b] = dlb;
      de[b] = deb;
    }
  }
}

// Parameter gradients of one segment from a tile's dl/de/dser, accumulated in float64.
template <class T, int M>
void accumulate_param_grads(const SegmentDesc& s, int64_t h, int NB, int n,
                            bool key, Scratch<T>& sc, double* acc, const GradSlots& slot) {
  const int nb = s.blocks, stride = n * nb;
  const size_t off = static_cast<size_t>(h) * NB + s.first_block;
  // partial sums over the tile's tokens in T (at most kTile terms), then into float64
  if (s.damped) {  // d exponent / d gamma = +-p; no gradient through a binding clamp
    T* tmp = sc.part.data();
    for (int tt = 0; tt < n; ++tt) {
      const T sp = static_cast<T>(key ? sc.pos[tt] : -sc.pos[tt]);
      const T* dlt = sc.dl.data() + tt * nb;
      const unsigned char* cl = sc.clamped.data() + tt * nb;
      if (tt == 0) {
        for (int b = 0; b < nb; ++b) tmp[b] = cl[b] ? T(0) : sp * dlt[b];
      } else {
        for (int b = 0; b < nb; ++b) tmp[b] += cl[b] ? T(0) : sp * dlt[b];
      }
    }
    double* ag = acc + slot.gamma(off);
    for (int b = 0; b < nb; ++b) ag[b] += static_cast<double>(tmp[b]);
  }
  if (M == 1) return;
  if (s.shear == ShearMode::Exponential) {
    T* tmp = sc.part.data();
    for (int tt = 0; tt < n; ++tt) {
      const T su = static_cast<T>(key ? sc.u[tt] : -sc.u[tt]);
      const T* det = sc.de.data() + tt * nb;
      if (tt == 0) {
        for (int b = 0; b < nb; ++b) tmp[b] = su * det[b];
      } else {
        for (int b = 0; b < nb; ++b) tmp[b] += su * det[b];
      }
    }
    double* ae = acc + slot.eta(off);
    for (int b = 0; b < nb; ++b) ae[b] += static_cast<double>(tmp[b]);
  } else if (s.shear == ShearMode::Gates) {
    // dL/dc via the unscaled series (d ic = -P^2 d c for queries); c_0 = alpha_0, c_k = g_k u^k/k!
    const T* coef = key ? sc.ck.data() : sc.cq.data();
    for (int tt = 0; tt < n; ++tt)
      for (int b = 0; b < nb; ++b) {
        const int i = tt * nb + b;
        const double e = static_cast<double>(key ? sc.ek[i] : sc.eq[i]);
        double dser2[kMaxOrder], ser[kMaxOrder], dc[kMaxOrder];
        for (int kk = 0; kk < M; ++kk) {
          dser2[kk] = static_cast<double>(sc.dser[kk * stride + i]) * e;
          ser[kk] = static_cast<double>(coef[kk * stride + i]) / e;
        }
        if (key) {
          for (int kk = 0; kk < M; ++kk) dc[kk] = dser2[kk];
        } else {
          double p2[kMaxOrder];
          for (int kk = 0; kk < M; ++kk) {
            p2[kk] = 0;
            for (int j = 0; j <= kk; ++j) p2[kk] += ser[j] * ser[kk - j];
          }
          for (int j = 0; j < M; ++j) {
            dc[j] = 0;
            for (int kk = j; kk < M; ++kk) dc[j] -= dser2[kk] * p2[kk - j];
          }
        }
        acc[slot.alpha0(off + b)] += dc[0];
        double pw = 1;
        for (int kk = 1; kk < M; ++kk) {
          pw *= sc.u[tt] / kk;
          acc[slot.gate(kk, off + b)] += dc[kk] * pw;
        }
      }
  }
}

// Calls f.template operator()<M>() with the segment's order as a compile-time constant.
template <class F>
void dispatch_order(int order, F&& f) {
  switch (order) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    case 8: f.template operator()<8>(); break;
    default: throw InputError("kernel supports Jordan orders 1..8, got " + std::to_string(order));
  }
}

// Identity on the complex coordinates no segment covers.
template <class T, Layout LY>
void copy_uncovered(int first, int D, const T* x, T* y) {
  if (!x || !y || x == y) return;
  for (int j = first; j < D / 2; ++j) {
    y[Addr<LY>::re(j, D)] = x[Addr<LY>::re(j, D)];
    y[Addr<LY>::im(j, D)] = x[Addr<LY>::im(j, D)];
  }
}

// Work items: tiles of up to kTile consecutive tokens of one (batch, head).
struct Tiling {
  int64_t per_bh, count;
  explicit Tiling(Dims d) : per_bh((d.T + kTile - 1) / kTile), count(d.B * d.H * per_bh) {}
};

struct TileInfo {
  int64_t bh, t0, h, b;
  int n;
};
// Where tile `tile` lies; loads its positions into the scratch and starts its damping state.
template <class T>
TileInfo start_tile(int64_t tile, const Tiling& tiling, Dims dims, const Positions& pos,
                    Scratch<T>& sc) {
  TileInfo ti;
  ti.bh = tile / tiling.per_bh;
  ti.t0 = (tile % tiling.per_bh) * kTile;
  ti.h = ti.bh % dims.H;
  ti.b = ti.bh / dims.H;
  ti.n = static_cast<int>(std::min<int64_t>(kTile, dims.T - ti.t0));
  for (int tt = 0; tt < ti.n; ++tt) sc.pos[tt] = pos.at(ti.b, ti.t0 + tt, dims.T);
  sc.begin_tile(tile, ti.bh, ti.n);
  return ti;
}

bool plain_rotation(const SegmentDesc& s) { return s.order == 1 && !s.damped; }

template <class T, Layout LY>
void forward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                  TrigView<T> trig, const T* q, const T* k, T* qo, T* ko) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks;
  const int covered = covered_pairs(plan);
  const Tiling tiling(dims);
#pragma omp parallel
  {
    Scratch<T> sc(plan.total_blocks);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiling.count; ++tile) {
      const auto [bh, t0, h, b, n] = start_tile(tile, tiling, dims, pos, sc);
      for (const auto& s : plan.segments)
        dispatch_order(s.order, [&]<int M>() {
          const bool plain = plain_rotation(s);
          if (!plain) tile_series<T, M>(s, P, h, dims.H, static_cast<int>(NB), n, sc);
          for (int tt = 0; tt < n; ++tt) {
            const int64_t row = bh * dims.T + t0 + tt;
            const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t0 + tt) * NB;
            forward_segment<T, M, LY>(s, static_cast<int>(D), trig.cos + trow, trig.sin + trow,
                                      plain ? nullptr : sc.ck.data() + tt * s.blocks,
                                      plain ? nullptr : sc.cq.data() + tt * s.blocks, n * s.blocks,
                                      q ? q + row * D : nullptr, k ? k + row * D : nullptr,
                                      q ? qo + row * D : nullptr, k ? ko + row * D : nullptr);
          }
        });
      for (int tt = 0; tt < n; ++tt) {
        const int64_t row = bh * dims.T + t0 + tt;
        if (q) copy_uncovered<T, LY>(covered, static_cast<int>(D), q + row * D, qo + row * D);
        if (k) copy_uncovered<T, LY>(covered, static_cast<int>(D), k + row * D, ko + row * D);
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Backward of one order-2 interleaved float segment over a tile, parameter gradients reduced in
// vector form (avx2_m2::backward_reduce) and folded into the float64 accumulators once per tile.
template <class T>
void reduce_tile_m2(const SegmentDesc& s, Dims dims, const Positions& pos, TrigView<T> trig,
                    int64_t b, int64_t bh, int64_t t0, int64_t h, int n, bool key, const T* x,
                    const T* g, T* o, Scratch<T>& sc, double* acc, const GradSlots& slot, int D,
                    int NB) {
  const int nb = s.blocks, stride = n * nb, off2 = 2 * s.first_pair;
  float* G = sc.red_g.data();
  float* E = sc.red_e.data();
  std::fill(G, G + 4 * nb, 0.0f);
  std::fill(E, E + 4 * nb, 0.0f);
  const float* coef = key ? sc.ck.data() : sc.cq.data();
  for (int tt = 0; tt < n; ++tt) {
    const int64_t row = bh * dims.T + t0 + tt;
    const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t0 + tt) * NB + s.first_block;
    const float sp = s.damped ? static_cast<float>(key ? sc.pos[tt] : -sc.pos[tt]) : 0.0f;
    const float su = static_cast<float>(key ? sc.u[tt] : -sc.u[tt]);
    const auto run = key ? avx2_m2::backward_reduce<true> : avx2_m2::backward_reduce<false>;
    run(x + row * D + off2, g + row * D + off2, o ? o + row * D + off2 : nullptr, trig.cos + trow,
        trig.sin + trow, coef + tt * nb, coef + stride + tt * nb, nb, sp, su, G, E);
  }
  const size_t off = static_cast<size_t>(h) * NB + s.first_block;
  for (int blk = 0; blk < nb; ++blk) {
    const float* gb = G + 4 * blk;
    const float* eb = E + 4 * blk;
    if (s.damped) acc[slot.gamma(off + blk)] += static_cast<double>(gb[0] + gb[1] + gb[2] + gb[3]);
    if (s.shear == ShearMode::Exponential)
      acc[slot.eta(off + blk)] += static_cast<double>(eb[0] + eb[1] + eb[2] + eb[3]);
  }
}
#endif

template <class T, Layout LY>
void backward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                   TrigView<T> trig, const T* q, const T* k, const T* gqo, const T* gko, T* gq,
                   T* gk, const ParamGrads<T>& G) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks;
  const int covered = covered_pairs(plan);
  const Tiling tiling(dims);
  const GradSlots slot{static_cast<size_t>(dims.H * NB)};
  const size_t nacc = G.any() ? (3 + plan.gate_rows) * slot.hb : 0;
  std::vector<std::vector<double>> acc(static_cast<size_t>(omp_get_max_threads()));
  const T* xin[2] = {q, k};
  const T* gy[2] = {gqo, gko};
  T* gx[2] = {gqo ? gq : nullptr, gko ? gk : nullptr};
#pragma omp parallel
  {
    Scratch<T> sc(plan.total_blocks);
    auto& mine = acc[static_cast<size_t>(omp_get_thread_num())];
    mine.assign(nacc, 0.0);
    double* a = nacc ? mine.data() : nullptr;
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiling.count; ++tile) {
      const auto [bh, t0, h, b, n] = start_tile(tile, tiling, dims, pos, sc);
      for (const auto& s : plan.segments)
        dispatch_order(s.order, [&]<int M>() {
          const bool plain = plain_rotation(s);
          if (!plain) tile_series<T, M>(s, P, h, dims.H, static_cast<int>(NB), n, sc);
          const int stride = n * s.blocks;
          for (int io = 0; io < 2; ++io) {
            if (!gy[io]) continue;
            const bool key = io == 1;
            const bool params = a && xin[io] && !plain;
#if defined(__AVX2__) && defined(__FMA__)
            if constexpr (std::is_same_v<T, float> && M == 2 && LY == Layout::Interleaved) {
              if (params && s.shear != ShearMode::Gates && s.blocks % 2 == 0 && !sc.tile_clamped) {
                reduce_tile_m2(s, dims, pos, trig, b, bh, t0, h, n, key, xin[io], gy[io], gx[io],
                               sc, a, slot, static_cast<int>(D), static_cast<int>(NB));
                continue;
              }
            }
#endif
            for (int tt = 0; tt < n; ++tt) {
              const int64_t row = bh * dims.T + t0 + tt;
              const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t0 + tt) * NB;
              const int off = tt * s.blocks;
              backward_segment<T, M, LY>(
                  s, static_cast<int>(D), trig.cos + trow, trig.sin + trow,
                  plain ? nullptr : (key ? sc.ck.data() : sc.cq.data()) + off, stride, key,
                  params ? xin[io] + row * D : nullptr, gy[io] + row * D,
                  gx[io] ? gx[io] + row * D : nullptr, sc.dl.data() + off, sc.de.data() + off,
                  sc.dser.data() + off);
            }
            if (params)
              accumulate_param_grads<T, M>(s, h, static_cast<int>(NB), n, key, sc, a, slot);
          }
        });
      for (int io = 0; io < 2; ++io)
        if (gy[io] && gx[io])
          for (int tt = 0; tt < n; ++tt) {
            const int64_t row = bh * dims.T + t0 + tt;
            copy_uncovered<T, LY>(covered, static_cast<int>(D), gy[io] + row * D, gx[io] + row * D);
          }
    }
  }
  if (!nacc) return;
  for (size_t i = 0; i < slot.hb; ++i) {
    double g = 0, e = 0, a0 = 0;
    for (const auto& v : acc)
      if (!v.empty()) g += v[slot.gamma(i)], e += v[slot.eta(i)], a0 += v[slot.alpha0(i)];
    if (G.gamma) G.gamma[i] += static_cast<T>(g);
    if (G.eta) G.eta[i] += static_cast<T>(e);
    if (G.alpha0) G.alpha0[i] += static_cast<T>(a0);
    for (int kk = 1; kk <= plan.gate_rows && G.gates; ++kk) {
      double sum = 0;
      for (const auto& v : acc)
        if (!v.empty()) sum += v[slot.gate(kk, i)];
      G.gates[(kk - 1) * slot.hb + i] += static_cast<T>(sum);
    }
  }
}

// True when every row of positions is p0 + t * step exactly (then the trig table can be filled by
// rotation recurrences instead of one sin/cos per entry).
bool arithmetic(const Positions& pos, int64_t rows, int64_t T, double* step) {
  *step = T > 1 ? pos.data[1] - pos.data[0] : 1.0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* p = pos.data + r * T;
    if (T > 1 && p[1] - p[0] != *step) return false;
    for (int64_t t = 0; t < T; ++t)
      if (p[t] != p[0] + static_cast<double>(t) * *step) return false;
  }
  return true;
}

}  // namespace RELPOS_ISA_NAMESPACE
}  // namespace relpos::kernels
