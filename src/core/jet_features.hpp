// The primitive jet feature of one Jordan block: the single place its formula lives.
//
//   J_r(d) = e^{-gamma d} * u(d)^r / r! * (cos, sin)(omega * phase(d)),   u(d) = s * sigma(d),
//
// sigma a lag chart (core/charts.hpp), s the shear scale, phase(d) = d for Fourier jets or the
// light-cone phase phi_L(d) for PJ-RoPE's LC sector. This is the coefficient of N^r in the relative
// operator of an order-m block with unit nilpotent amplitude (Jordan-RoPE eq. G2, PJ-RoPE FJ_r);
// the probe dictionaries (src/probes) are built from it, and mechanism lag features can be too.
#pragma once

#include <limits>

#include "core/types.hpp"

namespace relpos {

struct JetChart {
  Chart chart = Chart::Raw;  // sigma: Raw (exact / scaled), Bounded (stabilized), LightconeBeta
  double L = 1024.0;         // chart scale
  double shear_scale = 1.0;  // s (1/L gives the normalised coordinate d/L or tau(d)/L)
  double gamma = 0.0;        // damping e^{-gamma d}
  Chart phase_chart = Chart::Raw;  // Raw: angle omega d; LightconePhi: angle omega L asinh(d/L)
  bool factorial = true;           // u^r / r! (jet) or u^r (monomial)
  // |gamma d| is clamped here before exp, as the kernels clamp |gamma p| (none by default)
  double max_exponent = std::numeric_limits<double>::infinity();
};

struct JetValue {
  double re = 0.0;  // cos component
  double im = 0.0;  // sin component
};

// e^{-gamma d} u(d)^r / r!  (the real amplitude of J_r, no oscillation)
double jet_amplitude(const JetChart& c, int r, double d);

// J_r(d) for frequency omega: (amplitude * cos(angle), amplitude * sin(angle)).
JetValue jet_feature(const JetChart& c, double omega, int r, double d);

}  // namespace relpos
