// Output files and child processes (core/files.hpp): atomic writes, run directories that say when
// they are incomplete, and programs started without a shell whatever the arguments hold.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/files.hpp"
#include "core/mechanism.hpp"
#include "core/registry.hpp"
#include "core/types.hpp"

using namespace relpos;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("relpos-test-" + std::to_string(::getpid()) + "-" +
                                        std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::string> names(const fs::path& dir) {
  std::vector<std::string> n;
  for (const auto& e : fs::directory_iterator(dir)) n.push_back(e.path().filename().string());
  std::sort(n.begin(), n.end());
  return n;
}

// Paths no shell may see: quotes, command substitution, backticks, newlines, globs.
const std::vector<std::string> kHostileNames = {"x'; touch PWNED; echo '",
                                                "a$(touch PWNED)b",
                                                "c`touch PWNED`d",
                                                "e\ntouch PWNED\nf",
                                                "g\"; touch PWNED; \"h",
                                                "i;touch PWNED",
                                                "*",
                                                "-rf"};

}  // namespace

TEST(Files, AtomicWriteLeavesOnlyTheFile) {
  TempDir d;
  write_file_atomic(d.path / "a.txt", "one");
  write_file_atomic(d.path / "a.txt", "two");
  EXPECT_EQ(slurp(d.path / "a.txt"), "two");
  EXPECT_EQ(names(d.path), std::vector<std::string>{"a.txt"});
  // temp names differ between calls (two writers never share one)
  EXPECT_NE(temp_path_for(d.path / "a.txt"), temp_path_for(d.path / "a.txt"));
  EXPECT_THROW(write_file_atomic(d.path / "missing" / "a.txt", "x"), InputError);
}

TEST(Files, OutputDirMarksAnUnfinishedRun) {
  TempDir d;
  const fs::path out = d.path / "run";
  {
    OutputDir o(out, "relpos test");
    EXPECT_TRUE(fs::exists(out / OutputDir::kMarker));
    o.write("table.md", "x");
  }  // not finished (an exception, a kill): the marker stays
  EXPECT_TRUE(fs::exists(out / OutputDir::kMarker));
  {
    OutputDir o(out, "relpos test");
    o.write("table.md", "y");
    o.finish();
  }
  EXPECT_FALSE(fs::exists(out / OutputDir::kMarker));
  EXPECT_EQ(names(out), std::vector<std::string>{"table.md"});
}

TEST(Files, OutputDirSweepsTempFilesOfDeadRunsOnly) {
  TempDir d;
  // pid 2^30 is above Linux's pid_max: no such process
  const fs::path stale = d.path / ".table.md.tmp.1073741824.0";
  const fs::path alive = d.path / (".table.md.tmp." + std::to_string(::getppid()) + ".0");
  const fs::path other = d.path / ".keep.tmp.notapid.0";
  for (const auto& p : {stale, alive, other}) std::ofstream(p) << "x";
  {
    OutputDir o(d.path, "relpos test");
    o.finish();
  }
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(alive));
  EXPECT_TRUE(fs::exists(other));
}

TEST(Files, RunProgramPassesArgumentsVerbatimWithoutAShell) {
  TempDir d;
  std::vector<std::string> argv = {"/usr/bin/touch"};
  for (const auto& n : kHostileNames) argv.push_back("./" + n);  // "./" keeps "-rf" a file name
  ASSERT_EQ(run_program(argv, d.path), 0);
  for (const auto& n : kHostileNames) EXPECT_TRUE(fs::exists(d.path / n)) << n;
  EXPECT_FALSE(fs::exists(d.path / "PWNED"));
  EXPECT_EQ(run_program({"/nonexistent/program"}, d.path), -1);
  EXPECT_EQ(run_program({"/bin/false"}, d.path), 1);
}

TEST(Files, ChildProcessesGetTheirEnvironmentAndAreNeverLeftRunning) {
  // printenv exits 0 when the variable is set, 1 when not
  SpawnOptions o;
  o.quiet = true;
  o.env = {{"RELPOS_CHILD_TEST", "1; rm -rf /"}};
  EXPECT_EQ(ChildProcess({"/usr/bin/printenv", "RELPOS_CHILD_TEST"}, o).wait(), 0);
  EXPECT_EQ(ChildProcess({"/usr/bin/printenv", "RELPOS_CHILD_TEST"}, SpawnOptions{{}, {}, true, {}})
                .wait(),
            1);
  EXPECT_THROW(ChildProcess({"/nonexistent/program"}), InputError);

  ChildProcess sleeper({"/bin/sleep", "30"});
  EXPECT_FALSE(sleeper.poll().has_value());
  sleeper.signal(SIGTERM);
  EXPECT_EQ(sleeper.wait(), 128 + SIGTERM);
  EXPECT_EQ(sleeper.poll(), std::optional<int>(128 + SIGTERM));

  int pid = 0;
  {
    ChildProcess forgotten({"/bin/sleep", "30"});
    pid = forgotten.pid();
    ChildProcess moved = std::move(forgotten);  // the moved-from one owns nothing
  }                                             // killed and reaped here
  EXPECT_NE(::kill(pid, 0), 0);
}

TEST(Files, OutputDirsWithHostileNamesWork) {
  TempDir d;
  for (const auto& n : kHostileNames) {
    OutputDir o(d.path / n, "relpos test");
    o.write("t.csv", "1");
    o.finish();
    EXPECT_EQ(slurp(d.path / n / "t.csv"), "1");
  }
  EXPECT_FALSE(fs::exists(d.path / "PWNED"));
}

// "name(" as a call, not as the end of a longer identifier
bool calls(const std::string& line, const std::string& name) {
  for (size_t at = line.find(name + "("); at != std::string::npos;
       at = line.find(name + "(", at + 1))
    if (at == 0 || !(std::isalnum(static_cast<unsigned char>(line[at - 1])) || line[at - 1] == '_'))
      return true;
  return false;
}

// No code path may hand a string to a shell: no system(), popen() or exec through /bin/sh.
TEST(Files, NoShellCallsInTheSources) {
  int scanned = 0;
  for (const auto& e : fs::recursive_directory_iterator(fs::path(RELPOS_SOURCE_DIR) / "src")) {
    const auto ext = e.path().extension();
    if (ext != ".cpp" && ext != ".hpp" && ext != ".inc" && ext != ".h") continue;
    ++scanned;
    std::ifstream f(e.path());
    std::string line;
    for (int no = 1; std::getline(f, line); ++no)
      for (const char* f : {"system", "popen", "execl", "execlp", "wordexp"})
        EXPECT_FALSE(calls(line, f)) << e.path() << ":" << no << ": " << line;
  }
  EXPECT_GT(scanned, 20);
}

// The lag kernel clamps |gamma d| as the kernels clamp |gamma p|: never inf at long negative lags.
TEST(LagFeatures, ClampedAndFiniteAtLongLags) {
  const Mechanism m = build_mechanism("damped_rope(gamma0=0.01, max_exp=30)", 16, 1);
  const ParamValues p = default_params(m);
  for (double d : {-1e9, -1e6, -3001.0, 1e9})
    for (const auto& f : lag_features(m, p, 0, d))
      EXPECT_TRUE(std::isfinite(f.value)) << f.name << " " << d;
  EXPECT_GT(clamp_ratio(m, p, 1e6), 1.0);
  EXPECT_LT(clamp_ratio(m, p, 100.0), 1.0);
  // inside the clamp the value is the exact e^{-gamma d}
  const auto f = lag_features(m, p, 0, -100.0);
  EXPECT_NEAR(std::hypot(f[0].value, f[1].value), std::exp(1.0), 1e-12);
}
