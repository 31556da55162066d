// relpos::causal_scan through the dispatcher: forward and gradient against the same prefix sums
// composed from LibTorch ops in float64 (cumsum), both modes, fp32 and fp64; named errors.
#include <gtest/gtest.h>

#include "core/types.hpp"
#include "torch/scan.hpp"

using namespace relpos;

namespace {
// Phi by LibTorch ops: exclusive = cumsum - a; reversed inclusive = flip(cumsum) along T
torch::Tensor composed(const torch::Tensor& a, const std::string& mode) {
  const auto c = torch::cumsum(a, -2);
  return mode == "exclusive" ? c - a : torch::flip(c, {-2});
}
}  // namespace

TEST(CausalScanOp, MatchesComposedForwardAndGradient) {
  torch::manual_seed(0);
  for (const std::string mode : {"exclusive", "reversed_inclusive"})
    for (auto dt : {torch::kFloat, torch::kDouble})
      for (const auto& shape : {std::vector<int64_t>{2, 37, 5}, std::vector<int64_t>{11, 3}}) {
        SCOPED_TRACE(mode);
        const auto a = torch::randn(shape, torch::kDouble).to(dt).requires_grad_();
        const auto g = torch::randn(shape, torch::kDouble);
        const auto phi = nn::causal_scan(a, mode);
        const auto da = torch::autograd::grad({(phi * g.to(dt)).sum()}, {a})[0];
        const auto a64 = a.detach().to(torch::kDouble).requires_grad_();
        const auto ref = composed(a64, mode);
        const auto da64 = torch::autograd::grad({(ref * g).sum()}, {a64})[0];
        const double tol = dt == torch::kFloat ? 1e-5 : 1e-12;
        EXPECT_LT((phi.to(torch::kDouble) - ref).abs().max().item<double>(),
                  tol * (ref.abs().max().item<double>() + 1));
        EXPECT_LT((da.to(torch::kDouble) - da64).abs().max().item<double>(),
                  tol * (da64.abs().max().item<double>() + 1));
      }
}

TEST(CausalScanOp, NamedErrors) {
  const auto a = torch::randn({2, 3, 4});
  EXPECT_THROW(nn::causal_scan(a, "inclusive"), c10::ValueError);
  EXPECT_THROW(nn::causal_scan(torch::randn({4})), c10::ValueError);
  EXPECT_THROW(nn::causal_scan(torch::ones({2, 3}, torch::kLong)), c10::ValueError);
}
