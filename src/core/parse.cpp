#include "core/parse.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cmath>

namespace relpos {

namespace {
// from_chars takes no leading '+'; users write one now and then ("c=+1")
std::string_view strip_plus(std::string_view s) {
  if (s.size() > 1 && s[0] == '+' && s[1] != '-' && s[1] != '+') s.remove_prefix(1);
  return s;
}
}  // namespace

std::optional<double> parse_finite_double(std::string_view s) {
  s = strip_plus(s);
  if (s.empty()) return std::nullopt;
  double x = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (ec != std::errc() || end != s.data() + s.size() || !std::isfinite(x)) return std::nullopt;
  return x;
}

std::optional<int64_t> parse_int64(std::string_view s, int64_t lo, int64_t hi) {
  s = strip_plus(s);
  if (s.empty()) return std::nullopt;
  int64_t x = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (ec != std::errc() || end != s.data() + s.size() || x < lo || x > hi) return std::nullopt;
  return x;
}

std::optional<uint64_t> parse_uint64(std::string_view s) {
  s = strip_plus(s);
  if (s.empty() || s[0] == '-') return std::nullopt;
  uint64_t x = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return x;
}

std::string brief(std::string_view s, size_t keep) {
  if (s.size() <= keep + 24) return std::string(s);
  return fmt::format("{}... ({} characters)", s.substr(0, keep), s.size());
}

}  // namespace relpos
