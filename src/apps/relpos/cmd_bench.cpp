// relpos bench: benchmarks against LibTorch. This CLI links no LibTorch, so the benchmarks live
// in a separate LibTorch-linked program, relpos-bench (src/apps/bench), built beside relpos in the
// LibTorch build; `relpos bench ARGS...` runs `relpos-bench ARGS...` from the directory of the
// running relpos executable, arguments verbatim, and exits with its status.
#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <system_error>

#include "apps/relpos/commands.hpp"
#include "core/files.hpp"
#include "core/types.hpp"

namespace relpos::app {

namespace fs = std::filesystem;

void add_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "bench",
      "Benchmarks against LibTorch (runs relpos-bench of the LibTorch build): 'relpos bench "
      "attention --help' lists the options");
  // everything from the first positional on (the benchmark's name) goes to relpos-bench as is
  cmd->prefix_command();
  cmd->callback([cmd] {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    const fs::path bench = ec ? fs::path() : self.parent_path() / "relpos-bench";
    if (bench.empty() || !fs::is_regular_file(bench, ec))
      throw InputError(fmt::format(
          "bench needs the LibTorch build: relpos-bench was not found beside this relpos ({}); "
          "build without -DRELPOS_CORE_ONLY=ON (scripts/build.sh)",
          bench.empty() ? std::string("/proc/self/exe unreadable") : bench.string()));
    std::vector<std::string> argv = {bench.string()};
    for (const auto& a : cmd->remaining()) argv.push_back(a);
    const fs::path cwd = fs::current_path(ec);
    const int rc = run_program(argv, ec ? fs::path("/") : cwd, ChildOutput::Inherit);
    if (rc == 0) return;
    if (rc == 1 || rc == 2) throw ExitStatus{rc};
    throw std::runtime_error(rc < 0 ? fmt::format("could not start {}", bench.string())
                                    : fmt::format("{} exited with status {}", bench.string(), rc));
  });
}

}  // namespace relpos::app
