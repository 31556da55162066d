// T5's relative position buckets (core/mechanisms/t5_bias.cpp): the table gathers the learned
// [H, buckets] weights at each lag's bucket. The bucket of every lag comes from the core
// reference itself: its table at weights w[0, b] = b is the bucket index (a gather of exact
// integers), so the two can never disagree on a bucket boundary.
#include "torch/mechanisms/lag_runtime.hpp"

namespace relpos::nn {

namespace {

torch::Tensor t5_table(const LagKernel& k, const std::vector<torch::Tensor>& params, int64_t len) {
  const torch::Tensor& w = params.at(0);  // [H, buckets]
  std::vector<double> index_weights(static_cast<size_t>(w.size(1)));
  for (size_t b = 0; b < index_weights.size(); ++b) index_weights[b] = static_cast<double>(b);
  const auto buckets = relpos::lag_table(k, {index_weights}, 1, len);
  const auto idx = torch::tensor(buckets, torch::kDouble).to(w.device(), torch::kLong);
  return w.to(torch::kDouble).index_select(1, idx);
}

}  // namespace

LagRuntime t5_bias_lag_runtime() {
  return {nullptr, t5_table};
}

}  // namespace relpos::nn
