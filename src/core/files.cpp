#include "core/files.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <fstream>

#include "core/parse.hpp"
#include "core/types.hpp"

extern char** environ;

namespace relpos {

namespace fs = std::filesystem;

namespace {

std::atomic<unsigned> temp_counter{0};  // distinct temp names within one process

// ".NAME.tmp.PID.N" -> PID, or -1 when the name is not one of our temp files
long temp_owner(const std::string& name) {
  const auto t = name.rfind(".tmp.");
  if (name.empty() || name[0] != '.' || t == std::string::npos) return -1;
  const std::string rest = name.substr(t + 5);
  const auto dot = rest.find('.');
  if (dot == std::string::npos) return -1;
  const auto pid = parse_int64(rest.substr(0, dot), 1, 1 << 30);
  return pid ? static_cast<long>(*pid) : -1;
}

}  // namespace

fs::path temp_path_for(const fs::path& path) {
  return path.parent_path() / fmt::format(".{}.tmp.{}.{}", path.filename().string(),
                                          static_cast<long>(::getpid()), temp_counter++);
}

void write_file_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = temp_path_for(path);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw InputError(fmt::format("cannot write '{}'", brief(tmp.string())));
    f << text;
    if (!f.flush()) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw InputError(fmt::format("cannot write '{}' (disk full?)", brief(tmp.string())));
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw InputError(
        fmt::format("cannot rename onto '{}': {}", brief(path.string()), ec.message()));
  }
}

OutputDir::OutputDir(fs::path dir, const std::string& command) : dir_(std::move(dir)) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_))
    throw InputError(fmt::format("--out '{}' is not a writable directory", brief(dir_.string())));
  // temp files of runs that were killed (their process is gone)
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const long pid = temp_owner(e.path().filename().string());
    if (pid > 0 && pid != ::getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
      fs::remove(e.path(), ec);
  }
  write_file_atomic(dir_ / kMarker, fmt::format("run in progress or killed: pid {}\ncommand: {}\n",
                                                static_cast<long>(::getpid()), command));
}

OutputDir::~OutputDir() {
  // on an exception, leave no temp file of ours behind (the marker stays: the run did not finish)
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (temp_owner(e.path().filename().string()) == ::getpid()) fs::remove(e.path(), ec);
}

void OutputDir::write(const std::string& name, const std::string& text) const {
  write_file_atomic(dir_ / name, text);
}

void OutputDir::finish() {
  std::error_code ec;
  fs::remove(dir_ / kMarker, ec);
}

int run_program(const std::vector<std::string>& argv, const fs::path& cwd, ChildOutput output) {
  if (argv.empty()) return -1;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (output == ChildOutput::Discard) {
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  }
  posix_spawn_file_actions_addchdir_np(&actions, cwd.c_str());
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return -1;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace relpos
