// Output files and child processes (core/files.hpp): atomic writes, run directories that say when
// they are incomplete, and programs started without a shell whatever the arguments hold.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
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
  // the lock file stays: it marks the folder as ours (a later run may continue in it)
  EXPECT_EQ(names(out), (std::vector<std::string>{OutputDir::kLockFile, "table.md"}));
}

TEST(Files, OutputDirSweepsTempFilesOfDeadRunsOnly) {
  TempDir d;
  OutputDir(d.path, "relpos test").finish();  // an output folder of ours, then killed writers
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

// ---- the run-folder discipline (issue 23)

namespace {
OutputDirOptions run_options(Existing existing, const std::string& kind = "run") {
  OutputDirOptions o;
  o.kind = kind;
  o.command = "relpos test";
  o.existing = existing;
  return o;
}

std::string refusal(const fs::path& dir, const OutputDirOptions& o) {
  try {
    OutputDir d(dir, o);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(accepted)";
}

// every file below `dir` with its bytes
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    m[e.path().string()] = e.is_regular_file() ? slurp(e.path()) : std::string("<dir>");
  return m;
}
}  // namespace

TEST(RunFolders, AForeignFolderIsRefusedAndLeftByteIdentical) {
  TempDir d;
  std::ofstream(d.path / "config.toml") << "# my own settings\nseed = 7\n";
  std::ofstream(d.path / "metrics.csv") << "mine\n";
  fs::create_directories(d.path / "sub");
  const auto before = snapshot(d.path);
  for (const auto existing : {Existing::Refuse, Existing::Continue, Existing::Replace}) {
    const auto why = refusal(d.path, run_options(existing));
    EXPECT_NE(why.find("not empty and holds no relpos output"), std::string::npos) << why;
    EXPECT_THROW(OutputDir::check(d.path, run_options(existing)), InputError);
  }
  EXPECT_THROW(OutputDir(d.path, "relpos probe"), InputError);  // reports too
  EXPECT_EQ(snapshot(d.path), before);
}

TEST(RunFolders, AnExistingRunIsRefusedUnlessContinuedOrReplaced) {
  TempDir d;
  const fs::path run = d.path / "run";
  {
    OutputDir o(run, run_options(Existing::Refuse));
    EXPECT_FALSE(o.existed());
    o.write("metrics.csv", "1");
    o.finish();
  }
  const auto before = snapshot(run);
  const auto why = refusal(run, run_options(Existing::Refuse));
  EXPECT_NE(why.find("holds a relpos run already"), std::string::npos) << why;
  EXPECT_NE(why.find("--resume"), std::string::npos) << why;
  EXPECT_EQ(snapshot(run), before);  // refused without a write
  // another kind of output never takes a run's folder
  EXPECT_NE(refusal(run, run_options(Existing::Continue, "sweep")).find("not a sweep"),
            std::string::npos);
  {
    OutputDir o(run, run_options(Existing::Continue));
    EXPECT_TRUE(o.existed());
    EXPECT_TRUE(fs::exists(run / OutputDir::kMarker));  // marked again while it runs
    o.finish();
  }
  OutputDir o(run, run_options(Existing::Replace));
  EXPECT_TRUE(o.existed());
}

TEST(RunFolders, AnOutputThatWroteNothingCountsAsNew) {
  TempDir d;
  { OutputDir o(d.path / "r", run_options(Existing::Refuse)); }  // failed before any write
  OutputDir again(d.path / "r", run_options(Existing::Refuse));
  EXPECT_FALSE(again.existed());
}

TEST(RunFolders, ASecondHolderIsRefusedNamingTheFirst) {
  TempDir d;
  OutputDir first(d.path / "r", run_options(Existing::Refuse));
  const auto why = refusal(d.path / "r", run_options(Existing::Continue));
  EXPECT_NE(why.find("in use by another relpos"), std::string::npos) << why;
  EXPECT_NE(why.find("pid " + std::to_string(::getpid())), std::string::npos) << why;
  EXPECT_NE(why.find("relpos test"), std::string::npos) << why;
  EXPECT_THROW(OutputDir::check(d.path / "r", run_options(Existing::Continue)), InputError);
}

TEST(RunFolders, BadPathsAreNamedInputErrors) {
  TempDir d;
  std::ofstream(d.path / "file") << "x";
  fs::create_symlink(d.path / "nowhere", d.path / "dangling");
  const auto o = run_options(Existing::Refuse);
  EXPECT_NE(refusal(d.path / "file", o).find("is a file"), std::string::npos);
  EXPECT_NE(refusal(d.path / "file" / "sub", o).find("not a folder"), std::string::npos);
  EXPECT_NE(refusal(d.path / "dangling", o).find("dangling"), std::string::npos);
  EXPECT_NE(refusal(d.path / std::string(300, 'n'), o).find("longer than 255"), std::string::npos);
  EXPECT_EQ(names(d.path), (std::vector<std::string>{"dangling", "file"}));
  EXPECT_EQ(slurp(d.path / "file"), "x");
}

TEST(RunFolders, OneNameRule) {
  for (const std::string& ok :
       std::vector<std::string>{"rope-s0", "jordan_m_2.5", "a b", std::string(kMaxNameBytes, 'x')})
    EXPECT_NO_THROW(check_name("name", ok)) << ok;
  for (const std::string& bad : std::vector<std::string>{
           std::string(), std::string("."), std::string(".."), std::string("../../../../tmp/x"),
           std::string("a/b"), std::string("a\\b"), std::string("a..b"), std::string("a\nb"),
           std::string("a\rb"), std::string("a\0b", 3), std::string(kMaxNameBytes + 1, 'x')})
    EXPECT_THROW(check_name("name", bad), InputError) << bad;
}

TEST(Files, AtomicWriteOntoAFolderSaysWhy) {
  TempDir d;
  try {
    write_file_atomic(d.path, "x");
    FAIL() << "accepted";
  } catch (const InputError& e) {
    const std::string why = e.what();
    EXPECT_NE(why.find("is a folder"), std::string::npos) << why;
    EXPECT_EQ(why.find("Success"), std::string::npos) << why;
  }
  EXPECT_TRUE(names(d.path).empty());
}

TEST(Files, OutputFilesReplaceOnlyTheirOwnKind) {
  TempDir d;
  const std::string header = "layer,position,q_norm,k_norm\n";
  std::ofstream(d.path / "mine.csv") << header << "0,0,1,1\n";
  std::ofstream(d.path / "notes.txt") << "my notes\n";
  EXPECT_NO_THROW(check_output_file(d.path / "new.csv", header));
  EXPECT_NO_THROW(check_output_file(d.path / "mine.csv", header));
  EXPECT_THROW(check_output_file(d.path / "notes.txt", header), InputError);
  EXPECT_THROW(check_output_file(d.path, header), InputError);
  EXPECT_THROW(check_output_file(d.path / "notes.txt" / "x.csv", header), InputError);
}

// A symbolic link is refused, dangling or not, even to an earlier output (the write would replace
// the link); the message names the flag given as `what`; the files stay as they were.
TEST(Files, OutputFilesRefuseLinksAndNameTheFlag) {
  TempDir d;
  const std::string header = "{\n  \"benchmark\": \"attention\",\n";
  std::ofstream(d.path / "mine.json") << header << "}\n";
  std::ofstream(d.path / "notes.txt") << "hi\n";
  fs::create_symlink(d.path / "mine.json", d.path / "link.json");
  fs::create_symlink(d.path / "nowhere.json", d.path / "dangling.json");
  const auto refusal = [&](const fs::path& p) {
    try {
      check_output_file(p, header, "--json-out");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal(d.path / "link.json").find("--json-out"), std::string::npos);
  EXPECT_NE(refusal(d.path / "link.json").find("symbolic link"), std::string::npos);
  EXPECT_NE(refusal(d.path / "dangling.json").find("symbolic link"), std::string::npos);
  const std::string foreign = refusal(d.path / "notes.txt");
  EXPECT_NE(foreign.find("--json-out"), std::string::npos) << foreign;
  EXPECT_EQ(foreign.find('\n'), std::string::npos) << foreign;  // the header shown on one line
  EXPECT_NE(refusal(d.path).find("is a folder"), std::string::npos);
  EXPECT_EQ(refusal(d.path / "mine.json"), "");
  EXPECT_EQ(refusal(d.path / "new.json"), "");
  EXPECT_TRUE(fs::is_symlink(d.path / "link.json"));
  EXPECT_FALSE(fs::exists(d.path / "new.json"));
}

TEST(Files, CheckedFilesRefuseChangedBytes) {
  TempDir d;
  const fs::path p = d.path / "last.pt";
  std::string payload(5000, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 7919 % 251);
  write_checked_file(p, payload);
  const auto back = read_checked_file(p);
  EXPECT_TRUE(back.verified);
  EXPECT_EQ(back.bytes, payload);
  // one byte of the payload changed (a patched weight): refused, naming the file
  std::string bytes = slurp(p);
  bytes[bytes.size() - 100] ^= 1;
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  try {
    read_checked_file(p);
    FAIL() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("last.pt"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("integrity"), std::string::npos);
  }
  // a file written before checksums is read unverified
  std::ofstream(p, std::ios::binary | std::ios::trunc) << payload;
  EXPECT_FALSE(read_checked_file(p).verified);
}

TEST(Files, ForwardedSignalsAreReceivedNotDelivered) {
  ForwardedSignals s;
  ::pthread_kill(::pthread_self(), SIGHUP);  // default action: death, unless blocked
  EXPECT_EQ(s.wait(1000), SIGHUP);
  EXPECT_EQ(s.wait(10), 0);
}

// A ChildProcess dies with the process that started it, even one killed by SIGKILL.
TEST(Files, ChildrenDieWithTheirParent) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t helper = ::fork();
  ASSERT_GE(helper, 0);
  if (helper == 0) {
    ChildProcess sleeper({"/bin/sleep", "30"});
    const int pid = sleeper.pid();
    if (::write(fds[1], &pid, sizeof pid) != sizeof pid) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  ::close(fds[1]);
  int sleeper = 0;
  ASSERT_EQ(::read(fds[0], &sleeper, sizeof sleeper), static_cast<ssize_t>(sizeof sleeper));
  ::close(fds[0]);
  ::kill(helper, SIGKILL);
  ::waitpid(helper, nullptr, 0);
  // gone, or a zombie waiting for whoever adopted it
  const auto alive = [&] {
    std::ifstream stat("/proc/" + std::to_string(sleeper) + "/stat");
    std::string pid, comm, state;
    return stat >> pid >> comm >> state && state != "Z" && state != "X";
  };
  for (int i = 0; i < 300 && alive(); ++i) ::usleep(10'000);
  EXPECT_FALSE(alive()) << "the child of a SIGKILLed parent still runs (pid " << sleeper << ")";
  if (alive()) ::kill(sleeper, SIGKILL);
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

// Mechanisms whose scores the lag features do not describe are named (relpos kernel refuses
// them), from their terms' metadata: content-gated biases, content phases, vector positions,
// learned lag tables. Position-driven maps and slope biases are described.
TEST(LagFeatures, MechanismsTheyCannotDescribeAreNamed) {
  for (const char* spec : {"fox", "grape_a", "grape_ap", "structured", "journey(angles=token)",
                           "grape_m(context=true)", "t5_bias", "kerple", "rope + fox"}) {
    const Mechanism m = build_mechanism(spec, 16, 2);
    EXPECT_FALSE(lag_features_refusal(m).empty()) << spec;
  }
  for (const char* spec : {"rope", "alibi", "damped_rope", "jordan(m=2)", "journey", "grape_m",
                           "orthogonal_mix + rope", "nope"}) {
    const Mechanism m = build_mechanism(spec, 16, 2);
    EXPECT_EQ(lag_features_refusal(m), "") << spec;
  }
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
