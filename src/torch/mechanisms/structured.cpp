// The torch runtime of the `structured` family (core/mechanisms/structured.cpp): rotations by
// vector positions r [T, d_c] or [B, T, d_c],
//   R(r) = U [ (+)_u R_2(theta_u(r)) ] U^T,  theta_u(r) = sum_k lambda_{k,u} r_k,
// applied to queries and keys alike by the fast kernel (the op relpos::structured_rotate,
// differentiable in x, U and lambda). Parameters per key/value head, registered on the owner:
//   freqs    lambda [Hk, d_c, M] (mixed, cayley, exp; axial keeps the term's fixed values)
//   basis_w  W [Hk, D, D] (cayley, exp): U = E P with E = cayley / exp of W - W^T (W = 0: U = P)
// P puts plane u on the pair layout's pair u (core structured::layout_planes). A query head
// turns with its key/value head's rotation (grouped-query attention), so scores stay relative.
#include "core/structured.hpp"

#include <fmt/format.h>

#include "core/types.hpp"
#include "torch/grape_generators.hpp"
#include "torch/mechanisms/content_runtime.hpp"
#include "torch/structured.hpp"

namespace relpos::nn {

namespace {

bool learned_basis(const TransformTerm& t) {
  return t.basis == "cayley" || t.basis == "exp";
}

std::vector<std::string> structured_names(const TransformTerm& t) {
  if (t.basis == "axial") return {};
  if (learned_basis(t)) return {"freqs", "basis_w"};
  return {"freqs"};
}

torch::Tensor initial_freqs(const TransformTerm& t) {
  const auto heads =
      static_cast<int64_t>(t.plane_freqs.size()) / (int64_t{t.vector_dims} * t.planes);
  return torch::tensor(t.plane_freqs, torch::kDouble).view({heads, t.vector_dims, t.planes});
}

std::vector<torch::Tensor> structured_create(const TransformTerm& t, torch::nn::Module& owner,
                                             int64_t /*model_dim*/, int64_t kv_heads,
                                             int64_t head_dim) {
  std::vector<torch::Tensor> p;
  if (t.basis == "axial") return p;
  const auto freqs = initial_freqs(t);
  if (freqs.size(0) != kv_heads)
    throw std::logic_error(fmt::format("{}: {} heads of frequencies for {} key/value heads", t.name,
                                       freqs.size(0), kv_heads));
  p.push_back(owner.register_parameter("freqs", freqs.to(torch::kFloat)));
  if (learned_basis(t))
    p.push_back(owner.register_parameter("basis_w", torch::zeros({kv_heads, head_dim, head_dim})));
  return p;
}

// positions [T, d_c] or [B, T, d_c] for q's B and T, float64
torch::Tensor vector_positions(const TransformTerm& t, const torch::Tensor& pos,
                               const torch::Tensor& q) {
  const int64_t B = q.size(0), T = q.size(2), dc = t.vector_dims;
  const bool ok = pos.defined() && (pos.dim() == 2 || pos.dim() == 3) && pos.size(-1) == dc &&
                  pos.size(-2) == T && (pos.dim() == 2 || pos.size(0) == B);
  if (!ok)
    throw InputError(fmt::format(
        "'{}' rotates by vector positions: positions must be [T, {}] or [B, T, {}] with T = {}, "
        "B = {}, got {}",
        t.name, dc, dc, T, B,
        pos.defined() ? fmt::format("[{}]", fmt::join(pos.sizes(), ", ")) : "none"));
  if (!pos.is_floating_point() && pos.scalar_type() != torch::kLong &&
      pos.scalar_type() != torch::kInt)
    throw InputError(fmt::format("'{}': positions must be real or integer", t.name));
  const auto p = pos.to(torch::kDouble);
  if (!torch::isfinite(p).all().item<bool>())
    throw InputError(fmt::format("'{}': positions contain NaN or Inf", t.name));
  return p;
}

Rotated structured_rotate_qk(const TransformTerm& t, const std::vector<torch::Tensor>& p,
                             const RotationCall& c) {
  const auto dt = c.q.scalar_type();
  const auto pos = vector_positions(t, c.positions, c.q);
  const int64_t D = c.q.size(3);
  const auto lambda = (t.basis == "axial" ? initial_freqs(t) : p.at(0)).to(c.q.device(), dt);
  const structured::Mat P = structured::layout_planes(static_cast<int>(D), c.layout);
  auto U = torch::empty({D, D}, torch::kDouble);
  auto u = U.accessor<double, 2>();
  for (int64_t i = 0; i < D; ++i)
    for (int64_t j = 0; j < D; ++j) u[i][j] = P(i, j);
  U = U.to(c.q.device(), dt);
  if (learned_basis(t)) U = torch::matmul(orthogonal_basis(p.at(1).to(dt), t.basis == "exp"), U);
  const int64_t B = c.q.size(0), Hq = c.q.size(1), T = c.q.size(2), Hk = c.k.size(1), g = Hq / Hk;
  Rotated out;
  out.k = structured_rotate(c.k, U, lambda, pos);
  if (g == 1) {
    out.q = structured_rotate(c.q, U, lambda, pos);
  } else {  // query head h turns with key/value head h / g: the group's rows one after another
    const auto qpos = pos.dim() == 2 ? pos.repeat({g, 1}) : pos.repeat({1, g, 1});
    out.q =
        structured_rotate(c.q.reshape({B, Hk, g * T, D}), U, lambda, qpos).reshape({B, Hq, T, D});
  }
  return out;
}

}  // namespace

RotationRuntime structured_rotation_runtime() {
  return {structured_names, structured_create, structured_rotate_qk};
}

}  // namespace relpos::nn
