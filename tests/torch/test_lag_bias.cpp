// Learned lag tables through the torch layer, for every mechanism of the catalog that has one
// (no per-family code): the module registers the kernel's parameters under its names and shapes;
// the runtime's table (float64, LibTorch ops) equals the core's float64 table at the same values;
// its gradient in every parameter matches central differences; the fused attention with the
// module's table equals a materialised composition, forward and parameter gradients.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include "core/registry.hpp"
#include "torch/attention.hpp"
#include "torch/mechanisms/lag_runtime.hpp"

using namespace relpos;

namespace {

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const double den = std::max(b.abs().max().item<double>(), 1e-300);
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() / den;
}

// Every catalog mechanism with a learned lag table, at its defaults.
std::vector<std::string> learned_specs() {
  std::vector<std::string> out;
  for (const auto& info : mechanism_catalog())
    if (info.kind == "bias" && build_mechanism(info.name, 8, 2).learned_lag_bias())
      out.push_back(info.name);
  return out;
}

// The parameters moved off their initial values (so every term of the table matters), generically.
void perturb(nn::PositionEncodingImpl& enc) {
  torch::NoGradGuard g;
  for (const auto& p : enc.lag_parameters()) p.add_(torch::rand_like(p) - 0.5);
}

}  // namespace

TEST(LagBiasTorch, ModuleParametersAreTheKernels) {
  const auto specs = learned_specs();
  ASSERT_GE(specs.size(), 3u);
  for (const auto& spec : specs) {
    SCOPED_TRACE(spec);
    nn::PositionEncoding enc(spec, 8, 3);
    const auto params = enc->mechanism().learned_lag_bias()->learned->params(3);
    const auto named = enc->named_parameters(), kept = enc->named_buffers();
    ASSERT_EQ(enc->lag_parameters().size(), params.size());
    // learnable where the table reads it (each then gets a gradient from it); a part the spec
    // leaves off is a buffer under the same name, which changes nothing in the table
    const auto table = enc->lag_table(12);
    table.sum().backward();
    for (const auto& p : params) {
      const torch::Tensor* t = p.trained ? named.find(p.name) : kept.find(p.name);
      ASSERT_TRUE(t) << p.name;
      EXPECT_EQ(t->sizes(), c10::IntArrayRef(p.shape)) << p.name;
      EXPECT_EQ(t->requires_grad(), p.trained) << p.name;
      if (p.trained) {
        EXPECT_TRUE(t->grad().defined()) << p.name;
      } else {
        torch::NoGradGuard no_grad;
        t->add_(0.5);
        EXPECT_TRUE(torch::equal(enc->lag_table(12), table.detach())) << p.name;
      }
    }
  }
}

TEST(LagBiasTorch, RuntimeTableEqualsCoreTableAndItsGradientIsRight) {
  torch::manual_seed(3);
  for (const auto& spec : learned_specs()) {
    SCOPED_TRACE(spec);
    const int H = 2;
    nn::PositionEncoding enc(spec, 8, H);
    perturb(*enc);
    const LagKernel& k = *enc->mechanism().learned_lag_bias()->learned;
    // float64 table at the module's values against the core's reference formula
    const int64_t len = 300;
    const auto t = enc->lag_table(len);
    ASSERT_EQ(t.scalar_type(), torch::kDouble);
    const auto want =
        torch::tensor(lag_table(k, enc->lag_values(), H, len), torch::kDouble).view({H, len});
    EXPECT_LT(rel_err(t, want), 1e-12);
    // gradient of <W, table> in every parameter entry against central differences (float64)
    std::vector<torch::Tensor> p64;
    for (const auto& p : enc->lag_parameters())
      p64.push_back(p.detach().to(torch::kDouble).requires_grad_());
    const int64_t n = 40;
    const auto W = torch::randn({H, n}, torch::kDouble);
    const auto loss = [&](const std::vector<torch::Tensor>& ps) {
      return (nn::lag_table(k, H, ps, n) * W).sum();
    };
    const auto grads = torch::autograd::grad({loss(p64)}, p64, {}, false, false, true);
    const double eps = 1e-6;
    for (size_t i = 0; i < p64.size(); ++i) {
      auto num = torch::zeros_like(p64[i]);
      for (int64_t j = 0; j < p64[i].numel(); ++j) {
        auto shifted = [&](double s) {
          std::vector<torch::Tensor> ps;
          for (const auto& p : p64) ps.push_back(p.detach().clone());
          ps[i].view(-1)[j] += s;
          return loss(ps).item<double>();
        };
        num.view(-1)[j] = (shifted(eps) - shifted(-eps)) / (2 * eps);
      }
      const auto g = grads[i].defined() ? grads[i] : torch::zeros_like(num);
      EXPECT_LT((g - num).abs().max().item<double>(), 1e-6 * (1 + num.abs().max().item<double>()))
          << enc->mechanism().learned_lag_bias()->learned->params(H)[i].name;
    }
  }
}

TEST(LagBiasTorch, FusedAttentionWithTheModuleTableEqualsMaterialisedComposition) {
  torch::manual_seed(4);
  const int64_t B = 1, H = 2, T = 24, D = 8;
  for (const auto& spec : learned_specs()) {
    SCOPED_TRACE(spec);
    nn::PositionEncoding enc(spec, D, H);
    perturb(*enc);
    const auto q = torch::randn({B, H, T, D}), k = torch::randn({B, H, T, D}),
               v = torch::randn({B, H, T, D});
    const auto out = nn::attention(q, k, v, *enc, {});
    std::vector<torch::Tensor> params;
    for (const auto& p : enc->lag_parameters())
      if (p.requires_grad()) params.push_back(p);
    const auto dout = torch::randn_like(out);
    const auto g = torch::autograd::grad({(out * dout).sum()}, params, {}, false, false, true);
    // materialised: softmax(q k^T / sqrt(D) + table[i - j]) v over j <= i, float64
    const auto i = torch::arange(T, torch::kLong);
    const auto lag = (i.view({T, 1}) - i.view({1, T})).clamp_min(0);
    const auto table = enc->lag_table(T);
    const auto bias = table.index_select(1, lag.flatten()).view({H, T, T});
    auto s = torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).transpose(-1, -2)) /
                 std::sqrt(static_cast<double>(D)) +
             bias.unsqueeze(0);
    s = s.masked_fill(torch::ones({T, T}).tril().logical_not(),
                      -std::numeric_limits<double>::infinity());
    const auto ref = torch::matmul(torch::softmax(s, -1), v.to(torch::kDouble));
    EXPECT_LT(rel_err(out, ref), 1e-5);
    const auto g_ref = torch::autograd::grad({(ref * dout.to(torch::kDouble)).sum()}, params, {},
                                             false, false, true);
    for (size_t j = 0; j < params.size(); ++j) {
      // a parameter the table does not use (a disabled PJ sector) gets no gradient on either side
      const auto a = g[j].defined() ? g[j] : torch::zeros_like(params[j]);
      const auto b = g_ref[j].defined() ? g_ref[j] : torch::zeros_like(params[j]);
      if (b.abs().max().item<double>() == 0) {
        EXPECT_EQ(a.abs().max().item<double>(), 0.0) << j;
        continue;
      }
      EXPECT_LT(rel_err(a, b), 1e-4) << j;
    }
  }
}
