// Generic path of the transform kernels (any Jordan order, both layouts, float and double): one
// per-segment map template for the four roles A, A^{-T}, A^T, A^{-1} of one token row with a
// tile's coefficient series (forward, backward input gradients, transform_apply), the fused
// backward with the parameter gradients, and the parameter-gradient reductions. Used wherever no
// fast path (transform_fast.hpp) applies. Part of the per-ISA build (transform_isa.inc): internal
// header.
#pragma once

#ifndef RELPOS_ISA_NAMESPACE
#error "internal kernel header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set)"
#endif

#include "kernels/transform_tiles.hpp"

namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

// The four roles of a block map (MapRole, transform.hpp) as compile-time properties. A block of
// order m acts as N (x) R: R the rotation by the trig table's angle on every complex slot, N the
// m x m Toeplitz mixing of the slots - upper triangular in the key series ck for A, lower in the
// query series cq for A^{-T} (Jordan-RoPE Prop. 1). N and R commute, so
//   Primal          A      = N_k R        y_r = sum_{c>=r} ck_{c-r} (R x)_c
//   Contragredient  A^{-T} = N_q R        y_r = sum_{c<=r} cq_{r-c} (R x)_c
//   PrimalTranspose A^T    = N_k^T R^T    y_r = sum_{c<=r} ck_{r-c} (R^T x)_c
//   Inverse         A^{-1} = N_q^T R^T    y_r = sum_{c>=r} cq_{c-r} (R^T x)_c
// (as ggml's rope serves both directions with a sign: the transposes only flip sin and the
// triangle).
template <MapRole ROLE>
struct RoleTraits {
  static constexpr bool transposed = ROLE == MapRole::PrimalTranspose || ROLE == MapRole::Inverse;
  static constexpr bool key_series = ROLE == MapRole::Primal || ROLE == MapRole::PrimalTranspose;
  static constexpr bool upper = ROLE == MapRole::Primal || ROLE == MapRole::Inverse;
};

// z = R x (or R^T x when TRANSPOSED) of block b's M slots starting at pair j0.
template <class T, int M, Layout LY, bool TRANSPOSED>
[[gnu::always_inline]] inline void rotate_block(const T* x, int D, int j0, T c, T s, T* zr, T* zi) {
  using A = Addr<LY>;
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) {
    const T xr = x[A::re(j0 + r, D)], xi = x[A::im(j0 + r, D)];
    if constexpr (TRANSPOSED) {
      zr[r] = xr * c + xi * s;
      zi[r] = -xr * s + xi * c;
    } else {
      zr[r] = xr * c - xi * s;
      zi[r] = xr * s + xi * c;
    }
  }
}

// y_r = sum_{c>=r} coef_{c-r} z_c (UPPER) or sum_{c<=r} coef_{r-c} z_c, coef_k at
// coef[k * stride + b], stored to block b's M slots starting at pair j0.
template <class T, int M, Layout LY, bool UPPER>
[[gnu::always_inline]] inline void mix_block(const T* coef, int stride, int b, const T* zr,
                                             const T* zi, int D, int j0, T* y) {
  using A = Addr<LY>;
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) {
    T ar = 0, ai = 0;
#pragma GCC unroll 8
    for (int c = 0; c < M; ++c) {
      if (UPPER ? c < r : c > r) continue;
      const T w = coef[(UPPER ? c - r : r - c) * stride + b];
      ar += w * zr[c];
      ai += w * zi[c];
    }
    y[A::re(j0 + r, D)] = ar;
    y[A::im(j0 + r, D)] = ai;
  }
}

// The map of one role on one segment of one token row, with the tile's series at that token
// (coef: ck for the key-series roles, cq for the others; null for a plain rotation). In place is
// fine: each block loads its slots before it stores them.
template <class T, int M, Layout LY, MapRole ROLE>
void map_segment(const SegmentDesc& s, int D, const T* cosr, const T* sinr, const T* coef,
                 int stride, const T* x, T* y) {
  using A = Addr<LY>;
  using RT = RoleTraits<ROLE>;
  const T* cs = cosr + s.first_block;
  const T* sn = sinr + s.first_block;
  const int nb = s.blocks;
  if (M == 1 && !coef) {  // plain rotation: the RoPE hot loop (in place is fine: no overlap)
#pragma GCC ivdep
    for (int b = 0; b < nb; ++b) {
      const int j = s.first_pair + b;
      const T xr = x[A::re(j, D)], xi = x[A::im(j, D)];
      if constexpr (RT::transposed) {
        y[A::re(j, D)] = xr * cs[b] + xi * sn[b];
        y[A::im(j, D)] = -xr * sn[b] + xi * cs[b];
      } else {
        y[A::re(j, D)] = xr * cs[b] - xi * sn[b];
        y[A::im(j, D)] = xr * sn[b] + xi * cs[b];
      }
    }
    return;
  }
  // one fused pass per block: load the m slots, rotate, mix with the token's series, store.
  // The slot loops are unrolled by hand (pragma) so that the block loop vectorises.
#pragma GCC ivdep
  for (int b = 0; b < nb; ++b) {
    const int j0 = s.first_pair + b * M;
    T zr[M], zi[M];
    rotate_block<T, M, LY, RT::transposed>(x, D, j0, cs[b], sn[b], zr, zi);
    mix_block<T, M, LY, RT::upper>(coef, stride, b, zr, zi, D, j0, y);
  }
}

// Calls f.template operator()<ROLE>() with the role as a compile-time constant.
template <class F>
void dispatch_role(MapRole role, F&& f) {
  switch (role) {
    case MapRole::Primal:
      return f.template operator()<MapRole::Primal>();
    case MapRole::Contragredient:
      return f.template operator()<MapRole::Contragredient>();
    case MapRole::PrimalTranspose:
      return f.template operator()<MapRole::PrimalTranspose>();
    case MapRole::Inverse:
      return f.template operator()<MapRole::Inverse>();
  }
}

// Forward of one segment on one token row for q and k, with the tile's series at token tt:
// A^{-T} on queries, A on keys.
template <class T, int M, Layout LY>
void forward_segment(const SegmentDesc& s, int D, const T* cosr, const T* sinr, const T* ck,
                     const T* cq, int stride, const T* q, const T* k, T* qo, T* ko) {
  if (q) map_segment<T, M, LY, MapRole::Contragredient>(s, D, cosr, sinr, cq, stride, q, qo);
  if (k) map_segment<T, M, LY, MapRole::Primal>(s, D, cosr, sinr, ck, stride, k, ko);
}

// Index of the parameter-gradient accumulators: [gamma | eta | alpha0 | gates rows] x (H*NB).
struct GradSlots {
  size_t hb;
  size_t gamma(size_t i) const { return i; }
  size_t eta(size_t i) const { return hb + i; }
  size_t alpha0(size_t i) const { return 2 * hb + i; }
  size_t gate(int k, size_t i) const { return (3 + k - 1) * hb + i; }
};

// Backward of one segment on one token row, fused: the input gradient by the transposed map
// (ROLE: PrimalTranspose for keys, Inverse for queries; into o when given) and, when xin is
// given, dser'_k = sum_r <w_r, x_{r+k}> (key) or <w_r, x_{r-k}> (query) with w = R^T gy, reduced
// with the scaled series coef = e * series into dl = sum_k coef_k dser'_k (dL/dexponent) and
// de = sum_{k>=1} coef_{k-1} dser'_k (dL/deta up to +-u). w is rotated once for both.
template <class T, int M, Layout LY, MapRole ROLE>
void backward_segment(const SegmentDesc& s, int D, const T* cosr, const T* sinr, const T* coef,
                      int stride, const T* x, const T* g, T* o, T* dl, T* de, T* dser) {
  static_assert(RoleTraits<ROLE>::transposed);
  constexpr bool key = ROLE == MapRole::PrimalTranspose;
  using A = Addr<LY>;
  if (!x || (M == 1 && !coef)) {  // input gradient only (a plain rotation has no parameters)
    if (o) map_segment<T, M, LY, ROLE>(s, D, cosr, sinr, coef, stride, g, o);
    return;
  }
  const T* cs = cosr + s.first_block;
  const T* sn = sinr + s.first_block;
  const int nb = s.blocks;
#pragma GCC ivdep
  for (int b = 0; b < nb; ++b) {
    const int j0 = s.first_pair + b * M;
    T wr[M], wi[M];
    rotate_block<T, M, LY, true>(g, D, j0, cs[b], sn[b], wr, wi);
    if (o) mix_block<T, M, LY, RoleTraits<ROLE>::upper>(coef, stride, b, wr, wi, D, j0, o);
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

// Parameter gradients of one segment from a tile's dl/de/dser, accumulated in float64.
template <class T, int M>
void accumulate_param_grads(const SegmentDesc& s, int64_t h, int NB, int n, bool key,
                            Scratch<T>& sc, double* acc, const GradSlots& slot) {
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

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
