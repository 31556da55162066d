// The position transform as LibTorch calls: thin wrappers over the `relpos` operator library
// (torch/ops.cpp, TORCH_LIBRARY(relpos)), so C++ callers and Python share one op, its autograd
// kernel and its fake kernel. The op builds the kernel plan from the mechanism's canonical spec.
#pragma once

#include <torch/torch.h>

#include "core/mechanism.hpp"

namespace relpos::nn {

// q, k: [B, H, T, D] float or double, CPU; params in the same dtype (empty tensors when the
// mechanism has none); positions [T] or [B, T]; center = c0 (resolved). Applies the mechanism's
// position-driven term. Returns {q~, k~}, differentiable in q, k and every parameter tensor.
// trig: optional {cos, sin} table from trig_table() for the same positions, centre and dtype
// (a module caches it across calls with the same positions); computed by the op when empty.
// check_finite: the kernel checks its outputs tile by tile and raises c10::ValueError ("q contains
// NaN or Inf") when one is not finite, which every non-finite input gives (no extra pass).
std::vector<torch::Tensor> transform_qk(const Mechanism& m, Layout layout, const torch::Tensor& q,
                                        const torch::Tensor& k,
                                        const BlockParamSet<torch::Tensor>& params,
                                        const torch::Tensor& positions, double center,
                                        const std::vector<torch::Tensor>& trig = {},
                                        bool check_finite = false);

// The kernels' trig table {cos, sin} for batch B (positions [T] shared, or [B, T]).
std::vector<torch::Tensor> trig_table(const Mechanism& m, Layout layout, int64_t B,
                                      const torch::Tensor& positions, double center,
                                      torch::ScalarType dtype);

}  // namespace relpos::nn
