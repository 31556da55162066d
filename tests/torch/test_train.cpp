// The training harness: configuration parsing with named errors, the learning-rate schedule, a
// tiny query-LM run end to end (files, resume after the end, reproducibility), sweeps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/files.hpp"
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

// task.kind = "midi_text": PJ-RoPE's MIDI-token text (tasks/midi_text.hpp) built from a
// MusicNet-like folder and read as bytes; its keys round-trip through config.toml; the music
// experiments (Table 4b, Table 10's music row) name it with the selectors' seeds.
TEST(TrainRun, MidiTextTaskTrainsOnAMusicnetFolder) {
  const auto dir = temp_dir("miditext");
  const auto data = dir / "musicnet";
  fs::create_directories(data / "Bach");
  std::ofstream(data / "musicnet_metadata.csv")
      << "\"id\",\"composer\",\"composition\",\"movement\",\"ensemble\",\"seconds\"\n"
         "1,\"Bach\",\"Suite\",\"1. Prelude\",\"Solo Cello\",61\n"
         "2,\"Bach\",\"Suite\",\"2. Allemande\",\"Solo Cello\",70\n";
  // format 0, 96 ticks per beat: 40 notes of 0.25 s, each on then off
  std::string events;
  for (int i = 0; i < 40; ++i) {
    const char pitch = static_cast<char>(48 + i % 24);
    events += std::string("\x00\x90", 2) + pitch + '\x40' + std::string("\x30\x80", 2) + pitch +
              std::string("\x00", 1);
  }
  events += std::string("\x00\xff\x2f\x00", 4);
  const auto len = static_cast<uint32_t>(events.size());
  const std::string smf = std::string("MThd\0\0\0\x06\0\0\0\x01\0\x60", 14) + "MTrk" +
                          static_cast<char>(len >> 24) + static_cast<char>(len >> 16) +
                          static_cast<char>(len >> 8) + static_cast<char>(len) + events;
  std::ofstream(data / "Bach/1_prelude.mid", std::ios::binary) << smf;
  std::ofstream(data / "Bach/2_allemande.mid", std::ios::binary) << smf;

  auto c = tiny("pj_bias(sectors=lc/affine, gates=affine, slope0=2, L=24)");
  c.model.preset = models::Preset::PJ;
  c.task.kind = "midi_text";
  c.task.path = data.string();
  c.task.midi_seed = 37;
  c.task.midi_max_files = 2;
  c.optim.steps = 2;
  c.eval.every = 0;
  c.eval.lengths = {24};
  c.eval.batches = 1;
  const auto back = train::parse_config(c.to_toml(), "config.toml");
  EXPECT_EQ(back.task.kind, "midi_text");
  EXPECT_EQ(back.task.midi_seed, 37);
  EXPECT_EQ(back.task.midi_max_files, 2);
  EXPECT_TRUE(back.task.midi_programs);
  EXPECT_FALSE(back.task.midi_controls);
  train::RunOptions o;
  o.out = dir / "run";
  o.progress = false;
  const auto r = train::run_training(c, o);
  EXPECT_TRUE(std::isfinite(r.final_eval.at(0).loss));
  c.task.midi_max_files = 0;
  EXPECT_NE(error_of([&] { c.validate(); }).find("task.midi_max_files"), std::string::npos);

  for (const std::string name : {"pj-t4b", "pj-t10-music"}) {
    SCOPED_TRACE(name);
    std::set<int64_t> seeds;
    for (const auto& e : train::experiment_configs(name, "cpu", {})) {
      EXPECT_EQ(e.task.kind, "midi_text");
      EXPECT_EQ(e.task.train_length, 512);
      EXPECT_TRUE(e.task.midi_programs);
      EXPECT_EQ(e.task.midi_max_files, 64);
      EXPECT_EQ(e.eval.lengths.front(), 512);
      if (e.model.mechanism.find("pj_") != std::string::npos) {
        EXPECT_NE(e.model.mechanism.find("L=512"), std::string::npos) << e.model.mechanism;
      }
      seeds.insert(e.task.midi_seed);
    }
    EXPECT_EQ(seeds, name == "pj-t4b" ? (std::set<int64_t>{29, 37}) : (std::set<int64_t>{29}));
  }
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

// A sweep's runs: two steps of tiny(), evaluated once at the end at 24.
train::TrainConfig sweep_base() {
  auto c = tiny();
  c.optim.steps = 2;
  c.eval.every = 0;
  c.eval.lengths = {24};
  return c;
}

TEST(TrainSweep, MethodsTimesSeedsWithSkipOfFinishedRuns) {
  const auto dir = temp_dir("sweep");
  const auto c = sweep_base();
  std::ofstream(dir / "sweep.toml")
      << c.to_toml()
      << "\n[sweep]\nmethods = [\"nope\", \"rope + alibi\", \"jordan(m=2, regime=raw)\"]\n"
         "seeds = [0, 1]\n";
  const auto md = train::run_sweep(dir / "sweep.toml", {}, (dir / "out").string(), false);
  EXPECT_NE(md.find("| rope + alibi |"), std::string::npos) << md;
  EXPECT_TRUE(fs::exists(dir / "out" / "rope_alibi" / "s1" / "summary.json"));
  EXPECT_TRUE(fs::exists(dir / "out" / "summary.md"));
  EXPECT_TRUE(fs::exists(dir / "out" / "loss_curves.csv"));
  EXPECT_TRUE(fs::exists(dir / "out" / "length_curves.gp"));
  EXPECT_TRUE(fs::exists(dir / "out" / "length_accuracy.gp"));
  // one accuracy per method (the mean over its two seeds) at the one length
  std::ifstream acc_in(dir / "out" / "length_accuracy.csv");
  std::string header, row;
  std::getline(acc_in, header);
  std::getline(acc_in, row);
  EXPECT_EQ(std::count(header.begin(), header.end(), ','), 3) << header;
  EXPECT_EQ(row.rfind("24,", 0), 0u) << row;
  EXPECT_EQ(std::count(row.begin(), row.end(), ','), 3) << row;
  // results.csv is RFC 4180: a method spec with commas is one quoted field
  std::ifstream csv(dir / "out" / "results.csv");
  const std::string rows((std::istreambuf_iterator<char>(csv)), std::istreambuf_iterator<char>());
  EXPECT_NE(rows.find("\n\"jordan(m=2, regime=raw)\",,0,24,"), std::string::npos) << rows;
  EXPECT_NE(rows.find("\nrope + alibi,,1,24,"), std::string::npos) << rows;
  // a second call skips every finished run (their summaries are left untouched)
  const auto t = fs::last_write_time(dir / "out" / "nope" / "s0" / "summary.json");
  train::run_sweep(dir / "sweep.toml", {}, (dir / "out").string(), false);
  EXPECT_EQ(fs::last_write_time(dir / "out" / "nope" / "s0" / "summary.json"), t);
  EXPECT_EQ(train::method_folder("jordan(m=2, regime=raw)"), "jordan_m_2_regime_raw");
}

TEST(TrainSweep, RunRecordsCarryFinishedRunsToAnotherFolderAndStaleRunsAreRefused) {
  const auto dir = temp_dir("records");
  const auto c = sweep_base();
  const auto sweep_text = [&](const train::TrainConfig& base) {
    return base.to_toml() + "\n[sweep]\nmethods = [\"nope\", \"rope\"]\nseeds = [0, 1]\n";
  };
  const std::string text = sweep_text(c);
  const auto read_text = [](const fs::path& p) {
    std::ifstream in(p);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  // a sweep that finished three of its four runs ("another machine")
  train::run_sweep_text(text, "s.toml", {}, (dir / "a").string(), false);
  fs::remove_all(dir / "a" / "rope" / "s1");
  const std::string a_rope0 = read_text(dir / "a" / "rope" / "s0" / "summary.json");
  EXPECT_NE(a_rope0.find("\"isa\""), std::string::npos);  // where it ran is recorded
  EXPECT_NE(a_rope0.find("\"cpu\""), std::string::npos);
  EXPECT_EQ(train::export_runs(dir / "a", dir / "records"), 3u);
  EXPECT_TRUE(fs::exists(dir / "records" / "RUN-RECORDS"));
  EXPECT_TRUE(fs::exists(dir / "records" / "rope" / "s0" / "metrics.csv"));
  EXPECT_FALSE(fs::exists(dir / "records" / "rope" / "s0" / "checkpoints"));
  // exporting again refreshes the records; a folder of something else is refused
  EXPECT_EQ(train::export_runs(dir / "a", dir / "records"), 3u);
  fs::create_directories(dir / "other");
  std::ofstream(dir / "other" / "notes.txt") << "mine\n";
  EXPECT_NE(error_of([&] { train::export_runs(dir / "a", dir / "other"); }).find("RUN-RECORDS"),
            std::string::npos);
  EXPECT_TRUE(fs::exists(dir / "other" / "notes.txt"));
  // a fresh folder imports the three and trains only the fourth
  const auto out =
      train::run_sweep_text(text, "s.toml", {}, (dir / "b").string(), false, 1, dir / "records");
  EXPECT_EQ(read_text(dir / "b" / "rope" / "s0" / "summary.json"), a_rope0);
  EXPECT_TRUE(fs::exists(dir / "b" / "rope" / "s1" / "checkpoints"));   // trained here
  EXPECT_FALSE(fs::exists(dir / "b" / "rope" / "s0" / "checkpoints"));  // imported
  EXPECT_FALSE(fs::exists(dir / "b" / "rope" / "s0" / "INCOMPLETE"));
  EXPECT_EQ(out.results.at("rope").at(24).size(), 2u);
  EXPECT_EQ(out.ran_on.rfind("4 run(s), all on ", 0), 0u) << out.ran_on;
  EXPECT_NE(out.markdown.find(out.ran_on), std::string::npos);
  // records of another configuration are refused, naming the key, and nothing is imported
  auto longer = c;
  longer.optim.steps = 3;
  const std::string err = error_of([&] {
    train::run_sweep_text(sweep_text(longer), "s.toml", {}, (dir / "c").string(), false, 1,
                          dir / "records");
  });
  EXPECT_NE(err.find("optim.steps (2 -> 3)"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(dir / "c" / "nope" / "s0" / "summary.json"));
  // so is a finished run of the sweep's own folder once the experiment file changed
  const std::string stale = error_of([&] {
    train::run_sweep_text(sweep_text(longer), "s.toml", {}, (dir / "b").string(), false);
  });
  EXPECT_NE(stale.find("optim.steps (2 -> 3)"), std::string::npos) << stale;
  // the thread count is how a run ran, not what it computed: a record with another one is used
  EXPECT_NO_THROW(
      train::run_sweep_text(text, "s.toml", {"threads=1"}, (dir / "b").string(), false));
  // one bad record imports nothing, not the good ones before it
  fs::copy(dir / "records", dir / "records2", fs::copy_options::recursive);
  std::ofstream(dir / "records2" / "rope" / "s0" / "summary.json") << "{\"final_eval\": 3";
  const std::string corrupt = error_of([&] {
    train::run_sweep_text(text, "s.toml", {}, (dir / "e").string(), false, 1, dir / "records2");
  });
  EXPECT_NE(corrupt.find("corrupt"), std::string::npos) << corrupt;
  EXPECT_FALSE(fs::exists(dir / "e" / "nope" / "s0" / "summary.json"));
  // a folder that is not records is refused by the import
  EXPECT_NE(error_of([&] {
              train::run_sweep_text(text, "s.toml", {}, (dir / "d").string(), false, 1,
                                    dir / "other");
            }).find("not a folder of run records"),
            std::string::npos);
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
      o.out = dir / name / c.name;
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

// ---- run folders, resume and checkpoints (issue 23)

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// every file below `dir` with its bytes
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) m[e.path().string()] = slurp(e.path());
  return m;
}

// tiny(), 4 steps, one evaluation at the end
train::TrainConfig short_run() {
  auto c = tiny();
  c.optim.steps = 4;
  c.eval.every = 0;
  c.eval.lengths = {24};
  c.eval.batches = 1;
  return c;
}

std::string train_error(const train::TrainConfig& c, const train::RunOptions& o) {
  return error_of([&] { train::run_training(c, o); });
}

}  // namespace

TEST(TrainRunFolder, ANewRunNeverWritesIntoAForeignFolderOrAnotherRun) {
  const auto dir = temp_dir("refuse");
  train::RunOptions o;
  o.progress = false;
  // the user's own folder (`--out .` in a project): refused, every file byte-identical
  o.out = dir / "mine";
  fs::create_directories(o.out);
  std::ofstream(o.out / "config.toml") << "# my comments\nseed = 7\n";
  std::ofstream(o.out / "metrics.csv") << "step\n1\n";
  auto before = snapshot(o.out);
  for (const bool resume : {false, true}) {
    o.resume = resume;
    const auto why = train_error(short_run(), o);
    EXPECT_NE(why.find("not empty and holds no relpos output"), std::string::npos) << why;
  }
  EXPECT_EQ(snapshot(o.out), before);
  EXPECT_FALSE(fs::exists(o.out / "checkpoints"));
  // another run's folder: a new run (another model, no --resume) is refused
  o.resume = false;
  o.out = dir / "run";
  train::run_training(short_run(), o);
  before = snapshot(o.out);
  auto other = short_run();
  other.model.mechanism = "rope";
  other.seed = 3;
  const auto why = train_error(other, o);
  EXPECT_NE(why.find("holds a relpos run already"), std::string::npos) << why;
  EXPECT_NE(why.find("--overwrite"), std::string::npos) << why;
  EXPECT_EQ(snapshot(o.out), before);
  // --overwrite replaces it, old results first
  o.overwrite = true;
  train::run_training(other, o);
  EXPECT_EQ(train::load_config(o.out / "config.toml").model.mechanism, "rope");
  EXPECT_FALSE(fs::exists(o.out / OutputDir::kMarker));  // finished
}

TEST(TrainResume, RefusesAChangedConfigurationNamingTheKeys) {
  const auto dir = temp_dir("resume-changed");
  train::RunOptions o;
  o.progress = false;
  o.out = dir / "r";
  train::run_training(short_run(), o);
  const auto before = snapshot(o.out);
  o.resume = true;
  const std::vector<std::pair<std::string, std::function<void(train::TrainConfig&)>>> changes = {
      {"model.mechanism", [](auto& c) { c.model.mechanism = "alibi"; }},
      {"model.d_model", [](auto& c) { c.model.d_model = 64; }},
      {"seed", [](auto& c) { c.seed = 1; }},
      {"optim.lr", [](auto& c) { c.optim.lr = 1e-3; }},
      {"optim.batch", [](auto& c) { c.optim.batch = 2; }},
      {"task.path", [](auto& c) { c.task.path = "other.txt"; }},
      {"task.train_length", [](auto& c) { c.task.train_length = 32; }}};
  for (const auto& [key, change] : changes) {
    auto c = short_run();
    change(c);
    c.optim.steps = 6;
    const auto why = train_error(c, o);
    EXPECT_NE(why.find("--resume"), std::string::npos) << key << ": " << why;
    EXPECT_NE(why.find(key + " ("), std::string::npos) << key << ": " << why;
    EXPECT_EQ(snapshot(o.out), before) << key;
  }
  // what may change: the total steps, the evaluation and checkpoint cadence, threads, the name
  auto more = short_run();
  more.optim.steps = 6;
  more.eval.lengths = {24, 48};
  more.eval.every = 3;
  more.checkpoint_every = 3;
  more.log_every = 1;
  more.name = "renamed";
  EXPECT_EQ(train::run_training(more, o).steps, 6);
}

TEST(TrainResume, RefusesMissingOrGarbledMetrics) {
  const auto dir = temp_dir("resume-metrics");
  train::RunOptions o;
  o.progress = false;
  o.out = dir / "r";
  train::run_training(short_run(), o);
  o.resume = true;
  auto c = short_run();
  c.optim.steps = 6;
  const std::string good = slurp(o.out / "metrics.csv");
  fs::remove(o.out / "metrics.csv");
  EXPECT_NE(train_error(c, o).find("metrics.csv' is missing"), std::string::npos);
  std::ofstream(o.out / "metrics.csv") << "garbage\n";
  EXPECT_NE(train_error(c, o).find("does not start with the metrics header"), std::string::npos);
  std::ofstream(o.out / "metrics.csv") << good << "x,train,,\n";
  const auto why = train_error(c, o);
  EXPECT_NE(why.find("is not a metrics row"), std::string::npos) << why;
  EXPECT_NE(why.find("would be lost"), std::string::npos) << why;
  std::ofstream(o.out / "metrics.csv") << good;
  EXPECT_EQ(train::run_training(c, o).steps, 6);
}

TEST(TrainCheckpoint, APatchedWeightIsRefusedByResumeAndEval) {
  const auto dir = temp_dir("ckpt-patched");
  train::RunOptions o;
  o.progress = false;
  o.out = dir / "r";
  train::run_training(short_run(), o);
  const fs::path ckpt = o.out / "checkpoints" / "last.pt";
  std::string bytes = slurp(ckpt);
  ASSERT_EQ(bytes.rfind("relpos-checksum", 0), 0u);
  bytes[bytes.size() / 2] ^= 0x10;  // inside the archive: a weight, or what holds them
  std::ofstream(ckpt, std::ios::binary | std::ios::trunc) << bytes;
  for (const auto& why : {error_of([&] { train::evaluate_run(o.out, {24}); }), error_of([&] {
                            o.resume = true;
                            auto c = short_run();
                            c.optim.steps = 6;
                            train::run_training(c, o);
                          })}) {
    EXPECT_NE(why.find("fails its integrity check"), std::string::npos) << why;
    EXPECT_NE(why.find("last.pt"), std::string::npos) << why;
  }
}

TEST(TrainCheckpoint, ACheckpointOfAnotherModelIsANamedError) {
  const auto dir = temp_dir("ckpt-other");
  train::RunOptions o;
  o.progress = false;
  o.out = dir / "wide";
  auto wide = short_run();
  wide.model.d_model = 64;
  train::run_training(wide, o);
  o.out = dir / "narrow";
  train::run_training(short_run(), o);
  fs::copy_file(dir / "wide" / "checkpoints" / "last.pt", o.out / "checkpoints" / "last.pt",
                fs::copy_options::overwrite_existing);
  const auto why = error_of([&] { train::evaluate_run(o.out, {24}); });
  EXPECT_NE(why.find("holds another model"), std::string::npos) << why;
  o.resume = true;
  EXPECT_NE(train_error(short_run(), o).find("holds another model"), std::string::npos);
}

// A checkpoint whose model has the same tensors, some of them parameters where the run's model
// keeps buffers (a PJ sector on there, left off here: what a checkpoint from before those
// became buffers holds): its weights load by name, its optimizer state does not fit, named.
TEST(TrainCheckpoint, OptimizerStateForOtherParametersIsANamedError) {
  const auto dir = temp_dir("ckpt-optimizer");
  train::RunOptions o;
  o.progress = false;
  auto every_sector = short_run(), default_sectors = short_run();
  every_sector.model.mechanism = "pj_bias(sectors=fj/affine/lc)";
  default_sectors.model.mechanism = "pj_bias(sectors=fj/affine/lc)";
  o.out = dir / "all";
  train::run_training(every_sector, o);
  default_sectors.model.mechanism = "pj_bias";
  o.out = dir / "default";
  train::run_training(default_sectors, o);
  fs::copy_file(dir / "all" / "checkpoints" / "last.pt", o.out / "checkpoints" / "last.pt",
                fs::copy_options::overwrite_existing);
  const auto eval_why = error_of([&] { train::evaluate_run(o.out, {24}); });
  EXPECT_EQ(eval_why, "(no error)");  // the weights, by name: eval reads no optimizer state
  o.resume = true;
  auto longer = default_sectors;
  longer.optim.steps = 6;
  const auto why = train_error(longer, o);
  EXPECT_NE(why.find("its optimizer state does not fit this model's parameters"), std::string::npos)
      << why;
}

TEST(TrainRun, ANonFiniteLossStopsTheRunKeepingTheLastGoodCheckpoint) {
  // beta2 = 0 and an eps below float's range: a weight whose gradient is 0 (an embedding row of
  // a token absent from the batch) takes the Adam step 0 / (0 + 0) = NaN, with a finite loss and
  // gradient at that step; the next loss is NaN
  auto c = short_run();
  c.optim.steps = 200;
  c.optim.lr = 10;
  c.optim.beta2 = 0;
  c.optim.eps = 1e-300;
  c.optim.clip = 0;
  c.checkpoint_every = 1;
  const auto dir = temp_dir("diverged");
  train::RunOptions o;
  o.progress = false;
  o.out = dir / "r";
  std::string why;
  try {
    train::run_training(c, o);
  } catch (const train::TrainingDiverged& e) {
    why = e.what();
  }
  ASSERT_NE(why.find("training stopped: the "), std::string::npos) << why;
  EXPECT_NE(why.find("last good checkpoint"), std::string::npos) << why;
  EXPECT_FALSE(fs::exists(o.out / "summary.json"));
  EXPECT_TRUE(fs::exists(o.out / OutputDir::kMarker));  // not finished
  auto run = train::load_trained_model(o.out);
  for (const auto& p : run.model->parameters())
    EXPECT_TRUE(torch::isfinite(p).all().item<bool>()) << "the kept checkpoint holds NaN";
}

TEST(TrainNames, OneRuleForRunSweepSettingAndExperimentNames) {
  auto c = tiny();
  for (const std::string& bad :
       std::vector<std::string>{std::string("a\nb"), std::string("a\0b", 3), std::string("../x"),
                                std::string(200, 'n')}) {
    c.name = bad;
    EXPECT_THROW(c.validate(), InputError);
  }
  EXPECT_THROW(train::parse_config("name = \"x\\u0000y\"\n", "a.toml").validate(), InputError);
  // one key per --set: the rest after a newline is not dropped silently
  c = tiny();
  const auto why = error_of([&] { train::apply_override(c, "optim.steps=5\noptim.batch=0"); });
  EXPECT_NE(why.find("newline"), std::string::npos) << why;
  EXPECT_EQ(c.optim.steps, tiny().optim.steps);
  // sweeps: the name and the settings' names
  const auto dir = temp_dir("names");
  const fs::path escape = fs::temp_directory_path() / ("relpos-escape-" + std::to_string(getpid()));
  auto s = short_run();
  s.name = "../../../../../../../.." + escape.string();
  std::string text = s.to_toml() + "\n[sweep]\nmethods = [\"nope\"]\n";
  const auto cwd = fs::current_path();
  fs::current_path(dir);
  EXPECT_NE(error_of([&] { train::run_sweep_text(text, "s.toml", {}, "", false); }).find("name"),
            std::string::npos);
  fs::current_path(cwd);
  EXPECT_FALSE(fs::exists(escape));
  s.name = "fine";
  text = s.to_toml() + "\n[sweep]\nmethods = [\"nope\"]\nsettings = { \"../up\" = [] }\n";
  EXPECT_THROW(train::run_sweep_text(text, "s.toml", {}, (dir / "out").string(), false),
               InputError);
  EXPECT_FALSE(fs::exists(dir / "up"));
  // experiments: a 100,000-character name is a named error, not a filesystem exception
  EXPECT_THROW(train::experiment_configs(std::string(100000, 'x'), "cpu", {}), InputError);
  EXPECT_THROW(train::experiment_configs("../experiments/jordan-t5", "cpu", {}), InputError);
}

TEST(TrainExperiments, AnUnknownScaleListsEachKnownScaleOnce) {
  const auto why = error_of([] { train::experiment_configs("grape-small", "bogus", {}); });
  const auto known = why.substr(why.find("known:"));
  size_t n = 0;
  for (auto at = known.find("paper"); at != std::string::npos; at = known.find("paper", at + 1))
    ++n;
  EXPECT_EQ(n, 1u) << why;
}
