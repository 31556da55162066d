// PJ-RoPE Phase F light-cone probes (probes/lightcone.hpp; pj-rope.md 3.7, section 4's closed
// forms).
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/types.hpp"
#include "probes/lightcone.hpp"
#include "probes/pj_kernels.hpp"
#include "probes/suites.hpp"

namespace relpos::probes {
namespace {

using lc::Variant;

constexpr int kT = 32768;
constexpr double kL = 1024.0;

TEST(LightCone, CoordinateFamily) {
  const lc::Coords c;
  const double d = 3000.0;
  EXPECT_EQ(lc::amplitude_coordinate(Variant::Raw, d, c), d);
  EXPECT_EQ(lc::amplitude_coordinate(Variant::Scaled, d, c), d / kL);
  EXPECT_EQ(lc::amplitude_coordinate(Variant::Clipped, d, c), 1.0);
  EXPECT_DOUBLE_EQ(lc::amplitude_coordinate(Variant::Log, d, c), std::log1p(d / kL));
  EXPECT_DOUBLE_EQ(lc::amplitude_coordinate(Variant::Lc, d, c), d / std::hypot(d, kL));
  EXPECT_DOUBLE_EQ(lc::phase_coordinate(Variant::Lc, d, c), kL * std::asinh(d / kL));
  EXPECT_DOUBLE_EQ(lc::phase_coordinate(Variant::LcPhaseOnly, d, c), kL * std::asinh(d / kL));
  EXPECT_DOUBLE_EQ(lc::phase_coordinate(Variant::LcWrongScale, d, c), std::asinh(d / kL));
  EXPECT_EQ(lc::phase_coordinate(Variant::LcAmpOnly, d, c), d);
  EXPECT_DOUBLE_EQ(lc::envelope(Variant::Scaled, d, c), std::exp(-0.1 * d / kL));
  EXPECT_EQ(lc::envelope(Variant::Raw, d, c), 1.0);
  // A_r with and without 1/r!
  EXPECT_DOUBLE_EQ(lc::jet_amplitude(Variant::Raw, 3, d, c), d * d * d / 6.0);
  EXPECT_DOUBLE_EQ(lc::jet_amplitude(Variant::Lc, 3, d, c), std::pow(d / std::hypot(d, kL), 3));
  EXPECT_DOUBLE_EQ(lc::jet_amplitude(Variant::Scaled, 2, d, c),
                   std::exp(-0.1 * d / kL) * std::pow(d / kL, 2) / 2.0);
  EXPECT_EQ(lc::jet_amplitude(Variant::Raw, 0, 0.0, c), 1.0);
  EXPECT_EQ(lc::parse_variant("lc_wrong_scale"), Variant::LcWrongScale);
  EXPECT_THROW(lc::parse_variant("lc_right_scale"), InputError);
  EXPECT_EQ(lc::all_variants().size(), 8u);
  EXPECT_EQ(lc::variant_index(Variant::Lc), 6);
}

TEST(LightCone, PositionFeaturesLayout) {
  const lc::Coords c;
  const auto f =
      lc::position_features(Variant::Lc, {0.0, 5.0, 2000.0}, c, {5.0, 17.0, 61.0}, lc::Dtype::F64);
  ASSERT_EQ(f.cols(), 24);
  ASSERT_EQ(f.rows(), 3);
  // omega index 1 (17 cycles), order r = 2: columns (1 * 4 + 2) * 2 and + 1
  const double d = 2000.0, w = 2.0 * std::numbers::pi * 17.0 / kL;
  const double a = std::pow(pj::beta_l(d, kL), 2), th = w * pj::phi_l(d, kL);
  EXPECT_NEAR(f(2, 12), a * std::cos(th), 1e-15);
  EXPECT_NEAR(f(2, 13), a * std::sin(th), 1e-15);
  EXPECT_EQ(f(0, 0), 1.0);  // A_0 cos(0)
  EXPECT_EQ(f(0, 2), 0.0);  // A_1(0) = 0
}

// The float32 protocol (pj-rope.md 5.2): lag, amplitude and phase coordinate in float, omega
// rounded to float, the phase omega * psi rounded to float before cos/sin.
TEST(LightCone, Float32FeaturesRoundThePhaseBeforeCosSin) {
  const lc::Coords c;
  const std::vector<double> cycles{5.0, 17.0, 61.0};
  const std::vector<double> lags{1.0, 30001.0, 32767.0};
  for (Variant v : {Variant::Raw, Variant::Lc, Variant::Scaled}) {
    const lc::Mat<float> f = lc::position_features_as<float>(v, lags, c, cycles);
    const Eigen::MatrixXd f64 = lc::position_features(v, lags, c, cycles, lc::Dtype::F64);
    ASSERT_EQ(f.cols(), 24);
    double worst = 0.0;
    for (size_t i = 0; i < lags.size(); ++i) {
      const float d = static_cast<float>(lags[i]);
      const float psi = lc::phase_coordinate(v, d, c);
      for (size_t w = 0; w < cycles.size(); ++w) {
        const float omega = static_cast<float>(2.0 * std::numbers::pi * cycles[w] / kL);
        const float th = omega * psi;  // rounded to float
        for (int r = 0; r <= 3; ++r) {
          const float a = lc::jet_amplitude(v, r, d, c);
          const Eigen::Index col = (static_cast<Eigen::Index>(w) * 4 + r) * 2;
          const auto row = static_cast<Eigen::Index>(i);
          EXPECT_EQ(f(row, col), a * std::cos(th)) << lc::to_string(v) << " d " << d;
          EXPECT_EQ(f(row, col + 1), a * std::sin(th)) << lc::to_string(v) << " d " << d;
          if (r == 0)  // unit amplitude: the entries are the phases' cos/sin
            worst = std::max(worst, std::abs(f(row, col) - f64(row, col)));
        }
      }
    }
    // the float32 phase at d ~ 32k is off by up to ~ half an ulp of omega d (61 cycles: ~12270
    // rad, ulp 2^-10): visible in the features, far above float64's rounding
    EXPECT_GT(worst, 1e-5) << lc::to_string(v);
    EXPECT_LT(worst, 2e-3) << lc::to_string(v);
  }
  // A_r in float: d^3 / 3! by float multiplications
  const float d = 30001.0f;
  EXPECT_EQ(lc::jet_amplitude(Variant::Raw, 3, d, c), d * d * d / 6.0f);
  // the default of position_features is the float32 protocol, returned exactly as double
  EXPECT_EQ(lc::position_features(Variant::Raw, lags, c),
            lc::position_features_as<float>(Variant::Raw, lags, c, cycles).cast<double>());
}

// The last LC phase increment at T = 32768 in float32 is the reference's exported 0.03125
// (pj-rope.md 5.3): phi(T-1) ~ 4254.6, whose float ulp is 2^-11, so the difference is 64 ulps.
TEST(LightCone, Float32StabilityMatchesTheReferenceExport) {
  lc::StabilityOptions f32;
  f32.dtype = lc::Dtype::F32;
  const auto lcr = lc::phase_f_stability(Variant::Lc, kT, f32);
  EXPECT_EQ(lcr.phase_ratio_final, 0.03125);
  EXPECT_NEAR(lcr.phase_ratio_far_mean, 0.04328, 5e-5);
  EXPECT_NEAR(lcr.far_phase_span, 73.96, 0.02);
  EXPECT_EQ(lcr.nonfinite_count, 0);
  EXPECT_EQ(lc::phase_f_stability(Variant::Raw, kT, f32).phase_ratio_final, 1.0);
  // the default options are the float32 protocol
  EXPECT_EQ(lc::phase_f_stability(Variant::Lc, kT).phase_ratio_final, 0.03125);
}

// pj-rope.md section 4: T = 32768, L = 1024, omega = 17 cycles over L (float64: the closed forms to
// 1e-9).
TEST(LightCone, ClosedFormsAtT32768) {
  lc::StabilityOptions f64;
  f64.dtype = lc::Dtype::F64;
  const auto lcr = lc::phase_f_stability(Variant::Lc, kT, f64);
  const auto raw = lc::phase_f_stability(Variant::Raw, kT, f64);
  const double omega = 2.0 * std::numbers::pi * 17.0 / kL;
  EXPECT_NEAR(omega, 0.104311, 5e-7);
  // last-lag increment phi(T-1) - phi(T-2) ~ phi'(T - 1.5) = 1/sqrt(1 + ((T-1.5)/L)^2)
  const double mid = 1.0 / std::sqrt(1.0 + std::pow((kT - 1.5) / kL, 2));
  // the closed form is 0.0312362 (spec section 4 prints it truncated as 0.03123; the reference's
  // exported 0.03125 is the float32 rounding of phi near 4254.6, whose ulp is 2^-11)
  EXPECT_NEAR(mid, 0.0312362, 5e-8);
  EXPECT_NEAR(lcr.phase_ratio_final, mid, 1e-9);
  EXPECT_NEAR(lcr.phase_ratio_final, 0.03123, 1e-5);
  // far spans
  const double lc_span = omega * kL * (std::asinh(32767.0 / kL) - std::asinh(16384.0 / kL));
  EXPECT_NEAR(lc_span, 73.96, 5e-3);
  EXPECT_NEAR(lcr.far_phase_span, lc_span, 1e-9 * lc_span);
  EXPECT_NEAR(raw.far_phase_span, omega * 16383.0, 1e-9 * 1708.92);
  EXPECT_NEAR(raw.far_phase_span, 1708.92, 5e-3);
  // far-mean ratio = (psi(T-1) - psi(T/2)) / (T/2 - 1)
  const double far_mean = (pj::phi_l(kT - 1, kL) - pj::phi_l(kT / 2, kL)) / (kT / 2 - 1);
  EXPECT_NEAR(lcr.phase_ratio_far_mean, far_mean, 1e-12);
  EXPECT_NEAR(lcr.phase_ratio_far_mean, 0.04328, 5e-6);
  EXPECT_NEAR(raw.phase_ratio_final, 1.0, 0.0);
  EXPECT_NEAR(raw.phase_ratio_far_mean, 1.0, 1e-12);
  // lc_wrong_scale: increments 1/L smaller than lc's
  const auto wrong = lc::phase_f_stability(Variant::LcWrongScale, kT, f64);
  EXPECT_NEAR(wrong.far_phase_span, lc_span / kL, 1e-9);
  // QK proxy: LC amplitudes are bounded by sqrt(R+1); raw's grow like d^3 / 6
  EXPECT_LT(lcr.qk_proxy_final, 2.0);
  EXPECT_GT(raw.qk_proxy_final, 5e12);
  EXPECT_EQ(lcr.nonfinite_count, 0);
  EXPECT_EQ(raw.nonfinite_count, 0);
  EXPECT_EQ(lcr.far_sample_count, 4096);
}

TEST(LightCone, QuantisationRoundsHalfToEven) {
  EXPECT_EQ(lc::round_half_even(0.5), 0.0);
  EXPECT_EQ(lc::round_half_even(1.5), 2.0);
  EXPECT_EQ(lc::round_half_even(2.5), 2.0);
  EXPECT_EQ(lc::round_half_even(-0.5), 0.0);
  EXPECT_EQ(lc::round_half_even(-1.5), -2.0);
  EXPECT_EQ(lc::round_half_even(-2.5), -2.0);
  EXPECT_EQ(lc::round_half_even(2.4999), 2.0);
  EXPECT_EQ(lc::round_half_even(-2.6), -3.0);
  EXPECT_EQ(lc::quant_qmax(8), 127);
  EXPECT_EQ(lc::quant_qmax(4), 7);
  EXPECT_THROW(lc::quant_qmax(1), InputError);
  // per tensor: amax 7 -> scale 1 at int4; 2.5 -> 2, 3.5 -> 4, -7 stays -7
  Eigen::MatrixXd x(2, 2);
  x << 2.5, 3.5, -7.0, 0.5;
  const Eigen::MatrixXd q = lc::quantize_tensor(x, 4);
  EXPECT_EQ(q(0, 0), 2.0);
  EXPECT_EQ(q(0, 1), 4.0);
  EXPECT_EQ(q(1, 0), -7.0);
  EXPECT_EQ(q(1, 1), 0.0);
  // per column: column 1's amax 3.5 -> scale 0.5, so 0.5 -> 1 step exactly
  const Eigen::MatrixXd qc = lc::quantize_columns(x, 4);
  EXPECT_EQ(qc(1, 1), 0.5);
  EXPECT_EQ(qc(0, 1), 3.5);
  // symmetric clamp: never below -qmax scale
  EXPECT_EQ(lc::quantize_value(-100.0, 1.0, 7), -7.0);
  EXPECT_EQ(lc::quantize_tensor(Eigen::MatrixXd(Eigen::MatrixXd::Zero(2, 2)), 8).norm(), 0.0);
  // in float: x / scale and the rounding in float (scale 0.1f)
  lc::Mat<float> xf(1, 2);
  xf << 0.25f, 0.7f;
  const lc::Mat<float> qf = lc::quantize_tensor(xf, 4);
  EXPECT_EQ(qf(0, 0), lc::round_half_even(0.25f / (0.7f / 7.0f)) * (0.7f / 7.0f));
  EXPECT_EQ(qf(0, 1), 0.7f);
  EXPECT_NEAR(lc::relative_error(q, x), (q - x).norm() / x.norm(), 0.0);
}

TEST(LightCone, RetrievalTiesGoToTheFirstIndex) {
  Eigen::MatrixXd rows(4, 2);
  rows << 1, 0, 0, 1, 0, 1, 1, 0;  // rows 1 and 2 identical, rows 0 and 3 identical
  const auto s = lc::retrieve(rows, 2, 1e-6);
  EXPECT_EQ(s.prediction, 1);
  EXPECT_EQ(s.ties, 2);
  EXPECT_EQ(s.margin, 0.0);
  const auto s3 = lc::retrieve(rows, 3, 1e-6);
  EXPECT_EQ(s3.prediction, 0);
  Eigen::VectorXd v(4);
  v << 0.1, 0.7, 0.7, 0.2;
  EXPECT_EQ(lc::first_argmax(v), 1);
  EXPECT_EQ(lc::rounded_linspace(0, 3, 4), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(lc::rounded_linspace(0, 1, 5), (std::vector<int>{0, 1}));  // 0.25 0.5 0.75 -> 0 0 1
  EXPECT_EQ(lc::lower_median({3.0, 1.0, 2.0, 4.0}), 2.0);
}

// mean_tie_count counts the candidates with score >= target - 1e-6, the target included, in the
// rows' scalar type.
TEST(LightCone, TieCountUsesEps1e6) {
  const auto unit_rows = [](auto zero) {
    using Real = decltype(zero);
    // angles to the target (row 0): 0 (a copy), 1e-3 (cos = 1 - 5e-7: a tie), 2e-3 (1 - 2e-6:
    // not), 0.5 (not)
    const double angles[] = {0.0, 0.0, 1e-3, 2e-3, 0.5};
    lc::Mat<Real> m(5, 2);
    for (int i = 0; i < 5; ++i) {
      m(i, 0) = static_cast<Real>(std::cos(angles[i]));
      m(i, 1) = static_cast<Real>(std::sin(angles[i]));
    }
    return m;
  };
  const auto d = lc::retrieve(unit_rows(0.0), 0, 1e-6);
  const auto f = lc::retrieve(unit_rows(0.0f), 0, 1e-6);
  EXPECT_EQ(d.ties, 3);  // target, its copy, the 1e-3 neighbour
  EXPECT_EQ(f.ties, 3);
  EXPECT_EQ(d.prediction, 0);  // ties to the first
  EXPECT_EQ(f.prediction, 0);
  EXPECT_EQ(lc::retrieve(unit_rows(0.0), 2, 1e-6).ties, 4);  // 1e-3 from rows 0, 1 and 3
  EXPECT_EQ(lc::retrieve(unit_rows(0.0), 4, 1e-6).ties, 1);
  EXPECT_EQ(lc::retrieve(unit_rows(0.0), 3, 1e-6).prediction, 3);
}

// Raw features alias every 1024 lags (5, 17, 61 cycles over L = 1024): d and d + 1024 share the
// phases and differ only through the amplitude ratios, a cosine gap of ~1e-8 at d ~ 6000. float64
// resolves it; in float32 (the reference's protocol) the gap is below an ulp of the scores and the
// aliased lags tie, so top-1 at the far bucket falls and the tie count stays.
TEST(LightCone, Float32RetrievalLosesRawAliasedLags) {
  lc::RetrievalOptions f32, f64;
  f32.dtype = lc::Dtype::F32;
  f64.dtype = lc::Dtype::F64;
  const auto r32 = lc::phase_f_retrieval_resolution(Variant::Raw, 8192, lc::Quant::Fp32, f32);
  const auto r64 = lc::phase_f_retrieval_resolution(Variant::Raw, 8192, lc::Quant::Fp32, f64);
  ASSERT_EQ(r32.size(), 3u);  // train, x1_4, x4_16 = [4096, 8191]
  ASSERT_EQ(r64.size(), 3u);
  EXPECT_EQ(r32[0].top1, 1.0);  // no aliasing inside the train window
  EXPECT_EQ(r64[2].top1, 1.0);
  EXPECT_LT(r32[2].top1, 0.9);
  EXPECT_GE(r32[2].mean_tie_count, 2.0);  // the aliases are within 1e-6 in both
  EXPECT_GE(r64[2].mean_tie_count, 2.0);
}

TEST(LightCone, RetrievalAtT4096) {
  // Raw phases are injective over small lags in fp32: self-retrieval in the train bucket is exact.
  const auto rows = lc::phase_f_retrieval_resolution(Variant::Raw, 4096, lc::Quant::Fp32);
  ASSERT_EQ(rows.size(), 2u);  // train, x1_4 (x4_16 clipped at 4095 is [4096, 4095]: dropped)
  EXPECT_EQ(rows[0].bucket, "train");
  EXPECT_EQ(rows[0].queries, 128);
  EXPECT_EQ(rows[0].top1, 1.0);
  for (const auto& r : rows) EXPECT_GE(r.mean_tie_count, 1.0);
  // int4 per-column quantisation of lc features at the far bucket collapses many lags
  const auto q4 = lc::phase_f_retrieval_resolution(Variant::Lc, 4096, lc::Quant::Int4);
  EXPECT_LT(q4.back().top1, 1.0);
}

TEST(LightCone, MlpGradientMatchesFiniteDifferences) {
  lc::Mlp m = lc::Mlp::init(5, 7, 42);
  std::mt19937_64 gen(3);
  const Eigen::MatrixXd x = lc::gaussian_matrix(6, 5, 1.0, gen);
  Eigen::VectorXd y(6), w(6);
  y << 1, 0, 1, 0, 0, 1;
  w << 3, 1, 1, 2, 1, 1;
  lc::Mlp g = m;
  lc::mlp_bce_loss_grad(m, x, y, w, &g);
  const auto p = m.flatten();
  const auto gp = g.flatten();
  ASSERT_EQ(p.size(), static_cast<size_t>(5 * 7 + 7 + 7 * 7 + 7 + 7 + 1));
  double worst = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double h = 1e-6;
    auto pp = p, pm = p;
    pp[i] += h;
    pm[i] -= h;
    lc::Mlp a = m, b = m;
    a.assign(pp);
    b.assign(pm);
    const double fd =
        (lc::mlp_bce_loss_grad(a, x, y, w, nullptr) - lc::mlp_bce_loss_grad(b, x, y, w, nullptr)) /
        (2 * h);
    worst = std::max(worst, std::abs(fd - gp[i]) / std::max(1.0, std::abs(fd)));
  }
  EXPECT_LT(worst, 1e-8);
  // exact GELU
  EXPECT_NEAR(lc::gelu(1.0), 0.8413447460685429, 1e-15);
  EXPECT_NEAR(lc::gelu_grad(0.3), (lc::gelu(0.3 + 1e-6) - lc::gelu(0.3 - 1e-6)) / 2e-6, 1e-9);
  EXPECT_THROW(lc::mlp_forward(m, Eigen::MatrixXd::Zero(2, 4)), InputError);
}

TEST(LightCone, MlpInitAndAdamWMatchTorch) {
  const lc::Mlp m = lc::Mlp::init(24, 96, 7);
  EXPECT_LE(m.W1.cwiseAbs().maxCoeff(), 1.0 / std::sqrt(24.0));
  EXPECT_LE(m.W2.cwiseAbs().maxCoeff(), 1.0 / std::sqrt(96.0));
  EXPECT_GT(m.W1.cwiseAbs().maxCoeff(), 0.9 / std::sqrt(24.0));
  EXPECT_LE(m.b3.cwiseAbs().maxCoeff(), 1.0 / std::sqrt(96.0));
  // torch.optim.AdamW, two steps by hand
  lc::AdamW opt;
  opt.lr = 0.1;
  opt.weight_decay = 0.5;
  std::vector<double> p{1.0, -2.0};
  const std::vector<double> g1{0.3, -4.0}, g2{-0.1, 1.0};
  opt.step(p, g1);
  // step 1: mhat = g, vhat = g^2
  EXPECT_NEAR(p[0], 1.0 * (1 - 0.05) - 0.1 * 0.3 / (0.3 + 1e-8), 1e-14);
  EXPECT_NEAR(p[1], -2.0 * (1 - 0.05) + 0.1 * 4.0 / (4.0 + 1e-8), 1e-14);
  const double p0 = p[0];
  opt.step(p, g2);
  const double m1 = 0.9 * 0.1 * 0.3 + 0.1 * -0.1, v1 = 0.999 * 0.001 * 0.09 + 0.001 * 0.01;
  const double mhat = m1 / (1 - 0.81), vhat = v1 / (1 - 0.999 * 0.999);
  EXPECT_NEAR(p[0], p0 * (1 - 0.05) - 0.1 * mhat / (std::sqrt(vhat) + 1e-8), 1e-12);
}

TEST(LightCone, TrainedResolutionRuns) {
  lc::TrainedOptions o;
  o.steps = 60;  // the protocol's 320 in the suite; a quick run here
  const auto rows = lc::phase_f_trained_resolution(Variant::Lc, 8192, lc::Quant::Int4, o);
  ASSERT_EQ(rows.size(), 3u);  // train, x1_4, x4_16 = [4096, 8191]
  for (const auto& r : rows) {
    EXPECT_EQ(r.queries, 96);
    EXPECT_GE(r.hard_pair_accuracy, 0.0);
    EXPECT_LE(r.hard_pair_accuracy, 1.0);
    EXPECT_GE(r.hard_gap_mean, 1.0);
    EXPECT_TRUE(std::isfinite(r.final_loss));
  }
  // deterministic
  const auto again = lc::phase_f_trained_resolution(Variant::Lc, 8192, lc::Quant::Int4, o);
  EXPECT_EQ(again[2].hard_pair_accuracy, rows[2].hard_pair_accuracy);
  EXPECT_EQ(again[2].final_loss, rows[2].final_loss);
}

TEST(LightCone, CacheProbe) {
  const auto raw = lc::phase_f_cache_quantization(Variant::Raw, 4096);
  const auto lcr = lc::phase_f_cache_quantization(Variant::Lc, 4096);
  EXPECT_GT(raw.logit_std, 1e6 * lcr.logit_std);
  EXPECT_EQ(lcr.nonfinite_count, 0);
  EXPECT_LT(lcr.cache_error[0][1], lcr.cache_error[1][1]);  // int8 finer than int4
  // same seed, same mixes
  EXPECT_EQ(lc::phase_f_cache_quantization(Variant::Lc, 4096).logit_std, lcr.logit_std);
}

TEST(LightCone, BadInputIsNamed) {
  EXPECT_THROW(lc::phase_f_stability(Variant::Lc, 2), InputError);
  lc::Coords c;
  c.L = 0.0;
  EXPECT_THROW(lc::position_features(Variant::Lc, {1.0}, c), InputError);
  EXPECT_EQ(default_precision("pj-t5"), Precision::F32);  // the reference's float32 protocol
  EXPECT_EQ(default_precision("jordan-t3"), Precision::F64);
  const auto all = probe_suite_names();
  EXPECT_EQ(std::find(all.begin(), all.end(), "pj-t5"), all.end());  // not part of "all"
}

}  // namespace
}  // namespace relpos::probes
