#include "tasks/corpus.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>

#include "core/types.hpp"

namespace relpos::tasks {

void warn_to_stderr(const std::string& message) {
  fmt::print(stderr, "relpos: warning: {}\n", message);
}

std::string read_file_bytes(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw InputError(fmt::format("{}: not a readable file", path.string()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot open for reading", path.string()));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw InputError(fmt::format("{}: read error", path.string()));
  return bytes;
}

int64_t split_point(int64_t n, double validation_fraction) {
  if (!(validation_fraction > 0.0 && validation_fraction < 1.0))
    throw InputError(fmt::format("validation fraction {} must lie strictly between 0 and 1",
                                 validation_fraction));
  return static_cast<int64_t>((1.0 - validation_fraction) * static_cast<double>(n));
}

LmProtocol lm_protocol_wikitext103() {
  return {};
}

LmProtocol lm_protocol_wikitext103_subset() {
  LmProtocol p;
  p.seq_len_train = 512;
  p.batch_size = 4;
  p.train_steps = 500;
  p.eval_every = 500;
  p.eval_lengths = {512, 1024, 2048, 4096, 8192};
  p.eval_batches = 2;
  p.eval_batch_size = 1;
  p.train_sample_seed = 5701;
  p.eval_sample_seed = 6701;
  p.lr = 5e-4;
  p.weight_decay = 0.05;
  return p;
}

LmProtocol lm_protocol_music() {
  LmProtocol p;
  p.seq_len_train = 256;
  p.batch_size = 32;
  p.train_steps = 800;
  p.eval_every = 200;
  p.eval_lengths = {256, 512, 1024, 2048};
  p.eval_batches = 32;
  p.eval_batch_size = 4;
  p.train_sample_seed = 1701;
  p.eval_sample_seed = 20270506;
  p.seeds = {0, 1, 2, 3, 4};
  p.lr = 6e-4;
  p.weight_decay = 0.05;
  return p;
}

uint64_t lm_train_generator_seed(const LmProtocol& p, int64_t seed) {
  return p.train_sample_seed + static_cast<uint64_t>(seed) * 1000003u;
}

namespace {
int64_t exclusive_max_start(int64_t n_tokens, int64_t seq_len, const char* what) {
  if (seq_len < 1) throw InputError(fmt::format("{} window length {} must be >= 1", what, seq_len));
  const int64_t max_start = n_tokens - seq_len - 1;
  if (max_start <= 0)
    throw InputError(fmt::format(
        "{} stream of {} tokens is too short for windows of length {} (needs at least {} tokens)",
        what, n_tokens, seq_len, seq_len + 2));
  return max_start;
}
}  // namespace

WindowSampler::WindowSampler(int64_t n_tokens, int64_t seq_len, uint64_t generator_seed)
    : max_start_(exclusive_max_start(n_tokens, seq_len, "training")),
      seq_len_(seq_len),
      gen_(generator_seed) {}

std::vector<int64_t> WindowSampler::next_starts(int64_t batch) {
  if (batch < 1) throw InputError(fmt::format("batch size {} must be >= 1", batch));
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  for (auto& s : starts) s = gen_.randint(0, max_start_);
  return starts;
}

std::vector<EvalStarts> lm_eval_starts(int64_t n_tokens, const LmProtocol& p) {
  if (p.eval_batches < 1 || p.eval_batch_size < 1)
    throw InputError(fmt::format("eval batches {} and eval batch size {} must be >= 1",
                                 p.eval_batches, p.eval_batch_size));
  TorchCpuGenerator gen(p.eval_sample_seed);
  std::vector<EvalStarts> out;
  for (int64_t length : p.eval_lengths) {
    const int64_t max_start = exclusive_max_start(n_tokens, length, "validation");
    EvalStarts e{length, {}};
    for (int64_t b = 0; b < p.eval_batches; ++b) {
      std::vector<int64_t> starts(static_cast<size_t>(p.eval_batch_size));
      for (auto& s : starts) s = gen.randint(0, max_start);
      e.batches.push_back(std::move(starts));
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<int64_t> gather_windows(std::span<const int64_t> tokens,
                                    std::span<const int64_t> starts, int64_t seq_len) {
  const auto n = static_cast<int64_t>(tokens.size());
  if (seq_len < 1) throw InputError(fmt::format("window length {} must be >= 1", seq_len));
  std::vector<int64_t> out;
  out.reserve(starts.size() * static_cast<size_t>(seq_len + 1));
  for (int64_t s : starts) {
    if (s < 0 || s > n - seq_len - 1)
      throw InputError(fmt::format(
          "window start {} with length {} does not fit a stream of {} tokens", s, seq_len, n));
    out.insert(out.end(), tokens.begin() + s, tokens.begin() + s + seq_len + 1);
  }
  return out;
}

}  // namespace relpos::tasks
