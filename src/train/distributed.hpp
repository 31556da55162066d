// Data parallel training on PyTorch's distributed backend (c10d): a TCPStore rendezvous and a Gloo
// process group (CPU). Every rank holds a full copy of the model and trains on its own share of the
// batch; after backward, allreduce_gradients() replaces each gradient by its mean over the ranks
// (flattened into buckets, one all-reduce per bucket), so every rank takes the same optimizer step.
//
// A process learns its place from the usual rendezvous environment (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, as torchrun sets it), so the same binary runs on one machine or several;
// launch_local() starts N local workers with that environment. Without the environment a process
// is rank 0 of 1 and every collective is a no-op.
//
// No c10d or Gloo header leaks out of this file: the process group lives behind a pointer.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace relpos::train {

// A peer that did not show up in time, or a collective that failed (a peer died). The message names
// this rank and the rendezvous address.
struct DistributedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct DistConfig {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // how long a rank waits for the others at the rendezvous and in each collective
  std::chrono::milliseconds timeout{60'000};
  int64_t bucket_bytes = 25 << 20;  // gradients are all-reduced in buckets of about this size

  bool distributed() const { return world_size > 1; }
  // InputError naming the bad field (rank outside [0, world_size), port outside 1..65535, ...)
  void validate() const;

  // From RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and RELPOS_DIST_TIMEOUT_S, seconds): none set
  // gives a single process; a partial or malformed set is an InputError naming the variable.
  static DistConfig from_environment();
  static DistConfig from_environment(const std::map<std::string, std::string>& env);
};

enum class Reduce { Sum, Mean, Max, Min };

// One rank's membership of the group. Collectives must be called in the same order on every rank,
// from one thread per rank (a group is not for concurrent use).
class DataParallel {
 public:
  DataParallel();  // DistConfig::from_environment()
  // Joins the rendezvous (rank 0 hosts the TCPStore) and builds the Gloo group; throws
  // DistributedError when a peer does not show up within config.timeout.
  explicit DataParallel(DistConfig config);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const { return config_.rank; }
  int world_size() const { return config_.world_size; }
  bool is_main() const { return config_.rank == 0; }  // only the main rank writes files
  bool distributed() const { return config_.distributed(); }
  const DistConfig& config() const { return config_; }

  // Copies rank 0's parameters and buffers onto every rank (call once, before training), after
  // checking that every rank holds the same layout (InputError otherwise).
  void broadcast_parameters(torch::nn::Module& module) const;
  void broadcast(const std::vector<torch::Tensor>& tensors) const;  // from rank 0, in place

  // Replaces the gradient of every parameter that requires one by its mean over the ranks, in
  // buckets of config.bucket_bytes (grouped by dtype, in reverse order of `params`, as the backward
  // pass produces them). A gradient missing on some ranks counts as zero there; one missing on
  // every rank stays missing. Call after backward, before clipping and the optimizer step.
  void allreduce_gradients(const std::vector<torch::Tensor>& params) const;

  // The element-wise reduction of `value` over the ranks (a new tensor; `value` is untouched):
  // for averaging a loss or summing token counts across ranks.
  torch::Tensor all_reduce(const torch::Tensor& value, Reduce op = Reduce::Mean) const;
  double mean(double value) const;

  void barrier() const;  // every rank waits for the others

  // how many all-reduces the last allreduce_gradients() issued (one per bucket)
  int last_bucket_count() const { return last_buckets_; }

 private:
  struct Group;
  DistConfig config_;
  std::unique_ptr<Group> group_;  // null for a single process
  mutable int last_buckets_ = 0;
};

// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released).
int free_port();

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> args;  // the workers' arguments (after the program name)
  int port = 0;                   // MASTER_PORT; 0: a free one
  std::filesystem::path program = "/proc/self/exe";
  std::vector<std::pair<std::string, std::string>> env;  // more variables for every worker
  // how long workers get to exit after SIGTERM, once one has failed, before SIGKILL
  std::chrono::milliseconds grace{5'000};
};

// Starts nproc copies of `program` (no shell) with RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set, stdout and stderr shared with
// this process, and waits for them. Returns 0 when all succeed, else the exit status of the first
// worker that failed, after terminating the others (so that none hangs waiting for a dead peer).
// SIGTERM, SIGHUP and SIGINT sent to the launcher are passed on to every worker (the launcher then
// returns 128 + the signal), and a launcher killed outright takes its workers with it
// (PR_SET_PDEATHSIG, core/files.hpp ChildProcess): no worker outlives it.
int launch_local(const LaunchOptions& options);
int launch_local(int nproc, const std::vector<std::string>& args, int port = 0);

// `args` without "--nproc N" / "--nproc=N" (what the launched workers get).
std::vector<std::string> without_nproc(const std::vector<std::string>& args);

}  // namespace relpos::train
