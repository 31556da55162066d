#include "models/transformer.hpp"

#include <fmt/format.h>

#include <cmath>

#include "core/registry.hpp"
#include "core/types.hpp"
#include "torch/attention.hpp"

namespace relpos::models {

Preset parse_preset(const std::string& name) {
  if (name == "jordan") return Preset::Jordan;
  if (name == "pj") return Preset::PJ;
  throw InputError(fmt::format("unknown model preset '{}' (valid: jordan, pj)", name));
}

std::string to_string(Preset p) {
  return p == Preset::Jordan ? "jordan" : "pj";
}

void ModelConfig::validate() const {
  const auto range = [](int64_t v, int64_t lo, int64_t hi, const char* what) {
    if (v < lo || v > hi)
      throw InputError(fmt::format("model: {} must be in [{}, {}], got {}", what, lo, hi, v));
  };
  range(vocab, 2, int64_t{1} << 24, "vocab");
  range(d_model, 2, 65536, "d_model");
  range(heads, 1, 1024, "heads");
  range(layers, 0, 1024, "layers");
  range(mlp_ratio, 1, 64, "mlp_ratio");
  if (attention != "fused" && attention != "composed")
    throw InputError(
        fmt::format("model: attention must be fused or composed, got '{}'", attention));
  if (d_model % heads)
    throw InputError(fmt::format("model: d_model {} is not divisible by heads {}", d_model, heads));
  // the mechanism must fit this head shape (raises a named InputError otherwise)
  build_mechanism(mechanism, static_cast<int>(head_dim()), static_cast<int>(heads));
}

BlockImpl::BlockImpl(const ModelConfig& c, int64_t index) : c_(c) {
  const int64_t d = c.d_model;
  const bool bias = c.preset == Preset::PJ;
  qkv_ = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(d, 3 * d).bias(bias)));
  proj_ = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(bias)));
  up_ = register_module("up",
                        torch::nn::Linear(torch::nn::LinearOptions(d, c.mlp_ratio * d).bias(bias)));
  down_ = register_module(
      "down", torch::nn::Linear(torch::nn::LinearOptions(c.mlp_ratio * d, d).bias(bias)));
  if (c.preset == Preset::Jordan) {
    rms1_ = register_parameter("rms1", torch::ones({d}));
    rms2_ = register_parameter("rms2", torch::ones({d}));
  } else {
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  if (c.freeze_qk) {  // the reference zeroes the q and k rows of the fused projection
    torch::NoGradGuard no_grad;
    qkv_->weight.narrow(0, 0, 2 * d).zero_();
    if (bias) qkv_->bias.narrow(0, 0, 2 * d).zero_();
  }
  enc_ = register_module(fmt::format("pos{}", index),
                         nn::PositionEncoding(c.mechanism, c.head_dim(), c.heads,
                                              nn::EncodingOptions{c.layout, false}));
}

namespace {
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w) {
  return w * x * torch::rsqrt(x.square().mean(-1, true) + 1e-6);
}
}  // namespace

torch::Tensor BlockImpl::norm(int which, const torch::Tensor& x) {
  if (c_.preset == Preset::Jordan) return rms_norm(x, which == 1 ? rms1_ : rms2_);
  return which == 1 ? ln1_(x) : ln2_(x);
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& positions) {
  const int64_t B = x.size(0), T = x.size(1), H = c_.heads, hd = c_.head_dim();
  // one Linear(d, 3d) split into q, k, v in that order, heads [B, T, H, hd] -> [B, H, T, hd]
  const auto qkv = qkv_(norm(1, x)).view({B, T, 3, H, hd}).permute({2, 0, 3, 1, 4});
  nn::AttentionArgs args;
  args.q_positions = args.k_positions = positions;  // one tensor: one transform call
  args.exclude_self = !c_.include_self;
  torch::Tensor y;
  const auto q = c_.freeze_qk ? torch::zeros_like(qkv[0]) : qkv[0];
  const auto k = c_.freeze_qk ? torch::zeros_like(qkv[1]) : qkv[1];
  if (c_.attention == "fused") {
    y = nn::attention(q, k, qkv[2], *enc_, args);
  } else {
    const auto t = enc_->forward(q, k, positions);
    nn::AttentionArgs a = args;
    a.slopes = enc_->alibi_slopes();
    if (a.slopes.defined()) a.slopes = a.slopes.to(x.scalar_type());
    if (enc_->has_lag_table()) {
      const int64_t span =
          positions.defined() ? static_cast<int64_t>(
                                    std::ceil((positions.max() - positions.min()).item<double>()))
                              : T - 1;
      a.lag_table = enc_->lag_table(span + 1).to(x.scalar_type());
    }
    y = nn::composed_attention(t.q, t.k, qkv[2], a);
  }
  auto h = x + proj_(y.transpose(1, 2).reshape({B, T, c_.d_model}));
  return h + down_(torch::gelu(up_(norm(2, h))));  // exact (erf) GELU
}

std::pair<torch::Tensor, torch::Tensor> BlockImpl::qk_norms(const torch::Tensor& x,
                                                            const torch::Tensor& positions) {
  const int64_t B = x.size(0), T = x.size(1);
  const auto qkv =
      qkv_(norm(1, x)).view({B, T, 3, c_.heads, c_.head_dim()}).permute({2, 0, 3, 1, 4});
  const auto t = enc_->forward(qkv[0], qkv[1], positions);
  return {t.q.norm(2, -1).mean({0, 1}), t.k.norm(2, -1).mean({0, 1})};
}

TransformerLMImpl::TransformerLMImpl(const ModelConfig& c) : c_(c) {
  c_.validate();
  // Embedding's default initialisation is N(0, 1), as the reference
  embed_ = register_module("embed", torch::nn::Embedding(c.vocab, c.d_model));
  for (int64_t i = 0; i < c.layers; ++i)
    blocks_.push_back(register_module(fmt::format("block{}", i), Block(c, i)));
  if (c.preset == Preset::Jordan) {
    rms_f_ = register_parameter("rms_f", torch::ones({c.d_model}));
  } else {
    ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    head_ = register_module("head", torch::nn::Linear(c.d_model, c.vocab));
  }
}

torch::Tensor TransformerLMImpl::forward(const torch::Tensor& tokens,
                                         const torch::Tensor& positions) {
  if (tokens.dim() != 2 || tokens.scalar_type() != torch::kLong)
    throw InputError("model: tokens must be an int64 tensor [B, T]");
  if (tokens.numel() &&
      (tokens.min().item<int64_t>() < 0 || tokens.max().item<int64_t>() >= c_.vocab))
    throw InputError(fmt::format("model: token ids must be in [0, {})", c_.vocab));
  auto x = embed_(tokens);
  for (auto& b : blocks_) x = b->forward(x, positions);
  if (c_.preset == Preset::Jordan) return torch::matmul(rms_norm(x, rms_f_), embed_->weight.t());
  return head_(ln_f_(x));
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> TransformerLMImpl::qk_norm_profile(
    const torch::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  auto x = embed_(tokens);
  for (auto& b : blocks_) {
    out.push_back(b->qk_norms(x, {}));
    x = b->forward(x, {});
  }
  return out;
}

int64_t TransformerLMImpl::parameter_count() {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace relpos::models
