// The training loop (train/trainer.cpp reads top to bottom): model and optimiser from the
// configuration, the task's training stream, AdamW with global-norm clipping and a warmup +
// constant/cosine schedule, evaluation at several lengths, atomic checkpoints, resume.
//
// A run writes OUT/{config.toml, metrics.csv, summary.json, checkpoints/last.pt} (only rank 0 of
// a data-parallel run writes, holding the folder's lock). A checkpoint carries a checksum that
// --resume, eval and diagnose verify; one whose tensors do not fit the run's model is refused.
// `resume` continues from checkpoints/last.pt: the model, the optimiser state and the step are
// restored and the data stream is replayed to that step, so a killed run ends with the same metrics
// as an uninterrupted one.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/transformer.hpp"
#include "train/config.hpp"

namespace relpos::train {

// How gradients meet across data-parallel workers (train/distributed.hpp provides one over c10d);
// the default is a single process.
struct Replicas {
  int rank = 0;
  int world = 1;
  std::function<void(const std::vector<torch::Tensor>&)> broadcast_parameters;  // from rank 0
  std::function<void(const std::vector<torch::Tensor>&)> average_gradients;
};

struct RunOptions {
  std::filesystem::path out;  // the run's folder (core/files.hpp OutputDir, kind "run")
  // An existing run in `out` is refused unless resume (continue it from checkpoints/last.pt; the
  // configuration may differ only in resume_mutable_keys(); without the checkpoint, only a run
  // that recorded nothing past step 0 starts again) or overwrite (start it again, removing the
  // run's own files only: remove_checkpoints).
  bool resume = false;
  bool overwrite = false;
  std::string command = "relpos train";  // named in the folder's lock file and INCOMPLETE marker
  bool progress = true;  // progress on stderr (a bar on a terminal, plain lines otherwise)
  Replicas replicas;
};

struct EvalResult {
  int64_t step = 0;
  int64_t length = 0;
  double loss = 0, accuracy = 0, perplexity = 0;
};

struct RunResult {
  int64_t steps = 0;
  std::vector<EvalResult> final_eval;  // at the last step, one per evaluation length
  double wall_s = 0;
  double tokens_per_s = 0;  // training tokens per second (all workers)
  int64_t parameters = 0;
};

// A run whose loss (or gradient norm) became NaN or infinite: it stops at once, leaving the last
// checkpoint written before (never one of the diverged model); the message names the step. The
// CLI exits 1.
struct TrainingDiverged : std::runtime_error {
  using std::runtime_error::runtime_error;
};

RunResult run_training(const TrainConfig& c, const RunOptions& o);

// Removes the files relpos writes under RUN_DIR/checkpoints (last.pt and the temp files of its
// atomic writes), then the folder itself if nothing else is left in it. Any other file or folder
// there (a user's best_manual.pt, a subfolder) is kept: relpos never deletes what it did not make.
// The caller holds the run folder's lock (OutputDir).
void remove_checkpoints(const std::filesystem::path& run_dir);

// Loads RUN_DIR/config.toml and RUN_DIR/checkpoints/last.pt and evaluates at `lengths` (the run's
// eval.lengths when empty). No position rescaling: the model runs at each length as trained.
std::vector<EvalResult> evaluate_run(const std::filesystem::path& run_dir,
                                     const std::vector<int64_t>& lengths);

// A run's model loaded back from RUN_DIR/config.toml and RUN_DIR/checkpoints/last.pt, in eval
// mode (InputError naming a missing run folder, config or checkpoint, or a corrupt checkpoint).
struct TrainedModel {
  TrainConfig config;
  models::TransformerLM model{nullptr};
  int64_t step = 0;  // the checkpoint's step
};
TrainedModel load_trained_model(const std::filesystem::path& run_dir);

// Learning rate at `step` (0-based): linear warmup, then constant or cosine to min_lr.
double learning_rate(const OptimConfig& o, int64_t step);

// The run's thread count (c.threads, or every core when 0) set for LibTorch and OpenMP, with
// subnormal floats flushed to zero (gradients of saturated softmaxes reach them, and every matrix
// product that meets them runs 10-100x slower). Returns the count.
int configure_threads(const TrainConfig& c);

// The mean norms of the transformed queries and keys at every position of one evaluation
// sequence of `length` tokens, per layer, from a run's checkpoint: CSV
// layer,position,q_norm,k_norm.
std::string qk_profile_csv(const std::filesystem::path& run_dir, int64_t length);
// mechanism_stats_json of a run's checkpoint.
std::string run_mechanism_stats(const std::filesystem::path& run_dir);

// Mechanism statistics per layer (mean gamma, mean |eta|, mean |gates| over heads and blocks) as
// JSON text, for summaries and `relpos eval`.
std::string mechanism_stats_json(models::TransformerLMImpl& model);

}  // namespace relpos::train
