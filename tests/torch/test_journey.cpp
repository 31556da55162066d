// The JoFormer journey transform (issue 13): the rotate_pairs op against the rotation written out
// with plain LibTorch ops, journey attention against o_i = sum_j alpha_ij R(theta_j - theta_i) v_j
// computed straight from the paper's formula in float64, exact shift invariance of fixed angles,
// per-token scores that depend only on the tokens between the two positions, angle-table gradients
// against finite differences, decode through a KV cache with the running phase, the JoFormer
// model presets, and the causality test over every mechanism of `relpos list` (which fails, as it
// must, for the reference code's reversed per-token scan).
#include <gtest/gtest.h>

#include <cmath>

#include "core/registry.hpp"
#include "core/types.hpp"
#include "kernels/attention/journey_cache.hpp"
#include "models/transformer.hpp"
#include "torch/attention.hpp"
#include "torch/journey.hpp"

using namespace relpos;

namespace {

const auto kF64 = torch::TensorOptions().dtype(torch::kDouble);

// R(a) x per pair with plain ops (interleaved pairs), a [B, T, P] broadcast over heads
torch::Tensor rotate_composed(const torch::Tensor& x, const torch::Tensor& a, bool inverse) {
  const auto s = inverse ? -1.0 : 1.0;
  const auto c = torch::cos(a).unsqueeze(1), n = s * torch::sin(a).unsqueeze(1);
  const auto x0 = x.slice(-1, 0, x.size(-1), 2), x1 = x.slice(-1, 1, x.size(-1), 2);
  return torch::stack({c * x0 - n * x1, n * x0 + c * x1}, -1).flatten(-2);
}

// The paper's journey attention, float64, from its definition: frames theta [B, T, P];
// o_i = sum_{j<=i} alpha_ij R(theta_j - theta_i) v_j with
// alpha_ij = softmax_j(q_i . R(theta_j - theta_i) k_j / sqrt(D)).
torch::Tensor journey_by_definition(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& theta) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  auto out = torch::zeros_like(q);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<torch::Tensor> kv, vv;
        std::vector<double> s;
        for (int64_t j = 0; j <= i; ++j) {
          const auto rel = (theta[b][j] - theta[b][i]).view({1, 1, 1, -1});
          const auto kj = rotate_composed(k[b][h][j].view({1, 1, 1, D}), rel, false).flatten();
          const auto vj = rotate_composed(v[b][h][j].view({1, 1, 1, D}), rel, false).flatten();
          s.push_back(q[b][h][i].dot(kj).item<double>() / std::sqrt(double(D)));
          vv.push_back(vj);
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double x : s) z += std::exp(x - mx);
        auto o = torch::zeros({D}, kF64);
        for (size_t j = 0; j < s.size(); ++j) o += std::exp(s[j] - mx) / z * vv[j];
        out[b][h][i] = o;
      }
  return out;
}

double max_abs(const torch::Tensor& a) {
  return a.abs().max().item<double>();
}

models::ModelConfig joformer(int64_t vocab, int64_t d_model, int64_t heads, int64_t layers,
                             const std::string& mechanism) {
  models::ModelConfig c;
  c.preset = models::Preset::JoFormer;
  c.vocab = vocab;
  c.d_model = d_model;
  c.heads = heads;
  c.layers = layers;
  c.mlp_ratio = 4;
  c.mechanism = mechanism;
  return c;
}

}  // namespace

TEST(Journey, RotatePairsMatchesComposedOpsAndItsGradients) {
  torch::manual_seed(1);
  for (auto dt : {torch::kDouble, torch::kFloat}) {
    const auto x = torch::randn({2, 3, 5, 8}, torch::TensorOptions().dtype(dt)).requires_grad_();
    const auto a = (3 * torch::randn({2, 5, 4}, torch::TensorOptions().dtype(dt))).requires_grad_();
    for (bool inverse : {false, true}) {
      const auto y = nn::rotate_pairs(x, a, inverse);
      const auto want = rotate_composed(x, a, inverse);
      const double tol = dt == torch::kDouble ? 1e-13 : 1e-5;
      EXPECT_LT(max_abs(y - want), tol);
      const auto g = torch::randn_like(y);
      const auto gy = torch::autograd::grad({y}, {x, a}, {g});
      const auto gw = torch::autograd::grad({want}, {x, a}, {g});
      EXPECT_LT(max_abs(gy[0] - gw[0]), tol);
      EXPECT_LT(max_abs(gy[1] - gw[1]), 10 * tol);
    }
  }
  // shared angles [T, P] and the half-split layout against the interleaved one on permuted data
  const auto x = torch::randn({2, 1, 4, 6}, kF64);
  const auto a = torch::randn({4, 3}, kF64);
  EXPECT_LT(max_abs(nn::rotate_pairs(x, a) - nn::rotate_pairs(x, a.expand({2, 4, 3}))), 1e-15);
  const auto perm = torch::tensor({0, 2, 4, 1, 3, 5}, torch::kLong);  // interleaved -> half split
  EXPECT_LT(max_abs(nn::rotate_pairs(x.index_select(3, perm), a, false, Layout::HalfSplit) -
                    nn::rotate_pairs(x, a).index_select(3, perm)),
            1e-15);
  EXPECT_THROW(nn::rotate_pairs(x, torch::randn({4, 4}, kF64)), c10::ValueError);
  EXPECT_THROW(nn::rotate_pairs(x, a.to(torch::kFloat)), c10::ValueError);
}

TEST(Journey, FixedAnglesMatchTheDefinitionAndAreExactlyShiftInvariant) {
  torch::manual_seed(2);
  const int64_t B = 2, H = 2, T = 9, D = 8;
  const auto q = torch::randn({B, H, T, D}, kF64), k = torch::randn({B, H, T, D}, kF64),
             v = torch::randn({B, H, T, D}, kF64);
  for (const std::string spec : {"journey", "journey(angles=integer)"}) {
    SCOPED_TRACE(spec);
    nn::PositionEncoding enc(spec, D, H);
    const auto pos = torch::arange(T, kF64);
    nn::AttentionArgs args;
    args.q_positions = args.k_positions = pos;
    const auto out = nn::attention(q, k, v, *enc, args);
    const auto* term = nn::journey_term(enc->mechanism());
    ASSERT_NE(term, nullptr);
    const auto theta = nn::fixed_frame_angles(*term, pos, torch::kDouble).expand({B, T, D / 2});
    EXPECT_LT(max_abs(out - journey_by_definition(q, k, v, theta)), 1e-12);
    // the same call at positions shifted by 12345.5: identical to float64 rounding
    args.q_positions = args.k_positions = pos + 12345.5;
    EXPECT_LT(max_abs(nn::attention(q, k, v, *enc, args) - out), 1e-12);
  }
  // values=false is RoFormer: the rope mechanism's output
  nn::PositionEncoding roformer("journey(values=false)", D, H), rope("rope", D, H);
  EXPECT_LT(max_abs(nn::attention(q, k, v, *roformer) - nn::attention(q, k, v, *rope)), 1e-12);
}

TEST(Journey, PerTokenScoresDependOnlyOnTheTokensBetween) {
  torch::manual_seed(3);
  const int64_t B = 1, H = 1, T = 8, D = 6, P = 3;
  const auto q = torch::randn({B, H, T, D}, kF64), k = torch::randn({B, H, T, D}, kF64),
             v = torch::randn({B, H, T, D}, kF64);
  nn::PositionEncoding enc("journey(angles=token)", D, H);
  const auto* term = nn::journey_term(enc->mechanism());
  const auto inc = torch::randn({B, T, P}, kF64);
  const auto frames = nn::content_frame_angles(*term, inc);
  // the paper's frames: Phi_t = sum_{s<t} a_s
  EXPECT_LT(max_abs(frames - (torch::cumsum(inc, 1) - inc)), 1e-14);
  nn::AttentionArgs args;
  args.k_frame = frames;
  const auto out = nn::attention(q, k, v, *enc, args);
  EXPECT_LT(max_abs(out - journey_by_definition(q, k, v, frames)), 1e-12);
  // score(i, j) = q_i . R(Phi_j - Phi_i) k_j: change every token outside [j, i) and it stays
  const auto scores = [&](const torch::Tensor& a) {
    const auto f = nn::content_frame_angles(*term, a);
    return torch::matmul(nn::rotate_pairs(q, f), nn::rotate_pairs(k, f).transpose(-1, -2))[0][0];
  };
  const auto s0 = scores(inc);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      auto a = inc.clone();
      for (int64_t s = 0; s < T; ++s)
        if (s < j || s >= i) a[0][s] += torch::randn({P}, kF64);
      EXPECT_NEAR(scores(a)[i][j].item<double>(), s0[i][j].item<double>(), 1e-12)
          << "i " << i << " j " << j;
    }
  // ... while the reference code's reversed inclusive scan reads other (later) tokens
  nn::PositionEncoding leak("journey(angles=token, scan=reversed_inclusive)", D, H);
  const auto* lt = nn::journey_term(leak->mechanism());
  auto later = inc.clone();
  later[0][T - 1] += 1.0;  // the last token: after every pair (i, j) with i < T - 1
  const auto f0 = nn::content_frame_angles(*lt, inc), f1 = nn::content_frame_angles(*lt, later);
  const auto rel = [](const torch::Tensor& f) { return f[0][1] - f[0][0]; };  // pair (1, 0)
  EXPECT_GT(max_abs(rel(f1) - rel(f0)), 0.5);
}

TEST(Journey, DecodeWithTheRunningPhaseReproducesTheFullForward) {
  torch::manual_seed(6);
  const int64_t B = 2, Hq = 4, Hk = 2, T = 11, D = 8, P = 4;
  const auto q = torch::randn({B, Hq, T, D}, kF64), k = torch::randn({B, Hk, T, D}, kF64),
             v = torch::randn({B, Hk, T, D}, kF64);
  const auto inc = torch::randn({B, T, P}, kF64);
  for (const std::string spec :
       {"journey", "journey(angles=integer) + alibi", "journey(angles=token)"}) {
    SCOPED_TRACE(spec);
    nn::PositionEncoding enc(spec, D, Hk);
    const auto* term = nn::journey_term(enc->mechanism());
    const bool token = term->time == TimeSource::ContentPhase;
    nn::AttentionArgs args;
    if (token) args.k_frame = nn::content_frame_angles(*term, inc);
    const auto full = nn::attention(q, k, v, *enc, args);
    kernels::JourneyCache<double> cache(build_mechanism(spec, D, Hq), B, Hq, Hk, D);
    for (int64_t t = 0; t < T; ++t) {
      const auto qt = q.select(2, t).contiguous(), kt = k.select(2, t).contiguous(),
                 vt = v.select(2, t).contiguous(), at = inc.select(1, t).contiguous();
      auto out = torch::empty_like(qt);
      cache.step({qt.data_ptr<double>(), size_t(qt.numel())},
                 {kt.data_ptr<double>(), size_t(kt.numel())},
                 {vt.data_ptr<double>(), size_t(vt.numel())},
                 token ? std::span<const double>(at.data_ptr<double>(), size_t(at.numel()))
                       : std::span<const double>(),
                 double(t), {out.data_ptr<double>(), size_t(out.numel())});
      EXPECT_LT(max_abs(out - full.select(2, t)), 1e-12) << "token " << t;
    }
  }
  EXPECT_THROW(
      kernels::JourneyCache<double>(
          build_mechanism("journey(angles=token, scan=reversed_inclusive)", D, Hq), B, Hq, Hk, D),
      InputError);
}

TEST(Journey, AngleTableGradientsMatchFiniteDifferences) {
  torch::manual_seed(4);
  auto c = joformer(7, 12, 1, 2, "journey(angles=token)");
  for (bool per_layer : {false, true}) {
    c.angles_per_layer = per_layer;
    models::TransformerLM m(c);
    m->to(torch::kDouble);
    const auto tokens = torch::randint(0, c.vocab, {2, 6}, torch::kLong);
    const auto w = torch::randn({2, 6, c.vocab}, kF64);
    const auto loss = [&] { return (m->forward(tokens) * w).sum(); };
    torch::Tensor table;
    for (const auto& p : m->named_parameters())
      if (p.key() == "angles0") table = p.value();
    ASSERT_TRUE(table.defined());
    const auto g = torch::autograd::grad({loss()}, {table})[0];
    EXPECT_GT(max_abs(g), 1e-6);
    torch::NoGradGuard no_grad;
    const double eps = 1e-6;
    for (int64_t r = 0; r < c.vocab; ++r)
      for (int64_t p : {0, 5}) {
        const double x = table[r][p].item<double>();
        table[r][p] = x + eps;
        const double hi = loss().item<double>();
        table[r][p] = x - eps;
        const double lo = loss().item<double>();
        table[r][p] = x;
        const double fd = (hi - lo) / (2 * eps);
        EXPECT_NEAR(g[r][p].item<double>(), fd, 1e-6 * (1 + std::abs(fd))) << r << "," << p;
      }
  }
}

TEST(Journey, JoFormerPresetShapesAndParameterCounts) {
  auto c = joformer(65, 90, 1, 1, "rope");
  models::TransformerLM roformer(c);
  // embedding, block (ln, qkv+bias, out+bias, ln, ffn with biases), head with bias; no final norm
  const int64_t d = 90, block = 2 * d + 3 * d * d + 3 * d + d * d + d + 2 * d + 4 * d * d + 4 * d +
                                4 * d * d + d;
  EXPECT_EQ(roformer->parameter_count(), 65 * d + block + d * 65 + 65);
  // per-token: the reference's d/2 embedding with a Linear expander and a [65, 45] angle table
  c.mechanism = "journey(angles=token)";
  c.embed_dim = 45;
  models::TransformerLM per_token(c);
  EXPECT_EQ(per_token->parameter_count(), 65 * 45 + (45 * d + d) + 65 * 45 + block + d * 65 + 65);
  const auto tokens = torch::randint(0, 65, {3, 20}, torch::kLong);
  EXPECT_EQ(per_token->forward(tokens).sizes(), (std::vector<int64_t>{3, 20, 65}));
  c.weights = "softplus";
  c.dropout = 0.2;
  models::TransformerLM reference(c);
  EXPECT_EQ(reference->forward(tokens).sizes(), (std::vector<int64_t>{3, 20, 65}));
  c.weights = "sigmoid";
  EXPECT_THROW(models::TransformerLM{c}, InputError);
}

// Every mechanism of `relpos list` in a 2-layer model (scaling rules on top of rope): perturbing
// the token at position s changes no logit before s. The JoFormer reference's reversed per-token
// scan fails it (the leak of grape-joformer.md 4.2), with either attention weights.
TEST(Journey, CausalityOverEveryMechanismAndTheReferenceLeak) {
  const auto causal = [](models::ModelConfig c) {
    torch::manual_seed(5);
    models::TransformerLM m(c);
    m->to(torch::kDouble);
    m->eval();
    torch::NoGradGuard no_grad;
    const int64_t T = 12;
    const auto tokens = torch::randint(0, c.vocab, {2, T}, torch::kLong);
    const auto base = m->forward(tokens);
    bool ok = true;
    for (int64_t s : {1, 5, 10}) {
      auto t = tokens.clone();
      t.select(1, s).add_(1).remainder_(c.vocab);
      const auto diff = (m->forward(t) - base).abs();
      ok = ok && diff.narrow(1, 0, s).max().item<double>() == 0.0;
      EXPECT_GT(diff.narrow(1, s, T - s).max().item<double>(), 0.0) << c.mechanism;
    }
    return ok;
  };
  // head dim 24: every family's block size divides it
  auto c = joformer(9, 48, 2, 2, "");
  c.mlp_ratio = 2;
  int checked = 0;
  for (const auto& info : mechanism_catalog()) {
    c.mechanism = info.kind == "scaling" ? "rope + " + info.name : info.name;
    if (info.name == "journey") {
      for (const std::string spec : {"journey", "journey(angles=integer)", "journey(angles=token)",
                                     "journey(values=false)"}) {
        c.mechanism = spec;
        EXPECT_TRUE(causal(c)) << spec;
      }
      for (const std::string weights : {"softmax", "softplus"}) {
        c.weights = weights;
        c.mechanism = "journey(angles=token, scan=reversed_inclusive)";
        EXPECT_FALSE(causal(c)) << "the reference scan must leak (" << weights << ")";
        c.mechanism = "journey(angles=token)";
        EXPECT_TRUE(causal(c)) << "the paper's scan is causal (" << weights << ")";
      }
      c.weights = "softmax";
    } else if (build_mechanism(c.mechanism, 24, 2).structured_term()) {
      // vector positions: the language models refuse them by name
      EXPECT_THROW(c.validate(), InputError) << c.mechanism;
    } else if (info.name.starts_with("grape") || info.name == "fox") {
      // GRAPE forms: in their own block (the Llama/GRAPE preset; tests/torch/test_grape.cpp)
      models::ModelConfig g = c;
      g.preset = models::Preset::Grape;
      EXPECT_TRUE(causal(g)) << c.mechanism;
    } else {
      EXPECT_TRUE(causal(c)) << c.mechanism;
    }
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(mechanism_catalog().size()));
}
