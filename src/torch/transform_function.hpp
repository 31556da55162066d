// Autograd over the transform kernels (kernels/transform.hpp): one function for queries and keys
// together, so the trig table is built once per call and reused by the backward pass.
#pragma once

#include <torch/torch.h>

#include "kernels/transform.hpp"

namespace relpos::nn {

// q, k: [B, H, T, D] float or double, CPU; params in the same dtype (empty tensors when the
// mechanism has none); positions float64 [T] or [B, T]; center = c0 (resolved).
// Returns {q~, k~}; differentiable in q, k and every parameter tensor.
std::vector<torch::Tensor> transform_qk(const kernels::TransformPlan& plan, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& gamma,
                                        const torch::Tensor& eta, const torch::Tensor& gates,
                                        const torch::Tensor& alpha0,
                                        const torch::Tensor& positions, double center);

}  // namespace relpos::nn
