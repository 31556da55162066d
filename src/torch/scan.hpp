// The causal phase scan (kernels/scan.hpp) as the op `relpos::causal_scan` (CPU, Meta and
// Autograd kernels; its backward is the op `relpos::causal_scan_backward`, the reverse scan):
// per-token increments [B, T, C] (or [T, C]) into phases Phi_t = sum_{s<t} a_s, or the JoFormer
// reference code's time-reversed inclusive form. float32 (compensated) or float64, CPU.
#pragma once

#include <torch/torch.h>

#include <string>

namespace relpos::nn {

// mode: "exclusive" (causal, the papers') or "reversed_inclusive" (the JoFormer reference code's,
// which reads later tokens). Differentiable in `increments`.
torch::Tensor causal_scan(const torch::Tensor& increments, const std::string& mode = "exclusive");

}  // namespace relpos::nn
