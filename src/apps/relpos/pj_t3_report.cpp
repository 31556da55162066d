#include "apps/relpos/pj_t3_report.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "apps/relpos/table.hpp"
#include "core/files.hpp"
#include "core/parse.hpp"
#include "core/plot.hpp"
#include "core/types.hpp"
#include "probes/pj_adaptive.hpp"
#include "probes/targets.hpp"

namespace relpos::app {

namespace pj = probes::pj;

namespace {

pj::AdaptiveConfig parse_config(const PjT3Args& p, std::vector<uint64_t>* seeds) {
  pj::AdaptiveConfig cfg;
  const auto cycles = parse_finite_double(p.cycles);
  if (!cycles || !(*cycles > 0.0))
    throw InputError(fmt::format("--cycles must be a number > 0, got '{}'", brief(p.cycles)));
  cfg.cycles = *cycles;
  const auto steps = parse_int64(p.steps, 0, 1000000);
  if (!steps)
    throw InputError(
        fmt::format("--steps must be an integer in [0, 1000000], got '{}'", brief(p.steps)));
  cfg.steps = static_cast<int>(*steps);
  const auto restarts = parse_int64(p.restarts, 1, 100);
  if (!restarts)
    throw InputError(
        fmt::format("--restarts must be an integer in [1, 100], got '{}'", brief(p.restarts)));
  cfg.restarts = static_cast<int>(*restarts);
  if (p.select != "train_mse" && p.select != "eval_mse")
    throw InputError(
        fmt::format("--select must be train_mse or eval_mse, got '{}'", brief(p.select)));
  cfg.select = p.select;
  cfg.order_init_cycle = p.order_init_cycle;
  cfg.check();
  std::stringstream ss(p.seeds);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto s = parse_uint64(item);
    if (!s)
      throw InputError(fmt::format(
          "--seeds must be a comma-separated list of integers >= 0, got '{}'", brief(p.seeds)));
    seeds->push_back(*s);
  }
  if (seeds->empty() || seeds->size() > 64)
    throw InputError(fmt::format("--seeds must list 1 to 64 seeds, got '{}'", brief(p.seeds)));
  return cfg;
}

std::string join_sectors(const std::vector<pj::Sector>& v, const char* sep) {
  std::string s;
  for (const auto x : v) s += std::string(s.empty() ? "" : sep) + pj::sector_name(x);
  return s;
}

std::string pm(double m, double sd, const char* spec) {
  return fmt::format(fmt::runtime(std::string("{:") + spec + "} ± {:" + spec + "}"), m, sd);
}

// The caption's top order: the selected sector's dominant order, '-' when it has none (A).
std::string top_text(const pj::AdaptiveSummary& s, int mode) {
  if (s.selected_mode == pj::Sector::A) return fmt::format("- (argmax {})", mode);
  return fmt::format("{}", mode);
}

Table main_table(const pj::AdaptiveSweep& sw) {
  Table t{{"target", "eval MSE", "eval R^2", "g_FJ", "g_A", "g_LC", "top order (mass)",
           "top order (energy)", "selected (per seed)", "designed", "recovered"},
          {}};
  for (const auto& s : sw.summaries)
    t.rows.push_back(
        {s.target, pm(s.eval_mse_mean, s.eval_mse_std, ".2e"),
         fmt::format("{:.4f}", s.eval_r2_mean), pm(s.gate_mean[0], s.gate_std[0], ".3f"),
         pm(s.gate_mean[1], s.gate_std[1], ".3f"), pm(s.gate_mean[2], s.gate_std[2], ".3f"),
         top_text(s, s.top_order_mass_mode), top_text(s, s.top_order_energy_mode),
         join_sectors(s.selected, " "), join_sectors(s.designed, "+"), s.recovered ? "yes" : "NO"});
  return t;
}

Table order_table(const pj::AdaptiveSweep& sw) {
  Table t{{"target"}, {}};
  const int R1 = sw.cfg.max_order + 1;
  for (int r = 0; r < R1; ++r) t.header.push_back(fmt::format("r={}: mass / energy / LOO", r));
  for (const auto& s : sw.summaries) {
    std::vector<std::string> row{s.target};
    for (size_t r = 0; r < static_cast<size_t>(R1); ++r)
      row.push_back(
          fmt::format("{:.3f} / {:.3f} / {:.2e}", s.mass_mean[r], s.energy_mean[r], s.loo_mean[r]));
    t.rows.push_back(std::move(row));
  }
  return t;
}

Table summary_csv(const pj::AdaptiveSweep& sw) {
  Table t{
      {"target", "designed", "selected_per_seed", "recovered", "eval_mse_mean", "eval_mse_std",
       "eval_r2_mean", "gate_fj_mean", "gate_fj_std", "gate_a_mean", "gate_a_std", "gate_lc_mean",
       "gate_lc_std", "top_order_mass_mode", "top_order_energy_mode", "selected_mode"},
      {}};
  for (const auto& s : sw.summaries)
    t.rows.push_back(
        {s.target, join_sectors(s.designed, "+"), join_sectors(s.selected, " "),
         s.recovered ? "true" : "false", fmt::format("{:.17g}", s.eval_mse_mean),
         fmt::format("{:.17g}", s.eval_mse_std), fmt::format("{:.17g}", s.eval_r2_mean),
         fmt::format("{:.17g}", s.gate_mean[0]), fmt::format("{:.17g}", s.gate_std[0]),
         fmt::format("{:.17g}", s.gate_mean[1]), fmt::format("{:.17g}", s.gate_std[1]),
         fmt::format("{:.17g}", s.gate_mean[2]), fmt::format("{:.17g}", s.gate_std[2]),
         fmt::format("{}", s.top_order_mass_mode), fmt::format("{}", s.top_order_energy_mode),
         pj::sector_name(s.selected_mode)});
  return t;
}

Table runs_csv(const pj::AdaptiveSweep& sw) {
  const int R1 = sw.cfg.max_order + 1;
  Table t{{"target", "seed", "restart", "train_mse", "eval_mse", "eval_r2", "gate_fj", "gate_a",
           "gate_lc", "damping", "affine_a", "top_order_mass", "top_order_energy", "selected"},
          {}};
  for (const char* k : {"fj_mass", "lc_mass", "normalized_mass", "energy", "loo"})
    for (int r = 0; r < R1; ++r) t.header.push_back(fmt::format("{}_{}", k, r));
  for (const auto& run : sw.runs) {
    const auto& d = run.diag;
    std::vector<std::string> row{run.target,
                                 fmt::format("{}", run.seed),
                                 fmt::format("{}", run.restart),
                                 fmt::format("{:.17g}", d.train_mse),
                                 fmt::format("{:.17g}", d.eval_mse),
                                 fmt::format("{:.17g}", d.eval_r2),
                                 fmt::format("{:.17g}", d.gates[0]),
                                 fmt::format("{:.17g}", d.gates[1]),
                                 fmt::format("{:.17g}", d.gates[2]),
                                 fmt::format("{:.17g}", d.damping),
                                 fmt::format("{:.17g}", d.affine),
                                 fmt::format("{}", d.top_order_mass),
                                 fmt::format("{}", d.top_order_energy),
                                 pj::sector_name(d.selected)};
    for (const auto* v : {&d.fj_mass, &d.lc_mass, &d.normalized_mass, &d.energy, &d.loo})
      for (double x : *v) row.push_back(fmt::format("{:.17g}", x));
    t.rows.push_back(std::move(row));
  }
  return t;
}

nlohmann::json sweep_json(const pj::AdaptiveSweep& sw) {
  nlohmann::json j;
  j["protocol"] = {{"L", sw.cfg.L},
                   {"cycles", sw.cfg.cycles},
                   {"omega", sw.cfg.omega()},
                   {"max_order", sw.cfg.max_order},
                   {"train_len", sw.cfg.train_len},
                   {"eval_len", sw.cfg.eval_len},
                   {"steps", sw.cfg.steps},
                   {"lr", sw.cfg.lr},
                   {"restarts", sw.cfg.restarts},
                   {"select", sw.cfg.select},
                   {"order_init_cycle", sw.cfg.order_init_cycle},
                   {"seeds", sw.seeds},
                   {"dtype", "f64"}};
  j["summary"] = nlohmann::json::array();
  for (const auto& s : sw.summaries) {
    std::vector<std::string> sel, des;
    for (const auto x : s.selected) sel.push_back(pj::sector_name(x));
    for (const auto x : s.designed) des.push_back(pj::sector_name(x));
    j["summary"].push_back({{"target", s.target},
                            {"designed", des},
                            {"selected", sel},
                            {"recovered", s.recovered},
                            {"eval_mse_mean", s.eval_mse_mean},
                            {"eval_mse_std", s.eval_mse_std},
                            {"eval_r2_mean", s.eval_r2_mean},
                            {"gate_mean", s.gate_mean},
                            {"gate_std", s.gate_std},
                            {"normalized_mass_mean", s.mass_mean},
                            {"energy_mean", s.energy_mean},
                            {"loo_mean", s.loo_mean},
                            {"top_order_mass_mode", s.top_order_mass_mode},
                            {"top_order_energy_mode", s.top_order_energy_mode},
                            {"selected_mode", pj::sector_name(s.selected_mode)}});
  }
  j["runs"] = nlohmann::json::array();
  for (const auto& r : sw.runs) {
    const auto& d = r.diag;
    j["runs"].push_back({{"target", r.target},
                         {"seed", r.seed},
                         {"restart", r.restart},
                         {"restart_train_mse", r.restart_train_mse},
                         {"restart_eval_mse", r.restart_eval_mse},
                         {"train_mse", d.train_mse},
                         {"eval_mse", d.eval_mse},
                         {"eval_r2", d.eval_r2},
                         {"gates", d.gates},
                         {"damping", d.damping},
                         {"affine_a", d.affine},
                         {"fj_mass", d.fj_mass},
                         {"lc_mass", d.lc_mass},
                         {"normalized_mass", d.normalized_mass},
                         {"energy", d.energy},
                         {"loo", d.loo},
                         {"top_order_mass", d.top_order_mass},
                         {"top_order_energy", d.top_order_energy},
                         {"selected", pj::sector_name(d.selected)}});
  }
  return j;
}

std::string protocol_line(const pj::AdaptiveSweep& sw) {
  const auto& c = sw.cfg;
  return fmt::format(
      "AdaptivePJKernel (single head, max order {}, fixed omega = 2 pi {} / {:g}), Adam lr {:g}, "
      "{} full-batch MSE steps on d = 0..{}, {} restart(s) (seed + 7919 r) selected by {}{}, "
      "diagnostics on d = 0..{}, seeds {}, float64",
      c.max_order, c.cycles, c.L, c.lr, c.steps, c.train_len - 1, c.restarts, c.select,
      c.order_init_cycle ? ", --order-init-cycle" : "", c.eval_len - 1, fmt::join(sw.seeds, ", "));
}

std::string markdown(const pj::AdaptiveSweep& sw) {
  std::ostringstream os;
  os << "### PJ-RoPE Table 3, adaptive sector recovery: main table [pj-t3, f64]\n\n"
     << protocol_line(sw) << "\n\n";
  main_table(sw).write_markdown(os);
  os << "\nmean ± sample std over seeds; top order: mode over seeds (ties to the smaller order) of "
        "the argmax of the normalised parameter mass (the exported top_order) and of the "
        "functional energy (the paper caption's); '-': the selected sector (argmax gate) has no "
        "jet order. recency_weak_jet is the paper's mixed recency-plus-weak-jet teacher: A and FJ "
        "are both designed.\n\n"
     << "### Per-order diagnostics (seed means): normalised mass / functional energy / "
        "leave-one-order-out delta MSE\n\n";
  order_table(sw).write_markdown(os);
  int ok = 0;
  for (const auto& s : sw.summaries) ok += s.recovered;
  os << fmt::format(
      "\nadaptive sector recovery: {} of {} teachers select a designed sector in every seed "
      "({} seeds)\n",
      ok, sw.summaries.size(), sw.seeds.size());
  return os.str();
}

void warn_plot(PlotStatus st, const std::string& stem, bool* warned) {
  if (st == PlotStatus::NoGnuplot && !*warned) {
    std::cerr << "relpos: gnuplot not found; wrote CSV and .gp scripts only\n";
    *warned = true;
  } else if (st == PlotStatus::Failed) {
    std::cerr << fmt::format("relpos: gnuplot failed on {}; CSV and script kept\n", stem + ".gp");
  }
}

void write_plots(const OutputDir& out, const pj::AdaptiveSweep& sw) {
  bool warned = false;
  // gates: one cluster per teacher, mean with sample-std error bars
  std::ostringstream g;
  g << "target,g_fj,g_fj_std,g_a,g_a_std,g_lc,g_lc_std\n";
  for (const auto& s : sw.summaries)
    g << fmt::format("{},{:.9g},{:.9g},{:.9g},{:.9g},{:.9g},{:.9g}\n", s.target, s.gate_mean[0],
                     s.gate_std[0], s.gate_mean[1], s.gate_std[1], s.gate_mean[2], s.gate_std[2]);
  out.write("pj-t3-gates.csv", g.str());
  const std::string gd = quote_gp("pj-t3-gates.csv");
  std::ostringstream gp;
  gp << "set datafile separator ','\n"
     << "set style data histograms\nset style histogram errorbars gap 2 lw 1\n"
     << "set style fill solid 0.8 border -1\nset boxwidth 0.9\n"
     << "set yrange [0:1.05]\nset ylabel 'gate (mean over seeds)'\nset xtics rotate by -30\n"
     << "set key outside right top\nset grid ytics\n"
     << "set title "
     << quote_gp(fmt::format("PJ-RoPE Table 3 adaptive: sector gates FJ / A / LC ({} seeds, "
                             "omega {} cycles)",
                             sw.seeds.size(), sw.cfg.cycles))
     << "\n"
     << "plot " << gd << " using 2:3:xtic(1) skip 1 title 'g_FJ' lc rgb '#1f77b4', " << gd
     << " using 4:5 skip 1 title 'g_A' lc rgb '#ff7f0e', " << gd
     << " using 6:7 skip 1 title 'g_LC' lc rgb '#2ca02c'\n";
  warn_plot(gnuplot_png(out.path(), "pj-t3-gates", gp.str(), 1400, 700), "pj-t3-gates", &warned);

  // per-order normalised mass and functional energy: heatmaps teacher x order, values printed
  const int R1 = sw.cfg.max_order + 1;
  std::ostringstream o;
  o << "order,target_index,target,normalized_mass,energy,loo\n";
  for (size_t t = 0; t < sw.summaries.size(); ++t) {
    const auto& s = sw.summaries[t];
    for (size_t r = 0; r < static_cast<size_t>(R1); ++r)
      o << fmt::format("{},{},{},{:.9g},{:.9g},{:.9g}\n", r, t, s.target, s.mass_mean[r],
                       s.energy_mean[r], s.loo_mean[r]);
  }
  out.write("pj-t3-orders.csv", o.str());
  const std::string od = quote_gp("pj-t3-orders.csv");
  std::ostringstream ytics;
  for (size_t t = 0; t < sw.summaries.size(); ++t)
    ytics << (t ? ", " : "") << quote_gp(sw.summaries[t].target) << " " << t;
  std::ostringstream hp;
  hp << "set datafile separator ','\n"
     << "set multiplot layout 1,2\n"
     << "set palette defined (0 'white', 1 '#08519c')\nset cbrange [0:1]\n"
     << "set xrange [-0.5:" << R1 - 0.5 << "]\nset yrange [" << sw.summaries.size() - 0.5
     << ":-0.5]\n"
     << "set xtics 1\nset ytics (" << ytics.str() << ")\nset xlabel 'order r'\n";
  for (const auto& [col, name] :
       {std::pair<int, const char*>{4, "normalised parameter mass"}, {5, "functional energy"}}) {
    hp << "set title " << quote_gp(fmt::format("{} (seed means)", name)) << "\n"
       << "plot " << od << " using 1:2:" << col << " skip 1 with image notitle, " << od
       << " using 1:2:(sprintf('%.2f', $" << col << ")) skip 1 with labels notitle\n";
  }
  hp << "unset multiplot\n";
  warn_plot(gnuplot_png(out.path(), "pj-t3-orders", hp.str(), 1400, 650), "pj-t3-orders", &warned);
}

}  // namespace

void add_pj_t3_options(CLI::App* cmd, PjT3Args* a) {
  a->given = {
      cmd->add_option("--cycles", a->cycles, "pj-t3: omega = 2 pi CYCLES / 1024 (default 17)"),
      cmd->add_option("--steps", a->steps, "pj-t3: Adam steps per restart (default 1000)"),
      cmd->add_option("--restarts", a->restarts, "pj-t3: restarts per seed (default 2)"),
      cmd->add_option("--select", a->select,
                      "pj-t3: restart selection, train_mse (default) or eval_mse"),
      cmd->add_flag("--order-init-cycle", a->order_init_cycle,
                    "pj-t3: restart r starts with order r mod 4 at alpha logit +2, others -2"),
      cmd->add_option("--seeds", a->seeds, "pj-t3: comma-separated seeds (default 0,1,2)")};
}

void refuse_pj_t3_options(const PjT3Args& a, const std::string& experiment) {
  for (const auto* o : a.given)
    if (o->count() > 0)
      throw InputError(
          fmt::format("{} applies to pj-t3 only, not to '{}'", o->get_name(), experiment));
}

bool reproduce_pj_t3(const ProbeArgs& a, const PjT3Args& p) {
  if (!a.dtype.empty() && a.dtype != "f64")
    throw InputError("reproduce pj-t3 runs in float64 only (--dtype f64)");
  std::vector<uint64_t> seeds;
  const pj::AdaptiveConfig cfg = parse_config(p, &seeds);
  std::optional<OutputDir> out;
  if (!a.out.empty()) out.emplace(a.out, "relpos reproduce pj-t3");
  const auto t0 = std::chrono::steady_clock::now();
  const pj::AdaptiveSweep sw = pj::run_adaptive_sweep(cfg, probes::pj_target_names(), seeds);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string text;
  if (a.format == "json") {
    text = sweep_json(sw).dump(2) + "\n";
  } else if (a.format == "csv") {
    std::ostringstream os;
    summary_csv(sw).write_csv(os);
    text = os.str();
  } else {
    text = markdown(sw);
  }
  std::cout << text;
  if (a.format == "md") std::cout << fmt::format("\ncomputed in {:.2f} s\n", secs);
  if (out) {
    out->write("pj-t3." + a.format, text);
    std::ostringstream s, r;
    summary_csv(sw).write_csv(s);
    runs_csv(sw).write_csv(r);
    out->write("pj-t3-summary.csv", s.str());
    out->write("pj-t3-runs.csv", r.str());
    write_plots(*out, sw);
    out->finish();
  }
  for (const auto& s : sw.summaries)
    if (!s.recovered) return false;
  return true;
}

}  // namespace relpos::app
