// Output files and child processes, safely: atomic writes (temp file, then rename), output
// directories that say when they are incomplete, and external programs run without a shell.
#pragma once

#include <filesystem>
#include <string>
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

// Where a child's stdout and stderr go: /dev/null, or this process's own (a program run on the
// user's behalf, e.g. `relpos bench` running relpos-bench).
enum class ChildOutput { Discard, Inherit };

// Runs `argv[0]` (an absolute path) with arguments argv[1..] in directory `cwd`, through
// posix_spawn: no shell ever sees the arguments. stdout and stderr go to /dev/null unless
// `output` is Inherit. Returns the exit status (128 + signal when killed; -1 when the program
// could not be started).
int run_program(const std::vector<std::string>& argv, const std::filesystem::path& cwd,
                ChildOutput output = ChildOutput::Discard);

}  // namespace relpos
