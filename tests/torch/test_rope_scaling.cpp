// Context extension through the torch module (docs/rope-scaling.md): PositionEncoding with a rule
// equals the plain rotary mechanism at the rescaled frequencies, composed from LibTorch ops, times
// the attention factor (forward and backward); a dynamic rule follows the call's length.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/registry.hpp"
#include "core/rope_scaling.hpp"
#include "torch/attention.hpp"
#include "torch/composed.hpp"
#include "torch/encoding.hpp"

using namespace relpos;

namespace {

struct Result {
  torch::Tensor q, k, gq, gk;
};

// forward and the gradients of a fixed random projection of the outputs
Result run(
    const std::function<std::vector<torch::Tensor>(const torch::Tensor&, const torch::Tensor&)>& f,
    const torch::Tensor& q0, const torch::Tensor& k0) {
  auto q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true);
  const auto out = f(q, k);
  torch::manual_seed(11);
  const auto wq = torch::randn_like(out[0]), wk = torch::randn_like(out[1]);
  ((out[0] * wq).sum() + (out[1] * wk).sum()).backward();
  return {out[0].detach(), out[1].detach(), q.grad(), k.grad()};
}

double max_diff(const Result& a, const Result& b) {
  double d = 0;
  for (auto [x, y] : {std::pair{a.q, b.q}, {a.k, b.k}, {a.gq, b.gq}, {a.gk, b.gk}})
    d = std::max(d, (x - y).abs().max().item<double>());
  return d;
}

}  // namespace

TEST(RopeScalingEncoding, EqualsPlainRotaryAtTheRescaledFrequencies) {
  struct Case {
    const char* spec;
    int D;
    const char* plain;  // the rotary term alone
  };
  for (const Case c :
       {Case{"rope + yarn(factor=4, original=16)", 8, "rope"},
        Case{"rope + linear(factor=3)", 8, "rope"},
        Case{"rope + llama3(factor=8, original=16)", 8, "rope"},
        Case{"rope + pj_yarn(L=16)", 8, "rope"}, Case{"rope + pj_pi(L=16)", 8, "rope"},
        Case{"rope + dynamic_ntk(factor=2, original=16)", 8, "rope"},
        Case{"rope + longrope(factor=4, original=16, short_factor=1.5, long_factor=1/2/3/4)", 8,
             "rope"},
        Case{"jordan(m=2, regime=raw) + pj_dynamic_ntk(L=16)", 16, "jordan(m=2, regime=raw)"}}) {
    for (int64_t T : {12, 40}) {
      SCOPED_TRACE(fmt::format("{} T={}", c.spec, T));
      torch::manual_seed(3);
      nn::PositionEncoding enc(c.spec, c.D, 2);
      enc->to(torch::kDouble);
      const auto q = torch::randn({2, 2, T, c.D}, torch::kDouble);
      const auto k = torch::randn({2, 2, T, c.D}, torch::kDouble);
      const auto pos = torch::arange(T, torch::kDouble);
      const Result got = run(
          [&](const torch::Tensor& a, const torch::Tensor& b) {
            const auto o = enc->forward(a, b, pos);
            return std::vector<torch::Tensor>{o.q, o.k};
          },
          q, k);
      // the plain mechanism with the frequencies of the rule at length T, by hand
      Mechanism plain = build_mechanism(c.plain, c.D, 2);
      const Mechanism at = scaled_for_length(enc->mechanism(), static_cast<double>(T));
      plain.transforms[0].segments[0].omega = at.segments()[0].omega;
      const double af = attention_factor(enc->mechanism(), static_cast<double>(T));
      if (std::string(c.spec).find("yarn") != std::string::npos && T > 16) {
        EXPECT_GT(af, 1.0);
      }
      const auto kp = enc->kernel_params();
      const double center = enc->center_for(pos);
      const Result want = run(
          [&](const torch::Tensor& a, const torch::Tensor& b) {
            auto o = nn::composed_transform_qk(plain, Layout::Interleaved, kp, a, b, pos, center);
            return std::vector<torch::Tensor>{o[0] * af, o[1] * af};
          },
          q, k);
      EXPECT_LT(max_diff(got, want), 1e-12);
    }
  }
}

TEST(RopeScalingEncoding, DynamicRuleFollowsTheCallLength) {
  nn::PositionEncoding enc("rope + pj_dynamic_ntk(L=16)", 8, 1);
  nn::PositionEncoding plain("rope", 8, 1);
  enc->to(torch::kDouble);
  plain->to(torch::kDouble);
  torch::manual_seed(5);
  const auto q = torch::randn({1, 1, 40, 8}, torch::kDouble);
  const auto k = torch::randn({1, 1, 40, 8}, torch::kDouble);
  // up to the training length: plain RoPE, bit for bit
  const auto short_q = q.narrow(2, 0, 16), short_k = k.narrow(2, 0, 16);
  EXPECT_TRUE(torch::equal(enc->forward(short_q, short_k).q, plain->forward(short_q, short_k).q));
  // beyond it the same tokens are rotated differently, and differently for every length
  const auto at40 = enc->forward(q, k).q.narrow(2, 0, 16);
  const auto at20 = enc->forward(q.narrow(2, 0, 20), k.narrow(2, 0, 20)).q.narrow(2, 0, 16);
  const auto at16 = enc->forward(short_q, short_k).q;
  EXPECT_GT((at40 - at16).abs().max().item<double>(), 1e-3);
  EXPECT_GT((at40 - at20).abs().max().item<double>(), 1e-3);
  // position 0 does not rotate whatever the frequencies
  EXPECT_LT((at40.narrow(2, 0, 1) - at16.narrow(2, 0, 1)).abs().max().item<double>(), 1e-15);
  // the length is the largest position + 1, not the number of tokens
  const auto far = torch::tensor({0.0, 39.0}, torch::kDouble);
  const auto two_q = q.narrow(2, 0, 2), two_k = k.narrow(2, 0, 2);
  const auto o = enc->forward(two_q, two_k, far);
  Mechanism m = build_mechanism("rope", 8, 1);
  m.transforms[0].segments[0].omega = scaled_for_length(enc->mechanism(), 40).segments()[0].omega;
  const auto want = nn::composed_transform_qk(m, Layout::Interleaved, plain->kernel_params(), two_q,
                                              two_k, far, 0.0);
  EXPECT_LT((o.q - want[0]).abs().max().item<double>(), 1e-12);
}

// The attention path with the encoding: the factor reaches the logits (as its square).
TEST(RopeScalingEncoding, AttentionSeesTheAttentionFactor) {
  nn::PositionEncoding enc("rope + yarn(factor=16, original=8)", 8, 2);
  enc->to(torch::kDouble);
  torch::manual_seed(7);
  const auto q = torch::randn({1, 2, 24, 8}, torch::kDouble);
  const auto k = torch::randn({1, 2, 24, 8}, torch::kDouble);
  const auto v = torch::randn({1, 2, 24, 8}, torch::kDouble);
  const auto got = nn::attention(q, k, v, *enc);
  const double af = 0.1 * std::log(16.0) + 1;
  const auto o = enc->forward(q, k);  // already times af
  nn::AttentionArgs a;
  const auto want = nn::composed_attention(o.q, o.k, v, a);
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-12);
  // and without the factor the result differs
  const auto without = nn::composed_attention(o.q / af, o.k / af, v, a);
  EXPECT_GT((got - without).abs().max().item<double>(), 1e-3);
}
