// relpos reproduce: a paper experiment end to end, our table beside the paper's.
#include <fmt/format.h>

#include <iostream>

#include "apps/relpos/commands.hpp"
#include "apps/relpos/pj_t3_report.hpp"
#include "apps/relpos/probe_report.hpp"
#include "core/types.hpp"

namespace relpos::app {

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
                  "adaptive part) or pj-t5 (PJ-RoPE Table 5)")
      ->required();
  add_common_options(cmd, a);
  add_pj_t3_options(cmd, pj.get());
  cmd->callback([a, pj] {
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
    if (a->dtype == "f64" && s.reference_mismatch > 0) {
      std::cerr << fmt::format("relpos: {} cells differ from jordan-rope.md 6.2\n",
                               s.reference_mismatch);
      throw ExitStatus{1};
    }
  });
}

}  // namespace relpos::app
