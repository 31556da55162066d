// The PJ-RoPE bias (PJ-RoPE Definition 1 as the reference code realises it, spec pj-rope.md 1.5,
// 1.6): a learned lag kernel per head, the sum of three gated sectors,
//   b_h(d) = g_FJ sum_r FJ_{h,r}(d) + g_A (-s_h rho(d)) + g_LC sum_r LC_{h,r}(d),
//   FJ_{h,r}(d) = jet_r(d) e^{-c_h d/L} alpha_{h,r} (zre cos(omega_h d) - zim sin(omega_h d)),
//   LC_{h,r}(d) = beta_L(d)^r [e^{-c_h phi_L(d)/L}] alpha_{h,r} (zre cos(omega_h phi_L) - ...),
// with softmax gates over the enabled sectors (disabled ones exactly 0), a softmax over orders per
// branch, complex amplitudes zeta, c = softplus(raw damping), s = softplus(raw slope), and lags
// clamped at 0. It depends on d = i - j only, so the attention kernel consumes it as a lag table
// [H, T] built in O(H T (R+1)) and never a T x T tensor: a learned lag kernel (core/lag_kernel.hpp,
// PjLagKernel below). Float64 here (the reference the torch module is tested against); the torch
// runtime (torch/mechanisms/pj_bias.cpp) builds the same table differentiably.
#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/lag_kernel.hpp"
#include "core/mechanism.hpp"

namespace relpos {

enum class PjJetBasis {
  Factorial,  // (d/L)^r / r!  (the reference's PJBias)
  Monomial,   // (d/L)^r       (the fixed-projection bases)
  Binomial,   // C(d, r) / L^r (PJ-RoPE App. B; falling factorial over r!, real d)
};
enum class PjRho { Linear, Lightcone };  // rho(d) = d/L, or asinh(d/L) (no outer L)

struct PjBiasConfig {
  int max_order = 3;  // R: orders 0..R
  bool fj = true, affine = true, lc = false;
  PjRho rho = PjRho::Linear;
  double L = 1024.0;
  double init_cycles = 17.0;  // omega_h = 2 pi linspace(1, cycles, H)_h / L
  PjJetBasis basis = PjJetBasis::Factorial;
  bool lc_damped = false;  // the paper's damped light-cone term (the reference has none)
  double init_slope = 0.6931471805599453;     // softplus(0): the reference's raw slope 0
  double init_damping = 0.12692801104297263;  // softplus(-2)
  std::string gate_init = "uniform";          // uniform | affine | fj | lc (+2 / -2 logits)
  std::string order_init = "uniform";         // uniform | rK: order K at +2, the others -2
  double zeta_std = 0.02;
  uint64_t seed = 0;  // the core's own draw of the zetas (the torch module uses torch's RNG)
  int orders() const { return max_order + 1; }
  bool enabled(int sector) const { return sector == 0 ? fj : sector == 1 ? affine : lc; }
};

// Raw (unconstrained) parameters of H heads, row-major: gate logits [H, 3] over (FJ, A, LC),
// alpha logits and zetas [H, R+1], the rest [H].
struct PjBiasParams {
  int heads = 0, orders = 0;
  std::vector<double> omega, gate_logits, fj_alpha_logits, lc_alpha_logits;
  std::vector<double> fj_zeta_re, fj_zeta_im, lc_zeta_re, lc_zeta_im;
  std::vector<double> raw_damping, raw_slope;
};

// The initial parameters (reference initialisation; zetas zeta_std N(0, 1) from `rng`).
PjBiasParams pj_initial_params(const PjBiasConfig& c, int heads, std::mt19937_64& rng);
// ... with the config's own seed.
PjBiasParams pj_initial_params(const PjBiasConfig& c, int heads);

double softplus(double x);
double inverse_softplus(double v);  // log(expm1(v)), v itself above 20
// jet_r(d) of the basis at chart scale L (d >= 0)
double pj_jet(PjJetBasis b, double d, int r, double L);

// The gated sectors of one head at lag d, split by order (what the diagnostics read):
// fj[r] and lc[r] are the gated order components, affine the gated affine term.
struct PjLagTerms {
  std::vector<double> fj, lc;
  double affine = 0.0;
  double total() const;
};
// Gates of head h after the sector softmax (disabled sectors exactly 0).
std::vector<double> pj_gates(const PjBiasConfig& c, const PjBiasParams& p, int h);
PjLagTerms pj_lag_terms(const PjBiasConfig& c, const PjBiasParams& p, int h, double d);

// table[h * len + d] = b_h(d) for d = 0..len-1.
std::vector<double> pj_lag_table(const PjBiasConfig& c, const PjBiasParams& p, int64_t len);

// Checks the shapes of p against c and heads (InputError naming the parameter).
void check_pj_params(const PjBiasConfig& c, const PjBiasParams& p, int heads);

// The PJ bias as a learned lag kernel. Parameters, in this order (state-dict names): pj_omega [H],
// pj_gate_logits [H, 3], pj_fj_alpha_logits, pj_lc_alpha_logits, pj_fj_zeta_re, pj_fj_zeta_im,
// pj_lc_zeta_re, pj_lc_zeta_im [H, R+1], pj_raw_damping, pj_raw_slope [H]; initial values
// pj_initial_params with the config's seed.
class PjLagKernel final : public LagKernel {
 public:
  PjLagKernel(PjBiasConfig c, std::map<std::string, std::string> options)
      : LagKernel("pj_bias", std::move(options)), c_(std::move(c)) {}
  const PjBiasConfig& config() const { return c_; }
  std::vector<LagParam> params(int heads) const override;
  std::vector<double> table(const LagParamValues& values, int heads, int64_t len) const override;

 private:
  PjBiasConfig c_;
};

// The PJ config of a learned lag bias, or nullptr (none, or another family's table). Besides the
// PJ files, only the PJ diagnostics read it (train/pj_diagnostics.cpp: they report the PJ sectors).
const PjBiasConfig* pj_config(const BiasTerm& b);
// PjBiasParams <-> the kernel's parameter values (params() order).
PjBiasParams pj_params_from(const PjBiasConfig& c, const LagParamValues& values);
LagParamValues pj_lag_values(const PjBiasParams& p);

}  // namespace relpos
