#include "models/grid2d.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <numbers>

#include "core/registry.hpp"
#include "core/types.hpp"
#include "models/transformer.hpp"
#include "torch/grape_generators.hpp"

namespace relpos::models {

namespace {

// the mechanism of one layer's attention: rotates by 2-D vector positions, or reads no positions
Mechanism grid2d_mechanism(const std::string& spec, int64_t head_dim, int64_t heads) {
  Mechanism m;
  try {
    m = build_mechanism(spec, static_cast<int>(head_dim), static_cast<int>(heads));
  } catch (const InputError& e) {
    throw InputError(fmt::format("model: mechanism: {}", e.what()));
  }
  const TransformTerm* s = m.structured_term();
  if (s ? s->vector_dims != 2 : (m.has_transform() || !m.biases.empty()))
    throw InputError(fmt::format(
        "model: the grid2d model takes a mechanism that rotates by 2-D vector positions "
        "(structured(dims=2, ...), axial_rope, mixed_rope) or reads no positions (nope); '{}' "
        "does not",
        spec));
  return m;
}

}  // namespace

void Grid2dModelConfig::validate() const {
  const auto range = [](int64_t v, int64_t lo, int64_t hi, const char* what) {
    if (v < lo || v > hi)
      throw InputError(fmt::format("model: {} must be in [{}, {}], got {}", what, lo, hi, v));
  };
  range(vocab, 2, int64_t{1} << 24, "vocab");
  range(classes, 2, vocab, "classes");
  range(d_model, 4, 65536, "d_model");
  range(heads, 1, 1024, "heads");
  range(layers, 1, 1024, "layers");
  range(mlp_ratio, 1, 64, "mlp_ratio");
  if (d_model % heads)
    throw InputError(fmt::format("model: d_model {} is not divisible by heads {}", d_model, heads));
  grid2d_mechanism(mechanism, d_model / heads, heads);
}

torch::Tensor grid2d_positions(int64_t side, double offset_row, double offset_col) {
  const auto t = torch::arange(side * side, torch::kLong);
  return torch::stack({torch::floor_divide(t, side).to(torch::kDouble) + offset_row,
                       torch::remainder(t, side).to(torch::kDouble) + offset_col},
                      -1);
}

// ---- the model

Grid2dBlockImpl::Grid2dBlockImpl(const Grid2dModelConfig& c)
    : heads_(c.heads),
      head_dim_(c.d_model / c.heads),
      vector_(grid2d_mechanism(c.mechanism, head_dim_, heads_).structured_term() != nullptr) {
  const int64_t d = c.d_model;
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  qkv_ = register_module("qkv", torch::nn::Linear(d, 3 * d));
  proj_ = register_module("proj", torch::nn::Linear(d, d));
  up_ = register_module("up", torch::nn::Linear(d, c.mlp_ratio * d));
  down_ = register_module("down", torch::nn::Linear(c.mlp_ratio * d, d));
  // non-causal (a grid has no order), planes on the half-split pairs
  attn_ = register_module(
      "attn", nn::Attention(c.mechanism, head_dim_, heads_,
                            nn::AttentionOptions{.layout = Layout::HalfSplit, .causal = false}));
}

torch::Tensor Grid2dBlockImpl::learned_basis() {
  const TransformTerm* t = attn_->mechanism().structured_term();
  const auto params = attn_->named_parameters(false);
  if (!t || !params.contains("basis_w")) return {};
  return nn::orthogonal_basis(params["basis_w"], t->basis == "exp");
}

torch::Tensor Grid2dBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& positions) {
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2);
  const auto qkv = split_qkv(qkv_(ln1_(x)), heads_, head_dim_);
  const auto o =
      attn_->forward(qkv[0], qkv[1], qkv[2], {.positions = vector_ ? positions : torch::Tensor()});
  auto h = x + proj_(o.transpose(1, 2).reshape({B, T, d}));
  return h + down_(torch::gelu(up_(ln2_(h))));
}

Grid2dNetImpl::Grid2dNetImpl(const Grid2dModelConfig& c) : c_(c) {
  c_.validate();
  embed_ = register_module("embed", torch::nn::Embedding(c.vocab, c.d_model));
  for (int64_t i = 0; i < c.layers; ++i)
    blocks_.push_back(register_module(fmt::format("block{}", i), Grid2dBlock(c)));
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  head_ = register_module("head", torch::nn::Linear(c.d_model, c.classes));
}

torch::Tensor Grid2dNetImpl::forward(const torch::Tensor& tokens, const torch::Tensor& positions) {
  torch::Tensor pos = positions;
  if (!pos.defined()) {
    const int64_t T = tokens.size(1);
    const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(T))));
    if (side * side != T)
      throw InputError(
          fmt::format("grid2d model: {} tokens are no square grid; pass the positions [T, 2]", T));
    pos = grid2d_positions(side);
  }
  auto x = embed_(tokens);
  for (auto& b : blocks_) x = b(x, pos);
  return head_(ln_f_(x));
}

int64_t Grid2dNetImpl::parameter_count() {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace relpos::models
