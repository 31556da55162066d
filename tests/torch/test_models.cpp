// Transformer LMs: shapes, the reference block's parameter layout (tied head, bias-free), causality
// through every layer, gradients reaching the mechanism's parameters, and named config errors.
#include <gtest/gtest.h>

#include "core/types.hpp"
#include "models/transformer.hpp"

using namespace relpos;

namespace {
models::ModelConfig small(const std::string& mechanism,
                          models::Preset preset = models::Preset::Jordan) {
  models::ModelConfig c;
  c.preset = preset;
  c.vocab = 11;
  c.d_model = 64;
  c.heads = 2;
  c.layers = 2;
  c.mlp_ratio = 2;
  c.mechanism = mechanism;
  return c;
}
}  // namespace

TEST(Models, JordanPresetHasTheReferenceParameterLayout) {
  // Table 5 model: d 128, 4 heads, 3 layers, ratio 2, vocab 3, no positional parameters (rope)
  models::ModelConfig c;
  c.mechanism = "rope";
  models::TransformerLM m(c);
  const int64_t d = 128, per_block = 3 * d * d + d * d + 2 * (2 * d * d) + 2 * d;
  EXPECT_EQ(m->parameter_count(), 3 * per_block + d + 3 * d);  // blocks, final norm, tied embed
  torch::manual_seed(0);
  const auto tokens = torch::randint(0, 3, {2, 17}, torch::kLong);
  EXPECT_EQ(m->forward(tokens).sizes(), (std::vector<int64_t>{2, 17, 3}));
}

TEST(Models, EveryLayerIsCausal) {
  for (auto preset : {models::Preset::Jordan, models::Preset::PJ})
    for (const std::string spec : {"rope", "jordan(m=2, regime=raw) + alibi", "nope"}) {
      SCOPED_TRACE(spec);
      torch::manual_seed(1);
      models::TransformerLM m(small(spec, preset));
      auto tokens = torch::randint(0, 11, {1, 30}, torch::kLong);
      const auto a = m->forward(tokens);
      tokens[0][20] = (tokens[0][20].item<int64_t>() + 1) % 11;
      const auto b = m->forward(tokens);
      EXPECT_EQ((a - b).narrow(1, 0, 20).abs().max().item<double>(), 0.0);
      EXPECT_GT((a - b).narrow(1, 20, 10).abs().max().item<double>(), 0.0);
    }
}

TEST(Models, GradientsReachTheMechanismParameters) {
  torch::manual_seed(2);
  models::TransformerLM m(small("jordan(m=2, regime=scaled, c=1, eta0=0.05)"));
  const auto tokens = torch::randint(0, 11, {2, 12}, torch::kLong);
  const auto logits = m->forward(tokens);
  torch::nn::functional::cross_entropy(logits.reshape({-1, 11}), tokens.reshape({-1})).backward();
  int positional = 0;
  for (const auto& p : m->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(torch::isfinite(p.value().grad()).all().item<bool>()) << p.key();
    if (p.key().find(".pos") != std::string::npos) {
      ++positional;
      EXPECT_GT(p.value().grad().abs().max().item<double>(), 0) << p.key();
    }
  }
  EXPECT_GT(positional, 0);
}

TEST(Models, BadConfigsAreNamed) {
  auto c = small("rope");
  c.d_model = 66;
  c.heads = 4;
  EXPECT_THROW(
      {
        try {
          c.validate();
        } catch (const InputError& e) {
          EXPECT_NE(std::string(e.what()).find("not divisible by heads"), std::string::npos);
          throw;
        }
      },
      InputError);
  c = small("no_such_mechanism");
  EXPECT_THROW(c.validate(), InputError);
  EXPECT_THROW(models::parse_preset("gpt"), InputError);
  models::TransformerLM m(small("rope"));
  EXPECT_THROW(m->forward(torch::full({1, 4}, 11, torch::kLong)), InputError);
}

// sdpa_table (the SDPA model with its transform as a cos/sin table, as users write RoPE) is the
// sdpa model for transforms that rotate and scale pairs, in both layouts, values and gradients;
// a transform with learned parameters or one that is not a pair rotation is refused by name.
TEST(Models, SdpaTableIsTheSdpaModelForPairRotations) {
  for (const Layout layout : {Layout::Interleaved, Layout::HalfSplit})
    for (const std::string spec : {"rope", "xpos", "rope(theta=500)", "nope"}) {
      SCOPED_TRACE(spec + (layout == Layout::HalfSplit ? " half" : " interleaved"));
      auto c = small(spec);
      c.layout = layout;
      c.attention = "sdpa";
      torch::manual_seed(5);
      models::TransformerLM sdpa(c);
      c.attention = "sdpa_table";
      models::TransformerLM table(c);
      {
        torch::NoGradGuard ng;
        const auto src = sdpa->parameters();
        const auto dst = table->parameters();
        for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
      }
      for (const int64_t T : {40, 17}) {  // a second length makes a second table
        const auto tokens = torch::randint(0, 11, {2, T}, torch::kLong);
        const auto a = sdpa->forward(tokens), b = table->forward(tokens);
        EXPECT_LT((a - b).abs().max().item<double>(), 1e-4 * a.abs().max().item<double>());
        a.square().sum().backward();
        b.square().sum().backward();
        const auto ga = sdpa->parameters(), gb = table->parameters();
        for (size_t i = 0; i < ga.size(); ++i) {
          EXPECT_LT((ga[i].grad() - gb[i].grad()).abs().max().item<double>(),
                    1e-3 * (ga[i].grad().abs().max().item<double>() + 1e-6));
          ga[i].mutable_grad().zero_();
          gb[i].mutable_grad().zero_();
        }
      }
    }
  for (const std::string spec : {"jordan(m=2)", "orthogonal_mix + rope"}) {
    SCOPED_TRACE(spec);
    auto c = small(spec);
    c.attention = "sdpa_table";
    models::TransformerLM m(c);
    try {
      m->forward(torch::randint(0, 11, {1, 8}, torch::kLong));
      ADD_FAILURE() << "no refusal";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("sdpa_table"), std::string::npos) << e.what();
    }
  }
}

// The fused engine, the materialised composition and (mechanisms without biases) LibTorch's SDPA
// after the mechanism's transforms compute one model; SDPA refuses a bias by name.
TEST(Models, FusedComposedAndSdpaAttentionAgree) {
  {
    auto c = small("rope + alibi");
    c.attention = "sdpa";
    models::TransformerLM m(c);
    EXPECT_THROW(m->forward(torch::randint(0, 11, {1, 8}, torch::kLong)), InputError);
  }
  for (const auto& [spec, other] : {std::pair<std::string, std::string>{"rope + alibi", "composed"},
                                    {"jordan(m=2, regime=scaled, c=1, eta0=0.05)", "composed"},
                                    {"jordan(m=2, regime=scaled, c=1, eta0=0.05)", "sdpa"},
                                    {"rope", "sdpa"}}) {
    SCOPED_TRACE(spec + " " + other);
    auto c = small(spec);
    torch::manual_seed(5);
    models::TransformerLM fused(c);
    c.attention = other;
    models::TransformerLM composed(c);
    {
      torch::NoGradGuard ng;
      const auto src = fused->parameters();
      const auto dst = composed->parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
    const auto tokens = torch::randint(0, 11, {2, 40}, torch::kLong);
    const auto a = fused->forward(tokens), b = composed->forward(tokens);
    EXPECT_LT((a - b).abs().max().item<double>(), 1e-4 * b.abs().max().item<double>());
  }
}
