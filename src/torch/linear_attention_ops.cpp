// FAVOR+ linear attention (kernels/random_features.hpp, issue 15) as the op
// `relpos::favor_attention(q, k, v, projection, causal, scale)` (CPU, Meta and Autograd kernels;
// the backward is `relpos::favor_attention_backward`, which recomputes the features - O(T m D),
// cheaper to redo than to keep at long T - and runs the kernel's two linear-time passes).
// q, k [B, H, T, D], v [B, H, T, Dv], float32 or float64; projection W [m, D] (any real dtype,
// used in float64): drawn by `relpos::random_projection` (kernels::draw_projection), not
// differentiated (random features are redrawn, not trained). Compose with a
// rotation by rotating q and k first (relpos::transform, structured_rotate): the features then
// estimate exp((R_i q) . (R_j k) / sqrt(D)) = exp(q . R(j - i) k / sqrt(D)).
#include <fmt/format.h>

#include <array>

#include "kernels/random_features.hpp"
#include "torch/linear_attention.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

using op_util::value_errors;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FavorOperands {
  torch::Tensor q, k, v;
  kernels::FavorDims d;
  kernels::Projection W;
  kernels::FavorOptions o;
};

FavorOperands favor_operands(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& projection, bool causal, double scale) {
  const char* op = "favor_attention";
  for (const auto* t : {&q, &k, &v, &projection})
    if (!t->defined() || !t->device().is_cpu())
      throw InputError(fmt::format("{}: every tensor must be defined and on the CPU", op));
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    throw InputError(fmt::format("{}: q, k and v must be [B, H, T, D]", op));
  if (q.sizes() != k.sizes())
    throw InputError(fmt::format("{}: q and k must have the same shape (got {} and {})", op,
                                 fmt::join(q.sizes(), " x "), fmt::join(k.sizes(), " x ")));
  if (v.size(0) != q.size(0) || v.size(1) != q.size(1) || v.size(2) != q.size(2))
    throw InputError(fmt::format("{}: v must be [B, H, T, Dv] with q's B, H, T", op));
  if (!op_util::storable(q.scalar_type()))
    throw InputError(fmt::format("{}: q must be float32, float64, bfloat16 or float16", op));
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    throw InputError(fmt::format("{}: q, k and v must have one dtype", op));
  if (projection.dim() != 2 || projection.size(1) != q.size(3) || projection.size(0) < 1)
    throw InputError(fmt::format("{}: projection must be [m, D = {}] with m >= 1, got {}", op,
                                 q.size(3), fmt::join(projection.sizes(), " x ")));
  if (!(scale >= 0) || !std::isfinite(scale))
    throw InputError(
        fmt::format("{}: scale must be finite and >= 0 (0: D^-1/4), got {}", op, scale));
  FavorOperands o;
  o.q = op_util::computed(q);  // half storage: computed in float32
  o.k = op_util::computed(k);
  o.v = op_util::computed(v);
  o.d = {q.size(0), q.size(1), q.size(2), q.size(3), v.size(3)};
  const auto w = projection.to(torch::kDouble).contiguous();
  o.W.m = w.size(0);
  o.W.d = w.size(1);
  o.W.w.assign(w.data_ptr<double>(), w.data_ptr<double>() + w.numel());
  o.o.causal = causal;
  o.o.scale = scale;
  return o;
}

torch::Tensor favor_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& projection, bool causal, double scale) {
  return value_errors([&] {
    const auto o = favor_operands(q, k, v, projection, causal, scale);
    auto out = torch::empty_like(o.v, torch::MemoryFormat::Contiguous);
    AT_DISPATCH_FLOATING_TYPES(o.q.scalar_type(), "relpos_favor_attention", [&] {
      kernels::FavorCache<scalar_t> cache;
      kernels::favor_attention_forward<scalar_t>(o.d, o.q.data_ptr<scalar_t>(),
                                                 o.k.data_ptr<scalar_t>(), o.v.data_ptr<scalar_t>(),
                                                 o.W, o.o, out.data_ptr<scalar_t>(), cache);
    });
    return op_util::stored(out, v.scalar_type());
  });
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> favor_backward_cpu(
    const torch::Tensor& grad, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& v, const torch::Tensor& projection, bool causal, double scale,
    std::array<bool, 3> mask) {
  return value_errors([&] {
    const auto o = favor_operands(q, k, v, projection, causal, scale);
    const auto g = grad.to(o.q.scalar_type()).contiguous();
    if (g.sizes() != o.v.sizes())
      throw InputError("favor_attention_backward: grad must have v's shape");
    auto out = torch::empty_like(o.v, torch::MemoryFormat::Contiguous);
    auto dq = mask[0] ? torch::empty_like(o.q) : torch::Tensor();
    auto dk = mask[1] ? torch::empty_like(o.k) : torch::Tensor();
    auto dv = mask[2] ? torch::empty_like(o.v) : torch::Tensor();
    AT_DISPATCH_FLOATING_TYPES(o.q.scalar_type(), "relpos_favor_attention_backward", [&] {
      kernels::FavorCache<scalar_t> cache;
      kernels::favor_attention_forward<scalar_t>(o.d, o.q.data_ptr<scalar_t>(),
                                                 o.k.data_ptr<scalar_t>(), o.v.data_ptr<scalar_t>(),
                                                 o.W, o.o, out.data_ptr<scalar_t>(), cache);
      kernels::favor_attention_backward<scalar_t>(
          o.d, o.q.data_ptr<scalar_t>(), o.k.data_ptr<scalar_t>(), o.v.data_ptr<scalar_t>(), o.W,
          o.o, g.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), cache, op_util::mptr<scalar_t>(dq),
          op_util::mptr<scalar_t>(dk), op_util::mptr<scalar_t>(dv));
    });
    return std::make_tuple(op_util::stored(dq, q.scalar_type()),
                           op_util::stored(dk, k.scalar_type()),
                           op_util::stored(dv, v.scalar_type()));
  });
}

torch::Tensor favor_meta(const torch::Tensor&, const torch::Tensor&, const torch::Tensor& v,
                         const torch::Tensor&, bool, double) {
  return torch::empty_like(v, torch::MemoryFormat::Contiguous);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> favor_backward_meta(
    const torch::Tensor&, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor&, bool, double, std::array<bool, 3> mask) {
  const auto c = torch::MemoryFormat::Contiguous;
  return std::make_tuple(mask[0] ? torch::empty_like(q, c) : torch::Tensor(),
                         mask[1] ? torch::empty_like(k, c) : torch::Tensor(),
                         mask[2] ? torch::empty_like(v, c) : torch::Tensor());
}

class FavorFunction : public torch::autograd::Function<FavorFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& projection, bool causal,
                               double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({q, k, v, projection});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("relpos::favor_attention", "")
            .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&, bool, double)>();
    return op.call(q, k, v, projection, causal, scale);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto s = ctx->get_saved_variables();
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("relpos::favor_attention_backward", "")
            .typed<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>(
                const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                const torch::Tensor&, const torch::Tensor&, bool, double, std::array<bool, 3>)>();
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   ctx->needs_input_grad(2)};
    auto [dq, dk, dv] = op.call(grad[0], s[0], s[1], s[2], s[3], ctx->saved_data["causal"].toBool(),
                                ctx->saved_data["scale"].toDouble(), mask);
    return {dq, dk, dv, {}, {}, {}};
  }
};

torch::Tensor favor_autograd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& projection, bool causal, double scale) {
  return FavorFunction::apply(q, k, v, projection, causal, scale);
}

torch::Tensor random_projection_op(int64_t m, int64_t d, bool orthogonal, int64_t seed) {
  return value_errors([&] {
    const auto p = kernels::draw_projection(
        orthogonal ? kernels::ProjectionKind::Orthogonal : kernels::ProjectionKind::Iid, m, d,
        static_cast<uint64_t>(seed));
    return torch::tensor(p.w, torch::kDouble).reshape({m, d});
  });
}

}  // namespace

torch::Tensor favor_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& projection, bool causal,
                              double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("relpos::favor_attention", "")
                             .typed<decltype(favor_cpu)>();
  return op.call(q, k, v, projection, causal, scale);
}

torch::Tensor random_projection(int64_t m, int64_t d, bool orthogonal, int64_t seed) {
  return random_projection_op(m, d, orthogonal, seed);
}

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def(
      "favor_attention(Tensor q, Tensor k, Tensor v, Tensor projection, bool causal=True, float "
      "scale=0.) -> Tensor");
  m.def(
      "favor_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor projection, "
      "bool causal, float scale, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def("random_projection(int m, int d, bool orthogonal=True, int seed=0) -> Tensor",
        relpos::nn::random_projection_op);
}

TORCH_LIBRARY_IMPL(relpos, CPU, m) {
  m.impl("favor_attention", relpos::nn::favor_cpu);
  m.impl("favor_attention_backward", relpos::nn::favor_backward_cpu);
}

TORCH_LIBRARY_IMPL(relpos, Meta, m) {
  m.impl("favor_attention", relpos::nn::favor_meta);
  m.impl("favor_attention_backward", relpos::nn::favor_backward_meta);
}

TORCH_LIBRARY_IMPL(relpos, Autograd, m) {
  m.impl("favor_attention", relpos::nn::favor_autograd);
}
