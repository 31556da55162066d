// relpos-train: the LibTorch side of `relpos train | eval | sweep` (the relpos CLI links no
// LibTorch and runs this program from its own directory with the arguments verbatim).
//   train  --config FILE.toml | flags, --set section.key=value, --out DIR, --resume, --nproc N
//   eval   --checkpoint RUN_DIR [--lengths L,...]
//   diagnose --checkpoint RUN_DIR [--format md|json] [--length T] [--target NAME] [--out DIR]
//   sweep  --config SWEEP.toml: methods x seeds x settings, finished runs skipped
//   reproduce NAME --scale paper|cpu: a paper table from experiments/NAME.toml
// Exit codes as the CLI (docs/errors.md): 0 ok, 1 a run stopped on a non-finite loss, 2 bad
// input, 3 a bug.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "apps/cli_checks.hpp"
#include "core/files.hpp"
#include "core/parse.hpp"
#include "core/types.hpp"
#include "train/config.hpp"
#include "train/distributed.hpp"
#include "train/pj_diagnostics.hpp"
#include "train/reproduce.hpp"
#include "train/step_bench.hpp"
#include "train/sweep.hpp"
#include "train/trainer.hpp"

namespace fs = std::filesystem;
using namespace relpos;

namespace {

struct TrainArgs {
  std::string config;
  std::vector<std::string> sets;
  std::string out;
  bool resume = false;
  bool overwrite = false;
  bool quiet = false;
  int nproc = 1;
};

train::TrainConfig resolve(const TrainArgs& a) {
  train::TrainConfig c = a.config.empty() ? train::TrainConfig{} : train::load_config(a.config);
  for (const auto& s : a.sets) train::apply_override(c, s);
  c.validate();
  return c;
}

void print_eval(const std::vector<train::EvalResult>& ev) {
  fmt::print("| length | loss | accuracy | perplexity |\n|---:|---:|---:|---:|\n");
  for (const auto& e : ev)
    fmt::print("| {} | {:.4f} | {:.4f} | {:.3f} |\n", e.length, e.loss, e.accuracy, e.perplexity);
}

// --nproc N starts N local workers of this program (c10d rendezvous over loopback); a worker,
// or a program started by another launcher, finds RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
int run_train(const TrainArgs& a, const std::vector<std::string>& argv) {
  const auto c = resolve(a);  // a bad configuration fails before any worker starts
  train::RunOptions o;
  o.out = a.out.empty() ? fs::path("runs") / c.name : fs::path(a.out);
  o.resume = a.resume;
  o.overwrite = a.overwrite;
  o.command = fmt::format("relpos-train {}", brief(fmt::format("{}", fmt::join(argv, " ")), 400));
  if (a.nproc > 1) {
    // the folder's refusals before any worker starts (rank 0 then locks it)
    OutputDirOptions d;
    d.kind = "run";
    d.existing = a.resume ? Existing::Continue : a.overwrite ? Existing::Replace : Existing::Refuse;
    OutputDir::check(o.out, d);
    return train::launch_local(a.nproc, train::without_nproc(argv));
  }
  const train::DataParallel dp(train::DistConfig::from_environment());
  o.progress = !a.quiet;
  o.replicas.rank = dp.rank();
  o.replicas.world = dp.world_size();
  o.replicas.broadcast_parameters = [&dp](const std::vector<torch::Tensor>& p) { dp.broadcast(p); };
  o.replicas.average_gradients = [&dp](const std::vector<torch::Tensor>& p) {
    dp.allreduce_gradients(p);
  };
  const auto r = train::run_training(c, o);
  if (!dp.is_main()) return 0;
  fmt::print("{}: {} steps, {} parameters, {:.1f} s, {:.0f} tokens/s -> {}\n", c.name, r.steps,
             r.parameters, r.wall_s, r.tokens_per_s, o.out.string());
  print_eval(r.final_eval);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // OpenMP threads that spin between parallel regions (libgomp's default) lose whole scheduler
  // quanta at every barrier when the machine has other work: a training step of many small ops
  // ran 10x slower than with one thread on a loaded 2-core VM (docs/performance.md). Sleeping
  // waits cost microseconds instead. libgomp reads the policy when it loads, before main, so the
  // program restarts itself once with it set (a user's own setting is kept).
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv);  // on failure, continue with the default policy
  }
  CLI::App app{"relpos-train: transformer LMs with any mechanism (train, eval, sweep)"};
  app.require_subcommand(1);

  TrainArgs ta;
  auto* train_cmd = app.add_subcommand("train", "Train one model");
  train_cmd->add_option("--config", ta.config, "TOML configuration (train/config.hpp lists keys)");
  train_cmd->add_option("--set", ta.sets, "Override: section.key=value (repeatable)");
  train_cmd->add_option("--out", ta.out, "Run folder (default runs/NAME)");
  auto* resume_flag = train_cmd->add_flag(
      "--resume", ta.resume,
      "Continue the run in OUT from checkpoints/last.pt (its configuration may change only in "
      "optim.steps, eval.*, checkpoint_every, log_every, threads, name); without that checkpoint "
      "only a run that recorded nothing past step 0 starts again, else it is refused");
  train_cmd
      ->add_flag("--overwrite", ta.overwrite,
                 "Start again in OUT, replacing the relpos run there: its summary.json, "
                 "metrics.csv and checkpoints/last.pt are removed first (never other files)")
      ->excludes(resume_flag);
  train_cmd->add_flag("--quiet", ta.quiet, "No progress on stderr");
  train_cmd->add_option("--nproc", ta.nproc, "Data-parallel local workers (c10d, Gloo)")
      ->check(CLI::Range(1, 256));
  int exit_code = 0;
  const std::vector<std::string> args(argv + 1, argv + argc);
  train_cmd->callback([&] { exit_code = run_train(ta, args); });

  std::string ckpt;
  std::vector<int64_t> lengths;
  auto* eval_cmd =
      app.add_subcommand("eval", "Evaluate a run's last checkpoint at several lengths");
  eval_cmd->add_option("--checkpoint", ckpt, "Run folder (with config.toml, checkpoints/last.pt)")
      ->required();
  eval_cmd->add_option("--lengths", lengths, "Lengths (default: the run's eval.lengths)")
      ->delimiter(',');
  std::string profiles;
  eval_cmd->add_option(
      "--profiles", profiles,
      "Also write the q/k norm profile over positions (CSV) at the longest length");
  eval_cmd->callback([&] {
    if (!profiles.empty()) check_output_file(profiles, "layer,position,q_norm,k_norm\n");
    const auto r = train::evaluate_run(ckpt, lengths);
    print_eval(r);
    fmt::print("\nmechanism per layer (mean gamma, |eta|, |gates|): {}\n",
               train::run_mechanism_stats(ckpt));
    if (!profiles.empty()) {
      // refused before the work: a folder, or a file that is not an earlier profile
      check_output_file(profiles, "layer,position,q_norm,k_norm\n");
      write_file_atomic(profiles, train::qk_profile_csv(ckpt, r.back().length));
      fmt::print("q/k norm profile at {} tokens -> {}\n", r.back().length, profiles);
    }
  });

  std::string diag_ckpt, diag_format = "md", diag_out;
  train::PjDiagnoseOptions diag_opts;
  auto* diag_cmd = app.add_subcommand(
      "diagnose", "PJ-RoPE bias diagnostics of a run's checkpoint, per layer and head");
  diag_cmd
      ->add_option("--checkpoint", diag_ckpt, "Run folder (with config.toml, checkpoints/last.pt)")
      ->required();
  diag_cmd->add_option("--format", diag_format, "md (Markdown tables) or json")
      ->check(CLI::IsMember({"md", "json"}));
  diag_cmd
      ->add_option("--length", diag_opts.length,
                   "Window T_eval: lags d = 0..T-1 (default 4 L); also the CSV / plot length")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  diag_cmd->add_option("--target", diag_opts.target,
                       "PJ Table 3 teacher for target-relative leave-one-order-out deltas "
                       "(default: self-relative)");
  diag_cmd->add_option("--out", diag_out,
                       "Also write DIR/pj_lag_kernels.csv and DIR/pj_lag_kernels.png");
  diag_cmd->callback([&] {
    auto run = train::load_trained_model(diag_ckpt);
    auto d = train::pj_model_diagnostics(*run.model, diag_opts);
    d.step = run.step;
    fmt::print("{}", diag_format == "json" ? train::pj_diagnostics_json(d)
                                           : train::pj_diagnostics_markdown(d));
    if (!diag_out.empty()) {
      const bool drawn = train::write_pj_lag_kernel_plot(*run.model, d.window, diag_out);
      fmt::print(stderr, "lag kernels over d = 0..{} -> {}/pj_lag_kernels.csv{}\n", d.window - 1,
                 diag_out,
                 drawn ? fmt::format(", {}/pj_lag_kernels.png", diag_out)
                       : std::string(" (no PNG: gnuplot missing or failed; the .gp script stays)"));
    }
  });

  std::string sweep_config;
  bool sweep_quiet = false;
  auto* sweep_cmd = app.add_subcommand(
      "sweep", "Methods x seeds x settings from one TOML; finished runs skipped");
  sweep_cmd->add_option("--config", sweep_config, "Sweep TOML")->required();
  sweep_cmd->add_option("--set", ta.sets, "Override for every run: section.key=value");
  sweep_cmd->add_option("--out", ta.out, "Sweep folder (default runs/SWEEP_NAME)");
  sweep_cmd->add_flag("--quiet", sweep_quiet, "No progress on stderr");
  int64_t jobs = 1;
  sweep_cmd
      ->add_option("--jobs", jobs,
                   "Runs at a time, each in its own process (cores / jobs threads each)")
      ->check(CLI::Range(1, 256));
  std::string import_runs;
  const char* import_help =
      "A folder of run records (export-runs): its finished runs of this sweep are used, each "
      "checked against its run's configuration, before the rest are trained";
  sweep_cmd->add_option("--import-runs", import_runs, import_help);
  sweep_cmd->callback([&] {
    const auto md =
        train::run_sweep(sweep_config, ta.sets, ta.out, !sweep_quiet, jobs, import_runs);
    fmt::print("{}", md);
  });

  std::string experiment, scale;
  auto* repro_cmd = app.add_subcommand(
      "reproduce", "Run a paper table (experiments/NAME.toml) and print it beside the paper's");
  repro_cmd->add_option("name", experiment, "Experiment name (experiments/NAME.toml)");
  bool list_experiments = false;
  repro_cmd->add_flag("--list", list_experiments,
                      "List the experiments of experiments/ with their scales and run counts");
  auto* scale_opt = repro_cmd->add_option(
      "--scale", scale,
      "paper (the paper's sizes), cpu (default where the file has it), or another [scale.X]");
  repro_cmd
      ->add_option("--mode", scale,
                   "A protocol of the file, as --scale (JoFormer: paper or reference)")
      ->excludes(scale_opt);
  std::vector<int64_t> layers;
  repro_cmd->add_option("--layers", layers, "Only the settings L<n> (e.g. 1,3,6: layer counts)")
      ->delimiter(',');
  std::vector<std::string> only_settings;
  repro_cmd
      ->add_option("--settings", only_settings,
                   "Only these sweep settings (names of the file's [sweep] settings, e.g. tiny)")
      ->delimiter(',');
  repro_cmd->add_option("--jobs", jobs, "Runs at a time, each in its own process")
      ->check(CLI::Range(1, 256));
  repro_cmd->add_option("--set", ta.sets, "Override for every run: section.key=value");
  repro_cmd->add_option("--out", ta.out, "Folder (default runs/reproduce/NAME-SCALE)");
  repro_cmd->add_flag("--quiet", sweep_quiet, "No progress on stderr");
  repro_cmd->add_option("--import-runs", import_runs, import_help);
  std::vector<std::string> only;
  repro_cmd->add_option("--methods", only, "Only these rows (labels or specs, repeatable)");
  repro_cmd->callback([&] {
    if (list_experiments) {
      if (!experiment.empty())
        throw InputError(
            fmt::format("reproduce --list takes no experiment name (got '{}')", experiment));
      fmt::print("{}", train::experiment_list_markdown(train::list_experiments()));
      return;
    }
    if (experiment.empty())
      throw InputError("reproduce: name an experiment (reproduce --list lists them)");
    std::vector<std::string> settings = only_settings;
    for (auto n : layers) settings.push_back(fmt::format("L{}", n));
    fmt::print("{}", train::reproduce(experiment, scale, ta.sets, ta.out, !sweep_quiet, only,
                                      settings, jobs, import_runs));
  });

  std::string export_from, export_to;
  auto* export_cmd = app.add_subcommand(
      "export-runs",
      "Write the finished runs of a sweep folder (config.toml, metrics.csv, summary.json; no "
      "checkpoints) to a records folder that --import-runs continues from on another machine");
  export_cmd
      ->add_option("folder", export_from,
                   "A sweep's or reproduction's folder, with finished runs below it (not one "
                   "run's folder)")
      ->required();
  export_cmd->add_option("--out", export_to, "The records folder")->required();
  export_cmd->callback([&] {
    const size_t n = train::export_runs(export_from, export_to);
    fmt::print("{} finished run(s) of '{}' written to '{}'\n", n, export_from, export_to);
  });

  int64_t bench_T = 1024, bench_batch = 4;
  int bench_rounds = 5, bench_threads = 2;
  std::vector<std::string> bench_specs = {"nope", "rope", "jordan(m=2, regime=stabilized)"};
  std::vector<std::string> bench_attention = {"fused", "sdpa", "composed"};
  models::ModelConfig bench_model;  // the Table 5 model (jordan-rope.md 2.3) unless changed
  auto* step_cmd = app.add_subcommand(
      "bench-step",
      "Training-step cost of a model (default: the Table 5 model) with each mechanism, through "
      "the fused kernel, SDPA and composed attention");
  step_cmd->add_option("--layers", bench_model.layers, "Layers (default 3)")
      ->check(CLI::Range(1, 256));
  step_cmd->add_option("--d-model", bench_model.d_model, "Model width (default 128)")
      ->check(CLI::Range(2, 65536));
  step_cmd->add_option("--heads", bench_model.heads, "Heads (default 4)")
      ->check(CLI::Range(1, 1024));
  step_cmd->add_option("--mlp-ratio", bench_model.mlp_ratio, "MLP width / model width (default 2)")
      ->check(CLI::Range(1, 64));
  step_cmd->add_option("--vocab", bench_model.vocab, "Vocabulary (default 3)")
      ->check(CLI::Range(2, 1 << 20));
  step_cmd->add_option("--T", bench_T, "Sequence length")->check(CLI::Range(2, 1 << 16));
  step_cmd->add_option("--batch", bench_batch, "Batch")->check(CLI::Range(1, 1024));
  step_cmd->add_option("--rounds", bench_rounds, "Rounds (medians)")->check(CLI::Range(1, 1000));
  step_cmd->add_option("--threads", bench_threads, "Threads")->check(CLI::Range(1, 1024));
  step_cmd->add_option("--mechanisms", bench_specs, "Mechanisms (the first is the baseline)");
  std::string bench_layout = "interleaved";
  step_cmd
      ->add_option("--layout", bench_layout,
                   "Pair layout of every model's transforms: interleaved or half_split (HF's)")
      ->check(CLI::IsMember({"interleaved", "half_split"}));
  step_cmd
      ->add_option("--attention", bench_attention,
                   "Attention paths: fused (the engine), sdpa (the mechanism's transforms, then "
                   "LibTorch's SDPA; mechanisms without biases), sdpa_table (the same SDPA model "
                   "with the transform as users write RoPE: a cos/sin table made once, "
                   "q cos + rotate_half(q) sin; pair rotations only), composed (materialised "
                   "scores)")
      ->check(CLI::IsMember({"fused", "sdpa", "sdpa_table", "composed"}));
  step_cmd->callback([&] {
    if (bench_model.d_model % bench_model.heads)
      throw InputError(fmt::format("--d-model {} must be a multiple of --heads {}",
                                   bench_model.d_model, bench_model.heads));
    bench_model.layout = parse_layout(bench_layout);
    std::vector<train::StepBenchCase> cases;
    for (const auto& att : bench_attention)
      for (const auto& s : bench_specs) cases.push_back({s, att});
    fmt::print("{}", train::step_benchmark(bench_model, bench_T, bench_batch, bench_rounds, cases,
                                           bench_threads));
  });

  // an empty value (`--out ""`, `--profiles ""`, `--target ""`) is bad input, never "not given"
  relpos::app::refuse_empty_values(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << "relpos: error: " << brief(e.what(), 1000) << "\n";
    return 2;
  } catch (const InputError& e) {
    std::cerr << "relpos: error: " << brief(e.what(), 1000) << "\n";
    return 2;
  } catch (const train::TrainingDiverged& e) {  // a check failed: the run's loss is not finite
    std::cerr << "relpos: error: " << brief(e.what(), 1000) << "\n";
    return 1;
  } catch (const train::DistributedError& e) {  // a peer that never joined, a lost connection
    std::cerr << "relpos: error: " << brief(e.what(), 1000) << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "relpos: internal error (please report): " << brief(e.what(), 1000) << "\n";
    return 3;
  }
  return exit_code;
}
