// CLI11 checks that every relpos program shares (relpos, relpos-train, relpos-bench).
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

// Every option of `app` and of its subcommands (at any depth) that takes a value refuses an empty
// one: `--out ""` is bad input (exit 2, "--out: the value is empty ..."), never "not given" (which
// would write to the default folder, skip the output or use the default). Call it once, after
// every option is added, before parsing. Flags (no value) are not concerned.
inline void refuse_empty_values(CLI::App& app) {
  for (CLI::Option* opt : app.get_options([](CLI::Option* o) { return o->get_expected_min() > 0; }))
    opt->check(CLI::Validator(
        [](std::string& s) -> std::string {
          return s.empty() ? "the value is empty (an empty path or value is not accepted; leave "
                             "the option out for its default)"
                           : std::string();
        },
        ""));
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    refuse_empty_values(*sub);
}

}  // namespace relpos::app
