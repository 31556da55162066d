// Probe reports for relpos probe / relpos reproduce: basis-level fixed-kernel probes (Jordan-RoPE
// Tables 3, 4, 6, 11, 16; PJ-RoPE fixed-kernel recovery and the GRAPE projection table), printed
// like the papers' tables with the paper's value beside ours.
#include "apps/relpos/probe_report.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "apps/relpos/table.hpp"
#include "core/files.hpp"
#include "core/plot.hpp"
#include "core/types.hpp"
#include "probes/suites.hpp"

namespace relpos::app {

namespace fs = std::filesystem;
using probes::ProbeCell;
using probes::SuiteResult;

namespace {

bool is_winner_metric(const std::string& m) {
  return m.rfind("best", 0) == 0 || m == "paper_winner_mse";
}

// The printed form our value is compared against: the spec 6.2 digits, else the paper's.
std::string digits_of(const ProbeCell& c) {
  return c.reference.empty() ? c.paper : c.reference;
}

std::string grape_format(double r2) {
  if (r2 > 0.99995) return "1.000";
  if (r2 < -10.0) return "-";  // the export's em dash: failed extrapolation
  return fmt::format("{:.3f}", r2);
}

std::string cell_text(const ProbeCell& c) {
  std::string s;
  if (is_winner_metric(c.metric)) s = c.method + " ";
  if (c.suite == "pj-grape-t9" && c.metric == "r2")
    s += grape_format(c.ours);
  else if (c.suite == "pj-t5")
    s += fmt::format("{:.5g}", c.ours);  // no paper digits to follow (the table bodies are lost)
  else if (c.suite.rfind("pj-", 0) == 0 && c.metric == "best_r2")
    s += fmt::format("{:.8f}", c.ours);  // exact containment is R^2 > 0.999999
  else if (c.metric == "min_order")
    s += fmt::format("{}", static_cast<int>(c.ours));
  else if (c.metric.rfind("top_order", 0) == 0)  // -1: the selected sector has no jet order
    s += c.ours < 0 ? std::string("-") : fmt::format("{}", static_cast<int>(c.ours));
  else if (c.metric == "sector")
    s += c.method;
  else
    s += probes::format_like(c.ours, digits_of(c));
  if (!c.paper.empty() && c.metric != "min_order") {
    s += " (paper ";
    if (!c.paper_method.empty() && c.paper_method != c.method) s += c.paper_method + " ";
    s += c.paper + ")";
    if (!probes::within_paper_tolerance(c.ours, c.paper)) s += " *";
  }
  if (!c.reference.empty() && !probes::matches_printed(c.ours, c.reference)) s += " !";
  if (c.check == "FAIL") s += " FAIL";
  return s;
}

std::string table_title(const SuiteResult& r, const std::string& table, const std::string& dtype) {
  static const std::map<std::string, std::string> titles = {
      {"3", "Jordan-RoPE Table 3: fixed-kernel probes, MSE at 8192 (fit d<1024)"},
      {"11", "Jordan-RoPE Table 11: structured probes, MSE at 8192"},
      {"11-r2", "Jordan-RoPE Table 11 (R^2 at 8192, not in the paper)"},
      {"4", "Jordan-RoPE Table 4: best method per structured probe (MSE at 8192)"},
      {"6", "Jordan-RoPE Table 6: high-order fixed-basis probes (head_dim 96, length 8192)"},
      {"6-detail", "Table 6 detail: MSE at 8192, every basis"},
      {"6-detail-r2", "Table 6 detail: R^2 at 8192, every basis"},
      {"16", "Jordan-RoPE Table 16: R^2 at 8192"},
      {"16-detail", "Table 16 detail: MSE at 8192, every basis"},
      {"16-detail-r2", "Table 16 detail: R^2 at 8192, every basis"},
      {"9", "GRAPE appendix Table 9: R^2 at T=32768 (fit d<1024, omega 17 cycles)"},
      {"9-best", "GRAPE Table 9: best basis per target and exact-containment check"},
      {"t3-adaptive",
       "PJ-RoPE Table 3 (adaptive): sector recovery, seeds 0-2 (means; top order: mode; '-': the "
       "selected sector has no jet order)"},
  };
  const auto it = titles.find(table);
  std::string t = it != titles.end() ? it->second : "";
  if (t.empty() && table == "5")
    t = "PJ-RoPE Table 5: light-cone stability and resolution at T=32768 (focus rows; retrieval "
        "and "
        "trained columns at the far bucket x16_32 = lags [16L, 32L-1], L=1024)";
  else if (t.empty() && table == "5-other")
    t = "Table 5 columns for the other coordinate variants (the trained probe runs on the focus "
        "rows only)";
  else if (t.empty() && table == "5-stability")
    t = "Table 5 detail: phase_f_stability at T=32768 (omega 17 cycles / L)";
  else if (t.empty() && table == "5-cache")
    t = "Table 5 detail: phase_f_cache_quantization at T=32768 (24 features -> 128, seed 0, "
        "mt19937_64 normal mixes)";
  else if (t.empty() && table == "5-retrieval")
    t = "Table 5 detail: phase_f_retrieval_resolution at T=32768 (128 queries per bucket)";
  else if (t.empty() && table == "5-trained")
    t = "Table 5 detail: phase_f_trained_resolution at T=32768 (hard-negative pairwise MLP, 96 "
        "queries per bucket)";
  else if (t.empty() && table.rfind("5-T ", 0) == 0)
    t = "Table 5 / Fig. 6 stability curve: " + table.substr(4) + " against T";
  if (t.empty() && table.rfind("fixed-best", 0) == 0)
    t = "PJ-RoPE fixed-kernel recovery: best basis at T=8192 (" + table.substr(11) +
        ") and sector check";
  else if (t.empty() && table.rfind("fixed", 0) == 0)
    t = "PJ-RoPE fixed-kernel recovery: R^2 at T=8192 (" + table.substr(6) + ")";
  return fmt::format("{} [{}, {}]", t.empty() ? table : t, r.suite, dtype);
}

// Cells of one table pivoted into rows x columns, in first-appearance order.
Table pivot(const std::vector<const ProbeCell*>& cells, const std::string& corner) {
  std::vector<std::string> rows, cols;
  std::map<std::pair<std::string, std::string>, std::string> text;
  for (const auto* c : cells) {
    if (std::find(rows.begin(), rows.end(), c->row) == rows.end()) rows.push_back(c->row);
    if (std::find(cols.begin(), cols.end(), c->col) == cols.end()) cols.push_back(c->col);
    auto& t = text[{c->row, c->col}];
    t += (t.empty() ? "" : "; ") + cell_text(*c);
  }
  Table t;
  t.header.push_back(corner);
  for (const auto& c : cols) t.header.push_back(c);
  for (const auto& r : rows) {
    std::vector<std::string> row{r};
    for (const auto& c : cols) {
      const auto it = text.find({r, c});
      row.push_back(it == text.end() ? "" : it->second);
    }
    t.rows.push_back(std::move(row));
  }
  return t;
}

Summary summarise(const std::vector<SuiteResult>& results) {
  Summary s;
  for (const auto& r : results)
    for (const auto& c : r.cells) {
      ++s.cells;
      if (!c.reference.empty()) {
        ++s.with_reference;
        s.reference_mismatch += !probes::matches_printed(c.ours, c.reference);
      }
      if (!c.paper.empty() && c.metric != "min_order") {
        ++s.with_paper;
        s.outside_paper += !probes::within_paper_tolerance(c.ours, c.paper);
      }
      if (!c.check.empty()) {
        ++s.checks;
        s.check_failed += c.check == "FAIL";
      }
    }
  return s;
}

std::string summary_line(const Summary& s, const std::string& dtype) {
  return fmt::format(
      "{} cells ({}): {} of {} with a jordan-rope.md 6.2 value match it to the printed digits; {} "
      "of {} with a "
      "paper value are within 0.002 abs / 1% rel; sector checks {} of {} pass",
      s.cells, dtype, s.with_reference - s.reference_mismatch, s.with_reference,
      s.with_paper - s.outside_paper, s.with_paper, s.checks - s.check_failed, s.checks);
}

void write_markdown(std::ostream& os, const std::vector<SuiteResult>& results,
                    const std::string& dtype) {
  for (const auto& r : results) {
    std::vector<std::string> tables;
    std::map<std::string, std::vector<const ProbeCell*>> by_table;
    for (const auto& c : r.cells) {
      if (!by_table.count(c.table)) tables.push_back(c.table);
      by_table[c.table].push_back(&c);
    }
    for (const auto& t : tables) {
      os << "### " << table_title(r, t, dtype) << "\n\n";
      const bool by_variant = t == "5" || t == "5-other" || t.rfind("5-T ", 0) == 0;
      const bool by_metric = !by_variant && t.rfind("5-", 0) == 0;
      pivot(by_table[t], by_variant  ? "variant"
                         : by_metric ? "metric"
                         : t == "4" || t.rfind("6", 0) == 0 || t.rfind("16", 0) == 0 ||
                                 t.rfind("9", 0) == 0 || t.rfind("fixed-best", 0) == 0 ||
                                 t.rfind("t3-", 0) == 0
                             ? "target"
                             : "method")
          .write_markdown(os);
      os << "\n";
    }
  }
  const Summary sum = summarise(results);
  if (sum.with_reference == 0 && sum.with_paper == 0 && sum.checks == 0) {
    // pj-t5: the paper's table bodies are lost (pj-rope.md section 4), nothing printed to compare
    os << fmt::format(
        "{} cells ({}): no paper or re-derived values to compare with (the paper's table bodies "
        "are lost); every number above is computed by this run\n",
        sum.cells, dtype);
    return;
  }
  os << "Legend: ours (paper value); * outside 0.002 abs / 1% rel of the paper; ! differs from the "
        "jordan-rope.md 6.2 float64 re-derivation at its printed digits; FAIL: sector / "
        "exact-containment check "
        "failed.\n\n"
     << summary_line(sum, dtype) << "\n";
}

nlohmann::json paper_json(const std::string& s) {
  if (s.empty()) return nullptr;
  return std::stod(s);
}

nlohmann::json cells_json(const std::vector<SuiteResult>& results) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : results)
    for (const auto& c : r.cells) {
      nlohmann::json o{{"suite", c.suite},
                       {"table", c.table},
                       {"target", c.target},
                       {"method", c.method},
                       {"metric", c.metric},
                       {"ours", c.ours},
                       {"paper", paper_json(c.paper)},
                       {"dtype", c.dtype},
                       {"cond", c.cond < 0 ? nlohmann::json(nullptr) : nlohmann::json(c.cond)}};
      if (!c.paper_method.empty()) o["paper_method"] = c.paper_method;
      if (!c.reference.empty()) {
        o["reference_f64"] = std::stod(c.reference);
        o["matches_reference"] = probes::matches_printed(c.ours, c.reference);
      }
      if (!c.paper.empty())
        o["within_paper_tolerance"] = probes::within_paper_tolerance(c.ours, c.paper);
      if (!c.check.empty()) o["check"] = c.check;
      j.push_back(std::move(o));
    }
  return j;
}

Table cells_csv(const std::vector<SuiteResult>& results) {
  Table t{{"suite", "table", "target", "method", "metric", "ours", "paper", "reference_f64",
           "dtype", "cond", "check"},
          {}};
  for (const auto& r : results)
    for (const auto& c : r.cells)
      t.rows.push_back({c.suite, c.table, c.target, c.method, c.metric,
                        fmt::format("{:.17g}", c.ours), c.paper, c.reference, c.dtype,
                        c.cond < 0 ? "" : fmt::format("{:.6g}", c.cond), c.check});
  return t;
}

std::string render(const std::vector<SuiteResult>& results, const std::string& format,
                   const std::string& dtype) {
  std::ostringstream os;
  if (format == "json")
    os << cells_json(results).dump(2) << "\n";
  else if (format == "csv")
    cells_csv(results).write_csv(os);
  else
    write_markdown(os, results, dtype);
  return os.str();
}

void report_plot(PlotStatus status, const std::string& stem, bool* warned) {
  if (status == PlotStatus::NoGnuplot) {
    if (!*warned) std::cerr << "relpos: gnuplot not found; wrote CSV and .gp scripts only\n";
    *warned = true;
  } else if (status == PlotStatus::Failed) {
    std::cerr << fmt::format("relpos: gnuplot failed on {}; CSV and script kept\n", stem + ".gp");
  }
}

// The suite's curves grouped by target, targets in their first-seen order.
std::vector<std::pair<std::string, std::vector<const probes::ProbeCurve*>>> curves_by_target(
    const SuiteResult& r) {
  std::vector<std::pair<std::string, std::vector<const probes::ProbeCurve*>>> out;
  for (const auto& c : r.curves) {
    auto it =
        std::find_if(out.begin(), out.end(), [&](const auto& g) { return g.first == c.target; });
    if (it == out.end()) it = out.insert(out.end(), {c.target, {}});
    it->second.push_back(&c);
  }
  return out;
}

// Curves against an abscissa of their own (pj-t5: a metric against T, one curve per variant):
// log2 x axis, log y axis when every value is positive.
void write_xy_plots(const OutputDir& out, const SuiteResult& r, bool* warned) {
  for (const auto& [t, curves] : curves_by_target(r)) {
    const std::string stem = safe_stem(fmt::format("{}_{}", r.suite, t));
    std::ostringstream csv;
    csv << "x";
    for (const auto* c : curves) csv << "," << c->family;
    csv << "\n";
    bool positive = true;
    for (size_t i = 0; i < curves.front()->x.size(); ++i) {
      csv << fmt::format("{:.17g}", curves.front()->x[i]);
      for (const auto* c : curves) {
        const double y = i < c->y.size() ? c->y[i] : std::nan("");
        positive = positive && y > 0.0;
        csv << "," << fmt::format("{:.9g}", y);
      }
      csv << "\n";
    }
    out.write(stem + ".csv", csv.str());
    const std::string data = quote_gp(stem + ".csv");
    std::ostringstream gp;
    gp << "set datafile separator ','\n"
       << "set key outside right top\n"
       << "set logscale x 2\n"
       << (positive ? "set logscale y\nset format y '%g'\n" : "")
       << "set xlabel 'T (context length)'\nset ylabel " << quote_gp(t) << "\n"
       << "set grid\n"
       << "set title "
       << quote_gp(fmt::format("PJ-RoPE Table 5 / Fig. 6: {} against T (L=1024)", t)) << "\n"
       << "plot ";
    for (size_t k = 0; k < curves.size(); ++k)
      gp << (k ? ", \\\n     " : "") << data << " using 1:" << k + 2
         << " with linespoints lw 2 pt 7 title " << quote_gp(curves[k]->family);
    gp << "\n";
    report_plot(gnuplot_png(out.path(), stem, gp.str()), stem, warned);
  }
}

// Plots of the target and the best fit of each family over d = 0..N-1 (gnuplot, PNG). Without
// gnuplot the CSV and the .gp script are still written.
void write_plots(const OutputDir& out, const SuiteResult& r, bool* warned) {
  if (!r.curves.empty() && !r.curves.front().x.empty()) {
    write_xy_plots(out, r, warned);
    return;
  }
  for (const auto& [t, curves] : curves_by_target(r)) {
    const std::string stem = safe_stem(fmt::format("{}_{}", r.suite, t));
    std::ostringstream csv;
    csv << "d";
    for (const auto* c : curves)
      csv << "," << (c->family == "target" ? "target" : c->family + ":" + c->method);
    csv << "\n";
    const size_t n = curves.front()->y.size();
    for (size_t i = 0; i < n; ++i) {
      csv << i;
      for (const auto* c : curves) csv << "," << fmt::format("{:.9g}", c->y[i]);
      csv << "\n";
    }
    out.write(stem + ".csv", csv.str());
    const std::string data = quote_gp(stem + ".csv");
    std::ostringstream series;
    for (size_t k = 0; k < curves.size(); ++k) {
      const auto* c = curves[k];
      series << (k ? ", \\\n     " : "") << data << " using 1:" << k + 2 << " with lines "
             << (c->family == "target" ? "lw 2 lc rgb 'black'" : "lw 1.5") << " title "
             << quote_gp(c->family == "target" ? "target" : c->family + ": " + c->method);
    }
    // Top: the whole evaluation range; bottom: the last 160 lags, where the oscillation is
    // resolved.
    std::ostringstream gp;
    gp << "set datafile separator ','\n"
       << "set key outside right top\n"
       << "set multiplot layout 2,1\n"
       << "set xlabel 'lag d'\nset ylabel 'score'\n"
       << "set xrange [0:" << n << "]\n"
       << "set arrow 1 from 1024, graph 0 to 1024, graph 1 nohead dashtype 2\n"
       << "set title "
       << quote_gp(fmt::format("{} (Table {}): target and best fit of each family; fit on d < 1024",
                               t, curves.front()->table))
       << "\n"
       << "plot " << series.str() << "\n"
       << "unset arrow 1\n"
       << "set xrange [" << (n > 160 ? n - 160 : 0) << ":" << n << "]\n"
       << "set title 'zoom: the last 160 lags (extrapolation 8x past the fit range)'\n"
       << "plot " << series.str() << "\n"
       << "unset multiplot\n";
    report_plot(gnuplot_png(out.path(), stem, gp.str()), stem, warned);
  }
}

}  // namespace

Summary run_and_emit(const std::vector<std::string>& suites, const ProbeArgs& a,
                     const std::string& out_name) {
  // No --dtype: each suite's own default (pj-t5: the reference's float32; the others: float64).
  const auto precision_of = [&](const std::string& suite) {
    if (a.dtype.empty()) return probes::default_precision(suite);
    return a.dtype == "f32" ? probes::Precision::F32 : probes::Precision::F64;
  };
  const std::string dtype = suites.empty() ? a.dtype : probes::to_string(precision_of(suites[0]));
  const bool plots = !a.out.empty();
  std::optional<OutputDir> out;
  if (plots) out.emplace(a.out, "relpos " + out_name);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<SuiteResult> results;
  for (const auto& s : suites)
    results.push_back(probes::run_probe_suite(s, precision_of(s), plots));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string text = render(results, a.format, dtype);
  std::cout << text;
  if (a.format == "md") std::cout << fmt::format("\ncomputed in {:.2f} s\n", secs);
  if (out) {
    out->write(out_name + "." + a.format, text);
    bool warned = false;
    for (const auto& r : results)
      if (!r.curves.empty()) write_plots(*out, r, &warned);
    out->finish();
  }
  return summarise(results);
}

void add_common_options(CLI::App* cmd, const std::shared_ptr<ProbeArgs>& a) {
  cmd->add_option("--dtype", a->dtype,
                  "f64 or f32: the fits' normal equations / lstsq solved in float (default f64); "
                  "pj-t5: the arithmetic of every probe (default f32, the reference scripts' "
                  "default; f64 = their --float64)")
      ->check(CLI::IsMember({"f32", "f64"}));
  cmd->add_option("--format", a->format, "md, csv or json")
      ->check(CLI::IsMember({"md", "csv", "json"}));
  cmd->add_option("--out", a->out,
                  "directory for the tables and the plots (target and best fits, gnuplot PNG)");
}

}  // namespace relpos::app
