// Generic path of the transform kernels (any Jordan order, both layouts, float and double): the
// per-segment maps of one token row with a tile's coefficient series, the transposed maps of the
// backward input gradients, and the parameter-gradient reductions. Used wherever no fast path
// (transform_fast.hpp) applies. Part of the per-ISA build (transform_isa.inc): internal header.
#pragma once

#ifndef RELPOS_ISA_NAMESPACE
#error "internal kernel header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set)"
#endif

#include "kernels/transform_tiles.hpp"

namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

// Forward of one segment on one token row for q and k, with the tile's series at token tt.
// key:   y_r = e_k sum_{c>=r} c_{c-r}  R z_c      query: y_r = e_q sum_{c<=r} ic_{r-c} R z_c
template <class T, int M, Layout LY>
void forward_segment(const SegmentDesc& s, int D, const T* cosr, const T* sinr, const T* ck,
                     const T* cq, int stride, const T* q, const T* k, T* qo, T* ko) {
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
    // one fused pass per block: load the m slots, rotate, mix with the token's series, store.
    // The slot loops are unrolled by hand (pragma) so that the block loop vectorises.
    const auto block_loop = [&]<bool KEY>() {
#pragma GCC ivdep
      for (int b = 0; b < nb; ++b) {
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
#pragma GCC ivdep
  for (int b = 0; b < nb; ++b) {
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
