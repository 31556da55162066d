// Token corpora for next-token language models and the reference's random-window sampling
// (jordan-rope.md 3.6; the byte, char and MIDI corpora all end up here). Batches are plain
// row-major int64 buffers that a training loop wraps in tensors without copying.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tasks/rng.hpp"

namespace relpos::tasks {

// A tokenised corpus: the training and validation streams and the vocabulary size (every token
// lies in [0, vocab_size)).
struct TokenCorpus {
  std::vector<int64_t> train;
  std::vector<int64_t> validation;
  int64_t vocab_size = 0;
};

// Receives the non-fatal problems a loader meets (a MIDI file skipped, ...). The default sink
// prints "relpos: warning: MESSAGE" on stderr.
using WarningSink = std::function<void(const std::string&)>;
void warn_to_stderr(const std::string& message);

// The whole file as bytes; InputError naming the path when it cannot be read.
std::string read_file_bytes(const std::filesystem::path& path);

// Index where a stream of n items splits: the first floor((1 - validation_fraction) * n) items
// train, the rest validate (fraction 0.1 gives Python's int(0.9 * n), the split of the JoFormer
// and PJ-RoPE loaders). The fraction must lie in (0, 1); InputError otherwise.
int64_t split_point(int64_t n, double validation_fraction);

// The sampling protocol of the reference byte / music LMs (jordan-rope.md 3.6-3.8).
struct LmProtocol {
  int64_t seq_len_train = 1024;  // T of the training windows
  int64_t batch_size = 4;
  int64_t train_steps = 1000;
  int64_t eval_every = 500;  // and at the final step
  std::vector<int64_t> eval_lengths{1024, 2048, 4096, 8192};
  int64_t eval_batches = 16;
  int64_t eval_batch_size = 1;
  uint64_t train_sample_seed = 1701;
  uint64_t eval_sample_seed = 20270505;
  std::vector<int64_t> seeds{0, 1, 2};
  // Optimiser settings of the same config (AdamW, constant lr, clip 1.0), for the training loop.
  double lr = 3e-4;
  double weight_decay = 0.1;
};
LmProtocol lm_protocol_wikitext103();         // lm_focused.yaml (Tables 8, 12)
LmProtocol lm_protocol_wikitext103_subset();  // high_jet_wikitext103_subset_500 (Tables 9, 13)
LmProtocol lm_protocol_music();               // audio_lm_*_transfer_long (Table 7)

// Seed of the training-window generator of run `seed`: train_sample_seed + seed * 1000003 (one
// stream per seed, shared by every method of that seed). Arithmetic wraps modulo 2^64.
uint64_t lm_train_generator_seed(const LmProtocol& p, int64_t seed);

// Training-window starts, drawn batch after batch from one TorchCpuGenerator: the reference draws
// them all at once (`torch.randint(0, N - T - 1, (steps, batch))`), which is the same stream. A
// start s is uniform in [0, N - T - 2] (the reference's exclusive bound), so the window
// tokens[s .. s + T] (T + 1 tokens: inputs and shifted targets) always fits. InputError when the
// stream has fewer than T + 2 tokens.
class WindowSampler {
 public:
  WindowSampler(int64_t n_tokens, int64_t seq_len, uint64_t generator_seed);
  std::vector<int64_t> next_starts(int64_t batch);
  int64_t seq_len() const { return seq_len_; }

 private:
  int64_t max_start_;  // exclusive
  int64_t seq_len_;
  TorchCpuGenerator gen_;
};

// The evaluation windows of one length: `batches` lists of eval_batch_size starts.
struct EvalStarts {
  int64_t length = 0;
  std::vector<std::vector<int64_t>> batches;
};
// The reference's make_eval_starts: one generator seeded eval_sample_seed (independent of the
// training seed), drawing for each eval length in order eval_batches batches of starts in
// [0, N - length - 2]; identical for every method and seed. InputError when the stream is too short
// for a length.
std::vector<EvalStarts> lm_eval_starts(int64_t n_tokens, const LmProtocol& p);

// Windows [B, T + 1], row-major: row b is tokens[starts[b] .. starts[b] + T]; inputs are columns
// 0..T-1 and targets columns 1..T. InputError when a window does not fit.
std::vector<int64_t> gather_windows(std::span<const int64_t> tokens,
                                    std::span<const int64_t> starts, int64_t seq_len);

}  // namespace relpos::tasks
