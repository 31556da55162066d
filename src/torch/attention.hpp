// Attention through the fused CPU kernel (kernels/attention) as LibTorch calls: thin wrappers
// over the `relpos::fused_attention` op (torch/attention_ops.cpp: CPU, Meta and Autograd kernels)
// and the mechanism-level call that applies a mechanism's transforms and hands its biases to the
// kernel. C++ and Python (relpos.attention) share these ops.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <string>

#include "torch/encoding.hpp"

namespace relpos::nn {

// Everything of an attention call except q, k, v. Tensors are optional (undefined = absent).
struct AttentionArgs {
  torch::Tensor q_positions;  // [Tq] or [B, Tq], any real dtype; default Tk - Tq + i
  torch::Tensor k_positions;  // [Tk] or [B, Tk]; default j
  bool causal = true;
  double window = 0.0;      // > 0: key j visible to query i only when p_i - p_j < window
  torch::Tensor key_len;    // int64 [B]: valid keys per batch row (key padding on the right)
  torch::Tensor key_start;  // int64 [B]: the first valid key per batch row (left padding)
  // packed sequences: segment (document) ids [B, Tq] and [B, Tk], both or neither; a key is
  // visible only to the queries of its segment
  torch::Tensor q_segments, k_segments;
  double scale = 0.0;  // 0: 1 / sqrt(D)
  // Additive biases on top of the mechanism's own (kernels/attention/attention.hpp):
  torch::Tensor lag_table;  // [Hq, L], q's dtype: + lag_table[h][round(p_i - p_j)] (clamped)
  torch::Tensor slopes;     // [Hq]: - slopes[h] (p_i - p_j)
  torch::Tensor cq, ck;  // [B, Hq, Tq], [B, Hq, Tk]: + cq[i] - ck[j] (pass float64 for long sums)
  bool exclude_self = false;  // causal only: keys strictly before the query (p_j < p_i)
  // Per-token journey frames (mechanisms with journey(angles=token)): the content phases
  // [B, T, P] of the keys and queries (nn::content_frame_angles); q_frame defaults to k_frame.
  torch::Tensor q_frame, k_frame;
  // Content-dependent biases (GRAPE, torch/grape.hpp): gated slopes - (p_i - p_j) (gq_i + gk_j),
  // gq [B, Hq, Tq], gk [B, Hq, Tk] (either may be absent); the path integral
  // + sum_{l=j+1..slot(i)} path_beta_h logsigmoid(path_scale path_q_i . path_k_l) with probes
  // [B, Hq, T, P] and path_beta [Hq] (kernels/attention/attention.hpp; default positions only).
  torch::Tensor gq, gk, path_q, path_k, path_beta;
  double path_scale = 1.0;
  // A half storage dtype (bfloat16, float16) for the kernel's operands of a float32 call: q, k
  // and v are rounded to it once, the kernel reads them as stored (on Isa::Amx, bfloat16 tile
  // products), and the output comes back float32. The modules set it for half inputs, whose
  // mechanism computes in float32; nullopt: the operands as they are.
  std::optional<c10::ScalarType> kernel_storage;
};

// Fused softmax attention: q [B, Hq, Tq, D], k and v [B, Hk, Tk, D] (Hk divides Hq), float32 or
// float64 on the CPU. Returns {out [B, Hq, Tq, D], lse [B, Hq, Tq]}; differentiable in q, k, v and
// every bias tensor, and lse is differentiable too. The T x T scores are never stored.
std::vector<torch::Tensor> fused_attention(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, const AttentionArgs& args = {});

// The CPU forward kernel of fused_attention called directly, without the dispatcher or autograd:
// for a call that records no gradient and whose dispatch would cost a share of its time (a decode
// step over a few hundred keys). Same arguments (kernel_storage unset) and results.
std::vector<torch::Tensor> fused_attention_cpu_forward(const torch::Tensor& q,
                                                       const torch::Tensor& k,
                                                       const torch::Tensor& v,
                                                       const AttentionArgs& args);

// Attention with a mechanism: its transforms (a journey term rotates q, k, v by their frames and
// the output back, torch/journey.hpp) (the encoding's parameters, so they train) on q and k,
// its biases (ALiBi slopes) added to args' biases inside the kernel. The encoding is built for
// Hk heads: with grouped-query attention every query head uses the transform of its key/value
// head (the relative law needs one map per scored pair). Returns out [B, Hq, Tq, D].
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        PositionEncodingImpl& encoding, const AttentionArgs& args = {});

// The same with a spec string and the mechanism's initial parameters (exact fixed mechanisms:
// rope, alibi, damped_rope, ...): the `relpos::attention` op.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::string& spec, const AttentionArgs& args = {},
                        Layout layout = Layout::Interleaved);

// Plain LibTorch composition with materialised float64-capable scores (the correctness reference
// and the baseline of the benchmarks): same arguments and conventions as fused_attention.
torch::Tensor composed_attention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const AttentionArgs& args = {});

}  // namespace relpos::nn
