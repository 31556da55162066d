// A small non-causal attention model over a 2-D grid of tokens (the structured-2d experiment,
// issue 15 item 5): its attention is nn::Attention (the one engine) over a spec from the catalog
// that rotates by vector positions r = (row, col), or one that reads no positions:
//   axial_rope   structured(basis=axial): planes 0..D/4-1 turn with the row, D/4..D/2-1 with the
//                column, at theta^(-i / (D/4)) (theta = 100)
//   mixed_rope   structured(basis=mixed): every plane turns with both axes, lambda [H, 2, D/2]
//                learned (RoPE-Mixed), initialised at the axial magnitudes along seeded random
//                directions
//   structured   structured(basis=cayley): mixed's lambda and a learned basis U = Cayley(W - W^T)
//                per head (W = 0 at init)
//   nope         no positions at all
// or any other spec of that kind (structured(dims=2, basis=exp, theta=50), ...). The planes are
// the half-split pairs (u, u + D/2), so (R(r_i) q) . (R(r_j) k) = q . R(r_j - r_i) k (Lemma 2).
// The rotation's parameters are the attention module's (`attn.freqs`, `attn.basis_w`).
//
// Block: pre-LayerNorm, q/k/v/out linears with bias, non-causal softmax attention through the
// fused kernel, GELU MLP of ratio mlp_ratio; token embedding, final LayerNorm, linear classifier
// per cell (2 classes).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torch/attention_module.hpp"

namespace relpos::models {

struct Grid2dModelConfig {
  int64_t vocab = 2;
  int64_t classes = 2;
  int64_t d_model = 32;
  int64_t heads = 2;
  int64_t layers = 2;
  int64_t mlp_ratio = 2;
  std::string mechanism = "axial_rope";  // a spec (above)
  // InputError naming the problem (sizes out of range, a spec that is not a 2-D vector-position
  // rotation nor position-free, or that does not fit the head)
  void validate() const;
};

// Positions of a side x side grid, cell t = row * side + col: [side^2, 2] float64 rows
// (row + offset_row, col + offset_col).
torch::Tensor grid2d_positions(int64_t side, double offset_row = 0, double offset_col = 0);

class Grid2dBlockImpl : public torch::nn::Module {
 public:
  explicit Grid2dBlockImpl(const Grid2dModelConfig& c);
  // x [B, T, d_model]; positions [T, 2] or [B, T, 2]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions);
  nn::Attention& attention() { return attn_; }
  // the learned orthogonal basis E of the rotation [H, D, D] (U = E P), undefined when it has none
  torch::Tensor learned_basis();

 private:
  int64_t heads_, head_dim_;
  bool vector_;  // the mechanism rotates by the positions (else it reads none)
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, up_{nullptr}, down_{nullptr};
  nn::Attention attn_{nullptr};
};
TORCH_MODULE(Grid2dBlock);

class Grid2dNetImpl : public torch::nn::Module {
 public:
  explicit Grid2dNetImpl(const Grid2dModelConfig& c);
  // tokens [B, T] int64 with T = side^2 -> logits [B, T, classes]; positions [T, 2] or [B, T, 2]
  // (default: grid2d_positions(side))
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions = {});
  const Grid2dModelConfig& config() const { return c_; }
  std::vector<Grid2dBlock>& blocks() { return blocks_; }
  int64_t parameter_count();

 private:
  Grid2dModelConfig c_;
  torch::nn::Embedding embed_{nullptr};
  std::vector<Grid2dBlock> blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Grid2dNet);

}  // namespace relpos::models
