// The GRAPE attention sublayer (spec grape-joformer.md 1.1, 2): the part of a Llama/GRAPE block
// between the q/k/v projections and the output projection. It owns what turns token
// representations into a mechanism's position-dependent parts and runs the fused kernel with them:
//   KV-shift     k_t <- a_t k_{t-1} + (1 - a_t) k_t, a_t = sigmoid(s_h . x_t) (and for v)
//   rotation     the mechanism's transform (rope, ...) or GRAPE-M's learned frames: half-split
//                planes turned by -t theta_m, theta_m = exp(lambda_m / 16), or by -Phi_t theta_m
//                with the causal content phase Phi_t = sum_{s<t} sigmoid((w.x_s + b) / 16)
//   QK-RMSNorm   after the rotation, one gain of size D for q and one for k shared by the heads
//                (the relative law holds while gain_m == gain_{m+D/2}: gain_pair_gap())
//   biases       ALiBi slopes; GRAPE-A gates gq/gk; FoX cumulative log forget gates cq = ck = c;
//                GRAPE-AP probes (key probe RMS-normalised and rotated by -l rad)
// all inside the fused kernel (kernels/attention: never a T x T tensor). step() is the streaming
// path: one token against a cache of post-rotation, post-norm keys and each form's side state.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "core/mechanism.hpp"
#include "torch/attention.hpp"
#include "torch/encoding.hpp"

namespace relpos::nn {

enum class KvShift { None, K, V, KV };
KvShift parse_kv_shift(const std::string& s);  // "none" | "k" | "v" | "kv"; InputError otherwise
std::string to_string(KvShift s);

// Everything a layer carries between decode steps (one sequence batch).
struct GrapeDecodeState {
  torch::Tensor k, v;  // [B, H, t, D]: post-rotation, post-norm keys; values
  // [B, H, t, ...]: the content bias's key-side tensors (GRAPE-A key gates, FoX cumulative log
  // forget gates in float64, GRAPE-AP rotated key probes: torch/mechanisms/content_runtime.hpp)
  std::vector<torch::Tensor> content;
  torch::Tensor phase;           // [B, 1] float64: GRAPE-M-ctx running phase Phi_t
  torch::Tensor prev_k, prev_v;  // [B, H, 1, D]: last raw projections (KV-shift)
  int64_t length = 0;
};

class GrapeAttentionImpl : public torch::nn::Module {
 public:
  // attention: "fused" (the kernel) or "composed" (materialised LibTorch scores, the baseline)
  GrapeAttentionImpl(const std::string& spec, int64_t d_model, int64_t heads, KvShift shift,
                     std::string attention = "fused");

  // x: the sublayer input after the pre-norm [B, T, d_model]; q, k, v: its projections
  // [B, H, T, D]. Positions are 0..T-1. Returns the attention output [B, H, T, D].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v);
  // The same for the next T tokens of sequences whose earlier tokens are in `state` (updated).
  torch::Tensor step(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v, GrapeDecodeState& state);

  // What the kernel sees for these tokens (tests and diagnostics): rotated, normalised q and k,
  // values after the shift, and the bias arguments.
  struct Parts {
    torch::Tensor q, k, v;
    AttentionArgs args;
    std::vector<torch::Tensor> content;  // the new keys' content side tensors (args has them)
    torch::Tensor phase_end;             // GRAPE-M-ctx: Phi after the last token [B, 1]
    torch::Tensor last_k, last_v;        // raw projections of the last token (KV-shift state)
  };
  Parts parts(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& k,
              const torch::Tensor& v, const GrapeDecodeState* state = nullptr);

  // max_m |gain_m - gain_{m+D/2}| over the q and k gains: 0 keeps the exact relative law of a
  // half-split rotation followed by the norm; above 0 the gain breaks it.
  double gain_pair_gap() const;
  // GRAPE-M frequencies theta_m (empty without a learned rotation), and resetting them to the
  // initial (RoPE) spectrum in the parameter's current dtype (after to(kDouble): exact in float64)
  torch::Tensor frequencies() const;
  void reset_frequencies();
  const Mechanism& mechanism() const { return mech_; }
  PositionEncoding& encoding() { return enc_; }

 private:
  torch::Tensor attend(const Parts& p);
  Mechanism mech_;
  const TransformTerm* learned_ = nullptr;  // GRAPE-M term
  const BiasTerm* content_ = nullptr;       // GRAPE-A / FoX / GRAPE-AP term
  int64_t heads_, head_dim_;
  KvShift shift_;
  std::string attention_;
  PositionEncoding enc_{nullptr};  // fixed transforms (rope, ...) and ALiBi slopes
  torch::Tensor q_gain_, k_gain_;
  std::vector<torch::Tensor> rotation_params_;  // GRAPE-M (its runtime's; log_freq first)
  std::vector<torch::Tensor> content_params_;   // GRAPE-A / FoX / GRAPE-AP (its runtime's)
  torch::Tensor slopes_;                        // ALiBi slopes m_h [H] (buffer)
  torch::nn::Linear shift_k_{nullptr}, shift_v_{nullptr};  // KV-shift gates
};
TORCH_MODULE(GrapeAttention);

// Parameters of a GRAPE model that the reference initialises specially or does not decay, by
// name: the gate directions, the contextual phase weights and the log-frequencies keep their own
// initialisation; RMSNorm gains are not decayed.
bool grape_keeps_init(const std::string& parameter_name);
bool grape_no_decay(const std::string& parameter_name);

}  // namespace relpos::nn
