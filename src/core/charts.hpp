// Lag charts and frequency grids (DESIGN.md section 2, Jordan-RoPE section 4.3, PJ-RoPE charts).
#pragma once

#include <cmath>
#include <vector>

#include "core/types.hpp"

namespace relpos {

// sigma(t) for a chart with scale L. Every chart is odd in t, so sigma(-t) = -sigma(t).
inline double chart_value(Chart chart, double t, double L) {
  switch (chart) {
    case Chart::Raw:
      return t;
    case Chart::Bounded:
      return t / (1.0 + std::abs(t) / L);
    case Chart::LightconePhi:
      return L * std::asinh(t / L);
    case Chart::LightconeBeta:
      return t / std::sqrt(t * t + L * L);
  }
  return t;
}

// True when sigma is linear, i.e. sigma(a) - sigma(b) depends on a - b only.
inline bool chart_is_linear(Chart chart) {
  return chart == Chart::Raw;
}

inline double lightcone_phi(double d, double L) {
  return chart_value(Chart::LightconePhi, d, L);
}
inline double lightcone_beta(double d, double L) {
  return chart_value(Chart::LightconeBeta, d, L);
}

// sin and cos of the angle w * p without the rounding error of the product: the error e of
// a = fl(w p) is exact by fma, and the result is the rotation by a composed with the rotation by
// e. At p ~ 3e4 and w ~ 1 the plain product is off by ~4e-12 rad, more than the 1e-12 verify
// demands. For small e, sin e = e and cos e = 1 to double precision; a large e (|w p| beyond
// ~1e8, where ulp(a) is no longer small) takes its own sin and cos, so (s, c) stays a unit
// vector at any position (a first-order e there grew norms x1000 at p = 1e20).
inline void accurate_sincos(double w, double p, double* s, double* c) {
  const double a = w * p, e = std::fma(w, p, -a);
  const double sa = std::sin(a), ca = std::cos(a);
  if (std::abs(e) < 0x1p-27) {
    *s = sa + e * ca;
    *c = ca - e * sa;
    return;
  }
  const double se = std::sin(e), ce = std::cos(e);
  *s = sa * ce + ca * se;
  *c = ca * ce - sa * se;
}

// RoPE frequency grid: omega_k = theta^(-2 k / dim) for k = 0..count-1. An order-m Jordan module
// with head dim hd uses the first hd/(2m) entries of the grid for dim = hd (reference convention).
std::vector<double> rope_frequencies(double theta, int dim, int count);

// Same endpoint range with fewer frequencies: omega_k = theta^(-2 k m / hd), k < hd/(2m)
// (Jordan-RoPE section 3.5 "frequency-grid ablation").
std::vector<double> spanning_frequencies(double theta, int head_dim, int order);

// ALiBi slopes, including the rule for head counts that are not a power of two
// (take the 2^floor(log2 n) grid, then every other slope of the doubled grid).
std::vector<double> alibi_slopes(int heads);

}  // namespace relpos
