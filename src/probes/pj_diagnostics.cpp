#include "probes/pj_diagnostics.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numbers>

#include "core/types.hpp"
#include "probes/pj_adaptive.hpp"
#include "probes/pj_kernels.hpp"

namespace relpos::probes::pj {

const char* loo_reference_name(LooReference r) {
  return r == LooReference::Target ? "target" : "self";
}

namespace {

// softmax over the R + 1 order logits of head h (every order is on)
std::vector<double> order_softmax(const std::vector<double>& logits, int h, int orders) {
  const auto first = logits.begin() + static_cast<std::ptrdiff_t>(h) * orders;
  const double mx = *std::max_element(first, first + orders);
  std::vector<double> a;
  double s = 0.0;
  for (int r = 0; r < orders; ++r) s += a.emplace_back(std::exp(first[r] - mx));
  for (auto& x : a) x /= s;
  return a;
}

// gate alpha_r |zeta_r| per order through the reference's dict form (diagnostics.py)
std::vector<double> branch_mass(double gate, const std::vector<double>& alpha,
                                const std::vector<double>& zre, const std::vector<double>& zim,
                                int h, int orders) {
  std::map<int, double> a, z;
  for (int r = 0; r < orders; ++r) {
    const auto i = static_cast<size_t>(h * orders + r);
    a[r] = alpha[static_cast<size_t>(r)];
    z[r] = std::hypot(zre[i], zim[i]);
  }
  std::vector<double> out;
  for (const auto& [r, m] : effective_mass(gate, a, z)) out.push_back(m);
  return out;
}

std::vector<double> values(const std::map<int, double>& m) {
  std::vector<double> v;
  for (const auto& [r, x] : m) v.push_back(x);
  return v;
}

}  // namespace

PjHeadDiagnostics diagnose_pj_head(const PjBiasConfig& c, const PjBiasParams& p, int h,
                                   int64_t window, const std::vector<double>* target) {
  check_pj_params(c, p, p.heads);
  if (h < 0 || h >= p.heads)
    throw InputError(
        fmt::format("PJ diagnostics: head {} is out of range (0..{})", h, p.heads - 1));
  if (window < 1)
    throw InputError(
        fmt::format("PJ diagnostics: the window needs at least one lag, got {}", window));
  if (target && static_cast<int64_t>(target->size()) != window)
    throw InputError(fmt::format("PJ diagnostics: the target has {} values, the window {} lags",
                                 target->size(), window));
  const int O = c.orders();
  PjHeadDiagnostics d;
  d.head = h;
  const auto g = pj_gates(c, p, h);
  d.gates = {g[0], g[1], g[2]};
  d.slope = softplus(p.raw_slope[static_cast<size_t>(h)]);
  d.damping = softplus(p.raw_damping[static_cast<size_t>(h)]);
  d.omega = p.omega[static_cast<size_t>(h)];
  d.omega_cycles = d.omega * c.L / (2.0 * std::numbers::pi);

  // parameter mass: g alpha_r |zeta_r| per branch (a disabled sector's gate is exactly 0)
  d.fj_mass =
      branch_mass(g[0], order_softmax(p.fj_alpha_logits, h, O), p.fj_zeta_re, p.fj_zeta_im, h, O);
  d.lc_mass =
      branch_mass(g[2], order_softmax(p.lc_alpha_logits, h, O), p.lc_zeta_re, p.lc_zeta_im, h, O);
  double total = 0.0;
  for (int r = 0; r < O; ++r)
    total += d.fj_mass[static_cast<size_t>(r)] + d.lc_mass[static_cast<size_t>(r)];
  // the adaptive experiment's normalisation: sum.clamp_min(finfo(float64).eps)
  const double denom = std::max(total, std::numeric_limits<double>::epsilon());
  for (int r = 0; r < O; ++r) {
    const auto q = static_cast<size_t>(r);
    d.normalized_mass.push_back((d.fj_mass[q] + d.lc_mass[q]) / denom);
    if (r >= 2) d.high_order_mass += d.fj_mass[q] + d.lc_mass[q];
  }

  // order components C_r(d) = g_FJ FJ_r(d) + g_LC LC_r(d) and the affine term over the window
  const auto n = static_cast<size_t>(window);
  std::map<int, std::vector<double>> comps;
  for (int r = 0; r < O; ++r) comps[r].assign(n, 0.0);
  std::vector<double> affine(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const auto t = pj_lag_terms(c, p, h, static_cast<double>(i));
    for (int r = 0; r < O; ++r) {
      const auto q = static_cast<size_t>(r);
      comps[r][i] = (t.fj.empty() ? 0.0 : t.fj[q]) + (t.lc.empty() ? 0.0 : t.lc[q]);
    }
    affine[i] = t.affine;
  }
  d.energy = values(functional_energy(comps));
  // LOO over the full kernel b = sum_r C_r + affine: the dict form's "full" is sum_r C_r, so the
  // target it sees is y - affine (then full - C_r - (y - affine) = b - C_r - y).
  std::vector<double> shifted(n);
  d.loo_reference = target ? LooReference::Target : LooReference::Self;
  for (size_t i = 0; i < n; ++i) {
    double sum = 0.0;
    for (int r = 0; r < O; ++r) sum += comps[r][i];
    shifted[i] = target ? (*target)[i] - affine[i] : sum;
  }
  d.loo = values(leave_one_order_out_mse(shifted, comps));
  if (c.fj || c.lc) {
    d.top_order_mass = argmax_first(d.normalized_mass);
    d.top_order_energy = argmax_first(d.energy);
  }
  return d;
}

std::vector<PjHeadDiagnostics> diagnose_pj_heads(const PjBiasConfig& c, const PjBiasParams& p,
                                                 int64_t window,
                                                 const std::vector<std::vector<double>>* targets) {
  if (targets && static_cast<int>(targets->size()) != p.heads)
    throw InputError(
        fmt::format("PJ diagnostics: {} targets for {} heads", targets->size(), p.heads));
  std::vector<PjHeadDiagnostics> out;
  for (int h = 0; h < p.heads; ++h)
    out.push_back(
        diagnose_pj_head(c, p, h, window, targets ? &(*targets)[static_cast<size_t>(h)] : nullptr));
  return out;
}

namespace {

// mean of f(x) over xs, x a PjHeadDiagnostics or a PjSummary
template <class X>
PjSummary mean_summary(const std::vector<X>& xs, const char* what) {
  if (xs.empty()) throw InputError(fmt::format("PJ diagnostics: no {} to summarise", what));
  PjSummary s;
  const size_t O = xs.front().fj_mass.size();
  s.fj_mass.assign(O, 0.0);
  s.lc_mass.assign(O, 0.0);
  const double w = 1.0 / static_cast<double>(xs.size());
  for (const auto& x : xs) {
    if (x.fj_mass.size() != O || x.lc_mass.size() != O)
      throw InputError(fmt::format("PJ diagnostics: {} with different order counts", what));
    for (size_t k = 0; k < 3; ++k) s.gates[k] += w * x.gates[k];
    s.slope += w * x.slope;
    s.damping += w * x.damping;
    for (size_t r = 0; r < O; ++r) {
      s.fj_mass[r] += w * x.fj_mass[r];
      s.lc_mass[r] += w * x.lc_mass[r];
    }
    s.high_order_mass += w * x.high_order_mass;
  }
  return s;
}

}  // namespace

PjSummary summarize_heads(const std::vector<PjHeadDiagnostics>& heads) {
  return mean_summary(heads, "heads");
}
PjSummary summarize_layers(const std::vector<PjSummary>& layers) {
  return mean_summary(layers, "layers");
}

}  // namespace relpos::probes::pj
