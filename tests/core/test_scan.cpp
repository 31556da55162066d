// The causal scan (kernels/scan.hpp): both modes against float64 sums written from their
// definitions, the backward as the exact adjoint (<g, scan a> = <scan^T g, a>), causality of the
// exclusive mode and the reference mode's leak, and fp32 accuracy over long sequences.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/types.hpp"
#include "kernels/scan.hpp"
#include "test_util.hpp"

using namespace relpos;
using namespace relpos::kernels;

namespace {

// Phi_t by definition, float64 (a: [T, C] of one batch row).
std::vector<double> scan_by_definition(ScanMode mode, const std::vector<double>& a, int64_t T,
                                       int64_t C) {
  std::vector<double> phi(a.size(), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double s = 0;
      if (mode == ScanMode::Exclusive) {
        for (int64_t u = 0; u < t; ++u) s += a[u * C + c];
      } else {
        for (int64_t u = 0; u <= T - 1 - t; ++u) s += a[u * C + c];
      }
      phi[t * C + c] = s;
    }
  return phi;
}

}  // namespace

TEST(CausalScan, MatchesDefinitionAndBackwardIsTheAdjoint) {
  std::mt19937_64 rng(3);
  for (ScanMode mode : {ScanMode::Exclusive, ScanMode::ReversedInclusive})
    for (auto [B, T, C] :
         {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {2, 7, 3}, {3, 33, 45}}) {
      const ScanDims d{B, T, C};
      const auto a = test::normal_vec(static_cast<size_t>(B * T * C), rng);
      const auto g = test::normal_vec(a.size(), rng);
      std::vector<double> phi(a.size()), da(a.size());
      causal_scan_forward<double>(mode, d, a.data(), phi.data());
      causal_scan_backward<double>(mode, d, g.data(), da.data());
      for (int64_t b = 0; b < B; ++b) {
        const std::vector<double> ab(a.begin() + b * T * C, a.begin() + (b + 1) * T * C);
        const auto want = scan_by_definition(mode, ab, T, C);
        for (int64_t i = 0; i < T * C; ++i) ASSERT_NEAR(phi[b * T * C + i], want[i], 1e-12);
      }
      double lhs = 0, rhs = 0;
      for (size_t i = 0; i < a.size(); ++i) lhs += g[i] * phi[i], rhs += da[i] * a[i];
      EXPECT_NEAR(lhs, rhs, 1e-10 * (std::abs(lhs) + 1));
    }
}

// Exclusive: Phi_t never depends on a_s for s >= t (the journey of the paper is causal). The
// reference's reversed inclusive sum does, for t in the second half: the leak the spec describes.
TEST(CausalScan, ExclusiveIsCausalReferenceModeLeaks) {
  const int64_t T = 20, C = 2;
  std::vector<double> a(T * C, 0.5), phi0(a.size()), phi1(a.size());
  for (ScanMode mode : {ScanMode::Exclusive, ScanMode::ReversedInclusive}) {
    bool leaked = false;
    for (int64_t s = 0; s < T; ++s) {
      auto b = a;
      b[s * C] += 1.0;  // perturb the token at position s
      causal_scan_forward<double>(mode, {1, T, C}, a.data(), phi0.data());
      causal_scan_forward<double>(mode, {1, T, C}, b.data(), phi1.data());
      for (int64_t t = 0; t <= s; ++t)
        if (phi0[t * C] != phi1[t * C]) leaked = true;
    }
    EXPECT_EQ(leaked, mode == ScanMode::ReversedInclusive);
  }
}

// fp32 with compensation stays at float64 accuracy over 10^5 steps of O(1) increments, where a
// plain fp32 running sum drifts by ~1e-3.
TEST(CausalScan, CompensatedFloatKeepsLongPhases) {
  const int64_t T = 100000, C = 4;
  std::mt19937_64 rng(9);
  std::vector<double> a = test::normal_vec(static_cast<size_t>(T * C), rng);
  for (auto& x : a) x = 1.0 + 0.3 * x;
  std::vector<float> af(a.begin(), a.end()), phif(a.size());
  causal_scan_forward<float>(ScanMode::Exclusive, {1, T, C}, af.data(), phif.data());
  double worst = 0, naive_worst = 0;
  std::vector<double> exact(C, 0.0);
  std::vector<float> naive(C, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      worst = std::max(worst, std::abs(phif[t * C + c] - exact[c]) / std::max(1.0, exact[c]));
      naive_worst = std::max(naive_worst, std::abs(naive[c] - exact[c]) / std::max(1.0, exact[c]));
      exact[c] += static_cast<double>(af[t * C + c]);
      naive[c] += af[t * C + c];
    }
  EXPECT_LT(worst, 1e-7);  // the rounding of the stored fp32 result itself
  EXPECT_GT(naive_worst, 10 * worst);
}

TEST(CausalScan, RejectsBadArguments) {
  std::vector<float> x(4);
  EXPECT_THROW(causal_scan_forward<float>(ScanMode::Exclusive, {1, -1, 2}, x.data(), x.data() + 2),
               InputError);
  EXPECT_THROW(causal_scan_forward<float>(ScanMode::Exclusive, {1, 2, 2}, x.data(), x.data()),
               InputError);
  EXPECT_THROW(causal_scan_backward<float>(ScanMode::Exclusive, {1, 2, 2}, nullptr, x.data()),
               InputError);
}
