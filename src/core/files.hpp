// Output files and child processes, safely: atomic writes (temp file, then rename), output
// directories that say when they are incomplete, and external programs run without a shell.
#pragma once

#include <signal.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace relpos {

// Writes `text` to `path` atomically: a temp file unique to this process in the same directory,
// flushed, then renamed over `path`. Readers never see a half-written file; two processes writing
// the same path never share a temp file. Throws InputError naming the path on failure.
void write_file_atomic(const std::filesystem::path& path, const std::string& text);

// A unique temp name beside `path` for this process: ".NAME.tmp.PID.N".
std::filesystem::path temp_path_for(const std::filesystem::path& path);

// The one rule for names that become folder names (a training run's name, a sweep's and its
// settings', an experiment's): non-empty, at most kMaxNameBytes bytes, no '/' or '\\', no "..",
// not ".", no control character (NUL, newline, ...). InputError "WHAT 'NAME' ..." otherwise.
constexpr size_t kMaxNameBytes = 128;
void check_name(const std::string& what, const std::string& name);

// What an output folder that already holds an output of ours (same kind) is for:
enum class Existing {
  Refuse,    // refuse it (train without --resume or --overwrite)
  Continue,  // continue in it (train --resume, sweeps and reproduce, which skip finished runs)
  Replace,   // write over its files (train --overwrite, reports that a command regenerates)
};

struct OutputDirOptions {
  std::string kind = "output";  // "run" (train), "sweep" (sweep, reproduce), "output" (reports)
  std::string command;          // who holds the folder, for the lock file and the marker
  Existing existing = Existing::Replace;
  // what the Refuse message tells the user to do
  std::string refuse_hint = "--resume continues it, --overwrite replaces it";
  // the caller's own refusals (train --resume: a changed configuration), run under the lock
  // before anything is written; an InputError from it leaves the folder byte-identical
  std::function<void()> before_write;
};

// The run-folder discipline, one place for every command that writes a folder (train, sweep,
// reproduce, the probes' and reports' --out): docs/errors.md, "Output directories".
//  - Before any write: the path must be a folder or not exist (not a file, not under a file, not a
//    dangling symlink, names <= 255 bytes); an existing non-empty folder must be ours (it holds the
//    lock file .relpos-run naming its kind), else it is refused: no user file is ever replaced.
//  - The folder is locked (flock on .relpos-run, held while this object lives): a second process
//    on the same folder is refused with the holder's pid and command. An existing output of ours
//    is refused, continued or replaced as OutputDirOptions::existing says.
//  - While the run goes, INCOMPLETE holds the pid and the command; finish() removes it last, so a
//    killed run leaves the marker behind. Temp files of processes that no longer run are removed.
// Every refusal is an InputError naming the folder and the reason.
class OutputDir {
 public:
  OutputDir(std::filesystem::path dir, const std::string& command);  // a report ("output")
  OutputDir(std::filesystem::path dir, const OutputDirOptions& options);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  // The checks of the constructor that write nothing (a launcher's, before it starts workers).
  static void check(const std::filesystem::path& dir, const OutputDirOptions& options);

  const std::filesystem::path& path() const { return dir_; }
  // the folder held an output of ours before (a run to resume, a sweep to continue)
  bool existed() const { return existed_; }
  void write(const std::string& name, const std::string& text) const;
  void finish();  // the run completed: remove the INCOMPLETE marker

  static constexpr const char* kMarker = "INCOMPLETE";
  static constexpr const char* kLockFile = ".relpos-run";

 private:
  std::filesystem::path dir_;
  int lock_fd_ = -1;
  bool existed_ = false;
};

// An output file that a command writes whole (eval --profiles, bench --json-out): refused
// (InputError naming `what` - the flag - the path and why) when it is a folder, a symbolic link
// (dangling or not: the file written would replace the link, not what it points to), under a
// file, has an over-long name, or exists without starting with `header` (a file that is not an
// earlier output of the same command). Call it before the work, and again before the write
// (write_file_atomic).
void check_output_file(const std::filesystem::path& path, const std::string& header,
                       const std::string& what = "output file");

// Files with an integrity check (checkpoints): a first line "relpos-checksum fnv1a64 HEX" over
// the bytes that follow. read_checked_file throws InputError naming the file when the bytes do not
// match; a file without the line (written before checksums) is returned with verified = false.
uint64_t checksum64(std::string_view bytes);
void write_checked_file(const std::filesystem::path& path, const std::string& bytes);
struct CheckedFile {
  std::string bytes;
  bool verified = false;
};
CheckedFile read_checked_file(const std::filesystem::path& path);

// Blocks SIGTERM, SIGHUP and SIGINT in the calling thread while it lives, so that a launcher
// receives them with wait() and passes them on to its children instead of dying and leaving them
// (children started by ChildProcess begin with an empty signal mask). The destructor restores the
// previous mask.
class ForwardedSignals {
 public:
  ForwardedSignals();
  ~ForwardedSignals();
  ForwardedSignals(const ForwardedSignals&) = delete;
  ForwardedSignals& operator=(const ForwardedSignals&) = delete;
  // a signal received within `timeout_ms`, or 0
  int wait(int timeout_ms);

 private:
  sigset_t old_mask_{};
};

// Runs `argv[0]` (an absolute path) with arguments argv[1..] in directory `cwd`, as a ChildProcess:
// no shell ever sees the arguments. stdout and stderr go to /dev/null. Returns the
// exit status (128 + signal when killed; -1 when the program could not be started).
int run_program(const std::vector<std::string>& argv, const std::filesystem::path& cwd);

struct SpawnOptions {
  std::filesystem::path cwd;  // empty: the caller's working directory
  // variables set (or replaced) in the child's environment; the rest is the caller's
  std::vector<std::pair<std::string, std::string>> env;
  bool quiet = false;         // stdout and stderr to /dev/null (else the caller's)
  std::filesystem::path log;  // non-empty: stdout and stderr appended to this file
};

// One child process started with fork + execve (no shell), not waited for. Between the two the
// child asks for SIGKILL when the thread that started it dies (PR_SET_PDEATHSIG; posix_spawn has
// no way to), and exits at once if its parent is already gone, so a launcher killed even by
// SIGKILL leaves no child running. The destructor kills (SIGKILL) and reaps a child that is still
// running, so that no child outlives its owner or stays a zombie when an exception unwinds.
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
