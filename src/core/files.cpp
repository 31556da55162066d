#include "core/files.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string_view>

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

namespace {

int exit_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// The caller's environment with `overrides` set: built here rather than with setenv, which would
// change the whole process's environment under other threads.
std::vector<std::string> child_environment(
    const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view kv(*e);
    const bool replaced = std::any_of(overrides.begin(), overrides.end(), [&](const auto& o) {
      return kv.size() > o.first.size() && kv.substr(0, o.first.size()) == o.first &&
             kv[o.first.size()] == '=';
    });
    if (!replaced) env.emplace_back(kv);
  }
  for (const auto& [k, v] : overrides) env.push_back(k + "=" + v);
  return env;
}

std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

}  // namespace

ChildProcess::ChildProcess(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) throw InputError("no program to start");
  const auto env = child_environment(options.env);
  auto args = c_strings(argv);
  auto envp = c_strings(env);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (options.quiet) {
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  }
  if (!options.cwd.empty()) posix_spawn_file_actions_addchdir_np(&actions, options.cwd.c_str());
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0)
    throw InputError(fmt::format("cannot start '{}': {}", brief(argv[0]), std::strerror(rc)));
  pid_ = pid;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !status_) {
    ::kill(pid_, SIGKILL);
    wait();
  }
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)), status_(other.status_) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    ChildProcess old(std::move(*this));  // ends the child we held, if any
    pid_ = std::exchange(other.pid_, -1);
    status_ = other.status_;
  }
  return *this;
}

std::optional<int> ChildProcess::poll() {
  if (status_ || pid_ <= 0) return status_;
  int status = 0;
  pid_t r;
  while ((r = ::waitpid(pid_, &status, WNOHANG)) < 0 && errno == EINTR) {
  }
  if (r == pid_)
    status_ = exit_status(status);
  else if (r < 0)
    status_ = -1;  // not our child any more (reaped elsewhere): report a failure
  return status_;
}

int ChildProcess::wait() {
  if (status_ || pid_ <= 0) return status_.value_or(-1);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0)
    if (errno != EINTR) {
      status_ = -1;
      return -1;
    }
  status_ = exit_status(status);
  return *status_;
}

void ChildProcess::signal(int sig) {
  if (pid_ > 0 && !status_) ::kill(pid_, sig);
}

int run_program(const std::vector<std::string>& argv, const fs::path& cwd) {
  if (argv.empty()) return -1;
  try {
    ChildProcess child(argv, SpawnOptions{cwd, {}, true});
    return child.wait();
  } catch (const InputError&) {
    return -1;  // could not be started
  }
}

}  // namespace relpos
