// StepPlan: a Python module's state for its cached steps, and its two one-call steps
// (torch/cache_ops.cpp registers it as torch.classes.relpos.StepPlan, whose methods these are;
// the operator library's Python module, torch/ops_library.cpp, calls them without TorchScript's
// method call between).
#pragma once

#include <torch/custom_class.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/mechanism.hpp"

namespace relpos::nn {

// Its mechanism parsed once (the parse cost about a tenth of a decode step at a hundred keys)
// and the kernel parameters with the copy of the schema's values they were computed from. Held
// by the encoding (PositionEncoding._step_plan; dropped when it is pickled; itself pickled as the
// spec and dims, the parameters then handed again).
struct StepPlan : torch::CustomClassHolder {
  std::string spec;
  int64_t head_dim, kv_heads;
  Mechanism mechanism;
  std::vector<torch::Tensor> schema, params;  // params computed from these schema values
  // a content bias's term is built for the query heads: that mechanism, made on first use
  std::optional<Mechanism> query_heads;

  StepPlan(std::string spec_in, int64_t head_dim_in, int64_t kv_heads_in);

  void set_params(std::vector<torch::Tensor> schema_values, std::vector<torch::Tensor> kernel) {
    schema = std::move(schema_values);
    params = std::move(kernel);
  }

  // whether params are of the schema's present values, in the compute dtype of `stored`
  bool current(const std::vector<torch::Tensor>& now, c10::ScalarType stored) const;
};

// plan.decode and plan.transform (their contracts: torch/cache_ops.cpp's header)
std::tuple<torch::Tensor, torch::Tensor, int64_t, int64_t> decode_method(
    const c10::intrusive_ptr<StepPlan>& plan, const torch::Tensor& q_in, const torch::Tensor& k_in,
    const torch::Tensor& v, const torch::Tensor& keys, const torch::Tensor& values,
    const torch::Tensor& positions, const torch::Tensor& lengths,
    const c10::optional<torch::Tensor>& new_positions, const c10::optional<torch::Tensor>& key_len,
    const std::vector<torch::Tensor>& schema, int64_t num_heads, int64_t layout, bool causal,
    double window, double scale, bool check_finite, int64_t warned,
    const std::vector<torch::Tensor>& content_params, const c10::optional<torch::Tensor>& inputs,
    const std::vector<torch::Tensor>& content_store);

std::tuple<torch::Tensor, torch::Tensor, int64_t, bool> transform_method(
    const c10::intrusive_ptr<StepPlan>& plan, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& positions, const std::vector<torch::Tensor>& schema, int64_t layout,
    bool check_finite, int64_t warned);

}  // namespace relpos::nn
