#include "kernels/transform.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "core/charts.hpp"

namespace relpos::kernels {

TransformPlan TransformPlan::from(const Mechanism& m, Layout layout) {
  TransformPlan p;
  p.head_dim = m.head_dim;
  p.layout = layout;
  p.total_blocks = m.total_blocks();
  p.gate_rows = m.gate_rows();
  p.omega.assign(p.total_blocks, 0.0);
  for (const auto& s : m.segments) {
    p.segments.push_back({s.first_pair, s.first_block, s.blocks, s.order, s.chart, s.L,
                          s.shear_scale, s.max_exponent, s.shear, s.damped});
    for (int b = 0; b < s.blocks; ++b) p.omega[s.first_block + b] = s.omega[b];
  }
  return p;
}

namespace {

constexpr int kMaxOrder = 8;

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

// Per (token, head, block) scalars of the map: exponential scale and the coefficient series
// (c for keys, the inverse series ic for queries), plus what the parameter gradients need.
template <class T>
struct BlockCoefs {
  double u = 0;           // s * sigma(-p)
  double arg = 0;         // exponent before clamp (key: gamma p, query: -gamma p)
  bool clamped = false;
  T scale = 1;
  double c[kMaxOrder];    // key series
  double ic[kMaxOrder];   // query series
};

template <class T>
void block_coefs(const SegmentDesc& s, const Params<T>& P, size_t hb_index, size_t hb_stride,
                 double p, double u, bool key, BlockCoefs<T>& bc) {
  bc.u = u;
  if (s.damped) {
    const double a = static_cast<double>(P.gamma[hb_index]) * p;
    bc.arg = key ? a : -a;
    const double cl = std::clamp(bc.arg, -s.max_exponent, s.max_exponent);
    bc.clamped = cl != bc.arg;
    bc.scale = static_cast<T>(std::exp(cl));
  }
  if (s.order == 1) {
    bc.c[0] = bc.ic[0] = 1.0;
    return;
  }
  double gates[kMaxOrder];
  const double eta = s.shear == ShearMode::Exponential ? static_cast<double>(P.eta[hb_index]) : 0.0;
  double alpha0 = 1.0;
  if (s.shear == ShearMode::Gates) {
    for (int k = 1; k < s.order; ++k)
      gates[k - 1] = static_cast<double>(P.gates[(k - 1) * hb_stride + hb_index]);
    alpha0 = static_cast<double>(P.alpha0[hb_index]);
  }
  shear_coefficients(s.shear, s.order, eta, gates, 1, alpha0, u, bc.c);
  if (!key) inverse_series(s.order, bc.c, bc.ic);
}

// Forward of one segment on one row (one token of one head). KEY: y_r = e * sum_{c>=r} c_{c-r} R z_c;
// query: y_r = e * sum_{c<=r} ic_{r-c} R z_c.
template <class T, int M, Layout LY, bool KEY>
void forward_segment(const SegmentDesc& s, int D, int64_t h, int64_t H, int NB, double p,
                     const T* cosr, const T* sinr, const Params<T>& P, const T* x, T* y) {
  using A = Addr<LY>;
  if constexpr (M == 1) {
    if (!s.damped) {  // plain rotation: the RoPE hot loop
      for (int b = 0; b < s.blocks; ++b) {
        const int j = s.first_pair + b, gb = s.first_block + b;
        const T cs = cosr[gb], sn = sinr[gb];
        const T xr = x[A::re(j, D)], xi = x[A::im(j, D)];
        y[A::re(j, D)] = xr * cs - xi * sn;
        y[A::im(j, D)] = xr * sn + xi * cs;
      }
      return;
    }
  }
  const double u = s.shear_scale * chart_value(s.chart, -p, s.L);
  for (int b = 0; b < s.blocks; ++b) {
    const int gb = s.first_block + b;
    const size_t hi = static_cast<size_t>(h) * NB + gb;
    BlockCoefs<T> bc;
    block_coefs(s, P, hi, static_cast<size_t>(H) * NB, p, u, KEY, bc);
    T coef[M];
    for (int k = 0; k < M; ++k) coef[k] = static_cast<T>((KEY ? bc.c[k] : bc.ic[k])) * bc.scale;
    const T cs = cosr[gb], sn = sinr[gb];
    T zr[M], zi[M];
    const int j0 = s.first_pair + b * M;
    for (int r = 0; r < M; ++r) {
      const T xr = x[A::re(j0 + r, D)], xi = x[A::im(j0 + r, D)];
      zr[r] = xr * cs - xi * sn;
      zi[r] = xr * sn + xi * cs;
    }
    for (int r = 0; r < M; ++r) {
      T ar = 0, ai = 0;
      if constexpr (KEY) {
        for (int c = r; c < M; ++c) ar += coef[c - r] * zr[c], ai += coef[c - r] * zi[c];
      } else {
        for (int c = 0; c <= r; ++c) ar += coef[r - c] * zr[c], ai += coef[r - c] * zi[c];
      }
      y[A::re(j0 + r, D)] = ar;
      y[A::im(j0 + r, D)] = ai;
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

template <class T, int M, Layout LY, bool KEY>
void backward_segment(const SegmentDesc& s, int D, int64_t h, int64_t H, int NB, double p,
                      const T* cosr, const T* sinr, const Params<T>& P, const T* x, const T* gy,
                      T* gx, double* acc, const GradSlots& slot) {
  using A = Addr<LY>;
  const double u = s.shear_scale * chart_value(s.chart, -p, s.L);
  for (int b = 0; b < s.blocks; ++b) {
    const int gb = s.first_block + b;
    const size_t hi = static_cast<size_t>(h) * NB + gb;
    const T cs = cosr[gb], sn = sinr[gb];
    const int j0 = s.first_pair + b * M;
    T wr[M], wi[M];  // R^T gy
    for (int r = 0; r < M; ++r) {
      const T gr = gy[A::re(j0 + r, D)], gi = gy[A::im(j0 + r, D)];
      wr[r] = gr * cs + gi * sn;
      wi[r] = -gr * sn + gi * cs;
    }
    if (M == 1 && !s.damped) {
      if (gx) gx[A::re(j0, D)] = wr[0], gx[A::im(j0, D)] = wi[0];
      continue;
    }
    BlockCoefs<T> bc;
    block_coefs(s, P, hi, static_cast<size_t>(H) * NB, p, u, KEY, bc);
    const double* ser = KEY ? bc.c : bc.ic;
    if (gx) {
      T coef[M];
      for (int k = 0; k < M; ++k) coef[k] = static_cast<T>(ser[k]) * bc.scale;
      for (int c = 0; c < M; ++c) {
        T ar = 0, ai = 0;
        if constexpr (KEY) {
          for (int r = 0; r <= c; ++r) ar += coef[c - r] * wr[r], ai += coef[c - r] * wi[r];
        } else {
          for (int r = c; r < M; ++r) ar += coef[r - c] * wr[r], ai += coef[r - c] * wi[r];
        }
        gx[A::re(j0 + c, D)] = ar;
        gx[A::im(j0 + c, D)] = ai;
      }
    }
    if (!acc) continue;
    // dL/d(series_k) = scale * sum_r <w_r, x_{r+k}> (key) or <w_r, x_{r-k}> (query).
    double xr[M], xi[M], dser[M];
    for (int c = 0; c < M; ++c) xr[c] = x[A::re(j0 + c, D)], xi[c] = x[A::im(j0 + c, D)];
    for (int k = 0; k < M; ++k) {
      double a = 0;
      for (int r = 0; r < M; ++r) {
        const int c = KEY ? r + k : r - k;
        if (c < 0 || c >= M) continue;
        a += static_cast<double>(wr[r]) * xr[c] + static_cast<double>(wi[r]) * xi[c];
      }
      dser[k] = a * static_cast<double>(bc.scale);
    }
    if (s.damped && !bc.clamped) {
      double dlog = 0;  // dL/d(exponent) = sum_k series_k dL/dseries_k
      for (int k = 0; k < M; ++k) dlog += ser[k] * dser[k];
      acc[slot.gamma(hi)] += (KEY ? p : -p) * dlog;
    }
    if (M == 1) continue;
    if (s.shear == ShearMode::Exponential) {
      double de = 0;  // key: dc_k/deta = u c_{k-1}; query: dic_k/deta = -u ic_{k-1}
      for (int k = 1; k < M; ++k) de += dser[k] * ser[k - 1];
      acc[slot.eta(hi)] += (KEY ? u : -u) * de;
    } else if (s.shear == ShearMode::Gates) {
      double dc[M];
      if (KEY) {
        for (int k = 0; k < M; ++k) dc[k] = dser[k];
      } else {  // d ic = -P^2 d c with P the inverse series
        double p2[M];
        for (int k = 0; k < M; ++k) {
          p2[k] = 0;
          for (int j = 0; j <= k; ++j) p2[k] += bc.ic[j] * bc.ic[k - j];
        }
        for (int j = 0; j < M; ++j) {
          dc[j] = 0;
          for (int k = j; k < M; ++k) dc[j] -= dser[k] * p2[k - j];
        }
      }
      acc[slot.alpha0(hi)] += dc[0];
      double pw = 1;
      for (int k = 1; k < M; ++k) {
        pw *= u / k;
        acc[slot.gate(k, hi)] += dc[k] * pw;
      }
    }
  }
}

template <class T, Layout LY, bool KEY>
void forward_row(const TransformPlan& plan, int64_t h, int64_t H, double p, const T* cosr,
                 const T* sinr, const Params<T>& P, const T* x, T* y) {
  const int D = plan.head_dim, NB = plan.total_blocks;
  for (const auto& s : plan.segments) {
    switch (s.order) {
#define RELPOS_CASE(MM)                                                              \
  case MM:                                                                           \
    forward_segment<T, MM, LY, KEY>(s, D, h, H, NB, p, cosr, sinr, P, x, y); \
    break;
      RELPOS_CASE(1) RELPOS_CASE(2) RELPOS_CASE(3) RELPOS_CASE(4)
      RELPOS_CASE(5) RELPOS_CASE(6) RELPOS_CASE(7) RELPOS_CASE(8)
#undef RELPOS_CASE
    }
  }
  if (x != y)
    for (int j = covered_pairs(plan); j < D / 2; ++j) {
      y[Addr<LY>::re(j, D)] = x[Addr<LY>::re(j, D)];
      y[Addr<LY>::im(j, D)] = x[Addr<LY>::im(j, D)];
    }
}

template <class T, Layout LY, bool KEY>
void backward_row(const TransformPlan& plan, int64_t h, int64_t H, double p, const T* cosr,
                  const T* sinr, const Params<T>& P, const T* x, const T* gy, T* gx, double* acc,
                  const GradSlots& slot) {
  const int D = plan.head_dim, NB = plan.total_blocks;
  for (const auto& s : plan.segments) {
    switch (s.order) {
#define RELPOS_CASE(MM)                                                                           \
  case MM:                                                                                        \
    backward_segment<T, MM, LY, KEY>(s, D, h, H, NB, p, cosr, sinr, P, x, gy, gx, acc, slot); \
    break;
      RELPOS_CASE(1) RELPOS_CASE(2) RELPOS_CASE(3) RELPOS_CASE(4)
      RELPOS_CASE(5) RELPOS_CASE(6) RELPOS_CASE(7) RELPOS_CASE(8)
#undef RELPOS_CASE
    }
  }
  if (gx && gx != gy)
    for (int j = covered_pairs(plan); j < D / 2; ++j) {
      gx[Addr<LY>::re(j, D)] = gy[Addr<LY>::re(j, D)];
      gx[Addr<LY>::im(j, D)] = gy[Addr<LY>::im(j, D)];
    }
}

void check_plan(const TransformPlan& plan) {
  for (const auto& s : plan.segments)
    if (s.order < 1 || s.order > kMaxOrder)
      throw InputError("kernel supports Jordan orders 1..8, got " + std::to_string(s.order));
  if (plan.head_dim % 2) throw InputError("head dim must be even");
}

template <class T, Layout LY>
void forward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                  TrigView<T> trig, const T* q, const T* k, T* qo, T* ko) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks, rows = dims.B * dims.H * dims.T;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row % dims.T, h = (row / dims.T) % dims.H, b = row / (dims.T * dims.H);
    const double p = pos.at(b, t, dims.T);
    const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t) * NB;
    const T* cs = trig.cos + trow;
    const T* sn = trig.sin + trow;
    if (q) forward_row<T, LY, false>(plan, h, dims.H, p, cs, sn, P, q + row * D, qo + row * D);
    if (k) forward_row<T, LY, true>(plan, h, dims.H, p, cs, sn, P, k + row * D, ko + row * D);
  }
}

template <class T, Layout LY>
void backward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                   TrigView<T> trig, const T* q, const T* k, const T* gqo, const T* gko,
                   T* gq, T* gk, const ParamGrads<T>& G) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks, rows = dims.B * dims.H * dims.T;
  const GradSlots slot{static_cast<size_t>(dims.H * NB)};
  const size_t nacc = G.any() ? (3 + plan.gate_rows) * slot.hb : 0;
  const int nthreads = omp_get_max_threads();
  std::vector<std::vector<double>> acc(nthreads);
#pragma omp parallel
  {
    auto& mine = acc[omp_get_thread_num()];
    mine.assign(nacc, 0.0);
    double* a = nacc ? mine.data() : nullptr;
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t t = row % dims.T, h = (row / dims.T) % dims.H, b = row / (dims.T * dims.H);
      const double p = pos.at(b, t, dims.T);
      const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t) * NB;
      const T* cs = trig.cos + trow;
      const T* sn = trig.sin + trow;
      if (gqo)
        backward_row<T, LY, false>(plan, h, dims.H, p, cs, sn, P, q ? q + row * D : nullptr,
                                   gqo + row * D, gq ? gq + row * D : nullptr, q ? a : nullptr,
                                   slot);
      if (gko)
        backward_row<T, LY, true>(plan, h, dims.H, p, cs, sn, P, k ? k + row * D : nullptr,
                                  gko + row * D, gk ? gk + row * D : nullptr, k ? a : nullptr,
                                  slot);
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
      double s = 0;
      for (const auto& v : acc)
        if (!v.empty()) s += v[slot.gate(kk, i)];
      G.gates[(kk - 1) * slot.hb + i] += static_cast<T>(s);
    }
  }
}

}  // namespace

int64_t trig_table_size(const TransformPlan& plan, Dims dims, const Positions& pos) {
  return (pos.per_batch ? dims.B : 1) * dims.T * plan.total_blocks;
}

template <class T>
void fill_trig_table(const TransformPlan& plan, Dims dims, const Positions& pos, T* cos, T* sin) {
  const int64_t NB = plan.total_blocks, P = pos.per_batch ? dims.B : 1;
#pragma omp parallel for schedule(static)
  for (int64_t pt = 0; pt < P * dims.T; ++pt) {
    const double p = pos.at(pt / dims.T, pt % dims.T, dims.T);
    for (int64_t b = 0; b < NB; ++b) {
      double sn, c;
      accurate_sincos(plan.omega[b], p, &sn, &c);
      cos[pt * NB + b] = static_cast<T>(c);
      sin[pt * NB + b] = static_cast<T>(-sn);  // the maps rotate by -omega p
    }
  }
}

template <class T>
TrigTable<T> build_trig_table(const TransformPlan& plan, Dims dims, const Positions& pos) {
  TrigTable<T> tab;
  const auto n = static_cast<size_t>(trig_table_size(plan, dims, pos));
  tab.cos.resize(n);
  tab.sin.resize(n);
  fill_trig_table<T>(plan, dims, pos, tab.cos.data(), tab.sin.data());
  return tab;
}

template <class T>
void transform_forward(const TransformPlan& plan, Dims dims, const Positions& pos,
                       const Params<T>& params, TrigView<T> trig, const T* q, const T* k,
                       T* q_out, T* k_out) {
  check_plan(plan);
  if (plan.layout == Layout::Interleaved)
    forward_impl<T, Layout::Interleaved>(plan, dims, pos, params, trig, q, k, q_out, k_out);
  else
    forward_impl<T, Layout::HalfSplit>(plan, dims, pos, params, trig, q, k, q_out, k_out);
}

template <class T>
void transform_backward(const TransformPlan& plan, Dims dims, const Positions& pos,
                        const Params<T>& params, TrigView<T> trig, const T* q, const T* k,
                        const T* gq_out, const T* gk_out, T* gq, T* gk,
                        const ParamGrads<T>& grads) {
  check_plan(plan);
  if (plan.layout == Layout::Interleaved)
    backward_impl<T, Layout::Interleaved>(plan, dims, pos, params, trig, q, k, gq_out, gk_out, gq,
                                          gk, grads);
  else
    backward_impl<T, Layout::HalfSplit>(plan, dims, pos, params, trig, q, k, gq_out, gk_out, gq,
                                        gk, grads);
}

#define RELPOS_INSTANTIATE(T)                                                                    \
  template TrigTable<T> build_trig_table<T>(const TransformPlan&, Dims, const Positions&);       \
  template void fill_trig_table<T>(const TransformPlan&, Dims, const Positions&, T*, T*);        \
  template void transform_forward<T>(const TransformPlan&, Dims, const Positions&,               \
                                     const Params<T>&, TrigView<T>, const T*, const T*, \
                                     T*, T*);                                                    \
  template void transform_backward<T>(const TransformPlan&, Dims, const Positions&,              \
                                      const Params<T>&, TrigView<T>, const T*, const T*, \
                                      const T*, const T*, T*, T*, const ParamGrads<T>&);
RELPOS_INSTANTIATE(float)
RELPOS_INSTANTIATE(double)
#undef RELPOS_INSTANTIATE

}  // namespace relpos::kernels
