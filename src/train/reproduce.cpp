#include "train/reproduce.hpp"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <numbers>
#include <numeric>
#include <sstream>

#include "core/files.hpp"
#include "core/types.hpp"
#include "train/sweep.hpp"

#ifndef RELPOS_SOURCE_EXPERIMENTS
#define RELPOS_SOURCE_EXPERIMENTS "experiments"
#endif

namespace relpos::train {

namespace fs = std::filesystem;

fs::path experiments_dir() {
  if (const char* env = std::getenv("RELPOS_EXPERIMENTS")) return env;
  return RELPOS_SOURCE_EXPERIMENTS;
}

namespace {

struct Column {
  std::string metric;  // loss | accuracy | perplexity | exp2_loss (2^loss, loss in nats) | bpb
  int64_t length = 0;
  std::string setting;  // a sweep setting (METRIC@LENGTH:SETTING), else empty
};

Column parse_column(const std::string& s, const std::string& source) {
  const auto at = s.find('@'), colon = s.find(':');
  Column c;
  if (at != std::string::npos) {
    c.metric = s.substr(0, at);
    try {
      size_t used = 0;
      const std::string len = s.substr(at + 1, colon == std::string::npos ? colon : colon - at - 1);
      c.length = std::stoll(len, &used);
      if (used != len.size()) c.length = 0;
    } catch (const std::exception&) {
      c.length = 0;
    }
    if (colon != std::string::npos) c.setting = s.substr(colon + 1);
  }
  if (c.length <= 0 ||
      (c.metric != "loss" && c.metric != "accuracy" && c.metric != "perplexity" &&
       c.metric != "exp2_loss" && c.metric != "bpb") ||
      (colon != std::string::npos && c.setting.empty()))
    throw InputError(fmt::format(
        "{}: column '{}' must be METRIC@LENGTH or METRIC@LENGTH:SETTING (loss, accuracy, "
        "perplexity, exp2_loss, bpb)",
        source, s));
  return c;
}

// The sweep outcome's key of a method under a column's setting.
std::string result_key(const std::string& method, const Column& c) {
  return c.setting.empty() ? method : fmt::format("{} ({})", method, c.setting);
}

std::vector<std::string> strings(const toml::node* n, const std::string& what,
                                 const std::string& source) {
  std::vector<std::string> out;
  if (!n) return out;
  const auto* a = n->as_array();
  if (!a) throw InputError(fmt::format("{}: {} must be an array of strings", source, what));
  for (const auto& e : *a) {
    const auto v = e.value<std::string>();
    if (!v) throw InputError(fmt::format("{}: {} must be an array of strings", source, what));
    out.push_back(*v);
  }
  return out;
}

// mean and sample std over seeds of one metric
std::pair<double, double> stat(const std::vector<std::pair<double, double>>& runs,
                               const std::string& metric) {
  std::vector<double> v;
  for (const auto& [loss, acc] : runs)
    v.push_back(metric == "loss"        ? loss
                : metric == "accuracy"  ? acc
                : metric == "exp2_loss" ? std::exp2(loss)
                : metric == "bpb"       ? loss / std::numbers::ln2
                                        : std::exp(loss));
  if (v.empty()) return {NAN, NAN};
  const double m = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return {m, v.size() > 1 ? std::sqrt(s / static_cast<double>(v.size() - 1)) : NAN};
}

// mean ± sample std with 3 significant digits (quantities near 0 such as equivariance errors)
std::string pm_g(const std::vector<double>& v) {
  if (v.empty()) return "-";
  const double m = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  if (v.size() < 2) return fmt::format("{:.3g}", m);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return fmt::format("{:.3g} ± {:.3g}", m, std::sqrt(s / static_cast<double>(v.size() - 1)));
}

std::string pm(double m, double s) {
  if (std::isnan(m)) return "-";
  return std::isnan(s) ? fmt::format("{:.4f}", m) : fmt::format("{:.4f} ± {:.4f}", m, s);
}

// Spearman's rank correlation (average ranks for ties).
double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  const auto ranks = [](const std::vector<double>& x) {
    std::vector<size_t> idx(x.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](size_t i, size_t j) { return x[i] < x[j]; });
    std::vector<double> r(x.size());
    for (size_t i = 0; i < idx.size();) {
      size_t j = i;
      while (j + 1 < idx.size() && x[idx[j + 1]] == x[idx[i]]) ++j;
      for (size_t k = i; k <= j; ++k) r[idx[k]] = 0.5 * static_cast<double>(i + j);
      i = j + 1;
    }
    return r;
  };
  const auto ra = ranks(a), rb = ranks(b);
  const double ma = std::accumulate(ra.begin(), ra.end(), 0.0) / static_cast<double>(ra.size()),
               mb = std::accumulate(rb.begin(), rb.end(), 0.0) / static_cast<double>(rb.size());
  double num = 0, da = 0, db = 0;
  for (size_t i = 0; i < ra.size(); ++i) {
    num += (ra[i] - ma) * (rb[i] - mb);
    da += (ra[i] - ma) * (ra[i] - ma);
    db += (rb[i] - mb) * (rb[i] - mb);
  }
  return da > 0 && db > 0 ? num / std::sqrt(da * db) : NAN;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw InputError(fmt::format("experiment file '{}' does not exist", p.string()));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// An experiment file at one scale: the sweep to run and what the report needs.
struct Experiment {
  std::string source, sweep_text;
  toml::table report;
  std::vector<std::string> methods, paper_columns, our_columns, labels, all_sets;
  std::vector<size_t> rows;  // each method's row in the file (the paper's row)
};

Experiment load_experiment(const std::string& name, const std::string& scale,
                           const std::vector<std::string>& sets,
                           const std::vector<std::string>& only = {},
                           const std::vector<std::string>& only_settings = {}) {
  check_name("experiment", name);
  const fs::path file = experiments_dir() / fmt::format("{}.toml", name);
  std::error_code ec_exists;
  if (!fs::exists(file, ec_exists)) {
    std::string known;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(experiments_dir(), ec))
      if (e.path().extension() == ".toml")
        known += fmt::format("{}{}", known.empty() ? "" : ", ", e.path().stem().string());
    throw InputError(fmt::format("no experiment '{}' in {} (known: {})", name,
                                 experiments_dir().string(), known.empty() ? "none" : known));
  }
  const std::string source = file.string();
  toml::table root;
  try {
    root = toml::parse(std::string_view(read_text(file)), std::string_view(source));
  } catch (const toml::parse_error& e) {
    throw InputError(fmt::format("{}:{}: {}", source, e.source().begin.line, e.description()));
  }
  const auto* rep = root.get_as<toml::table>("reproduce");
  if (!rep) throw InputError(fmt::format("{}: no [reproduce] table", source));
  const toml::table report = *rep;
  toml::table scales;
  if (const auto* s = root.get_as<toml::table>("scale")) scales = *s;
  root.erase("reproduce");
  root.erase("scale");
  auto* sweep = root.get_as<toml::table>("sweep");
  if (!sweep) throw InputError(fmt::format("{}: no [sweep] table", source));

  std::vector<std::string> methods = strings(sweep->get("methods"), "sweep.methods", source);
  std::vector<std::string> paper_columns =
      strings(report.get("columns"), "reproduce.columns", source);
  std::vector<std::string> our_columns = paper_columns;
  std::vector<std::string> all_sets;
  if (scale != "paper") {
    const auto* sc = scales.get_as<toml::table>(scale);
    if (!sc) {
      std::string known = "paper";
      for (const auto& [k, v] : scales)
        if (k.str() != "paper") known += fmt::format(", {}", k.str());  // listed once
      throw InputError(fmt::format("{}: no scale '{}' (known: {})", source, scale, known));
    }
    all_sets = strings(sc->get("set"), "scale.set", source);
    if (const auto* m = sc->get("methods")) {
      methods = strings(m, "scale.methods", source);
      sweep->insert_or_assign("methods", *m->as_array());
    }
    if (const auto* s = sc->get("seeds")) sweep->insert_or_assign("seeds", *s->as_array());
    if (sc->get("columns")) our_columns = strings(sc->get("columns"), "scale.columns", source);
  }
  for (const auto& s : sets) all_sets.push_back(s);
  if (our_columns.size() != paper_columns.size())
    throw InputError(
        fmt::format("{}: scale.columns must have one entry per reproduce.columns", source));
  auto labels = strings(report.get("labels"), "reproduce.labels", source);
  if (!labels.empty() && labels.size() != methods.size())
    throw InputError(fmt::format("{}: reproduce.labels must have one entry per method", source));
  std::vector<size_t> rows(methods.size());
  std::iota(rows.begin(), rows.end(), 0);
  if (!only.empty()) {  // a subset of the rows, named by label or spec
    std::vector<size_t> kept;
    for (size_t i = 0; i < methods.size(); ++i)
      if (std::find(only.begin(), only.end(), methods[i]) != only.end() ||
          (!labels.empty() && std::find(only.begin(), only.end(), labels[i]) != only.end()))
        kept.push_back(i);
    if (kept.size() != only.size())
      throw InputError(
          fmt::format("{}: --methods names a method that is not a row of this table", source));
    toml::array subset;
    std::vector<std::string> m2, l2;
    for (auto i : kept) {
      subset.push_back(methods[i]);
      m2.push_back(methods[i]);
      if (!labels.empty()) l2.push_back(labels[i]);
    }
    sweep->insert_or_assign("methods", subset);
    methods = m2;
    labels = l2;
    rows = kept;
  }
  if (!only_settings.empty()) {  // a subset of the settings (other columns show '-' for ours)
    auto* st = sweep->get_as<toml::table>("settings");
    if (!st)
      throw InputError(fmt::format("{}: this experiment has no sweep settings to select", source));
    toml::table kept;
    for (const auto& want : only_settings) {
      const auto* v = st->get(want);
      if (!v) {
        std::string known;
        for (const auto& [k, x] : *st)
          known += fmt::format("{}{}", known.empty() ? "" : ", ", k.str());
        throw InputError(fmt::format("{}: no sweep setting '{}' (known: {})", source, want, known));
      }
      kept.insert_or_assign(want, *v);
    }
    sweep->insert_or_assign("settings", kept);
  }
  std::ostringstream sweep_text;
  sweep_text << root;
  return {source,      sweep_text.str(), report,   methods, paper_columns,
          our_columns, labels,           all_sets, rows};
}

}  // namespace

std::string resolve_scale(const std::string& name, const std::string& scale) {
  check_name("experiment", name);
  if (!scale.empty()) return scale;
  const fs::path file = experiments_dir() / fmt::format("{}.toml", name);
  std::error_code ec;
  if (!fs::exists(file, ec)) return "cpu";  // load_experiment names the problem
  try {
    const auto root =
        toml::parse(std::string_view(read_text(file)), std::string_view(file.string()));
    return root["scale"]["cpu"].as_table() ? "cpu" : "paper";
  } catch (const toml::parse_error&) {
    return "cpu";
  }
}

std::vector<TrainConfig> experiment_configs(const std::string& name, const std::string& scale,
                                            const std::vector<std::string>& sets) {
  const auto e = load_experiment(name, resolve_scale(name, scale), sets);
  return sweep_configs(e.sweep_text, e.source, e.all_sets);
}

std::vector<ExperimentSummary> list_experiments() {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(experiments_dir(), ec))
    if (e.path().extension() == ".toml") files.push_back(e.path());
  if (ec)
    throw InputError(fmt::format("cannot read the experiments folder {}: {}",
                                 experiments_dir().string(), ec.message()));
  std::sort(files.begin(), files.end());
  std::vector<ExperimentSummary> out;
  for (const auto& f : files) {
    ExperimentSummary s;
    s.name = f.stem().string();
    std::vector<std::string> scales = {"paper"};
    try {
      const auto root = toml::parse(std::string_view(read_text(f)), std::string_view(f.string()));
      s.title = root["reproduce"]["title"].value_or(std::string());
      if (const auto* t = root["scale"].as_table())
        for (const auto& [k, v] : *t)
          if (k.str() != "paper") scales.emplace_back(k.str());
    } catch (const toml::parse_error& e) {
      s.title = fmt::format("(unreadable: line {}: {})", e.source().begin.line, e.description());
    }
    // the default scale first, as `relpos reproduce NAME` runs it
    const std::string first = resolve_scale(s.name, "");
    std::stable_partition(scales.begin(), scales.end(),
                          [&](const std::string& x) { return x == first; });
    for (const auto& sc : scales) {
      ExperimentSummary::Scale row{sc, 0, {}};
      try {
        row.runs = experiment_configs(s.name, sc, {}).size();
      } catch (const std::exception& e) {
        row.error = e.what();
      }
      s.scales.push_back(std::move(row));
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::string experiment_list_markdown(const std::vector<ExperimentSummary>& list) {
  std::string md =
      "| experiment | scales (training runs; the default first) | what it reproduces |\n"
      "|---|---|---|\n";
  for (const auto& e : list) {
    std::string scales;
    for (const auto& s : e.scales)
      scales += fmt::format("{}{} ({})", scales.empty() ? "" : ", ", s.name,
                            s.error.empty() ? fmt::format("{}", s.runs) : "does not build");
    md += fmt::format("| {} | {} | {} |\n", e.name, scales, e.title);
  }
  return md;
}

std::string reproduce(const std::string& name, const std::string& scale_in,
                      const std::vector<std::string>& sets, const std::string& out, bool progress,
                      const std::vector<std::string>& only,
                      const std::vector<std::string>& only_settings, int64_t parallel,
                      const std::filesystem::path& import_runs) {
  const std::string scale = resolve_scale(name, scale_in);
  const auto ex = load_experiment(name, scale, sets, only, only_settings);
  const auto& [source, sweep_text_str, report, methods, paper_columns, our_columns, labels,
               all_sets, rows] = ex;
  const fs::path folder = out.empty()
                              ? fs::path("runs") / "reproduce" / fmt::format("{}-{}", name, scale)
                              : fs::path(out);
  const auto t0 = std::chrono::steady_clock::now();
  // a long sweep begun elsewhere keeps its finished runs in the repository: say so before hours
  // of training repeat them
  if (const fs::path records = experiments_dir() / "records" / fmt::format("{}-{}", name, scale);
      progress && import_runs.empty() && is_run_records(records))
    fmt::print(stderr,
               "reproduce: '{}' holds finished runs of this experiment (run records); "
               "--import-runs {} uses them and trains only the rest\n",
               records.string(), records.string());
  // the folder is a sweep's (kind "sweep": continued by the next call) with the report beside it
  OutputDir dir(folder,
                sweep_dir_options(fmt::format("relpos reproduce {} --scale {}", name, scale)));
  const auto outcome =
      run_sweep_text(sweep_text_str, source, all_sets, dir, progress, parallel, import_runs);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const auto label_of = [&](size_t i) { return labels.empty() ? methods[i] : labels[i]; };
  const auto title = report.get("title") ? report.get("title")->value_or(std::string(name)) : name;
  std::string md = fmt::format("## {} ({} scale)\n\n", title, scale);
  const std::string kind =
      report.get("kind") ? report.get("kind")->value_or(std::string("rows")) : "rows";
  if (kind == "rows") {
    const auto* paper = report.get_as<toml::array>("paper");
    // optional second view of our runs per column (reproduce.also, e.g. another metric)
    const auto also = strings(report.get("also"), "reproduce.also", source);
    if (!also.empty() && also.size() != paper_columns.size())
      throw InputError(
          fmt::format("{}: reproduce.also must have one entry per reproduce.columns", source));
    const auto ours_at = [&](size_t i, const std::string& column) {
      const auto col = parse_column(column, source);
      const auto it = outcome.results.find(result_key(methods[i], col));
      return it == outcome.results.end() || !it->second.count(col.length)
                 ? std::pair<double, double>{NAN, NAN}
                 : stat(it->second.at(col.length), col.metric);
    };
    md += "| method |";
    std::string rule = "|---|";
    // no reproduce.paper: the paper reports other quantities (GRAPE's 0-shot accuracies), ours only
    const bool with_paper = paper != nullptr;
    for (size_t c = 0; c < paper_columns.size(); ++c) {
      md += with_paper ? fmt::format(" paper {} | ours {} |", paper_columns[c], our_columns[c])
                       : fmt::format(" {} |", our_columns[c]);
      rule += with_paper ? "---:|---:|" : "---:|";
      if (!also.empty()) {
        md += fmt::format(" ours {} |", also[c]);
        rule += "---:|";
      }
    }
    const auto extras = strings(report.get("extras"), "reproduce.extras", source);
    for (const auto& e : extras) {
      md += fmt::format(" {} |", e);
      rule += "---:|";
    }
    md += fmt::format("\n{}\n", rule);
    std::vector<std::vector<double>> pm_paper(paper_columns.size()), pm_ours(paper_columns.size());
    for (size_t i = 0; i < methods.size(); ++i) {
      md += fmt::format("| {} |", label_of(i));
      const auto* prow = paper && rows[i] < paper->size() ? (*paper)[rows[i]].as_array() : nullptr;
      for (size_t c = 0; c < paper_columns.size(); ++c) {
        const double pmean = prow && prow->size() > 2 * c ? (*prow)[2 * c].value_or(NAN) : NAN;
        const double pstd =
            prow && prow->size() > 2 * c + 1 ? (*prow)[2 * c + 1].value_or(NAN) : NAN;
        const auto [m, s] = ours_at(i, our_columns[c]);
        md += with_paper ? fmt::format(" {} | {} |", pm(pmean, pstd), pm(m, s))
                         : fmt::format(" {} |", pm(m, s));
        if (!also.empty()) {
          const auto [am, as] = ours_at(i, also[c]);
          md += fmt::format(" {} |", pm(am, as));
        }
        if (!std::isnan(pmean) && !std::isnan(m)) {
          pm_paper[c].push_back(pmean);
          pm_ours[c].push_back(m);
        }
      }
      for (const auto& e : extras) {
        const auto it = outcome.extras.find(methods[i]);
        md += fmt::format(" {} |", it == outcome.extras.end() || !it->second.count(e)
                                       ? std::string("-")
                                       : pm_g(it->second.at(e)));
      }
      md += "\n";
    }
    if (with_paper) {
      md += "\nOrdering against the paper (Spearman rank correlation of the means over methods):";
      for (size_t c = 0; c < paper_columns.size(); ++c)
        md += fmt::format(" {} vs {}: {:.2f};", paper_columns[c], our_columns[c],
                          pm_paper[c].size() > 2 ? spearman(pm_paper[c], pm_ours[c]) : NAN);
      md += "\n";
    }
  } else if (kind == "best") {
    md +=
        "| column | paper best | paper value | ours | our best | our value "
        "|\n|---|---|---:|---|---|---:|\n";
    const auto* best = report.get_as<toml::array>("best");
    for (size_t c = 0; best && c < best->size(); ++c) {
      const auto* b = (*best)[c].as_array();
      if (!b || b->size() < 4)
        throw InputError(
            fmt::format("{}: reproduce.best rows are [column, method, mean, std]", source));
      const std::string pcol = (*b)[0].value_or(std::string());
      const auto pc = std::find(paper_columns.begin(), paper_columns.end(), pcol);
      if (pc == paper_columns.end())
        throw InputError(fmt::format("{}: reproduce.best column '{}' is not in reproduce.columns",
                                     source, pcol));
      const auto col =
          parse_column(our_columns[static_cast<size_t>(pc - paper_columns.begin())], source);
      // best = highest accuracy or lowest loss / perplexity over the methods' seed means
      size_t arg = methods.size();
      double bm = NAN, bs = NAN;
      for (size_t i = 0; i < methods.size(); ++i) {
        const auto it = outcome.results.find(result_key(methods[i], col));
        if (it == outcome.results.end() || !it->second.count(col.length)) continue;
        const auto [m, s] = stat(it->second.at(col.length), col.metric);
        const bool better = col.metric == "accuracy" ? m > bm : m < bm;
        if (arg == methods.size() || better) {
          arg = i;
          bm = m;
          bs = s;
        }
      }
      md += fmt::format("| {} | {} | {} | {} | {} | {} |\n", pcol, (*b)[1].value_or(std::string()),
                        pm((*b)[2].value_or(NAN), (*b)[3].value_or(NAN)),
                        our_columns[static_cast<size_t>(pc - paper_columns.begin())],
                        arg < methods.size() ? label_of(arg) : "-", pm(bm, bs));
    }
  } else {
    throw InputError(fmt::format("{}: reproduce.kind must be rows or best", source));
  }
  md += fmt::format(
      "\nRuns: {} (per-seed rows in results.csv); {}; this call took {:.0f} s (finished runs "
      "are reused).\n",
      folder.string(), outcome.ran_on, wall);
  write_file_atomic(folder / "reproduce.md", md);
  for (const auto& part : strings(report.get("parts"), "reproduce.parts", source))
    md += fmt::format(
        "\n{}", reproduce(part, scale, sets, (folder / part).string(), progress, {}, {}, parallel));
  dir.finish();
  return md;
}

}  // namespace relpos::train
