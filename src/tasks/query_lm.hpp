// The synthetic query-LM of Jordan-RoPE (jordan-rope.md 3.4, 3.5; Tables 5 and 10): T-1 random
// bits and a QUERY token; the label is the sign of a teacher kernel applied to the bits by lag.
//
// Vocabulary: BIT0 = 0, BIT1 = 1, QUERY = 2. A sequence of length T holds i.i.d. uniform bits at
// positions 0..T-2 and QUERY at T-1; the bit at position j has lag d = T-1-j in {1, ..., T-1}.
//   score = sum_j (2 bit_j - 1) K(T-1-j) / ||K(1..L_tr-1)||_2,     label = [score > 0]
// (or Bernoulli(sigmoid(logit_scale * score)) in the unused `stochastic` mode). The norm is the
// one of the training-length kernel at every length, so longer sequences get larger margins.
// The model reads the logits of the last position restricted to the two bit tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tasks/rng.hpp"

namespace relpos::tasks {

inline constexpr int64_t kQueryLmBit0 = 0;
inline constexpr int64_t kQueryLmBit1 = 1;
inline constexpr int64_t kQueryLmQuery = 2;
inline constexpr int64_t kQueryLmVocab = 3;

enum class QueryLmLabels { Threshold, Stochastic };

// One run configuration (the reference's kernel_lm block plus the model sizes it implies).
// Teachers, x = d / seq_len_train, omega = theta^(-2 target_freq_index / d_head),
// omega2 = theta^(-2 second_freq_index / d_head), d_head = d_model / n_heads (integer division):
//   mixed_raw            x cos(omega d)
//   mixed_bounded        (tau(d) / L) cos(omega d),  tau(d) = d / (1 + d / L), L = seq_len_train
//   damped_mixed         e^{-gamma d} (cos(omega d) + 0.75 x sin(omega d))
//   rhythm_envelope      (0.25 + 0.85 x)(0.65 cos(omega d) + 0.35 sin(omega2 d))
//   high_jet_r<r>        x^r cos(omega d)
//   scaled_high_jet_r<r> x^r e^{-scaled_c x} cos(omega d)
struct QueryLmConfig {
  std::string benchmark = "mixed_raw";
  int64_t seq_len_train = 1024;  // training length: the x scale and the normalisation length
  int64_t d_model = 128;
  int64_t n_heads = 4;
  int64_t n_layers = 3;
  int64_t mlp_ratio = 2;
  double theta = 1e4;
  int64_t target_freq_index = 3;
  int64_t second_freq_index = 5;
  double gamma = 1e-4;    // damped_mixed
  double scaled_c = 0.1;  // scaled_high_jet_r<r>
  QueryLmLabels label_mode = QueryLmLabels::Threshold;
  double logit_scale = 3.0;  // stochastic mode only
  uint64_t data_seed = 7107;
  uint64_t eval_seed = 9109;
  // Protocol.
  int64_t train_steps = 1200;
  int64_t batch_size = 24;
  int64_t eval_every = 600;  // and at the final step
  std::vector<int64_t> eval_lengths{1024, 2048, 4096, 8192};
  int64_t eval_batches = 32;
  int64_t eval_batch_size = 1;
  std::vector<int64_t> seeds{0, 1, 2};
  double lr = 5e-4;  // AdamW, constant, grad-norm clip 1.0
  double weight_decay = 0.01;
};

QueryLmConfig query_lm_table5();              // kernel_lm.yaml: mixed_raw, L 1024, d_head 32
QueryLmConfig query_lm_table10_second_jet();  // high_jet_kernel_lm_medium: scaled_high_jet_r2
QueryLmConfig query_lm_table10_third_jet();   // high_jet_kernel_lm_eta1: scaled_high_jet_r3
QueryLmConfig query_lm_smoke();               // kernel_lm_smoke.yaml: L 64, d_head 16, index 2

// Teacher names accepted in `benchmark` (for messages).
std::vector<std::string> query_lm_benchmarks();

// A config checked once: the teacher parsed, omegas and the training-length norm computed.
// InputError names the bad field (unknown benchmark with the valid ones, L < 2, d_head < 1, ...).
class QueryLmTeacher {
 public:
  explicit QueryLmTeacher(const QueryLmConfig& c);

  double raw(double d) const;            // K(d), unnormalised
  double norm() const { return norm_; }  // ||K(1..L-1)||_2, clamped below at 1e-6 as the reference
  double omega() const { return omega_; }
  double omega2() const { return omega2_; }
  // K(d) / norm() for d = 1..length-1 (element d-1).
  std::vector<double> kernel(int64_t length) const;
  const QueryLmConfig& config() const { return cfg_; }

 private:
  enum class Kind { MixedRaw, MixedBounded, DampedMixed, RhythmEnvelope, HighJet, ScaledHighJet };
  QueryLmConfig cfg_;
  Kind kind_ = Kind::MixedRaw;
  int order_ = 0;
  double omega_ = 0, omega2_ = 0, norm_ = 1;
};

// One batch: tokens [batch, length] row-major (last column QUERY), labels [batch] in {0, 1} and
// the normalised scores [batch].
struct QueryLmBatch {
  int64_t batch = 0;
  int64_t length = 0;
  std::vector<int64_t> tokens;
  std::vector<int64_t> labels;
  std::vector<double> scores;
};

// A stream of batches from one generator. Per batch it draws batch * (length - 1) bits in
// row-major order (then, in stochastic mode, one Bernoulli per row), as the reference's
// generate_batch does, so with the same seed it reproduces the reference run on a CPU device
// bit for bit (the published runs used CUDA generators).
// One batch of `length - 1` random bits (ids 0/1, drawn from `gen` row by row as the reference
// does) and the QUERY token; scores[b] = sum_j (2 bit_j - 1) weight[j] over the bit positions
// j = 0..length-2 (labels are left to the caller). Shared by the query-LM and the PJ bridge.
QueryLmBatch draw_query_batch(TorchCpuGenerator& gen, int64_t batch, int64_t length,
                              const std::vector<double>& weight);

class QueryLmGenerator {
 public:
  QueryLmGenerator(const QueryLmConfig& c, uint64_t generator_seed);
  QueryLmBatch next(int64_t length, int64_t batch);
  const QueryLmTeacher& teacher() const { return teacher_; }

 private:
  QueryLmTeacher teacher_;
  TorchCpuGenerator gen_;
  int64_t cached_length_ = -1;
  std::vector<double> kernel_;  // teacher_.kernel(cached_length_)
};

// Seeds of the reference protocol: training stream of run `seed` = data_seed + seed * 1000003
// (one stream per seed, shared by all methods); evaluation at `length` = eval_seed + seed * 1009 +
// length, a fresh generator at every evaluation. Arithmetic wraps modulo 2^64.
uint64_t query_lm_train_seed(const QueryLmConfig& c, int64_t seed);
uint64_t query_lm_eval_seed(const QueryLmConfig& c, int64_t seed, int64_t length);

// The training stream of run `seed` (batches of c.batch_size at c.seq_len_train via next()).
QueryLmGenerator query_lm_train_stream(const QueryLmConfig& c, int64_t seed);

// The evaluation set of run `seed` at `length`: c.eval_batches batches of c.eval_batch_size.
// Loss and accuracy are the means of the per-batch means (32 x 1 sequences in Table 5).
std::vector<QueryLmBatch> query_lm_eval_set(const QueryLmConfig& c, int64_t seed, int64_t length);

}  // namespace relpos::tasks
