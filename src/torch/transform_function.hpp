// Autograd over the transform kernels (kernels/transform.hpp): one function for queries and keys
// together, so the trig table is built once per call and reused by the backward pass.
#pragma once

#include <torch/torch.h>

#include "kernels/transform.hpp"

namespace relpos::nn {

// q, k: [B, H, T, D] float or double, CPU; params in the same dtype (empty tensors when the
// mechanism has none); positions float64 [T] or [B, T]; center = c0 (resolved).
// Returns {q~, k~}; differentiable in q, k and every parameter tensor.
// trig: optional {cos, sin} table from trig_table() for the same positions, centre and dtype
// (a module caches it across calls with the same positions); computed here when empty.
std::vector<torch::Tensor> transform_qk(const kernels::TransformPlan& plan, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& gamma,
                                        const torch::Tensor& eta, const torch::Tensor& gates,
                                        const torch::Tensor& alpha0, const torch::Tensor& positions,
                                        double center, const std::vector<torch::Tensor>& trig = {});

// The kernels' trig table {cos, sin} for [B, H, T] inputs (B = positions' batch when [B, T]).
std::vector<torch::Tensor> trig_table(const kernels::TransformPlan& plan, int64_t B, int64_t T,
                                      const torch::Tensor& positions, double center,
                                      torch::ScalarType dtype);

}  // namespace relpos::nn
