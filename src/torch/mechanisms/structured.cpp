// The torch runtime of the `structured` family (core/mechanisms/structured.cpp): rotations by
// vector positions r [T, d_c] or [B, T, d_c],
//   R(r) = U [ (+)_u R_2(theta_u(r)) ] U^T,  theta_u(r) = sum_k lambda_{k,u} r_k,
// applied to queries and keys alike by the fast kernel (the op relpos::structured_rotate,
// differentiable in x, U and lambda). Parameters per key/value head, registered on the owner:
//   freqs    lambda [Hk, d_c, M] (mixed, cayley, exp; axial keeps the term's fixed values)
//   basis_w  W [Hk, D, D] (cayley, exp): U = E P with E = cayley / exp of W - W^T (W = 0: U = P)
// P puts plane u on the pair layout's pair u (core structured::layout_planes). A query head
// turns with its key/value head's rotation (grouped-query attention), so scores stay relative.
//
// Its operators, in TORCH_LIBRARY(relpos): `structured_rotate` (CPU kernel =
// kernels/structured, Meta for torch.compile, Autograd) and `structured_rotate_backward` (the
// adjoint rotation and the basis and frequency gradients, summed in float64 across tiles).
#include "core/structured.hpp"

#include <fmt/format.h>

#include <array>

#include "core/types.hpp"
#include "kernels/structured.hpp"
#include "torch/grape_generators.hpp"
#include "torch/mechanisms/content_runtime.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

using op_util::value_errors;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The operands as the kernel takes them: contiguous, x's dtype for U and lambda, float64
// positions, leading dims made explicit; every problem named.
struct Operands {
  torch::Tensor x, U, lambda, pos;
  kernels::StructuredDims d;
};

Operands operands(const torch::Tensor& x, const torch::Tensor& basis, const torch::Tensor& freqs,
                  const torch::Tensor& positions) {
  const char* op = "structured_rotate";
  if (!x.defined() || x.dim() != 4) throw InputError(fmt::format("{}: x must be [B, H, T, D]", op));
  for (const auto* t : {&x, &basis, &freqs, &positions})
    if (!t->defined() || !t->device().is_cpu())
      throw InputError(fmt::format("{}: every tensor must be defined and on the CPU", op));
  if (!op_util::storable(x.scalar_type()))
    throw InputError(fmt::format("{}: x must be float32, float64, bfloat16 or float16", op));
  if (!op_util::goes_with(basis.scalar_type(), x.scalar_type()) ||
      !op_util::goes_with(freqs.scalar_type(), x.scalar_type()))
    throw InputError(
        fmt::format("{}: basis and freqs must have x's dtype ({}; float32 beside a "
                    "bfloat16/float16 x)",
                    op, c10::toString(x.scalar_type())));
  Operands o;
  o.d.B = x.size(0);
  o.d.H = x.size(1);
  o.d.T = x.size(2);
  o.d.D = x.size(3);
  if (basis.dim() != 2 && basis.dim() != 3)
    throw InputError(fmt::format("{}: basis must be [D, D] or [H, D, D]", op));
  if (basis.size(-1) != o.d.D || basis.size(-2) != o.d.D)
    throw InputError(fmt::format("{}: basis must be {} x {} (the head dim), got {}", op, o.d.D,
                                 o.d.D, fmt::join(basis.sizes(), " x ")));
  o.d.basis_per_head = basis.dim() == 3;
  if (o.d.basis_per_head && basis.size(0) != o.d.H)
    throw InputError(fmt::format("{}: a per-head basis needs H = {} leading rows, got {}", op,
                                 o.d.H, basis.size(0)));
  if (freqs.dim() != 2 && freqs.dim() != 3)
    throw InputError(fmt::format("{}: freqs must be [dc, M] or [H, dc, M]", op));
  o.d.freqs_per_head = freqs.dim() == 3;
  if (o.d.freqs_per_head && freqs.size(0) != o.d.H)
    throw InputError(fmt::format("{}: per-head freqs need H = {} leading rows, got {}", op, o.d.H,
                                 freqs.size(0)));
  o.d.DC = freqs.size(-2);
  o.d.M = freqs.size(-1);
  if (positions.dim() != 2 && positions.dim() != 3)
    throw InputError(fmt::format("{}: positions must be [T, dc] or [B, T, dc]", op));
  if (positions.size(-1) != o.d.DC || positions.size(-2) != o.d.T)
    throw InputError(fmt::format("{}: positions must end in [T = {}, dc = {}], got {}", op, o.d.T,
                                 o.d.DC, fmt::join(positions.sizes(), " x ")));
  o.d.positions_per_batch = positions.dim() == 3;
  if (o.d.positions_per_batch && positions.size(0) != o.d.B)
    throw InputError(fmt::format("{}: per-batch positions need B = {} rows, got {}", op, o.d.B,
                                 positions.size(0)));
  if (!positions.is_floating_point() && positions.scalar_type() != torch::kLong &&
      positions.scalar_type() != torch::kInt)
    throw InputError(fmt::format("{}: positions must be real or integer", op));
  o.x = op_util::computed(x);  // half storage: computed in float32
  o.U = op_util::computed(basis).to(o.x.scalar_type());
  o.lambda = op_util::computed(freqs).to(o.x.scalar_type());
  o.pos = positions.to(torch::kDouble).contiguous();
  return o;
}

torch::Tensor rotate_cpu(const torch::Tensor& x, const torch::Tensor& basis,
                         const torch::Tensor& freqs, const torch::Tensor& positions, bool inverse) {
  return value_errors([&] {
    const Operands o = operands(x, basis, freqs, positions);
    auto y = op_util::output_like(o.x);
    AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "relpos_structured_rotate", [&] {
      kernels::structured_forward<scalar_t>(o.d, inverse, o.x.data_ptr<scalar_t>(),
                                            o.U.data_ptr<scalar_t>(), o.lambda.data_ptr<scalar_t>(),
                                            o.pos.data_ptr<double>(), y.data_ptr<scalar_t>());
    });
    return op_util::stored(y, x.scalar_type());
  });
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rotate_backward_cpu(
    const torch::Tensor& grad, const torch::Tensor& x, const torch::Tensor& basis,
    const torch::Tensor& freqs, const torch::Tensor& positions, bool inverse,
    std::array<bool, 3> mask) {
  return value_errors([&] {
    const Operands o = operands(x, basis, freqs, positions);
    const auto g = grad.to(o.x.scalar_type()).contiguous();
    if (g.sizes() != o.x.sizes())
      throw InputError("structured_rotate_backward: grad must have x's shape");
    auto dx = op_util::output_like(g);
    const bool params = mask[1] || mask[2];
    auto dU =
        params ? torch::zeros(o.U.sizes(), o.U.options().dtype(torch::kDouble)) : torch::Tensor();
    auto dl = params ? torch::zeros(o.lambda.sizes(), o.lambda.options().dtype(torch::kDouble))
                     : torch::Tensor();
    AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "relpos_structured_rotate_backward", [&] {
      kernels::structured_backward<scalar_t>(
          o.d, inverse, o.x.data_ptr<scalar_t>(), o.U.data_ptr<scalar_t>(),
          o.lambda.data_ptr<scalar_t>(), o.pos.data_ptr<double>(), g.data_ptr<scalar_t>(),
          dx.data_ptr<scalar_t>(), params ? dU.data_ptr<double>() : nullptr,
          params ? dl.data_ptr<double>() : nullptr);
    });
    return std::make_tuple(mask[0] ? op_util::stored(dx, x.scalar_type()) : torch::Tensor(),
                           mask[1] ? dU.to(basis.scalar_type()) : torch::Tensor(),
                           mask[2] ? dl.to(freqs.scalar_type()) : torch::Tensor());
  });
}

torch::Tensor rotate_meta(const torch::Tensor& x, const torch::Tensor&, const torch::Tensor&,
                          const torch::Tensor&, bool) {
  return torch::empty_like(x, torch::MemoryFormat::Contiguous);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rotate_backward_meta(
    const torch::Tensor& grad, const torch::Tensor&, const torch::Tensor& basis,
    const torch::Tensor& freqs, const torch::Tensor&, bool, std::array<bool, 3> mask) {
  return std::make_tuple(
      mask[0] ? torch::empty_like(grad, torch::MemoryFormat::Contiguous) : torch::Tensor(),
      mask[1] ? torch::empty_like(basis, torch::MemoryFormat::Contiguous) : torch::Tensor(),
      mask[2] ? torch::empty_like(freqs, torch::MemoryFormat::Contiguous) : torch::Tensor());
}

torch::Tensor call_forward(const torch::Tensor& x, const torch::Tensor& basis,
                           const torch::Tensor& freqs, const torch::Tensor& positions,
                           bool inverse) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("relpos::structured_rotate", "")
          .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                               const torch::Tensor&, bool)>();
  return op.call(x, basis, freqs, positions, inverse);
}

class StructuredRotateFunction : public torch::autograd::Function<StructuredRotateFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& basis, const torch::Tensor& freqs,
                               const torch::Tensor& positions, bool inverse) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, basis, freqs, positions});
    ctx->saved_data["inverse"] = inverse;
    return call_forward(x, basis, freqs, positions, inverse);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto s = ctx->get_saved_variables();
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("relpos::structured_rotate_backward", "")
            .typed<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>(
                const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                const torch::Tensor&, const torch::Tensor&, bool, std::array<bool, 3>)>();
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   ctx->needs_input_grad(2)};
    auto [dx, dU, dl] =
        op.call(grad[0], s[0], s[1], s[2], s[3], ctx->saved_data["inverse"].toBool(), mask);
    return {dx, dU, dl, {}, {}};
  }
};

torch::Tensor rotate_autograd(const torch::Tensor& x, const torch::Tensor& basis,
                              const torch::Tensor& freqs, const torch::Tensor& positions,
                              bool inverse) {
  return StructuredRotateFunction::apply(x, basis, freqs, positions, inverse);
}

}  // namespace

// y_t = R(r_t) x_t; inverse: R(-r) = R(r)^T. x [B, H, T, D], U [(H,) D, D] orthogonal (its first
// 2M columns read), lambda [(H,) dc, M], positions [(B,) T, dc] (angles formed in float64);
// differentiable in x, U and lambda.
torch::Tensor structured_rotate(const torch::Tensor& x, const torch::Tensor& basis,
                                const torch::Tensor& freqs, const torch::Tensor& positions,
                                bool inverse = false) {
  return call_forward(x, basis, freqs, positions, inverse);
}

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def(
      "structured_rotate(Tensor x, Tensor basis, Tensor freqs, Tensor positions, bool "
      "inverse=False) -> Tensor");
  m.def(
      "structured_rotate_backward(Tensor grad, Tensor x, Tensor basis, Tensor freqs, Tensor "
      "positions, bool inverse, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(relpos, CPU, m) {
  m.impl("structured_rotate", relpos::nn::rotate_cpu);
  m.impl("structured_rotate_backward", relpos::nn::rotate_backward_cpu);
}

TORCH_LIBRARY_IMPL(relpos, Meta, m) {
  m.impl("structured_rotate", relpos::nn::rotate_meta);
  m.impl("structured_rotate_backward", relpos::nn::rotate_backward_meta);
}

TORCH_LIBRARY_IMPL(relpos, Autograd, m) {
  m.impl("structured_rotate", relpos::nn::rotate_autograd);
}

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
