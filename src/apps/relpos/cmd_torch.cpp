// relpos train | eval | sweep | reproduce <trained experiment> | bench: the work that needs
// LibTorch runs in relpos-train (or relpos-bench), programs of the LibTorch build that sit beside
// this one (this CLI links no
// LibTorch so that it also builds with -DRELPOS_CORE_ONLY=ON). The arguments go through verbatim
// (no shell); relpos passes SIGTERM, SIGHUP and SIGINT on and exits with the program's status.
#include <fmt/format.h>

#include <filesystem>
#include <system_error>

#include "apps/relpos/commands.hpp"
#include "core/files.hpp"
#include "core/types.hpp"

namespace relpos::app {

namespace fs = std::filesystem;

int run_beside(const std::string& program, const std::vector<std::string>& args) {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  const fs::path path = ec ? fs::path() : self.parent_path() / program;
  if (path.empty() || !fs::is_regular_file(path, ec))
    throw InputError(fmt::format(
        "this needs the LibTorch build: {} was not found beside this relpos ({}); build without "
        "-DRELPOS_CORE_ONLY=ON (scripts/build.sh)",
        program, path.empty() ? std::string("/proc/self/exe unreadable") : path.string()));
  std::vector<std::string> argv = {path.string()};
  argv.insert(argv.end(), args.begin(), args.end());
  // SIGTERM, SIGHUP and SIGINT sent to relpos go on to the program (which also dies with relpos,
  // ChildProcess): a killed `relpos train` never leaves a trainer writing its run folder
  ForwardedSignals signals;
  ChildProcess child(argv);
  for (;;) {
    if (const auto status = child.poll()) return *status;
    if (const int sig = signals.wait(50)) child.signal(sig);
  }
}

void add_torch_commands(CLI::App& app) {
  struct Forward {
    std::string name, program, help;
  };
  const std::vector<Forward> commands = {
      {"train", "relpos-train",
       "Train a transformer LM with any mechanism (--config FILE.toml, --set k=v, --nproc N)"},
      {"eval", "relpos-train", "Evaluate a run's checkpoint at several lengths (--checkpoint DIR)"},
      {"diagnose", "relpos-train",
       "PJ-RoPE bias diagnostics of a run's checkpoint (--checkpoint DIR, --format md|json, "
       "--out DIR)"},
      {"sweep", "relpos-train",
       "Methods x seeds x settings from one TOML (--config SWEEP.toml), resumable"},
      {"export-runs", "relpos-train",
       "A sweep's finished runs as records that --import-runs continues from elsewhere (FOLDER "
       "--out DIR)"},
      {"bench", "relpos-bench",
       "Benchmarks against LibTorch: 'relpos bench attention|decode|step --help' lists the "
       "options (step: the training step, in relpos-train)"}};
  for (const auto& [name, program, help] : commands) {
    auto* cmd = app.add_subcommand(name, fmt::format("{} [{}]", help, program));
    cmd->prefix_command();  // everything after the name goes to the program as is
    cmd->set_help_flag();   // --help too
    // relpos-train takes the subcommand's name first; relpos-bench takes the benchmark's name
    cmd->callback([cmd, name = name, program = program] {
      std::vector<std::string> args;
      if (program == "relpos-train") args.push_back(name);
      for (const auto& a : cmd->remaining()) args.push_back(a);
      // the training step's benchmark builds models, so it lives in relpos-train (bench-step)
      std::string runs = program;
      if (name == "bench" && !args.empty() && args[0] == "step") {
        runs = "relpos-train";
        args[0] = "bench-step";
      }
      if (const int rc = run_beside(runs, args); rc != 0) throw ExitStatus{rc};
    });
  }
}

}  // namespace relpos::app
