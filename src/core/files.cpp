#include "core/files.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>
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
  std::error_code ec;
  if (fs::is_directory(path, ec))
    throw InputError(
        fmt::format("cannot write '{}': it is a folder, not a file", brief(path.string())));
  const fs::path tmp = temp_path_for(path);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f)
      throw InputError(
          fmt::format("cannot write '{}': {}", brief(tmp.string()), std::strerror(errno)));
    f << text;
    if (!f.flush()) {
      fs::remove(tmp, ec);
      throw InputError(fmt::format("cannot write '{}' (disk full?)", brief(tmp.string())));
    }
  }
  // rename(2) itself: std::filesystem::rename reported some failures as "Success"
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    fs::remove(tmp, ec);
    throw InputError(
        fmt::format("cannot rename onto '{}': {}", brief(path.string()), std::strerror(err)));
  }
}

void check_name(const std::string& what, const std::string& name) {
  const auto bad = [&](const char* why) {
    throw InputError(
        fmt::format("{} '{}' {} (a name becomes a folder name: at most {} bytes, no "
                    "'/', '\\', '..' or control characters)",
                    what, brief(name, 60), why, kMaxNameBytes));
  };
  if (name.empty()) bad("is empty");
  if (name.size() > kMaxNameBytes) bad("is too long");
  if (name == "." || name.find("..") != std::string::npos) bad("contains '..' or is '.'");
  for (const char ch : name) {
    if (ch == '/' || ch == '\\') bad("contains a path separator");
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f)
      bad("contains a control character (NUL, newline, ...)");
  }
}

namespace {

// An open file descriptor, closed with its owner.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int release() { return std::exchange(fd, -1); }
};

std::string read_fd(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  off_t at = 0;
  while ((n = ::pread(fd, buf, sizeof buf, at)) > 0) {
    out.append(buf, static_cast<size_t>(n));
    at += n;
  }
  return out;
}

// "relpos KIND" from the first line of a lock file ("" when empty)
std::string lock_kind(const std::string& text) {
  const auto nl = text.find('\n');
  const std::string first = text.substr(0, nl);
  return first.rfind("relpos ", 0) == 0 ? first.substr(7) : std::string("?");
}

std::string holder_of(const std::string& text) {
  std::string h;
  for (size_t at = text.find('\n'); at != std::string::npos && at + 1 < text.size();) {
    const auto nl = text.find('\n', at + 1);
    h += (h.empty() ? "" : ", ") + text.substr(at + 1, nl - at - 1);
    at = nl;
  }
  return brief(h.empty() ? std::string("unknown") : h, 300);
}

// Checks that write nothing: the path itself (not a file, not under a file, not a dangling
// symlink, no over-long name).
void check_output_path(const fs::path& p, const char* what) {
  const std::string shown = brief(p.string(), 120);
  if (p.empty()) throw InputError(fmt::format("{}: empty path", what));
  if (p.native().size() > 4000)
    throw InputError(fmt::format("{} '{}' is too long ({} bytes)", what, shown, p.native().size()));
  for (const auto& part : p)
    if (part.native().size() > 255)
      throw InputError(fmt::format("{} '{}': the name '{}' is longer than 255 bytes", what, shown,
                                   brief(part.string(), 40)));
  std::error_code ec;
  const auto st = fs::symlink_status(p, ec);
  if (fs::is_symlink(st) && !fs::exists(p, ec))
    throw InputError(fmt::format("{} '{}' is a dangling symbolic link", what, shown));
  // the nearest existing ancestor must be a folder (else the path is under a file)
  for (fs::path a = p.parent_path(); !a.empty(); a = a.parent_path()) {
    if (fs::exists(a, ec)) {
      if (!fs::is_directory(a, ec))
        throw InputError(fmt::format("{} '{}' is under '{}', which is not a folder", what, shown,
                                     brief(a.string(), 120)));
      break;
    }
    if (a == a.parent_path()) break;
  }
}

bool folder_is_empty(const fs::path& dir) {
  std::error_code ec;
  return fs::directory_iterator(dir, ec) == fs::directory_iterator();
}

// An output of ours that holds no file but the lock and the marker (a run that failed on bad
// input before writing anything) counts as new: there is nothing to lose.
bool holds_nothing(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n != OutputDir::kLockFile && n != OutputDir::kMarker && temp_owner(n) < 0) return false;
  }
  return true;
}

// The kind/policy verdict on an output of ours found in `dir` (lock file text `text`).
void check_existing(const fs::path& dir, const std::string& text, const OutputDirOptions& o) {
  if (holds_nothing(dir)) return;
  const std::string kind = lock_kind(text);
  const std::string shown = brief(dir.string(), 120);
  if (kind != o.kind)
    throw InputError(fmt::format("--out '{}' holds a relpos {}, not a {}: choose another folder",
                                 shown, kind, o.kind));
  if (o.existing == Existing::Refuse)
    throw InputError(fmt::format("--out '{}' holds a relpos {} already (by {}): {}", shown, kind,
                                 holder_of(text), o.refuse_hint));
}

}  // namespace

void OutputDir::check(const fs::path& dir, const OutputDirOptions& o) {
  check_output_path(dir, "--out");
  std::error_code ec;
  const std::string shown = brief(dir.string(), 120);
  if (!fs::exists(dir, ec)) return;
  if (!fs::is_directory(dir, ec))
    throw InputError(fmt::format("--out '{}' is a file, not a folder", shown));
  const fs::path lock = dir / kLockFile;
  if (!fs::is_regular_file(fs::symlink_status(lock, ec))) {
    if (!folder_is_empty(dir))
      throw InputError(fmt::format(
          "--out '{}' is not empty and holds no relpos output (no {}): choose a new or empty "
          "folder; relpos never writes over files it did not make",
          shown, kLockFile));
    return;
  }
  Fd fd(::open(lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (fd.fd < 0)
    throw InputError(
        fmt::format("cannot open '{}': {}", brief(lock.string()), std::strerror(errno)));
  const std::string text = read_fd(fd.fd);
  if (::flock(fd.fd, LOCK_SH | LOCK_NB) != 0)
    throw InputError(
        fmt::format("--out '{}' is in use by another relpos ({})", shown, holder_of(text)));
  if (!text.empty()) check_existing(dir, text, o);
}

OutputDir::OutputDir(fs::path dir, const std::string& command)
    : OutputDir(std::move(dir), OutputDirOptions{"output", command, Existing::Replace, "", {}}) {}

OutputDir::OutputDir(fs::path dir, const OutputDirOptions& o) : dir_(std::move(dir)) {
  check(dir_, o);  // refusals before any write
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_))
    throw InputError(fmt::format("--out '{}' is not a writable folder: {}", brief(dir_.string()),
                                 ec ? ec.message() : std::string("not a folder")));
  const fs::path lock = dir_ / kLockFile;
  Fd fd(::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd.fd < 0)
    throw InputError(
        fmt::format("cannot open '{}': {}", brief(lock.string()), std::strerror(errno)));
  if (::flock(fd.fd, LOCK_EX | LOCK_NB) != 0)
    throw InputError(fmt::format("--out '{}' is in use by another relpos ({})",
                                 brief(dir_.string(), 120), holder_of(read_fd(fd.fd))));
  // under the lock, again: another process may have made an output here since check()
  const std::string text = read_fd(fd.fd);
  if (!text.empty() && !holds_nothing(dir_)) {
    check_existing(dir_, text, o);
    existed_ = true;
  }
  if (o.before_write) o.before_write();
  const std::string holder = fmt::format("relpos {}\npid {}\ncommand: {}\n", o.kind,
                                         static_cast<long>(::getpid()), brief(o.command, 2000));
  if (::ftruncate(fd.fd, 0) != 0 ||
      ::pwrite(fd.fd, holder.data(), holder.size(), 0) != static_cast<ssize_t>(holder.size()))
    throw InputError(
        fmt::format("cannot write '{}': {}", brief(lock.string()), std::strerror(errno)));
  lock_fd_ = fd.release();
  // temp files of runs that were killed (their process is gone)
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const long pid = temp_owner(e.path().filename().string());
    if (pid > 0 && pid != ::getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
      fs::remove(e.path(), ec);
  }
  write_file_atomic(dir_ / kMarker, fmt::format("run in progress or killed: pid {}\ncommand: {}\n",
                                                static_cast<long>(::getpid()), o.command));
}

OutputDir::~OutputDir() {
  // on an exception, leave no temp file of ours behind (the marker stays: the run did not finish)
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (temp_owner(e.path().filename().string()) == ::getpid()) fs::remove(e.path(), ec);
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
}

void OutputDir::write(const std::string& name, const std::string& text) const {
  write_file_atomic(dir_ / name, text);
}

void OutputDir::finish() {
  std::error_code ec;
  fs::remove(dir_ / kMarker, ec);
}

void check_output_file(const fs::path& path, const std::string& header, const std::string& what) {
  check_output_path(path, what.c_str());
  std::error_code ec;
  const std::string shown = brief(path.string(), 120);
  if (fs::is_symlink(fs::symlink_status(path, ec)))
    throw InputError(fmt::format(
        "{} '{}' is a symbolic link: relpos writes its output files in place of a link, so it "
        "refuses one; name the file itself",
        what, shown));
  if (fs::is_directory(path, ec))
    throw InputError(fmt::format("{} '{}' is a folder, not a file", what, shown));
  if (!fs::exists(path, ec)) return;
  std::ifstream in(path, std::ios::binary);
  std::string start(header.size(), '\0');
  in.read(start.data(), static_cast<std::streamsize>(header.size()));
  if (!in || start != header) {
    std::string expected;  // the header on one line
    for (const char c : brief(header, 60))
      expected += c == '\n' ? std::string("\\n") : std::string(1, c);
    throw InputError(fmt::format(
        "{} '{}' exists and was not written by this command (it does not start with '{}'): "
        "remove it or choose another path; relpos never writes over files it did not make",
        what, shown, expected));
  }
}

uint64_t checksum64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a, 64 bits
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

namespace {
constexpr std::string_view kChecksumTag = "relpos-checksum fnv1a64 ";

std::optional<uint64_t> parse_hex64(std::string_view s) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}
}  // namespace

void write_checked_file(const fs::path& path, const std::string& bytes) {
  write_file_atomic(path, fmt::format("{}{:016x}\n", kChecksumTag, checksum64(bytes)) + bytes);
}

CheckedFile read_checked_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("cannot read '{}'", brief(path.string())));
  std::ostringstream s;
  s << in.rdbuf();
  std::string all = s.str();
  if (all.compare(0, kChecksumTag.size(), kChecksumTag) != 0) return {std::move(all), false};
  const size_t head = kChecksumTag.size() + 17;
  const auto want = all.size() >= head && all[head - 1] == '\n'
                        ? parse_hex64(all.substr(kChecksumTag.size(), 16))
                        : std::nullopt;
  const std::string_view body = all.size() >= head ? std::string_view(all).substr(head) : "";
  if (!want || *want != checksum64(body))
    throw InputError(fmt::format(
        "'{}' fails its integrity check (the bytes changed since relpos wrote it): corrupt or "
        "edited; it is not used",
        brief(path.string())));
  return {all.substr(head), true};
}

ForwardedSignals::ForwardedSignals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGTERM, SIGHUP, SIGINT}) sigaddset(&set, sig);
  pthread_sigmask(SIG_BLOCK, &set, &old_mask_);
}

ForwardedSignals::~ForwardedSignals() {
  pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
}

int ForwardedSignals::wait(int timeout_ms) {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGTERM, SIGHUP, SIGINT}) sigaddset(&set, sig);
  const timespec t{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1'000'000};
  const int sig = ::sigtimedwait(&set, nullptr, &t);
  return sig > 0 ? sig : 0;
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
  // everything the child needs is made before fork: between fork and execve it may only make
  // async-signal-safe calls (this process may have other threads)
  const auto env = child_environment(options.env);
  auto args = c_strings(argv);
  auto envp = c_strings(env);
  const std::string cwd = options.cwd.string();
  const std::string log = options.log.string();
  int pipe_fds[2];  // the child reports a failed execve (errno) here; execve closes it on success
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0)
    throw InputError(fmt::format("cannot start '{}': {}", brief(argv[0]), std::strerror(errno)));
  Fd report_read(pipe_fds[0]), report_write(pipe_fds[1]);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0)
    throw InputError(fmt::format("cannot start '{}': {}", brief(argv[0]), std::strerror(errno)));
  if (pid == 0) {
    // the child: die with the thread that started us; if it is already gone, do not run at all
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    int err = 0;
    if (::getppid() != parent) ::_exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);  // a launcher blocks the signals it forwards
    if (options.quiet || !log.empty()) {
      const int out = options.quiet ? ::open("/dev/null", O_WRONLY)
                                    : ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (out < 0 || ::dup2(out, 1) < 0 || ::dup2(out, 2) < 0) err = errno ? errno : EIO;
    }
    if (!err && !cwd.empty() && ::chdir(cwd.c_str()) != 0) err = errno;
    if (!err) {
      ::execve(args[0], args.data(), envp.data());
      err = errno;
    }
    [[maybe_unused]] const auto n = ::write(report_write.fd, &err, sizeof err);
    ::_exit(127);
  }
  pid_ = pid;
  ::close(report_write.release());
  int err = 0;
  ssize_t n;
  while ((n = ::read(report_read.fd, &err, sizeof err)) < 0 && errno == EINTR) {
  }
  if (n == static_cast<ssize_t>(sizeof err)) {
    wait();  // reap the child that could not start
    pid_ = -1;
    status_.reset();
    throw InputError(fmt::format("cannot start '{}': {}", brief(argv[0]), std::strerror(err)));
  }
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
    ChildProcess child(argv, SpawnOptions{cwd, {}, true, {}});
    return child.wait();
  } catch (const InputError&) {
    return -1;  // could not be started
  }
}

}  // namespace relpos
