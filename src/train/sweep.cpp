#include "train/sweep.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/files.hpp"
#include "core/parse.hpp"
#include "core/plot.hpp"
#include "core/types.hpp"
#include "tasks/corpus.hpp"

namespace relpos::train {

namespace fs = std::filesystem;

std::string method_folder(const std::string& spec) {
  std::string out;
  for (const char ch : spec) {
    if (std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '-') {
      out += ch;
    } else if (!out.empty() && out.back() != '_') {
      out += '_';
    }
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  if (out.empty())
    throw InputError(fmt::format("sweep: method '{}' gives an empty folder name", spec));
  return out;
}

namespace {

struct Sweep {
  std::string base_toml;  // the configuration without [sweep]
  std::vector<std::string> methods;
  std::vector<int64_t> seeds{0};
  std::vector<std::pair<std::string, std::vector<std::string>>> settings{{"", {}}};
  // setting -> the only methods that run it (sweep.only; a setting not named runs every method)
  std::map<std::string, std::vector<std::string>> only;
};

Sweep parse_sweep(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(std::string_view(text), std::string_view(source));
  } catch (const toml::parse_error& e) {
    throw InputError(fmt::format("{}:{}: {}", source, e.source().begin.line, e.description()));
  }
  Sweep s;
  const auto* sw = root.get_as<toml::table>("sweep");
  if (!sw) throw InputError(fmt::format("{}: no [sweep] table", source));
  for (const auto& [k, v] : *sw) {
    const std::string key(k.str());
    if (key == "methods") {
      const auto* a = v.as_array();
      if (!a || a->empty())
        throw InputError(
            fmt::format("{}: sweep.methods must be a non-empty array of strings", source));
      for (const auto& e : *a) {
        const auto str = e.value<std::string>();
        if (!str) throw InputError(fmt::format("{}: sweep.methods must be strings", source));
        s.methods.push_back(*str);
      }
    } else if (key == "seeds") {
      const auto* a = v.as_array();
      if (!a || a->empty())
        throw InputError(
            fmt::format("{}: sweep.seeds must be a non-empty array of integers", source));
      s.seeds.clear();
      for (const auto& e : *a) {
        const auto i = e.value_exact<int64_t>();
        if (!i || *i < 0)
          throw InputError(fmt::format("{}: sweep.seeds must be integers >= 0", source));
        s.seeds.push_back(*i);
      }
    } else if (key == "settings") {
      const auto* t = v.as_table();
      if (!t)
        throw InputError(
            fmt::format("{}: sweep.settings must be a table of override lists", source));
      s.settings.clear();
      for (const auto& [name, list] : *t) {
        std::vector<std::string> sets;
        const auto* a = list.as_array();
        if (!a)
          throw InputError(fmt::format("{}: sweep.settings.{} must be an array of \"key=value\"",
                                       source, name.str()));
        for (const auto& e : *a) {
          const auto str = e.value<std::string>();
          if (!str)
            throw InputError(
                fmt::format("{}: sweep.settings.{} must hold strings", source, name.str()));
          sets.push_back(*str);
        }
        check_name(fmt::format("{}: sweep.settings name", source), std::string(name.str()));
        s.settings.push_back({std::string(name.str()), sets});
      }
    } else if (key == "only") {
      const auto* t = v.as_table();
      if (!t)
        throw InputError(fmt::format(
            "{}: sweep.only must be a table: setting = [the methods that run it]", source));
      for (const auto& [name, list] : *t) {
        const auto* a = list.as_array();
        if (!a)
          throw InputError(
              fmt::format("{}: sweep.only.{} must be an array of methods", source, name.str()));
        for (const auto& e : *a) {
          const auto str = e.value<std::string>();
          if (!str)
            throw InputError(
                fmt::format("{}: sweep.only.{} must hold strings", source, name.str()));
          s.only[std::string(name.str())].push_back(*str);
        }
      }
    } else {
      throw InputError(fmt::format(
          "{}: unknown key 'sweep.{}' (valid: methods, seeds, settings, only)", source, key));
    }
  }
  if (s.methods.empty()) throw InputError(fmt::format("{}: sweep.methods is missing", source));
  // (sweep.only may name methods that --methods filtered out)
  for (const auto& [setting, methods] : s.only) {
    if (std::none_of(s.settings.begin(), s.settings.end(),
                     [&](const auto& x) { return x.first == setting; }))
      throw InputError(
          fmt::format("{}: sweep.only.{} names no setting of sweep.settings", source, setting));
  }
  root.erase("sweep");
  std::ostringstream base;
  base << root;
  s.base_toml = base.str();
  return s;
}

struct Job {
  std::string method, setting;
  int64_t seed;
  TrainConfig config;
  fs::path dir;
};

// Every run of a sweep, configured and checked before the first one starts.
std::vector<Job> build_jobs(const Sweep& sw, const TrainConfig& base,
                            const std::vector<std::string>& sets, const fs::path& root) {
  std::vector<Job> jobs;
  for (const auto& method : sw.methods)
    for (const auto& [setting, overrides] : sw.settings)
      for (const int64_t seed : sw.seeds) {
        if (const auto it = sw.only.find(setting);
            it != sw.only.end() &&
            std::find(it->second.begin(), it->second.end(), method) == it->second.end())
          continue;
        TrainConfig c = base;
        for (const auto& s : sets) apply_override(c, s);
        for (const auto& s : overrides) apply_override(c, s);
        c.model.mechanism = method;
        c.seed = seed;
        const std::string folder = setting.empty()
                                       ? method_folder(method)
                                       : fmt::format("{}-{}", method_folder(method), setting);
        check_name("sweep: the folder of a method and setting", folder);
        c.name = fmt::format("{}-s{}", folder, seed);
        c.validate();
        jobs.push_back({method, setting, seed, c, root / folder / fmt::format("s{}", seed)});
      }
  return jobs;
}

// The files of a finished run that carry its result (a record): no checkpoint.
constexpr std::array<const char*, 3> kRecordFiles{"config.toml", "metrics.csv", "summary.json"};
constexpr const char* kRecordsMarker = "RUN-RECORDS";

// A finished run stands for its job only when it was trained with the job's configuration (but
// for finished_run_free_keys()): an edited experiment file must not be reported with the results
// of the old one. `what` names the run (a folder of the sweep or a record).
void check_finished_run(const Job& j, const fs::path& run, const std::string& what) {
  std::error_code ec;
  if (!fs::is_regular_file(run / "config.toml", ec))
    throw InputError(fmt::format(
        "sweep: {} '{}' has no config.toml, so it cannot be checked against the sweep's run {}",
        what, brief(run.string(), 200), j.config.name));
  const auto changed =
      config_changes(load_config(run / "config.toml"), j.config, finished_run_free_keys());
  if (!changed.empty())
    throw InputError(fmt::format(
        "sweep: {} '{}' was trained with another configuration than the sweep's run: {}; remove "
        "it to train the run again, or use another --out",
        what, brief(run.string(), 200), fmt::join(changed, ", ")));
}

nlohmann::json read_summary(const fs::path& file) {
  std::ifstream in(file);
  auto s = nlohmann::json::parse(in, nullptr, false);
  if (s.is_discarded() || !s.is_object() || !s.contains("final_eval") ||
      !s["final_eval"].is_array())
    throw InputError(fmt::format("sweep: '{}' is corrupt", brief(file.string(), 200)));
  return s;
}

void check_records_folder(const fs::path& dir) {
  if (!is_run_records(dir))
    throw InputError(fmt::format(
        "'{}' is not a folder of run records (it has no {} file; export-runs writes them)",
        brief(dir.string(), 200), kRecordsMarker));
}

// Copies the records of `from` (export_runs' layout) into the folders of the jobs that hold no
// finished run, every one checked against its job before the first is copied (a bad record
// imports nothing); a killed run's checkpoint there is replaced by the finished record of the
// same configuration. Returns how many were imported.
size_t import_records(const std::vector<Job>& jobs, const fs::path& root, const fs::path& from) {
  check_records_folder(from);
  std::vector<std::pair<const Job*, fs::path>> todo;
  std::error_code ec;
  for (const auto& j : jobs) {
    if (fs::exists(j.dir / "summary.json", ec)) continue;
    const fs::path rec = from / fs::relative(j.dir, root);
    if (!fs::exists(rec / "summary.json", ec)) continue;
    for (const char* f : kRecordFiles)
      if (!fs::is_regular_file(rec / f, ec))
        throw InputError(
            fmt::format("sweep: the record '{}' has no {}", brief(rec.string(), 200), f));
    check_finished_run(j, rec, "the record");
    read_summary(rec / "summary.json");
    todo.emplace_back(&j, rec);
  }
  for (const auto& [job, rec] : todo) {
    const Job& j = *job;
    OutputDirOptions d;
    d.kind = "run";
    d.command = fmt::format("relpos sweep --import-runs {}", from.string());
    d.existing = Existing::Continue;
    OutputDir dir(j.dir, d);
    remove_checkpoints(j.dir);          // a killed run's last.pt; the user's files there stay
    for (const char* f : kRecordFiles)  // summary.json last: it marks the run finished
      dir.write(f, tasks::read_file_bytes(rec / f));
    dir.finish();
  }
  return todo.size();
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}
double sample_std(const std::vector<double>& v) {
  if (v.size() < 2) return NAN;
  const double m = mean(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size() - 1));
}

// Training-loss curves (mean over seeds at each logged step) and length curves (mean final loss
// and accuracy at each evaluation length), one series per method: CSV and gnuplot PNG in the
// sweep folder.
void write_plots(const fs::path& root, const std::vector<Job>& jobs,
                 const std::vector<std::pair<std::string, std::string>>& order,
                 std::map<std::pair<std::string, std::string>,
                          std::map<int64_t, std::vector<std::pair<double, double>>>>& agg,
                 const std::vector<int64_t>& lengths) {
  // step -> series -> losses over seeds
  std::map<int64_t, std::map<size_t, std::vector<double>>> curves;
  for (const auto& j : jobs) {
    const size_t series = static_cast<size_t>(
        std::find(order.begin(), order.end(), std::make_pair(j.method, j.setting)) - order.begin());
    std::ifstream in(j.dir / "metrics.csv");
    std::string line;
    while (std::getline(in, line)) {
      std::vector<std::string> f;
      std::stringstream ss(line);
      for (std::string x; std::getline(ss, x, ',');) f.push_back(x);
      if (f.size() > 3 && f[1] == "train") {
        try {
          curves[std::stoll(f[0])][series].push_back(std::stod(f[3]));
        } catch (const std::exception&) {
        }
      }
    }
  }
  const auto label = [&](size_t i) {
    return order[i].second.empty() ? order[i].first
                                   : fmt::format("{} ({})", order[i].first, order[i].second);
  };
  std::string loss_csv = "step", len_csv = "length";
  for (size_t i = 0; i < order.size(); ++i) {
    loss_csv += fmt::format(",{}", safe_stem(label(i)));
    len_csv += fmt::format(",{}", safe_stem(label(i)));
  }
  std::string acc_csv = len_csv + "\n";
  loss_csv += "\n";
  len_csv += "\n";
  for (const auto& [step, by_series] : curves) {
    loss_csv += std::to_string(step);
    for (size_t i = 0; i < order.size(); ++i) {
      const auto it = by_series.find(i);
      loss_csv +=
          it == by_series.end() ? std::string(",") : fmt::format(",{:.6g}", mean(it->second));
    }
    loss_csv += "\n";
  }
  for (const auto L : lengths) {
    len_csv += std::to_string(L);
    acc_csv += std::to_string(L);
    for (size_t i = 0; i < order.size(); ++i) {
      std::vector<double> loss, acc;
      for (const auto& [l, a] : agg[order[i]][L]) {
        loss.push_back(l);
        acc.push_back(a);
      }
      len_csv += loss.empty() ? std::string(",") : fmt::format(",{:.6g}", mean(loss));
      acc_csv += acc.empty() ? std::string(",") : fmt::format(",{:.6g}", mean(acc));
    }
    len_csv += "\n";
    acc_csv += "\n";
  }
  write_file_atomic(root / "loss_curves.csv", loss_csv);
  write_file_atomic(root / "length_curves.csv", len_csv);
  write_file_atomic(root / "length_accuracy.csv", acc_csv);
  const auto series = [&](const std::string& data) {
    std::string s;
    for (size_t i = 0; i < order.size(); ++i)
      s += fmt::format("{}{} using 1:{} with linespoints title {}", i ? ", " : "", quote_gp(data),
                       i + 2, quote_gp(label(i)));
    return s;
  };
  const std::string common = "set datafile separator ','\nset key below\nset grid\n";
  gnuplot_png(
      root, "loss_curves",
      fmt::format("{}set xlabel 'step'\nset ylabel 'training loss (mean over seeds)'\nplot {}\n",
                  common, series("loss_curves.csv")));
  gnuplot_png(
      root, "length_curves",
      fmt::format("{}set logscale x 2\nset xlabel 'evaluation length'\nset ylabel 'final loss "
                  "(mean over seeds)'\nplot {}\n",
                  common, series("length_curves.csv")));
  // accuracy: the query-LM's argmax accuracy (the bridge's Fig. 4), the LMs' token accuracy
  gnuplot_png(
      root, "length_accuracy",
      fmt::format("{}set logscale x 2\nset xlabel 'evaluation length'\nset ylabel 'final accuracy "
                  "(mean over seeds)'\nplot {}\n",
                  common, series("length_accuracy.csv")));
}

// An unfinished job killed before its first checkpoint holds rows in metrics.csv but nothing to
// resume from; `train --resume` refuses to start such a run again over its history, so the sweep,
// whose job it is, drops that partial metrics.csv (its own file) and the run starts from step 0
// (the same seed gives the same rows). The caller holds the job folder's lock.
void restart_if_unsaved(const Job& j) {
  std::error_code ec;
  if (!fs::exists(j.dir / "summary.json", ec) && !fs::exists(j.dir / "checkpoints" / "last.pt", ec))
    fs::remove(j.dir / "metrics.csv", ec);
}

// Runs the unfinished jobs `jobs` at a time, each in a child process of this program
// (`train --config DIR/job.toml --out DIR --resume --quiet`, output in DIR/train.log): runs of a
// sweep are independent, and on a few cores several single-threaded runs of small models go
// faster than one run on every core (docs/performance.md). Each child gets cores / jobs threads
// unless the configuration names a count.
void run_jobs_in_processes(std::vector<const Job*> todo, int64_t jobs, bool progress) {
  // longest first (cost ~ steps x tokens per step x layers x d^2), so that no long run starts
  // last and runs alone
  const auto cost = [](const Job* j) {
    const auto& c = j->config;
    return static_cast<double>(c.optim.steps) * static_cast<double>(c.optim.batch) *
           static_cast<double>(c.task.train_length) *
           static_cast<double>(std::max<int64_t>(c.model.layers, 1)) *
           static_cast<double>(c.model.d_model) * static_cast<double>(c.model.d_model);
  };
  std::stable_sort(todo.begin(), todo.end(),
                   [&](const Job* a, const Job* b) { return cost(a) > cost(b); });
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw InputError("sweep: --jobs needs /proc/self/exe (Linux) to start the runs");
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  // SIGTERM, SIGHUP and SIGINT go on to the runs (which also die with this process)
  ForwardedSignals signals;
  int received = 0;
  std::vector<std::pair<ChildProcess, const Job*>> running;
  std::vector<std::string> failed;
  size_t next = 0;
  while (next < todo.size() || !running.empty()) {
    while (!received && static_cast<int64_t>(running.size()) < jobs && next < todo.size()) {
      const Job& j = *todo[next++];
      TrainConfig c = j.config;
      if (c.threads == 0) c.threads = std::max<int64_t>(1, cores / jobs);
      {  // the run's folder, made ours (the child locks it again) to hold job.toml
        OutputDirOptions d;
        d.kind = "run";
        d.command = "relpos sweep";
        d.existing = Existing::Continue;
        OutputDir dir(j.dir, d);
        dir.write("job.toml", c.to_toml());
        restart_if_unsaved(j);
      }
      SpawnOptions so;
      so.log = j.dir / "train.log";
      ChildProcess child({exe.string(), "train", "--config", (j.dir / "job.toml").string(), "--out",
                          j.dir.string(), "--resume", "--quiet"},
                         so);
      if (progress)
        fmt::print(stderr, "sweep: started {} seed {}{} (pid {}, log {})\n", j.method, j.seed,
                   j.setting.empty() ? std::string() : fmt::format(" ({})", j.setting), child.pid(),
                   so.log.string());
      running.emplace_back(std::move(child), &j);
    }
    if (const int sig = signals.wait(50)) {
      received = sig;
      for (auto& [child, job] : running) child.signal(sig);
    }
    for (auto it = running.begin(); it != running.end();) {
      const auto status = it->first.poll();
      if (!status) {
        ++it;
        continue;
      }
      const Job& j = *it->second;
      const bool ok = *status == 0;
      if (!ok)
        failed.push_back(fmt::format("{} (exit status {}, see {})", j.dir.string(), *status,
                                     (j.dir / "train.log").string()));
      if (progress)
        fmt::print(stderr, "sweep: {} {} seed {}{}\n", ok ? "finished" : "FAILED", j.method, j.seed,
                   j.setting.empty() ? std::string() : fmt::format(" ({})", j.setting));
      it = running.erase(it);
    }
  }
  if (received)
    throw InputError(fmt::format(
        "sweep: stopped by signal {}; the runs it stopped resume on the next call", received));
  if (!failed.empty())
    throw InputError(
        fmt::format("sweep: {} run(s) failed: {}", failed.size(), fmt::join(failed, "; ")));
}

}  // namespace

std::vector<TrainConfig> sweep_configs(const std::string& text, const std::string& source,
                                       const std::vector<std::string>& sets) {
  const Sweep sw = parse_sweep(text, source);
  std::vector<TrainConfig> out;
  for (const auto& j : build_jobs(sw, parse_config(sw.base_toml, source), sets, "runs"))
    out.push_back(j.config);
  return out;
}

fs::path sweep_folder(const std::string& text, const std::string& source, const std::string& out) {
  const TrainConfig base = parse_config(parse_sweep(text, source).base_toml, source);
  check_name(fmt::format("{}: name", source), base.name);
  return out.empty() ? fs::path("runs") / base.name : fs::path(out);
}

OutputDirOptions sweep_dir_options(const std::string& command) {
  OutputDirOptions d;
  d.kind = "sweep";
  d.command = command;
  d.existing = Existing::Continue;  // a sweep continues where it stopped
  return d;
}

SweepOutcome run_sweep_text(const std::string& text, const std::string& source,
                            const std::vector<std::string>& sets, const std::string& out,
                            bool progress, int64_t parallel, const fs::path& import_from) {
  OutputDir dir(sweep_folder(text, source, out),
                sweep_dir_options(fmt::format("relpos sweep --config {}", source)));
  auto outcome = run_sweep_text(text, source, sets, dir, progress, parallel, import_from);
  dir.finish();
  return outcome;
}

SweepOutcome run_sweep_text(const std::string& text, const std::string& source,
                            const std::vector<std::string>& sets, const OutputDir& dir,
                            bool progress, int64_t parallel, const fs::path& import_from) {
  const Sweep sw = parse_sweep(text, source);
  const TrainConfig base = parse_config(sw.base_toml, source);
  check_name(fmt::format("{}: name", source), base.name);
  const fs::path root = dir.path();
  const std::vector<Job> jobs = build_jobs(sw, base, sets, root);
  if (!import_from.empty()) {
    const size_t n = import_records(jobs, root, import_from);
    if (progress)
      fmt::print(stderr, "sweep: {} finished run(s) imported from '{}'\n", n, import_from.string());
  }
  std::error_code ec;
  for (const auto& j : jobs)
    if (fs::exists(j.dir / "summary.json", ec)) check_finished_run(j, j.dir, "the finished run");
  if (parallel > 1) {
    std::vector<const Job*> todo;
    for (const auto& j : jobs)
      if (!fs::exists(j.dir / "summary.json")) todo.push_back(&j);  // unfinished
    run_jobs_in_processes(todo, parallel, progress);
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    const auto& j = jobs[i];
    if (fs::exists(j.dir / "summary.json")) continue;  // finished earlier
    if (progress)
      fmt::print(stderr, "sweep: run {}/{}: {} seed {}{}\n", i + 1, jobs.size(), j.method, j.seed,
                 j.setting.empty() ? std::string() : fmt::format(" ({})", j.setting));
    {  // the run's folder, made ours, before train --resume locks it again
      OutputDirOptions d;
      d.kind = "run";
      d.command = "relpos sweep";
      d.existing = Existing::Continue;
      OutputDir dir(j.dir, d);
      restart_if_unsaved(j);
    }
    RunOptions o;
    o.out = j.dir;
    o.resume = true;
    o.progress = progress;
    o.command = "relpos sweep";
    run_training(j.config, o);
  }
  // the table: mean and sample std over seeds of the final loss and accuracy at each length
  std::map<std::pair<std::string, std::string>,
           std::map<int64_t, std::vector<std::pair<double, double>>>>
      agg;
  std::vector<std::pair<std::string, std::string>> order;
  std::map<std::pair<std::string, std::string>, std::map<std::string, std::vector<double>>> extras;
  // RFC 4180: a field with a comma (most method specs), a quote or a line break is quoted
  const auto csv_field = [](const std::string& f) {
    if (f.find_first_of(",\"\r\n") == std::string::npos) return f;
    std::string q = "\"";
    for (char c : f) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  };
  std::map<std::string, size_t> machines;  // CPU (kernel ISA) -> runs
  std::string csv = "method,setting,seed,length,loss,accuracy,perplexity,wall_s\n";
  std::vector<int64_t> lengths;
  for (const auto& j : jobs) {
    const auto s = read_summary(j.dir / "summary.json");
    const auto key = std::make_pair(j.method, j.setting);
    if (!agg.count(key)) order.push_back(key);
    ++machines[s.contains("cpu") && s["cpu"].is_string() && s.contains("isa") &&
                       s["isa"].is_string()
                   ? fmt::format("{} ({})", s["cpu"].get<std::string>(),
                                 s["isa"].get<std::string>())
                   : std::string("not recorded")];
    auto& ex = extras[key];
    if (s.contains("wall_s") && s["wall_s"].is_number())
      ex["wall_s"].push_back(s["wall_s"].get<double>());
    if (s.contains("extra") && s["extra"].is_object())
      for (const auto& [name, v] : s["extra"].items())
        if (v.is_number()) ex[name].push_back(v.get<double>());
    for (const auto& e : s["final_eval"]) {
      const int64_t L = e["length"];
      agg[key][L].push_back({e["loss"].get<double>(), e["accuracy"].get<double>()});
      if (std::find(lengths.begin(), lengths.end(), L) == lengths.end()) lengths.push_back(L);
      csv += fmt::format("{},{},{},{},{:.9g},{:.9g},{:.9g},{:.3f}\n", csv_field(j.method),
                         csv_field(j.setting), j.seed, L, e["loss"].get<double>(),
                         e["accuracy"].get<double>(), e["perplexity"].get<double>(),
                         s["wall_s"].get<double>());
    }
  }
  std::string md = fmt::format(
      "| method |{}\n|---|{}\n",
      [&] {
        std::string h;
        for (auto L : lengths) h += fmt::format(" loss@{} | acc@{} |", L, L);
        return h;
      }(),
      [&] {
        std::string h;
        for (size_t i = 0; i < lengths.size(); ++i) h += "---:|---:|";
        return h;
      }());
  for (const auto& key : order) {
    md += key.second.empty() ? fmt::format("| {} |", key.first)
                             : fmt::format("| {} ({}) |", key.first, key.second);
    for (auto L : lengths) {
      std::vector<double> loss, acc;
      for (const auto& [l, a] : agg[key][L]) {
        loss.push_back(l);
        acc.push_back(a);
      }
      md += fmt::format(" {:.4f} ± {:.4f} | {:.4f} ± {:.4f} |", mean(loss), sample_std(loss),
                        mean(acc), sample_std(acc));
    }
    md += "\n";
  }
  md += fmt::format("\nmean ± sample std over seeds {}\n", [&] {
    std::string s;
    for (auto x : sw.seeds) s += fmt::format("{}{}", s.empty() ? "" : ", ", x);
    return s;
  }());
  // runs of one sweep may come from several machines (records): say which ran how many
  std::string ran_on;
  for (const auto& [m, n] : machines)
    ran_on += fmt::format("{}{} on {}", ran_on.empty() ? "" : "; ",
                          n == jobs.size() ? std::string("all") : std::to_string(n), m);
  ran_on = fmt::format("{} run(s), {}", jobs.size(), ran_on);
  md += fmt::format("{}\n", ran_on);
  write_file_atomic(root / "summary.md", md);
  write_file_atomic(root / "results.csv", csv);
  write_plots(root, jobs, order, agg, lengths);
  SweepOutcome outcome;
  outcome.ran_on = ran_on;
  outcome.markdown = md;
  outcome.folder = root;
  for (const auto& key : order) {
    const std::string label =
        key.second.empty() ? key.first : fmt::format("{} ({})", key.first, key.second);
    outcome.methods.push_back(label);
    outcome.results[label] = agg[key];
    outcome.extras[label] = extras[key];
  }
  return outcome;
}

std::string run_sweep(const fs::path& sweep_file, const std::vector<std::string>& sets,
                      const std::string& out, bool progress, int64_t parallel,
                      const fs::path& import_from) {
  std::ifstream in(sweep_file);
  if (!in)
    throw InputError(
        fmt::format("sweep file '{}' does not exist or is unreadable", sweep_file.string()));
  std::ostringstream text;
  text << in.rdbuf();
  return run_sweep_text(text.str(), sweep_file.string(), sets, out, progress, parallel, import_from)
      .markdown;
}

bool is_run_records(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kRecordsMarker, ec);
}

size_t export_runs(const fs::path& sweep_dir, const fs::path& out) {
  std::error_code ec;
  if (!fs::is_directory(sweep_dir, ec))
    throw InputError(
        fmt::format("export-runs: '{}' is not a folder", brief(sweep_dir.string(), 200)));
  // one run's folder is not a folder of runs: its records would land in --out itself, where
  // --import-runs finds no job of any sweep
  for (const char* f : {"summary.json", "config.toml"})
    if (fs::is_regular_file(sweep_dir / f, ec))
      throw InputError(fmt::format(
          "export-runs: '{}' is one run's folder (it holds {}), not a sweep's: pass the sweep or "
          "reproduction folder that holds it (its parent '{}', or the folder above)",
          brief(sweep_dir.string(), 200), f,
          brief(fs::absolute(sweep_dir, ec).lexically_normal().parent_path().string(), 200)));
  // the runs first: a bad one refuses the export before anything is written
  std::vector<fs::path> runs;
  for (auto it = fs::recursive_directory_iterator(sweep_dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (it->path().filename() != "summary.json" || !it->is_regular_file(ec)) continue;
    const fs::path run = it->path().parent_path();
    for (const char* f : kRecordFiles)
      if (!fs::is_regular_file(run / f, ec))
        throw InputError(fmt::format("export-runs: the finished run '{}' has no {}",
                                     brief(run.string(), 200), f));
    read_summary(run / "summary.json");
    load_config(run / "config.toml");
    runs.push_back(run);
  }
  if (ec)
    throw InputError(fmt::format("export-runs: cannot read '{}': {}",
                                 brief(sweep_dir.string(), 200), ec.message()));
  if (runs.empty())
    throw InputError(fmt::format(
        "export-runs: '{}' holds no finished run (no RUN/summary.json below it): nothing to "
        "export; pass a sweep's or reproduction's folder",
        brief(sweep_dir.string(), 200)));
  std::sort(runs.begin(), runs.end());
  if (fs::exists(out, ec) && !fs::is_directory(out, ec))
    throw InputError(
        fmt::format("export-runs: --out '{}' is not a folder", brief(out.string(), 200)));
  if (fs::exists(out, ec) && !fs::is_empty(out, ec)) check_records_folder(out);
  fs::create_directories(out, ec);
  if (ec || !fs::is_directory(out))
    throw InputError(
        fmt::format("export-runs: cannot make the folder '{}'", brief(out.string(), 200)));
  write_file_atomic(
      out / kRecordsMarker,
      "relpos run records: the config.toml, metrics.csv and summary.json of finished "
      "runs of a sweep, at their paths in the sweep folder (relpos-train export-runs);\n"
      "'relpos reproduce NAME --import-runs THIS_FOLDER' continues the sweep with them.\n");
  for (const auto& run : runs) {
    const fs::path dest = out / fs::relative(run, sweep_dir);
    fs::create_directories(dest, ec);
    if (ec)
      throw InputError(fmt::format("export-runs: cannot make '{}'", brief(dest.string(), 200)));
    for (const char* f : kRecordFiles) write_file_atomic(dest / f, tasks::read_file_bytes(run / f));
  }
  return runs.size();
}

}  // namespace relpos::train
