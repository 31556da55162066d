// PJ-RoPE adaptive sector recovery (pj-rope.md 3.2): the AdaptivePJKernel's analytic gradients
// against central finite differences, torch's Adam step by hand, short runs that select the
// designed sector, and the diagnostics' definitions (against the dict-form diagnostics of
// pj_kernels and the tie rules).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <numbers>
#include <random>

#include "core/types.hpp"
#include "probes/pj_adaptive.hpp"
#include "probes/pj_kernels.hpp"
#include "probes/targets.hpp"

namespace relpos::probes::pj {
namespace {

// Parameters away from the initialisation so that every gradient entry is exercised.
AdaptivePJKernel random_kernel(uint64_t seed, double omega, double L) {
  AdaptivePJKernel k(3, omega, L);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> N(0.0, 0.7);
  for (auto& p : k.params()) p = N(rng);
  return k;
}

TEST(PjAdaptive, GradientMatchesCentralFiniteDifferences) {
  const double L = 100.0, omega = 0.3;
  const LagBasis b = make_lag_basis(300, omega, L);  // x up to 3: every jet order matters
  std::vector<double> y(b.size());
  for (size_t i = 0; i < y.size(); ++i)
    y[i] = pj_target("recency_weak_jet", static_cast<double>(i), omega, L) +
           pj_target("lc_core", static_cast<double>(i), omega, L);
  for (uint64_t seed : {1u, 2u, 3u}) {
    AdaptivePJKernel k = random_kernel(seed, omega, L);
    std::vector<double> grad;
    const double f0 = k.loss(b, y, &grad);
    ASSERT_EQ(grad.size(), static_cast<size_t>(k.layout().size()));
    EXPECT_DOUBLE_EQ(f0, k.loss(b, y, nullptr));
    const double h = 1e-6;
    for (size_t i = 0; i < grad.size(); ++i) {
      AdaptivePJKernel kp = k, km = k;
      kp.params()[i] += h;
      km.params()[i] -= h;
      const double fd = (kp.loss(b, y, nullptr) - km.loss(b, y, nullptr)) / (2.0 * h);
      EXPECT_NEAR(grad[i], fd, 1e-7 * (1.0 + std::abs(fd)))
          << "parameter " << i << ", seed " << seed;
    }
  }
}

TEST(PjAdaptive, LossMatchesTheScalarReferenceComponents) {
  // pred(d) from parts() against fj_component / lc_component of pj_kernels (1/r! and damping
  // in FJ, neither in LC; the paper's zeta sign convention Re[alpha zeta e^{i w d}]).
  const double L = 64.0, omega = 0.21;
  AdaptivePJKernel k = random_kernel(7, omega, L);
  const LagBasis b = make_lag_basis(200, omega, L);
  const auto parts = k.parts(b);
  const auto g = k.gates();
  const auto af = k.fj_alpha(), al = k.lc_alpha();
  const auto& p = k.params();
  const auto& lay = k.layout();
  for (int d : {0, 1, 17, 64, 199}) {
    double want = g[1] * p[static_cast<size_t>(lay.affine())] * d / L;
    for (int r = 0; r <= 3; ++r) {
      const cd zf(p[static_cast<size_t>(lay.fj_zre() + r)],
                  p[static_cast<size_t>(lay.fj_zim() + r)]);
      const cd zl(p[static_cast<size_t>(lay.lc_zre() + r)],
                  p[static_cast<size_t>(lay.lc_zim() + r)]);
      const double fj = fj_component(d, omega, r, L, k.damping(), af[static_cast<size_t>(r)] * zf);
      const double lc = lc_component(d, omega, r, L, al[static_cast<size_t>(r)] * zl);
      EXPECT_NEAR(parts.fj[static_cast<size_t>(r)][static_cast<size_t>(d)], fj, 1e-14);
      EXPECT_NEAR(parts.lc[static_cast<size_t>(r)][static_cast<size_t>(d)], lc, 1e-14);
      want += g[0] * fj + g[2] * lc;
    }
    EXPECT_NEAR(parts.pred[static_cast<size_t>(d)], want, 1e-13) << "d = " << d;
  }
}

TEST(PjAdaptive, InitialisationIsTheReferences) {
  AdaptivePJKernel k(3, 0.1, 1024.0);
  k.init(5);
  const auto g = k.gates();
  const double z = 1.0 + 2.0 * std::exp(-0.2);
  EXPECT_NEAR(g[0], 1.0 / z, 1e-15);
  EXPECT_NEAR(g[1], std::exp(-0.2) / z, 1e-15);
  for (double a : k.fj_alpha()) EXPECT_NEAR(a, 0.25, 1e-15);
  EXPECT_NEAR(k.damping(), std::log1p(std::exp(-2.0)), 1e-15);
  EXPECT_EQ(k.params()[static_cast<size_t>(k.layout().affine())], 0.0);
  double s2 = 0.0;
  for (int i = k.layout().fj_zre(); i < k.layout().damping_raw(); ++i)
    s2 += k.params()[static_cast<size_t>(i)] * k.params()[static_cast<size_t>(i)];
  EXPECT_GT(s2, 0.0);
  EXPECT_LT(std::sqrt(s2 / 16.0), 0.2);  // 0.05 N(0,1) draws
  // the same seed gives the same draws; order_init puts +2 at one order, -2 elsewhere
  AdaptivePJKernel k2(3, 0.1, 1024.0);
  k2.init(5, 2);
  for (int i = k.layout().fj_zre(); i < k.layout().size(); ++i)
    EXPECT_EQ(k.params()[static_cast<size_t>(i)], k2.params()[static_cast<size_t>(i)]);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(k2.params()[static_cast<size_t>(k2.layout().fj_alpha() + r)], r == 2 ? 2.0 : -2.0);
    EXPECT_EQ(k2.params()[static_cast<size_t>(k2.layout().lc_alpha() + r)], r == 2 ? 2.0 : -2.0);
  }
  EXPECT_THROW(k2.init(5, 4), InputError);
  EXPECT_THROW(AdaptivePJKernel(-1, 0.1, 1024.0), InputError);
  EXPECT_THROW(AdaptivePJKernel(3, 0.1, 0.0), InputError);
}

TEST(PjAdaptive, AdamMatchesAHandComputedStep) {
  Adam opt(2, 0.1);
  std::vector<double> p{1.0, -2.0};
  // step 1: m = 0.1 g, v = 0.001 g^2, bias corrections 0.1 and 0.001:
  // p -= 0.1 / 0.1 * (0.1 g) / (sqrt(0.001 g^2) / sqrt(0.001) + 1e-8) = 0.1 g / (|g| + 1e-8)
  opt.step(p, {0.5, -3.0});
  EXPECT_NEAR(p[0], 1.0 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-15);
  EXPECT_NEAR(p[1], -2.0 + 0.1 * 3.0 / (3.0 + 1e-8), 1e-15);
  // step 2 with g = (0.1, 1.0):
  // m = 0.9 * 0.05 + 0.1 * 0.1 = 0.055; 0.9 * -0.3 + 0.1 * 1.0 = -0.17
  // v = 0.999 * 0.00025 + 0.001 * 0.01 = 0.00025975; 0.999 * 0.009 + 0.001 * 1.0 = 0.009991
  // bias corrections 1 - 0.81 = 0.19 and 1 - 0.998001 = 0.001999
  const double p0 = p[0], p1 = p[1];
  opt.step(p, {0.1, 1.0});
  EXPECT_EQ(opt.steps(), 2);
  const double s = 0.1 / 0.19, c2 = std::sqrt(0.001999);
  EXPECT_NEAR(p[0], p0 - s * 0.055 / (std::sqrt(0.00025975) / c2 + 1e-8), 1e-14);
  EXPECT_NEAR(p[1], p1 - s * -0.17 / (std::sqrt(0.009991) / c2 + 1e-8), 1e-14);
  EXPECT_THROW(opt.step(p, {1.0}), InputError);
  EXPECT_THROW(Adam(2, 0.0), InputError);
}

// Short runs (a fifth of the sweep's steps, one restart): the Fourier teacher selects FJ with
// order 0 on top, the affine teacher selects A.
TEST(PjAdaptive, ShortRunsSelectTheDesignedSector) {
  AdaptiveConfig cfg;
  cfg.steps = 200;
  cfg.restarts = 1;
  const AdaptiveRun phase = fit_adaptive("phase", 0, cfg);
  EXPECT_EQ(phase.diag.selected, Sector::FJ);
  EXPECT_EQ(phase.diag.top_order_mass, 0);
  EXPECT_EQ(phase.diag.top_order_energy, 0);
  EXPECT_LT(phase.diag.train_mse, 0.05);
  const AdaptiveRun linear = fit_adaptive("linear", 0, cfg);
  EXPECT_EQ(linear.diag.selected, Sector::A);
  EXPECT_GT(linear.diag.affine, 0.0);  // the teacher is +x
  EXPECT_LT(linear.diag.train_mse, 0.05);
  // the run is a function of the seed only
  const AdaptiveRun again = fit_adaptive("linear", 0, cfg);
  EXPECT_EQ(again.params, linear.params);
}

TEST(PjAdaptive, RestartsAreSelectedByTheChosenMse) {
  AdaptiveConfig cfg;
  cfg.steps = 20;
  cfg.restarts = 3;
  const AdaptiveRun r = fit_adaptive("first_jet", 4, cfg);
  ASSERT_EQ(r.restart_train_mse.size(), 3u);
  for (double m : r.restart_train_mse) EXPECT_LE(r.diag.train_mse, m);
  cfg.select = "eval_mse";
  const AdaptiveRun e = fit_adaptive("first_jet", 4, cfg);
  for (double m : e.restart_eval_mse) EXPECT_LE(e.diag.eval_mse, m);
  cfg.select = "loss";
  EXPECT_THROW(fit_adaptive("first_jet", 4, cfg), InputError);
  cfg.select = "train_mse";
  EXPECT_THROW(fit_adaptive("nope", 4, cfg), InputError);
}

TEST(PjAdaptive, TiesGoToTheSmallestOrder) {
  EXPECT_EQ(argmax_first({0.25, 0.25, 0.5, 0.5}), 2);
  EXPECT_EQ(argmax_first({1.0, 1.0}), 0);
  EXPECT_EQ(mode_smallest({2, 1, 2, 1}), 1);
  EXPECT_EQ(mode_smallest({3, 0, 3}), 3);
  EXPECT_EQ(mode_smallest({3, 2, 1}), 1);
  EXPECT_THROW(argmax_first({}), InputError);
  EXPECT_THROW(mode_smallest({}), InputError);
}

TEST(PjAdaptive, DiagnosticsFollowTheirDefinitions) {
  const double L = 1024.0, omega = 2.0 * std::numbers::pi * 17.0 / L;
  AdaptivePJKernel k = random_kernel(11, omega, L);
  const LagBasis train = make_lag_basis(1024, omega, L), eval = make_lag_basis(4096, omega, L);
  std::vector<double> yt(train.size()), ye(eval.size());
  for (size_t i = 0; i < ye.size(); ++i)
    ye[i] = pj_target("lc_affine", static_cast<double>(i), omega, L);
  for (size_t i = 0; i < yt.size(); ++i) yt[i] = ye[i];
  const AdaptiveDiagnostics d = diagnose(k, train, yt, eval, ye);
  // against the dict-form diagnostics: C_r = g_FJ FJ_r + g_LC LC_r, and the affine term a
  // component of the prediction without an order
  const auto parts = k.parts(eval);
  std::map<int, std::vector<double>> C, with_affine;
  for (int r = 0; r < 4; ++r) {
    std::vector<double> c(eval.size());
    for (size_t i = 0; i < c.size(); ++i)
      c[i] = d.gates[0] * parts.fj[static_cast<size_t>(r)][i] +
             d.gates[2] * parts.lc[static_cast<size_t>(r)][i];
    C[r] = c;
  }
  with_affine = C;
  with_affine[-1] = parts.affine;
  for (auto& v : with_affine[-1]) v *= d.gates[1];
  const auto energy = functional_energy(C);
  const auto loo = leave_one_order_out_mse(ye, with_affine);
  std::map<int, double> mass;
  for (int r = 0; r < 4; ++r)
    mass[r] = d.fj_mass[static_cast<size_t>(r)] + d.lc_mass[static_cast<size_t>(r)];
  const auto nm = normalized_mass(mass);
  double nsum = 0.0;
  for (int r = 0; r < 4; ++r) {
    const auto q = static_cast<size_t>(r);
    EXPECT_NEAR(d.energy[q], energy.at(r), 1e-12);
    EXPECT_NEAR(d.loo[q], loo.at(r), 1e-12);
    EXPECT_NEAR(d.normalized_mass[q], nm.at(r), 1e-10);
    nsum += d.normalized_mass[q];
    const auto& p = k.params();
    EXPECT_NEAR(d.fj_mass[q],
                d.gates[0] * k.fj_alpha()[q] *
                    std::hypot(p[static_cast<size_t>(k.layout().fj_zre() + r)],
                               p[static_cast<size_t>(k.layout().fj_zim() + r)]),
                1e-15);
  }
  EXPECT_NEAR(nsum, 1.0, 1e-12);
  EXPECT_EQ(d.top_order_mass, argmax_first(d.normalized_mass));
  EXPECT_EQ(d.top_order_energy, argmax_first(d.energy));
  EXPECT_EQ(d.selected, static_cast<Sector>(argmax_first({d.gates[0], d.gates[1], d.gates[2]})));
  double mse = 0.0, ss = 0.0, mean = 0.0;
  for (double v : ye) mean += v / static_cast<double>(ye.size());
  for (size_t i = 0; i < ye.size(); ++i) {
    mse += (parts.pred[i] - ye[i]) * (parts.pred[i] - ye[i]);
    ss += (ye[i] - mean) * (ye[i] - mean);
  }
  EXPECT_NEAR(d.eval_mse, mse / static_cast<double>(ye.size()), 1e-12);
  EXPECT_NEAR(d.eval_r2, 1.0 - mse / (ss + 1e-12), 1e-12);
  EXPECT_NEAR(d.train_mse, k.loss(train, yt, nullptr), 1e-15);

  // equal mass at orders 1 and 2: the top order is 1
  AdaptivePJKernel t(3, omega, L);
  t.init(0);
  auto& p = t.params();
  for (int r = 0; r < 4; ++r) {
    p[static_cast<size_t>(t.layout().fj_zre() + r)] = r == 1 || r == 2 ? 1.0 : 0.0;
    p[static_cast<size_t>(t.layout().fj_zim() + r)] = 0.0;
    p[static_cast<size_t>(t.layout().lc_zre() + r)] = 0.0;
    p[static_cast<size_t>(t.layout().lc_zim() + r)] = 0.0;
  }
  const AdaptiveDiagnostics dt = diagnose(t, train, yt, eval, ye);
  EXPECT_EQ(dt.normalized_mass[1], dt.normalized_mass[2]);
  EXPECT_EQ(dt.top_order_mass, 1);
  EXPECT_EQ(dt.selected, Sector::FJ);
}

TEST(PjAdaptive, DesignedSectorsAndConfigErrors) {
  EXPECT_EQ(designed_sectors("phase"), std::vector<Sector>{Sector::FJ});
  EXPECT_EQ(designed_sectors("third_jet"), std::vector<Sector>{Sector::FJ});
  EXPECT_EQ(designed_sectors("linear"), std::vector<Sector>{Sector::A});
  EXPECT_EQ(designed_sectors("recency_weak_jet"), (std::vector<Sector>{Sector::A, Sector::FJ}));
  EXPECT_EQ(designed_sectors("lc_affine"), std::vector<Sector>{Sector::LC});
  EXPECT_THROW(designed_sectors("mixed"), InputError);
  AdaptiveConfig cfg;
  cfg.restarts = 0;
  EXPECT_THROW(cfg.check(), InputError);
  cfg = {};
  cfg.cycles = -1;
  EXPECT_THROW(cfg.check(), InputError);
  EXPECT_THROW(run_adaptive_sweep(AdaptiveConfig{}, {"phase"}, {}), InputError);
}

}  // namespace
}  // namespace relpos::probes::pj
