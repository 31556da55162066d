// Implementation of the transform kernels, included once per instruction set (transform_isa.inc):
// the same code is compiled for the baseline x86-64 and for AVX2+FMA, and transform.cpp picks the
// best at run time. Internal header: include kernels/transform.hpp instead.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/charts.hpp"
#include "kernels/transform.hpp"

namespace relpos::kernels {
namespace RELPOS_ISA_NAMESPACE {

constexpr int kMaxOrder = 8;
constexpr int64_t kTrigAnchor = 32;
constexpr int kExpAnchor = 32;

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

// Per-thread scratch for one row of one segment, laid out structure-of-arrays ([slot][block]) so
// that every loop below runs over blocks with unit stride and vectorises.
template <class T>
struct Scratch {
  int nb;
  std::vector<T> ek, eq, x, ck, cq, zr, zi, yr, yi, xr, xi, dl, de;
  // Damping by recurrence along consecutive rows of one (batch, head): e^{gamma (p + d)} =
  // e^{gamma p} e^{gamma d}, float64, re-anchored exactly every kExpAnchor rows. One exp per block
  // per anchor instead of two per row: exp was the hot spot of the damped kernels.
  std::vector<double> ekd, eqd, rk, rq;  // per global block
  enum class Step { Anchor, NewRatio, Reuse } step = Step::Anchor;
  int64_t last_row = -2;
  double last_p = 0, last_d = 0;
  int run = 0;
  bool force_anchor = true;
  explicit Scratch(int blocks)
      : nb(std::max(1, blocks)),
        ek(nb), eq(nb), x(nb), ck(kMaxOrder * nb), cq(kMaxOrder * nb), zr(kMaxOrder * nb),
        zi(kMaxOrder * nb), yr(kMaxOrder * nb), yi(kMaxOrder * nb), xr(kMaxOrder * nb),
        xi(kMaxOrder * nb), dl(nb), de(nb), ekd(nb), eqd(nb), rk(nb), rq(nb) {}

  // Called once per row before its segments: decides how the damping of this row is obtained.
  void begin_row(int64_t row, int64_t t, double p) {
    const bool contiguous = row == last_row + 1 && t > 0 && run < kExpAnchor && !force_anchor;
    const double d = p - last_p;
    if (!contiguous) {
      step = Step::Anchor;
      run = 0;
      last_d = std::numeric_limits<double>::quiet_NaN();  // ratios belong to the last run only
    } else {
      step = d == last_d ? Step::Reuse : Step::NewRatio;
      last_d = d;
      ++run;
    }
    force_anchor = false;
    last_row = row;
    last_p = p;
  }
};

// Scaled coefficient series of every block of the segment at this row:
//   ck[k][b] = e^{+gamma p} c_k (keys),  cq[k][b] = e^{-gamma p} ic_k (queries),
// with c_k = x^k/k!, ic_k = (-x)^k/k!, x = eta s sigma(-p) (exponential shear), or the jet-gate
// series and its power-series inverse.
template <class T, int M>
void row_series(const SegmentDesc& s, const Params<T>& P, int64_t h, int64_t H, int NB, double p,
                double u, Scratch<T>& sc) {
  const int nb = s.blocks;
  const int64_t off = h * NB + s.first_block;
  T* ek = sc.ek.data();
  T* eq = sc.eq.data();
  if (s.damped) {
    const double X = s.max_exponent;
    const T* g = P.gamma + off;
    double* ekd = sc.ekd.data() + s.first_block;
    double* eqd = sc.eqd.data() + s.first_block;
    double* rk = sc.rk.data() + s.first_block;
    double* rq = sc.rq.data() + s.first_block;
    if (sc.step == Scratch<T>::Step::Anchor) {
      for (int b = 0; b < nb; ++b) {
        const double a = static_cast<double>(g[b]) * p;
        ekd[b] = std::exp(std::min(std::max(a, -X), X));
        eqd[b] = std::exp(std::min(std::max(-a, -X), X));
      }
    } else {
      if (sc.step == Scratch<T>::Step::NewRatio)
        for (int b = 0; b < nb; ++b) {
          rk[b] = std::exp(static_cast<double>(g[b]) * sc.last_d);
          rq[b] = 1.0 / rk[b];
        }
      for (int b = 0; b < nb; ++b) {
        ekd[b] *= rk[b];
        eqd[b] *= rq[b];
      }
    }
    for (int b = 0; b < nb; ++b) {
      const double a = static_cast<double>(g[b]) * p;
      if (std::abs(a) > X) {  // clamp binds: exact values, and the next row starts afresh
        ekd[b] = std::exp(std::min(std::max(a, -X), X));
        eqd[b] = std::exp(std::min(std::max(-a, -X), X));
        sc.force_anchor = true;
      }
      ek[b] = static_cast<T>(ekd[b]);
      eq[b] = static_cast<T>(eqd[b]);
    }
  } else {
    std::fill(ek, ek + nb, T(1));
    std::fill(eq, eq + nb, T(1));
  }
  T* ck = sc.ck.data();
  T* cq = sc.cq.data();
  std::copy(ek, ek + nb, ck);
  std::copy(eq, eq + nb, cq);
  if (M == 1) return;
  if (s.shear == ShearMode::Gates) {
    for (int b = 0; b < nb; ++b) {
      double gates[kMaxOrder], c[kMaxOrder], ic[kMaxOrder];
      for (int k = 1; k < M; ++k) gates[k - 1] = static_cast<double>(P.gates[(k - 1) * H * NB + off + b]);
      shear_coefficients(ShearMode::Gates, M, 0.0, gates, 1, static_cast<double>(P.alpha0[off + b]), u, c);
      inverse_series(M, c, ic);
      for (int k = 0; k < M; ++k) {
        ck[k * nb + b] = static_cast<T>(c[k]) * ek[b];
        cq[k * nb + b] = static_cast<T>(ic[k]) * eq[b];
      }
    }
    return;
  }
  T* x = sc.x.data();
  if (s.shear == ShearMode::Exponential) {
    const T ut = static_cast<T>(u);
    const T* e = P.eta + off;
    for (int b = 0; b < nb; ++b) x[b] = e[b] * ut;
  } else {
    std::fill(x, x + nb, T(0));
  }
  for (int k = 1; k < M; ++k) {
    const T inv = T(1) / static_cast<T>(k);
    for (int b = 0; b < nb; ++b) {
      ck[k * nb + b] = ck[(k - 1) * nb + b] * x[b] * inv;
      cq[k * nb + b] = -cq[(k - 1) * nb + b] * x[b] * inv;
    }
  }
}

// Gathers slot r of every block into zr/zi[r][b] (rotated by the row's angle when rotate is set).
template <class T, int M, Layout LY>
void gather(const SegmentDesc& s, int D, const T* x, const T* cs, const T* sn, bool rotate,
            T* zr, T* zi) {
  using A = Addr<LY>;
  const int nb = s.blocks;
  for (int r = 0; r < M; ++r) {
    T* ar = zr + r * nb;
    T* ai = zi + r * nb;
    for (int b = 0; b < nb; ++b) {
      const int j = s.first_pair + b * M + r;
      ar[b] = x[A::re(j, D)];
      ai[b] = x[A::im(j, D)];
    }
    if (!rotate) continue;
    for (int b = 0; b < nb; ++b) {
      const T xr = ar[b], xi = ai[b];
      ar[b] = xr * cs[b] - xi * sn[b];
      ai[b] = xr * sn[b] + xi * cs[b];
    }
  }
}

template <class T, int M, Layout LY>
void scatter(const SegmentDesc& s, int D, const T* yr, const T* yi, T* y) {
  using A = Addr<LY>;
  const int nb = s.blocks;
  for (int r = 0; r < M; ++r)
    for (int b = 0; b < nb; ++b) {
      const int j = s.first_pair + b * M + r;
      y[A::re(j, D)] = yr[r * nb + b];
      y[A::im(j, D)] = yi[r * nb + b];
    }
}

// y_r = sum_c coef[|c - r|] z_c over c >= r (upper: keys, transposed queries) or c <= r (lower).
template <class T, int M>
void mix(int nb, const T* coef, const T* zr, const T* zi, bool upper, T* yr, T* yi) {
  for (int r = 0; r < M; ++r) {
    T* orr = yr + r * nb;
    T* oi = yi + r * nb;
    {  // the diagonal term c = r initialises the output (no separate zero fill)
      const T* w = coef;
      const T* a = zr + r * nb;
      const T* bb = zi + r * nb;
      for (int b = 0; b < nb; ++b) {
        orr[b] = w[b] * a[b];
        oi[b] = w[b] * bb[b];
      }
    }
    const int lo = upper ? r + 1 : 0, hi = upper ? M : r;
    for (int c = lo; c < hi; ++c) {
      const T* w = coef + (upper ? c - r : r - c) * nb;
      const T* a = zr + c * nb;
      const T* bb = zi + c * nb;
      for (int b = 0; b < nb; ++b) {
        orr[b] += w[b] * a[b];
        oi[b] += w[b] * bb[b];
      }
    }
  }
}

// Forward of one segment on one (token, head) row for q and k together.
// key:   y_r = e_k sum_{c>=r} c_{c-r}  R z_c      query: y_r = e_q sum_{c<=r} ic_{r-c} R z_c
template <class T, int M, Layout LY>
void forward_segment(const SegmentDesc& s, int D, int64_t h, int64_t H, int NB, double p,
                     const T* cosr, const T* sinr, const Params<T>& P, Scratch<T>& sc,
                     const T* q, const T* k, T* qo, T* ko) {
  using A = Addr<LY>;
  const T* cs = cosr + s.first_block;
  const T* sn = sinr + s.first_block;
  if (M == 1 && !s.damped) {  // plain rotation: the RoPE hot loop (in place is fine: no overlap)
    for (int io = 0; io < 2; ++io) {
      const T* x = io ? k : q;
      T* y = io ? ko : qo;
      if (!x) continue;
#pragma GCC ivdep
      for (int b = 0; b < s.blocks; ++b) {
        const int j = s.first_pair + b;
        const T xr = x[A::re(j, D)], xi = x[A::im(j, D)];
        y[A::re(j, D)] = xr * cs[b] - xi * sn[b];
        y[A::im(j, D)] = xr * sn[b] + xi * cs[b];
      }
    }
    return;
  }
  const double u = s.shear_scale * chart_value(s.chart, -p, s.L);
  row_series<T, M>(s, P, h, H, NB, p, u, sc);
  const int nb = s.blocks;
  for (int io = 0; io < 2; ++io) {
    const bool key = io == 1;
    const T* x = key ? k : q;
    T* y = key ? ko : qo;
    if (!x) continue;
    const T* coef = key ? sc.ck.data() : sc.cq.data();
    // one fused pass per block: load the m slots, rotate, mix with the row's series, store
#pragma GCC ivdep
    for (int b = 0; b < nb; ++b) {
      const int j0 = s.first_pair + b * M;
      T zr[M], zi[M];
      for (int r = 0; r < M; ++r) {
        const T xr = x[A::re(j0 + r, D)], xi = x[A::im(j0 + r, D)];
        zr[r] = xr * cs[b] - xi * sn[b];
        zi[r] = xr * sn[b] + xi * cs[b];
      }
      for (int r = 0; r < M; ++r) {
        T ar = 0, ai = 0;
        if (key) {
          for (int c = r; c < M; ++c) ar += coef[(c - r) * nb + b] * zr[c], ai += coef[(c - r) * nb + b] * zi[c];
        } else {
          for (int c = 0; c <= r; ++c) ar += coef[(r - c) * nb + b] * zr[c], ai += coef[(r - c) * nb + b] * zi[c];
        }
        y[A::re(j0 + r, D)] = ar;
        y[A::im(j0 + r, D)] = ai;
      }
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

// Backward of one segment on one row: input gradients (transposed maps) and, when acc is given,
// parameter gradients accumulated in float64.
template <class T, int M, Layout LY>
void backward_segment(const SegmentDesc& s, int D, int64_t h, int64_t H, int NB, double p,
                      const T* cosr, const T* sinr, const Params<T>& P, Scratch<T>& sc,
                      const T* const xin[2], const T* const gy[2], T* const gx[2], double* acc,
                      const GradSlots& slot) {
  using A = Addr<LY>;
  const T* cs = cosr + s.first_block;
  const T* sn = sinr + s.first_block;
  if (M == 1 && !s.damped) {  // transpose of a rotation
    for (int io = 0; io < 2; ++io) {
      if (!gy[io] || !gx[io]) continue;
      const T* g = gy[io];
      T* o = gx[io];
#pragma GCC ivdep
      for (int b = 0; b < s.blocks; ++b) {
        const int j = s.first_pair + b;
        const T gr = g[A::re(j, D)], gi = g[A::im(j, D)];
        o[A::re(j, D)] = gr * cs[b] + gi * sn[b];
        o[A::im(j, D)] = -gr * sn[b] + gi * cs[b];
      }
    }
    return;
  }
  const int nb = s.blocks;
  const double u = s.shear_scale * chart_value(s.chart, -p, s.L);
  row_series<T, M>(s, P, h, H, NB, p, u, sc);
  T* dser = sc.yr.data();  // dser'_k[b], kept for the jet-gate gradients
  T* dl = sc.dl.data();
  T* de = sc.de.data();
  for (int io = 0; io < 2; ++io) {
    if (!gy[io]) continue;
    const bool key = io == 1;
    const T* coef = key ? sc.ck.data() : sc.cq.data();
    const T* g = gy[io];
    T* o = gx[io];
    const T* x = acc ? xin[io] : nullptr;
    // One fused pass per block: w = R^T gy; input gradient by the transposed mixing (key lower,
    // query upper); and, for the parameters, dser'_k = sum_r <w_r, x_{r+k}> (key) or
    // <w_r, x_{r-k}> (query). With the scaled series coef = e * series these give
    // dL/dexponent = sum_k coef_k dser'_k and dL/deta = +-u sum_{k>=1} coef_{k-1} dser'_k.
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
            for (int r = 0; r <= c; ++r) ar += coef[(c - r) * nb + b] * wr[r], ai += coef[(c - r) * nb + b] * wi[r];
          } else {
            for (int r = c; r < M; ++r) ar += coef[(r - c) * nb + b] * wr[r], ai += coef[(r - c) * nb + b] * wi[r];
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
          dser[kk * nb + b] = d;
          dlb += coef[kk * nb + b] * d;
          if (kk >= 1) deb += coef[(kk - 1) * nb + b] * d;
        }
        dl[b] = dlb;
        de[b] = deb;
      }
    }
    if (!x) continue;
    const size_t off = static_cast<size_t>(h) * NB + s.first_block;
    if (s.damped) {
      const T* g = P.gamma + off;
      const double sgn = key ? p : -p;
      double* ag = acc + slot.gamma(off);
      for (int b = 0; b < nb; ++b)  // no gradient through a binding clamp
        if (std::abs(static_cast<double>(g[b]) * p) <= s.max_exponent)
          ag[b] += sgn * static_cast<double>(dl[b]);
    }
    if (M == 1) continue;
    if (s.shear == ShearMode::Exponential) {
      double* ae = acc + slot.eta(off);
      const double su = key ? u : -u;
      for (int b = 0; b < nb; ++b) ae[b] += su * static_cast<double>(de[b]);
    } else if (s.shear == ShearMode::Gates) {
      // dL/dc via the unscaled series (d ic = -P^2 d c for queries), then c_0 = alpha_0,
      // c_k = g_k u^k/k!
      for (int b = 0; b < nb; ++b) {
        const double e = static_cast<double>(key ? sc.ek[b] : sc.eq[b]);
        double dser2[kMaxOrder], ser[kMaxOrder], dc[kMaxOrder];
        for (int kk = 0; kk < M; ++kk) {
          dser2[kk] = static_cast<double>(sc.yr[kk * nb + b]) * e;
          ser[kk] = static_cast<double>(coef[kk * nb + b]) / e;
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
          pw *= u / kk;
          acc[slot.gate(kk, off + b)] += dc[kk] * pw;
        }
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


template <class T, Layout LY>
void forward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                  TrigView<T> trig, const T* q, const T* k, T* qo, T* ko) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks, rows = dims.B * dims.H * dims.T;
  const int covered = covered_pairs(plan);
#pragma omp parallel
  {
    Scratch<T> sc(plan.total_blocks);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t t = row % dims.T, h = (row / dims.T) % dims.H, b = row / (dims.T * dims.H);
      const double p = pos.at(b, t, dims.T);
      const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t) * NB;
      sc.begin_row(row, t, p);
      const T* qr = q ? q + row * D : nullptr;
      const T* kr = k ? k + row * D : nullptr;
      T* qor = q ? qo + row * D : nullptr;
      T* kor = k ? ko + row * D : nullptr;
      for (const auto& s : plan.segments)
        dispatch_order(s.order, [&]<int M>() {
          forward_segment<T, M, LY>(s, static_cast<int>(D), h, dims.H, static_cast<int>(NB), p,
                                    trig.cos + trow, trig.sin + trow, P, sc, qr, kr, qor, kor);
        });
      copy_uncovered<T, LY>(covered, static_cast<int>(D), qr, qor);
      copy_uncovered<T, LY>(covered, static_cast<int>(D), kr, kor);
    }
  }
}

template <class T, Layout LY>
void backward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                   TrigView<T> trig, const T* q, const T* k, const T* gqo, const T* gko, T* gq,
                   T* gk, const ParamGrads<T>& G) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks, rows = dims.B * dims.H * dims.T;
  const int covered = covered_pairs(plan);
  const GradSlots slot{static_cast<size_t>(dims.H * NB)};
  const size_t nacc = G.any() ? (3 + plan.gate_rows) * slot.hb : 0;
  std::vector<std::vector<double>> acc(static_cast<size_t>(omp_get_max_threads()));
#pragma omp parallel
  {
    Scratch<T> sc(plan.total_blocks);
    auto& mine = acc[static_cast<size_t>(omp_get_thread_num())];
    mine.assign(nacc, 0.0);
    double* a = nacc ? mine.data() : nullptr;
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t t = row % dims.T, h = (row / dims.T) % dims.H, b = row / (dims.T * dims.H);
      const double p = pos.at(b, t, dims.T);
      const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t) * NB;
      sc.begin_row(row, t, p);
      const T* const xin[2] = {q ? q + row * D : nullptr, k ? k + row * D : nullptr};
      const T* const gy[2] = {gqo ? gqo + row * D : nullptr, gko ? gko + row * D : nullptr};
      T* const gx[2] = {gq && gqo ? gq + row * D : nullptr, gk && gko ? gk + row * D : nullptr};
      for (const auto& s : plan.segments)
        dispatch_order(s.order, [&]<int M>() {
          backward_segment<T, M, LY>(s, static_cast<int>(D), h, dims.H, static_cast<int>(NB), p,
                                     trig.cos + trow, trig.sin + trow, P, sc, xin, gy, gx, a, slot);
        });
      for (int io = 0; io < 2; ++io) copy_uncovered<T, LY>(covered, static_cast<int>(D), gy[io], gx[io]);
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
