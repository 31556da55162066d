// Decoder-only transformer language models with any mechanism in every attention layer. Attention
// runs through the engine (torch/attention.hpp: the mechanism's transforms, then the fused kernel
// with its biases). Two presets:
//   jordan  the Jordan-RoPE reference block (spec jordan-rope.md 2.1): pre-RMSNorm (eps 1e-6),
//           bias-free Linear(d, 3d) split q, k, v, exact-GELU MLP of ratio r, tied N(0,1)
//           embeddings as the output head, 1/sqrt(hd), causal; no absolute positions
//   pj      the PJ-RoPE block (pj-rope.md 3.3): pre-LayerNorm, qkv with bias, untied head
//   joformer the JoFormer block (grape-joformer.md 4.2): pre-LayerNorm (eps 1e-5), q/k/v/out with
//           bias, ReLU FFN of ratio r, dropout after the out projection and the FFN, no final norm,
//           untied head with bias; a per-token journey mechanism gets a model-level angle table
//           [vocab, D/2] (N(0, 1) radians) shared by every layer (or one per layer)
//   grape   the Llama/GRAPE block (grape-joformer.md 1.1): pre-RMSNorm (eps 1e-5, fp32), bias-free
//           q/k/v/out, SwiGLU MLP of width floor(8/3 d), the GRAPE attention sublayer
//           (torch/grape.hpp: KV-shift, rotation, QK-RMSNorm with head-shared gains, biases in the
//           fused kernel), final RMSNorm, head tied to the N(0, 0.02) embedding; the reference's
//           init (N(0, 0.5/sqrt d), output projections / sqrt(layers)) and decay grouping
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torch/encoding.hpp"
#include "torch/grape.hpp"

namespace relpos::models {

enum class Preset { Jordan, PJ, JoFormer, Grape };
// "jordan" | "pj" | "joformer" | "grape"; InputError otherwise
Preset parse_preset(const std::string& name);
std::string to_string(Preset p);

// One fused projection's output [B, T, 3 H hd] as q, k, v [B, H, T, hd] (views, in that order).
// unbind over the q/k/v axis of the [B, T, 3, H, hd] view, then a transpose each: unbind's
// backward stacks the three gradients into that very layout, the projection's gradient as it is
// (a view), so the three are copied once a layer. (Three selects would each fill a zero tensor
// and autograd add the three; unbinding a permuted [3, B, H, T, hd] view would stack into that
// order and copy again into the projection's.)
inline std::vector<torch::Tensor> split_qkv(const torch::Tensor& qkv, int64_t heads,
                                            int64_t head_dim) {
  auto parts = qkv.view({qkv.size(0), qkv.size(1), 3, heads, head_dim}).unbind(2);
  for (auto& t : parts) t = t.transpose(1, 2);
  return parts;
}

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
  // performance comparisons and a cross-check); "sdpa": the mechanism's transforms, then LibTorch's
  // scaled_dot_product_attention, causal (the strongest baseline a LibTorch user has: mechanisms
  // without biases or frames, default positions, include_self); "sdpa_table": the same SDPA model
  // written as users write RoPE (HF's rotary embedding): q cos + rotate_half(q) sin with the
  // cos/sin table computed once per length, for transforms that rotate (and scale) pairs
  std::string attention = "fused";
  // PJ-RoPE's synthetic bridge (spec pj-rope.md 3.3): include_self = false lets no query see its
  // own position (strictly causal); freeze_qk zeroes the query/key projections, so the logits are
  // the mechanism's bias alone
  bool include_self = true;
  bool freeze_qk = false;
  // The JoFormer comparison (grape-joformer.md 4): "softmax" attention weights (the paper) or
  // "softplus" (the reference code: w_ij = ln(1 + e^{s_ij}) for j <= i, unnormalised; composed,
  // since it is not a softmax); dropout after the out projection, the FFN and (softplus) on the
  // weights; a token embedding of width embed_dim followed by a Linear expander to d_model (0:
  // d_model without expander, except d_model / 2 for the JoFormer preset with per-token angles,
  // as the reference); per-layer angle tables instead of one shared table
  std::string weights = "softmax";
  double dropout = 0.0;
  int64_t embed_dim = 0;
  bool angles_per_layer = false;
  // The GRAPE block's data-dependent token shift of k and/or v: none | k | v | kv
  std::string kv_shift = "none";
  int64_t head_dim() const { return d_model / heads; }
  // InputError naming the problem (head dim not dividing, sizes out of range, bad spec)
  void validate() const;
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& c, int64_t index);
  // frame: per-token journey frames [B, T, D/2] (mechanisms with per-token angles), else undefined
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions,
                        const torch::Tensor& frame = {});
  // The norms of the transformed queries and keys per position, mean over batch and heads
  // ([T] each): how the mechanism rescales them along the sequence.
  std::pair<torch::Tensor, torch::Tensor> qk_norms(const torch::Tensor& x,
                                                   const torch::Tensor& positions);
  nn::PositionEncoding& encoding();
  // The grape preset's streaming path: the next tokens' hidden states x [B, T, d] given the
  // layer's cache (updated); equals forward() on the whole sequence.
  torch::Tensor step(const torch::Tensor& x, nn::GrapeDecodeState& state);
  // The attention block's own diagnostics for the training log, by name (the grape preset's:
  // the QK-norm gains' pair gap, which breaks a rotation's relative law once gain_m !=
  // gain_{m+D/2}, and the mean log frequency of learned frequencies); empty for the others.
  std::vector<std::pair<std::string, double>> attention_stats();

 private:
  torch::Tensor norm(int which, const torch::Tensor& x);
  // the reference JoFormer's unnormalised softplus attention (composed)
  torch::Tensor softplus_attention(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& positions,
                                   const torch::Tensor& frame);
  ModelConfig c_;
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, up_{nullptr}, down_{nullptr};
  torch::Tensor rms1_, rms2_;                         // jordan preset
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};  // pj preset
  nn::PositionEncoding enc_{nullptr};
  nn::GrapeAttention grape_{nullptr};  // grape preset
  torch::Tensor grape_mlp(const torch::Tensor& h);
  // sdpa_table: q and k turned through the cos/sin table (made and checked against the
  // transform on the first call of each length)
  std::pair<torch::Tensor, torch::Tensor> table_rotated(const torch::Tensor& q,
                                                        const torch::Tensor& k);
  torch::Tensor table_;
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
  // The per-token journey frames of layer `layer` for these tokens ([B, T, D/2]; undefined when
  // the mechanism has fixed angles).
  torch::Tensor journey_frames(const torch::Tensor& tokens, int64_t layer);
  // grape preset: logits [B, T, vocab] of the next tokens given every layer's cache (resized to
  // the layers on first use, updated); a sequence fed in pieces gives forward()'s logits.
  torch::Tensor step(const torch::Tensor& tokens, std::vector<nn::GrapeDecodeState>& states);
  // Parameters to decay and not to decay (the grape preset exempts the RMSNorm gains; the other
  // presets decay everything).
  std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> decay_groups();

 private:
  ModelConfig c_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::Linear expand_{nullptr};        // embed_dim -> d_model (embed_dim > 0)
  std::vector<torch::Tensor> angle_tables_;  // per-token journey angles [vocab, D/2]
  std::vector<Block> blocks_;
  torch::Tensor rms_f_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};  // pj preset (jordan ties the head to the embedding)
};
TORCH_MODULE(TransformerLM);

}  // namespace relpos::models
