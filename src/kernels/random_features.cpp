#include "kernels/random_features.hpp"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/types.hpp"

namespace relpos::kernels {

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
template <class T>
using RowVec = Eigen::Matrix<T, 1, Eigen::Dynamic>;
template <class T>
using CMap = Eigen::Map<const Mat<T>>;
template <class T>
using MMap = Eigen::Map<Mat<T>>;

// Below this much work (multiply-adds) a call runs on the calling thread: a parallel region costs
// more than it saves on tiny problems.
constexpr int64_t kParallelWork = int64_t{1} << 16;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

void check_dims(const char* what, std::initializer_list<std::pair<const char*, int64_t>> dims) {
  for (const auto& [name, v] : dims)
    if (v < 1) throw InputError(fmt::format("{}: {} must be >= 1 (got {})", what, name, v));
}

template <class T>
void check_buffer(const char* what, const char* name, const T* p, int64_t n, bool finite = true) {
  if (!p) throw InputError(fmt::format("{}: buffer {} is null", what, name));
  if (!finite) return;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(p[i]))
      throw InputError(fmt::format("{}: {} has a non-finite value ({}) at flat index {}", what,
                                   name, static_cast<double>(p[i]), i));
}

void check_projection(const char* what, const Projection& W, int64_t D) {
  if (W.m < 1 || W.d < 1)
    throw InputError(fmt::format("{}: the projection must have m >= 1 and d >= 1 (got m {}, d {})",
                                 what, W.m, W.d));
  if (W.d != D)
    throw InputError(
        fmt::format("{}: projection dimension d {} != head dimension D {}", what, W.d, D));
  if (static_cast<int64_t>(W.w.size()) != W.m * W.d)
    throw InputError(
        fmt::format("{}: projection holds {} values, not m d = {}", what, W.w.size(), W.m * W.d));
  check_buffer(what, "W", W.w.data(), W.m * W.d);
}

double resolve_scale(const FeatureOptions& o, int64_t D) {
  if (!std::isfinite(o.scale) || o.scale < 0)
    throw InputError(fmt::format("feature map: scale must be finite and >= 0 (got {})", o.scale));
  return o.scale == 0.0 ? std::pow(static_cast<double>(D), -0.25) : o.scale;
}

// 1 / den, 0 where den is not a positive normal number (all features underflowed).
template <class T>
T safe_inv(T den) {
  return den > std::numeric_limits<T>::min() ? T(1) / den : T(0);
}

}  // namespace

// ------------------------------------------------------------------ projections

uint64_t derive_seed(uint64_t seed, uint64_t index) {
  return splitmix64(splitmix64(seed) ^ splitmix64(index + 0x632be59bd9b4e019ULL));
}

RedrawPolicy RedrawPolicy::every(int64_t n) {
  if (n < 1) throw InputError(fmt::format("redraw policy: every N calls needs N >= 1 (got {})", n));
  return RedrawPolicy(static_cast<uint64_t>(n));
}

Projection draw_projection(ProjectionKind kind, int64_t m, int64_t d, std::mt19937_64& rng) {
  check_dims("draw_projection", {{"m (number of features)", m}, {"d (dimension)", d}});
  if (m > (int64_t{1} << 24) || d > (int64_t{1} << 16) || m * d > (int64_t{1} << 28))
    throw InputError(fmt::format("draw_projection: m {} x d {} is too large", m, d));
  std::normal_distribution<double> N(0.0, 1.0);
  Projection P{m, d, std::vector<double>(static_cast<size_t>(m * d))};
  if (kind == ProjectionKind::Iid) {
    for (auto& x : P.w) x = N(rng);
    return P;
  }
  Eigen::MatrixXd G(d, d);
  for (int64_t r0 = 0; r0 < m; r0 += d) {
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < d; ++j) G(i, j) = N(rng);
    Eigen::HouseholderQR<Eigen::MatrixXd> qr(G);
    Eigen::MatrixXd Q = qr.householderQ() * Eigen::MatrixXd::Identity(d, d);
    const Eigen::MatrixXd& R = qr.matrixQR();
    for (int64_t j = 0; j < d; ++j)  // Haar: the signs of diag(R) into Q's columns
      if (R(j, j) < 0) Q.col(j) = -Q.col(j);
    // rows of Q^T (Q's columns) are orthonormal directions
    for (int64_t r = r0; r < std::min(m, r0 + d); ++r) {
      double n2 = 0;  // chi(d) norm: |g| for a fresh g ~ N(0, I_d)
      for (int64_t j = 0; j < d; ++j) {
        const double g = N(rng);
        n2 += g * g;
      }
      const double norm = std::sqrt(n2);
      for (int64_t j = 0; j < d; ++j) P.w[r * d + j] = norm * Q(j, r - r0);
    }
  }
  return P;
}

Projection draw_projection(ProjectionKind kind, int64_t m, int64_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return draw_projection(kind, m, d, rng);
}

FeatureSampler::FeatureSampler(ProjectionKind kind, int64_t m, int64_t d, uint64_t seed,
                               RedrawPolicy policy)
    : kind_(kind),
      m_(m),
      d_(d),
      seed_(seed),
      policy_(policy),
      proj_(draw_projection(kind, m, d, derive_seed(seed, 0))) {}

const Projection& FeatureSampler::next() {
  const uint64_t idx = policy_.draw_index(calls_++);
  if (idx != index_) {
    index_ = idx;
    proj_ = draw_projection(kind_, m_, d_, derive_seed(seed_, idx));
  }
  return proj_;
}

// ------------------------------------------------------------------ feature map

template <class T>
void feature_map_forward(const FeatureDims& dims, const T* x, const Projection& W,
                         const FeatureOptions& options, T* phi, T* stab) {
  const char* what = "feature map";
  check_dims(what, {{"B", dims.B}, {"H", dims.H}, {"T", dims.T}, {"D", dims.D}});
  check_projection(what, W, dims.D);
  const int64_t BH = dims.B * dims.H, Tn = dims.T, D = dims.D, M = W.m;
  check_buffer(what, "x", x, BH * Tn * D);
  check_buffer(what, "phi", phi, 0, false);
  const double s = resolve_scale(options, D);
  const T sign = options.sign == FeatureSign::Minus ? T(-1) : T(1);
  const Mat<T> Wt = CMap<double>(W.w.data(), M, D).template cast<T>();
  const T inv_sqrt_m = static_cast<T>(1.0 / std::sqrt(static_cast<double>(M)));
  const T ts = static_cast<T>(s);
#pragma omp parallel for schedule(dynamic, 1) if (BH > 1 && BH * Tn * M * D >= kParallelWork)
  for (int64_t bh = 0; bh < BH; ++bh) {
    CMap<T> X(x + bh * Tn * D, Tn, D);
    MMap<T> U(phi + bh * Tn * M, Tn, M);
    // u_tr = s w_r . x_t -/+ s^2 |x_t|^2 / 2, in blocks of rows (one GEMM each)
    constexpr int64_t kRows = 256;
    for (int64_t t0 = 0; t0 < Tn; t0 += kRows) {
      const int64_t L = std::min(kRows, Tn - t0);
      U.middleRows(t0, L).noalias() = (ts * X.middleRows(t0, L)) * Wt.transpose();
      const Vec<T> half_n2 = (ts * ts * T(0.5)) * X.middleRows(t0, L).rowwise().squaredNorm();
      U.middleRows(t0, L).colwise() += sign * half_n2;
    }
    T* st = stab ? stab + bh * Tn : nullptr;
    if (options.stabilizer == FeatureStabilizer::Global) {
      const T c = U.maxCoeff();
      U = ((U.array() - c).exp() * inv_sqrt_m).matrix();
      if (st) std::fill(st, st + Tn, c);
    } else if (options.stabilizer == FeatureStabilizer::PerToken) {
      for (int64_t t = 0; t < Tn; ++t) {
        const T c = U.row(t).maxCoeff();
        U.row(t) = ((U.row(t).array() - c).exp() * inv_sqrt_m).matrix();
        if (st) st[t] = c;
      }
    } else {
      U = (U.array().exp() * inv_sqrt_m).matrix();
      if (st) std::fill(st, st + Tn, T(0));
    }
  }
}

template <class T>
void feature_map_backward(const FeatureDims& dims, const T* x, const Projection& W,
                          const FeatureOptions& options, const T* phi, const T* dphi, T* dx) {
  const char* what = "feature map backward";
  check_dims(what, {{"B", dims.B}, {"H", dims.H}, {"T", dims.T}, {"D", dims.D}});
  check_projection(what, W, dims.D);
  const int64_t BH = dims.B * dims.H, Tn = dims.T, D = dims.D, M = W.m;
  check_buffer(what, "x", x, BH * Tn * D);
  check_buffer(what, "phi", phi, 0, false);
  check_buffer(what, "dphi", dphi, BH * Tn * M);
  check_buffer(what, "dx", dx, 0, false);
  const double s = resolve_scale(options, D);
  const T sign = options.sign == FeatureSign::Minus ? T(-1) : T(1);
  const Mat<T> Wt = CMap<double>(W.w.data(), M, D).template cast<T>();
  const T ts = static_cast<T>(s);
#pragma omp parallel for schedule(dynamic, 1) if (BH > 1 && BH * Tn * M * D >= kParallelWork)
  for (int64_t bh = 0; bh < BH; ++bh) {
    CMap<T> X(x + bh * Tn * D, Tn, D);
    CMap<T> P(phi + bh * Tn * M, Tn, M), dP(dphi + bh * Tn * M, Tn, M);
    MMap<T> dX(dx + bh * Tn * D, Tn, D);
    constexpr int64_t kRows = 256;
    Mat<T> G;
    for (int64_t t0 = 0; t0 < Tn; t0 += kRows) {
      const int64_t L = std::min(kRows, Tn - t0);
      G = (dP.middleRows(t0, L).array() * P.middleRows(t0, L).array()).matrix();
      const Vec<T> g = G.rowwise().sum();
      dX.middleRows(t0, L).noalias() = ts * (G * Wt);
      // d(s^2 |x|^2 / 2)/dx = s^2 x
      dX.middleRows(t0, L) +=
          (sign * ts * ts) * (X.middleRows(t0, L).array().colwise() * g.array()).matrix();
    }
  }
}

// ------------------------------------------------------------------ linear attention

namespace {

void check_linear(const char* what, const LinearAttentionDims& d, const LinearAttentionOptions& o) {
  check_dims(what, {{"B", d.B}, {"H", d.H}, {"T", d.T}, {"M (features)", d.M}, {"Dv", d.Dv}});
  if (o.chunk < 1) throw InputError(fmt::format("{}: chunk must be >= 1 (got {})", what, o.chunk));
}

// The per-(batch, head) views and the chunk workspace.
template <class T>
struct Head {
  CMap<T> A, B, V;  // features of queries, keys [T, M]; values [T, Dv]
  Head(const T* fq, const T* fk, const T* v, int64_t Tn, int64_t M, int64_t Dv)
      : A(fq, Tn, M), B(fk, Tn, M), V(v, Tn, Dv) {}
};

// P = A_c B_c^T with the entries j > i zeroed (causal) for the chunk rows [t0, t0 + L).
template <class T>
void masked_scores(const Head<T>& h, int64_t t0, int64_t L, bool causal, Mat<T>& P) {
  P.noalias() = h.A.middleRows(t0, L) * h.B.middleRows(t0, L).transpose();
  if (causal) P.template triangularView<Eigen::StrictlyUpper>().setZero();
}

// The key stabilisers of one (batch, head): c_j, and the running max m_i = max_{j <= i} c_j (the
// frame of row i: key j <= i weighs b_j exp(c_j - m_i) there). Empty (false) without them.
template <class T>
struct KeyFrames {
  const T* c = nullptr;
  std::vector<T> m;
  KeyFrames(const T* kstab, int64_t Tn) : c(kstab) {
    if (!c) return;
    m.resize(static_cast<size_t>(Tn));
    T run = c[0];
    for (int64_t t = 0; t < Tn; ++t) m[t] = run = std::max(run, c[t]);
  }
  explicit operator bool() const { return c != nullptr; }
};

// E_ij = exp(c_j - m_i) (<= 1) for the chunk rows and keys [t0, t0 + L), j <= i; 0 above the
// diagonal (the argument clamped to <= 0 first, so nothing there overflows). Entry (i, j) reads
// c_j and m_i only: keys <= i.
template <class T>
void decay(const KeyFrames<T>& kf, int64_t t0, int64_t L, Mat<T>& E) {
  E.resize(L, L);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j) E(i, j) = std::min(kf.c[t0 + j] - kf.m[t0 + i], T(0));
  E = E.array().exp().matrix();
  E.template triangularView<Eigen::StrictlyUpper>().setZero();
}

// Out = diag(exp(c_j - ref)) B[t0, t0 + L): keys relative to the frame `ref` (>= every c_j there).
template <class T>
void keys_in_frame(const KeyFrames<T>& kf, const CMap<T>& B, int64_t t0, int64_t L, T ref,
                   Mat<T>& out) {
  out = B.middleRows(t0, L);
  for (int64_t j = 0; j < L; ++j) out.row(j) *= std::exp(kf.c[t0 + j] - ref);
}

// Rows i of X (chunk rows from t0) times exp(frame - m_i) (<= 1), where the running max grew
// past `frame`: the prefix state, relative to `frame`, brought into the frame of row i.
template <class T, class Xpr>
void rows_to_frames(const KeyFrames<T>& kf, int64_t t0, T frame, Xpr&& X) {
  for (int64_t i = 0; i < X.rows(); ++i)
    if (kf.m[t0 + i] > frame) X.row(i) *= std::exp(frame - kf.m[t0 + i]);
}

}  // namespace

// Causal with key stabilisers: S, z hold sum_{j < t0} b_j exp(c_j - frame) (v_j^T, 1) with frame
// = m_{t0 - 1} (the running max at the end of the previous chunk). Row i of the chunk reads
// them times exp(frame - m_i) and the chunk's keys j <= i times exp(c_j - m_i): every term is in
// the frame m_i, which depends on keys <= i only. At the chunk's end the state moves to the new
// running max (a rescale by exp(old - new) <= 1 when it grew) and takes the chunk's keys times
// exp(c_j - new). Non-causal with key stabilisers: every key times exp(c_j - max_j c_j) once.
template <class T>
void linear_attention_forward(const LinearAttentionDims& dims, const T* fq, const T* fk, const T* v,
                              const LinearAttentionOptions& options, T* out, T* den,
                              const T* kstab) {
  const char* what = "linear attention";
  check_linear(what, dims, options);
  const int64_t BH = dims.B * dims.H, Tn = dims.T, M = dims.M, Dv = dims.Dv;
  check_buffer(what, "features of q", fq, BH * Tn * M);
  check_buffer(what, "features of k", fk, BH * Tn * M);
  check_buffer(what, "v", v, BH * Tn * Dv);
  if (kstab) check_buffer(what, "key stabilisers", kstab, BH * Tn);
  check_buffer(what, "out", out, 0, false);
  for (int64_t i = 0; i < BH * Tn * M; ++i)
    if (fq[i] < 0 || fk[i] < 0)
      throw InputError(fmt::format("{}: features must be >= 0 (flat index {})", what, i));
  const int64_t C = options.chunk;
  const bool causal = options.causal;
#pragma omp parallel for schedule(dynamic, 1) if (BH > 1 && BH * Tn * M * Dv >= kParallelWork)
  for (int64_t bh = 0; bh < BH; ++bh) {
    const KeyFrames<T> kf(kstab ? kstab + bh * Tn : nullptr, Tn);
    const T* fkh = fk + bh * Tn * M;
    Mat<T> Bg;  // non-causal with key stabilisers: all keys in the frame max_j c_j
    if (kf && !causal) {
      keys_in_frame(kf, CMap<T>(fkh, Tn, M), 0, Tn, kf.m[Tn - 1], Bg);
      fkh = Bg.data();
    }
    const Head<T> h(fq + bh * Tn * M, fkh, v + bh * Tn * Dv, Tn, M, Dv);
    MMap<T> O(out + bh * Tn * Dv, Tn, Dv);
    Mat<double> S = Mat<double>::Zero(M, Dv);  // carried state, float64
    RowVec<double> z = RowVec<double>::Zero(M);
    if (!causal) {  // the totals first
      for (int64_t t0 = 0; t0 < Tn; t0 += C) {
        const int64_t L = std::min(C, Tn - t0);
        S += (h.B.middleRows(t0, L).transpose() * h.V.middleRows(t0, L)).template cast<double>();
        z += h.B.middleRows(t0, L).colwise().sum().template cast<double>();
      }
    }
    Mat<T> Sf = S.template cast<T>(), P, E, Bs;
    Vec<T> zf = z.transpose().template cast<T>(), dn;
    T frame = kf ? kf.m[0] : T(0);  // the running max the causal state is relative to
    for (int64_t t0 = 0; t0 < Tn; t0 += C) {
      const int64_t L = std::min(C, Tn - t0);
      auto Oc = O.middleRows(t0, L);
      Oc.noalias() = h.A.middleRows(t0, L) * Sf;
      dn.noalias() = h.A.middleRows(t0, L) * zf;
      if (causal) {
        masked_scores(h, t0, L, true, P);
        if (kf) {
          rows_to_frames(kf, t0, frame, Oc);
          rows_to_frames(kf, t0, frame, dn);
          decay(kf, t0, L, E);
          P.array() *= E.array();
        }
        Oc.noalias() += P * h.V.middleRows(t0, L);
        dn += P.rowwise().sum();
        if (kf) {
          const T end = kf.m[t0 + L - 1];
          if (end > frame) {  // the max grew: rescale the state (online softmax)
            const double f = std::exp(static_cast<double>(frame) - static_cast<double>(end));
            S *= f, z *= f, frame = end;
          }
          keys_in_frame(kf, h.B, t0, L, end, Bs);
          S += (Bs.transpose() * h.V.middleRows(t0, L)).template cast<double>();
          z += Bs.colwise().sum().template cast<double>();
        } else {
          S += (h.B.middleRows(t0, L).transpose() * h.V.middleRows(t0, L)).template cast<double>();
          z += h.B.middleRows(t0, L).colwise().sum().template cast<double>();
        }
        Sf = S.template cast<T>();
        zf = z.transpose().template cast<T>();
      }
      for (int64_t i = 0; i < L; ++i) {
        Oc.row(i) *= safe_inv(dn(i));
        if (den) den[bh * Tn + t0 + i] = dn(i);
      }
    }
  }
}

// With key stabilisers the backward differentiates the forward's expression with its factors
// exp(c_j - m_i) held constant (they are stop-gradients; see the header): Q_ij and the chunk
// scores carry the factors E_ij; pass 1 moves its state as the forward does; pass 2 keeps R, r
// relative to `next`, the running max at the first row after the chunk (<= m_i of every row i
// summed in, >= c_j of every key of the chunk): db_j, dv_j read them times exp(c_j - next) <= 1,
// and rows enter them times exp(m_t0 - m_i) <= 1 after the rescale by exp(m_t0 - next).
template <class T>
void linear_attention_backward(const LinearAttentionDims& dims, const T* fq, const T* fk,
                               const T* v, const LinearAttentionOptions& options, const T* dout,
                               const T* out, const T* den, T* dfq, T* dfk, T* dv, const T* kstab) {
  const char* what = "linear attention backward";
  check_linear(what, dims, options);
  const int64_t BH = dims.B * dims.H, Tn = dims.T, M = dims.M, Dv = dims.Dv;
  check_buffer(what, "features of q", fq, BH * Tn * M);
  check_buffer(what, "features of k", fk, BH * Tn * M);
  check_buffer(what, "v", v, BH * Tn * Dv);
  if (kstab) check_buffer(what, "key stabilisers", kstab, BH * Tn);
  check_buffer(what, "dout", dout, BH * Tn * Dv);
  check_buffer(what, "out", out, BH * Tn * Dv);
  check_buffer(what, "den", den, BH * Tn);
  const int64_t C = options.chunk;
  const bool causal = options.causal;
#pragma omp parallel for schedule(dynamic, 1) if (BH > 1 && BH * Tn * M * Dv >= kParallelWork)
  for (int64_t bh = 0; bh < BH; ++bh) {
    const KeyFrames<T> kf(kstab ? kstab + bh * Tn : nullptr, Tn);
    const bool framed = kf && causal;  // per-row frames; non-causal: keys pre-scaled
    const T* fkh = fk + bh * Tn * M;
    Mat<T> Bg;
    if (kf && !causal) {
      keys_in_frame(kf, CMap<T>(fkh, Tn, M), 0, Tn, kf.m[Tn - 1], Bg);
      fkh = Bg.data();
    }
    const Head<T> h(fq + bh * Tn * M, fkh, v + bh * Tn * Dv, Tn, M, Dv);
    CMap<T> G(dout + bh * Tn * Dv, Tn, Dv), O(out + bh * Tn * Dv, Tn, Dv);
    const T* dn = den + bh * Tn;
    // h_i = g_i / den_i (the numerator's gradient), c_i = -(g_i . out_i) / den_i (the
    // denominator's), for the chunk rows
    Mat<T> Hm, P, Q, E, Bs;
    Vec<T> c;
    const auto row_grads = [&](int64_t t0, int64_t L) {
      Hm = G.middleRows(t0, L);
      c.resize(L);
      for (int64_t i = 0; i < L; ++i) {
        const T inv = safe_inv(dn[t0 + i]);
        Hm.row(i) *= inv;
        c(i) = -inv * G.row(t0 + i).dot(O.row(t0 + i));
      }
      // Q_ij = h_i . v_j + c_i (j <= i when causal): d out_i / d (a_i . b_j) (times E_ij, the
      // key factors in the frame of row i, with key stabilisers)
      Q.noalias() = Hm * h.V.middleRows(t0, L).transpose();
      Q.colwise() += c;
      if (causal) Q.template triangularView<Eigen::StrictlyUpper>().setZero();
      if (framed) {
        decay(kf, t0, L, E);
        Q.array() *= E.array();
      }
    };
    // pass 1, forward in time: da_i = S_i h_i + c_i z_i (S_i, z_i over the visible keys)
    Mat<double> S = Mat<double>::Zero(M, Dv);
    RowVec<double> z = RowVec<double>::Zero(M);
    if (!causal)
      for (int64_t t0 = 0; t0 < Tn; t0 += C) {
        const int64_t L = std::min(C, Tn - t0);
        S += (h.B.middleRows(t0, L).transpose() * h.V.middleRows(t0, L)).template cast<double>();
        z += h.B.middleRows(t0, L).colwise().sum().template cast<double>();
      }
    Mat<T> Sf = S.template cast<T>();
    RowVec<T> zf = z.template cast<T>();
    if (dfq) {
      MMap<T> dA(dfq + bh * Tn * M, Tn, M);
      T frame = framed ? kf.m[0] : T(0);
      for (int64_t t0 = 0; t0 < Tn; t0 += C) {
        const int64_t L = std::min(C, Tn - t0);
        row_grads(t0, L);
        auto dAc = dA.middleRows(t0, L);
        dAc.noalias() = Hm * Sf.transpose();
        dAc.noalias() += c * zf;
        if (causal) {
          if (framed) rows_to_frames(kf, t0, frame, dAc);
          dAc.noalias() += Q * h.B.middleRows(t0, L);
          if (framed) {
            const T end = kf.m[t0 + L - 1];
            if (end > frame) {
              const double f = std::exp(static_cast<double>(frame) - static_cast<double>(end));
              S *= f, z *= f, frame = end;
            }
            keys_in_frame(kf, h.B, t0, L, end, Bs);
            S += (Bs.transpose() * h.V.middleRows(t0, L)).template cast<double>();
            z += Bs.colwise().sum().template cast<double>();
          } else {
            S +=
                (h.B.middleRows(t0, L).transpose() * h.V.middleRows(t0, L)).template cast<double>();
            z += h.B.middleRows(t0, L).colwise().sum().template cast<double>();
          }
          Sf = S.template cast<T>();
          zf = z.template cast<T>();
        }
      }
    }
    if (!dfk && !dv) continue;
    // pass 2, backward in time: R_j = sum_{i >= j} a_i h_i^T, r_j = sum_{i >= j} c_i a_i;
    //   db_j = R_j v_j + r_j,  dv_j = R_j^T b_j   (i over the queries that see key j)
    Mat<double> R = Mat<double>::Zero(M, Dv);
    RowVec<double> r = RowVec<double>::Zero(M);
    const int64_t nchunks = (Tn + C - 1) / C;
    if (!causal)
      for (int64_t t0 = 0; t0 < Tn; t0 += C) {
        const int64_t L = std::min(C, Tn - t0);
        row_grads(t0, L);
        R += (h.A.middleRows(t0, L).transpose() * Hm).template cast<double>();
        r += (c.transpose() * h.A.middleRows(t0, L)).template cast<double>();
      }
    Mat<T> Rf = R.template cast<T>(), As;
    RowVec<T> rf = r.template cast<T>();
    Vec<T> g;  // the chunk's key factors exp(c_j - next), or (non-causal) exp(c_j - max c)
    T next = kf ? kf.m[Tn - 1] : T(0);
    for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
      const int64_t t0 = ci * C, L = std::min(C, Tn - t0);
      if (causal) row_grads(t0, L);
      if (kf) {
        g.resize(L);
        for (int64_t j = 0; j < L; ++j) g(j) = std::exp(kf.c[t0 + j] - next);
      }
      if (dfk) {
        MMap<T> dB(dfk + bh * Tn * M, Tn, M);
        auto dBc = dB.middleRows(t0, L);
        dBc.noalias() = h.V.middleRows(t0, L) * Rf.transpose();
        dBc.rowwise() += rf;
        // causal: the later chunks' part; non-causal: back from the pre-scaled keys to fk
        if (kf) dBc = g.asDiagonal() * dBc;
        if (causal) dBc.noalias() += Q.transpose() * h.A.middleRows(t0, L);
      }
      if (dv) {
        MMap<T> dV(dv + bh * Tn * Dv, Tn, Dv);
        auto dVc = dV.middleRows(t0, L);
        dVc.noalias() = h.B.middleRows(t0, L) * Rf;
        if (framed) dVc = g.asDiagonal() * dVc;
        if (causal) {
          masked_scores(h, t0, L, true, P);
          if (framed) P.array() *= E.array();
          dVc.noalias() += P.transpose() * Hm;
        }
      }
      if (causal) {
        if (framed) {
          const T first = kf.m[t0];
          if (first < next) {
            const double f = std::exp(static_cast<double>(first) - static_cast<double>(next));
            R *= f, r *= f;
          }
          next = first;
          As = h.A.middleRows(t0, L);
          for (int64_t i = 0; i < L; ++i)
            if (kf.m[t0 + i] > first) As.row(i) *= std::exp(first - kf.m[t0 + i]);
          R += (As.transpose() * Hm).template cast<double>();
          r += (c.transpose() * As).template cast<double>();
        } else {
          R += (h.A.middleRows(t0, L).transpose() * Hm).template cast<double>();
          r += (c.transpose() * h.A.middleRows(t0, L)).template cast<double>();
        }
        Rf = R.template cast<T>();
        rf = r.template cast<T>();
      }
    }
  }
}

// ------------------------------------------------------------------ FAVOR+ attention

namespace {
void check_favor(const FavorDims& d, const Projection& W, const FavorOptions& o) {
  check_dims("favor attention", {{"B", d.B}, {"H", d.H}, {"T", d.T}, {"D", d.D}, {"Dv", d.Dv}});
  check_projection("favor attention", W, d.D);
  if (o.chunk < 1)
    throw InputError(fmt::format("favor attention: chunk must be >= 1 (got {})", o.chunk));
}
FeatureOptions feature_options(const FavorOptions& o, FeatureStabilizer st) {
  return FeatureOptions{o.sign, st, o.scale};
}
FeatureStabilizer key_stabilizer(const FavorOptions& o) {
  return o.causal ? FeatureStabilizer::PerToken : FeatureStabilizer::Global;
}
}  // namespace

template <class T>
void favor_attention_forward(const FavorDims& dims, const T* q, const T* k, const T* v,
                             const Projection& W, const FavorOptions& options, T* out,
                             FavorCache<T>& cache) {
  check_favor(dims, W, options);
  const FeatureDims fd{dims.B, dims.H, dims.T, dims.D};
  const auto n = static_cast<size_t>(dims.B * dims.H * dims.T * W.m);
  cache.fq.resize(n);
  cache.fk.resize(n);
  cache.den.resize(static_cast<size_t>(dims.B * dims.H * dims.T));
  feature_map_forward(fd, q, W, feature_options(options, FeatureStabilizer::PerToken),
                      cache.fq.data());
  // causal: each key stabilised by its own max, which the kernel turns into a running max (the
  // output at i reads keys <= i only, bit for bit); non-causal: one max over all keys
  cache.kstab.resize(options.causal ? cache.den.size() : 0);
  feature_map_forward(fd, k, W, feature_options(options, key_stabilizer(options)), cache.fk.data(),
                      options.causal ? cache.kstab.data() : nullptr);
  linear_attention_forward(LinearAttentionDims{dims.B, dims.H, dims.T, W.m, dims.Dv},
                           cache.fq.data(), cache.fk.data(), v,
                           LinearAttentionOptions{options.causal, options.chunk}, out,
                           cache.den.data(), options.causal ? cache.kstab.data() : nullptr);
}

template <class T>
void favor_attention_backward(const FavorDims& dims, const T* q, const T* k, const T* v,
                              const Projection& W, const FavorOptions& options, const T* dout,
                              const T* out, const FavorCache<T>& cache, T* dq, T* dk, T* dv) {
  check_favor(dims, W, options);
  const auto n = static_cast<size_t>(dims.B * dims.H * dims.T * W.m);
  const auto nt = static_cast<size_t>(dims.B * dims.H * dims.T);
  if (cache.fq.size() != n || cache.fk.size() != n || cache.den.size() != nt ||
      cache.kstab.size() != (options.causal ? nt : 0))
    throw InputError("favor attention backward: the cache does not come from this forward");
  std::vector<T> dfq(dq ? n : 0), dfk(dk ? n : 0);
  linear_attention_backward(LinearAttentionDims{dims.B, dims.H, dims.T, W.m, dims.Dv},
                            cache.fq.data(), cache.fk.data(), v,
                            LinearAttentionOptions{options.causal, options.chunk}, dout, out,
                            cache.den.data(), dq ? dfq.data() : nullptr, dk ? dfk.data() : nullptr,
                            dv, options.causal ? cache.kstab.data() : nullptr);
  const FeatureDims fd{dims.B, dims.H, dims.T, dims.D};
  if (dq)
    feature_map_backward(fd, q, W, feature_options(options, FeatureStabilizer::PerToken),
                         cache.fq.data(), dfq.data(), dq);
  if (dk)
    feature_map_backward(fd, k, W, feature_options(options, key_stabilizer(options)),
                         cache.fk.data(), dfk.data(), dk);
}

#define RELPOS_RF_INSTANTIATE(T)                                                                \
  template void feature_map_forward<T>(const FeatureDims&, const T*, const Projection&,         \
                                       const FeatureOptions&, T*, T*);                          \
  template void feature_map_backward<T>(const FeatureDims&, const T*, const Projection&,        \
                                        const FeatureOptions&, const T*, const T*, T*);         \
  template void linear_attention_forward<T>(const LinearAttentionDims&, const T*, const T*,     \
                                            const T*, const LinearAttentionOptions&, T*, T*,    \
                                            const T*);                                          \
  template void linear_attention_backward<T>(const LinearAttentionDims&, const T*, const T*,    \
                                             const T*, const LinearAttentionOptions&, const T*, \
                                             const T*, const T*, T*, T*, T*, const T*);         \
  template void favor_attention_forward<T>(const FavorDims&, const T*, const T*, const T*,      \
                                           const Projection&, const FavorOptions&, T*,          \
                                           FavorCache<T>&);                                     \
  template void favor_attention_backward<T>(const FavorDims&, const T*, const T*, const T*,     \
                                            const Projection&, const FavorOptions&, const T*,   \
                                            const T*, const FavorCache<T>&, T*, T*, T*);
RELPOS_RF_INSTANTIATE(float)
RELPOS_RF_INSTANTIATE(double)
#undef RELPOS_RF_INSTANTIATE

}  // namespace relpos::kernels
