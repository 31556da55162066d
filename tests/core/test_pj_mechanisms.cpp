// The PJ-RoPE mechanisms: pj_bias's lag table against the reference's T x T composition
// (probes/pj_kernels, spec pj-rope.md 1.5), its initialisation and sector switches, the table in
// the fused attention path; pj_rotary against the reference's 4-real layout formula.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>

#include "core/pj_bias.hpp"
#include "core/reference.hpp"
#include "core/registry.hpp"
#include "kernels/attention/mechanism_attention.hpp"
#include "probes/pj_kernels.hpp"
#include "test_util.hpp"

using namespace relpos;

namespace {

const BiasTerm& pj_term(const Mechanism& m) {
  const BiasTerm* b = m.learned_lag_bias();
  if (!b) throw std::logic_error("no pj bias");
  return *b;
}

// Random raw parameters (wider than the initialisation, so every sector matters).
PjBiasParams random_params(const PjBiasConfig& c, int H, std::mt19937_64& rng) {
  PjBiasParams p = pj_initial_params(c, H, rng);
  for (auto* v : {&p.gate_logits, &p.fj_alpha_logits, &p.lc_alpha_logits, &p.fj_zeta_re,
                  &p.fj_zeta_im, &p.lc_zeta_re, &p.lc_zeta_im, &p.raw_damping, &p.raw_slope})
    for (auto& x : *v) x = test::uniform(rng, -1.5, 1.5);
  return p;
}

Eigen::MatrixXd softmax_rows(const std::vector<double>& logits, int H, int n) {
  Eigen::MatrixXd a(H, n);
  for (int h = 0; h < H; ++h) {
    double mx = -INFINITY, s = 0;
    for (int r = 0; r < n; ++r) mx = std::max(mx, logits[h * n + r]);
    for (int r = 0; r < n; ++r) s += a(h, r) = std::exp(logits[h * n + r] - mx);
    a.row(h) /= s;
  }
  return a;
}

Eigen::MatrixXd as_matrix(const std::vector<double>& v, int H, int n) {
  Eigen::MatrixXd a(H, n);
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < n; ++r) a(h, r) = v[h * n + r];
  return a;
}

}  // namespace

// The lag table equals every entry of the reference's [H, T, T] composition (future entries
// excluded: the kernel masks them), for each sector subset and both affine coordinates.
TEST(PjBias, LagTableMatchesReferenceComposition) {
  std::mt19937_64 rng(11);
  const int H = 3, T = 40;
  for (const char* sectors : {"fj/affine/lc", "fj", "affine", "lc", "fj/lc", "lc/affine"})
    for (const char* rho : {"linear", "lightcone"}) {
      const auto spec = fmt::format("pj_bias(R=3, sectors={}, rho={}, L=16)", sectors, rho);
      const Mechanism m = build_mechanism(spec, 8, H);
      const PjBiasConfig& c = *pj_config(pj_term(m));
      const PjBiasParams p = random_params(c, H, rng);
      const auto table = pj_lag_table(c, p, T);
      // the reference's composition from its own pieces
      const int O = c.orders();
      Eigen::MatrixXd gates(H, 3);
      for (int h = 0; h < H; ++h) {
        const auto g = pj_gates(c, p, h);
        for (int s = 0; s < 3; ++s) gates(h, s) = g[s];
      }
      std::vector<double> damping, slope;
      for (int h = 0; h < H; ++h) {
        damping.push_back(softplus(p.raw_damping[h]));
        slope.push_back(softplus(p.raw_slope[h]));
      }
      const auto fj = probes::pj::fourier_jet_components(
          T, p.omega, softmax_rows(p.fj_alpha_logits, H, O), as_matrix(p.fj_zeta_re, H, O),
          as_matrix(p.fj_zeta_im, H, O), c.L, damping);
      const auto lc = probes::pj::lightcone_components(
          T, p.omega, softmax_rows(p.lc_alpha_logits, H, O), as_matrix(p.lc_zeta_re, H, O),
          as_matrix(p.lc_zeta_im, H, O), c.L);
      const auto aff = probes::pj::affine_bias(T, slope, c.L, rho);
      const auto ref = probes::pj::combine_pj_bias(gates, c.fj ? &fj : nullptr,
                                                   c.affine ? &aff : nullptr, c.lc ? &lc : nullptr);
      double worst = 0, scale = 0;
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < T; ++i)
          for (int j = 0; j <= i; ++j) {
            worst = std::max(worst, std::abs(table[h * T + (i - j)] - ref[h](i, j)));
            scale = std::max(scale, std::abs(ref[h](i, j)));
          }
      EXPECT_LT(worst, 1e-13 * std::max(scale, 1.0)) << spec;
    }
}

// Disabled sectors have exactly zero gates; the reference's initial gates for the byte LM's
// `full` method with the affine gate init: (0.0177, 0.9647, 0.0177); omega from 1 to 17 cycles.
TEST(PjBias, InitialisationAndSectorSwitches) {
  const Mechanism m =
      build_mechanism("pj_bias(sectors=fj/affine/lc, gates=affine, slope0=2)", 8, 4);
  const PjBiasConfig& c = *pj_config(pj_term(m));
  const PjBiasParams p = pj_initial_params(c, 4);
  const auto g = pj_gates(c, p, 0);
  EXPECT_NEAR(g[0], 0.0177, 5e-5);
  EXPECT_NEAR(g[1], 0.9647, 5e-5);
  EXPECT_NEAR(g[2], 0.0177, 5e-5);
  EXPECT_NEAR(p.omega[0], 2 * std::numbers::pi / 1024, 1e-15);
  EXPECT_NEAR(p.omega[3], 2 * std::numbers::pi * 17 / 1024, 1e-15);
  EXPECT_NEAR(softplus(p.raw_slope[0]), 2.0, 1e-12);
  EXPECT_NEAR(softplus(p.raw_damping[0]), 0.12692801104297263, 1e-15);
  const Mechanism off = build_mechanism("pj_bias(sectors=fj/lc, gates=affine)", 8, 2);
  const auto go =
      pj_gates(*pj_config(pj_term(off)), pj_initial_params(*pj_config(pj_term(off)), 2), 1);
  EXPECT_EQ(go[1], 0.0);
  EXPECT_NEAR(go[0], 0.5, 1e-15);
  // the reference's spelling of the sector choices
  EXPECT_THROW(build_mechanism("pj_bias(sectors=fj/nope)", 8, 2), InputError);
  EXPECT_THROW(build_mechanism("pj_bias(orders=q2)", 8, 2), InputError);
}

// The three jet bases: x^r / r!, x^r and C(d, r) / L^r.
TEST(PjBias, JetBases) {
  EXPECT_NEAR(pj_jet(PjJetBasis::Factorial, 30, 3, 10), 27.0 / 6, 1e-14);
  EXPECT_NEAR(pj_jet(PjJetBasis::Monomial, 30, 3, 10), 27.0, 1e-13);
  EXPECT_NEAR(pj_jet(PjJetBasis::Binomial, 30, 3, 10), 30 * 29 * 28 / 6.0 / 1000, 1e-14);
  EXPECT_EQ(pj_jet(PjJetBasis::Binomial, 2, 3, 10), 0.0);  // C(2, 3) = 0
}

// The mechanism-level attention hands the table to the kernel: equal to the kernel called with
// the table built by hand; and a strictly causal call leaves row 0 empty.
TEST(PjBias, MechanismAttentionUsesTheTable) {
  std::mt19937_64 rng(5);
  const int H = 2, T = 33, D = 8;
  const Mechanism m = build_mechanism("pj_bias(sectors=fj/affine/lc, L=8, slope0=1)", D, H);
  const auto q = test::normal_vec(H * T * D, rng), k = test::normal_vec(H * T * D, rng),
             v = test::normal_vec(H * T * D, rng);
  const kernels::AttentionDims dims{1, H, H, T, T, D};
  std::vector<double> out(q.size()), want(q.size());
  for (bool strict : {false, true}) {
    kernels::AttentionOptions o;
    o.exclude_self = strict;
    kernels::mechanism_attention_forward<double>(m, default_params(m), Layout::Interleaved, dims,
                                                 q.data(), k.data(), v.data(), {}, o, out.data(),
                                                 nullptr);
    const auto table =
        pj_lag_table(*pj_config(pj_term(m)), pj_initial_params(*pj_config(pj_term(m)), H), T);
    kernels::AttentionBias<double> bias;
    bias.lag_table = table.data();
    bias.lag_len = T;
    kernels::attention_reference(dims, q.data(), k.data(), v.data(), {}, bias, o, want.data(),
                                 nullptr);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 1e-12) << i;
    if (strict) {
      for (int e = 0; e < D; ++e) EXPECT_EQ(out[e], 0.0);  // head 0, row 0
    }
  }
}

// pj_rotary(m=2) is the reference's apply_exact_pj_rotary: the same scores q'_i . k'_j for every
// pair of positions (the maps may differ by an orthogonal change of basis; the scores may not).
TEST(PjRotary, ScoresMatchTheReferenceLayout) {
  std::mt19937_64 rng(3);
  const int D = 16, T = 12;
  const double base = 100, L = 8, eta = 1;
  const Mechanism m =
      build_mechanism(fmt::format("pj_rotary(base={}, L={}, eta={})", base, L, eta), D, 1);
  EXPECT_EQ(m.exactness(), "exact");
  const ParamValues p = default_params(m);
  Eigen::MatrixXd q(T, D), k(T, D);
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < D; ++e)
      q(t, e) = test::uniform(rng, -1, 1), k(t, e) = test::uniform(rng, -1, 1);
  Eigen::MatrixXd qr = q, kr = k;
  probes::pj::apply_exact_pj_rotary(qr, kr, base, L, eta);
  double worst = 0;
  for (int i = 0; i < T; ++i)
    for (int j = 0; j < T; ++j) {
      const Eigen::VectorXd qi =
          reference::query_map(m, p, 0, i, Layout::Interleaved) * q.row(i).transpose();
      const Eigen::VectorXd kj =
          reference::key_map(m, p, 0, j, Layout::Interleaved) * k.row(j).transpose();
      worst = std::max(worst, std::abs(qi.dot(kj) - qr.row(i).dot(kr.row(j))));
    }
  EXPECT_LT(worst, 1e-12);
  EXPECT_THROW(build_mechanism("pj_rotary", 6, 1), InputError);  // 6 is not a multiple of 4
}
