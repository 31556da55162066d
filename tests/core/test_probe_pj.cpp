// Ports of the PJ-RoPE reference test suite (pj-rope.md section 2, items 1-11 and 16-19) to the
// probe layer, plus the fixed-kernel and GRAPE sector-containment pattern.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/types.hpp"
#include "probes/features.hpp"
#include "probes/pj_kernels.hpp"
#include "probes/solvers.hpp"
#include "probes/suites.hpp"
#include "probes/targets.hpp"

namespace relpos::probes {
namespace {

using pj::cd;

// 1. test_scalar_special_points
TEST(ProbePjReference, ScalarSpecialPoints) {
  const double L = 128.0, omega = 0.17;
  EXPECT_NEAR(pj::fj_component(9, omega, 0, L), std::cos(omega * 9), 1e-7);
  EXPECT_NEAR(pj::affine_component(16, L), -16.0 / L, 1e-7);
  EXPECT_LT(pj::beta_l(16, L), 1.0);
  EXPECT_NEAR(pj::phi_l(1.0, 10000.0), 1.0, 1e-8);
  EXPECT_THROW(pj::rapidity(1.0, 0.0), InputError);
  EXPECT_THROW(pj::fj_component(1.0, omega, -1, L), InputError);
  EXPECT_THROW(pj::rho(1.0, L, "cubic"), InputError);
  // the 1/r! factor and the damping of the scalar FJ reference
  EXPECT_NEAR(pj::fj_component(64, 0.0, 2, L, 0.5), 0.25 / 2 * std::exp(-0.25), 1e-15);
  EXPECT_NEAR(pj::lc_component(64, 0.0, 2, L), std::pow(pj::beta_l(64, L), 2), 1e-15);
  EXPECT_NEAR(pj::affine_component(64, L, 2.0, "lightcone"), -2.0 * std::asinh(0.5), 1e-15);
}

// 2. test_diagnostics (dict form)
TEST(ProbePjReference, DictDiagnostics) {
  const auto mass = pj::effective_mass(0.25, {{0, 0.5}, {1, 0.5}}, {{0, 1.0}, {1, 3.0}});
  EXPECT_GT(mass.at(1), mass.at(0));
  const auto energy = pj::functional_energy({{0, {1.0, 0.0}}, {1, {0.0, 1.0}}});
  EXPECT_GT(energy.at(0), 0.0);
  EXPECT_GT(energy.at(1), 0.0);
  EXPECT_NEAR(energy.at(0), 1.0 / std::sqrt(2.0), 1e-12);
  const auto nm = pj::normalized_mass({{0, 1.0}, {1, 3.0}, {2, -1.0}});
  EXPECT_NEAR(nm.at(1), 0.75, 1e-9);
  EXPECT_EQ(nm.at(2), 0.0);
  const auto loo = pj::leave_one_order_out_mse({1.0, 1.0}, {{0, {1.0, 0.0}}, {1, {0.0, 1.0}}});
  EXPECT_NEAR(loo.at(0), 0.5, 1e-15);
  EXPECT_THROW(pj::functional_energy({{0, {1.0}}, {1, {1.0, 2.0}}}), InputError);
}

// 3. test_jordan_group_law
TEST(ProbePjReference, JordanGroupLaw) {
  const Eigen::Matrix2cd left = pj::jordan2_complex(2.0, 0.03) * pj::jordan2_complex(4.0, 0.03);
  EXPECT_LT((left - pj::jordan2_complex(6.0, 0.03)).cwiseAbs().maxCoeff(), 1e-12);
}

// 4. test_shift_lowers_binomial_jet_order (Proposition 2)
TEST(ProbePjReference, ShiftLowersBinomialJetOrder) {
  const cd z = std::polar(1.0, 0.37);
  for (int r = 0; r < 4; ++r)
    for (int d = 0; d < 12; ++d) {
      const cd left = pj::binomial_jet(z, r, d + 1) - z * pj::binomial_jet(z, r, d);
      EXPECT_NEAR(std::abs(left - z * pj::binomial_jet(z, r - 1, d)), 0.0, 1e-10) << r << " " << d;
    }
}

// 5. test_repeated_root_annihilates_finite_jet
TEST(ProbePjReference, RepeatedRootAnnihilatesFiniteJet) {
  const cd z = 0.91 * std::polar(1.0, 0.23);
  for (int r = 0; r < 4; ++r) {
    std::vector<cd> v;
    for (int d = 0; d < 20; ++d) v.push_back(pj::binomial_jet(z, r, d));
    for (int k = 0; k <= r; ++k) v = pj::shift_minus_root(v, z);
    for (const cd& x : v) EXPECT_LT(std::abs(x), 1e-9);
  }
}

// 6. test_repeated_unit_root_contains_affine_direction
TEST(ProbePjReference, RepeatedUnitRootContainsAffine) {
  std::vector<cd> v;
  for (int d = 0; d < 8; ++d) v.push_back(static_cast<double>(d));
  v = pj::shift_minus_root(pj::shift_minus_root(v, 1.0), 1.0);
  for (const cd& x : v) EXPECT_LT(std::abs(x), 1e-12);
}

// 7. test_monomial_and_binomial_jet_spans_match
TEST(ProbePjReference, MonomialAndBinomialSpansMatch) {
  const cd z = std::polar(1.0, 0.19);
  const int R = 3, n = 12;
  Eigen::MatrixXcd mono(n, R + 1), bino(n, R + 1), both(n, 2 * (R + 1));
  for (int d = 0; d < n; ++d)
    for (int r = 0; r <= R; ++r) {
      mono(d, r) = std::pow(static_cast<double>(d), r) * std::pow(z, d);
      bino(d, r) = pj::binomial_jet(z, r, d);
    }
  both << mono, bino;
  EXPECT_EQ(pj::complex_rank(mono), R + 1);
  EXPECT_EQ(pj::complex_rank(bino), R + 1);
  EXPECT_EQ(pj::complex_rank(both), R + 1);
}

// 8. test_fj_matches_scalar_rope_character
TEST(ProbePjReference, FjMatchesScalarRopeCharacter) {
  const Eigen::MatrixXd one = Eigen::MatrixXd::Ones(1, 1), zero = Eigen::MatrixXd::Zero(1, 1);
  const auto comp = pj::fourier_jet_components(8, {0.17}, one, one, zero, 128.0, {0.0});
  ASSERT_EQ(comp.heads, 1);
  ASSERT_EQ(comp.orders, 1);
  ASSERT_EQ(comp.at(0, 0).rows(), 8);
  ASSERT_EQ(comp.at(0, 0).cols(), 8);
  EXPECT_NEAR(comp.at(0, 0)(7, 0), std::cos(1.19), 1e-6);
  Eigen::MatrixXd gates(1, 3);
  gates << 1, 0, 0;
  const auto bias = pj::combine_pj_bias(gates, &comp, nullptr, nullptr);
  ASSERT_EQ(bias.size(), 1u);
  ASSERT_EQ(bias[0].rows(), 8);
  EXPECT_EQ(bias[0](0, 7), 0.0);  // a future entry
  EXPECT_THROW(pj::combine_pj_bias(gates, nullptr, nullptr, nullptr), InputError);
}

// 9. test_affine_and_lc_shapes
TEST(ProbePjReference, AffineAndLcShapes) {
  const auto affine = pj::affine_bias(16, {0.5, 1.0}, 64.0);
  ASSERT_EQ(affine.size(), 2u);
  ASSERT_EQ(affine[1].rows(), 16);
  EXPECT_LT(affine[1](15, 0), 0.0);
  const Eigen::MatrixXd alpha = Eigen::MatrixXd::Constant(2, 3, 1.0 / 3.0);  // softmax(ones(2, 3))
  const auto lc = pj::lightcone_components(16, {0.11, 0.13}, alpha, Eigen::MatrixXd::Ones(2, 3),
                                           Eigen::MatrixXd::Zero(2, 3), 64.0);
  EXPECT_EQ(lc.heads, 2);
  EXPECT_EQ(lc.orders, 3);
  EXPECT_EQ(lc.at(1, 2).rows(), 16);
  Eigen::MatrixXd gates(2, 3);
  gates << 0, 0, 1, 0, 0.5, 0.5;
  const auto bias = pj::combine_pj_bias(gates, nullptr, &affine, &lc);
  ASSERT_EQ(bias.size(), 2u);
  EXPECT_EQ(bias[0].rows(), 16);
  EXPECT_EQ(bias[0].cols(), 16);
}

// 10. test_diagnostics (tensor form)
TEST(ProbePjReference, TensorDiagnostics) {
  Eigen::MatrixXd alpha(1, 2), zre(1, 2);
  alpha << 0.25, 0.75;
  zre << 2, 4;
  const Eigen::MatrixXd m = pj::parameter_effective_mass({0.5}, alpha, zre, Eigen::MatrixXd::Zero(1, 2));
  EXPECT_GT(m(0, 1), m(0, 0));
  pj::Components c;
  c.heads = 1;
  c.orders = 2;
  c.grid = {Eigen::MatrixXd(Eigen::RowVector2d(1, 0)), Eigen::MatrixXd(Eigen::RowVector2d(0, 1))};
  const Eigen::MatrixXd e = pj::functional_energy(c);
  EXPECT_EQ(e.rows(), 1);
  EXPECT_EQ(e.cols(), 2);
  const Eigen::MatrixXd loo = pj::leave_one_order_out_mse(Eigen::MatrixXd(Eigen::RowVector2d(1, 1)), c);
  EXPECT_EQ(loo.rows(), 1);
  EXPECT_EQ(loo.cols(), 2);
}

// 11. test_exact_pj_rotary_relative_scores
TEST(ProbePjReference, ExactPjRotaryRelativeScores) {
  const Eigen::RowVectorXd qb = (Eigen::RowVectorXd(8) << 0.2, -0.3, 0.5, 0.7, -0.1, 0.4, 0.8, -0.2).finished();
  const Eigen::RowVectorXd kb = (Eigen::RowVectorXd(8) << -0.6, 0.1, 0.3, -0.4, 0.9, 0.2, -0.7, 0.5).finished();
  Eigen::MatrixXd q = qb.replicate(6, 1), k = kb.replicate(6, 1);
  pj::apply_exact_pj_rotary(q, k, 100.0, 4.0);
  EXPECT_EQ(q.rows(), 6);
  EXPECT_EQ(q.cols(), 8);
  const Eigen::MatrixXd S = q * k.transpose();
  EXPECT_NEAR(S(3, 1), S(4, 2), 1e-10);
  EXPECT_NEAR(S(5, 2), S(4, 1), 1e-10);
  Eigen::MatrixXd bad(2, 6);
  EXPECT_THROW(pj::apply_exact_pj_rotary(bad, bad), InputError);
}

// 16. test_grape_special_basis_shapes
TEST(ProbePjReference, GrapeSpecialBasisShapes) {
  const double omega = 2 * std::numbers::pi * 3 / 64;
  const auto lags = lag_range(16);
  EXPECT_EQ(build_matrix(grape_dictionary("grape_m_rope", omega, 64), lags).cols(), 2);
  EXPECT_EQ(build_matrix(grape_dictionary("grape_a_alibi", omega, 64), lags).cols(), 1);
  const auto X = build_matrix(grape_dictionary("grape_ma_rope_alibi", omega, 64), lags);
  EXPECT_EQ(X.rows(), 16);
  EXPECT_EQ(X.cols(), 3);
  EXPECT_EQ(build_matrix(grape_dictionary("pj_fj_r2", omega, 64), lags).cols(), 6);
  EXPECT_EQ(build_matrix(grape_dictionary("pj_lc_r3_affine", omega, 64), lags).cols(), 9);
  EXPECT_THROW(grape_dictionary("grape_x", omega, 64), InputError);
}

double projection_r2(const std::string& basis, const std::string& target, double L, int n, double omega,
                     double* mse) {
  const auto lags = lag_range(n);
  const Eigen::MatrixXd X = build_matrix(grape_dictionary(basis, omega, L), lags);
  Eigen::VectorXd y(n);
  for (int i = 0; i < n; ++i) y(i) = grape_target(target, lags[static_cast<size_t>(i)], omega, L);
  const auto fit = lstsq_fit<double>(X, y, /*standardise=*/false);
  const Scores s = pj_scores<double>(fit.predict(X), y);
  if (mse) *mse = s.mse;
  return s.r2;
}

// 17. test_grape_m_projects_phase_target
TEST(ProbePjReference, GrapeMProjectsPhase) {
  EXPECT_GT(projection_r2("grape_m_rope", "phase", 128, 128, 2 * std::numbers::pi * 7 / 128, nullptr), 0.999999);
}

// 18. test_grape_a_projects_affine_target
TEST(ProbePjReference, GrapeAProjectsAffine) {
  EXPECT_GT(projection_r2("grape_a_alibi", "affine", 128, 128, 2 * std::numbers::pi * 7 / 128, nullptr), 0.999999);
}

// 19. test_grape_ma_has_nonzero_projection_residual_on_first_jet
TEST(ProbePjReference, GrapeMaResidualOnFirstJet) {
  const double omega = 2 * std::numbers::pi * 17 / 256;
  double mse_ma = 0.0, mse_fj = 1.0;
  projection_r2("grape_ma_rope_alibi", "first_jet", 256, 1024, omega, &mse_ma);
  projection_r2("pj_fj_r1", "first_jet", 256, 1024, omega, &mse_fj);
  EXPECT_GT(mse_ma, 1e-3);
  EXPECT_LT(mse_fj, 1e-20);
}

// Sector containment pattern of the fixed-kernel and GRAPE suites, both precisions.
TEST(ProbePjSuites, SectorContainment) {
  for (const auto p : {Precision::F64, Precision::F32})
    for (const std::string suite : {"pj-fixed", "pj-grape-t9"}) {
      const SuiteResult r = run_probe_suite(suite, p, false);
      int checks = 0;
      for (const auto& c : r.cells) {
        if (c.check.empty()) continue;
        ++checks;
        EXPECT_EQ(c.check, "pass") << suite << " " << to_string(p) << " " << c.table << " " << c.target << " "
                                   << c.method << " r2=" << c.ours;
      }
      EXPECT_GT(checks, 10) << suite;
    }
}

TEST(ProbePjSuites, FirstJetExactlyInFjR1) {
  const SuiteResult r = run_probe_suite("pj-grape-t9", Precision::F64, false);
  bool seen = false;
  for (const auto& c : r.cells)
    if (c.table == "9" && c.target == "first_jet" && c.method == "pj_fj_r1") {
      seen = true;
      EXPECT_GT(c.ours, 0.999999);
    }
  EXPECT_TRUE(seen);
}

TEST(ProbePjFeatures, BasesAndStandardisation) {
  EXPECT_EQ(pj_fixed_bases(3).size(), 15u);
  const double omega = 2 * std::numbers::pi * 17 / 1024;
  const auto lags = lag_range(1024);
  for (const auto& b : pj_fixed_bases(3)) EXPECT_NO_THROW(pj_dictionary(b, omega, 1024)) << b;
  EXPECT_EQ(pj_dictionary("scaled_R2_affine", omega, 1024).columns.size(), 7u);
  EXPECT_EQ(pj_dictionary("lc_R3_affine", omega, 1024).columns.size(), 9u);
  EXPECT_THROW(pj_dictionary("jordan_Rx", omega, 1024), InputError);
  // monomial columns: (d/L)^2 cos(omega d), no 1/r!
  const auto X = build_matrix(pj_dictionary("jordan_R2", omega, 1024), lags);
  EXPECT_NEAR(X(512, 4), 0.25 * std::cos(omega * 512), 1e-15);
  // standardised lstsq is invariant to column scaling
  Eigen::VectorXd y(1024);
  for (int i = 0; i < 1024; ++i) y(i) = pj_target("first_jet", i, omega, 1024);
  Eigen::MatrixXd X2 = X;
  X2.col(2) *= 1e3;
  const auto f1 = lstsq_fit<double>(X, y), f2 = lstsq_fit<double>(X2, y);
  EXPECT_LT((f1.predict(X) - f2.predict(X2)).cwiseAbs().maxCoeff(), 1e-12);
  EXPECT_LT((f1.predict(X) - y).cwiseAbs().maxCoeff(), 1e-12);
}

}  // namespace
}  // namespace relpos::probes
