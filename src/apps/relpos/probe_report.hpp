// Probe reports shared by `relpos probe` and `relpos reproduce`: run suites, print their tables
// next to the papers' values (Markdown, CSV, JSON) and write them, with plots, to --out.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

namespace relpos::app {

struct ProbeArgs {
  // dtype "": the suite's default (probes::default_precision: f32 for pj-t5, f64 otherwise)
  std::string suite, dtype, format = "md", out;
};

struct Summary {
  int cells = 0, with_reference = 0, reference_mismatch = 0, with_paper = 0, outside_paper = 0,
      checks = 0, check_failed = 0;
};

// Runs the suites, prints (and with --out writes) the tables; returns the summary.
Summary run_and_emit(const std::vector<std::string>& suites, const ProbeArgs& a,
                     const std::string& out_name);

// --dtype, --format, --out
void add_common_options(CLI::App* cmd, const std::shared_ptr<ProbeArgs>& a);

}  // namespace relpos::app
