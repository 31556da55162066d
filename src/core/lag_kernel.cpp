#include "core/lag_kernel.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "core/parse.hpp"
#include "core/types.hpp"

namespace relpos {

int64_t LagParam::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

const std::string& LagKernel::text(const std::string& key) const {
  const auto it = options_.find(key);
  if (it == options_.end())
    throw std::logic_error(fmt::format("{}: the lag kernel has no option '{}'", term_, key));
  return it->second;
}

double LagKernel::number(const std::string& key) const {
  const auto x = parse_finite_double(text(key));
  if (!x) throw std::logic_error(fmt::format("{}: option '{}' is not a number", term_, key));
  return *x;
}

LagParamValues initial_lag_values(const LagKernel& k, int heads) {
  LagParamValues v;
  for (auto& p : k.params(heads)) v.push_back(std::move(p.init));
  return v;
}

void check_lag_values(const LagKernel& k, const LagParamValues& values, int heads) {
  const auto params = k.params(heads);
  if (values.size() != params.size())
    throw InputError(fmt::format("{}: {} parameter arrays given, the lag table has {}", k.term(),
                                 values.size(), params.size()));
  for (size_t i = 0; i < params.size(); ++i)
    if (static_cast<int64_t>(values[i].size()) != params[i].numel())
      throw InputError(fmt::format("{}: parameter '{}' has {} values, expected {}", k.term(),
                                   params[i].name, values[i].size(), params[i].numel()));
}

std::vector<double> lag_table(const LagKernel& k, const LagParamValues& values, int heads,
                              int64_t len) {
  check_lag_values(k, values, heads);
  if (len < 1) throw InputError(fmt::format("{}: the lag table needs at least one lag", k.term()));
  return k.table(values, heads, len);
}

std::vector<double> initial_lag_table(const LagKernel& k, int heads, int64_t len) {
  return lag_table(k, initial_lag_values(k, heads), heads, len);
}

}  // namespace relpos
