#include "train/grid2d_train.hpp"

#include <fmt/format.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/files.hpp"
#include "core/types.hpp"

namespace relpos::train {

namespace fs = std::filesystem;
namespace F = torch::nn::functional;

models::Grid2dModelConfig grid2d_model_config(const TrainConfig& c) {
  models::Grid2dModelConfig m;
  m.vocab = tasks::kGrid2dVocab;
  m.classes = 2;
  m.d_model = c.model.d_model;
  m.heads = c.model.heads;
  m.layers = c.model.layers;
  m.mlp_ratio = c.model.mlp_ratio;
  m.mechanism = c.model.mechanism;
  return m;
}

tasks::Grid2dConfig grid2d_task_config(const TrainConfig& c) {
  tasks::Grid2dConfig g;
  g.teacher = c.task.benchmark;
  g.side = tasks::grid2d_side(c.task.train_length);
  g.eval_batches = c.eval.batches;
  g.eval_batch_size = c.eval.batch_size;
  return g;
}

void validate_grid2d(const TrainConfig& c) {
  if (c.task.benchmark != "oblique")
    throw InputError(
        fmt::format("config: task.benchmark of task.kind = grid2d is the teacher "
                    "(valid: oblique), got '{}'",
                    c.task.benchmark));
  const auto where = [](const char* key, const std::string& msg) {
    return InputError(fmt::format("config: {}: {}", key, msg));
  };
  try {
    tasks::grid2d_side(c.task.train_length);
  } catch (const InputError& e) {
    throw where("task.train_length", e.what());
  }
  for (const auto l : c.eval.lengths) {
    try {
      tasks::grid2d_side(l);
    } catch (const InputError& e) {
      throw where("eval.lengths[]", e.what());
    }
  }
  tasks::Grid2dTeacher check(grid2d_task_config(c));
  const auto check_pair = [&](const char* key, const std::vector<double>& v) {
    if (v.size() != 2)
      throw where(key, fmt::format("must be [row, col] (2 numbers), got {} numbers", v.size()));
    for (const double x : v)
      if (!std::isfinite(x) || std::abs(x) > 1e6)
        throw where(key, fmt::format("entries must be finite with |x| <= 1e6, got {}", x));
  };
  check_pair("task.eval_offset", c.task.eval_offset);
  check_pair("task.equivariance_shift", c.task.equivariance_shift);
  if (c.device != "cpu") throw InputError("config: task.kind = grid2d runs on device = cpu");
  grid2d_model_config(c).validate();
}

Grid2dEquivariance grid2d_equivariance(models::Grid2dNetImpl& model, const torch::Tensor& tokens,
                                       int64_t side, double shift_row, double shift_col) {
  torch::NoGradGuard no_grad;
  const auto a = model.forward(tokens, models::grid2d_positions(side));
  const auto b = model.forward(tokens, models::grid2d_positions(side, shift_row, shift_col));
  Grid2dEquivariance e;
  e.max_abs = (b - a).abs().max().item<double>();
  e.max_logit = a.abs().max().item<double>();
  e.rel = e.max_logit > 0 ? e.max_abs / e.max_logit : 0.0;
  return e;
}

namespace {

struct Tensors {
  torch::Tensor tokens, labels;  // [B, T] int64
};

Tensors to_tensors(const tasks::Grid2dBatch& b) {
  const int64_t T = b.side * b.side;
  return {torch::tensor(b.tokens, torch::kLong).view({b.batch, T}),
          torch::tensor(b.labels, torch::kLong).view({b.batch, T})};
}

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& labels) {
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), labels.reshape({-1}));
}

double accuracy_of(const torch::Tensor& logits, const torch::Tensor& labels) {
  return (logits.argmax(-1) == labels).to(torch::kDouble).mean().item<double>();
}

// Loss and accuracy on a set: means over the batches of the per-batch means.
std::pair<double, double> evaluate_set(models::Grid2dNetImpl& model,
                                       const std::vector<tasks::Grid2dBatch>& set,
                                       double offset_row = 0, double offset_col = 0) {
  torch::NoGradGuard no_grad;
  double loss = 0, acc = 0;
  for (const auto& b : set) {
    const auto t = to_tensors(b);
    const auto logits =
        model.forward(t.tokens, models::grid2d_positions(b.side, offset_row, offset_col));
    loss += loss_of(logits, t.labels).item<double>();
    acc += accuracy_of(logits, t.labels);
  }
  const double n = static_cast<double>(set.size());
  return {loss / n, acc / n};
}

std::vector<EvalResult> evaluate(models::Grid2dNetImpl& model, const tasks::Grid2dConfig& g,
                                 int64_t seed, const std::vector<int64_t>& lengths, int64_t step) {
  model.eval();
  std::vector<EvalResult> out;
  for (const int64_t L : lengths) {
    const auto [loss, acc] =
        evaluate_set(model, tasks::grid2d_eval_set(g, seed, tasks::grid2d_side(L)));
    out.push_back({step, L, loss, acc, std::exp(loss)});
  }
  model.train();
  return out;
}

constexpr const char* kCsvHeader =
    "step,split,length,loss,accuracy,perplexity,lr,grad_norm,tokens_per_s,elapsed_s";

}  // namespace

RunResult run_grid2d_training(const TrainConfig& c, const RunOptions& o) {
  // ---- setup: everything that can fail on bad input fails here
  c.validate();
  if (o.replicas.world > 1)
    throw InputError("task.kind = grid2d trains in one process (no data parallel)");
  const int threads = configure_threads(c);
  const auto g = grid2d_task_config(c);
  tasks::Grid2dTrainStream stream(g, c.seed);
  torch::manual_seed(static_cast<uint64_t>(c.seed));  // the model's initialisation
  models::Grid2dNet model(grid2d_model_config(c));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(c.optim.lr)
                                                   .betas({c.optim.beta1, c.optim.beta2})
                                                   .eps(c.optim.eps)
                                                   .weight_decay(c.optim.weight_decay));
  fs::create_directories(o.out);
  write_file_atomic(o.out / "config.toml", c.to_toml());

  // ---- the loop
  const auto params = model->parameters();
  const auto t0 = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<std::string> rows;
  RunResult result;
  double loss_sum = 0, grad_norm = 0;
  int64_t loss_count = 0, tokens = 0;
  model->train();
  for (int64_t step = 0; step < c.optim.steps; ++step) {
    const double lr = learning_rate(c.optim, step);
    for (auto& group : opt.param_groups()) group.options().set_lr(lr);
    const auto batch = to_tensors(stream.next(c.optim.batch));
    const auto loss = loss_of(model->forward(batch.tokens), batch.labels);
    opt.zero_grad();
    loss.backward();
    grad_norm = c.optim.clip > 0 ? torch::nn::utils::clip_grad_norm_(params, c.optim.clip) : 0.0;
    opt.step();
    loss_sum += loss.item<double>();
    ++loss_count;
    tokens += batch.tokens.numel();
    const int64_t done = step + 1;
    const bool last = done == c.optim.steps;
    if (done % c.log_every == 0 || last) {
      const double tps = static_cast<double>(tokens) / std::max(elapsed(), 1e-9);
      rows.push_back(fmt::format("{},train,{},{:.9g},,,{:.9g},{:.6g},{:.1f},{:.3f}", done,
                                 c.task.train_length, loss_sum / loss_count, lr, grad_norm, tps,
                                 elapsed()));
      if (o.progress)
        fmt::print(stderr, "step {}/{}  loss {:.4f}  {:.0f} cells/s\n", done, c.optim.steps,
                   loss_sum / loss_count, tps);
      loss_sum = 0;
      loss_count = 0;
    }
    if ((c.eval.every > 0 && done % c.eval.every == 0) || last) {
      const auto ev = evaluate(*model, g, c.seed, c.eval.lengths, done);
      for (const auto& e : ev)
        rows.push_back(fmt::format("{},eval,{},{:.9g},{:.9g},{:.9g},,,,{:.3f}", e.step, e.length,
                                   e.loss, e.accuracy, e.perplexity, elapsed()));
      if (last) result.final_eval = ev;
    }
  }
  result.steps = c.optim.steps;
  result.wall_s = elapsed();
  result.tokens_per_s = static_cast<double>(tokens) / std::max(result.wall_s, 1e-9);
  result.parameters = model->parameter_count();

  // ---- the trained model: translated grid, equivariance (float32, then float64)
  model->eval();
  const auto train_set = tasks::grid2d_eval_set(g, c.seed, g.side);
  const auto [shift_loss, shift_acc] =
      evaluate_set(*model, train_set, c.task.eval_offset[0], c.task.eval_offset[1]);
  const auto probe = to_tensors(train_set.front()).tokens;
  const auto& s = c.task.equivariance_shift;
  const auto eq32 = grid2d_equivariance(*model, probe, g.side, s[0], s[1]);
  {
    std::string csv = std::string(kCsvHeader) + "\n";
    for (const auto& r : rows) csv += r + "\n";
    write_file_atomic(o.out / "metrics.csv", csv);
    torch::serialize::OutputArchive archive;
    model->save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    fs::create_directories(o.out / "checkpoints");
    write_checked_file(o.out / "checkpoints" / "last.pt", bytes.str());
  }
  // how far the learned bases moved from U = I (structured; 0 for the others)
  double basis_dev = 0;
  for (auto& b : model->blocks())
    if (const auto U = b->learned_basis(); U.defined())
      basis_dev =
          std::max(basis_dev, (U - torch::eye(U.size(-1), U.options())).abs().max().item<double>());
  model->to(torch::kDouble);
  const auto eq64 = grid2d_equivariance(*model, probe, g.side, s[0], s[1]);

  nlohmann::json j;
  j["name"] = c.name;
  j["task"] = "grid2d";
  j["mechanism"] = c.model.mechanism;
  j["seed"] = c.seed;
  j["steps"] = result.steps;
  j["parameters"] = result.parameters;
  j["wall_s"] = result.wall_s;
  j["tokens_per_s"] = result.tokens_per_s;
  j["threads"] = threads;
  j["workers"] = 1;
  nlohmann::json ev = nlohmann::json::array();
  for (const auto& e : result.final_eval)
    ev.push_back({{"length", e.length},
                  {"loss", e.loss},
                  {"accuracy", e.accuracy},
                  {"perplexity", e.perplexity}});
  j["final_eval"] = ev;
  j["extra"] = {{"accuracy_shifted", shift_acc},    {"loss_shifted", shift_loss},
                {"equivariance_rel_f32", eq32.rel}, {"equivariance_abs_f32", eq32.max_abs},
                {"equivariance_rel_f64", eq64.rel}, {"max_abs_logit", eq32.max_logit},
                {"basis_max_dev", basis_dev},       {"eval_offset", c.task.eval_offset},
                {"equivariance_shift", s}};
  write_file_atomic(o.out / "summary.json", j.dump(2) + "\n");
  return result;
}

}  // namespace relpos::train
