// The same transforms composed from plain LibTorch ops, autograd for the backward: what a user
// would write by hand. It is the baseline of the speed ratios in bench/ and a third independent
// implementation the kernels are tested against.
#pragma once

#include <torch/torch.h>

#include "core/mechanism.hpp"
#include "torch/encoding.hpp"

namespace relpos::nn {

// positions float64 [T] or [B, T]; params as from PositionEncodingImpl::kernel_params().
std::vector<torch::Tensor> composed_transform_qk(const Mechanism& m, Layout layout,
                                                 const KernelParams& params, const torch::Tensor& q,
                                                 const torch::Tensor& k,
                                                 const torch::Tensor& positions, double center);

}  // namespace relpos::nn
