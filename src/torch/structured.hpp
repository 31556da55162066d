// Structured rotations by vector positions (kernels/structured.hpp, issue 15) as the op
// `relpos::structured_rotate` (CPU, Meta and Autograd kernels; the backward is the op
// `relpos::structured_rotate_backward`):
//   y_t = R(r_t) x_t,  R(r) = U [ (+)_u R_2(theta_u(r)) (+) I ] U^T,  theta_u(r) = sum_k
//   lambda_{k,u} r_k,
// with x [B, H, T, D], U [D, D] or [H, D, D] orthogonal (only its first 2M columns are read),
// lambda [dc, M] or [H, dc, M], positions [T, dc] or [B, T, dc] (any real dtype; the angles are
// formed in float64). Queries and keys take the same rotation (R is orthogonal), so
// (R(r_i) q) . (R(r_j) k) = q . R(r_j - r_i) k for a commuting family (Theorem 1). Differentiable
// in x, U and lambda; float32 or float64, CPU. U from a learned W: nn::orthogonal_basis (Cayley or
// exp, torch/grape_generators.hpp), whose autograd carries dU back to W.
#pragma once

#include <torch/torch.h>

namespace relpos::nn {

// inverse: R(-r) = R(r)^T.
torch::Tensor structured_rotate(const torch::Tensor& x, const torch::Tensor& basis,
                                const torch::Tensor& freqs, const torch::Tensor& positions,
                                bool inverse = false);

}  // namespace relpos::nn
