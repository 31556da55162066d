#include "core/jet_features.hpp"

#include <algorithm>
#include <cmath>

#include "core/charts.hpp"

namespace relpos {

double jet_amplitude(const JetChart& c, int r, double d) {
  const double u = c.shear_scale * chart_value(c.chart, d, c.L);
  double a =
      c.gamma == 0.0 ? 1.0 : std::exp(std::clamp(-c.gamma * d, -c.max_exponent, c.max_exponent));
  for (int k = 1; k <= r; ++k) a *= c.factorial ? u / k : u;
  return a;
}

JetValue jet_feature(const JetChart& c, double omega, int r, double d) {
  const double a = jet_amplitude(c, r, d);
  const double angle = omega * chart_value(c.phase_chart, d, c.L);
  return {a * std::cos(angle), a * std::sin(angle)};
}

}  // namespace relpos
