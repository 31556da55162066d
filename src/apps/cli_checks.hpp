// CLI11 checks that every relpos program shares (relpos, relpos-bench).
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <string>

#include "core/parse.hpp"

namespace relpos::app {

// A floating-point flag's value: a finite number written in full (parse_finite_double) within
// [lo, hi]. CLI::Range alone lets "nan" through (every comparison with NaN is false), so a NaN
// would reach the command and surface later, if at all, under another name.
inline CLI::Validator FiniteRange(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        const auto v = parse_finite_double(s);
        if (!v || *v < lo || *v > hi)
          return fmt::format("'{}' is not a finite number in [{}, {}]", brief(s), lo, hi);
        return {};
      },
      fmt::format("FLOAT in [{}, {}]", lo, hi));
}

}  // namespace relpos::app
