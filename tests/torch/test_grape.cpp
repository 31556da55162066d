// GRAPE (issue 14) in the torch layer: the fused op's gated slopes and path integrals against the
// materialised float64 composition (values and every gradient), ALiBi as the unipotent lift,
// GRAPE-M at init equal to RoPE and its frequency gradients against finite differences, the
// contextual phase's relative law, GRAPE-AP with a query-independent potential equal to FoX, the
// QK-norm gain caveat, and the Llama/GRAPE model: decode through the cache equal to the full
// forward and causality for every form, init and decay groups.
#include <gtest/gtest.h>

#include <cmath>

#include "core/charts.hpp"
#include "core/types.hpp"
#include "models/transformer.hpp"
#include "torch/attention.hpp"
#include "torch/grape.hpp"

using namespace relpos;

namespace {

const auto kF64 = torch::TensorOptions().dtype(torch::kDouble);

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-30);
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() / scale;
}

// Every GRAPE mechanism the model takes, with and without KV-shift where the paper has both.
const std::vector<std::pair<std::string, std::string>> kForms = {
    {"rope", "none"},
    {"rope", "kv"},
    {"alibi", "none"},
    {"alibi", "kv"},
    {"fox", "none"},
    {"fox", "kv"},
    {"grape_m", "none"},
    {"grape_m(context=true)", "none"},
    {"grape_m(basis=cayley)", "none"},
    {"grape_a(gate=k)", "none"},
    {"grape_a(gate=q)", "none"},
    {"grape_a(gate=qk)", "none"},
    {"grape_a(gate=qk, form=paper)", "none"},
    {"grape_ap", "none"},
    {"grape_ap", "kv"},
    {"grape_ap(form=paper)", "none"},
    {"nope", "k"},
};

models::ModelConfig grape_config(const std::string& mech, const std::string& shift) {
  models::ModelConfig c;
  c.preset = models::Preset::Grape;
  c.vocab = 11;
  c.d_model = 32;
  c.heads = 4;
  c.layers = 2;
  c.mechanism = mech;
  c.kv_shift = shift;
  return c;
}

}  // namespace

// The fused op with gated slopes and a path integral (fp32) against the materialised float64
// composition: the output and the gradients of q, k, v, gq, gk and the probes and beta.
TEST(Grape, FusedGatedSlopeAndPathIntegralMatchComposition) {
  torch::manual_seed(3);
  for (const auto& [T, P] : std::vector<std::pair<int64_t, int64_t>>{{70, 8}, {203, 4}}) {
    const int64_t B = 2, H = 3, D = 16;
    auto make = [&](std::vector<int64_t> s, double scale = 1.0) {
      return (torch::randn(s, kF64) * scale).requires_grad_(true);
    };
    auto q = make({B, H, T, D}), k = make({B, H, T, D}), v = make({B, H, T, D});
    auto gq = make({B, H, T}, 0.05), gk = make({B, H, T}, 0.05);
    auto pq = make({B, H, T, P}), pk = make({B, H, T, P});
    auto beta = (torch::rand({H}, kF64) * 0.5 + 0.05).requires_grad_(true);
    const std::vector<torch::Tensor> leaves = {q, k, v, gq, gk, pq, pk, beta};
    const auto dout = torch::randn({B, H, T, D}, kF64);
    const auto run = [&](bool fused, torch::ScalarType dt) {
      std::vector<torch::Tensor> in;
      for (const auto& t : leaves) in.push_back(t.detach().to(dt).requires_grad_(true));
      nn::AttentionArgs a;
      a.gq = in[3];
      a.gk = in[4];
      a.path_q = in[5];
      a.path_k = in[6];
      a.path_beta = in[7];
      a.path_scale = 1.0 / static_cast<double>(P);
      const auto out = fused ? nn::fused_attention(in[0], in[1], in[2], a)[0]
                             : nn::composed_attention(in[0], in[1], in[2], a);
      (out * dout.to(dt)).sum().backward();
      std::vector<torch::Tensor> r = {out.detach()};
      for (const auto& t : in) r.push_back(t.grad());
      return r;
    };
    const auto ref = run(false, torch::kDouble);
    const auto f32 = run(true, torch::kFloat);
    const auto f64 = run(true, torch::kDouble);
    const char* names[] = {"out", "dq", "dk", "dv", "dgq", "dgk", "dpath_q", "dpath_k", "dbeta"};
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_LT(rel_err(f32[i], ref[i]), 1e-5) << names[i] << " T=" << T;
      EXPECT_LT(rel_err(f64[i], ref[i]), 1e-10) << names[i] << " T=" << T;
    }
  }
}

// ALiBi as the rank-1 unipotent lift: q^ = [q/sqrt D; 0; 1], k^ = [k; 1; 0], A = m e_{D+1} e_D^T,
// queries G(i)^{-T} q^, keys G(j) k^ with G(n) = I + n A give q^T G(j - i) k^ = q.k/sqrt D -
// m (i - j): attention on the lifted vectors equals the slope form to 1e-12 (fp64).
TEST(Grape, AlibiUnipotentLiftEqualsSlopes) {
  torch::manual_seed(5);
  const int64_t B = 1, H = 4, T = 37, D = 8;
  const auto q = torch::randn({B, H, T, D}, kF64), k = torch::randn({B, H, T, D}, kF64),
             v = torch::randn({B, H, T, D}, kF64);
  const auto slopes = torch::tensor(alibi_slopes(static_cast<int>(H)), kF64);
  nn::AttentionArgs a;
  a.slopes = slopes;
  const auto by_slopes = nn::fused_attention(q, k, v, a)[0];
  auto ql = torch::zeros({B, H, T, D + 2}, kF64), kl = torch::zeros({B, H, T, D + 2}, kF64);
  for (int64_t h = 0; h < H; ++h) {
    auto A = torch::zeros({D + 2, D + 2}, kF64);
    A[D + 1][D] = slopes[h];
    for (int64_t t = 0; t < T; ++t) {
      const auto G = torch::eye(D + 2, kF64) + static_cast<double>(t) * A;
      auto qh = torch::cat({q[0][h][t] / std::sqrt(double(D)), torch::tensor({0.0, 1.0}, kF64)});
      auto kh = torch::cat({k[0][h][t], torch::tensor({1.0, 0.0}, kF64)});
      ql[0][h][t] = torch::linalg_solve(G.t(), qh, true);  // G^{-T} q^
      kl[0][h][t] = torch::matmul(G, kh);
    }
  }
  nn::AttentionArgs lifted;
  lifted.scale = 1.0;
  const auto vl = torch::cat({v, torch::zeros({B, H, T, 2}, kF64)}, -1);
  const auto by_lift = nn::fused_attention(ql, kl, vl, lifted)[0].narrow(-1, 0, D);
  EXPECT_LT((by_lift - by_slopes).abs().max().item<double>(), 1e-12);
}

// GRAPE-M at its initial log-frequencies is RoPE (half-split, base 10000) to 1e-12; its frequency
// gradient matches central differences.
TEST(Grape, GrapeMAtInitIsRopeAndItsFrequencyGradientIsRight) {
  torch::manual_seed(7);
  const int64_t d = 32, H = 2, T = 23;
  nn::GrapeAttention gm("grape_m", d, H, nn::KvShift::None), rope("rope", d, H, nn::KvShift::None);
  gm->to(torch::kDouble);
  gm->reset_frequencies();  // the RoPE spectrum exactly in float64
  rope->to(torch::kDouble);
  const auto x = torch::randn({1, T, d}, kF64);
  const auto q = torch::randn({1, H, T, d / H}, kF64), k = torch::randn({1, H, T, d / H}, kF64),
             v = torch::randn({1, H, T, d / H}, kF64);
  const auto a = gm->parts(x, q, k, v), b = rope->parts(x, q, k, v);
  EXPECT_LT((a.q - b.q).abs().max().item<double>(), 1e-12);
  EXPECT_LT((a.k - b.k).abs().max().item<double>(), 1e-12);
  // d loss / d lambda against central differences
  const auto w = torch::randn({1, H, T, d / H}, kF64);
  auto lam = gm->named_parameters()["log_freq"];
  (gm->forward(x, q, k, v) * w).sum().backward();
  const auto g = lam.grad().clone();
  torch::NoGradGuard no_grad;
  for (int64_t m : {0, 3, 7}) {
    const double h = 1e-5, x0 = lam[m].item<double>();
    lam[m] = x0 + h;
    const double up = (gm->forward(x, q, k, v) * w).sum().item<double>();
    lam[m] = x0 - h;
    const double dn = (gm->forward(x, q, k, v) * w).sum().item<double>();
    lam[m] = x0;
    const double fd = (up - dn) / (2 * h);
    EXPECT_NEAR(g[m].item<double>(), fd, 1e-6 * std::max(1.0, std::abs(fd))) << "plane " << m;
  }
}

// GRAPE-M with a learned commuting basis: E = I at init is GRAPE-M; a random skew matrix keeps the
// exact relative law (scores of equal lags agree to 1e-12).
TEST(Grape, LearnedBasisKeepsTheRelativeLaw) {
  torch::manual_seed(8);
  const int64_t d = 16, H = 1, T = 12, D = 16;
  nn::GrapeAttention with("grape_m(basis=cayley)", d, H, nn::KvShift::None),
      plain("grape_m", d, H, nn::KvShift::None);
  with->to(torch::kDouble);
  plain->to(torch::kDouble);
  const auto x = torch::randn({1, T, d}, kF64);
  const auto q = torch::randn({1, H, 1, D}, kF64).expand({1, H, T, D}).contiguous(),
             k = torch::randn({1, H, 1, D}, kF64).expand({1, H, T, D}).contiguous();
  EXPECT_LT((with->parts(x, q, k, k).q - plain->parts(x, q, k, k).q).abs().max().item<double>(),
            1e-12);
  {
    torch::NoGradGuard no_grad;
    with->named_parameters()["basis_w"].normal_(0.0, 0.3);
  }
  const auto p = with->parts(x, q, k, k);
  const auto s = torch::matmul(p.q, p.k.transpose(-1, -2))[0][0];
  EXPECT_LT((s.narrow(0, 1, T - 1).narrow(1, 1, T - 1) - s.narrow(0, 0, T - 1).narrow(1, 0, T - 1))
                .abs()
                .max()
                .item<double>(),
            1e-12);
  EXPECT_GT((p.q - plain->parts(x, q, k, k).q).abs().max().item<double>(), 1e-3);
}

// GRAPE-M-ctx: scores depend on Phi_i - Phi_j only (a constant added to every phase leaves the
// output unchanged), and with w = 0 it is RoPE at positions omega t, omega = sigmoid(b / 16).
TEST(Grape, ContextualPhaseRelativeLaw) {
  torch::manual_seed(9);
  const int64_t d = 32, H = 2, T = 29;
  nn::GrapeAttention gm("grape_m(context=true)", d, H, nn::KvShift::None);
  gm->to(torch::kDouble);
  gm->reset_frequencies();
  {
    torch::NoGradGuard no_grad;
    gm->named_parameters()["ctx_w"].normal_(0.0, 0.3);
  }
  const auto x = torch::randn({2, T, d}, kF64);
  const auto q = torch::randn({2, H, T, d / H}, kF64), k = torch::randn({2, H, T, d / H}, kF64),
             v = torch::randn({2, H, T, d / H}, kF64);
  torch::NoGradGuard no_grad;
  const auto base = gm->forward(x, q, k, v);
  nn::GrapeDecodeState shifted;
  shifted.phase = torch::full({2, 1}, 1234.5678, kF64);
  const auto moved = gm->step(x, q, k, v, shifted);
  EXPECT_LT((moved - base).abs().max().item<double>(), 1e-9);
  // w = 0: positions omega t
  gm->named_parameters()["ctx_w"].zero_();
  const double b = gm->named_parameters()["ctx_b"].item<double>();  // ln(e^0.001 - 1) in fp32
  EXPECT_NEAR(b, std::log(std::expm1(1e-3)), 1e-6);
  const double omega = 1.0 / (1.0 + std::exp(-b / 16.0));
  EXPECT_NEAR(omega, 0.394, 1e-3);
  const auto p = gm->parts(x, q, k, v);
  nn::PositionEncoding rope("rope", d / H, H, nn::EncodingOptions{Layout::HalfSplit, false});
  rope->to(torch::kDouble);
  const auto r = rope->forward(q, k, torch::arange(T, kF64) * omega);
  const auto norm = [](const torch::Tensor& y) {
    return y * torch::rsqrt(y.square().mean(-1, true) + 1e-5);
  };
  EXPECT_LT((p.q - norm(r.q)).abs().max().item<double>(), 1e-12);
}

// GRAPE-AP with a query-independent potential is FoX: path_q = 1, path_k = a_l, beta = 1 give
// edges logsigmoid(a_l), the same as cq = ck = c with c the inclusive cumulative sum.
TEST(Grape, PathIntegralWithQueryIndependentPotentialIsFox) {
  torch::manual_seed(11);
  const int64_t B = 2, H = 3, T = 150, D = 8;
  const auto q = torch::randn({B, H, T, D}, kF64), k = torch::randn({B, H, T, D}, kF64),
             v = torch::randn({B, H, T, D}, kF64);
  const auto a_l = torch::randn({B, H, T, 1}, kF64);
  nn::AttentionArgs path;
  path.path_q = torch::ones({B, H, T, 1}, kF64);
  path.path_k = a_l;
  path.path_beta = torch::ones({H}, kF64);
  nn::AttentionArgs fox;
  fox.cq = fox.ck = torch::cumsum(torch::log_sigmoid(a_l.squeeze(-1)), -1);
  const auto x = nn::fused_attention(q, k, v, path)[0], y = nn::fused_attention(q, k, v, fox)[0];
  EXPECT_LT((x - y).abs().max().item<double>(), 1e-12);
  // and a constant potential -m_h is ALiBi
  const auto m = torch::tensor(alibi_slopes(static_cast<int>(H)), kF64);
  nn::AttentionArgs constant;
  constant.path_q = torch::ones({B, H, T, 1}, kF64);
  constant.path_k = torch::full({B, H, T, 1}, 30.0, kF64);  // logsigmoid(30) ~ -1e-13
  constant.path_beta = torch::ones({H}, kF64);
  nn::AttentionArgs gated;
  gated.gk = m.view({1, H, 1}).expand({B, H, T}).contiguous();
  nn::AttentionArgs slopes;
  slopes.slopes = m;
  EXPECT_LT((nn::fused_attention(q, k, v, gated)[0] - nn::fused_attention(q, k, v, slopes)[0])
                .abs()
                .max()
                .item<double>(),
            1e-12);
}

// Rotation then a per-coordinate gain: the relative law holds while gain_m == gain_{m+D/2} and
// breaks (reported by gain_pair_gap) otherwise.
TEST(Grape, QkNormGainCaveatIsReported) {
  torch::manual_seed(13);
  const int64_t d = 16, H = 1, T = 12;
  nn::GrapeAttention g("rope", d, H, nn::KvShift::None);
  g->to(torch::kDouble);
  const auto x = torch::randn({1, T, d}, kF64);
  auto qv = torch::randn({1, H, 1, d}, kF64).expand({1, H, T, d}).contiguous();
  auto kv = torch::randn({1, H, 1, d}, kF64).expand({1, H, T, d}).contiguous();
  const auto lag_residual = [&] {
    const auto p = g->parts(x, qv, kv, kv);
    const auto s = torch::matmul(p.q, p.k.transpose(-1, -2))[0][0];  // [T, T]
    // a relative law: s[i][j] depends on i - j only
    return (s.narrow(0, 1, T - 1).narrow(1, 1, T - 1) - s.narrow(0, 0, T - 1).narrow(1, 0, T - 1))
        .abs()
        .max()
        .item<double>();
  };
  EXPECT_EQ(g->gain_pair_gap(), 0.0);
  EXPECT_LT(lag_residual(), 1e-12);
  {
    torch::NoGradGuard no_grad;
    g->named_parameters()["q_gain"][1] = 1.5;
  }
  EXPECT_DOUBLE_EQ(g->gain_pair_gap(), 0.5);
  EXPECT_GT(lag_residual(), 1e-3);
}

// Decode through the cache (one token at a time, then in chunks) reproduces the full forward for
// every GRAPE form, with and without KV-shift.
TEST(Grape, DecodeEqualsFullForwardForEveryForm) {
  for (const auto& [mech, shift] : kForms) {
    torch::manual_seed(17);
    models::TransformerLM model(grape_config(mech, shift));
    model->eval();
    torch::NoGradGuard no_grad;
    const int64_t B = 2, T = 37;
    const auto tokens = torch::randint(0, 11, {B, T}, torch::kLong);
    const auto full = model->forward(tokens);
    std::vector<nn::GrapeDecodeState> one, chunks;
    std::vector<torch::Tensor> a, b;
    for (int64_t t = 0; t < T; ++t) a.push_back(model->step(tokens.narrow(1, t, 1), one));
    for (int64_t t = 0; t < T; t += 10) {
      const int64_t n = std::min<int64_t>(10, T - t);
      b.push_back(model->step(tokens.narrow(1, t, n), chunks));
    }
    EXPECT_LT(rel_err(torch::cat(a, 1), full), 1e-5) << mech << " kv_shift=" << shift;
    EXPECT_LT(rel_err(torch::cat(b, 1), full), 1e-5) << mech << " kv_shift=" << shift;
  }
}

// Causality: changing the tokens after position i leaves the logits up to i unchanged.
TEST(Grape, EveryFormIsCausal) {
  for (const auto& [mech, shift] : kForms) {
    torch::manual_seed(19);
    models::TransformerLM model(grape_config(mech, shift));
    torch::NoGradGuard no_grad;
    const int64_t T = 90, cut = 41;
    const auto tokens = torch::randint(0, 11, {1, T}, torch::kLong);
    auto changed = tokens.clone();
    changed.narrow(1, cut + 1, T - cut - 1).random_(0, 11);
    const auto a = model->forward(tokens).narrow(1, 0, cut + 1),
               b = model->forward(changed).narrow(1, 0, cut + 1);
    EXPECT_TRUE(torch::equal(a, b)) << mech << " kv_shift=" << shift;
  }
}

// The fused model equals the same model with materialised (composed) attention, and its
// parameter gradients match, for every additive form (fp32).
TEST(Grape, FusedModelEqualsComposedModel) {
  for (const auto& [mech, shift] : kForms) {
    auto c = grape_config(mech, shift);
    torch::manual_seed(23);
    models::TransformerLM fused(c);
    c.attention = "composed";
    torch::manual_seed(23);
    models::TransformerLM composed(c);
    const auto tokens = torch::randint(0, 11, {2, 40}, torch::kLong);
    const auto lf = fused->forward(tokens), lc = composed->forward(tokens);
    EXPECT_LT(rel_err(lf, lc), 1e-5) << mech;
    lf.square().mean().backward();
    lc.square().mean().backward();
    auto pf = fused->named_parameters(), pc = composed->named_parameters();
    for (const auto& p : pf) {
      const auto& gc = pc[p.key()].grad();
      if (!gc.defined()) continue;
      EXPECT_LT(rel_err(p.value().grad(), gc), 2e-4) << mech << " " << p.key();
    }
  }
}

// The reference's init and decay grouping: embedding N(0, 0.02), matrices N(0, 0.5/sqrt d), the
// output projections scaled by 1/sqrt(layers), gate directions and log-frequencies untouched,
// RMSNorm gains (and only they) without decay.
TEST(Grape, InitAndDecayGroups) {
  auto c = grape_config("grape_a(gate=qk)", "kv");
  c.d_model = 256;
  c.heads = 4;
  c.layers = 4;
  c.vocab = 2000;
  torch::manual_seed(29);
  models::TransformerLM model(c);
  auto p = model->named_parameters();
  const double s0 = 0.5 / 16.0;
  EXPECT_NEAR(p["embed.weight"].std().item<double>(), 0.02, 1e-3);
  EXPECT_NEAR(p["block0.qkv.weight"].std().item<double>(), s0, 1e-3);
  EXPECT_NEAR(p["block1.proj.weight"].std().item<double>(), s0 / 2, 1e-3);
  EXPECT_NEAR(p["block1.down.weight"].std().item<double>(), s0 / 2, 1e-3);
  EXPECT_NEAR(p["block0.grape0.shift_k.weight"].std().item<double>(), s0, 2e-3);
  // unit-normalised gate directions drawn N(0, 1/D): their std stays 1/sqrt(64)
  EXPECT_NEAR(p["block0.grape0.gate_u"].std().item<double>(), 0.125, 0.02);
  const auto [decay, keep] = model->decay_groups();
  // rms1, rms2, q_gain, k_gain per layer and the final rms
  EXPECT_EQ(keep.size(), static_cast<size_t>(4 * c.layers + 1));
  EXPECT_EQ(decay.size() + keep.size(), p.size());
  // SwiGLU width floor(8/3 d)
  EXPECT_EQ(p["block0.down.weight"].size(1), 8 * 256 / 3);
}

TEST(Grape, BadConfigurationsAreNamedErrors) {
  auto c = grape_config("grape_ap(probe=3)", "none");
  EXPECT_THROW(models::TransformerLM{c}, InputError);
  c = grape_config("fox", "sideways");
  EXPECT_THROW(models::TransformerLM{c}, InputError);
  c = grape_config("fox", "none");
  c.preset = models::Preset::Jordan;
  EXPECT_THROW(models::TransformerLM{c}, InputError);  // content biases need the grape preset
  c = grape_config("grape_m+fox", "none");
  EXPECT_NO_THROW(models::TransformerLM{c});
  c = grape_config("fox+grape_ap", "none");
  EXPECT_THROW(models::TransformerLM{c}, InputError);  // one content bias per layer
}
