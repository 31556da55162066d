// The float64 references (core/reference.hpp) against the papers' algebra: Proposition 1
// (A(i)^{-1} A(j) = G(i-j) for exact mechanisms), the group law, the contragredient identity, the
// closed-form score, the conventions of spec 1.3 (keys e^{+gamma p} R(-omega p) U(-p)), and the
// failure of the relative law for the approximate mechanisms.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/charts.hpp"
#include "core/reference.hpp"
#include "core/registry.hpp"
#include "test_util.hpp"

using namespace relpos;
using relpos::test::rel_err;

namespace {

struct Case {
  std::string spec;
  int head_dim;
};

// Exact transforms (group law holds), with head dims that fit.
std::vector<Case> exact_cases() {
  std::vector<Case> c = {{"rope", 16},
                         {"rope(theta=500)", 12},
                         {"damped_rope(m=1)", 12},
                         {"damped_rope", 16},
                         {"real_jordan(regime=raw)", 8},
                         {"direct_sum(regime=raw)", 16},
                         {"jordan(m=2, regime=raw, zero_omega=true)", 8},
                         {"jordan(m=3, regime=scaled, c=0.5, eta0=0.1, eta_max=1)", 12},
                         {"jordan(m=4, regime=scaled, L=16, eta_max=1)", 16},
                         {"jordan(m=2, regime=raw, grid=span)", 16}};
  for (int m = 1; m <= 5; ++m) {
    c.push_back({"jordan(m=" + std::to_string(m) + ", regime=raw)", 4 * m});
    c.push_back({"jordan(m=" + std::to_string(m) + ", regime=scaled)", 6 * m});
  }
  return c;
}

ParamValues draw(const Mechanism& m, std::mt19937_64& rng) {
  return random_params(m, rng);
}

std::vector<double> random_positions(std::mt19937_64& rng, int n, double lo, double hi) {
  std::vector<double> p;
  for (int i = 0; i < n; ++i) {
    double x = test::uniform(rng, lo, hi);
    if (i % 2) x = std::round(x);  // integers and reals
    p.push_back(x);
  }
  return p;
}

const Layout kLayouts[] = {Layout::Interleaved, Layout::HalfSplit};

}  // namespace

TEST(Reference, ExactMechanismsSatisfyTheRelativeLaw) {
  std::mt19937_64 rng(11);
  for (const auto& c : exact_cases())
    for (const Layout layout : kLayouts) {
      SCOPED_TRACE(c.spec + " " + test::layout_name(layout));
      const Mechanism m = build_mechanism(c.spec, c.head_dim, 2);
      ASSERT_TRUE(m.transform_exact());
      const ParamValues p = draw(m, rng);
      const auto pos = random_positions(rng, 6, -40.0, 60.0);
      double worst = 0;
      for (int h = 0; h < m.heads; ++h)
        for (double i : pos)
          for (double j : pos) {
            const Eigen::MatrixXd lhs = reference::key_map(m, p, h, i, layout).inverse() *
                                        reference::key_map(m, p, h, j, layout);
            worst =
                std::max(worst, rel_err(lhs, reference::relative_operator(m, p, h, i - j, layout)));
          }
      EXPECT_LT(worst, 1e-12);
    }
}

TEST(Reference, ExactMechanismsSatisfyTheGroupLaw) {
  std::mt19937_64 rng(12);
  for (const auto& c : exact_cases())
    for (const Layout layout : kLayouts) {
      SCOPED_TRACE(c.spec + " " + test::layout_name(layout));
      const Mechanism m = build_mechanism(c.spec, c.head_dim, 2);
      const ParamValues p = draw(m, rng);
      double worst = 0;
      for (int n = 0; n < 8; ++n) {
        const double a = test::uniform(rng, -70, 70), b = test::uniform(rng, -70, 70);
        const int h = n % m.heads;
        const Eigen::MatrixXd prod = reference::relative_operator(m, p, h, a, layout) *
                                     reference::relative_operator(m, p, h, b, layout);
        worst =
            std::max(worst, rel_err(prod, reference::relative_operator(m, p, h, a + b, layout)));
      }
      EXPECT_LT(worst, 1e-12);
      // G(0) = I
      EXPECT_LT(rel_err(reference::relative_operator(m, p, 0, 0.0, layout),
                        Eigen::MatrixXd::Identity(m.head_dim, m.head_dim)),
                1e-15);
    }
}

TEST(Reference, StabilizedChartBreaksTheGroupLaw) {
  std::mt19937_64 rng(13);
  const Mechanism m = build_mechanism("jordan(m=2, regime=stabilized, L=64)", 8, 1);
  ParamValues p = draw(m, rng);
  for (auto& e : p.eta) e = 0.08;
  const Eigen::MatrixXd prod = reference::relative_operator(m, p, 0, 50, Layout::Interleaved) *
                               reference::relative_operator(m, p, 0, 70, Layout::Interleaved);
  EXPECT_GT(rel_err(prod, reference::relative_operator(m, p, 0, 120, Layout::Interleaved)), 1e-3);
}

TEST(Reference, QueryMapIsTheInverseTranspose) {
  std::mt19937_64 rng(14);
  std::vector<Case> cases = exact_cases();
  cases.push_back({"jordan(m=3, regime=stabilized)", 12});
  cases.push_back({"jetmixfull(m=4, alpha=1/0.5/0.3/0.2)", 16});
  cases.push_back({"jetmix(m=3, gates=0.1/0.05)", 12});
  for (const auto& c : cases)
    for (const Layout layout : kLayouts) {
      SCOPED_TRACE(c.spec + " " + test::layout_name(layout));
      const Mechanism m = build_mechanism(c.spec, c.head_dim, 2);
      const ParamValues p = draw(m, rng);
      const Eigen::MatrixXd I = Eigen::MatrixXd::Identity(m.head_dim, m.head_dim);
      for (double pos : random_positions(rng, 5, -50, 50)) {
        const Eigen::MatrixXd K = reference::key_map(m, p, 1, pos, layout);
        const Eigen::MatrixXd Q = reference::query_map(m, p, 1, pos, layout);
        EXPECT_LT((Q.transpose() * K - I).norm(), 1e-12) << "pos " << pos;
        EXPECT_LT((K * Q.transpose() - I).norm(), 1e-12) << "pos " << pos;
      }
    }
}

TEST(Reference, RelativeScoreIsQTransposeGK) {
  std::mt19937_64 rng(15);
  std::vector<Case> cases = exact_cases();
  cases.push_back({"jordan(m=3, regime=stabilized)", 12});
  cases.push_back({"jetmixfull(m=4, alpha=1/0.5/0.3/0.2)", 16});
  cases.push_back({"nope", 8});
  cases.push_back({"rope + alibi", 8});
  for (const auto& c : cases)
    for (const Layout layout : kLayouts) {
      SCOPED_TRACE(c.spec + " " + test::layout_name(layout));
      const Mechanism m = build_mechanism(c.spec, c.head_dim, 2);
      const ParamValues p = draw(m, rng);
      for (int n = 0; n < 6; ++n) {
        const double d = test::uniform(rng, -30, 90);
        const int h = n % 2;
        const auto q = test::normal_vec(m.head_dim, rng), k = test::normal_vec(m.head_dim, rng);
        const Eigen::Map<const Eigen::VectorXd> qv(q.data(), m.head_dim), kv(k.data(), m.head_dim);
        const Eigen::MatrixXd G = reference::relative_operator(m, p, h, d, layout);
        const double want = qv.dot(G * kv);
        const double got = reference::relative_score(m, p, h, d, q.data(), k.data(), layout);
        EXPECT_NEAR(got, want, 1e-12 * (qv.norm() * (G * kv).norm() + 1.0)) << "d " << d;
      }
    }
}

// Spec 1.3: keys get k~ = e^{+gamma p} R(-omega p) (x) U(-p) k with U(-p) = sum_r (eta s
// sigma(-p))^r / r! N^r, the upper shift N moving slot r+1 into slot r; complex coordinate b*m + r
// is (2(bm+r), 2(bm+r)+1) interleaved and (bm+r, bm+r+D/2) half-split.
TEST(Reference, KeyMapFollowsTheReferenceConvention) {
  const int m_order = 3, D = 12;
  const Mechanism m = build_mechanism("jordan(m=3, regime=raw)", D, 1);
  ParamValues p = default_params(m);
  p.gamma = {0.01, 0.02};
  p.eta = {0.05, -0.07};
  const double pos = 5.5;
  for (const Layout layout : kLayouts) {
    SCOPED_TRACE(test::layout_name(layout));
    Eigen::MatrixXd want = Eigen::MatrixXd::Zero(D, D);
    for (int b = 0; b < 2; ++b) {
      const double w = m.segments()[0].omega[b], g = p.gamma[b], e = p.eta[b];
      const double x = e * (-pos);  // eta * s * sigma(t), t = -p
      const double coef[3] = {1.0, x, x * x / 2};
      const double cs = std::cos(-w * pos), sn = std::sin(-w * pos);
      for (int r = 0; r < m_order; ++r)
        for (int c = r; c < m_order; ++c) {
          const int jr = b * m_order + r, jc = b * m_order + c;
          const double a = std::exp(g * pos) * coef[c - r];
          const auto I = [&](int j, int comp) { return reference::real_index(layout, D, j, comp); };
          want(I(jr, 0), I(jc, 0)) = a * cs;
          want(I(jr, 0), I(jc, 1)) = -a * sn;
          want(I(jr, 1), I(jc, 0)) = a * sn;
          want(I(jr, 1), I(jc, 1)) = a * cs;
        }
    }
    EXPECT_LT(rel_err(reference::key_map(m, p, 0, pos, layout), want), 1e-13);
    // and the relative operator is e^{-gamma d} R(omega d) (x) exp(eta d N) (paper 3.3)
    const double d = 4.0;
    const Eigen::MatrixXd G = reference::relative_operator(m, p, 0, d, layout);
    const int j01 = reference::real_index(layout, D, 1, 0),
              j00 = reference::real_index(layout, D, 0, 0);
    const int j02 = reference::real_index(layout, D, 2, 0);
    const double w0 = m.segments()[0].omega[0];
    EXPECT_NEAR(G(j00, j01), std::exp(-0.01 * d) * 0.05 * d * std::cos(w0 * d), 1e-15);
    EXPECT_NEAR(G(j00, j02), std::exp(-0.01 * d) * 0.05 * 0.05 * d * d / 2 * std::cos(w0 * d),
                1e-15);
    EXPECT_EQ(G(j01, j00), 0.0);  // upper triangular in the slots
  }
}

TEST(Reference, LayoutsArePermutationsOfEachOther) {
  std::mt19937_64 rng(16);
  const int D = 24;
  const Mechanism m = build_mechanism("jordan(m=3, regime=raw)", D, 1);
  const ParamValues p = draw(m, rng);
  Eigen::MatrixXd P = Eigen::MatrixXd::Zero(D, D);  // interleaved index -> half-split index
  for (int j = 0; j < D / 2; ++j)
    for (int c = 0; c < 2; ++c)
      P(reference::real_index(Layout::HalfSplit, D, j, c),
        reference::real_index(Layout::Interleaved, D, j, c)) = 1;
  const Eigen::MatrixXd Ai = reference::key_map(m, p, 0, 9.0, Layout::Interleaved);
  const Eigen::MatrixXd Ah = reference::key_map(m, p, 0, 9.0, Layout::HalfSplit);
  EXPECT_LT(rel_err(Ah, P * Ai * P.transpose()), 1e-15);
  EXPECT_GT(rel_err(Ah, Ai), 0.1);  // really different matrices
}

TEST(Reference, ApproximateMechanismsBreakTheRelativeLawUnlessTheShearIsZero) {
  std::mt19937_64 rng(17);
  const std::vector<Case> cases = {{"jordan(m=2, regime=stabilized)", 8},
                                   {"jordan(m=3, regime=stabilized)", 12},
                                   {"real_jordan", 8},
                                   {"direct_sum", 16},
                                   {"jetmix(m=3, gates=0.1/0.05)", 12},
                                   {"jetmixfull(m=4, alpha=1/0.5/0.3/0.2)", 16},
                                   {"jetspec(m=3, alpha=0.7/0.2/0.1)", 12},
                                   {"jetmix(m=3, regime=scaled, gates=0.1/0.05)", 12}};
  const double i = 3000, j = 1000;
  for (const auto& c : cases)
    for (const Layout layout : kLayouts) {
      SCOPED_TRACE(c.spec + " " + test::layout_name(layout));
      const Mechanism m = build_mechanism(c.spec, c.head_dim, 2);
      EXPECT_FALSE(m.transform_exact());
      ParamValues p = draw(m, rng);
      const auto err = [&](const ParamValues& pv) {
        double e = 0;
        for (int h = 0; h < m.heads; ++h) {
          const Eigen::MatrixXd lhs = reference::key_map(m, pv, h, i, layout).inverse() *
                                      reference::key_map(m, pv, h, j, layout);
          e = std::max(e, rel_err(lhs, reference::relative_operator(m, pv, h, i - j, layout)));
        }
        return e;
      };
      EXPECT_GT(err(p), 1e-6);
      for (auto& e : p.eta) e = 0;  // no nilpotent part: a damped rotation, exact
      for (auto& g : p.gates) g = 0;
      EXPECT_LT(err(p), 1e-10);
    }
}

TEST(Reference, AlibiLiftIsAPositionWiseFactorisation) {
  for (const double slope : alibi_slopes(6))
    for (const double i : {0.0, 3.0, 17.5, 4096.0})
      for (const double j : {0.0, 1.0, 17.5, 300.25}) {
        const auto l = reference::alibi_lift(slope, i, j);
        EXPECT_NEAR(l.q.dot(l.k), -slope * (i - j), 1e-12 * (1 + std::abs(i - j)));
        // the lifted query depends on i only and the lifted key on j only
        const auto other = reference::alibi_lift(slope, i, j + 5.0);
        EXPECT_EQ(other.q, l.q);
        const auto other2 = reference::alibi_lift(slope, i + 5.0, j);
        EXPECT_EQ(other2.k, l.k);
        EXPECT_NEAR(other2.q.dot(other2.k), -slope * (i + 5.0 - j), 1e-12 * (6 + std::abs(i - j)));
      }
}

// xPos (Sun et al. 2023; torchscale XPOS) by hand in float64: uncentred, the query at n is
// zeta_b^{n/S} R(n w_b) q_b and the key at m zeta_b^{-m/S} R(m w_b) k_b per pair b, with
// zeta_b = (2b/D + zeta0)/(1 + zeta0) and w_b = theta^(-2b/D); so each pair's score is the rotated
// dot product times zeta_b^{(n-m)/S}, which the centred default keeps.
TEST(Reference, XposIsRopeScaledByZetaToTheLagOverScaleBase) {
  const int D = 16;
  const double theta = 500.0, zeta0 = 0.4, S = 512.0;
  std::mt19937_64 rng(24);
  const auto rotate = [](double a, double x, double y) {
    return std::pair{std::cos(a) * x - std::sin(a) * y, std::sin(a) * x + std::cos(a) * y};
  };
  for (const std::string center : {"none", "auto"}) {
    SCOPED_TRACE(center);
    const Mechanism m =
        build_mechanism("xpos(theta=500, zeta0=0.4, scale_base=512, center=" + center + ")", D, 1);
    const ParamValues p = default_params(m);
    const double c0 = m.window_center(0, 1000);
    for (const auto& [n, mm] : {std::pair{700.0, 3.0}, {5.0, 5.0}, {40.5, 900.0}, {1000.0, 0.0}}) {
      const auto q = test::normal_vec(D, rng), k = test::normal_vec(D, rng);
      const Eigen::Map<const Eigen::VectorXd> qv(q.data(), D), kv(k.data(), D);
      const Eigen::VectorXd qt = reference::query_map(m, p, 0, n - c0, Layout::Interleaved) * qv;
      const Eigen::VectorXd kt = reference::key_map(m, p, 0, mm - c0, Layout::Interleaved) * kv;
      for (int b = 0; b < D / 2; ++b) {
        const double zeta = (2.0 * b / D + zeta0) / (1.0 + zeta0);
        const double w = std::pow(theta, -2.0 * b / D);
        const auto [q0, q1] = rotate(n * w, q[2 * b], q[2 * b + 1]);
        const auto [k0, k1] = rotate(mm * w, k[2 * b], k[2 * b + 1]);
        const double want = (q0 * k0 + q1 * k1) * std::pow(zeta, (n - mm) / S);
        const double got = qt[2 * b] * kt[2 * b] + qt[2 * b + 1] * kt[2 * b + 1];
        EXPECT_NEAR(got, want, 1e-12 * (1 + std::abs(want))) << "pair " << b << " n " << n;
        if (center == "none") {  // the transformed vectors themselves are torchscale's
          EXPECT_NEAR(qt[2 * b], std::pow(zeta, n / S) * q0, 1e-12 * (1 + std::abs(q0)));
          EXPECT_NEAR(kt[2 * b + 1], std::pow(zeta, -mm / S) * k1, 1e-12 * (1 + std::abs(k1)));
        }
      }
    }
  }
  // one segment per pair has no frequency grid: grid-defined context extension is refused, not
  // applied to every pair as grid entry 0
  EXPECT_THROW(build_mechanism("xpos + yarn(factor=4, original=64)", D, 1), InputError);
}
