// Output files and child processes, safely: atomic writes (temp file, then rename), output
// directories that say when they are incomplete, and external programs run without a shell.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace relpos {

// Writes `text` to `path` atomically: a temp file unique to this process in the same directory,
// flushed, then renamed over `path`. Readers never see a half-written file; two processes writing
// the same path never share a temp file. Throws InputError naming the path on failure.
void write_file_atomic(const std::filesystem::path& path, const std::string& text);

// A unique temp name beside `path` for this process: ".NAME.tmp.PID.N".
std::filesystem::path temp_path_for(const std::filesystem::path& path);

// An output directory for one run. While the run is going the directory holds a file INCOMPLETE
// (with the process id and the command); it is removed only by finish(), so a killed run leaves
// the marker behind. Opening a directory removes temp files left by processes that no longer run.
class OutputDir {
 public:
  OutputDir(std::filesystem::path dir, const std::string& command);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  const std::filesystem::path& path() const { return dir_; }
  void write(const std::string& name, const std::string& text) const;
  void finish();  // the run completed: remove the INCOMPLETE marker

  static constexpr const char* kMarker = "INCOMPLETE";

 private:
  std::filesystem::path dir_;
};

// Runs `argv[0]` (an absolute path) with arguments argv[1..] in directory `cwd`, through
// posix_spawn: no shell ever sees the arguments. stdout and stderr go to /dev/null. Returns the
// exit status (128 + signal when killed; -1 when the program could not be started).
int run_program(const std::vector<std::string>& argv, const std::filesystem::path& cwd);

struct SpawnOptions {
  std::filesystem::path cwd;  // empty: the caller's working directory
  // variables set (or replaced) in the child's environment; the rest is the caller's
  std::vector<std::pair<std::string, std::string>> env;
  bool quiet = false;  // stdout and stderr to /dev/null (else the caller's)
};

// One child process started through posix_spawn (no shell), not waited for. The destructor kills
// (SIGKILL) and reaps a child that is still running, so that no child outlives its owner or stays
// a zombie when an exception unwinds.
class ChildProcess {
 public:
  // Starts `argv[0]` (a path) with arguments argv[1..]; InputError naming it when that fails.
  ChildProcess(const std::vector<std::string>& argv, const SpawnOptions& options = {});
  ~ChildProcess();
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  int pid() const { return pid_; }
  // the exit status (128 + signal when killed) once the child has ended; nullopt while it runs
  std::optional<int> poll();
  int wait();            // blocks until the child ends; its exit status
  void signal(int sig);  // no-op once the child has been reaped

 private:
  int pid_ = -1;
  std::optional<int> status_;
};

}  // namespace relpos
