// A training run's configuration: one TOML file (`relpos train --config FILE.toml`), flags on top
// (`--set section.key=value`), every key checked before training starts. Unknown keys, wrong types
// and values out of range are InputErrors naming the key. The resolved configuration is written
// back as runs/NAME/config.toml, so a run can be repeated from its own folder.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "models/transformer.hpp"

namespace relpos::train {

struct TaskConfig {
  // query_lm | pj_query_lm | bytes | chars | midi | midi_text | grid2d
  std::string kind = "query_lm";
  std::string benchmark = "mixed_raw";  // query_lm: the teacher; grid2d: the teacher (oblique)
  int64_t train_length = 1024;          // tokens per training sequence
  // bytes / chars: a text file; midi: a folder of .mid files; midi_text: the MusicNet MIDI folder
  std::string path;
  std::string validation_path;       // optional separate validation file
  double validation_fraction = 0.1;  // else the tail of `path`
  int64_t train_sample_seed =
      1701;  // corpus LMs: training windows of run s from seed + s * 1000003
  int64_t eval_sample_seed = 20270505;  // corpus LMs: the evaluation windows (same for every run)
  // pj_query_lm (the PJ-RoPE synthetic bridge, tasks/pj_query_lm.hpp): train_length is the kernel
  // scale L; training sequences take the lengths of train_lengths (empty: train_length) by
  // length_sampling (cycle | random)
  std::string target = "first_jet";  // phase, first_jet, ..., lc_affine
  std::string teacher = "signed";    // signed | attention
  double teacher_lambda = 4.0;       // attention teacher: softmax(lambda kernel)
  double omega_cycles = 17.0;        // omega = 2 pi cycles / L
  bool median_threshold = false;     // label = score > batch median (else score > 0)
  std::vector<int64_t> train_lengths;
  std::string length_sampling = "cycle";
  // grid2d (the 2-D relative-position task, train/grid2d_train.hpp): train_length and eval.lengths
  // are cell counts of square grids; the final accuracy is also taken with every position moved
  // by eval_offset, and translation equivariance measured for the shift equivariance_shift
  // (both [row, col])
  std::vector<double> eval_offset{29.0, -41.0};
  std::vector<double> equivariance_shift{3.5, -7.0};
  // midi_text (PJ-RoPE's MIDI-token text read as bytes, tasks/midi_text.hpp): the MusicNet
  // selector's shuffle seed (A 29, B 37), its piece count, and which message tokens it writes
  int64_t midi_seed = 29;
  int64_t midi_max_files = 64;
  bool midi_programs = true;
  bool midi_controls = false;
};

struct OptimConfig {
  int64_t steps = 1200;
  int64_t batch = 24;  // global batch (split across data-parallel workers)
  double lr = 5e-4;
  double weight_decay = 0.01;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double clip = 1.0;                  // global gradient-norm clip (0: none)
  int64_t warmup = 0;                 // linear warmup steps
  std::string schedule = "constant";  // constant | cosine (to min_lr at the last step)
  double min_lr = 0.0;
};

struct EvalConfig {
  int64_t every = 600;  // and at the last step
  std::vector<int64_t> lengths{1024, 2048, 4096, 8192};
  int64_t batches = 32;
  int64_t batch_size = 1;
  // corpus LMs: every non-overlapping window of the validation split (in batches of batch_size)
  // instead of `batches` random ones
  bool full_split = false;
};

struct TrainConfig {
  std::string name = "run";
  int64_t seed = 0;
  int64_t threads = 0;  // 0: every core of the machine
  std::string device = "cpu";
  models::ModelConfig model;  // vocab comes from the task
  TaskConfig task;
  OptimConfig optim;
  EvalConfig eval;
  int64_t checkpoint_every = 100;
  int64_t log_every = 10;

  // Checks every value (and the mechanism against the head shape) with named errors.
  void validate() const;
  // The configuration as TOML (what config.toml holds; parse_config reads it back).
  std::string to_toml() const;
};

// Parses TOML text (`source` names it in messages). Keys absent keep the defaults above.
TrainConfig parse_config(const std::string& text, const std::string& source);
TrainConfig load_config(const std::filesystem::path& path);
// What --resume may change: the keys of resume_mutable_keys() (the total steps, the thread count,
// the evaluation and checkpoint cadence, the name); resume_changes lists every other key whose
// value differs between the run's saved configuration and the new one ("key (old -> new)").
const std::vector<std::string>& resume_mutable_keys();
std::vector<std::string> resume_changes(const TrainConfig& saved, const TrainConfig& now);
// Every key of `now` but `free` whose value differs in `saved` ("key (old -> new)").
std::vector<std::string> config_changes(const TrainConfig& saved, const TrainConfig& now,
                                        const std::vector<std::string>& free);
// What a finished run's saved configuration may differ in from a sweep's job and still stand
// for it (a sweep reuses it, a record is imported): how it was run and saved (the name, the
// threads, the checkpoint and log cadence), never what it computed.
const std::vector<std::string>& finished_run_free_keys();

// Applies "section.key=value" (or "key=value" for top-level keys), value in TOML syntax.
void apply_override(TrainConfig& c, const std::string& assignment);

}  // namespace relpos::train
