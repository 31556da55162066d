#include "train/grid2d_train.hpp"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

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

// The 2-D grid task as the training loop takes it: targets are the cells' labels (2 classes).
class Grid2dTask : public Task {
 public:
  explicit Grid2dTask(const TrainConfig& c)
      : g_(grid2d_task_config(c)), seed_(c.seed), stream_(g_, c.seed) {}
  int64_t vocab() const override { return tasks::kGrid2dVocab; }
  int64_t classes() const override { return 2; }
  bool language_model() const override { return false; }
  Batch next_train_batch(int64_t batch) override {
    const auto t = to_tensors(stream_.next(batch));
    return {t.tokens, t.labels};
  }
  std::vector<Batch> eval_set(int64_t length) override {
    std::vector<Batch> out;
    for (const auto& b : tasks::grid2d_eval_set(g_, seed_, tasks::grid2d_side(length))) {
      const auto t = to_tensors(b);
      out.push_back({t.tokens, t.labels});
    }
    return out;
  }

 private:
  tasks::Grid2dConfig g_;
  int64_t seed_;
  tasks::Grid2dTrainStream stream_;
};

// The grid model: every parameter decays (the experiment's protocol); the summary's "extra" holds
// the trained model's checks on the training grid's evaluation set (header comment).
class Grid2dModel : public TrainModel {
 public:
  explicit Grid2dModel(const TrainConfig& c) : c_(c), model_(grid2d_model_config(c)) {}
  torch::nn::Module& module() override { return *model_; }
  torch::Tensor forward(const torch::Tensor& tokens) override { return model_->forward(tokens); }
  std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> decay_groups() override {
    return {model_->parameters(), {}};
  }
  int64_t parameter_count() override { return model_->parameter_count(); }
  void summarize(nlohmann::json& s) override {
    const auto g = grid2d_task_config(c_);
    model_->eval();
    const auto train_set = tasks::grid2d_eval_set(g, c_.seed, g.side);
    const auto [shift_loss, shift_acc] =
        evaluate_set(*model_, train_set, c_.task.eval_offset[0], c_.task.eval_offset[1]);
    const auto probe = to_tensors(train_set.front()).tokens;
    const auto& sh = c_.task.equivariance_shift;
    const auto eq32 = grid2d_equivariance(*model_, probe, g.side, sh[0], sh[1]);
    // how far the learned bases moved from U = I (a learned basis; 0 for the others)
    double basis_dev = 0;
    for (auto& b : model_->blocks())
      if (const auto U = b->learned_basis(); U.defined())
        basis_dev = std::max(basis_dev,
                             (U - torch::eye(U.size(-1), U.options())).abs().max().item<double>());
    model_->to(torch::kDouble);
    const auto eq64 = grid2d_equivariance(*model_, probe, g.side, sh[0], sh[1]);
    s["task"] = "grid2d";
    s["extra"] = {{"accuracy_shifted", shift_acc},    {"loss_shifted", shift_loss},
                  {"equivariance_rel_f32", eq32.rel}, {"equivariance_abs_f32", eq32.max_abs},
                  {"equivariance_rel_f64", eq64.rel}, {"max_abs_logit", eq32.max_logit},
                  {"basis_max_dev", basis_dev},       {"eval_offset", c_.task.eval_offset},
                  {"equivariance_shift", sh}};
  }

 private:
  TrainConfig c_;
  models::Grid2dNet model_;
};

}  // namespace

std::unique_ptr<Task> grid2d_task(const TrainConfig& c) {
  return std::make_unique<Grid2dTask>(c);
}

std::unique_ptr<TrainModel> grid2d_model(const TrainConfig& c) {
  return std::make_unique<Grid2dModel>(c);
}

}  // namespace relpos::train
