// The causal scan operators of TORCH_LIBRARY(relpos): `causal_scan` (CPU kernel = kernels/scan,
// Meta for torch.compile, Autograd) and `causal_scan_backward` (the adjoint reverse scan).
#include <fmt/format.h>

#include "kernels/scan.hpp"
#include "torch/op_util.hpp"
#include "torch/scan.hpp"

namespace relpos::nn {

namespace {

using op_util::value_errors;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

kernels::ScanMode parse_mode(const std::string& mode) {
  if (mode == "exclusive") return kernels::ScanMode::Exclusive;
  if (mode == "reversed_inclusive") return kernels::ScanMode::ReversedInclusive;
  throw InputError(
      fmt::format("causal_scan: mode '{}' is not one of: exclusive, reversed_inclusive", mode));
}

// [T, C] -> [1, T, C]; checks rank, device and dtype with named errors
torch::Tensor as_btc(const torch::Tensor& x, const char* what) {
  if (!x.defined() || (x.dim() != 2 && x.dim() != 3))
    throw InputError(fmt::format("causal_scan: {} must be [B, T, C] or [T, C]", what));
  if (!x.device().is_cpu())
    throw InputError(fmt::format("causal_scan: {} must be on the CPU", what));
  if (!op_util::storable(x.scalar_type()))
    throw InputError(
        fmt::format("causal_scan: {} must be float32, float64, bfloat16 or float16", what));
  return op_util::computed(x.dim() == 2 ? x.unsqueeze(0) : x);  // half: summed in float32
}

template <bool Forward>
torch::Tensor run_scan(const torch::Tensor& in, const std::string& mode) {
  return value_errors([&] {
    const auto m = parse_mode(mode);
    const auto x = as_btc(in, Forward ? "increments" : "grad");
    auto out = torch::empty_like(x);
    const kernels::ScanDims d{x.size(0), x.size(1), x.size(2)};
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "relpos_causal_scan", [&] {
      if constexpr (Forward)
        kernels::causal_scan_forward<scalar_t>(m, d, x.data_ptr<scalar_t>(),
                                               out.data_ptr<scalar_t>());
      else
        kernels::causal_scan_backward<scalar_t>(m, d, x.data_ptr<scalar_t>(),
                                                out.data_ptr<scalar_t>());
    });
    out = op_util::stored(out, in.scalar_type());
    return in.dim() == 2 ? out.squeeze(0) : out;
  });
}

torch::Tensor scan_cpu(const torch::Tensor& a, c10::string_view mode) {
  return run_scan<true>(a, std::string(mode));
}
torch::Tensor scan_backward_cpu(const torch::Tensor& g, c10::string_view mode) {
  return run_scan<false>(g, std::string(mode));
}
torch::Tensor scan_meta(const torch::Tensor& a, c10::string_view) {
  return torch::empty_like(a, torch::MemoryFormat::Contiguous);
}

torch::Tensor call(const char* name, const torch::Tensor& x, c10::string_view mode) {
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow(name, "")
                      .typed<torch::Tensor(const torch::Tensor&, c10::string_view)>();
  return op.call(x, mode);
}

class CausalScanFunction : public torch::autograd::Function<CausalScanFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& a,
                               c10::string_view mode) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->saved_data["mode"] = std::string(mode);
    return call("relpos::causal_scan", a, mode);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    // the scan is linear: its gradient is the adjoint scan of the incoming gradient
    const auto mode = ctx->saved_data["mode"].toStringRef();
    return {call("relpos::causal_scan_backward", grad[0], mode), {}};
  }
};

torch::Tensor scan_autograd(const torch::Tensor& a, c10::string_view mode) {
  return CausalScanFunction::apply(a, mode);
}

}  // namespace

torch::Tensor causal_scan(const torch::Tensor& increments, const std::string& mode) {
  return call("relpos::causal_scan", increments, mode);
}

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def("causal_scan(Tensor increments, str mode=\"exclusive\") -> Tensor");
  m.def("causal_scan_backward(Tensor grad, str mode) -> Tensor");
}

TORCH_LIBRARY_IMPL(relpos, CPU, m) {
  m.impl("causal_scan", relpos::nn::scan_cpu);
  m.impl("causal_scan_backward", relpos::nn::scan_backward_cpu);
}

TORCH_LIBRARY_IMPL(relpos, Meta, m) {
  m.impl("causal_scan", relpos::nn::scan_meta);
  m.impl("causal_scan_backward", relpos::nn::scan_meta);
}

TORCH_LIBRARY_IMPL(relpos, Autograd, m) {
  m.impl("causal_scan", relpos::nn::scan_autograd);
}
