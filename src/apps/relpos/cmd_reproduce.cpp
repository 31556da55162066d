// relpos reproduce: a paper experiment end to end, our table beside the paper's.
#include <fmt/format.h>

#include <iostream>

#include "apps/relpos/commands.hpp"
#include "apps/relpos/pj_t3_report.hpp"
#include "apps/relpos/probe_report.hpp"
#include "core/types.hpp"

namespace relpos::app {

namespace {

// The one list of the CLI's own reproductions (`reproduce --list`, the dispatch in main.cpp).
struct BuiltinExperiment {
  const char* name;
  const char* what;
};
constexpr BuiltinExperiment kBuiltins[] = {
    {"jordan-basis",
     "Jordan-RoPE Tables 3, 4, 6, 11, 16: fixed-kernel least-squares probes (exact)"},
    {"pj-t3", "PJ-RoPE Table 3: fixed-basis fits and adaptive sector recovery"},
    {"pj-t5", "PJ-RoPE Table 5: light-cone stability and resolution probes"},
};

}  // namespace

bool is_builtin_experiment(const std::string& name) {
  for (const auto& b : kBuiltins)
    if (name == b.name) return true;
  return false;
}

void add_reproduce_command(CLI::App& app) {
  auto a = std::make_shared<ProbeArgs>();
  auto pj = std::make_shared<PjT3Args>();
  auto* cmd = app.add_subcommand(
      "reproduce",
      "Reproduce a paper experiment end to end: jordan-basis (Jordan-RoPE Tables 3, 4, 11, 6, "
      "16), pj-t3 (PJ-RoPE Table 3, adaptive sector recovery), pj-t5 (PJ-RoPE Table 5: "
      "light-cone stability and resolution probes), or a trained experiment of experiments/ "
      "('relpos reproduce jordan-t5 --scale cpu', run by relpos-train: 'relpos reproduce NAME "
      "--help' lists its options)");
  cmd->add_option("experiment", a->suite,
                  "jordan-basis (Jordan-RoPE Tables 3, 4, 11, 6, 16), pj-t3 (PJ-RoPE Table 3, "
                  "adaptive part) or pj-t5 (PJ-RoPE Table 5)");
  auto list = std::make_shared<bool>(false);
  cmd->add_flag("--list", *list,
                "List every experiment: these basis-level ones, then the trained ones of "
                "experiments/ (from relpos-train, with their scales and run counts)");
  add_common_options(cmd, a);
  add_pj_t3_options(cmd, pj.get());
  cmd->callback([a, pj, list] {
    if (*list) {
      if (!a->suite.empty())
        throw InputError(
            fmt::format("reproduce --list takes no experiment name (got '{}')", a->suite));
      std::cout << "Basis-level reproductions (run by this CLI):\n\n"
                   "| experiment | what it reproduces |\n|---|---|\n";
      for (const auto& b : kBuiltins) std::cout << fmt::format("| {} | {} |\n", b.name, b.what);
      std::cout << "\nTrained experiments (experiments/*.toml, run by relpos-train):\n\n"
                << std::flush;
      if (const int rc = run_beside("relpos-train", {"reproduce", "--list"}); rc != 0)
        throw ExitStatus{rc};
      return;
    }
    if (a->suite.empty())
      throw InputError("reproduce: name an experiment ('relpos reproduce --list' lists them)");
    if (a->suite == "pj-t3") {
      // exit 1 when a teacher does not select its designed sector in every seed
      if (!reproduce_pj_t3(*a, *pj)) throw ExitStatus{1};
      return;
    }
    refuse_pj_t3_options(*pj, a->suite);
    if (a->suite == "pj-t5") {
      run_and_emit({"pj-t5"}, *a, "reproduce-pj-t5");
      return;
    }
    if (a->suite != "jordan-basis")
      throw InputError(
          fmt::format("unknown experiment '{}' (valid: jordan-basis, pj-t3, pj-t5)", a->suite));
    const Summary s = run_and_emit({"jordan-t3", "jordan-t11", "jordan-t6", "jordan-t16"}, *a,
                                   "reproduce-jordan-basis");
    // In float64 every cell must reproduce the spec's re-derivation to its printed digits.
    if (a->dtype != "f32" && s.reference_mismatch > 0) {
      std::cerr << fmt::format("relpos: {} cells differ from jordan-rope.md 6.2\n",
                               s.reference_mismatch);
      throw ExitStatus{1};
    }
  });
}

}  // namespace relpos::app
