// The PJ-RoPE bias (core/pj_bias.hpp) as learnable tensors: the lag table [H, len] built from
// them with LibTorch ops in float64 (O(H len (R+1)), never T x T), so autograd carries the
// kernel's lag-table gradient to omega, the gate and order logits, the complex amplitudes, the
// damping and the slope. The core's float64 table is the reference it is tested against.
#pragma once

#include <torch/torch.h>

#include "core/pj_bias.hpp"

namespace relpos::nn {

struct PjBiasTensors {
  torch::Tensor omega, gate_logits, fj_alpha_logits, lc_alpha_logits;  // [H], [H, 3], [H, R+1]
  torch::Tensor fj_zeta_re, fj_zeta_im, lc_zeta_re, lc_zeta_im;        // [H, R+1]
  torch::Tensor raw_damping, raw_slope;                                // [H]
  // f(name, tensor&) in a fixed order (the state-dict names are "pj_" + name)
  template <class F>
  void for_each(F&& f) {
    f("omega", omega);
    f("gate_logits", gate_logits);
    f("fj_alpha_logits", fj_alpha_logits);
    f("lc_alpha_logits", lc_alpha_logits);
    f("fj_zeta_re", fj_zeta_re);
    f("fj_zeta_im", fj_zeta_im);
    f("lc_zeta_re", lc_zeta_re);
    f("lc_zeta_im", lc_zeta_im);
    f("raw_damping", raw_damping);
    f("raw_slope", raw_slope);
  }
};

// Initial values: the core's deterministic initialisation, with the zetas drawn from torch's
// generator (zeta_std N(0, 1)), as the reference's nn.Module does. float32 tensors.
PjBiasTensors pj_initial_tensors(const PjBiasConfig& c, int heads);
// The lag table b_h(d), d = 0..len-1, float64 [H, len].
torch::Tensor pj_lag_table(const PjBiasConfig& c, const PjBiasTensors& p, int64_t len);
// Float64 snapshot (for the core's diagnostics).
PjBiasParams pj_param_values(const PjBiasConfig& c, const PjBiasTensors& p);

}  // namespace relpos::nn
