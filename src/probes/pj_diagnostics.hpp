// Diagnostics of a learned PJ-RoPE bias (pj-rope.md 1.5, 1.7, 3.2, 3.4, 3.5, 5.1 item 8), float64
// and without LibTorch: per head, the gates, slope, damping and frequency, the effective
// (parameter) mass per order and branch, the normalised order mass, the functional energy per
// order over a uniform window d = 0..T_eval-1, leave-one-order-out deltas, the high-order mass and
// both "top order" definitions; per layer and per model, the head-mean / layer-mean summary the
// reference records per training row. docs/diagnostics.md gives every formula and convention.
//
// The per-head quantities are read from the core's float64 kernel (core/pj_bias.hpp:
// pj_gates, pj_lag_terms), so they describe exactly the lag table the model attends with.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/pj_bias.hpp"

namespace relpos::probes::pj {

// What the leave-one-order-out deltas were measured against.
enum class LooReference {
  Target,  // a given target y(d): Delta_r = mean((b - C_r - y)^2) - mean((b - y)^2)
  Self,    // the head's own kernel b(d) as the target: Delta_r = mean(C_r^2)
};
const char* loo_reference_name(LooReference r);  // "target" | "self"

struct PjHeadDiagnostics {
  int head = 0;
  std::array<double, 3> gates{};  // FJ, A, LC after the sector softmax (disabled sectors 0)
  double slope = 0.0;             // softplus(raw slope)
  double damping = 0.0;           // c = softplus(raw damping)
  double omega = 0.0;             // radians per lag
  double omega_cycles = 0.0;      // omega L / (2 pi): cycles over the chart scale L
  // Per order r = 0..R:
  std::vector<double> fj_mass, lc_mass;  // g_FJ alpha^FJ_r |zeta^FJ_r|, g_LC alpha^LC_r |zeta^LC_r|
  std::vector<double> normalized_mass;   // (fj + lc)_r / max(sum_r (fj + lc), DBL_EPSILON)
  std::vector<double> energy;            // ||C_r|| / (||sum_r C_r|| + 1e-12) over the window
  std::vector<double> loo;               // leave-one-order-out delta MSE (see LooReference)
  LooReference loo_reference = LooReference::Self;
  double high_order_mass = 0.0;  // sum_{r >= 2} (fj_mass_r + lc_mass_r), unnormalised
  // argmax of normalised mass (the reference exporter's top_order) and of functional energy
  // (the paper's caption), ties to the smallest order; -1 when neither FJ nor LC is enabled.
  int top_order_mass = -1, top_order_energy = -1;
};

// Diagnostics of head h over the window d = 0..window-1. `target` (optional, window values) makes
// the LOO deltas target-relative; without it they are self-relative. InputError on a bad head,
// window < 1, a target of the wrong length or parameters that do not fit the config.
PjHeadDiagnostics diagnose_pj_head(const PjBiasConfig& c, const PjBiasParams& p, int h,
                                   int64_t window, const std::vector<double>* target = nullptr);
// Every head; targets, when given, holds one window-length vector per head.
std::vector<PjHeadDiagnostics> diagnose_pj_heads(
    const PjBiasConfig& c, const PjBiasParams& p, int64_t window,
    const std::vector<std::vector<double>>* targets = nullptr);

// Means over heads (of one layer) or over layers (of layer summaries): the reference's "recorded
// PJ summary per row" (pj-rope.md 3.4), head mean then layer mean.
struct PjSummary {
  std::array<double, 3> gates{};  // mean gates FJ, A, LC
  double slope = 0.0, damping = 0.0;
  std::vector<double> fj_mass, lc_mass;  // mean mass per order
  double high_order_mass = 0.0;          // mean of sum_{r >= 2} (fj + lc) mass (pj-rope.md 3.5)
};
PjSummary summarize_heads(const std::vector<PjHeadDiagnostics>& heads);  // InputError when empty
PjSummary summarize_layers(const std::vector<PjSummary>& layers);        // InputError when empty

}  // namespace relpos::probes::pj
