// Positive (orthogonal) random features and linear attention (kernels/random_features.hpp): the
// FAVOR+ estimator is unbiased for exp(x.y) with the minus sign and biased with the paper's plus
// sign, orthogonal features beat iid ones, the chi row norms, the redraw policy, the chunked
// causal and the non-causal kernels against a materialised float64 reference (with and without
// key stabilisers), causality bit for bit through the whole pipeline, the gradients against
// central differences, convergence to softmax attention as m grows, bad input, and (at the end)
// the relative law of rotated q and k kept by the features in expectation.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/types.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/random_features.hpp"
#include "test_util.hpp"

using namespace relpos;
using namespace relpos::kernels;

namespace {

std::vector<double> scaled_normal(size_t n, std::mt19937_64& rng, double norm) {
  auto v = test::normal_vec(n, rng);
  double s = 0;
  for (double x : v) s += x * x;
  for (double& x : v) x *= norm / std::sqrt(s);
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

struct Moments {
  double mean = 0, se = 0, mse = 0;
};

// `draws` independent estimates phi(x) . phi(y) with m features each (no stabiliser, scale 1),
// from ONE kernel call on a projection of draws * rows_per_draw rows: iid rows are independent
// anyway, and orthogonal blocks of d rows are independent of each other, so the first m rows of
// each block (a truncated block, as the kernel draws for m < d) form one orthogonal draw.
Moments monte_carlo(ProjectionKind kind, int64_t m, const std::vector<double>& x,
                    const std::vector<double>& y, FeatureSign sign, int64_t draws, uint64_t seed,
                    double exact) {
  const auto d = static_cast<int64_t>(x.size());
  const int64_t per = kind == ProjectionKind::Iid ? m : d;  // rows per draw, m <= d
  const auto W = draw_projection(kind, draws * per, d, seed);
  std::vector<double> xy(x);
  xy.insert(xy.end(), y.begin(), y.end());
  std::vector<double> phi(static_cast<size_t>(2 * W.m));
  feature_map_forward<double>(FeatureDims{1, 1, 2, d}, xy.data(), W,
                              FeatureOptions{sign, FeatureStabilizer::None, 1.0}, phi.data());
  // the kernel divides by sqrt(W.m); one draw of m features divides by sqrt(m)
  const double rescale = static_cast<double>(W.m) / static_cast<double>(m);
  double s = 0, s2 = 0, se2 = 0;
  for (int64_t n = 0; n < draws; ++n) {
    double e = 0;
    for (int64_t r = n * per; r < n * per + m; ++r) e += phi[r] * phi[W.m + r];
    e *= rescale;
    s += e, s2 += e * e, se2 += (e - exact) * (e - exact);
  }
  const auto N = static_cast<double>(draws);
  Moments r;
  r.mean = s / N;
  r.se = std::sqrt((s2 / N - r.mean * r.mean) / (N - 1.0));
  r.mse = se2 / N;
  return r;
}

// Causal (or not) linear attention straight from the definition, float64, materialising the
// T x T weights A_ij = fq_i . fk_j (times exp(c_j - max c) with key stabilisers c [B, H, T]).
template <class T>
std::vector<double> linear_reference(const LinearAttentionDims& d, const std::vector<T>& fq,
                                     const std::vector<T>& fk, const std::vector<T>& v, bool causal,
                                     const std::vector<T>* kstab = nullptr) {
  std::vector<double> out(static_cast<size_t>(d.B * d.H * d.T * d.Dv));
  for (int64_t bh = 0; bh < d.B * d.H; ++bh)
    for (int64_t i = 0; i < d.T; ++i) {
      double cmax = -INFINITY;
      if (kstab)
        for (int64_t j = 0; j < d.T; ++j)
          cmax = std::max(cmax, static_cast<double>((*kstab)[bh * d.T + j]));
      std::vector<double> num(static_cast<size_t>(d.Dv), 0.0);
      double den = 0;
      for (int64_t j = 0; j < (causal ? i + 1 : d.T); ++j) {
        double a = 0;
        for (int64_t r = 0; r < d.M; ++r)
          a += static_cast<double>(fq[(bh * d.T + i) * d.M + r]) *
               static_cast<double>(fk[(bh * d.T + j) * d.M + r]);
        if (kstab) a *= std::exp(static_cast<double>((*kstab)[bh * d.T + j]) - cmax);
        den += a;
        for (int64_t c = 0; c < d.Dv; ++c)
          num[c] += a * static_cast<double>(v[(bh * d.T + j) * d.Dv + c]);
      }
      for (int64_t c = 0; c < d.Dv; ++c) out[(bh * d.T + i) * d.Dv + c] = num[c] / den;
    }
  return out;
}

template <class A, class B>
double rel_diff(const std::vector<A>& a, const std::vector<B>& b) {
  double n = 0, e = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    e += (x - y) * (x - y), n += y * y;
  }
  return std::sqrt(e / (n > 0 ? n : 1.0));
}

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

}  // namespace

// E[phi(x).phi(y)] = exp(x.y) with exp(w.x - |x|^2/2) (FAVOR+), within 5 standard errors; the
// paper's exp(w.x + |x|^2/2) instead converges to exp(x.y + |x|^2 + |y|^2), far from exp(x.y).
TEST(RandomFeatures, MinusSignIsUnbiasedPlusSignIsBiased) {
  std::mt19937_64 rng(11);
  const int64_t d = 6, m = 4;
  const int64_t draws = 40000;
  for (int pair = 0; pair < 3; ++pair) {
    const auto x = scaled_normal(d, rng, 0.4 + 0.2 * pair), y = scaled_normal(d, rng, 0.6);
    const double exact = std::exp(dot(x, y));
    for (auto kind : {ProjectionKind::Iid, ProjectionKind::Orthogonal}) {
      const auto minus = monte_carlo(kind, m, x, y, FeatureSign::Minus, draws, 100 + pair, exact);
      EXPECT_LT(std::abs(minus.mean - exact), 5 * minus.se)
          << "pair " << pair << " mean " << minus.mean << " exact " << exact << " se " << minus.se;
      const auto plus = monte_carlo(kind, m, x, y, FeatureSign::Plus, draws, 100 + pair, exact);
      const double biased = std::exp(dot(x, y) + dot(x, x) + dot(y, y));
      EXPECT_GT(std::abs(plus.mean - exact), 20 * plus.se) << "pair " << pair;
      EXPECT_GT(plus.mean / exact, 1.2) << "pair " << pair;
      EXPECT_LT(std::abs(plus.mean - biased), 5 * plus.se)
          << "pair " << pair << " plus mean " << plus.mean << " predicted " << biased;
    }
  }
}

// Orthogonal blocks lower the mean squared error at equal m (Performer, Theorem 2), for several
// x, y (m = d: one full block per draw). Measured ratios ort/iid: about 0.8 - 0.9 here.
TEST(RandomFeatures, OrthogonalFeaturesHaveLowerMseThanIid) {
  std::mt19937_64 rng(5);
  const int64_t d = 8, m = 8, draws = 30000;
  double ratio_sum = 0;
  const int pairs = 5;
  for (int pair = 0; pair < pairs; ++pair) {
    const auto x = scaled_normal(d, rng, 0.8), y = scaled_normal(d, rng, 0.8);
    const double exact = std::exp(dot(x, y));
    const auto iid =
        monte_carlo(ProjectionKind::Iid, m, x, y, FeatureSign::Minus, draws, 7 + pair, exact);
    const auto ort = monte_carlo(ProjectionKind::Orthogonal, m, x, y, FeatureSign::Minus, draws,
                                 70 + pair, exact);
    EXPECT_LT(ort.mse, 1.05 * iid.mse) << "pair " << pair;
    ratio_sum += ort.mse / iid.mse;
  }
  EXPECT_LT(ratio_sum / pairs, 0.95);
}

// Orthogonal rows: chi(d) norms (E|w|^2 = d, Var |w|^2 = 2d), orthogonal within a block.
TEST(RandomFeatures, OrthogonalRowsHaveChiNormsAndAreOrthogonalInABlock) {
  const int64_t d = 16, m = 40;  // two full blocks and a truncated one
  std::mt19937_64 rng(9);
  double s = 0;
  int64_t rows = 0;
  for (int n = 0; n < 1500; ++n) {
    const auto W = draw_projection(ProjectionKind::Orthogonal, m, d, rng);
    for (int64_t r = 0; r < m; ++r) {
      double n2 = 0;
      for (int64_t j = 0; j < d; ++j) n2 += W.row(r)[j] * W.row(r)[j];
      s += n2, ++rows;
      if (n == 0)
        for (int64_t r2 = (r / d) * d; r2 < r; ++r2) {
          double c = 0, n2b = 0;
          for (int64_t j = 0; j < d; ++j) c += W.row(r)[j] * W.row(r2)[j];
          for (int64_t j = 0; j < d; ++j) n2b += W.row(r2)[j] * W.row(r2)[j];
          EXPECT_LT(std::abs(c) / std::sqrt(n2 * n2b), 1e-12) << r << " " << r2;
        }
    }
  }
  const double mean = s / rows, se = std::sqrt(2.0 * d / rows);
  EXPECT_LT(std::abs(mean - d), 5 * se) << "mean |w|^2 " << mean;
}

TEST(RandomFeatures, DrawsAreDeterministicAndRedrawPolicyFollowsItsPeriod) {
  const auto a = draw_projection(ProjectionKind::Orthogonal, 12, 5, uint64_t{3});
  const auto b = draw_projection(ProjectionKind::Orthogonal, 12, 5, uint64_t{3});
  EXPECT_EQ(a.w, b.w);
  EXPECT_NE(derive_seed(3, 0), derive_seed(3, 1));
  EXPECT_NE(derive_seed(3, 0), derive_seed(4, 0));

  FeatureSampler fixed(ProjectionKind::Iid, 4, 3, 42, RedrawPolicy::fixed());
  const auto first = fixed.next().w;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(fixed.next().w, first);

  FeatureSampler s1(ProjectionKind::Orthogonal, 6, 3, 42, RedrawPolicy::every(3));
  FeatureSampler s2(ProjectionKind::Orthogonal, 6, 3, 42, RedrawPolicy::every(3));
  std::vector<std::vector<double>> seen;
  for (int i = 0; i < 9; ++i) {
    seen.push_back(s1.next().w);
    EXPECT_EQ(s2.next().w, seen.back());
    EXPECT_EQ(s1.draw_index(), static_cast<uint64_t>(i / 3));
    EXPECT_EQ(seen.back(),
              draw_projection(ProjectionKind::Orthogonal, 6, 3, derive_seed(42, i / 3)).w);
  }
  EXPECT_EQ(seen[0], seen[2]);
  EXPECT_NE(seen[2], seen[3]);
  EXPECT_NE(seen[5], seen[6]);
}

// The stabilised features give the same attention weights as the unstabilised ones: per-token
// constants cancel per row, the key constant is shared by every key.
TEST(RandomFeatures, StabilisersCancelInTheAttentionWeights) {
  std::mt19937_64 rng(2);
  const int64_t T = 9, D = 5, M = 7;
  const auto W = draw_projection(ProjectionKind::Orthogonal, M, D, rng);
  const auto q = test::normal_vec(T * D, rng), k = test::normal_vec(T * D, rng);
  const FeatureDims fd{1, 1, T, D};
  std::vector<double> fq0(T * M), fk0(T * M), fq(T * M), fk(T * M);
  feature_map_forward<double>(fd, q.data(), W, {FeatureSign::Minus, FeatureStabilizer::None, 0},
                              fq0.data());
  feature_map_forward<double>(fd, k.data(), W, {FeatureSign::Minus, FeatureStabilizer::None, 0},
                              fk0.data());
  feature_map_forward<double>(fd, q.data(), W, {FeatureSign::Minus, FeatureStabilizer::PerToken, 0},
                              fq.data());
  feature_map_forward<double>(fd, k.data(), W, {FeatureSign::Minus, FeatureStabilizer::Global, 0},
                              fk.data());
  const std::vector<double> v = test::normal_vec(T * 3, rng);
  const LinearAttentionDims ld{1, 1, T, M, 3};
  const auto a = linear_reference(ld, fq0, fk0, v, true), b = linear_reference(ld, fq, fk, v, true);
  EXPECT_LT(rel_diff(b, a), 1e-13);
  for (int64_t t = 0; t < T; ++t) {  // the query max is 1/sqrt(M) in every row
    double mx = 0;
    for (int64_t r = 0; r < M; ++r) mx = std::max(mx, fq[t * M + r]);
    EXPECT_NEAR(mx, 1 / std::sqrt(double(M)), 1e-15);
  }
  // keys stabilised each by its own max, the constants handed to the kernel (the causal FAVOR+
  // keys; the kernel undoes them with a running max): the unstabilised outputs again, causal and
  // not, with key norms that grow along the sequence (the running max grows inside chunks)
  auto k2 = k;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < D; ++c) k2[t * D + c] *= 0.5 + 0.4 * static_cast<double>(t);
  std::vector<double> fk2(T * M), fk20(T * M), kst(T);
  feature_map_forward<double>(fd, k2.data(), W, {FeatureSign::Minus, FeatureStabilizer::None, 0},
                              fk20.data());
  feature_map_forward<double>(fd, k2.data(), W,
                              {FeatureSign::Minus, FeatureStabilizer::PerToken, 0}, fk2.data(),
                              kst.data());
  for (bool causal : {true, false})
    for (int64_t chunk : {1, 4, 64}) {
      std::vector<double> out(T * 3);
      linear_attention_forward<double>(ld, fq.data(), fk2.data(), v.data(), {causal, chunk},
                                       out.data(), nullptr, kst.data());
      EXPECT_LT(rel_diff(out, linear_reference(ld, fq0, fk20, v, causal)), 1e-13)
          << "causal " << causal << " chunk " << chunk;
    }
}

// Chunked causal and non-causal kernels against the materialised float64 reference on the same
// features, float and double, awkward shapes and chunk sizes.
TEST(LinearAttention, MatchesMaterialisedReference) {
  std::mt19937_64 rng(21);
  struct Shape {
    int64_t B, H, T, D, Dv, M, chunk;
  };
  for (const Shape s :
       {Shape{1, 1, 1, 4, 3, 8, 64}, Shape{2, 3, 37, 8, 5, 16, 64}, Shape{1, 2, 200, 16, 8, 32, 64},
        Shape{2, 1, 131, 6, 6, 12, 16}, Shape{1, 1, 65, 4, 2, 40, 7}}) {
    for (int mode = 0; mode < 4; ++mode) {
      // keys: global max (modes 0, 1), or per token with the constants to the kernel (2, 3)
      const bool causal = mode % 2 == 0, per_key = mode >= 2;
      const FeatureOptions ko{FeatureSign::Minus,
                              per_key ? FeatureStabilizer::PerToken : FeatureStabilizer::Global, 0};
      const auto W = draw_projection(ProjectionKind::Orthogonal, s.M, s.D, rng);
      const auto q = test::normal_vec(s.B * s.H * s.T * s.D, rng);
      const auto k = test::normal_vec(q.size(), rng);
      const auto v = test::normal_vec(s.B * s.H * s.T * s.Dv, rng);
      const FeatureDims fd{s.B, s.H, s.T, s.D};
      const LinearAttentionDims ld{s.B, s.H, s.T, s.M, s.Dv};
      const LinearAttentionOptions lo{causal, s.chunk};
      const auto n = static_cast<size_t>(s.B * s.H * s.T * s.M);
      const auto nt = static_cast<size_t>(s.B * s.H * s.T);
      {  // float64
        std::vector<double> fq(n), fk(n), out(v.size()), kst(nt);
        feature_map_forward<double>(fd, q.data(), W, {}, fq.data());
        feature_map_forward<double>(fd, k.data(), W, ko, fk.data(), kst.data());
        linear_attention_forward<double>(ld, fq.data(), fk.data(), v.data(), lo, out.data(),
                                         nullptr, per_key ? kst.data() : nullptr);
        EXPECT_LT(rel_diff(out, linear_reference(ld, fq, fk, v, causal, per_key ? &kst : nullptr)),
                  1e-12)
            << "T " << s.T << " mode " << mode;
      }
      {  // float32: the reference reads the same fp32 features and values
        const auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v);
        std::vector<float> fq(n), fk(n), out(v.size()), den(nt), kst(nt);
        feature_map_forward<float>(fd, qf.data(), W, {}, fq.data());
        feature_map_forward<float>(fd, kf.data(), W, ko, fk.data(), kst.data());
        linear_attention_forward<float>(ld, fq.data(), fk.data(), vf.data(), lo, out.data(),
                                        den.data(), per_key ? kst.data() : nullptr);
        EXPECT_LT(rel_diff(out, linear_reference(ld, fq, fk, vf, causal, per_key ? &kst : nullptr)),
                  1e-5)
            << "T " << s.T << " mode " << mode;
      }
    }
  }
}

// Later tokens never change earlier outputs, bit for bit: in the kernel on given features (with
// and without key stabilisers), and through the whole FAVOR+ pipeline (q, k -> features with
// their stabilisers -> chunked causal attention), float and double, for chunk sizes that put the
// cut inside a chunk, when the later keys raise the running key max. A global key max would not
// do: the same pipeline with one max over all keys moves earlier outputs in their last bits.
namespace {
template <class T>
void check_pipeline_causal(int64_t chunk, std::mt19937_64& rng) {
  const int64_t B = 2, H = 2, Tn = 150, D = 8, Dv = 4, M = 16, cut = 70;
  const auto W = draw_projection(ProjectionKind::Orthogonal, M, D, rng);
  const auto q = cast<T>(test::normal_vec(B * H * Tn * D, rng)),
             k = cast<T>(test::normal_vec(q.size(), rng)),
             v = cast<T>(test::normal_vec(B * H * Tn * Dv, rng));
  // later keys near w_r / s for the longest row w_r of W: their exponents s w.k - s^2 |k|^2 / 2
  // reach about |w_r|^2 / 2, the bound of every exponent, so the running key max grows past the
  // cut (scaling keys up would not: the -|k|^2 term wins)
  int64_t rmax = 0;
  for (int64_t r = 1; r < M; ++r)
    if (std::inner_product(W.row(r), W.row(r) + D, W.row(r), 0.0) >
        std::inner_product(W.row(rmax), W.row(rmax) + D, W.row(rmax), 0.0))
      rmax = r;
  const double s = std::pow(static_cast<double>(D), 0.25);  // 1 / the default scale
  auto q2 = q, k2 = k, v2 = v;
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = cut; t < Tn; ++t) {
      for (int64_t c = 0; c < D; ++c) {
        q2[(bh * Tn + t) * D + c] = static_cast<T>(test::uniform(rng, -2, 2));
        k2[(bh * Tn + t) * D + c] =
            static_cast<T>(W.row(rmax)[c] * s * test::uniform(rng, 0.9, 1.1));
      }
      for (int64_t c = 0; c < Dv; ++c)
        v2[(bh * Tn + t) * Dv + c] = static_cast<T>(test::uniform(rng, -9, 9));
    }
  const FavorDims fd{B, H, Tn, D, Dv};
  const FavorOptions fo{FeatureSign::Minus, 0.0, true, chunk};
  std::vector<T> o1(v.size()), o2(v.size());
  FavorCache<T> c1, c2;
  favor_attention_forward<T>(fd, q.data(), k.data(), v.data(), W, fo, o1.data(), c1);
  favor_attention_forward<T>(fd, q2.data(), k2.data(), v2.data(), W, fo, o2.data(), c2);
  int64_t grew = 0;  // (batch, head)s whose running key max grew after the cut
  for (int64_t bh = 0; bh < B * H; ++bh) {
    T m1 = c2.kstab[bh * Tn], m2 = m1;
    for (int64_t t = 0; t < cut; ++t) m1 = std::max(m1, c2.kstab[bh * Tn + t]);
    for (int64_t t = 0; t < Tn; ++t) m2 = std::max(m2, c2.kstab[bh * Tn + t]);
    grew += m2 > m1;
    for (int64_t t = 0; t < cut; ++t)
      for (int64_t c = 0; c < Dv; ++c) {
        const size_t i = static_cast<size_t>((bh * Tn + t) * Dv + c);
        ASSERT_EQ(o1[i], o2[i]) << "chunk " << chunk << " bh " << bh << " t " << t;
      }
  }
  EXPECT_EQ(grew, B * H) << "chunk " << chunk;
  EXPECT_GT(rel_diff(o2, o1), 1e-3);  // later outputs did change
  // the backward of the pipeline runs on what the forward kept
  std::vector<T> dq(q.size()), dk(k.size()), dv(v.size());
  favor_attention_backward<T>(fd, q2.data(), k2.data(), v2.data(), W, fo, v.data(), o2.data(), c2,
                              dq.data(), dk.data(), dv.data());
  for (const auto* g : {&dq, &dk, &dv})
    for (T x : *g) ASSERT_TRUE(std::isfinite(x));
  // with one global key max (the non-causal keys) some earlier output moves
  const FeatureDims fm{B, H, Tn, D};
  const LinearAttentionDims ld{B, H, Tn, M, Dv};
  const auto n = static_cast<size_t>(B * H * Tn * M);
  std::vector<T> fq(n), fk(n), g1(v.size()), g2(v.size());
  const FeatureOptions global{FeatureSign::Minus, FeatureStabilizer::Global, 0};
  feature_map_forward<T>(fm, q.data(), W, {}, fq.data());
  feature_map_forward<T>(fm, k.data(), W, global, fk.data());
  linear_attention_forward<T>(ld, fq.data(), fk.data(), v.data(), {true, chunk}, g1.data(),
                              nullptr);
  feature_map_forward<T>(fm, q2.data(), W, {}, fq.data());
  feature_map_forward<T>(fm, k2.data(), W, global, fk.data());
  linear_attention_forward<T>(ld, fq.data(), fk.data(), v2.data(), {true, chunk}, g2.data(),
                              nullptr);
  int64_t moved = 0;
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t t = 0; t < cut; ++t)
      for (int64_t c = 0; c < Dv; ++c) {
        const size_t i = static_cast<size_t>((bh * Tn + t) * Dv + c);
        moved += g1[i] != g2[i];
        EXPECT_NEAR(g1[i], g2[i], (sizeof(T) == 4 ? 1e-5 : 1e-12) * (1 + std::abs(g1[i])));
      }
  EXPECT_GT(moved, 0) << "chunk " << chunk;
}
}  // namespace

TEST(LinearAttention, CausalOutputsIgnoreLaterTokens) {
  std::mt19937_64 rng(4);
  const int64_t B = 2, H = 2, T = 150, Dv = 4, M = 16, cut = 70;
  const LinearAttentionDims ld{B, H, T, M, Dv};
  const auto n = static_cast<size_t>(B * H * T * M);
  for (int64_t chunk : {64, 16, 1})
    for (bool stab : {false, true}) {
      std::vector<float> fq(n), fk(n), v(B * H * T * Dv), kst(B * H * T);
      for (auto& x : fq) x = static_cast<float>(test::uniform(rng, 0, 1));
      for (auto& x : fk) x = static_cast<float>(test::uniform(rng, 0, 1));
      for (auto& x : v) x = static_cast<float>(test::uniform(rng, -1, 1));
      for (auto& x : kst) x = static_cast<float>(test::uniform(rng, -3, 3));
      const float* ks = stab ? kst.data() : nullptr;
      std::vector<float> o1(v.size()), o2(v.size());
      linear_attention_forward<float>(ld, fq.data(), fk.data(), v.data(), {true, chunk}, o1.data(),
                                      nullptr, ks);
      for (int64_t bh = 0; bh < B * H; ++bh)
        for (int64_t t = cut; t < T; ++t) {
          for (int64_t r = 0; r < M; ++r) {
            fq[(bh * T + t) * M + r] = static_cast<float>(test::uniform(rng, 0, 5));
            fk[(bh * T + t) * M + r] = static_cast<float>(test::uniform(rng, 0, 5));
          }
          for (int64_t c = 0; c < Dv; ++c)
            v[(bh * T + t) * Dv + c] = static_cast<float>(test::uniform(rng, -9, 9));
          kst[bh * T + t] = static_cast<float>(test::uniform(rng, 0, 10));  // the max grows
        }
      linear_attention_forward<float>(ld, fq.data(), fk.data(), v.data(), {true, chunk}, o2.data(),
                                      nullptr, ks);
      for (int64_t bh = 0; bh < B * H; ++bh)
        for (int64_t t = 0; t < cut; ++t)
          for (int64_t c = 0; c < Dv; ++c) {
            const size_t i = static_cast<size_t>((bh * T + t) * Dv + c);
            ASSERT_EQ(o1[i], o2[i]) << "chunk " << chunk << " stab " << stab << " t " << t;
          }
      EXPECT_GT(rel_diff(o2, o1), 1e-3);  // later outputs did change
    }
  // the whole pipeline, float and double
  for (int64_t chunk : {64, 16, 1}) {
    check_pipeline_causal<float>(chunk, rng);
    check_pipeline_causal<double>(chunk, rng);
  }
}

// Gradients to q, k, v (through the features and their stabilisers) against central
// differences of <G, out>, float64, causal and not; and the float32 backward against the
// float64 one.
TEST(LinearAttention, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(8);
  const int64_t B = 1, H = 2, T = 21, D = 4, Dv = 3, M = 8;
  const FavorDims fd{B, H, T, D, Dv};
  const auto W = draw_projection(ProjectionKind::Orthogonal, M, D, rng);
  const auto q = test::normal_vec(B * H * T * D, rng), k = test::normal_vec(q.size(), rng),
             v = test::normal_vec(B * H * T * Dv, rng), G = test::normal_vec(v.size(), rng);
  for (bool causal : {true, false}) {
    const FavorOptions fo{FeatureSign::Minus, 0.0, causal, 8};
    const auto loss = [&](const std::vector<double>& qq, const std::vector<double>& kk,
                          const std::vector<double>& vv) {
      std::vector<double> out(vv.size());
      FavorCache<double> c;
      favor_attention_forward<double>(fd, qq.data(), kk.data(), vv.data(), W, fo, out.data(), c);
      return dot(out, G);
    };
    std::vector<double> out(v.size()), dq(q.size()), dk(k.size()), dv(v.size());
    FavorCache<double> cache;
    favor_attention_forward<double>(fd, q.data(), k.data(), v.data(), W, fo, out.data(), cache);
    favor_attention_backward<double>(fd, q.data(), k.data(), v.data(), W, fo, G.data(), out.data(),
                                     cache, dq.data(), dk.data(), dv.data());
    const double eps = 1e-5;
    for (int which = 0; which < 3; ++which) {
      const auto& grad = which == 0 ? dq : which == 1 ? dk : dv;
      // every third coordinate (all tokens, heads and components are still visited)
      std::vector<double> got, fdg;
      for (size_t i = which; i < grad.size(); i += 3) {
        auto qq = q, kk = k, vv = v;
        auto& x = which == 0 ? qq : which == 1 ? kk : vv;
        x[i] += eps;
        const double lp = loss(qq, kk, vv);
        x[i] -= 2 * eps;
        fdg.push_back((lp - loss(qq, kk, vv)) / (2 * eps));
        got.push_back(grad[i]);
      }
      EXPECT_LT(rel_diff(got, fdg), 1e-6) << "causal " << causal << " input " << which;
    }
    // float32 backward vs float64
    const auto qf = cast<float>(q), kf = cast<float>(k), vf = cast<float>(v), Gf = cast<float>(G);
    std::vector<float> outf(v.size()), dqf(q.size()), dkf(k.size()), dvf(v.size());
    FavorCache<float> cf;
    favor_attention_forward<float>(fd, qf.data(), kf.data(), vf.data(), W, fo, outf.data(), cf);
    favor_attention_backward<float>(fd, qf.data(), kf.data(), vf.data(), W, fo, Gf.data(),
                                    outf.data(), cf, dqf.data(), dkf.data(), dvf.data());
    EXPECT_LT(rel_diff(dqf, dq), 1e-4);
    EXPECT_LT(rel_diff(dkf, dk), 1e-4);
    EXPECT_LT(rel_diff(dvf, dv), 1e-4);
  }
}

// Gradients to the feature inputs of the kernel itself, against central differences, on a
// longer sequence with several chunks.
TEST(LinearAttention, FeatureGradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(12);
  const int64_t T = 45, M = 5, Dv = 3;
  const LinearAttentionDims ld{1, 1, T, M, Dv};
  std::vector<double> fq(T * M), fk(T * M);
  for (auto& x : fq) x = test::uniform(rng, 0.1, 1);
  for (auto& x : fk) x = test::uniform(rng, 0.1, 1);
  const auto v = test::normal_vec(T * Dv, rng), G = test::normal_vec(T * Dv, rng);
  // key stabilisers (held constant): a running max that grows inside chunks and across them
  std::vector<double> kst(T);
  for (auto& x : kst) x = test::uniform(rng, -2, 2);
  for (int mode = 0; mode < 4; ++mode) {
    const bool causal = mode % 2 == 0;
    const double* ks = mode >= 2 ? kst.data() : nullptr;
    const LinearAttentionOptions lo{causal, 8};
    const auto loss = [&](const std::vector<double>& a, const std::vector<double>& b,
                          const std::vector<double>& vv) {
      std::vector<double> out(vv.size());
      linear_attention_forward<double>(ld, a.data(), b.data(), vv.data(), lo, out.data(), nullptr,
                                       ks);
      return dot(out, G);
    };
    std::vector<double> out(v.size()), den(T), da(fq.size()), db(fk.size()), dv(v.size());
    linear_attention_forward<double>(ld, fq.data(), fk.data(), v.data(), lo, out.data(), den.data(),
                                     ks);
    linear_attention_backward<double>(ld, fq.data(), fk.data(), v.data(), lo, G.data(), out.data(),
                                      den.data(), da.data(), db.data(), dv.data(), ks);
    const double eps = 1e-6;
    for (int which = 0; which < 3; ++which) {
      const auto& grad = which == 0 ? da : which == 1 ? db : dv;
      std::vector<double> fdg(grad.size());
      for (size_t i = 0; i < grad.size(); ++i) {
        auto a = fq, b = fk, vv = v;
        auto& x = which == 0 ? a : which == 1 ? b : vv;
        x[i] += eps;
        const double lp = loss(a, b, vv);
        x[i] -= 2 * eps;
        fdg[i] = (lp - loss(a, b, vv)) / (2 * eps);
      }
      EXPECT_LT(rel_diff(grad, fdg), 1e-6) << "mode " << mode << " input " << which;
    }
  }
}

// The FAVOR+ output approaches exact softmax attention as m grows (error ~ 1/sqrt(m)).
TEST(LinearAttention, ErrorAgainstSoftmaxDecreasesWithM) {
  const int64_t B = 1, H = 2, T = 48, D = 16;
  std::mt19937_64 rng(30);
  // |q|, |k| ~ 2 after the D^(-1/4) scaling ~ 1: the estimator's relative variance per
  // feature is about exp(|q' + k'|^2) - 1
  const auto q = test::normal_vec(B * H * T * D, rng, 0.5),
             k = test::normal_vec(q.size(), rng, 0.5), v = test::normal_vec(q.size(), rng);
  std::vector<double> exact(q.size());
  AttentionOptions ao;
  ao.causal = true;
  attention_reference(AttentionDims{B, H, H, T, T, D}, q.data(), k.data(), v.data(), {}, {}, ao,
                      exact.data(), nullptr);
  std::vector<double> errs;
  for (int64_t m : {8, 32, 128, 512, 2048}) {
    double e = 0;
    const int seeds = 6;
    for (int s = 0; s < seeds; ++s) {
      const auto W = draw_projection(ProjectionKind::Orthogonal, m, D, uint64_t(1000 + s));
      std::vector<double> out(q.size());
      FavorCache<double> cache;
      favor_attention_forward<double>(FavorDims{B, H, T, D, D}, q.data(), k.data(), v.data(), W, {},
                                      out.data(), cache);
      e += rel_diff(out, exact) / seeds;
    }
    errs.push_back(e);
  }
  for (size_t i = 1; i < errs.size(); ++i) EXPECT_LT(errs[i], errs[i - 1]) << "step " << i;
  EXPECT_LT(errs.back(), 0.25 * errs.front());  // 1/sqrt(m) would give 1/16
  EXPECT_LT(errs.back(), 0.1) << errs.front() << " " << errs.back();
}

TEST(LinearAttention, BadInputThrowsInputError) {
  std::mt19937_64 rng(1);
  EXPECT_THROW(draw_projection(ProjectionKind::Iid, 0, 4, rng), InputError);
  EXPECT_THROW(draw_projection(ProjectionKind::Orthogonal, 4, 0, rng), InputError);
  EXPECT_THROW(RedrawPolicy::every(0), InputError);
  const auto W = draw_projection(ProjectionKind::Orthogonal, 8, 4, rng);
  const int64_t T = 5;
  auto q = test::normal_vec(T * 4, rng);
  const auto k = test::normal_vec(T * 4, rng), v = test::normal_vec(T * 4, rng);
  std::vector<double> out(T * 4);
  FavorCache<double> cache;
  // mismatched head dimension
  EXPECT_THROW(favor_attention_forward<double>(FavorDims{1, 1, T, 3, 4}, q.data(), k.data(),
                                               v.data(), W, {}, out.data(), cache),
               InputError);
  // m = 0 projection
  Projection empty;
  empty.d = 4;
  EXPECT_THROW(favor_attention_forward<double>(FavorDims{1, 1, T, 4, 4}, q.data(), k.data(),
                                               v.data(), empty, {}, out.data(), cache),
               InputError);
  // NaN
  q[7] = std::nan("");
  EXPECT_THROW(favor_attention_forward<double>(FavorDims{1, 1, T, 4, 4}, q.data(), k.data(),
                                               v.data(), W, {}, out.data(), cache),
               InputError);
  // linear attention: M = 0, chunk 0, negative features, T = 0
  std::vector<double> f(T * 8, 0.5);
  EXPECT_THROW(linear_attention_forward<double>({1, 1, T, 0, 4}, f.data(), f.data(), v.data(), {},
                                                out.data(), nullptr),
               InputError);
  EXPECT_THROW(linear_attention_forward<double>({1, 1, T, 8, 4}, f.data(), f.data(), v.data(),
                                                {true, 0}, out.data(), nullptr),
               InputError);
  EXPECT_THROW(linear_attention_forward<double>({1, 1, 0, 8, 4}, f.data(), f.data(), v.data(), {},
                                                out.data(), nullptr),
               InputError);
  // non-finite key stabilisers
  std::vector<double> kst(T, 0.0);
  kst[2] = std::nan("");
  EXPECT_THROW(linear_attention_forward<double>({1, 1, T, 8, 4}, f.data(), f.data(), v.data(), {},
                                                out.data(), nullptr, kst.data()),
               InputError);
  auto g = f;
  g[3] = -1;
  EXPECT_THROW(linear_attention_forward<double>({1, 1, T, 8, 4}, g.data(), f.data(), v.data(), {},
                                                out.data(), nullptr),
               InputError);
}

// ------------------------------------------------------------------ rotations before the features
// The features compose with rotations applied to q and k first (RoPE, interleaved pairs
// (x_2u, x_2u+1) turned by p theta_u at position p, theta_u = 10000^(-2u/D)): over independent
// draws, the mean of phi(R_i q) . phi(R_j k) estimates exp((R_i q) . (R_j k)) = exp(q . R(j - i)
// k), a function of j - i only, so the random features keep the relative law in expectation.
// Through the stabilised map (the per-token constants undone), scale 1, iid and orthogonal draws,
// within 5 standard errors of the sample mean; pairs with one offset at far apart positions agree
// with each other, and the estimate tells offsets apart.
namespace {

std::vector<double> rope(const std::vector<double>& x, double p) {
  const size_t D = x.size();
  std::vector<double> y(x);
  for (size_t u = 0; u < D / 2; ++u) {
    const double th = p * std::pow(10000.0, -2.0 * static_cast<double>(u) / static_cast<double>(D));
    const double c = std::cos(th), s = std::sin(th);
    y[2 * u] = c * x[2 * u] - s * x[2 * u + 1];
    y[2 * u + 1] = s * x[2 * u] + c * x[2 * u + 1];
  }
  return y;
}

// Mean and standard error over `draws` draws of m = D features of phi(x) . phi(y), from one
// stabilised feature-map call on a projection of draws * D rows (independent blocks).
Moments rotated_estimate(ProjectionKind kind, const std::vector<double>& x,
                         const std::vector<double>& y, int64_t draws, uint64_t seed) {
  const auto D = static_cast<int64_t>(x.size());
  const auto W = draw_projection(kind, draws * D, D, seed);
  std::vector<double> xy(x);
  xy.insert(xy.end(), y.begin(), y.end());
  std::vector<double> phi(static_cast<size_t>(2 * W.m)), st(2);
  feature_map_forward<double>(FeatureDims{1, 1, 2, D}, xy.data(), W,
                              FeatureOptions{FeatureSign::Minus, FeatureStabilizer::PerToken, 1.0},
                              phi.data(), st.data());
  // undo both tokens' constants, and divide by sqrt(D) per draw rather than sqrt(W.m)
  const double undo = std::exp(st[0] + st[1]) * static_cast<double>(W.m) / static_cast<double>(D);
  double s = 0, s2 = 0;
  for (int64_t n = 0; n < draws; ++n) {
    double e = 0;
    for (int64_t r = n * D; r < (n + 1) * D; ++r) e += phi[r] * phi[W.m + r];
    e *= undo;
    s += e, s2 += e * e;
  }
  const auto N = static_cast<double>(draws);
  Moments m;
  m.mean = s / N;
  m.se = std::sqrt((s2 / N - m.mean * m.mean) / (N - 1.0));
  return m;
}

}  // namespace

TEST(RandomFeatures, RotatedQueriesAndKeysKeepTheRelativeLawInExpectation) {
  std::mt19937_64 rng(17);
  const int64_t D = 8, draws = 20000;
  const auto q = scaled_normal(D, rng, 0.8), k = scaled_normal(D, rng, 0.8);
  struct Pos {
    double i, j;
  };
  // offsets 5 (three times, far apart), -5, 17 and 0
  const std::vector<Pos> pos{{0, 5}, {100, 105}, {3000, 3005}, {7, 2}, {40, 57}, {9, 9}};
  for (auto kind : {ProjectionKind::Iid, ProjectionKind::Orthogonal}) {
    std::vector<Moments> est;
    for (size_t p = 0; p < pos.size(); ++p) {
      const auto qi = rope(q, pos[p].i), kj = rope(k, pos[p].j);
      const double rel = dot(q, rope(k, pos[p].j - pos[p].i));
      EXPECT_NEAR(dot(qi, kj), rel, 1e-12) << "pair " << p;  // the relative law itself
      const auto e =
          rotated_estimate(kind, qi, kj, draws, 500 + p + 50 * (kind == ProjectionKind::Iid));
      EXPECT_LT(std::abs(e.mean - std::exp(rel)), 5 * e.se)
          << "pair " << p << " mean " << e.mean << " exact " << std::exp(rel) << " se " << e.se;
      EXPECT_LT(e.se, 0.01 * std::exp(rel)) << "pair " << p;  // a test with teeth
      est.push_back(e);
    }
    for (size_t p : {1, 2})  // the same offset, absolute positions 100 and 3000 apart
      EXPECT_LT(std::abs(est[p].mean - est[0].mean), 5 * std::hypot(est[p].se, est[0].se))
          << "pair " << p;
    // different offsets give estimates of different values (here by many standard errors)
    for (size_t p : {3, 4, 5}) {
      const double exact0 = std::exp(dot(q, rope(k, 5)));
      EXPECT_GT(std::abs(est[p].mean - exact0), 10 * est[p].se) << "pair " << p;
    }
  }
}
