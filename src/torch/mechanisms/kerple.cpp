// KERPLE's kernels (core/mechanisms/kerple.cpp) from the module's raw tensors:
// r1 = softplus(raw_r1), r2 = softplus(raw_r2) (log) or 2 sigmoid(raw_r2) (power), and
//   log: -r1 log(1 + r2 d),  power: -r1 d^r2 (0 at d = 0, written exp(r2 log d) for d > 0 so the
// gradient in r2 stays finite at d = 0).
#include "torch/mechanisms/lag_runtime.hpp"

namespace relpos::nn {

namespace {

torch::Tensor kerple_table(const LagKernel& k, const std::vector<torch::Tensor>& params,
                           int64_t len) {
  const bool log_kernel = k.text("kernel") == "log";
  const auto raw1 = params.at(0).to(torch::kDouble), raw2 = params.at(1).to(torch::kDouble);
  const int64_t H = raw1.size(0);
  const auto r1 = torch::nn::functional::softplus(raw1).view({H, 1});
  const auto r2 = (log_kernel ? torch::nn::functional::softplus(raw2) : 2.0 * torch::sigmoid(raw2))
                      .view({H, 1});
  const auto d = torch::arange(len, raw1.options()).view({1, len});
  if (log_kernel) return -r1 * torch::log1p(r2 * d);
  const auto log_d = torch::log(d.clamp_min(1.0));  // 0 at d = 0 (masked below)
  return torch::where(d > 0, -r1 * torch::exp(r2 * log_d), torch::zeros({1, 1}, raw1.options()));
}

}  // namespace

LagRuntime kerple_lag_runtime() {
  return {nullptr, kerple_table};
}

}  // namespace relpos::nn
