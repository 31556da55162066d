// `relpos reproduce NAME --scale paper|cpu`: one TOML file per paper table under experiments/,
// run as a sweep and printed beside the paper's numbers.
//
// An experiment file is a sweep file (train/sweep.hpp) at the paper's scale plus:
//   [reproduce]
//   title = "..."
//   kind = "rows"                     # one paper row per method: labels[i] is methods[i]
//   labels = ["RoPE", ...]
//   columns = ["accuracy@1024", ...]  # METRIC@LENGTH, METRIC in loss | accuracy | perplexity;
//                                     # METRIC@LENGTH:SETTING reads the runs of a sweep setting
//   paper = [[0.969, 0.031, 0.781, 0.083], ...]   # per row: mean, std for each column
//   also = ["exp2_loss@20:L1", ...]   # optional: a second view of ours beside each column
//   extras = ["equivariance_rel_f32", "wall_s"]  # optional: more columns of ours, each the mean
//                                     # ± std over seeds of a run's summary.json "extra" number
//                                     # (or wall_s), printed with 3 significant digits
//   # or kind = "best": the paper reports the best method per column
//   best = [["accuracy@512", "Exact m=3 c=.1 eta0=.01", 0.9097, 0.0335], ...]
//   parts = ["other-experiment", ...]  # optional: also run these (into OUT/PART), printed after
//   [scale.cpu]                        # a smaller protocol for 2 CPU cores
//   set = ["task.train_length=512", ...]
//   methods = [...]                    # optional: the same rows at the smaller scale
//   columns = ["accuracy@512", ...]    # our column for each paper column
//   seeds = [0, 1, 2]
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "train/config.hpp"

namespace relpos::train {

// The folder of experiment files: $RELPOS_EXPERIMENTS, else the source tree's experiments/.
std::filesystem::path experiments_dir();

// The scale a call means: `scale`, or when empty "cpu" where the file has [scale.cpu] and
// "paper" otherwise (experiments whose paper protocol fits 2 cores). A scale is any [scale.X]
// table of the file (JoFormer's "reference" mode is one) or "paper".
std::string resolve_scale(const std::string& name, const std::string& scale);

// The configuration of every run of experiment NAME at `scale` (checked; nothing runs).
std::vector<TrainConfig> experiment_configs(const std::string& name, const std::string& scale,
                                            const std::vector<std::string>& sets);

// One experiment file as `relpos reproduce --list` shows it: its title, and per scale (the
// file's default first) the number of training runs, or why its configurations do not build.
struct ExperimentSummary {
  std::string name, title;
  struct Scale {
    std::string name;
    size_t runs = 0;
    std::string error;  // empty when the runs were counted
  };
  std::vector<Scale> scales;
};
std::vector<ExperimentSummary> list_experiments();
// The list as a Markdown table (experiment, scales with their run counts, title).
std::string experiment_list_markdown(const std::vector<ExperimentSummary>& list);

// Runs experiment NAME at `scale` into `out` (default runs/reproduce/NAME-SCALE) and returns the
// report (Markdown), also written to OUT/reproduce.md. Finished runs are reused (resumable).
// `only` (optional) keeps the methods whose label or spec is listed, in the file's order;
// `only_settings` the named sweep settings. parallel > 1 runs that many at a time, and
// `import_runs` (a folder of run records) supplies finished runs first (sweep.hpp).
std::string reproduce(const std::string& name, const std::string& scale,
                      const std::vector<std::string>& sets, const std::string& out, bool progress,
                      const std::vector<std::string>& only = {},
                      const std::vector<std::string>& only_settings = {}, int64_t parallel = 1,
                      const std::filesystem::path& import_runs = {});

}  // namespace relpos::train
