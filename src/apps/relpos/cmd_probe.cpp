// relpos probe: basis-level fixed-kernel probes (Jordan-RoPE Tables 3, 4, 6, 11, 16; PJ-RoPE
// fixed-kernel recovery and the GRAPE projection table).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "apps/relpos/commands.hpp"
#include "apps/relpos/probe_report.hpp"
#include "core/types.hpp"
#include "probes/suites.hpp"

namespace relpos::app {

namespace {

// "all" is the suites of probe_suite_names() only (tests/golden.sh pins its output); the extra
// suites (pj-t3-adaptive, pj-t5) run by name.
std::vector<std::string> resolve_suites(const std::string& s) {
  const auto all = probes::probe_suite_names();
  const auto extra = probes::extra_probe_suite_names();
  if (s == "all") return all;
  if (s == "jordan-t4") return {"jordan-t11"};
  if (std::find(all.begin(), all.end(), s) == all.end() &&
      std::find(extra.begin(), extra.end(), s) == extra.end())
    throw InputError(fmt::format("unknown probe suite '{}' (valid: {}, {}, jordan-t4, all)", s,
                                 fmt::join(all, ", "), fmt::join(extra, ", ")));
  return {s};
}

}  // namespace

void add_probe_command(CLI::App& app) {
  auto a = std::make_shared<ProbeArgs>();
  auto* cmd = app.add_subcommand("probe",
                                 "Basis-level fixed-kernel probes: least-squares fits of target "
                                 "lag kernels over primitive bases");
  cmd->add_option(
         "--suite", a->suite,
         fmt::format("{}, jordan-t4 (= jordan-t11), all (these), or {} (outside all: PJ-RoPE "
                     "Table 3 adaptive part and Table 5 light-cone probes; pj-t5 runs in "
                     "the reference's float32 unless --dtype f64)",
                     fmt::join(probes::probe_suite_names(), ", "),
                     fmt::join(probes::extra_probe_suite_names(), ", ")))
      ->required();
  add_common_options(cmd, a);
  cmd->callback([a] {
    const auto suites = resolve_suites(a->suite);
    run_and_emit(suites, *a, "probe-" + a->suite);
  });
}

}  // namespace relpos::app
