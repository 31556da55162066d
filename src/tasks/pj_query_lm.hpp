// The PJ-RoPE synthetic sequence bridge (spec pj-rope.md 3.3, synthetic_query_lm.py; paper Fig. 4
// and the synthetic rows of Table 10): T-1 random bits and a QUERY token; the label is read from a
// teacher kernel over the lags of the bits from the query.
//
// Vocabulary: BIT0 = 0, BIT1 = 1, QUERY = 2 (as the Jordan query-LM, tasks/query_lm.hpp). A
// sequence of length T holds i.i.d. uniform bits b_j in {-1, +1} (ids 0/1) at positions 0..T-2 and
// QUERY at T-1; the bit at position j has lag d = T-1-j in {1, ..., T-1}. With x = d / L
// (L = the training length, also at evaluation) and omega = 2 pi cycles / L, the target kernels are
//   phase            cos(omega d)
//   first_jet        x cos(omega d)
//   second_jet       x^2 e^{-0.1 x} cos(omega d)
//   third_jet        x^3 e^{-0.1 x} cos(omega d)
//   affine           -0.4 x
//   recency_weak_jet -0.4 x + 0.15 x^2 cos(omega d)
//   lc_core          cos(omega phi_L(d)) (1 + 0.4 beta_L(d) + 0.2 beta_L(d)^2)
//   lc_affine        lc_core - 0.25 asinh(d / L)
// (the fixed-kernel targets of probes/targets.hpp, pj_target, with affine = -0.4 x). Teachers turn
// the kernel k over the sequence's own lags [T-1, ..., 1] into coefficients c_j:
//   signed     c = k / max(||k||_2, 1e-12)
//   attention  c = softmax(lambda k)
// score = sum_j b_j c_j; label = [score > 0], or with the median threshold [score > median of the
// batch's scores] (torch.median: the lower middle value, so an even batch of distinct scores has
// exactly half its labels 1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tasks/query_lm.hpp"
#include "tasks/rng.hpp"

namespace relpos::tasks {

struct PjQueryLmConfig {
  std::string target = "first_jet";
  std::string teacher = "signed";  // signed | attention
  double lambda = 4.0;             // attention teacher: softmax(lambda k)
  double cycles = 17.0;            // omega = 2 pi cycles / L
  int64_t train_length = 96;       // L: the x scale of the kernel
  bool median_threshold = false;
  // Training sequence lengths (empty: train_length only) and how a step picks one: "cycle"
  // (step s uses lengths[s mod n]) or "random" (uniform, drawn from the data generator).
  std::vector<int64_t> train_lengths;
  std::string length_sampling = "cycle";
  // The training stream of run `seed` draws from data_seed + seed * 1000003, the evaluation set at
  // length T from eval_seed + seed * 1009 + T (the Jordan query-LM's scheme).
  uint64_t data_seed = 7107;
  uint64_t eval_seed = 9109;
  int64_t eval_batches = 8;
  int64_t eval_batch_size = 96;
};

std::vector<std::string> pj_query_lm_targets();
std::vector<std::string> pj_query_lm_teachers();

// A checked configuration: InputError names an unknown target or teacher (with the valid ones), a
// bad length, lambda or sampling rule.
class PjQueryLmTeacher {
 public:
  explicit PjQueryLmTeacher(const PjQueryLmConfig& c);
  double kernel(double d) const;  // the target kernel at lag d (scale L = train_length)
  double omega() const { return omega_; }
  // The coefficients c_j of positions j = 0..length-2 (lag length-1-j), teacher applied.
  std::vector<double> coefficients(int64_t length) const;
  const PjQueryLmConfig& config() const { return cfg_; }

 private:
  PjQueryLmConfig cfg_;
  double omega_ = 0;
};

// One generator: next(length, batch) draws batch * (length - 1) bits row-major (TorchCpuGenerator,
// as the Jordan query-LM) and labels them. Batches reuse QueryLmBatch (scores = teacher scores).
class PjQueryLmGenerator {
 public:
  PjQueryLmGenerator(const PjQueryLmConfig& c, uint64_t generator_seed);
  QueryLmBatch next(int64_t length, int64_t batch);
  // The length of training step `step` under the config's sampling rule (random draws from this
  // generator, before the step's bits).
  int64_t train_length_at(int64_t step);
  const PjQueryLmTeacher& teacher() const { return teacher_; }

 private:
  PjQueryLmTeacher teacher_;
  TorchCpuGenerator gen_;
  int64_t cached_length_ = -1;
  std::vector<double> coeff_;
};

// The training stream of run `seed`: step s is a batch at train_length_at(s).
class PjQueryLmTrainStream {
 public:
  PjQueryLmTrainStream(const PjQueryLmConfig& c, int64_t seed);
  QueryLmBatch next(int64_t batch);
  int64_t steps() const { return step_; }

 private:
  PjQueryLmGenerator gen_;
  int64_t step_ = 0;
};

// The evaluation set of run `seed` at `length`: eval_batches batches of eval_batch_size.
std::vector<QueryLmBatch> pj_query_lm_eval_set(const PjQueryLmConfig& c, int64_t seed,
                                               int64_t length);

}  // namespace relpos::tasks
