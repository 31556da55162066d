#include "probes/targets.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "core/charts.hpp"
#include "core/types.hpp"

namespace relpos::probes {

namespace {
// "<prefix><digits>" -> digits, else -1.
int order_suffix(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  const std::string tail = name.substr(prefix.size());
  for (char c : tail)
    if (c < '0' || c > '9') return -1;
  return tail.size() > 2 ? -1 : std::stoi(tail);
}
}  // namespace

double jordan_target(const std::string& name, double d, const JordanTargetParams& p) {
  const double x = d / p.L, c = std::cos(p.omega * d), s = std::sin(p.omega * d);
  if (name == "phase") return c;
  if (name == "linear") return -x;
  if (name == "mixed") return x * c;
  if (name == "phase_drift") return std::cos(p.omega * (1.0 + p.drift_eps) * d);
  if (name == "seasonal_trend") return (0.35 + 0.9 * x) * c + 0.25 * s;
  if (name == "damped_wave") return std::exp(-p.gamma * d) * (c + 0.75 * x * s);
  if (name == "rhythm_envelope") return (0.25 + 0.85 * x) * (0.65 * c + 0.35 * std::sin(p.omega2 * d));
  if (name == "motif_spacing")
    return x / (1.0 + 0.25 * x) * (0.7 * std::cos(p.omega2 * d) - 0.3 * std::sin(p.omega2 * d));
  if (int r = order_suffix(name, "high_jet_r"); r >= 0) return std::pow(x, r) * c;
  if (int r = order_suffix(name, "scaled_high_jet_r"); r >= 0)
    return std::pow(x, r) * std::exp(-p.scaled_c * x) * c;
  throw InputError(fmt::format("unknown Jordan probe target '{}' (valid: {})", name,
                               fmt::join(jordan_target_names(), ", ")));
}

double pj_target(const std::string& name, double d, double omega, double L) {
  const double x = d / L, c = std::cos(omega * d);
  if (name == "phase") return c;
  if (name == "linear") return x;
  if (name == "first_jet") return x * c;
  if (name == "second_jet") return x * x * std::exp(-0.1 * x) * c;
  if (name == "third_jet") return x * x * x * std::exp(-0.1 * x) * c;
  if (name == "recency_weak_jet") return -0.4 * x + 0.15 * x * x * c;
  const double beta = lightcone_beta(d, L);
  const double core = std::cos(omega * lightcone_phi(d, L)) * (1.0 + 0.4 * beta + 0.2 * beta * beta);
  if (name == "lc_core") return core;
  if (name == "lc_affine") return core - 0.25 * std::asinh(d / L);
  throw InputError(fmt::format("unknown PJ probe target '{}' (valid: {})", name,
                               fmt::join(pj_target_names(), ", ")));
}

double grape_target(const std::string& name, double d, double omega, double L) {
  const double x = d / L, c = std::cos(omega * d);
  if (name == "phase") return c;
  if (name == "affine") return -x;
  if (name == "first_jet") return x * c;
  if (name == "second_jet") return x * x * c;
  if (name == "lc_core") return pj_target("lc_core", d, omega, L);
  throw InputError(fmt::format("unknown GRAPE probe target '{}' (valid: {})", name,
                               fmt::join(grape_target_names(), ", ")));
}

std::vector<std::string> jordan_target_names() {
  return {"phase",         "linear",          "mixed",         "phase_drift",    "seasonal_trend",
          "damped_wave",   "rhythm_envelope", "motif_spacing", "high_jet_r<r>", "scaled_high_jet_r<r>"};
}
std::vector<std::string> pj_target_names() {
  return {"phase", "first_jet", "second_jet", "third_jet", "linear", "recency_weak_jet", "lc_core", "lc_affine"};
}
std::vector<std::string> grape_target_names() { return {"phase", "affine", "first_jet", "second_jet", "lc_core"}; }

}  // namespace relpos::probes
