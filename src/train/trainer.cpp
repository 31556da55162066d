#include "train/trainer.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <optional>
#include <sstream>
#include <thread>

#include "core/files.hpp"
#include "core/parse.hpp"
#include "core/types.hpp"
#include "kernels/isa.hpp"
#include "train/model.hpp"
#include "train/task.hpp"

namespace relpos::train {

namespace fs = std::filesystem;
namespace F = torch::nn::functional;

double learning_rate(const OptimConfig& o, int64_t step) {
  if (step < o.warmup) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup);
  if (o.schedule == "constant") return o.lr;
  const double span = std::max<int64_t>(o.steps - o.warmup - 1, 1);
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup) / span);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + std::cos(std::numbers::pi * progress));
}

namespace {

// Loss over the targets that are not -1, scoring the first `classes` logits.
torch::Tensor loss_of(const torch::Tensor& logits, const Batch& b, int64_t classes) {
  return F::cross_entropy(logits.narrow(-1, 0, classes).reshape({-1, classes}),
                          b.targets.reshape({-1}), F::CrossEntropyFuncOptions().ignore_index(-1));
}

double accuracy_of(const torch::Tensor& logits, const Batch& b, int64_t classes) {
  const auto pred = logits.narrow(-1, 0, classes).argmax(-1);
  const auto scored = b.targets >= 0;
  return ((pred == b.targets) & scored).sum().item<double>() /
         std::max(1.0, scored.sum().item<double>());
}

// Loss and accuracy at each length: means over the evaluation set of the per-batch means (the
// papers' protocol).
std::vector<EvalResult> evaluate(TrainModel& model, Task& task, const std::vector<int64_t>& lengths,
                                 int64_t step) {
  torch::NoGradGuard no_grad;
  model.module().eval();
  std::vector<EvalResult> out;
  for (const int64_t T : lengths) {
    double loss = 0, acc = 0;
    const auto set = task.eval_set(T);
    for (const auto& b : set) {
      const auto logits = model.forward(b.tokens);
      loss += loss_of(logits, b, task.classes()).item<double>();
      acc += accuracy_of(logits, b, task.classes());
    }
    const double n = static_cast<double>(set.size());
    out.push_back({step, T, loss / n, acc / n, std::exp(loss / n)});
  }
  model.module().train();
  return out;
}

// Refuses an evaluation length whose forward would not fit in memory, before training starts.
// Activations of one layer dominate: about 16 floats per token and model dim (qkv, transformed
// copies, attention output, MLP of ratio r), plus the logits.
void check_memory(const TrainConfig& c, int64_t vocab) {
  const auto& m = c.model;
  int64_t longest = c.task.train_length;
  for (auto l : c.eval.lengths) longest = std::max(longest, l);
  for (auto l : c.task.train_lengths) longest = std::max(longest, l);
  const double tokens = static_cast<double>(longest) *
                        static_cast<double>(std::max(c.eval.batch_size, c.optim.batch));
  const double bytes =
      4.0 * tokens *
      (static_cast<double>(m.d_model) * (12.0 + 2.0 * static_cast<double>(m.mlp_ratio)) *
           std::max<double>(1, static_cast<double>(m.layers)) +
       static_cast<double>(vocab));
  const double available =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (bytes > 0.8 * available)
    throw InputError(fmt::format(
        "config: sequences of {} tokens (batch {}) need about {:.1f} GB of activations, more than "
        "this machine's {:.1f} GB; lower eval.lengths / task.train_length / the batch",
        longest, std::max(c.eval.batch_size, c.optim.batch), bytes / 1e9, available / 1e9));
}

// ---- files
// ---------------------------------------------------------------------------------------

constexpr const char* kCsvHeader =
    "step,split,length,loss,accuracy,perplexity,lr,grad_norm,tokens_per_s,elapsed_s";

struct Metrics {
  std::vector<std::string> rows;  // CSV lines without the header
  void add_eval(const EvalResult& e, double elapsed) {
    rows.push_back(fmt::format("{},eval,{},{:.9g},{:.9g},{:.9g},,,,{:.3f}", e.step, e.length,
                               e.loss, e.accuracy, e.perplexity, elapsed));
  }
  std::string csv() const {
    std::string s = std::string(kCsvHeader) + "\n";
    for (const auto& r : rows) s += r + "\n";
    return s;
  }
  // Rows of an earlier attempt up to `step` (a resumed run continues after them). A missing or
  // garbled file is refused: resuming would silently drop the history before the checkpoint.
  static Metrics read(const fs::path& path, int64_t step) {
    const auto refuse = [&](const std::string& why) {
      return InputError(fmt::format(
          "--resume: '{}' {}; the history up to the checkpoint (step {}) would be lost: restore "
          "the file, or start the run again with --overwrite",
          path.string(), why, step));
    };
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) throw refuse("is missing");
    Metrics m;
    std::ifstream in(path);
    std::string line;
    if (!std::getline(in, line) || line != kCsvHeader)
      throw refuse("does not start with the metrics header");
    for (int no = 2; std::getline(in, line); ++no) {
      const auto comma = line.find(',');
      const auto row_step = comma == std::string::npos
                                ? std::nullopt
                                : parse_int64(line.substr(0, comma), 0, int64_t{1} << 62);
      if (!row_step) throw refuse(fmt::format("line {} is not a metrics row", no));
      if (*row_step <= step) m.rows.push_back(line);
    }
    return m;
  }
};

struct Checkpoint {
  int64_t step = 0;
  double elapsed = 0;
  int64_t tokens = 0;
};

void save_checkpoint(const fs::path& path, torch::nn::Module& model, torch::optim::AdamW& opt,
                     const Checkpoint& ck) {
  torch::serialize::OutputArchive archive, model_archive, opt_archive;
  model.save(model_archive);
  opt.save(opt_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", opt_archive);
  archive.write("step", torch::tensor(ck.step, torch::kLong));
  archive.write("elapsed", torch::tensor(ck.elapsed, torch::kDouble));
  archive.write("tokens", torch::tensor(ck.tokens, torch::kLong));
  std::ostringstream bytes;
  archive.save_to(bytes);
  fs::create_directories(path.parent_path());
  write_checked_file(path, bytes.str());
}

// The checkpoint's bytes, checksum verified (a file from before checksums: a warning).
std::string checkpoint_bytes(const fs::path& path) {
  auto f = read_checked_file(path);
  if (!f.verified)
    fmt::print(stderr,
               "relpos: warning: checkpoint '{}' has no checksum (written by an older relpos); "
               "it is loaded unverified\n",
               path.string());
  return std::move(f.bytes);
}

// opt: null to load the weights only (eval, diagnose: a run's model, whatever its optimizer)
Checkpoint load_checkpoint(const fs::path& path, torch::nn::Module& model,
                           torch::optim::AdamW* opt) {
  const std::string bytes = checkpoint_bytes(path);
  // a checkpoint's tensors replace the model's whatever their shapes: compare them after loading
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& p : model.named_parameters())
    shapes.emplace_back(p.key(), p.value().sizes().vec());
  for (const auto& b : model.named_buffers()) shapes.emplace_back(b.key(), b.value().sizes().vec());
  torch::serialize::InputArchive archive, model_archive, opt_archive;
  try {
    archive.load_from(bytes.data(), bytes.size());
    archive.read("model", model_archive);
    model.load(model_archive);
    size_t i = 0;
    const auto check = [&](const std::string& name, const torch::Tensor& t) {
      const auto& [want_name, want] = shapes[i++];
      if (name != want_name || t.sizes().vec() != want)
        throw InputError(fmt::format(
            "checkpoint '{}' holds another model than the run's config.toml: '{}' has shape {} "
            "there, {} here",
            path.string(), name, fmt::format("[{}]", fmt::join(t.sizes().vec(), ", ")),
            fmt::format("[{}]", fmt::join(want, ", "))));
    };
    for (const auto& p : model.named_parameters()) check(p.key(), p.value());
    for (const auto& b : model.named_buffers()) check(b.key(), b.value());
    archive.read("optimizer", opt_archive);
    try {
      if (opt) opt->load(opt_archive);
    } catch (const c10::Error& e) {
      // the model's tensors loaded by name, the optimizer's state is by position: a checkpoint
      // from before 2026-11-30, when tensors no table or block reads (PJ sectors left off,
      // order-1 eta) were still parameters, has more of them than this model
      throw InputError(fmt::format(
          "checkpoint '{}': its optimizer state does not fit this model's parameters ({}); a "
          "run saved before relpos kept unread mechanism tensors as buffers (2026-11-30) cannot "
          "resume, start it again",
          path.string(), brief(e.what_without_backtrace(), 200)));
    }
    torch::Tensor step, elapsed, tokens;
    archive.read("step", step);
    archive.read("elapsed", elapsed);
    archive.read("tokens", tokens);
    return {step.item<int64_t>(), elapsed.item<double>(), tokens.item<int64_t>()};
  } catch (const c10::Error& e) {
    throw InputError(fmt::format("checkpoint '{}' is corrupt or from another model: {}",
                                 path.string(), brief(e.what_without_backtrace(), 300)));
  }
}

// ---- progress on stderr
// ----------------------------------------------------------------------------

class Progress {
 public:
  Progress(bool on, int64_t total) : on_(on), tty_(isatty(2) != 0), total_(total) {}
  void update(int64_t step, double loss, double tokens_per_s, double elapsed, int64_t first_step) {
    if (!on_) return;
    const double done = static_cast<double>(step - first_step);
    const double eta = done > 0 ? elapsed / done * static_cast<double>(total_ - step) : 0;
    const std::string line = fmt::format("step {}/{}  loss {:.4f}  {:.0f} tok/s  ETA {:.0f}s", step,
                                         total_, loss, tokens_per_s, eta);
    if (tty_) {
      const int width = 30;
      const int filled = static_cast<int>(width * step / std::max<int64_t>(total_, 1));
      fmt::print(stderr, "\r[{}{}] {}", std::string(filled, '#'), std::string(width - filled, ' '),
                 line);
    } else {
      fmt::print(stderr, "{}\n", line);
    }
  }
  void done() {
    if (on_ && tty_) fmt::print(stderr, "\n");
  }

 private:
  bool on_, tty_;
  int64_t total_;
};

}  // namespace

namespace {
torch::optim::AdamWOptions adamw_options(const OptimConfig& o,
                                         std::optional<double> wd = std::nullopt) {
  return torch::optim::AdamWOptions(o.lr)
      .betas({o.beta1, o.beta2})
      .eps(o.eps)
      .weight_decay(wd.value_or(o.weight_decay));
}

std::vector<torch::optim::OptimizerParamGroup> adamw_groups(TrainModel& model,
                                                            const OptimConfig& o) {
  // one group, or (grape preset) a second without decay for the RMSNorm gains
  auto [decay, keep] = model.decay_groups();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(adamw_options(o)));
  if (!keep.empty())
    groups.emplace_back(keep, std::make_unique<torch::optim::AdamWOptions>(adamw_options(o, 0.0)));
  return groups;
}
}  // namespace

std::string mechanism_stats_json(models::TransformerLMImpl& model) {
  nlohmann::json layers = nlohmann::json::array();
  for (auto& block : model.blocks()) {
    const auto kp = block->encoding()->kernel_params();
    nlohmann::json j;
    const auto mean_abs = [](const torch::Tensor& t) {
      return t.defined() && t.numel() ? t.detach().abs().mean().item<double>() : 0.0;
    };
    j["gamma"] = mean_abs(kp.gamma);
    j["abs_eta"] = mean_abs(kp.eta);
    j["abs_gates"] = mean_abs(kp.gates);
    for (const auto& [name, value] : block->attention_stats()) j[name] = value;
    layers.push_back(j);
  }
  return layers.dump();
}

int configure_threads(const TrainConfig& c) {
  const int threads = c.threads > 0
                          ? static_cast<int>(c.threads)
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
  omp_set_num_threads(threads);
  // Subnormal floats (gradients of saturated softmaxes over tied N(0, 1) embeddings reach them)
  // make every matrix product that meets them 10-100x slower; flush them to zero, as GPUs do.
  at::globalContext().setFlushDenormal(true);
  return threads;
}

namespace {

// The CPU's model name from /proc/cpuinfo ("unknown" elsewhere).
std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0)
      if (const auto at = line.find_first_not_of(" \t:", line.find(':')); at != std::string::npos)
        return line.substr(at);
  return "unknown";
}

// What OUT records of an earlier run ("metrics.csv rows up to step 3, summary.json"), or nullopt
// when there is nothing that a start from step 0 would lose (no metrics.csv, or only its header
// and rows of step 0).
std::optional<std::string> recorded_history(const fs::path& out) {
  std::error_code ec;
  std::vector<std::string> found;
  if (fs::is_regular_file(out / "metrics.csv", ec)) {
    std::ifstream in(out / "metrics.csv");
    std::string line;
    int64_t last = 0;
    bool garbled = false;
    if (std::getline(in, line) && line != kCsvHeader) garbled = true;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      const auto comma = line.find(',');
      const auto step = comma == std::string::npos
                            ? std::nullopt
                            : parse_int64(line.substr(0, comma), 0, int64_t{1} << 62);
      if (!step)
        garbled = true;
      else
        last = std::max(last, *step);
    }
    if (last > 0) found.push_back(fmt::format("metrics.csv rows up to step {}", last));
    if (garbled) found.push_back("metrics.csv lines that are not metrics rows");
  }
  if (fs::exists(out / "summary.json", ec)) found.push_back("summary.json of a finished run");
  if (found.empty()) return std::nullopt;
  return fmt::format("{}", fmt::join(found, ", "));
}

// --resume continues a run only with the configuration it was trained with (but for
// resume_mutable_keys()), and only from a checkpoint: anything else would train the rest of it as
// another model, or start it again over its recorded history.
void check_resume(const TrainConfig& c, const fs::path& out) {
  std::error_code ec;
  const fs::path ckpt = out / "checkpoints" / "last.pt";
  if (!fs::exists(ckpt, ec)) {
    // nothing to continue from: starting at step 0 is fine only when nothing was recorded
    if (const auto history = recorded_history(out))
      throw InputError(fmt::format(
          "--resume: the checkpoint '{}' is missing, but the run holds {}; starting again from "
          "step 0 would lose that history: restore the checkpoint, or start the run again with "
          "--overwrite",
          ckpt.string(), *history));
    return;  // nothing trained yet: start
  }
  const fs::path saved = out / "config.toml";
  if (!fs::is_regular_file(saved, ec))
    throw InputError(fmt::format(
        "--resume: '{}' has a checkpoint but no config.toml, so its configuration cannot be "
        "checked; --overwrite starts the run again",
        out.string()));
  const auto changed = resume_changes(load_config(saved), c);
  if (!changed.empty())
    throw InputError(fmt::format(
        "--resume: the run in '{}' was trained with another configuration: {}; a resume may "
        "change only {} (--overwrite starts a new run there)",
        out.string(), fmt::join(changed, ", "), fmt::join(resume_mutable_keys(), ", ")));
}

RunResult train(const TrainConfig& c, const RunOptions& o);

}  // namespace

void remove_checkpoints(const fs::path& run_dir) {
  const fs::path dir = run_dir / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  // last.pt and the temp files of its atomic writes (".last.pt.tmp.PID.N", temp_path_for)
  const std::string temp_prefix = ".last.pt.tmp.";
  std::vector<fs::path> ours;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if ((name == "last.pt" || name.rfind(temp_prefix, 0) == 0) &&
        !fs::is_directory(e.symlink_status(ec)))
      ours.push_back(e.path());
  }
  for (const auto& p : ours) fs::remove(p, ec);
  // the folder goes only when nothing is left in it (and never a link to it, which is not ours)
  if (!fs::is_symlink(fs::symlink_status(dir, ec)) && fs::is_empty(dir, ec) && !ec)
    fs::remove(dir, ec);
}

RunResult run_training(const TrainConfig& c, const RunOptions& o) {
  // ---- setup: everything that can fail on bad input fails here, before the first step
  c.validate();
  if (o.resume && o.overwrite) throw InputError("--resume and --overwrite exclude each other");
  // the folder: refused, locked and marked INCOMPLETE by rank 0, the only writer
  std::optional<OutputDir> dir;
  if (o.replicas.rank == 0) {
    OutputDirOptions d;
    d.kind = "run";
    d.command = o.command;
    d.existing = o.resume ? Existing::Continue : o.overwrite ? Existing::Replace : Existing::Refuse;
    if (o.resume) d.before_write = [&] { check_resume(c, o.out); };
    dir.emplace(o.out, d);
    if (o.overwrite && dir->existed()) {  // the old run's results must not outlive it
      std::error_code ec;
      for (const char* f : {"summary.json", "metrics.csv"})  // files of ours, never a folder
        if (!fs::is_directory(fs::symlink_status(o.out / f, ec))) fs::remove(o.out / f, ec);
      remove_checkpoints(o.out);  // last.pt; anything else in checkpoints/ is the user's
    }
  }
  if (o.resume && o.replicas.rank != 0) check_resume(c, o.out);  // rank 0's ran under the lock
  auto result = train(c, o);
  if (dir) dir->finish();
  return result;
}

namespace {

RunResult train(const TrainConfig& c, const RunOptions& o) {
  if (c.device != "cpu")
    throw InputError("device = cuda: the CUDA engine is not built yet (issue 16); use cpu");
  const int threads = configure_threads(c);
  const bool main_rank = o.replicas.rank == 0;
  const int world = o.replicas.world;
  if (c.optim.batch % world)
    throw InputError(
        fmt::format("optim.batch {} is not divisible by the {} workers", c.optim.batch, world));
  auto task = make_task(c);
  check_memory(c, task->vocab());
  torch::manual_seed(static_cast<uint64_t>(c.seed));  // the model's initialisation
  const std::unique_ptr<TrainModel> model = make_model(c, task->vocab());
  torch::optim::AdamW opt(adamw_groups(*model, c.optim), adamw_options(c.optim));
  const fs::path ckpt_path = o.out / "checkpoints" / "last.pt";
  Checkpoint ck;
  Metrics metrics;
  if (o.resume && fs::exists(ckpt_path)) {
    ck = load_checkpoint(ckpt_path, model->module(), &opt);
    metrics = Metrics::read(o.out / "metrics.csv", ck.step);
    // the stream is a function of the seed: replay it to where the checkpoint stopped
    for (int64_t s = 0; s < ck.step; ++s) task->next_train_batch(c.optim.batch);
  } else if (o.replicas.broadcast_parameters) {
    o.replicas.broadcast_parameters(model->module().parameters());
  }
  if (main_rank) write_file_atomic(o.out / "config.toml", c.to_toml());
  // the step of the checkpoint on disk (-1: none yet), named when the run diverges
  int64_t saved_step = o.resume && fs::exists(ckpt_path) ? ck.step : -1;
  const auto diverged = [&](int64_t step, const std::string& what) {
    return TrainingDiverged(fmt::format(
        "training stopped: the {} at step {}; {}", what, step,
        saved_step >= 0 ? fmt::format("the last good checkpoint (step {}) is kept in '{}'",
                                      saved_step, ckpt_path.string())
                        : std::string("no checkpoint was written before")));
  };

  // ---- the loop
  const auto params = model->module().parameters();
  const int64_t local = c.optim.batch / world;
  const auto t0 = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return ck.elapsed +
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  Progress progress(o.progress && main_rank, c.optim.steps);
  const int64_t first_step = ck.step;
  double loss_sum = 0, grad_norm = 0;
  int64_t loss_count = 0;
  RunResult result;
  model->module().train();
  for (int64_t step = ck.step; step < c.optim.steps; ++step) {
    const double lr = learning_rate(c.optim, step);
    for (auto& group : opt.param_groups()) group.options().set_lr(lr);

    // every worker draws the global batch and trains on its own rows of it
    Batch batch = task->next_train_batch(c.optim.batch);
    if (world > 1)
      batch = {batch.tokens.narrow(0, o.replicas.rank * local, local),
               batch.targets.narrow(0, o.replicas.rank * local, local)};

    const auto logits = model->forward(batch.tokens);
    const auto loss = loss_of(logits, batch, task->classes());
    // a non-finite loss or gradient stops the run before the optimiser step spreads it into
    // every weight (and into the next checkpoint)
    const double loss_value = loss.item<double>();
    if (!std::isfinite(loss_value)) throw diverged(step + 1, fmt::format("loss is {}", loss_value));
    opt.zero_grad();
    loss.backward();
    if (world > 1) o.replicas.average_gradients(params);
    grad_norm = c.optim.clip > 0 ? torch::nn::utils::clip_grad_norm_(params, c.optim.clip) : 0.0;
    if (!std::isfinite(grad_norm))
      throw diverged(step + 1, fmt::format("gradient norm is {}", grad_norm));
    opt.step();

    loss_sum += loss_value;
    ++loss_count;
    ck.step = step + 1;
    ck.tokens += c.optim.batch * batch.tokens.size(1);  // multi-length tasks vary T per step
    const bool last = ck.step == c.optim.steps;
    if (ck.step % c.log_every == 0 || last) {
      const double tps = static_cast<double>(ck.tokens) / std::max(elapsed(), 1e-9);
      metrics.rows.push_back(fmt::format("{},train,{},{:.9g},,,{:.9g},{:.6g},{:.1f},{:.3f}",
                                         ck.step, c.task.train_length, loss_sum / loss_count, lr,
                                         grad_norm, tps, elapsed()));
      progress.update(ck.step, loss_sum / loss_count, tps,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                      first_step);
      loss_sum = 0;
      loss_count = 0;
    }
    if ((c.eval.every > 0 && ck.step % c.eval.every == 0) || last) {
      const auto ev = evaluate(*model, *task, c.eval.lengths, ck.step);
      for (const auto& e : ev) metrics.add_eval(e, elapsed());
      if (last) result.final_eval = ev;
    }
    const bool checkpoint = (c.checkpoint_every > 0 && ck.step % c.checkpoint_every == 0) || last;
    // an optimiser step can make weights non-finite with a finite loss and gradient (Adam's
    // 0 / (0 + eps) when eps underflows): never checkpoint such a model
    if (checkpoint)
      for (const auto& p : params)
        if (!torch::isfinite(p).all().item<bool>())
          throw diverged(ck.step, "weights are not finite after the update");
    if (main_rank) {
      if (checkpoint) {
        // metrics first: a checkpoint never points past the rows on disk
        write_file_atomic(o.out / "metrics.csv", metrics.csv());
        Checkpoint now = ck;
        now.elapsed = elapsed();
        save_checkpoint(ckpt_path, model->module(), opt, now);
        saved_step = now.step;
      } else if (ck.step % c.log_every == 0) {
        write_file_atomic(o.out / "metrics.csv", metrics.csv());
      }
    }
  }
  progress.done();
  if (result.final_eval.empty())  // resumed after the last step: evaluate the final model
    result.final_eval = evaluate(*model, *task, c.eval.lengths, ck.step);

  // ---- summary
  result.steps = ck.step;
  result.wall_s = elapsed();
  result.tokens_per_s = static_cast<double>(ck.tokens) / std::max(result.wall_s, 1e-9);
  result.parameters = model->parameter_count();
  if (main_rank) {
    nlohmann::json s;
    s["name"] = c.name;
    s["mechanism"] = c.model.mechanism;
    s["seed"] = c.seed;
    s["steps"] = result.steps;
    s["parameters"] = result.parameters;
    s["wall_s"] = result.wall_s;
    s["tokens_per_s"] = result.tokens_per_s;
    s["threads"] = threads;
    s["workers"] = world;
    // where it ran: runs of one sweep may come from several machines (--import-runs)
    s["cpu"] = cpu_model_name();
    s["isa"] = kernels::kernel_isa();
    double train_len_loss = NAN;
    for (const auto& e : result.final_eval)
      if (e.length == c.task.train_length) train_len_loss = e.loss;
    nlohmann::json ev = nlohmann::json::array();
    for (const auto& e : result.final_eval)
      ev.push_back(
          {{"length", e.length},
           {"loss", e.loss},
           {"accuracy", e.accuracy},
           {"perplexity", e.perplexity},
           {"delta_loss", std::isnan(train_len_loss) ? nlohmann::json()
                                                     : nlohmann::json(e.loss - train_len_loss)}});
    s["final_eval"] = ev;
    model->summarize(s);  // last: it may move the model to float64
    write_file_atomic(o.out / "summary.json", s.dump(2) + "\n");
  }
  return result;
}

}  // namespace

namespace {
// A finished (or interrupted) run loaded back: its configuration, task and model.
struct LoadedRun {
  TrainConfig config;
  std::unique_ptr<Task> task;
  models::TransformerLM model{nullptr};
  int64_t step = 0;
};

LoadedRun load_run(const fs::path& run_dir, const std::vector<int64_t>& lengths) {
  LoadedRun r;
  r.config = load_config(run_dir / "config.toml");
  if (!lengths.empty()) r.config.eval.lengths = lengths;
  r.config.validate();
  if (r.config.task.kind == "grid2d")
    throw InputError(fmt::format(
        "'{}' is a grid2d run: eval, diagnose and the profiles load language models; its "
        "results are in its summary.json",
        run_dir.string()));
  r.task = make_task(r.config);
  check_memory(r.config, r.task->vocab());
  LmModel lm(r.config, r.task->vocab());
  r.model = lm.lm();
  const fs::path ckpt = run_dir / "checkpoints" / "last.pt";
  if (!fs::exists(ckpt)) throw InputError(fmt::format("no checkpoint at '{}'", ckpt.string()));
  r.step = load_checkpoint(ckpt, *r.model, nullptr).step;
  return r;
}
}  // namespace

std::vector<EvalResult> evaluate_run(const fs::path& run_dir, const std::vector<int64_t>& lengths) {
  auto r = load_run(run_dir, lengths);
  LmModel lm(r.model);
  return evaluate(lm, *r.task, r.config.eval.lengths, r.step);
}

std::string qk_profile_csv(const fs::path& run_dir, int64_t length) {
  auto r = load_run(run_dir, {length});
  const auto set = r.task->eval_set(length);
  const auto profile = r.model->qk_norm_profile(set.front().tokens);
  std::string csv = "layer,position,q_norm,k_norm\n";
  for (size_t l = 0; l < profile.size(); ++l) {
    const auto q = profile[l].first.to(torch::kDouble).contiguous(),
               k = profile[l].second.to(torch::kDouble).contiguous();
    for (int64_t t = 0; t < q.numel(); ++t)
      csv += fmt::format("{},{},{:.6g},{:.6g}\n", l, t, q.data_ptr<double>()[t],
                         k.data_ptr<double>()[t]);
  }
  return csv;
}

TrainedModel load_trained_model(const fs::path& run_dir) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec))
    throw InputError(fmt::format("no run folder at '{}'", run_dir.string()));
  const fs::path ckpt = run_dir / "checkpoints" / "last.pt";
  if (!fs::exists(ckpt, ec)) throw InputError(fmt::format("no checkpoint at '{}'", ckpt.string()));
  auto r = load_run(run_dir, {});
  r.model->eval();
  return {r.config, r.model, r.step};
}

std::string run_mechanism_stats(const fs::path& run_dir) {
  auto r = load_run(run_dir, {});
  return mechanism_stats_json(*r.model);
}

}  // namespace relpos::train
