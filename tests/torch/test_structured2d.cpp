// The structured-2d experiment (issue 15, item 5): the 2-D grid task, the vector-position
// rotations of models/grid2d.hpp (axial RoPE, mixed RoPE, the learned-basis structured rotation)
// against a hand-written rotation, translation invariance of a whole model's logits, and a short
// training run.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <set>

#include "core/registry.hpp"
#include "core/types.hpp"
#include "models/grid2d.hpp"
#include "torch/mechanisms/content_runtime.hpp"
#include "tasks/grid2d.hpp"
#include "train/config.hpp"
#include "train/grid2d_train.hpp"
#include "train/reproduce.hpp"

using namespace relpos;
namespace fs = std::filesystem;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

models::Grid2dModelConfig small(const std::string& mechanism) {
  models::Grid2dModelConfig c;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 2;
  c.mechanism = mechanism;
  return c;
}

}  // namespace

TEST(Structured2d, TaskIsDeterministicBalancedAndTheTeachersSum) {
  tasks::Grid2dConfig g;
  tasks::Grid2dTrainStream a(g, 3), b(g, 3), other(g, 4);
  const auto x = a.next(16), y = b.next(16), z = other.next(16);
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.labels, y.labels);
  EXPECT_NE(x.tokens, z.tokens);
  const auto e1 = tasks::grid2d_eval_set(g, 1, 12), e2 = tasks::grid2d_eval_set(g, 1, 12);
  ASSERT_EQ(e1.size(), static_cast<size_t>(g.eval_batches));
  EXPECT_EQ(e1.back().tokens, e2.back().tokens);
  EXPECT_EQ(e1.back().side, 12);

  // labels balanced: 200 grids of 64 cells (K even, K(0) = 0: P[label] = 1/2 by symmetry)
  double ones = 0;
  const auto many = a.next(200);
  for (auto l : many.labels) ones += static_cast<double>(l);
  EXPECT_NEAR(ones / static_cast<double>(many.labels.size()), 0.5, 0.03);

  // one cell's score by hand
  const tasks::Grid2dTeacher teacher(g);
  const int64_t side = 8, i = 2 * side + 5;
  double s = 0;
  for (int64_t j = 0; j < side * side; ++j)
    s += static_cast<double>(2 * x.tokens[j] - 1) *
         std::exp(-((j / side - 2) * (j / side - 2) + (j % side - 5) * (j % side - 5)) / 8.0) *
         (j == i ? 0.0
                 : std::cos(1.1 * (static_cast<double>(j / side - 2) *
                                       std::cos(35 * std::numbers::pi / 180) +
                                   static_cast<double>(j % side - 5) *
                                       std::sin(35 * std::numbers::pi / 180))));
  EXPECT_NEAR(x.scores[i], s, 1e-12);
  EXPECT_EQ(x.labels[i], s > 0 ? 1 : 0);
  EXPECT_EQ(teacher.kernel(0, 0), 0.0);
  EXPECT_EQ(teacher.kernel(1.5, -2), teacher.kernel(-1.5, 2));

  EXPECT_NE(error_of([] { tasks::grid2d_side(63); }).find("square grid"), std::string::npos);
  EXPECT_EQ(tasks::grid2d_side(144), 12);
  auto bad = g;
  bad.teacher = "round";
  EXPECT_NE(error_of([&] { tasks::Grid2dTeacher t(bad); }).find("unknown teacher 'round'"),
            std::string::npos);
}

// The grid model's mechanisms are catalog specs turned by their rotation runtime: axial RoPE on
// the half-split planes equals a hand-written rotation, and the learned-basis and mixed forms with
// the axial lambda (and W = 0, U = I) are the same map.
TEST(Structured2d, AxialRotationMatchesAHandWrittenOneAndUIsTheIdentityAtInit) {
  torch::manual_seed(0);
  const int64_t H = 2, D = 8, T = 5;
  const double theta = 100;
  const auto turn = [&](const std::string& spec, const std::vector<torch::Tensor>& params,
                        const torch::Tensor& x, const torch::Tensor& pos) {
    const Mechanism m = build_mechanism(spec, D, H);
    return nn::rotate_learned(*m.structured_term(), params,
                              {{}, x, x, pos, {}, Layout::HalfSplit, {}})
        .k;
  };
  const auto x = torch::randn({1, H, T, D}, torch::kDouble);
  const auto pos = torch::randn({T, 2}, torch::kDouble) * 5;
  const auto y = turn("axial_rope", {}, x, pos);
  auto want = x.clone();
  const auto xa = x.accessor<double, 4>();
  auto wa = want.accessor<double, 4>();
  const auto pa = pos.accessor<double, 2>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t u = 0; u < D / 2; ++u) {
        // planes 0, 1 turn with the row at 1, theta^(-1/2); planes 2, 3 with the column
        const double w = std::pow(theta, -static_cast<double>(u % 2) / 2.0);
        const double phi = (u < 2 ? pa[t][0] : pa[t][1]) * w;
        const double a = xa[0][h][t][u], b = xa[0][h][t][u + D / 2];
        wa[0][h][t][u] = a * std::cos(phi) - b * std::sin(phi);
        wa[0][h][t][u + D / 2] = a * std::sin(phi) + b * std::cos(phi);
      }
  EXPECT_LT((y - want).abs().max().item<double>(), 1e-14);

  // the learned-basis rotation with W = 0 (its initialisation) and the axial lambda is the same
  // map, and so is mixed RoPE with the axial lambda
  auto lambda = torch::zeros({H, 2, D / 2}, torch::kDouble);
  for (int64_t u = 0; u < D / 2; ++u)
    lambda.select(1, u < 2 ? 0 : 1).select(1, u).fill_(std::pow(theta, -(u % 2) / 2.0));
  EXPECT_LT((turn("structured", {lambda, torch::zeros({H, D, D}, torch::kDouble)}, x, pos) - want)
                .abs()
                .max()
                .item<double>(),
            1e-14);
  EXPECT_LT((turn("mixed_rope", {lambda}, x, pos) - want).abs().max().item<double>(), 1e-14);

  // a mechanism of scalar positions, or of 3-D ones, is refused by name
  EXPECT_NE(error_of([] { small("rope").validate(); }).find("2-D vector positions"),
            std::string::npos);
  EXPECT_NE(error_of([] { small("structured(dims=3)").validate(); }).find("2-D vector positions"),
            std::string::npos);
  EXPECT_NE(error_of([] { small("axial_rope(base=3)").validate(); }).find("axial_rope"),
            std::string::npos);
}

TEST(Structured2d, LogitsAreInvariantToATranslationOfAllPositions) {
  for (const std::string mech : {"axial_rope", "mixed_rope", "structured", "nope"}) {
    SCOPED_TRACE(mech);
    torch::manual_seed(1);
    models::Grid2dNet net(small(mech));
    if (mech == "structured") {  // a basis away from the identity, exercising Cayley(W - W^T)
      torch::NoGradGuard no_grad;
      for (auto& b : net->blocks()) b->attention()->named_parameters()["basis_w"].normal_(0, 0.5);
      ASSERT_GT((net->blocks()[0]->learned_basis() - torch::eye(8)).abs().max().item<double>(),
                0.1);
    }
    net->eval();
    const auto tokens = torch::randint(0, 2, {3, 36}, torch::kLong);
    const auto e32 = train::grid2d_equivariance(*net, tokens, 6, 3.5, -7);
    // positions matter for the rotary models: a non-uniform change of positions moves the logits
    torch::NoGradGuard no_grad;
    const double moved =
        (net->forward(tokens, models::grid2d_positions(6) * 2) - net->forward(tokens))
            .abs()
            .max()
            .item<double>();
    if (mech == "nope") {
      EXPECT_EQ(e32.max_abs, 0.0);
      EXPECT_EQ(moved, 0.0);
    } else {
      EXPECT_LT(e32.rel, 1e-5);
      EXPECT_GT(moved, 1e-3);
    }
    net->to(torch::kDouble);
    const auto e64 = train::grid2d_equivariance(*net, tokens, 6, 3.5, -7);
    EXPECT_LT(e64.rel, 1e-12);
    EXPECT_GT(e64.max_logit, 1e-3);
  }
}

TEST(Structured2d, ThirtyTrainingStepsReduceTheLoss) {
  const auto dir =
      fs::temp_directory_path() / ("relpos-test-structured2d-" + std::to_string(getpid()));
  fs::remove_all(dir);
  train::TrainConfig c = train::parse_config(
      "name = \"s2d\"\nthreads = 1\nlog_every = 10\n"
      "[model]\nd_model = 16\nheads = 2\nlayers = 1\nmechanism = \"structured\"\n"
      "[task]\nkind = \"grid2d\"\nbenchmark = \"oblique\"\ntrain_length = 36\n"
      "eval_offset = [10, -3.5]\n"
      "[optim]\nsteps = 30\nbatch = 16\nlr = 1e-2\n"
      "[eval]\nevery = 0\nlengths = [36, 64]\nbatches = 2\nbatch_size = 8\n",
      "s2d.toml");
  c.validate();
  const auto back = train::parse_config(c.to_toml(), "config.toml");
  EXPECT_EQ(back.task.eval_offset, (std::vector<double>{10, -3.5}));
  train::RunOptions o;
  o.out = dir;
  o.progress = false;
  const auto r = train::run_training(c, o);
  ASSERT_EQ(r.final_eval.size(), 2u);
  std::ifstream in(dir / "metrics.csv");
  std::string line;
  std::vector<double> losses;
  while (std::getline(in, line))
    if (line.find(",train,") != std::string::npos) {
      const auto f = line.find(",train,") + 7;
      const auto comma = line.find(',', f);
      losses.push_back(std::stod(line.substr(comma + 1)));
    }
  ASSERT_EQ(losses.size(), 3u);
  EXPECT_LT(losses.back(), losses.front());
  std::ifstream js(dir / "summary.json");
  const auto s = nlohmann::json::parse(js);
  EXPECT_LT(s["extra"]["equivariance_rel_f32"].get<double>(), 1e-5);
  EXPECT_LT(s["extra"]["equivariance_rel_f64"].get<double>(), 1e-12);
  EXPECT_TRUE(s["extra"].contains("accuracy_shifted"));
  EXPECT_TRUE(fs::exists(dir / "checkpoints" / "last.pt"));
  fs::remove_all(dir);

  // bad configurations name the key
  auto bad = c;
  bad.eval.lengths = {36, 50};
  EXPECT_NE(error_of([&] { bad.validate(); }).find("eval.lengths[]"), std::string::npos);
  bad = c;
  bad.task.equivariance_shift = {1.0};
  EXPECT_NE(error_of([&] { bad.validate(); }).find("task.equivariance_shift"), std::string::npos);
  bad = c;
  bad.model.mechanism = "rope";
  EXPECT_NE(error_of([&] { bad.validate(); }).find("2-D vector positions"), std::string::npos);
  bad = c;
  bad.task.benchmark = "mixed_raw";
  EXPECT_NE(error_of([&] { bad.validate(); }).find("task.benchmark"), std::string::npos);
}

TEST(Structured2d, TheExperimentRunsFourMethodsTimesThreeSeeds) {
  const auto configs = train::experiment_configs("structured-2d", "", {});
  ASSERT_EQ(configs.size(), 12u);
  std::set<std::string> methods;
  for (const auto& c : configs) {
    EXPECT_EQ(c.task.kind, "grid2d");
    methods.insert(c.model.mechanism);
  }
  EXPECT_EQ(methods, (std::set<std::string>{"axial_rope", "mixed_rope", "structured", "nope"}));
}

// The grid task trains in the one training loop (train/trainer.cpp): a run stopped at its step-10
// checkpoint and resumed to step 20 ends with the same final metrics, bit for bit, as one
// uninterrupted run (constant learning rate, so the stop's shorter schedule changes nothing).
TEST(Structured2d, GridRunsResumeFromTheirCheckpoints) {
  const auto base =
      fs::temp_directory_path() / ("relpos-test-structured2d-resume-" + std::to_string(getpid()));
  fs::remove_all(base);
  const auto config = [](int64_t steps) {
    return train::parse_config(
        fmt::format("name = \"s2d\"\nthreads = 1\nlog_every = 5\ncheckpoint_every = 10\n"
                    "[model]\nd_model = 16\nheads = 2\nlayers = 1\nmechanism = \"structured\"\n"
                    "[task]\nkind = \"grid2d\"\nbenchmark = \"oblique\"\ntrain_length = 36\n"
                    "[optim]\nsteps = {}\nbatch = 8\nlr = 1e-2\nschedule = \"constant\"\n"
                    "[eval]\nevery = 0\nlengths = [36]\nbatches = 2\nbatch_size = 4\n",
                    steps),
        "s2d.toml");
  };
  train::RunOptions o;
  o.progress = false;
  o.out = base / "straight";
  const auto straight = train::run_training(config(20), o);
  o.out = base / "stopped";
  train::run_training(config(10), o);
  o.resume = true;
  const auto resumed = train::run_training(config(20), o);
  ASSERT_EQ(resumed.final_eval.size(), 1u);
  EXPECT_EQ(resumed.steps, 20);
  EXPECT_EQ(resumed.final_eval[0].loss, straight.final_eval[0].loss);
  EXPECT_EQ(resumed.final_eval[0].accuracy, straight.final_eval[0].accuracy);
  const auto extra = [](const fs::path& dir) {
    std::ifstream in(dir / "summary.json");
    return nlohmann::json::parse(in)["extra"];
  };
  EXPECT_EQ(extra(base / "stopped"), extra(base / "straight"));
  fs::remove_all(base);
}
