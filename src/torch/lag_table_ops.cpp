// The learned lag table operators of TORCH_LIBRARY(relpos), for the Python PositionEncoding:
// `lag_initial` (the parameters' initial tensors, as the C++ module creates them: the runtime may
// draw from torch's generator) and `lag_table` (the table [H, length], float64, built by the
// family's runtime from the given parameter tensors; CompositeImplicitAutograd, so autograd runs
// through the runtime's LibTorch ops). Generic: the spec string picks the kernel and its runtime
// (torch/mechanisms/lag_runtime.hpp); the parameters' names and shapes are in the mechanism's JSON
// (`relpos::mechanism`, biases[].lag_params).
#include <fmt/format.h>
#include <torch/library.h>
#include <torch/torch.h>

#include "core/registry.hpp"
#include "torch/mechanisms/lag_runtime.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

// The mechanism's learned lag bias (InputError when it has none).
const BiasTerm& learned_bias(const Mechanism& m) {
  const BiasTerm* b = m.learned_lag_bias();
  if (!b) throw InputError(fmt::format("'{}' has no learned lag table", m.spec));
  return *b;
}

Mechanism lag_mechanism(const std::string& spec, int64_t head_dim, int64_t heads) {
  if (head_dim <= 0 || head_dim > kMaxHeadDim || heads <= 0 || heads > kMaxHeads)
    throw InputError(fmt::format("head dim {} / heads {} out of range", head_dim, heads));
  return build_mechanism(spec, static_cast<int>(head_dim), static_cast<int>(heads));
}

std::vector<torch::Tensor> lag_initial_op(const std::string& spec, int64_t head_dim,
                                          int64_t heads) {
  return op_util::value_errors([&] {
    const Mechanism m = lag_mechanism(spec, head_dim, heads);
    return initial_lag_tensors(*learned_bias(m).learned, m.heads);
  });
}

torch::Tensor lag_table_op(const std::string& spec, int64_t head_dim, int64_t heads,
                           at::TensorList params, int64_t length) {
  return op_util::value_errors([&] {
    const Mechanism m = lag_mechanism(spec, head_dim, heads);
    return lag_table(*learned_bias(m).learned, m.heads, params.vec(), length);
  });
}

}  // namespace

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def("lag_initial(str spec, int head_dim, int heads) -> Tensor[]", relpos::nn::lag_initial_op);
  m.def("lag_table(str spec, int head_dim, int heads, Tensor[] params, int length) -> Tensor");
}

TORCH_LIBRARY_IMPL(relpos, CompositeImplicitAutograd, m) {
  m.impl("lag_table", relpos::nn::lag_table_op);
}
