// A small non-causal attention model over a 2-D grid of tokens (the structured-2d experiment,
// issue 15 item 5), with the position mechanism acting on queries and keys through vector
// positions r = (row, col) (structured rotations paper, Sec. 2):
//
//   R(r) = U [ (+)_u R_2(theta_u(r)) ] U^T,   theta_u(r) = sum_k lambda_{k,u} r_k,   k in {row,
//   col}
//
// per head, u = 0..D/2-1 over the half-split planes (u, u + D/2) (every plane active: d_null = 0),
// applied to q and k alike, so (R(r_i) q) . (R(r_j) k) = q . R(r_j - r_i) k (Lemma 2). Mechanisms
// (ModelConfig::mechanism, optionally with "(theta=X)"):
//   nope         no positions at all
//   axial_rope   U = I, planes 0..D/4-1 turn with the row, D/4..D/2-1 with the column, at the
//                fixed frequencies theta^(-i / (D/4)), i = 0..D/4-1 (theta = 100 by default)
//   mixed_rope   U = I, every plane turns with both axes, lambda [H, 2, D/2] learned (RoPE-Mixed):
//                initialised at the axial magnitudes along a random direction per head and plane
//   structured   U = Cayley(W - W^T) per head learned (W = 0 at init: U = I), lambda learned with
//                mixed_rope's initialisation: the learned-basis structured rotation
// Angles are computed in float64 from float64 positions and cast (the repository's convention),
// the rotation is torch::nn's basis_rotate (torch/grape_generators.hpp) for the structured form
// and the same half-split formula without the basis otherwise, all plain LibTorch ops under
// autograd.
//
// Block: pre-LayerNorm, q/k/v/out linears with bias, non-causal softmax attention through the
// fused kernel (nn::fused_attention, causal = false), GELU MLP of ratio mlp_ratio; token
// embedding, final LayerNorm, linear classifier per cell (2 classes).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace relpos::models {

enum class Grid2dPosition { NoPE, Axial, Mixed, Structured };

struct Grid2dMechanism {
  Grid2dPosition kind = Grid2dPosition::Axial;
  double theta = 100.0;
};
// "nope" | "axial_rope" | "mixed_rope" | "structured", each optionally "(theta=X)"; InputError
// naming the problem otherwise.
Grid2dMechanism parse_grid2d_mechanism(const std::string& spec);
std::vector<std::string> grid2d_mechanisms();

struct Grid2dModelConfig {
  int64_t vocab = 2;
  int64_t classes = 2;
  int64_t d_model = 32;
  int64_t heads = 2;
  int64_t layers = 2;
  int64_t mlp_ratio = 2;
  std::string mechanism = "axial_rope";
  // InputError naming the problem (sizes out of range, head dim not a multiple of 4, bad spec)
  void validate() const;
};

// Positions of a side x side grid, cell t = row * side + col: [side^2, 2] float64 rows
// (row + offset_row, col + offset_col).
torch::Tensor grid2d_positions(int64_t side, double offset_row = 0, double offset_col = 0);

// The position mechanism of one attention layer.
class PlaneRotation2dImpl : public torch::nn::Module {
 public:
  PlaneRotation2dImpl(Grid2dMechanism m, int64_t heads, int64_t head_dim);
  // x [B, H, T, D]; positions [T, 2] or [B, T, 2] (any real dtype): R(r_t) x_t per head.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions);
  // theta_u(r) in float64: [H, T, D/2] (or [B, H, T, D/2] for per-batch positions)
  torch::Tensor angles(const torch::Tensor& positions);
  // U [H, D, D] (structured), else undefined
  torch::Tensor basis();
  // lambda [H, 2, D/2] (learned for mixed_rope / structured, fixed for axial_rope)
  const torch::Tensor& lambda() const { return lambda_; }
  Grid2dPosition kind() const { return m_.kind; }

 private:
  Grid2dMechanism m_;
  int64_t heads_, head_dim_;
  torch::Tensor lambda_, W_;
};
TORCH_MODULE(PlaneRotation2d);

class Grid2dBlockImpl : public torch::nn::Module {
 public:
  Grid2dBlockImpl(const Grid2dModelConfig& c, const Grid2dMechanism& m);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions);
  PlaneRotation2d& rotation() { return rot_; }

 private:
  int64_t heads_, head_dim_;
  bool rotate_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, up_{nullptr}, down_{nullptr};
  PlaneRotation2d rot_{nullptr};
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
