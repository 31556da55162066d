// The torch side of a learned lag table (core/lag_kernel.hpp): one runtime per family, in its own
// file in this folder and named in list.inc, owning the family's initial tensors and its table
// [H, len] built with LibTorch ops from the module's tensors (float64, differentiable, O(H len)).
// Everything else (PositionEncoding, the attention op, the models, the Python op) goes through
// the functions below and never names a family (docs/architecture.md, "Learned lag tables").
#pragma once

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "core/lag_kernel.hpp"

namespace relpos::nn {

struct LagRuntime {
  // The initial tensors (float32), in the kernel's params() order, e.g. drawn from torch's
  // generator where the reference module does; null: the kernel's deterministic initial values.
  std::vector<torch::Tensor> (*initial)(const LagKernel& k, int heads) = nullptr;
  // b_h(d), d = 0..len-1, float64 [H, len], from one tensor per LagParam (any float dtype; shapes
  // checked by the caller).
  torch::Tensor (*table)(const LagKernel& k, const std::vector<torch::Tensor>& params,
                         int64_t len) = nullptr;
  // What training summaries record of the learned parameters (name, value; e.g. the PJ gates and
  // order masses); null: nothing.
  std::vector<std::pair<std::string, double>> (*stats)(
      const LagKernel& k, const std::vector<torch::Tensor>& params) = nullptr;
};

// The runtime of the kernel's term (std::logic_error naming it when list.inc has none).
const LagRuntime& lag_runtime(const LagKernel& k);
// The initial tensors through the runtime (float32, params() order).
std::vector<torch::Tensor> initial_lag_tensors(const LagKernel& k, int heads);
// The table through the runtime: the parameters' count and shapes checked against
// k.params(heads) (InputError naming the parameter), len >= 1.
torch::Tensor lag_table(const LagKernel& k, int heads, const std::vector<torch::Tensor>& params,
                        int64_t len);
// The runtime's summary of its learned parameters (empty when it has none).
std::vector<std::pair<std::string, double>> lag_stats(const LagKernel& k,
                                                      const std::vector<torch::Tensor>& params);
// Float64 snapshot of parameter tensors, for the core's reference table and diagnostics.
LagParamValues lag_values(const std::vector<torch::Tensor>& params);

#define RELPOS_LAG_RUNTIME(NAME) LagRuntime NAME##_lag_runtime();
#define RELPOS_CONTENT_RUNTIME(NAME)
#define RELPOS_ROTATION_RUNTIME(NAME)
#include "torch/mechanisms/list.inc"
#undef RELPOS_ROTATION_RUNTIME
#undef RELPOS_CONTENT_RUNTIME
#undef RELPOS_LAG_RUNTIME

}  // namespace relpos::nn
