// The training harness: configuration parsing with named errors, the learning-rate schedule, a
// tiny query-LM run end to end (files, resume after the end, reproducibility), sweeps.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/types.hpp"
#include "train/config.hpp"
#include "train/reproduce.hpp"
#include "train/sweep.hpp"
#include "train/trainer.hpp"

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

fs::path temp_dir(const std::string& name) {
  const auto d =
      fs::temp_directory_path() / ("relpos-test-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A query-LM small enough for a test: 1 layer, d 32, T 24, 8 steps.
train::TrainConfig tiny(const std::string& mechanism = "jordan(m=2, regime=raw)") {
  train::TrainConfig c;
  c.name = "tiny";
  c.threads = 1;
  c.model.d_model = 32;
  c.model.heads = 2;
  c.model.layers = 1;
  c.model.mechanism = mechanism;
  c.task.train_length = 24;
  c.optim.steps = 8;
  c.optim.batch = 4;
  c.optim.lr = 3e-3;
  c.eval.every = 4;
  c.eval.lengths = {24, 48};
  c.eval.batches = 3;
  c.eval.batch_size = 2;
  c.checkpoint_every = 4;
  c.log_every = 2;
  return c;
}

}  // namespace

TEST(TrainConfig, ParsesOverridesAndRoundTrips) {
  auto c = train::parse_config(R"(
name = "t5"
seed = 2
[model]
mechanism = "rope"
d_model = 64
heads = 2
[optim]
lr = 1e-3
[eval]
lengths = [64, 128]
)",
                               "test.toml");
  EXPECT_EQ(c.name, "t5");
  EXPECT_EQ(c.seed, 2);
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-3);
  EXPECT_EQ(c.eval.lengths, (std::vector<int64_t>{64, 128}));
  train::apply_override(c, "model.mechanism=jordan(m=2, regime=raw)");
  train::apply_override(c, "optim.steps=7");
  train::apply_override(c, "model.preset=pj");
  EXPECT_EQ(c.model.mechanism, "jordan(m=2, regime=raw)");
  EXPECT_EQ(c.optim.steps, 7);
  EXPECT_EQ(c.model.preset, models::Preset::PJ);
  const auto back = train::parse_config(c.to_toml(), "round trip");
  EXPECT_EQ(back.to_toml(), c.to_toml());
}

TEST(TrainConfig, BadConfigsNameTheProblem) {
  EXPECT_NE(error_of([] {
              train::parse_config("[optim]\nlearning_rate = 1", "a.toml");
            }).find("unknown key 'optim.learning_rate'"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              train::parse_config("seed = \"x\"", "a.toml");
            }).find("'seed' must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of([] { train::parse_config("seed = ", "a.toml"); }).find("a.toml:1"),
            std::string::npos);
  EXPECT_NE(error_of([] { train::load_config("/nonexistent/x.toml"); }).find("does not exist"),
            std::string::npos);
  auto c = tiny();
  c.model.d_model = 33;
  EXPECT_NE(error_of([&] { c.validate(); }).find("not divisible"), std::string::npos);
  c = tiny();
  c.task.kind = "bytes";
  EXPECT_NE(error_of([&] { c.validate(); }).find("needs task.path"), std::string::npos);
  c.task.path = "/nonexistent/file.txt";
  train::RunOptions o;
  o.out = temp_dir("badpath");
  o.progress = false;
  EXPECT_NE(error_of([&] { train::run_training(c, o); }).find("/nonexistent/file.txt"),
            std::string::npos);
  c = tiny();
  c.eval.lengths = {int64_t{1} << 22};
  c.eval.batch_size = 1 << 20;
  EXPECT_NE(error_of([&] { train::run_training(c, o); }).find("GB of activations"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(o.out / "metrics.csv"));  // nothing trained
}

TEST(TrainConfig, PjQueryLmKeysRoundTripAndBadOnesAreNamed) {
  const auto c = train::parse_config(
      "[task]\nkind = \"pj_query_lm\"\ntarget = \"lc_core\"\nteacher = \"attention\"\n"
      "teacher_lambda = 8\nmedian_threshold = true\ntrain_lengths = [48, 96]\n"
      "length_sampling = \"random\"\ntrain_length = 96\n",
      "a.toml");
  c.validate();
  const auto back = train::parse_config(c.to_toml(), "config.toml");
  EXPECT_EQ(back.task.target, "lc_core");
  EXPECT_EQ(back.task.teacher, "attention");
  EXPECT_EQ(back.task.teacher_lambda, 8.0);
  EXPECT_TRUE(back.task.median_threshold);
  EXPECT_EQ(back.task.train_lengths, (std::vector<int64_t>{48, 96}));
  EXPECT_EQ(back.task.length_sampling, "random");
  auto bad = c;
  bad.task.teacher = "hinge";
  EXPECT_NE(error_of([&] { bad.validate(); }).find("task.teacher must be signed or attention"),
            std::string::npos);
  bad = c;
  bad.task.target = "fourth_jet";
  EXPECT_NE(error_of([&] { bad.validate(); }).find("task.target must be one of phase, first_jet"),
            std::string::npos);
  bad = c;
  bad.task.length_sampling = "shuffle";
  EXPECT_NE(error_of([&] { bad.validate(); }).find("task.length_sampling"), std::string::npos);
  bad = c;
  bad.task.kind = "query_lm";
  EXPECT_NE(error_of([&] { bad.validate(); }).find("task.train_lengths (multi-length training)"),
            std::string::npos);
  bad = c;
  bad.task.train_lengths = {48, 1};
  EXPECT_NE(error_of([&] { bad.validate(); }).find("task.train_lengths[]"), std::string::npos);
  EXPECT_NE(error_of([] {
              train::parse_config("[task]\ntrain_lengths = [48, \"x\"]", "a.toml");
            }).find("'task.train_lengths' must be an array of integers"),
            std::string::npos);
}

TEST(TrainSchedule, WarmupThenCosine) {
  train::OptimConfig o;
  o.steps = 101;
  o.lr = 1.0;
  o.warmup = 10;
  o.schedule = "cosine";
  o.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(train::learning_rate(o, 0), 0.1);
  EXPECT_DOUBLE_EQ(train::learning_rate(o, 9), 1.0);
  EXPECT_DOUBLE_EQ(train::learning_rate(o, 10), 1.0);
  EXPECT_NEAR(train::learning_rate(o, 100), 0.1, 1e-12);
  o.schedule = "constant";
  EXPECT_DOUBLE_EQ(train::learning_rate(o, 50), 1.0);
}

TEST(TrainRun, TinyQueryLmWritesFilesAndIsReproducible) {
  const auto dir = temp_dir("tiny");
  train::RunOptions o;
  o.out = dir / "a";
  o.progress = false;
  const auto c = tiny();
  const auto a = train::run_training(c, o);
  ASSERT_EQ(a.final_eval.size(), 2u);
  for (const auto& e : a.final_eval) EXPECT_TRUE(std::isfinite(e.loss));
  for (const char* f : {"config.toml", "metrics.csv", "summary.json", "checkpoints/last.pt"})
    EXPECT_TRUE(fs::exists(o.out / f)) << f;
  // the same seed again gives the same numbers
  o.out = dir / "b";
  const auto b = train::run_training(c, o);
  EXPECT_EQ(a.final_eval[1].loss, b.final_eval[1].loss);
  // resuming a finished run changes nothing
  o.resume = true;
  const auto again = train::run_training(c, o);
  EXPECT_EQ(again.final_eval[1].loss, b.final_eval[1].loss);
  EXPECT_EQ(train::evaluate_run(dir / "a", {24})[0].loss, a.final_eval[0].loss);
  // the q/k norm profile: one row per layer and position
  const auto profile = train::qk_profile_csv(dir / "a", 48);
  EXPECT_NE(profile.find("\n0,47,"), std::string::npos);
  EXPECT_EQ(profile.find("\n0,48,"), std::string::npos);
}

TEST(TrainRun, PjBridgeSmokeRunThreeSteps) {
  // the bridge's setting in miniature: frozen q/k, strictly causal, a PJ bias, lengths cycled
  auto c = tiny("pj_bias(R=3, sectors=fj/affine/lc, L=24, gates=fj, orders=r1, slope0=0.4)");
  c.model.preset = models::Preset::PJ;
  c.model.freeze_qk = true;
  c.model.include_self = false;
  c.task.kind = "pj_query_lm";
  c.task.target = "first_jet";
  c.task.median_threshold = true;
  c.task.train_lengths = {12, 24};
  c.optim.steps = 3;
  c.optim.batch = 8;
  c.optim.clip = 0;
  c.eval.every = 0;
  c.eval.lengths = {24, 48};
  c.eval.batch_size = 8;
  const auto dir = temp_dir("pjbridge");
  train::RunOptions o;
  o.out = dir / "a";
  o.progress = false;
  const auto a = train::run_training(c, o);
  ASSERT_EQ(a.final_eval.size(), 2u);
  for (const auto& e : a.final_eval) {
    EXPECT_TRUE(std::isfinite(e.loss));
    // balanced labels: near chance after 3 steps, never all right or all wrong by construction
    EXPECT_GE(e.accuracy, 0.0);
    EXPECT_LE(e.accuracy, 1.0);
  }
  // tokens of the cycled lengths 12, 24, 12
  EXPECT_NEAR(a.tokens_per_s * a.wall_s, 8.0 * (12 + 24 + 12), 1e-6 * 8 * 48);
  o.out = dir / "b";
  EXPECT_EQ(train::run_training(c, o).final_eval[1].loss, a.final_eval[1].loss);
  // freeze_qk with no bias is uniform attention over the strict past: every sequence's query row
  // averages the bits, which is still a valid (weak) classifier
  c.model.mechanism = "nope";
  o.out = dir / "nope";
  EXPECT_TRUE(std::isfinite(train::run_training(c, o).final_eval[0].loss));
}

TEST(TrainRun, ResumeFromAMidRunCheckpointEndsTheSame) {
  // stop after 4 of 8 steps (a run configured for 4 steps writes the same checkpoint at step 4
  // with a constant learning rate), then continue to 8
  const auto dir = temp_dir("resume");
  train::RunOptions o;
  o.progress = false;
  o.out = dir / "full";
  const auto full = train::run_training(tiny(), o);
  auto half = tiny();
  half.optim.steps = 4;
  o.out = dir / "split";
  train::run_training(half, o);
  o.resume = true;
  const auto resumed = train::run_training(tiny(), o);
  ASSERT_EQ(resumed.final_eval.size(), full.final_eval.size());
  for (size_t i = 0; i < full.final_eval.size(); ++i)
    EXPECT_EQ(resumed.final_eval[i].loss, full.final_eval[i].loss);
}

TEST(TrainSweep, MethodsTimesSeedsWithSkipOfFinishedRuns) {
  const auto dir = temp_dir("sweep");
  auto c = tiny();
  c.optim.steps = 2;
  c.eval.every = 0;
  c.eval.lengths = {24};
  std::ofstream(dir / "sweep.toml")
      << c.to_toml() << "\n[sweep]\nmethods = [\"nope\", \"rope + alibi\"]\nseeds = [0, 1]\n";
  const auto md = train::run_sweep(dir / "sweep.toml", {}, (dir / "out").string(), false);
  EXPECT_NE(md.find("| rope + alibi |"), std::string::npos) << md;
  EXPECT_TRUE(fs::exists(dir / "out" / "rope_alibi" / "s1" / "summary.json"));
  EXPECT_TRUE(fs::exists(dir / "out" / "summary.md"));
  EXPECT_TRUE(fs::exists(dir / "out" / "loss_curves.csv"));
  EXPECT_TRUE(fs::exists(dir / "out" / "length_curves.gp"));
  // a second call skips every finished run (their summaries are left untouched)
  const auto t = fs::last_write_time(dir / "out" / "nope" / "s0" / "summary.json");
  train::run_sweep(dir / "sweep.toml", {}, (dir / "out").string(), false);
  EXPECT_EQ(fs::last_write_time(dir / "out" / "nope" / "s0" / "summary.json"), t);
  EXPECT_EQ(train::method_folder("jordan(m=2, regime=raw)"), "jordan_m_2_regime_raw");
}

TEST(TrainExperiments, PaperScaleConfigsBuildThePapersModelsAndTrainAFewSteps) {
  const auto dir = temp_dir("experiments");
  for (const std::string name :
       {"jordan-t5", "jordan-t10", "jordan-t10-third"}) {  // synthetic data
    SCOPED_TRACE(name);
    EXPECT_FALSE(train::experiment_configs(name, "cpu", {}).empty());
    std::set<std::string> seen;
    for (auto c : train::experiment_configs(name, "paper", {})) {
      if (!seen.insert(c.model.mechanism).second) continue;  // one seed per method
      SCOPED_TRACE(c.model.mechanism);
      // the paper's model (jordan-rope.md 2.3) ...
      EXPECT_EQ(c.model.layers, 3);
      EXPECT_EQ(c.model.heads, 4);
      EXPECT_EQ(c.model.d_model, name == "jordan-t5" ? 128 : 192);
      // ... trained for two steps on short sequences
      c.threads = 1;
      c.task.train_length = 32;
      c.optim.steps = 2;
      c.optim.batch = 2;
      c.eval.every = 0;
      c.eval.lengths = {32};
      c.eval.batches = 1;
      train::RunOptions o;
      o.out = dir / c.name;
      o.progress = false;
      const auto r = train::run_training(c, o);
      EXPECT_TRUE(std::isfinite(r.final_eval[0].loss));
      EXPECT_GT(r.parameters, name == "jordan-t5" ? 390000 : 880000);
    }
    EXPECT_GE(seen.size(), 7u);
  }
  // the PJ-RoPE synthetic bridge (pj-rope.md 3.3, 3.6): one file per target
  for (const std::string name :
       {"pj-bridge", "pj-bridge-second-jet", "pj-bridge-third-jet", "pj-bridge-lc-core"}) {
    SCOPED_TRACE(name);
    const auto cpu = train::experiment_configs(name, "cpu", {});
    const auto paper = train::experiment_configs(name, "paper", {});
    ASSERT_EQ(cpu.size(), paper.size());  // the full protocol fits 2 cores
    EXPECT_EQ(paper.size() % 3, 0u);
    for (const auto& c : paper) {
      EXPECT_EQ(c.task.kind, "pj_query_lm");
      EXPECT_EQ(c.task.teacher, "signed");
      EXPECT_TRUE(c.task.median_threshold);
      EXPECT_EQ(c.task.train_lengths, (std::vector<int64_t>{48, 96}));
      EXPECT_EQ(c.task.train_length, 96);
      EXPECT_TRUE(c.model.freeze_qk);
      EXPECT_FALSE(c.model.include_self);
      EXPECT_EQ(c.model.d_model, 96);
      EXPECT_EQ(c.model.heads, 4);
      EXPECT_EQ(c.model.layers, 2);
      EXPECT_EQ(c.optim.steps, 350);
      EXPECT_EQ(c.optim.batch, 96);
      EXPECT_EQ(c.optim.clip, 0.0);
      EXPECT_EQ(c.eval.lengths, (std::vector<int64_t>{96, 192, 384}));
      EXPECT_EQ(c.eval.batches, 8);
    }
    // the model: 150,242 parameters without PJ in the reference (Linear(E, 2) head); ours scores
    // 2 of 3 head rows, 97 more
    auto c = paper.front();
    ASSERT_EQ(c.model.mechanism, "nope");
    c.model.vocab = 3;
    EXPECT_EQ(models::TransformerLM(c.model)->parameter_count(), 150242 + 97);
  }

  EXPECT_NE(error_of([] { train::experiment_configs("no-such-table", "cpu", {}); }).find("known:"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { train::experiment_configs("jordan-t5", "tpu", {}); }).find("no scale 'tpu'"),
      std::string::npos);
}
