#include "torch/mechanisms/lag_runtime.hpp"

#include <fmt/format.h>

#include <map>
#include <stdexcept>
#include <string>

#include "core/types.hpp"

namespace relpos::nn {

const LagRuntime& lag_runtime(const LagKernel& k) {
  static const std::map<std::string, LagRuntime> runtimes = {
#define RELPOS_LAG_RUNTIME(NAME) {#NAME, NAME##_lag_runtime()},
#define RELPOS_CONTENT_RUNTIME(NAME)
#define RELPOS_ROTATION_RUNTIME(NAME)
#include "torch/mechanisms/list.inc"
#undef RELPOS_ROTATION_RUNTIME
#undef RELPOS_CONTENT_RUNTIME
#undef RELPOS_LAG_RUNTIME
  };
  const auto it = runtimes.find(k.term());
  if (it == runtimes.end() || !it->second.table)
    throw std::logic_error(fmt::format(
        "{}: a learned lag table without a torch runtime (torch/mechanisms/list.inc)", k.term()));
  return it->second;
}

std::vector<torch::Tensor> initial_lag_tensors(const LagKernel& k, int heads) {
  const LagRuntime& r = lag_runtime(k);
  if (r.initial) return r.initial(k, heads);
  std::vector<torch::Tensor> out;
  for (const auto& p : k.params(heads))
    out.push_back(torch::tensor(p.init, torch::kDouble).view(p.shape).to(torch::kFloat));
  return out;
}

torch::Tensor lag_table(const LagKernel& k, int heads, const std::vector<torch::Tensor>& params,
                        int64_t len) {
  const auto spec = k.params(heads);
  if (params.size() != spec.size())
    throw InputError(fmt::format("{}: {} parameter tensors given, the lag table has {}", k.term(),
                                 params.size(), spec.size()));
  for (size_t i = 0; i < spec.size(); ++i) {
    if (!params[i].defined() || params[i].sizes() != c10::IntArrayRef(spec[i].shape))
      throw InputError(fmt::format(
          "{}: parameter '{}' must be [{}], got [{}]", k.term(), spec[i].name,
          fmt::join(spec[i].shape, ", "),
          params[i].defined() ? fmt::format("{}", fmt::join(params[i].sizes(), ", ")) : "none"));
    if (!params[i].is_floating_point())
      throw InputError(
          fmt::format("{}: parameter '{}' must be a float tensor", k.term(), spec[i].name));
  }
  if (len < 1) throw InputError(fmt::format("{}: the lag table needs at least one lag", k.term()));
  return lag_runtime(k).table(k, params, len);
}

std::vector<std::pair<std::string, double>> lag_stats(const LagKernel& k,
                                                      const std::vector<torch::Tensor>& params) {
  const LagRuntime& r = lag_runtime(k);
  if (!r.stats) return {};
  const torch::NoGradGuard no_grad;
  return r.stats(k, params);
}

LagParamValues lag_values(const std::vector<torch::Tensor>& params) {
  LagParamValues out;
  for (const auto& t : params) {
    const auto y = t.detach().to(torch::kCPU, torch::kDouble).contiguous().flatten();
    out.emplace_back(y.data_ptr<double>(), y.data_ptr<double>() + y.numel());
  }
  return out;
}

}  // namespace relpos::nn
