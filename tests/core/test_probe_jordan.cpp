// Jordan-RoPE basis probes: feature dictionaries (spec jordan-rope.md 1.9), solvers, and the
// float64 agreement of Tables 3, 4, 11, 6 and 16 with the spec's re-derivation (section 6.2).
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/charts.hpp"
#include "core/jet_features.hpp"
#include "core/mechanism.hpp"
#include "core/registry.hpp"
#include "core/types.hpp"
#include "probes/features.hpp"
#include "probes/solvers.hpp"
#include "probes/suites.hpp"
#include "probes/targets.hpp"

namespace relpos::probes {
namespace {

TEST(ProbeJordanFeatures, ColumnCounts) {
  const JordanGrid g;
  const auto n = [&](const std::string& m) { return jordan_dictionary(m, g).columns.size(); };
  EXPECT_EQ(n("nope"), 1u);
  EXPECT_EQ(n("rope"), 33u);
  EXPECT_EQ(n("rope_matched_m3"), 11u);  // F // 3 = 5 frequencies
  EXPECT_EQ(n("rope_matched_m32"), 3u);  // max(1, F // M)
  EXPECT_EQ(n("alibi"), 2u);
  EXPECT_EQ(n("rope_alibi"), 34u);
  EXPECT_EQ(n("damped_rope"), 33u);
  EXPECT_EQ(n("real_jordan"), 3u);
  EXPECT_EQ(n("direct_sum"), 36u);
  EXPECT_EQ(n("direct_sum_poly_m4"), 36u);
  EXPECT_EQ(n("direct_sum_poly"), 36u);
  EXPECT_EQ(n("jordan_rope"), 65u);
  EXPECT_EQ(n("jordan_m4"), 129u);
  EXPECT_EQ(n("jordan_scaled_m3_c010"), 97u);
  EXPECT_THROW(jordan_dictionary("jordan_bogus", g), InputError);
  try {
    jordan_dictionary("fourier", g);
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("fourier"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("jordan_scaled_mM_cCCC"), std::string::npos);
  }
}

TEST(ProbeJordanFeatures, ColumnValuesAndAliases) {
  const JordanGrid g;
  const auto lags = lag_range(3000);
  const double L = g.L, d = 2500.0, w5 = std::pow(1e4, -10.0 / 64), tau_n = d / (1 + d / L) / L;
  const auto Xs = build_matrix(jordan_dictionary("jordan_m3", g), lags);
  // r = 2 block starts after intercept + 2 * 32 columns; sin block of r = 2 after its 16 cos
  EXPECT_NEAR(Xs(2500, 1 + 64 + 16 + 5), tau_n * tau_n / 2 * std::exp(-1e-4 * d) * std::sin(w5 * d),
              1e-14);
  const auto Xp = build_matrix(jordan_dictionary("direct_sum_poly_m4", g), lags);
  EXPECT_NEAR(Xp(2500, 35), tau_n * tau_n * tau_n, 1e-14);  // no factorial, no damping
  const auto Xd = build_matrix(jordan_dictionary("direct_sum", g), lags);
  EXPECT_NEAR(Xd(2500, 33), d / L, 1e-15);
  EXPECT_NEAR(Xd(2500, 35), tau_n * std::exp(-1e-4 * d), 1e-15);
  // jordan_exact_c010 == jordan_scaled_m2_c010; raw differs only by gamma
  const auto Xe = build_matrix(jordan_dictionary("jordan_exact_c010", g), lags);
  const auto Xsc = build_matrix(jordan_dictionary("jordan_scaled_m2_c010", g), lags);
  EXPECT_LT((Xe - Xsc).cwiseAbs().maxCoeff(), 1e-15);
  const auto Xr = build_matrix(jordan_dictionary("jordan_raw_tau", g), lags);
  EXPECT_NEAR(Xr(2500, 1 + 32), d / L * std::exp(-1e-4 * d) * std::cos(d), 1e-12);  // omega_0 = 1
  const auto Xng = build_matrix(jordan_dictionary("jordan_no_gamma", g), lags);
  EXPECT_NEAR(Xng(2500, 1 + 32), tau_n * std::cos(d), 1e-12);  // bounded, gamma 0
  const auto Xx = build_matrix(jordan_dictionary("jordan_exact_scaled", g), lags);
  EXPECT_NEAR(Xx(2500, 1), std::exp(-d / L) * std::cos(d), 1e-12);  // c = 1 default
}

// The probe features and the mechanisms' lag features are the same formula: an order-2 raw
// Jordan block with unit eta has lag features e^{-gamma d} (s d)^r / r! (cos, sin)(omega d).
TEST(ProbeJordanFeatures, JetFeatureMatchesMechanismLagFeatures) {
  const Mechanism m = build_mechanism("jordan_raw_tau", 16, 1);
  ParamValues p = default_params(m);
  for (auto& e : p.eta) e = 1.0;
  ASSERT_FALSE(m.segments().empty());
  const auto& s = m.segments().front();
  for (const double d : {0.0, 3.0, 700.0, 5000.0}) {
    const auto feats = lag_features(m, p, 0, d);
    ASSERT_EQ(feats.size(), static_cast<size_t>(2 * s.blocks * s.order));
    for (int b = 0; b < s.blocks; ++b)
      for (int r = 0; r < s.order; ++r) {
        JetChart c;
        c.chart = s.chart;
        c.L = s.L;
        c.shear_scale = s.shear_scale;
        c.gamma = p.gamma[static_cast<size_t>(b)];
        const JetValue v = jet_feature(c, s.omega[static_cast<size_t>(b)], r, d);
        const size_t k = static_cast<size_t>(2 * (b * s.order + r));
        EXPECT_NEAR(feats[k].value, v.re, 1e-12 * (1 + std::abs(v.re)));
        EXPECT_NEAR(feats[k + 1].value, v.im, 1e-12 * (1 + std::abs(v.im)));
      }
  }
}

TEST(ProbeJordanTargets, Definitions) {
  JordanTargetParams tp;
  tp.omega = 0.4216965;
  tp.omega2 = 0.2371374;
  EXPECT_DOUBLE_EQ(jordan_target("linear", 512, tp), -0.5);
  EXPECT_NEAR(jordan_target("mixed", 2048, tp), 2 * std::cos(tp.omega * 2048), 1e-15);
  EXPECT_NEAR(jordan_target("scaled_high_jet_r3", 2048, tp),
              8 * std::exp(-0.2) * std::cos(tp.omega * 2048), 1e-13);
  EXPECT_NEAR(jordan_target("motif_spacing", 1024, tp),
              1 / 1.25 * (0.7 * std::cos(tp.omega2 * 1024) - 0.3 * std::sin(tp.omega2 * 1024)),
              1e-15);
  EXPECT_THROW(jordan_target("quadratic", 1, tp), InputError);
}

TEST(ProbeSolvers, RidgeMatchesClosedFormAndF32IsClose) {
  Eigen::MatrixXd X(50, 3);
  Eigen::VectorXd y(50);
  for (int i = 0; i < 50; ++i) {
    X.row(i) << 1.0, i / 50.0, std::cos(0.3 * i);
    y(i) = 0.5 - 2.0 * i / 50.0 + 0.25 * std::cos(0.3 * i);
  }
  const auto f = ridge_fit<double>(X, y, 1e-4);
  Eigen::MatrixXd A = X.transpose() * X + 1e-4 * Eigen::MatrixXd::Identity(3, 3);
  const Eigen::VectorXd w = A.inverse() * (X.transpose() * y);
  EXPECT_LT((f.w - w).cwiseAbs().maxCoeff(), 1e-10);
  EXPECT_GT(f.cond, 1.0);
  const auto f32 = ridge_fit<float>(X.cast<float>(), y.cast<float>(), 1e-4);
  EXPECT_LT((f32.w.cast<double>() - w).cwiseAbs().maxCoeff(), 1e-3);
  const Scores s = jordan_scores<double>(X * f.w, y);
  EXPECT_LT(s.mse, 1e-6);
  EXPECT_GT(s.r2, 0.999);
}

TEST(ProbeFormat, PrintedDigits) {
  EXPECT_TRUE(matches_printed(51.7449, "51.74"));
  EXPECT_FALSE(matches_printed(51.7451, "51.74"));
  EXPECT_TRUE(matches_printed(2.24e-6, "2.2e-6"));
  EXPECT_FALSE(matches_printed(2.26e-6, "2.2e-6"));
  EXPECT_TRUE(within_paper_tolerance(8.834, "8.819"));
  EXPECT_FALSE(within_paper_tolerance(0.271, "0.229"));
  EXPECT_EQ(format_like(0.0064, "8.14e-3"), "6.40e-3");
  EXPECT_EQ(format_like(0.27064, "0.229"), "0.271");
}

TEST(ProbeSuites, UnknownSuiteListsValidOnes) {
  try {
    run_probe_suite("jordan-t99", Precision::F64, false);
    FAIL();
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("jordan-t99"), std::string::npos);
    EXPECT_NE(msg.find("jordan-t16"), std::string::npos);
    EXPECT_NE(msg.find("pj-grape-t9"), std::string::npos);
  }
}

// Acceptance: in float64 every cell with a jordan-rope.md 6.2 value agrees to the printed digits.
TEST(ProbeSuites, Float64MatchesSpecRederivation) {
  int with_ref = 0;
  for (const std::string suite : {"jordan-t3", "jordan-t11", "jordan-t6", "jordan-t16"}) {
    const SuiteResult r = run_probe_suite(suite, Precision::F64, false);
    for (const auto& c : r.cells) {
      if (c.reference.empty()) continue;
      ++with_ref;
      EXPECT_TRUE(matches_printed(c.ours, c.reference))
          << suite << " table " << c.table << " " << c.target << " " << c.method << " " << c.metric
          << ": ours " << c.ours << " vs spec " << c.reference;
    }
  }
  EXPECT_EQ(with_ref, 27 + 45 + 5 + 3 * 4 + 12);
}

// Table 4 / 6 winners in both precisions (the float64 motif-spacing winner is Jordan (m=3)).
TEST(ProbeSuites, Winners) {
  for (const auto p : {Precision::F64, Precision::F32}) {
    const SuiteResult t11 = run_probe_suite("jordan-t11", p, false);
    std::map<std::string, std::string> w;
    for (const auto& c : t11.cells)
      if (c.table == "4" && c.metric == "best_mse") w[c.target] = c.method;
    EXPECT_EQ(w["phase_drift"], "jordan_no_gamma");
    EXPECT_EQ(w["seasonal_trend"], "jordan_raw_tau");
    EXPECT_EQ(w["damped_wave"], "jordan_raw_tau");
    EXPECT_EQ(w["rhythm_envelope"], "jordan_raw_tau");
    EXPECT_EQ(w["motif_spacing"], "jordan_m3");
    const SuiteResult t6 = run_probe_suite("jordan-t6", p, false);
    std::map<std::string, std::string> b;
    for (const auto& c : t6.cells)
      if (c.table == "6" && c.metric == "best_mse") b[c.target] = c.method;
    EXPECT_EQ(b["high_jet_r1"], "jordan_scaled_m4_c010");
    EXPECT_EQ(b["scaled_high_jet_r2"], "jordan_scaled_m3_c010");
    EXPECT_EQ(b["scaled_high_jet_r3"], "jordan_scaled_m4_c010");
  }
}

}  // namespace
}  // namespace relpos::probes
