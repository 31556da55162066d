#include "models/grid2d.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <numbers>

#include "core/parse.hpp"
#include "core/types.hpp"
#include "torch/attention.hpp"
#include "torch/grape_generators.hpp"

namespace relpos::models {

std::vector<std::string> grid2d_mechanisms() {
  return {"nope", "axial_rope", "mixed_rope", "structured"};
}

Grid2dMechanism parse_grid2d_mechanism(const std::string& spec) {
  std::string name = spec, args;
  if (const auto open = spec.find('('); open != std::string::npos) {
    if (spec.back() != ')')
      throw InputError(fmt::format("grid2d mechanism '{}': expected NAME or NAME(theta=X)", spec));
    name = spec.substr(0, open);
    args = spec.substr(open + 1, spec.size() - open - 2);
  }
  const auto trim = [](std::string s) {
    const auto a = s.find_first_not_of(' '), b = s.find_last_not_of(' ');
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
  };
  name = trim(name);
  Grid2dMechanism m;
  if (name == "nope") {
    m.kind = Grid2dPosition::NoPE;
  } else if (name == "axial_rope") {
    m.kind = Grid2dPosition::Axial;
  } else if (name == "mixed_rope") {
    m.kind = Grid2dPosition::Mixed;
  } else if (name == "structured") {
    m.kind = Grid2dPosition::Structured;
  } else {
    throw InputError(fmt::format("grid2d: unknown mechanism '{}' (valid: {})", name,
                                 fmt::join(grid2d_mechanisms(), ", ")));
  }
  args = trim(args);
  if (!args.empty()) {
    const auto eq = args.find('=');
    const std::string key = trim(args.substr(0, eq));
    if (eq == std::string::npos || key != "theta")
      throw InputError(
          fmt::format("grid2d mechanism '{}': the only option is theta (theta=X)", spec));
    const auto v = parse_finite_double(trim(args.substr(eq + 1)));
    if (!v || *v <= 1)
      throw InputError(fmt::format("grid2d mechanism '{}': theta must be a number > 1", spec));
    m.theta = *v;
  }
  return m;
}

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
  const auto m = parse_grid2d_mechanism(mechanism);
  if (m.kind != Grid2dPosition::NoPE && (d_model / heads) % 4)
    throw InputError(fmt::format(
        "model: grid2d rotations need a head dim divisible by 4 (planes for both axes), got {}",
        d_model / heads));
}

torch::Tensor grid2d_positions(int64_t side, double offset_row, double offset_col) {
  const auto t = torch::arange(side * side, torch::kLong);
  return torch::stack({torch::floor_divide(t, side).to(torch::kDouble) + offset_row,
                       torch::remainder(t, side).to(torch::kDouble) + offset_col},
                      -1);
}

// ---- the rotation

PlaneRotation2dImpl::PlaneRotation2dImpl(Grid2dMechanism m, int64_t heads, int64_t head_dim)
    : m_(m), heads_(heads), head_dim_(head_dim) {
  const int64_t planes = head_dim / 2, per_axis = planes / 2;
  // axial magnitudes theta^(-i / per_axis), i = 0..per_axis-1, for plane u: index u mod per_axis
  auto omega = torch::empty({planes}, torch::kFloat);
  for (int64_t u = 0; u < planes; ++u)
    omega[u] =
        std::pow(m.theta, -static_cast<double>(u % per_axis) / static_cast<double>(per_axis));
  auto lambda = torch::zeros({heads, 2, planes}, torch::kFloat);
  if (m.kind == Grid2dPosition::Axial) {
    lambda.select(1, 0).narrow(1, 0, per_axis).copy_(omega.narrow(0, 0, per_axis));
    lambda.select(1, 1).narrow(1, per_axis, per_axis).copy_(omega.narrow(0, per_axis, per_axis));
    lambda_ = register_buffer("lambda", lambda);
  } else if (m.kind == Grid2dPosition::Mixed || m.kind == Grid2dPosition::Structured) {
    // RoPE-Mixed's initialisation: the axial magnitude along a random direction per head and plane
    const auto phi = torch::rand({heads, planes}) * (2 * std::numbers::pi);
    lambda.select(1, 0).copy_(omega * torch::cos(phi));
    lambda.select(1, 1).copy_(omega * torch::sin(phi));
    lambda_ = register_parameter("lambda", lambda);
    if (m.kind == Grid2dPosition::Structured)
      W_ = register_parameter("W", torch::zeros({heads, head_dim, head_dim}));
  }
}

torch::Tensor PlaneRotation2dImpl::angles(const torch::Tensor& positions) {
  if (!(positions.dim() == 2 || positions.dim() == 3) || positions.size(-1) != 2)
    throw InputError("grid2d rotation: positions must be [T, 2] or [B, T, 2]");
  const auto p = positions.to(torch::kDouble), l = lambda_.to(torch::kDouble);
  return positions.dim() == 2 ? torch::einsum("tk,hku->htu", {p, l})
                              : torch::einsum("btk,hku->bhtu", {p, l});
}

torch::Tensor PlaneRotation2dImpl::basis() {
  return W_.defined() ? nn::orthogonal_basis(W_) : torch::Tensor();
}

torch::Tensor PlaneRotation2dImpl::forward(const torch::Tensor& x, const torch::Tensor& positions) {
  if (m_.kind == Grid2dPosition::NoPE) return x;
  if (x.dim() != 4 || x.size(1) != heads_ || x.size(3) != head_dim_)
    throw InputError(fmt::format("grid2d rotation: x must be [B, {}, T, {}]", heads_, head_dim_));
  const auto th = angles(positions);
  const auto c = torch::cos(th).to(x.scalar_type()), s = torch::sin(th).to(x.scalar_type());
  if (m_.kind == Grid2dPosition::Structured) return nn::basis_rotate(x, basis(), c, s);
  // U = I: basis_rotate's half-split formula without the basis products
  const int64_t m = head_dim_ / 2;
  const auto x1 = x.narrow(-1, 0, m), x2 = x.narrow(-1, m, m);
  return torch::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
}

// ---- the model

Grid2dBlockImpl::Grid2dBlockImpl(const Grid2dModelConfig& c, const Grid2dMechanism& m)
    : heads_(c.heads), head_dim_(c.d_model / c.heads), rotate_(m.kind != Grid2dPosition::NoPE) {
  const int64_t d = c.d_model;
  ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  qkv_ = register_module("qkv", torch::nn::Linear(d, 3 * d));
  proj_ = register_module("proj", torch::nn::Linear(d, d));
  up_ = register_module("up", torch::nn::Linear(d, c.mlp_ratio * d));
  down_ = register_module("down", torch::nn::Linear(c.mlp_ratio * d, d));
  rot_ = register_module("rot", PlaneRotation2d(m, heads_, head_dim_));
}

torch::Tensor Grid2dBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& positions) {
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2);
  const auto qkv = qkv_(ln1_(x)).view({B, T, 3, heads_, head_dim_}).permute({2, 0, 3, 1, 4});
  auto q = qkv[0], k = qkv[1];
  if (rotate_) {
    q = rot_(q, positions);
    k = rot_(k, positions);
  }
  nn::AttentionArgs args;
  args.causal = false;
  const auto o = nn::fused_attention(q.contiguous(), k.contiguous(), qkv[2].contiguous(), args)[0];
  auto h = x + proj_(o.transpose(1, 2).reshape({B, T, d}));
  return h + down_(torch::gelu(up_(ln2_(h))));
}

Grid2dNetImpl::Grid2dNetImpl(const Grid2dModelConfig& c) : c_(c) {
  c_.validate();
  const auto m = parse_grid2d_mechanism(c.mechanism);
  embed_ = register_module("embed", torch::nn::Embedding(c.vocab, c.d_model));
  for (int64_t i = 0; i < c.layers; ++i)
    blocks_.push_back(register_module(fmt::format("block{}", i), Grid2dBlock(c, m)));
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
