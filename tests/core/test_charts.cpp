// Lag charts, frequency grids, ALiBi slopes and the compensated sin/cos (core/charts.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/charts.hpp"
#include "core/types.hpp"

using namespace relpos;

namespace {

const Chart kCharts[] = {Chart::Raw, Chart::Bounded, Chart::LightconePhi, Chart::LightconeBeta};

}  // namespace

TEST(Charts, EveryChartIsOddZeroAtZeroAndIncreasing) {
  const std::vector<double> ts = {1e-9, 0.3, 1.0, 7.5, 100.0, 1023.0, 1e4, 1e6, 1e12};
  for (const Chart c : kCharts)
    for (const double L : {1.0, 16.0, 1024.0}) {
      SCOPED_TRACE(to_string(c) + " L=" + std::to_string(L));
      EXPECT_EQ(chart_value(c, 0.0, L), 0.0);
      double prev = 0.0;
      for (const double t : ts) {
        const double f = chart_value(c, t, L);
        EXPECT_DOUBLE_EQ(chart_value(c, -t, L), -f) << "t=" << t;
        EXPECT_GT(f, prev) << "t=" << t;  // strictly increasing on t > 0
        prev = f;
      }
    }
}

TEST(Charts, OnlyRawIsLinear) {
  EXPECT_TRUE(chart_is_linear(Chart::Raw));
  EXPECT_FALSE(chart_is_linear(Chart::Bounded));
  EXPECT_FALSE(chart_is_linear(Chart::LightconePhi));
  EXPECT_FALSE(chart_is_linear(Chart::LightconeBeta));
  EXPECT_DOUBLE_EQ(chart_value(Chart::Raw, -37.25, 8.0), -37.25);
}

TEST(Charts, BoundedTauIsBelowLAndSaturates) {
  for (const double L : {16.0, 256.0, 1024.0}) {
    for (const double d : {0.0, 1.0, 10.0, L, 10 * L, 1e6, 1e9, 1e15}) {
      const double tau = chart_value(Chart::Bounded, d, L);
      EXPECT_LT(tau, L) << "d=" << d << " L=" << L;
      EXPECT_DOUBLE_EQ(tau, d / (1.0 + d / L));
      EXPECT_DOUBLE_EQ(tau, chart_value(Chart::Bounded, d, L));
    }
    EXPECT_DOUBLE_EQ(chart_value(Chart::Bounded, L, L), L / 2);       // tau(L) = L/2
    EXPECT_DOUBLE_EQ(chart_value(Chart::Bounded, 3 * L, L), 0.75 * L);  // tau(3L) = 3L/4
    EXPECT_GT(chart_value(Chart::Bounded, 1e9 * L, L), L * (1 - 1e-8));
  }
}

TEST(Charts, BoundedTauIsDPlusOrderDSquaredOverL) {
  // d - tau(d) = (d^2/L) / (1 + d/L): the correction is exactly O(d^2/L) with constant -> 1.
  const double L = 1024.0;
  for (const double d : {1e-3, 0.1, 1.0, 4.0, 16.0}) {
    const double tau = chart_value(Chart::Bounded, d, L);
    EXPECT_LT(tau, d);
    const double ratio = (d - tau) / (d * d / L);
    EXPECT_NEAR(ratio, 1.0 / (1.0 + d / L), 1e-9) << "d=" << d;
    EXPECT_LE(ratio, 1.0);
    EXPECT_GT(ratio, 1.0 - 2 * d / L);
  }
}

TEST(Charts, LightconePhiAndBetaMatchHandFormulas) {
  // phi_L(d) = L asinh(d/L) ~ d near 0 (PJ-RoPE test: phi_L(1, 10000) = 1 to 8 places)
  EXPECT_NEAR(lightcone_phi(1.0, 10000.0), 1.0, 1e-8);
  EXPECT_NEAR(lightcone_phi(1024.0, 1024.0), 1024.0 * 0.88137358701954302523, 1e-10);  // asinh(1)
  EXPECT_NEAR(lightcone_phi(3.0 * 16.0 / 4.0, 16.0), 16.0 * std::log(0.75 + 1.25), 1e-12);
  for (const double d : {0.5, 2.0, 8.0}) {  // Taylor: d - d^3/(6 L^2)
    const double L = 1000.0;
    EXPECT_NEAR(lightcone_phi(d, L), d - d * d * d / (6 * L * L), 1e-8) << d;
  }
  // beta_L(d) = d / sqrt(d^2 + L^2): 3-4-5 triangle, |beta| < 1, beta = tanh(asinh(d/L))
  EXPECT_DOUBLE_EQ(lightcone_beta(3.0, 4.0), 0.6);
  EXPECT_DOUBLE_EQ(lightcone_beta(-12.0, 5.0), -12.0 / 13.0);
  EXPECT_LT(lightcone_beta(16.0, 128.0), 1.0);
  EXPECT_LT(lightcone_beta(1e6, 128.0), 1.0);
  for (const double d : {0.1, 7.0, 100.0, 5000.0}) {
    const double L = 128.0;
    EXPECT_NEAR(lightcone_beta(d, L), std::tanh(std::asinh(d / L)), 1e-14) << d;
    EXPECT_NEAR(lightcone_phi(d, L), L * std::asinh(d / L), 1e-12 * L) << d;
  }
}

TEST(Charts, RopeFrequencies) {
  const auto w = rope_frequencies(10000.0, 64, 32);
  ASSERT_EQ(w.size(), 32u);
  EXPECT_DOUBLE_EQ(w[0], 1.0);
  EXPECT_NEAR(w[8], 0.1, 1e-15);    // 10000^(-16/64)
  EXPECT_NEAR(w[16], 0.01, 1e-16);  // 10000^(-32/64)
  for (int k = 0; k < 32; ++k) EXPECT_NEAR(w[k], std::pow(10.0, -k / 8.0), 1e-15 * w[k]) << k;
  for (int k = 1; k < 32; ++k) EXPECT_LT(w[k], w[k - 1]);
  // spec 1.3: hd=32, m=2 uses omega_0..omega_7 = 10000^(-b/16), the prefix of the hd=32 grid
  const auto p = rope_frequencies(10000.0, 32, 8);
  ASSERT_EQ(p.size(), 8u);
  for (int b = 0; b < 8; ++b) EXPECT_NEAR(p[b], std::pow(10000.0, -b / 16.0), 1e-15) << b;
  // another theta
  const auto q = rope_frequencies(500.0, 8, 4);
  EXPECT_NEAR(q[1], std::pow(500.0, -0.25), 1e-15);
  EXPECT_NEAR(q[3], std::pow(500.0, -0.75), 1e-15);
  // spanning grid: theta^(-2km/hd), hd/(2m) entries
  const auto s = spanning_frequencies(10000.0, 64, 2);
  ASSERT_EQ(s.size(), 16u);
  EXPECT_NEAR(s[8], 0.01, 1e-16);  // 10000^(-32/64)
  EXPECT_NEAR(s[15], std::pow(10000.0, -60.0 / 64.0), 1e-17);
}

TEST(Charts, AlibiSlopesReferenceValues) {
  const std::vector<double> n4 = {0.25, 0.0625, 0.015625, 0.00390625};
  const std::vector<double> n6 = {0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125};
  EXPECT_EQ(alibi_slopes(4), n4);
  EXPECT_EQ(alibi_slopes(6), n6);
  const auto s8 = alibi_slopes(8);
  ASSERT_EQ(s8.size(), 8u);
  for (int h = 0; h < 8; ++h) EXPECT_DOUBLE_EQ(s8[h], std::ldexp(1.0, -(h + 1))) << h;
  // n = 1: 2^-8; n = 3: (2^-4, 2^-8) then slope 0 of the n = 4 grid
  EXPECT_EQ(alibi_slopes(1), std::vector<double>{0.00390625});
  EXPECT_EQ(alibi_slopes(3), (std::vector<double>{0.0625, 0.00390625, 0.25}));
  // n = 12: 2^-1..2^-8, then entries 0, 2, 4, 6 of the n = 16 grid (2^-0.5, 2^-1.5, ...)
  const auto s12 = alibi_slopes(12);
  ASSERT_EQ(s12.size(), 12u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(s12[8 + i], std::pow(2.0, -0.5 - i), 1e-15) << i;
  EXPECT_THROW(alibi_slopes(0), InputError);
}

TEST(Charts, AccurateSincosMatchesLongDoubleAtLargeArguments) {
  static_assert(std::numeric_limits<long double>::digits >= 64, "need extended long double");
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> W(0.3, 1.0), P(1e4, 1e5);
  double worst = 0, worst_plain = 0;
  for (int n = 0; n < 2000; ++n) {
    // w with 40 significant bits and p with < 20: w * p is exact in a 64-bit long double
    // mantissa but not in a double
    const double w = std::ldexp(std::round(std::ldexp(W(rng), 40)), -40);
    const double p = std::round(P(rng)) + (n % 3) * 0.25;
    double s, c;
    accurate_sincos(w, p, &s, &c);
    const long double a = static_cast<long double>(w) * static_cast<long double>(p);
    const double ts = static_cast<double>(std::sin(a)), tc = static_cast<double>(std::cos(a));
    worst = std::max({worst, std::abs(s - ts), std::abs(c - tc)});
    worst_plain = std::max({worst_plain, std::abs(std::sin(w * p) - ts), std::abs(std::cos(w * p) - tc)});
  }
  EXPECT_LT(worst, 5e-16);
  // the plain product really is worse at these arguments, so the check has teeth
  EXPECT_GT(worst_plain, 1e-13);
  // small arguments: identical to sin/cos
  double s, c;
  accurate_sincos(0.5, 3.0, &s, &c);
  EXPECT_DOUBLE_EQ(s, std::sin(1.5));
  EXPECT_DOUBLE_EQ(c, std::cos(1.5));
}

TEST(Types, LayoutNamesRoundTrip) {
  EXPECT_EQ(parse_layout(to_string(Layout::Interleaved)), Layout::Interleaved);
  EXPECT_EQ(parse_layout(to_string(Layout::HalfSplit)), Layout::HalfSplit);
  EXPECT_EQ(parse_layout("neox"), Layout::HalfSplit);
  EXPECT_THROW(parse_layout("diagonal"), InputError);
}
