// The PJ bias through the engine: the torch lag table against the core's float64 table, and the
// fused attention (fp32, the table inside the kernel) against the reference's composition in
// float64 (the [H, R+1, T, T] component tensors of spec pj-rope.md 1.5, materialised scores),
// forward and the gradients of q, k, v and every PJ parameter; strict causality.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>

#include "core/pj_bias.hpp"
#include "models/transformer.hpp"
#include "torch/attention.hpp"

using namespace relpos;

namespace {

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const double den = std::max(b.abs().max().item<double>(), 1e-300);
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() / den;
}

// Wider random raw parameters than the initialisation, so that every sector and order matters.
void randomise(nn::PositionEncodingImpl& enc) {
  torch::NoGradGuard g;
  for (auto& p : enc.named_parameters())
    if (p.key().rfind("pj_", 0) == 0 && p.key() != "pj_omega") p.value().uniform_(-1.5, 1.5);
}

// The reference's composition (torch_backend.py / attention.py): T x T lags clamped at 0, each
// sector's [H, R+1, T, T] components, gated sum, causal mask (diagonal included unless
// include_self is false), softmax, weights @ v. float64 throughout.
torch::Tensor reference_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const PjBiasConfig& c,
                                  const std::map<std::string, torch::Tensor>& p,
                                  bool include_self) {
  const int64_t T = q.size(2), H = q.size(1), O = c.orders();
  const double L = c.L;
  const auto i = torch::arange(T, torch::kDouble);
  const auto lags = (i.view({T, 1}) - i.view({1, T})).clamp_min(0).view({1, 1, T, T});
  const auto P = [&](const char* n) { return p.at(n).to(torch::kDouble); };
  const auto r = torch::arange(O, torch::kDouble).view({1, O, 1, 1});  // light-cone powers
  const auto omega = P("pj_omega").view({H, 1, 1, 1});
  const auto gates = torch::softmax(
      P("pj_gate_logits")
          .masked_fill(torch::tensor({!c.fj, !c.affine, !c.lc}, torch::kBool).view({1, 3}),
                       -std::numeric_limits<double>::infinity()),
      -1);
  auto bias = torch::zeros({H, T, T}, torch::kDouble);
  if (c.fj) {
    const auto alpha = torch::softmax(P("pj_fj_alpha_logits"), -1).view({H, O, 1, 1});
    // jet_r(d): x^r / r! (the reference), or C(d, r) / L^r, written out per order
    std::vector<torch::Tensor> jr;
    for (int64_t o = 0; o < O; ++o) {
      auto t = torch::ones_like(lags);
      for (int64_t m = 0; m < o; ++m)
        t = t * (c.basis == PjJetBasis::Binomial ? lags - static_cast<double>(m) : lags) /
            (L * static_cast<double>(m + 1));
      jr.push_back(t);
    }
    const auto jets = torch::cat(jr, 1);  // [1, O, T, T]
    const auto damp = torch::nn::functional::softplus(P("pj_raw_damping")).view({H, 1, 1, 1});
    const auto comp = jets * torch::exp(-damp * lags / L) * alpha *
                      (P("pj_fj_zeta_re").view({H, O, 1, 1}) * torch::cos(omega * lags) -
                       P("pj_fj_zeta_im").view({H, O, 1, 1}) * torch::sin(omega * lags));
    bias = bias + gates.select(1, 0).view({H, 1, 1}) * comp.sum(1);
  }
  if (c.affine) {
    const auto slope = torch::nn::functional::softplus(P("pj_raw_slope")).view({H, 1, 1});
    const auto rho = c.rho == PjRho::Linear ? lags[0][0] / L : torch::asinh(lags[0][0] / L);
    bias = bias - gates.select(1, 1).view({H, 1, 1}) * slope * rho;
  }
  if (c.lc) {
    const auto alpha = torch::softmax(P("pj_lc_alpha_logits"), -1).view({H, O, 1, 1});
    const auto phi = L * torch::asinh(lags / L), beta = lags / torch::sqrt(lags * lags + L * L);
    // the paper's damped light-cone term, e^{-c phi / L}, behind lc_damping
    const auto env =
        c.lc_damped
            ? torch::exp(-torch::nn::functional::softplus(P("pj_raw_damping")).view({H, 1, 1, 1}) *
                         phi / L)
            : torch::ones_like(phi);
    const auto comp = torch::pow(beta, r) * env * alpha *
                      (P("pj_lc_zeta_re").view({H, O, 1, 1}) * torch::cos(omega * phi) -
                       P("pj_lc_zeta_im").view({H, O, 1, 1}) * torch::sin(omega * phi));
    bias = bias + gates.select(1, 2).view({H, 1, 1}) * comp.sum(1);
  }
  auto scores = torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).transpose(-1, -2)) /
                    std::sqrt(static_cast<double>(q.size(3))) +
                bias.unsqueeze(0);
  const auto mask = include_self ? torch::ones({T, T}).tril(0) : torch::ones({T, T}).tril(-1);
  scores = scores.masked_fill(mask.logical_not().to(torch::kBool),
                              -std::numeric_limits<double>::infinity());
  // a row with no valid key gets all-zero weights (the reference's masked softmax), not NaN
  auto w = torch::softmax(scores, -1);
  w = torch::nan_to_num(w, 0.0);
  return torch::matmul(w, v.to(torch::kDouble));
}

}  // namespace

TEST(PjBiasTorch, TableMatchesCoreReference) {
  torch::manual_seed(0);
  nn::PositionEncoding enc("pj_bias(sectors=fj/affine/lc, R=3, L=64, rho=lightcone)", 8, 3);
  randomise(*enc);
  const auto t = enc->lag_table(300);
  const auto c = *pj_config(*enc->mechanism().learned_lag_bias());
  const auto want = pj_lag_table(c, pj_params_from(c, enc->lag_values()), 300);
  const auto w = torch::tensor(want, torch::kDouble).view({3, 300});
  EXPECT_LT(rel_err(t, w), 1e-12);
}

TEST(PjBiasTorch, FusedForwardAndGradientsMatchReferenceComposition) {
  torch::manual_seed(1);
  const int64_t B = 2, H = 3, T = 70, D = 16;
  for (const char* spec : {"pj_bias(sectors=fj/affine/lc, R=3, L=32)",
                           "pj_bias(sectors=fj/affine, R=2, L=16, basis=binomial)",
                           "pj_bias(sectors=lc/affine, L=40, lc_damping=true, rho=lightcone)"})
    for (bool include_self : {true, false}) {
      SCOPED_TRACE(std::string(spec) + (include_self ? "" : " strict"));
      nn::PositionEncoding enc(spec, D, H);
      randomise(*enc);
      const auto q = torch::randn({B, H, T, D}).requires_grad_();
      const auto k = torch::randn({B, H, T, D}).requires_grad_();
      const auto v = torch::randn({B, H, T, D}).requires_grad_();
      const auto dout = torch::randn({B, H, T, D});
      nn::AttentionArgs args;
      args.exclude_self = !include_self;
      const auto out = nn::attention(q, k, v, *enc, args);
      std::vector<torch::Tensor> leaves{q, k, v};
      std::map<std::string, torch::Tensor> params, params64;
      for (auto& p : enc->named_parameters()) {
        leaves.push_back(p.value());
        params[p.key()] = p.value();
        params64[p.key()] = p.value().detach().to(torch::kDouble).requires_grad_();
      }
      const auto g = torch::autograd::grad({(out * dout).sum()}, leaves, {}, false, false, true);
      const auto q64 = q.detach().to(torch::kDouble).requires_grad_(),
                 k64 = k.detach().to(torch::kDouble).requires_grad_(),
                 v64 = v.detach().to(torch::kDouble).requires_grad_();
      const auto ref = reference_attention(
          q64, k64, v64, *pj_config(*enc->mechanism().learned_lag_bias()), params64, include_self);
      EXPECT_LT(rel_err(out, ref), 1e-5);
      std::vector<torch::Tensor> leaves64{q64, k64, v64};
      std::vector<std::string> names{"q", "k", "v"};
      for (auto& p : enc->named_parameters()) {
        leaves64.push_back(params64[p.key()]);
        names.push_back(p.key());
      }
      const auto g64 = torch::autograd::grad({(ref * dout.to(torch::kDouble)).sum()}, leaves64, {},
                                             false, false, true);
      for (size_t i = 0; i < g.size(); ++i) {
        if (!g64[i].defined() || g64[i].abs().max().item<double>() == 0) {
          // (the gate logits of a lone sector: softmax over one entry, gradient exactly 0)
          EXPECT_TRUE(!g[i].defined() || g[i].abs().max().item<double>() == 0) << names[i];
          continue;
        }
        EXPECT_LT(rel_err(g[i], g64[i]), 1e-5) << names[i];
      }
      if (!include_self) {
        EXPECT_EQ(out.select(2, 0).abs().max().item<double>(), 0.0);
      }
    }
}

// The parameters are the tensors the enabled sectors read; the others are buffers under the same
// names (the state dict does not depend on the sectors), so no parameter goes without a gradient
// (torch's DistributedDataParallel refuses one that does).
TEST(PjBiasTorch, SectorsLeftOffKeepBuffersNotParameters) {
  const std::map<std::string, std::set<std::string>> read = {
      {"pj_bias",
       {"omega", "gate_logits", "fj_alpha_logits", "fj_zeta_re", "fj_zeta_im", "raw_damping",
        "raw_slope"}},
      {"pj_bias(sectors=affine)", {"raw_slope"}},  // one sector: its gate is 1
      {"pj_bias(sectors=affine/lc)",
       {"omega", "gate_logits", "lc_alpha_logits", "lc_zeta_re", "lc_zeta_im", "raw_slope"}},
      {"pj_bias(sectors=lc, lc_damping=true)",
       {"omega", "lc_alpha_logits", "lc_zeta_re", "lc_zeta_im", "raw_damping"}},
      {"pj_bias(R=0)",  // orders up to 0: one weight per branch, 1
       {"omega", "gate_logits", "fj_zeta_re", "fj_zeta_im", "raw_damping", "raw_slope"}},
  };
  for (const auto& [spec, names] : read) {
    SCOPED_TRACE(spec);
    nn::PositionEncoding enc(spec, 8, 2);
    std::set<std::string> params, kept;
    for (const auto& p : enc->named_parameters()) params.insert(p.key().substr(3));
    for (const auto& b : enc->named_buffers())
      if (b.key().rfind("pj_", 0) == 0) kept.insert(b.key().substr(3));
    EXPECT_EQ(params, names);
    EXPECT_EQ(params.size() + kept.size(), 10u);
  }
}

namespace {

// A small PJ preset model with every sector of the PJ bias.
models::ModelConfig small_pj_model() {
  models::ModelConfig c;
  c.preset = models::Preset::PJ;
  c.vocab = 11;
  c.d_model = 24;
  c.heads = 2;
  c.layers = 2;
  c.mechanism = "pj_bias(sectors=fj/affine/lc, L=16)";
  return c;
}

}  // namespace

// The model with the PJ bias trains its parameters through the fused kernel, and the composed
// attention path gives the same logits.
TEST(PjBiasTorch, ModelFusedEqualsComposed) {
  torch::manual_seed(2);
  models::ModelConfig c = small_pj_model();
  c.include_self = false;
  c.freeze_qk = true;
  models::TransformerLM fused(c);
  c.attention = "composed";
  models::TransformerLM composed(c);
  {
    torch::NoGradGuard g;
    auto pf = fused->named_parameters(), pc = composed->named_parameters();
    for (auto& p : pf) pc[p.key()].copy_(p.value());
  }
  const auto tokens = torch::randint(0, 11, {2, 40});
  const auto a = fused->forward(tokens), b = composed->forward(tokens);
  EXPECT_LT(rel_err(a, b), 1e-5);
  (a.square().mean()).backward();
  for (auto& p : fused->named_parameters())
    if (p.key().find("pj_") != std::string::npos) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
    }
}

// The training summary's PJ stats (Fig. 4 bottom left, Table 4b): the sector gates (softmax over
// the enabled sectors, mean over heads) and the order masses gate x alpha_r x |zeta_r| (mean over
// heads) with their high-order sum over r >= 2, against plain loops over the parameters' values;
// a disabled sector reports nothing; the model's block reports them as attention stats.
TEST(PjBiasTorch, LagStatsAreGatesAndOrderMasses) {
  torch::manual_seed(3);
  for (const char* spec : {"pj_bias(sectors=fj/affine/lc, R=3, L=64, rho=lightcone)",
                           "pj_bias(sectors=fj/affine, R=2, L=16)"}) {
    nn::PositionEncoding enc(spec, 8, 3);
    randomise(*enc);
    const auto c = *pj_config(*enc->mechanism().learned_lag_bias());
    std::map<std::string, double> got;
    for (const auto& [name, value] : enc->lag_stats()) got[name] = value;
    const auto named = enc->named_parameters();
    const auto values = [&](const char* n) {
      const auto t = named[n].detach().to(torch::kDouble).contiguous();
      return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
    };
    const int H = 3, O = c.orders();
    const auto gl = values("pj_gate_logits");  // [H, 3]
    const bool on[3] = {c.fj, c.affine, c.lc};
    const char* sector[3] = {"fj", "affine", "lc"};
    std::vector<double> gate(H * 3, 0.0);
    for (int h = 0; h < H; ++h) {
      double z = 0;
      for (int s = 0; s < 3; ++s) z += on[s] ? std::exp(gl[h * 3 + s]) : 0.0;
      for (int s = 0; s < 3; ++s) gate[h * 3 + s] = on[s] ? std::exp(gl[h * 3 + s]) / z : 0.0;
    }
    double high = 0;
    for (int s = 0; s < 3; ++s) {
      const std::string g = std::string("gate_") + sector[s];
      if (!on[s]) {
        EXPECT_EQ(got.count(g), 0u) << spec << " " << g;
        continue;
      }
      double mean = 0;
      for (int h = 0; h < H; ++h) mean += gate[h * 3 + s] / H;
      EXPECT_NEAR(got.at(g), mean, 1e-12) << spec << " " << g;
      if (s == 1) continue;  // the affine sector has no orders
      const std::string br = sector[s];
      const auto al = values(("pj_" + br + "_alpha_logits").c_str()),
                 zr = values(("pj_" + br + "_zeta_re").c_str()),
                 zi = values(("pj_" + br + "_zeta_im").c_str());
      for (int r = 0; r < O; ++r) {
        double m = 0;
        for (int h = 0; h < H; ++h) {
          double z = 0;
          for (int o = 0; o < O; ++o) z += std::exp(al[h * O + o]);
          m += gate[h * 3 + s] * std::exp(al[h * O + r]) / z *
               std::hypot(zr[h * O + r], zi[h * O + r]) / H;
        }
        const std::string key = br + "_mass_r" + std::to_string(r);
        EXPECT_NEAR(got.at(key), m, 1e-12) << spec << " " << key;
        if (r >= 2) high += m;
      }
    }
    EXPECT_NEAR(got.at("high_order_mass"), high, 1e-12) << spec;
  }
  models::TransformerLM model(small_pj_model());
  for (auto& block : model->blocks()) {
    std::map<std::string, double> stats;
    for (const auto& [name, value] : block->attention_stats()) stats[name] = value;
    EXPECT_EQ(stats.count("gate_lc"), 1u);
    EXPECT_EQ(stats.count("high_order_mass"), 1u);
  }
}
