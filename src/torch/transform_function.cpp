#include "torch/transform_function.hpp"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace relpos::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The plan travels through the autograd context as a capsule (saved_data holds IValues only);
// sharing it keeps the backward independent of the module's lifetime.
struct PlanHolder : torch::CustomClassHolder {
  explicit PlanHolder(std::shared_ptr<const kernels::TransformPlan> p) : plan(std::move(p)) {}
  std::shared_ptr<const kernels::TransformPlan> plan;
};
const kernels::TransformPlan& plan_of(const c10::IValue& v) {
  return *static_cast<const PlanHolder*>(v.toCapsule().get())->plan;
}

template <class T>
const T* ptr(const torch::Tensor& t) {
  return t.defined() && t.numel() ? t.data_ptr<T>() : nullptr;
}
template <class T>
T* mptr(torch::Tensor& t) {
  return t.defined() && t.numel() ? t.data_ptr<T>() : nullptr;
}

struct Geometry {
  kernels::Dims dims;
  kernels::Positions pos;
};
Geometry geometry(const torch::Tensor& q, const torch::Tensor& positions, double center) {
  Geometry g;
  g.dims = {q.size(0), q.size(1), q.size(2)};
  g.pos = {positions.data_ptr<double>(), positions.dim() == 2, center};
  return g;
}

// An output buffer the kernel will fill. Large ones are advised as transparent huge pages before
// their first write: a fresh 16 MiB tensor otherwise costs 4096 page faults taken by the kernel's
// threads at once, which can cost more than the kernel itself (measurements in
// docs/performance.md). Harmless where THP is off or the memory reused.
torch::Tensor output_like(const torch::Tensor& t) {
  auto out = torch::empty_like(t);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const auto end = begin + static_cast<uintptr_t>(out.nbytes());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return out;
}

class TransformQK : public torch::autograd::Function<TransformQK> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& gamma, const torch::Tensor& eta,
                               const torch::Tensor& gates, const torch::Tensor& alpha0,
                               const torch::Tensor& positions, const torch::Tensor& cos,
                               const torch::Tensor& sin,
                               std::shared_ptr<const kernels::TransformPlan> plan_ptr,
                               double center) {
    const auto& plan = *plan_ptr;
    const auto g = geometry(q, positions, center);
    auto qo = output_like(q), ko = output_like(k);
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_transform_forward", [&] {
      kernels::transform_forward<scalar_t>(
          plan, g.dims, g.pos,
          {ptr<scalar_t>(gamma), ptr<scalar_t>(eta), ptr<scalar_t>(gates), ptr<scalar_t>(alpha0)},
          {cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>()}, q.data_ptr<scalar_t>(),
          k.data_ptr<scalar_t>(), qo.data_ptr<scalar_t>(), ko.data_ptr<scalar_t>());
    });
    ctx->save_for_backward({q, k, gamma, eta, gates, alpha0, positions, cos, sin});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(c10::make_intrusive<PlanHolder>(plan_ptr));
    ctx->saved_data["center"] = center;
    return {qo, ko};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &gamma = saved[2], &eta = saved[3], &gates = saved[4],
               &alpha0 = saved[5], &positions = saved[6], &cos = saved[7], &sin = saved[8];
    const auto& plan = plan_of(ctx->saved_data["plan"]);
    const auto g = geometry(q, positions, ctx->saved_data["center"].toDouble());
    const auto gqo = grad_out[0].defined() ? grad_out[0].contiguous() : torch::zeros_like(q);
    const auto gko = grad_out[1].defined() ? grad_out[1].contiguous() : torch::zeros_like(k);
    torch::Tensor gq, gk, ggamma, geta, ggates, galpha0;
    if (ctx->needs_input_grad(0)) gq = output_like(q);
    if (ctx->needs_input_grad(1)) gk = output_like(k);
    if (ctx->needs_input_grad(2)) ggamma = torch::zeros_like(gamma);
    if (ctx->needs_input_grad(3)) geta = torch::zeros_like(eta);
    if (ctx->needs_input_grad(4)) ggates = torch::zeros_like(gates);
    if (ctx->needs_input_grad(5)) galpha0 = torch::zeros_like(alpha0);
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_transform_backward", [&] {
      kernels::transform_backward<scalar_t>(
          plan, g.dims, g.pos,
          {ptr<scalar_t>(gamma), ptr<scalar_t>(eta), ptr<scalar_t>(gates), ptr<scalar_t>(alpha0)},
          {cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>()}, q.data_ptr<scalar_t>(),
          k.data_ptr<scalar_t>(), gqo.data_ptr<scalar_t>(), gko.data_ptr<scalar_t>(),
          mptr<scalar_t>(gq), mptr<scalar_t>(gk),
          {mptr<scalar_t>(ggamma), mptr<scalar_t>(geta), mptr<scalar_t>(ggates),
           mptr<scalar_t>(galpha0)});
    });
    return {gq,
            gk,
            ggamma,
            geta,
            ggates,
            galpha0,
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

std::vector<torch::Tensor> trig_table(const kernels::TransformPlan& plan, int64_t B, int64_t T,
                                      const torch::Tensor& positions, double center,
                                      torch::ScalarType dtype) {
  const auto pos = positions.to(torch::kDouble).contiguous();
  const kernels::Dims dims{B, 1, T};
  const kernels::Positions P{pos.data_ptr<double>(), pos.dim() == 2, center};
  const int64_t n = kernels::trig_table_size(plan, dims, P);
  auto cos = torch::empty({n}, torch::TensorOptions().dtype(dtype));
  auto sin = torch::empty({n}, torch::TensorOptions().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES(dtype, "relpos_trig_table", [&] {
    kernels::fill_trig_table<scalar_t>(plan, dims, P, cos.data_ptr<scalar_t>(),
                                       sin.data_ptr<scalar_t>());
  });
  return {cos, sin};
}

std::vector<torch::Tensor> transform_qk(const kernels::TransformPlan& plan, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& gamma,
                                        const torch::Tensor& eta, const torch::Tensor& gates,
                                        const torch::Tensor& alpha0, const torch::Tensor& positions,
                                        double center, const std::vector<torch::Tensor>& trig) {
  const auto pos = positions.to(torch::kDouble).contiguous();
  const auto table = trig.size() == 2
                         ? trig
                         : trig_table(plan, q.size(0), q.size(2), pos, center, q.scalar_type());
  const kernels::Dims dims{q.size(0), q.size(1), q.size(2)};
  const kernels::Positions P{pos.data_ptr<double>(), pos.dim() == 2, center};
  if (table[0].numel() != kernels::trig_table_size(plan, dims, P) ||
      table[0].scalar_type() != q.scalar_type() || table[1].sizes() != table[0].sizes())
    throw InputError("trig table does not match the inputs' positions, length or dtype");
  return TransformQK::apply(q.contiguous(), k.contiguous(), gamma.contiguous(), eta.contiguous(),
                            gates.contiguous(), alpha0.contiguous(), pos, table[0].detach(),
                            table[1].detach(), std::make_shared<const kernels::TransformPlan>(plan),
                            center);
}

}  // namespace relpos::nn
