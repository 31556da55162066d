// Sweeps: methods x seeds x settings from one TOML file.
//
// A sweep file is a training configuration (train/config.hpp) plus a [sweep] table:
//   [sweep]
//   methods = ["nope", "rope", "jordan(m=2, regime=stabilized)"]   # model.mechanism values
//   seeds = [0, 1, 2]
//   settings = { lr3 = ["optim.lr=1e-3"], long = ["task.train_length=2048"] }  # optional
// Each combination runs in OUT/METHOD[-SETTING]/s<SEED> with resume on; a run whose
// summary.json exists is skipped (after checking that its config.toml is the run's), so a killed
// sweep continues where it stopped. The summary
// (mean and sample std over seeds) is written as OUT/summary.md and OUT/results.csv.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/files.hpp"
#include "train/trainer.hpp"

namespace relpos::train {

// What a sweep produced: the Markdown table and, per method ("METHOD (SETTING)" with settings),
// per length, the final (loss, accuracy) of each seed.
struct SweepOutcome {
  std::string markdown;
  std::filesystem::path folder;
  std::vector<std::string> methods;
  std::map<std::string, std::map<int64_t, std::vector<std::pair<double, double>>>> results;
  // per method, per name, one value per seed: wall_s and the numbers of a run's summary.json
  // "extra" object (grid2d runs: accuracy_shifted, equivariance_rel_f32, ...)
  std::map<std::string, std::map<std::string, std::vector<double>>> extras;
  // "N run(s), all on CPU (ISA)" or "n on CPU (ISA); m on ...": where the runs were trained
  std::string ran_on;
};
// parallel > 1: that many runs at a time, each in a child process (train --config ...).
SweepOutcome run_sweep_text(const std::string& toml_text, const std::string& source,
                            const std::vector<std::string>& sets, const std::string& out,
                            bool progress, int64_t parallel = 1,
                            const std::filesystem::path& import_from = {});

// The same in a folder the caller holds (reproduce: the report goes beside the sweep); `out` above
// is opened as an OutputDir of kind "sweep" that continues an earlier sweep of the same folder.
SweepOutcome run_sweep_text(const std::string& toml_text, const std::string& source,
                            const std::vector<std::string>& sets, const OutputDir& dir,
                            bool progress, int64_t parallel = 1,
                            const std::filesystem::path& import_from = {});
// The folder a sweep writes (`out`, or runs/NAME with its name checked) and its OutputDir options.
std::filesystem::path sweep_folder(const std::string& toml_text, const std::string& source,
                                   const std::string& out);
OutputDirOptions sweep_dir_options(const std::string& command);

// The configuration of every run of a sweep (checked), without running any.
std::vector<TrainConfig> sweep_configs(const std::string& toml_text, const std::string& source,
                                       const std::vector<std::string>& sets);

// Returns the Markdown summary table.
std::string run_sweep(const std::filesystem::path& sweep_file, const std::vector<std::string>& sets,
                      const std::string& out, bool progress, int64_t parallel = 1,
                      const std::filesystem::path& import_from = {});

// Run records: a sweep's finished runs carried to another machine without their checkpoints.
// export_runs writes the config.toml, metrics.csv and summary.json of every finished run under
// `sweep_dir` to `out` at the same relative path (with a RUN-RECORDS marker; a non-empty folder
// without it is refused) and returns the count. A folder with no finished run below it, and one
// run's folder (config.toml or summary.json at its top), are refused naming it. A sweep given
// `import_from` (such a folder) first copies in the records of its runs that are not finished in
// its own folder, each refused unless it was trained with its run's configuration
// (finished_run_free_keys() aside).
size_t export_runs(const std::filesystem::path& sweep_dir, const std::filesystem::path& out);
// Whether `dir` is such a records folder (it holds the marker).
bool is_run_records(const std::filesystem::path& dir);

// A folder-safe name for a method spec: "jordan(m=2, regime=raw)" -> "jordan_m_2_regime_raw".
std::string method_folder(const std::string& spec);

}  // namespace relpos::train
