#include "core/charts.hpp"

#include <fmt/format.h>

namespace relpos {

std::vector<double> rope_frequencies(double theta, int dim, int count) {
  std::vector<double> w(static_cast<size_t>(count));
  for (int k = 0; k < count; ++k) w[k] = std::pow(theta, -2.0 * k / dim);
  return w;
}

std::vector<double> spanning_frequencies(double theta, int head_dim, int order) {
  const int nb = head_dim / (2 * order);
  std::vector<double> w(static_cast<size_t>(nb));
  for (int k = 0; k < nb; ++k) w[k] = std::pow(theta, -2.0 * k * order / head_dim);
  return w;
}

namespace {
std::vector<double> power_of_two_slopes(int n) {
  const double start = std::pow(2.0, -8.0 / n);
  std::vector<double> s(static_cast<size_t>(n));
  for (int h = 0; h < n; ++h) s[h] = std::pow(start, h + 1);
  return s;
}
}  // namespace

std::vector<double> alibi_slopes(int heads) {
  if (heads <= 0) throw InputError(fmt::format("alibi needs at least one head, got {}", heads));
  int c = 1;
  while (c * 2 <= heads) c *= 2;
  std::vector<double> s = power_of_two_slopes(c);
  if (c == heads) return s;
  const std::vector<double> extra = power_of_two_slopes(2 * c);
  for (size_t i = 0; s.size() < static_cast<size_t>(heads); i += 2) s.push_back(extra[i]);
  return s;
}

}  // namespace relpos
