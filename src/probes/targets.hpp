// Target kernels y(d) of the basis-level probes.
#pragma once

#include <string>
#include <vector>

namespace relpos::probes {

// Jordan-RoPE targets (spec jordan-rope.md 3.1-3.3), x = d/L:
//   phase cos(w d); linear -(x); mixed x cos(w d);
//   phase_drift cos(w (1 + 5e-5) d); seasonal_trend (0.35 + 0.9x) cos + 0.25 sin;
//   damped_wave e^{-gamma d}(cos + 0.75 x sin); rhythm_envelope (0.25 + 0.85x)(0.65 cos(w d) +
//   0.35 sin(w2 d)); motif_spacing x/(1 + 0.25x) (0.7 cos(w2 d) - 0.3 sin(w2 d));
//   high_jet_r{r} x^r cos(w d); scaled_high_jet_r{r} x^r e^{-c x} cos(w d).
struct JordanTargetParams {
  double omega = 0.0, omega2 = 0.0, L = 1024.0, gamma = 1e-4, scaled_c = 0.1, drift_eps = 5e-5;
};
double jordan_target(const std::string& name, double d, const JordanTargetParams& p);

// PJ-RoPE fixed-kernel recovery targets (pj-rope.md 3.1): phase, linear (+x), first_jet,
// second_jet (x^2 e^{-0.1x} cos), third_jet, recency_weak_jet, lc_core, lc_affine.
double pj_target(const std::string& name, double d, double omega, double L);

// GRAPE appendix targets (pj-rope.md 1.8): phase, affine (-x), first_jet, second_jet (undamped),
// lc_core.
double grape_target(const std::string& name, double d, double omega, double L);

// Valid names for messages.
std::vector<std::string> jordan_target_names();
std::vector<std::string> pj_target_names();
std::vector<std::string> grape_target_names();

}  // namespace relpos::probes
