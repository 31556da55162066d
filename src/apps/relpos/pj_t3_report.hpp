// relpos reproduce pj-t3: PJ-RoPE Table 3, adaptive sector recovery (pj-rope.md 3.2), printed as
// the exporter's "Adaptive Main Table" with both top-order definitions and the designed-sector
// check, written with --out as CSV plus gnuplot PNGs (gates; per-order mass and energy).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "apps/relpos/probe_report.hpp"

namespace relpos::app {

// Options as given (parsed strictly, with named errors, by reproduce_pj_t3).
struct PjT3Args {
  std::string cycles = "17", steps = "1000", restarts = "2", select = "train_mse", seeds = "0,1,2";
  bool order_init_cycle = false;
  std::vector<CLI::Option*> given;  // the options above, to refuse them for other experiments
};

// Adds --cycles, --steps, --restarts, --select, --order-init-cycle, --seeds.
void add_pj_t3_options(CLI::App* cmd, PjT3Args* a);
// Throws InputError when one of them was given (for experiments other than pj-t3).
void refuse_pj_t3_options(const PjT3Args& a, const std::string& experiment);

// Runs the sweep, prints the tables in a.format, writes them with --out; true when every teacher
// selected its designed sector in every seed.
bool reproduce_pj_t3(const ProbeArgs& a, const PjT3Args& p);

}  // namespace relpos::app
