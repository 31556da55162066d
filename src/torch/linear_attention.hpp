// C++ entry points of the FAVOR+ operators (torch/linear_attention_ops.cpp): linear attention on
// positive random features of q and k, and the projection they are drawn with. nn::Attention's
// backend "favor" runs through these.
#pragma once

#include <torch/torch.h>

namespace relpos::nn {

// The op relpos::favor_attention (autograd through its backward op): q, k [B, H, T, D], v
// [B, H, T, Dv], projection [m, D]; scale multiplies q and k before the features (0: D^(-1/4)).
torch::Tensor favor_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& projection, bool causal,
                              double scale);
// W [m, d] float64: orthogonal blocks with chi-distributed norms (or iid rows), from the seed.
torch::Tensor random_projection(int64_t m, int64_t d, bool orthogonal, int64_t seed);

}  // namespace relpos::nn
