#include "train/distributed.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

// ProcessGroupGloo.hpp includes Gloo's own headers, which the torch wheel does not ship; they come
// from Debian's libgloo-dev (scripts/install-deps.sh). Only declarations are used from them: the
// Gloo code that runs is the one inside libtorch_cpu, reached through c10d's exported functions.
#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/files.hpp"
#include "core/parse.hpp"
#include "core/types.hpp"

namespace relpos::train {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// configuration

void DistConfig::validate() const {
  if (world_size < 1) throw InputError(fmt::format("world size {} is not positive", world_size));
  if (rank < 0 || rank >= world_size)
    throw InputError(fmt::format("rank {} is not in [0, world size {})", rank, world_size));
  if (timeout.count() <= 0) throw InputError("the distributed timeout must be positive");
  if (bucket_bytes <= 0)
    throw InputError(fmt::format("bucket size {} bytes is not positive", bucket_bytes));
  if (distributed()) {
    if (master_addr.empty()) throw InputError("MASTER_ADDR (the rendezvous address) is empty");
    if (master_port < 1 || master_port > 65535)
      throw InputError(fmt::format("MASTER_PORT {} is not in 1..65535", master_port));
  }
}

DistConfig DistConfig::from_environment(const std::map<std::string, std::string>& env) {
  const auto get = [&](const char* k) -> std::optional<std::string> {
    const auto it = env.find(k);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  const auto rank = get("RANK"), world = get("WORLD_SIZE");
  DistConfig c;
  if (!rank && !world) return c;  // not launched as a worker: a single process
  if (!rank || !world)
    throw InputError(fmt::format(
        "{} is set but {} is not: a distributed worker needs RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT",
        rank ? "RANK" : "WORLD_SIZE", rank ? "WORLD_SIZE" : "RANK"));
  const auto ws = parse_int64(*world, 1, 1 << 20);
  if (!ws)
    throw InputError(fmt::format("WORLD_SIZE='{}' is not a positive integer", brief(*world)));
  c.world_size = static_cast<int>(*ws);
  const auto r = parse_int64(*rank, 0, c.world_size - 1);
  if (!r)
    throw InputError(
        fmt::format("RANK='{}' is not an integer in [0, WORLD_SIZE={})", brief(*rank), *ws));
  c.rank = static_cast<int>(*r);
  if (c.distributed()) {
    const auto addr = get("MASTER_ADDR"), port = get("MASTER_PORT");
    if (!addr || addr->empty())
      throw InputError("WORLD_SIZE > 1 but MASTER_ADDR (the address of rank 0) is not set");
    if (!port) throw InputError("WORLD_SIZE > 1 but MASTER_PORT (rank 0's port) is not set");
    const auto p = parse_int64(*port, 1, 65535);
    if (!p) throw InputError(fmt::format("MASTER_PORT='{}' is not in 1..65535", brief(*port)));
    c.master_addr = *addr;
    c.master_port = static_cast<int>(*p);
  }
  if (const auto t = get("RELPOS_DIST_TIMEOUT_S")) {
    const auto s = parse_finite_double(*t);
    if (!s || *s <= 0 || *s > 1e6)
      throw InputError(
          fmt::format("RELPOS_DIST_TIMEOUT_S='{}' is not a positive number of seconds", brief(*t)));
    c.timeout = std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(*s * 1000)));
  }
  return c;
}

DistConfig DistConfig::from_environment() {
  std::map<std::string, std::string> env;
  for (const char* k :
       {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RELPOS_DIST_TIMEOUT_S"})
    if (const char* v = std::getenv(k)) env[k] = v;
  return from_environment(env);
}

// ---------------------------------------------------------------------------------------------
// the process group

struct DataParallel::Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

namespace {

std::string where(const DistConfig& c) {
  return fmt::format("rank {} of {} (rendezvous {}:{})", c.rank, c.world_size, c.master_addr,
                     c.master_port);
}

double seconds(std::chrono::milliseconds t) {
  return static_cast<double>(t.count()) / 1000.0;
}

// First line of a c10d / Gloo message (the rest is a C++ backtrace).
std::string first_line(const char* what) {
  std::string s(what);
  if (const auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  return brief(s, 400);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// The Gloo device (the address this rank's pairs listen on). All ranks on one machine: loopback.
// Several machines: the interface named by GLOO_SOCKET_IFNAME (as in PyTorch), else the address
// this machine's hostname resolves to (Gloo falls back to loopback when it resolves to none).
std::shared_ptr<gloo::transport::Device> gloo_device(const DistConfig& c) {
  if (is_loopback(c.master_addr))
    return c10d::ProcessGroupGloo::createDeviceForHostname(c.master_addr == "::1" ? "::1"
                                                                                  : "127.0.0.1");
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// Waits for one collective; a c10d / Gloo failure becomes a DistributedError naming the rank.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const DistConfig& c,
              const std::string& what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw DistributedError(
        fmt::format("{}: {} failed (a peer died or did not answer within {} s): {}", where(c), what,
                    seconds(c.timeout), first_line(e.what())));
  }
}

// Tensors packed into flat buckets of one dtype and at most `bytes` (a larger tensor is a bucket
// of its own), keeping the order of `tensors` within each dtype.
std::vector<std::vector<size_t>> make_buckets(const std::vector<torch::Tensor>& tensors,
                                              int64_t bytes) {
  std::vector<std::vector<size_t>> done;
  std::map<torch::ScalarType, std::pair<std::vector<size_t>, int64_t>> open;  // dtype -> bucket
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto& [members, size] = open[tensors[i].scalar_type()];
    const int64_t b = tensors[i].numel() * static_cast<int64_t>(tensors[i].element_size());
    if (!members.empty() && size + b > bytes) {
      done.push_back(std::move(members));
      members.clear();
      size = 0;
    }
    members.push_back(i);
    size += b;
  }
  for (auto& [dtype, bucket] : open)
    if (!bucket.first.empty()) done.push_back(std::move(bucket.first));
  return done;
}

void check_dense(const torch::Tensor& t, const char* what) {
  if (t.is_sparse() || t.layout() != torch::kStrided)
    throw InputError(fmt::format("data parallel: {} is not a dense tensor", what));
}

}  // namespace

DataParallel::DataParallel() : DataParallel(DistConfig::from_environment()) {}

DataParallel::DataParallel(DistConfig config) : config_(std::move(config)) {
  config_.validate();
  if (!config_.distributed()) return;
  auto group = std::make_unique<Group>();
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(config_.master_port);
  so.isServer = config_.rank == 0;
  so.numWorkers = static_cast<size_t>(config_.world_size);
  so.waitWorkers = true;  // rank 0 returns only once every rank has connected
  so.timeout = config_.timeout;
  try {
    group->store = c10::make_intrusive<c10d::TCPStore>(config_.master_addr, so);
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format("{}: {} within {} s: {}", where(config_),
                                       config_.rank == 0
                                           ? "not every rank joined the rendezvous"
                                           : "could not join the rendezvous hosted by rank 0",
                                       seconds(config_.timeout), first_line(e.what())));
  }
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(config_.timeout);
    options->devices.push_back(gloo_device(config_));
    // a prefix of our own, so that other groups could share the store
    auto store = c10::make_intrusive<c10d::PrefixStore>("relpos/dp/", group->store);
    group->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, config_.rank,
                                                                 config_.world_size, options);
  } catch (const std::exception& e) {
    throw DistributedError(
        fmt::format("{}: connecting the Gloo process group failed within {} s: {}", where(config_),
                    seconds(config_.timeout), first_line(e.what())));
  }
  group_ = std::move(group);
}

DataParallel::~DataParallel() = default;

void DataParallel::broadcast(const std::vector<torch::Tensor>& tensors) const {
  if (!group_) return;
  torch::NoGradGuard no_grad;
  for (const auto& t : tensors) check_dense(t, "a broadcast tensor");
  const auto buckets = make_buckets(tensors, config_.bucket_bytes);
  std::vector<torch::Tensor> flats;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto& b : buckets) {
    std::vector<torch::Tensor> parts;
    for (size_t i : b) parts.push_back(tensors[i].reshape({-1}));
    std::vector<torch::Tensor> io = {torch::cat(parts)};
    c10d::BroadcastOptions o;
    o.rootRank = 0;
    works.push_back(group_->backend->broadcast(io, o));
    flats.push_back(io[0]);
  }
  for (size_t k = 0; k < buckets.size(); ++k) {
    wait_for(works[k], config_, fmt::format("broadcast of bucket {}/{}", k + 1, buckets.size()));
    int64_t off = 0;
    for (size_t i : buckets[k]) {
      const auto& t = tensors[i];
      t.copy_(flats[k].narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

void DataParallel::broadcast_parameters(torch::nn::Module& module) const {
  if (!group_) return;
  std::vector<torch::Tensor> tensors = module.parameters();
  for (const auto& b : module.buffers()) tensors.push_back(b);
  // Every rank must hold the same layout, or the buckets would not line up: compare a digest of
  // the names, shapes and dtypes (max and min over the ranks agree only if all digests do).
  std::string layout;
  const auto describe = [&](const std::string& name, const torch::Tensor& t) {
    layout += name + ":" + std::string(c10::toString(t.scalar_type()));
    for (const auto d : t.sizes()) layout += fmt::format(",{}", d);
    layout += ";";
  };
  for (const auto& p : module.named_parameters()) describe(p.key(), p.value());
  for (const auto& b : module.named_buffers()) describe(b.key(), b.value());
  const auto digest = static_cast<int64_t>(std::hash<std::string>{}(layout) >> 1);
  const auto n = static_cast<int64_t>(tensors.size());
  // max over the ranks of (d, n, -d, -n) is (max d, max n, -min d, -min n): equal to ours on every
  // rank only if all ranks agree
  const auto mine = torch::tensor({digest, n, -digest, -n}, torch::kLong);
  if (!torch::equal(all_reduce(mine, Reduce::Max), mine))
    throw InputError(fmt::format(
        "{}: the ranks hold different models (parameter names, shapes or dtypes differ)",
        where(config_)));
  broadcast(tensors);
}

void DataParallel::allreduce_gradients(const std::vector<torch::Tensor>& params) const {
  last_buckets_ = 0;
  if (!group_) return;  // one rank: its gradients are already the mean
  torch::NoGradGuard no_grad;
  // reverse order: backward produces the last layers' gradients first (as torch's DDP buckets)
  std::vector<torch::Tensor> ps;
  for (auto it = params.rbegin(); it != params.rend(); ++it)
    if (it->requires_grad()) {
      check_dense(*it, "a parameter");
      if (it->grad().defined()) check_dense(it->grad(), "a gradient");
      ps.push_back(*it);
    }
  const auto buckets = make_buckets(ps, config_.bucket_bytes);
  // Each bucket: the gradients, then one flag per parameter (1 where this rank has a gradient);
  // after the sum the flags say which gradients exist somewhere, the same on every rank.
  std::vector<torch::Tensor> flats;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto& b : buckets) {
    std::vector<torch::Tensor> parts;
    std::vector<double> flags;
    for (size_t i : b) {
      const auto& g = ps[i].grad();
      parts.push_back(g.defined() ? g.reshape({-1})
                                  : torch::zeros({ps[i].numel()}, ps[i].options()));
      flags.push_back(g.defined() ? 1.0 : 0.0);
    }
    parts.push_back(torch::tensor(flags, ps[b[0]].options().requires_grad(false)));
    std::vector<torch::Tensor> io = {torch::cat(parts)};
    works.push_back(group_->backend->allreduce(io));  // SUM: Gloo has no AVG
    flats.push_back(io[0]);
  }
  last_buckets_ = static_cast<int>(buckets.size());
  const double ws = config_.world_size;
  for (size_t k = 0; k < buckets.size(); ++k) {
    wait_for(works[k], config_,
             fmt::format("gradient all-reduce of bucket {}/{}", k + 1, buckets.size()));
    const auto& b = buckets[k];
    const auto& flat = flats[k];
    const int64_t count = flat.numel() - static_cast<int64_t>(b.size());
    const auto present = flat.narrow(0, count, static_cast<int64_t>(b.size())).gt(0.5).cpu();
    const auto has = present.accessor<bool, 1>();
    flat.narrow(0, 0, count).div_(ws);
    int64_t off = 0;
    for (size_t j = 0; j < b.size(); ++j) {
      auto& p = ps[b[j]];
      const auto mean = flat.narrow(0, off, p.numel()).view(p.sizes());
      off += p.numel();
      if (!has[static_cast<int64_t>(j)]) continue;
      if (p.grad().defined())
        p.mutable_grad().copy_(mean);
      else
        p.mutable_grad() = mean.clone();
    }
  }
}

torch::Tensor DataParallel::all_reduce(const torch::Tensor& value, Reduce op) const {
  check_dense(value, "an all-reduced value");
  auto t = value.detach().clone().contiguous();
  if (op == Reduce::Mean && !t.is_floating_point()) t = t.to(torch::kDouble);
  if (!group_) return t;
  c10d::AllreduceOptions o;
  o.reduceOp = op == Reduce::Max   ? c10d::ReduceOp::MAX
               : op == Reduce::Min ? c10d::ReduceOp::MIN
                                   : c10d::ReduceOp::SUM;
  std::vector<torch::Tensor> io = {t};
  wait_for(group_->backend->allreduce(io, o), config_, "all-reduce");
  if (op == Reduce::Mean) t.div_(static_cast<double>(config_.world_size));
  return t;
}

double DataParallel::mean(double value) const {
  return all_reduce(torch::tensor(value, torch::kDouble), Reduce::Mean).item<double>();
}

void DataParallel::barrier() const {
  if (!group_) return;
  wait_for(group_->backend->barrier(), config_, "barrier");
}

// ---------------------------------------------------------------------------------------------
// local launcher

namespace {

// A socket that is closed when it goes out of scope.
struct Socket {
  int fd;
  explicit Socket(int f) : fd(f) {}
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
};

}  // namespace

int free_port() {
  Socket s(::socket(AF_INET, SOCK_STREAM, 0));
  if (s.fd < 0) throw DistributedError("cannot open a socket to find a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;  // the kernel picks one
  socklen_t len = sizeof a;
  if (::bind(s.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(s.fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw DistributedError("cannot bind a socket on 127.0.0.1 to find a free port");
  return ntohs(a.sin_port);
}

std::vector<std::string> without_nproc(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--") {  // the rest is positional
      out.insert(out.end(), args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
      break;
    }
    if (args[i] == "--nproc") {
      ++i;  // and its value
      continue;
    }
    if (args[i].rfind("--nproc=", 0) == 0) continue;
    out.push_back(args[i]);
  }
  return out;
}

int launch_local(const LaunchOptions& o) {
  if (o.nproc < 1 || o.nproc > 1024)
    throw InputError(fmt::format("--nproc {} is not in 1..1024", o.nproc));
  // the real path, so that the workers' argv[0] (and their messages) name the program
  fs::path program = o.program;
  if (program == "/proc/self/exe") program = fs::read_symlink(program);
  const int port = o.port ? o.port : free_port();
  std::vector<std::string> argv = {program.string()};
  for (auto& a : without_nproc(o.args)) argv.push_back(std::move(a));

  // SIGTERM, SIGHUP and SIGINT are passed on to the workers (blocked here before the first one
  // starts, so none is lost); the workers also die with this process (ChildProcess)
  ForwardedSignals signals;
  int received = 0;
  std::vector<ChildProcess> workers;
  for (int r = 0; r < o.nproc; ++r) {
    SpawnOptions so;
    so.env = {{"RANK", std::to_string(r)},
              {"LOCAL_RANK", std::to_string(r)},
              {"WORLD_SIZE", std::to_string(o.nproc)},
              {"LOCAL_WORLD_SIZE", std::to_string(o.nproc)},
              {"MASTER_ADDR", "127.0.0.1"},
              {"MASTER_PORT", std::to_string(port)}};
    so.env.insert(so.env.end(), o.env.begin(), o.env.end());
    workers.emplace_back(argv, so);  // a failure here kills the ones started (their destructors)
  }

  // Poll rather than waitpid(-1): other children of this process are none of our business.
  std::optional<int> failure;
  for (;;) {
    bool running = false;
    for (int r = 0; r < o.nproc; ++r) {
      const auto s = workers[static_cast<size_t>(r)].poll();
      if (!s) {
        running = true;
      } else if (*s != 0 && !failure && !received) {
        failure = *s;
        std::cerr << fmt::format(
            "relpos: worker {} of {} failed (exit status {}); stopping the others\n", r, o.nproc,
            *s);
      }
    }
    if (failure || !running) break;
    if (const int sig = signals.wait(20); sig && !received) {
      received = sig;
      for (auto& w : workers) w.signal(sig);
      failure = 128 + sig;  // then as a failure: a grace period, SIGKILL for what is left
    }
  }
  if (failure) {
    for (auto& w : workers) w.signal(SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + o.grace;
    while (std::chrono::steady_clock::now() < deadline &&
           std::any_of(workers.begin(), workers.end(), [](auto& w) { return !w.poll(); }))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    // the destructors SIGKILL and reap whatever is left
  }
  return failure.value_or(0);
}

int launch_local(int nproc, const std::vector<std::string>& args, int port) {
  LaunchOptions o;
  o.nproc = nproc;
  o.args = args;
  o.port = port;
  return launch_local(o);
}

}  // namespace relpos::train
