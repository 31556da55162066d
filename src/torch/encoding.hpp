// PositionEncoding: a mechanism (spec string) as a torch module with learnable parameters.
// forward(q, k, positions) returns the transformed q and k; additive biases (ALiBi) are exposed
// as descriptors (slopes) and, for reference attention only, as a materialised logit bias.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "core/mechanism.hpp"
#include "kernels/transform.hpp"

namespace relpos::nn {

// The largest |position| a call accepts: 2^53, up to which float64 (and int64 converted to it)
// holds every integer exactly. Beyond it neighbouring positions merge, so they are refused.
inline constexpr double kMaxPosition = 9007199254740992.0;

// The once-per-module warnings of a PositionEncoding (docs/errors.md, "Warnings").
struct EncodingWarnings {
  bool clamp = false, resolution = false, center = false;
};

struct EncodingOptions {
  Layout layout = Layout::Interleaved;
  bool check_finite = true;  // reject NaN / Inf inputs with an error (checked by the kernel)
  // rows of a learned lag table (0: the encoding's heads): a grouped-query layer's query heads,
  // each with its own row, while the transforms act on the key/value heads
  int64_t bias_heads = 0;
};

// Parameters as the kernels see them (differentiable functions of the raw parameters):
// gamma, eta, alpha0 [H, NB]; gates [gate_rows, H, NB]; empty where the mechanism has none.
using KernelParams = BlockParamSet<torch::Tensor>;

// The kernels' per-head per-block parameters from a mechanism's schema tensors (the
// reparameterisation, declared once): `schema` holds raw, fixed, bound and learn for each entry of
// m.params in order (the module's raw_<name>, <name>_fixed, <name>_bound, <name>_learn).
// Differentiable in the raw tensors. Mechanisms without a schema give gamma, eta [H, 0], gates [0]
// and alpha0 [H, 0].
KernelParams schema_kernel_params(const Mechanism& m, const std::vector<torch::Tensor>& schema);

// The key of a memo of values computed from `tensors` without autograd (encoding.cpp).
std::optional<std::vector<uint8_t>> memo_key(const std::vector<torch::Tensor>& tensors,
                                             int64_t extra = 0);

class PositionEncodingImpl : public torch::nn::Module {
 public:
  PositionEncodingImpl(const std::string& spec, int64_t head_dim, int64_t heads,
                       EncodingOptions options = {});

  struct Output {
    torch::Tensor q, k;
  };
  // q, k: [B, H, T, D]; positions: [T] or [B, T] (real values within +-2^53; float64 or int64
  // keep every position exact), default 0..T-1. Warns once per module when the exponent clamp
  // binds, when float32 positions have lost resolution, or when center=mid moves between calls.
  Output forward(const torch::Tensor& q, const torch::Tensor& k,
                 const torch::Tensor& positions = {});

  // schema_kernel_params over this module's tensors; without autograd the same tensors while
  // the schema's values repeat (a memo): read them, never modify them in place
  KernelParams kernel_params() const;
  ParamValues param_values() const;  // float64 snapshot of kernel_params()
  // ALiBi slopes [H] of the encoding's heads (undefined tensor when the mechanism has no ALiBi
  // term); logit_bias() takes bias_heads() slopes.
  torch::Tensor alibi_slopes() const;
  // The learned lag table b_h(d), d = 0..len-1, float64 [bias_heads(), len], differentiable in its
  // parameters (undefined tensor when the mechanism has none). Built by the family's runtime
  // (torch/mechanisms/lag_runtime.hpp); without autograd memoised as kernel_params() (read only).
  torch::Tensor lag_table(int64_t len) const;
  bool has_lag_table() const { return mech_.learned_lag_bias() != nullptr; }
  // The lag table's rows (EncodingOptions::bias_heads; the heads by default).
  int64_t bias_heads() const { return bias_heads_; }
  // The learned table's parameters, in the kernel's params() order (state-dict names from it).
  // every tensor of the lag table in LagKernel::params order: parameters, and buffers where
  // the table does not depend on them (LagParam::trained)
  const std::vector<torch::Tensor>& lag_parameters() const { return lag_params_; }
  // Their float64 snapshot (InputError without a learned table).
  LagParamValues lag_values() const;
  // The family runtime's summary of them (name, value), for training summaries (empty without a
  // learned table or where the runtime has none).
  std::vector<std::pair<std::string, double>> lag_stats() const;
  // Materialised additive bias [H, Tq, Tk]: -slope_h (i - j) and the lag table (reference
  // attention only); H = bias_heads() (the slopes of that many heads).
  torch::Tensor logit_bias(const torch::Tensor& q_positions,
                           const torch::Tensor& k_positions) const;

  const Mechanism& mechanism() const { return mech_; }
  // Which once-per-module warnings forward() has issued so far.
  using Warnings = EncodingWarnings;
  const Warnings& warnings_issued() const { return warned_; }
  Warnings& warnings_issued() { return warned_; }  // (a decode step outside forward issues them)
  const kernels::TransformPlan& plan() const { return plan_; }
  double center_for(const torch::Tensor& positions) const;

 private:
  Mechanism mech_;
  kernels::TransformPlan plan_;
  EncodingOptions options_;
  int64_t bias_heads_;
  Output position_forward(const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& positions, const torch::Tensor& pos,
                          bool check_finite);
  // the tensors of each parameter of the mechanism's schema (core ParamSpec)
  struct SchemaTensors {
    size_t index = 0;  // into mechanism().params
    torch::Tensor raw, fixed, bound, learn;
  };
  std::vector<SchemaTensors> schema_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> fixed_maps_;  // M, M^{-T} per fixed term
  // The trig table of the last call, reused while positions, centre and dtype repeat (training
  // calls with the same 0..T-1 every step). Makes forward non-reentrant, like any module state.
  struct TrigCache {
    torch::Tensor positions;
    double center = 0;
    torch::ScalarType dtype = torch::kFloat;
    std::vector<torch::Tensor> table;
  } trig_cache_;
  // kernel_params() without autograd, kept while the schema tensors' bytes repeat (a decode step
  // would otherwise reparametrise them, a dozen small ops, every token). Non-reentrant as above.
  template <class V>
  struct Memo {
    std::vector<uint8_t> key;  // memo_key(): dtype, shape and bytes of every input tensor
    V value;
  };
  mutable Memo<KernelParams> params_memo_;
  mutable Memo<torch::Tensor> lag_memo_;  // lag_table() without autograd, by length
  Warnings warned_;
  std::optional<double> last_center_;
  std::vector<torch::Tensor> lag_params_;  // the learned lag table's parameters (empty: none)
};
TORCH_MODULE(PositionEncoding);

// The attention factor of the mechanism's context-extension rule (core/rope_scaling.hpp) for a call
// at these positions (context length = max position + 1); 1 without a rule. forward() multiplies
// q and k by it.
double scaling_attention_factor(const Mechanism& m, const torch::Tensor& positions);

// Positions of a call checked: [T] or [B, T], real numbers (not bool or complex), finite and
// within +-kMaxPosition (checked before any conversion, so an int64 beyond 2^53 is refused, not
// rounded). Returns them as contiguous float64 on the host; undefined positions give 0..T-1.
// `name` names them in the messages (the op's "q_positions", "k_positions").
torch::Tensor checked_position_values(const torch::Tensor& positions, int64_t B, int64_t T,
                                      const char* name = "positions");

// The warnings of docs/errors.md for one call, each issued (TORCH_WARN: a UserWarning in Python)
// at most once per `issued` record: the exponent clamp binds (gamma: the kernels' [H, NB] damping,
// empty without one), float32 or narrower `user_positions` have lost resolution, or a per-call
// centre moved from `last_center` (updated here). `pos` are the call's float64 positions. The C++
// and the Python PositionEncoding both call this (Python through the `encoding_warnings` op).
void warn_about_positions(const Mechanism& m, const torch::Tensor& user_positions,
                          const torch::Tensor& pos, double center, const torch::Tensor& gamma,
                          std::optional<double>& last_center, EncodingWarnings& issued);

// Refuses (InputError) a damped mechanism whose exponent clamp max_exp overflows dtype's exp.
void check_exponent_range(const Mechanism& m, torch::ScalarType dtype);

// Validates q/k/positions for a mechanism (shape, dtype, head dim, finiteness) with errors that
// name the tensor and the problem. Returns the positions as float64 (default 0..T-1).
torch::Tensor checked_positions(const Mechanism& m, const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& positions, bool check_finite);

}  // namespace relpos::nn
