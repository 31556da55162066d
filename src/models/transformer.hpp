// Decoder-only transformer language models with any mechanism in every attention layer. Attention
// runs through the engine (torch/attention.hpp: the mechanism's transforms, then the fused kernel
// with its biases). Two presets:
//   jordan  the Jordan-RoPE reference block (spec jordan-rope.md 2.1): pre-RMSNorm (eps 1e-6),
//           bias-free Linear(d, 3d) split q, k, v, exact-GELU MLP of ratio r, tied N(0,1)
//           embeddings as the output head, 1/sqrt(hd), causal; no absolute positions
//   pj      the PJ-RoPE block (pj-rope.md 3.3): pre-LayerNorm, qkv with bias, untied head
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torch/encoding.hpp"

namespace relpos::models {

enum class Preset { Jordan, PJ };
Preset parse_preset(const std::string& name);  // "jordan" | "pj"; InputError otherwise
std::string to_string(Preset p);

struct ModelConfig {
  Preset preset = Preset::Jordan;
  int64_t vocab = 3;
  int64_t d_model = 128;
  int64_t heads = 4;
  int64_t layers = 3;
  int64_t mlp_ratio = 2;
  std::string mechanism = "rope";  // spec string, one encoding per layer
  Layout layout = Layout::Interleaved;
  // "fused": the engine (transforms, then the fused kernel with biases inside); "composed": the
  // same math from plain LibTorch ops with materialised T x T scores (the baseline of the
  // performance comparisons and a cross-check)
  std::string attention = "fused";
  // PJ-RoPE's synthetic bridge (spec pj-rope.md 3.3): include_self = false lets no query see its
  // own position (strictly causal); freeze_qk zeroes the query/key projections, so the logits are
  // the mechanism's bias alone
  bool include_self = true;
  bool freeze_qk = false;
  int64_t head_dim() const { return d_model / heads; }
  // InputError naming the problem (head dim not dividing, sizes out of range, bad spec)
  void validate() const;
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& c, int64_t index);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions);
  // The norms of the transformed queries and keys per position, mean over batch and heads
  // ([T] each): how the mechanism rescales them along the sequence.
  std::pair<torch::Tensor, torch::Tensor> qk_norms(const torch::Tensor& x,
                                                   const torch::Tensor& positions);
  nn::PositionEncoding& encoding() { return enc_; }

 private:
  torch::Tensor norm(int which, const torch::Tensor& x);
  ModelConfig c_;
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, up_{nullptr}, down_{nullptr};
  torch::Tensor rms1_, rms2_;                         // jordan preset
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};  // pj preset
  nn::PositionEncoding enc_{nullptr};
};
TORCH_MODULE(Block);

class TransformerLMImpl : public torch::nn::Module {
 public:
  explicit TransformerLMImpl(const ModelConfig& c);
  // tokens [B, T] int64 -> logits [B, T, vocab]; positions [T] (default 0..T-1)
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions = {});
  const ModelConfig& config() const { return c_; }
  std::vector<Block>& blocks() { return blocks_; }
  int64_t parameter_count();
  // Per layer, the mean norms of the transformed q and k at each position ([T] each).
  std::vector<std::pair<torch::Tensor, torch::Tensor>> qk_norm_profile(const torch::Tensor& tokens);

 private:
  ModelConfig c_;
  torch::nn::Embedding embed_{nullptr};
  std::vector<Block> blocks_;
  torch::Tensor rms_f_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};  // pj preset (jordan ties the head to the embedding)
};
TORCH_MODULE(TransformerLM);

}  // namespace relpos::models
