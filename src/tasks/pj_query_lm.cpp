#include "tasks/pj_query_lm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/parse.hpp"
#include "core/types.hpp"
#include "probes/targets.hpp"

// Where the spec (pj-rope.md 3.3) leaves room:
// - Kernels and scores are float64 (the reference computes them in float32): labels can differ
//   only where a score is within float32 rounding of the threshold.
// - The generators are PyTorch's CPU generator with the Jordan query-LM's seed scheme; the
//   reference drew from its device's (CUDA) generator, whose stream is not reproduced, so batches
//   have the reference's distribution, not its draws.
// - The signed teacher's norm is clamped at 1e-12 (the reference clamps at an eps).

namespace relpos::tasks {

namespace {

void check(bool ok, const std::string& what) {
  if (!ok) throw InputError(fmt::format("pj query-LM: {}", what));
}

}  // namespace

std::vector<std::string> pj_query_lm_targets() {
  return {"phase",  "first_jet",        "second_jet", "third_jet",
          "affine", "recency_weak_jet", "lc_core",    "lc_affine"};
}

std::vector<std::string> pj_query_lm_teachers() {
  return {"signed", "attention"};
}

PjQueryLmTeacher::PjQueryLmTeacher(const PjQueryLmConfig& c) : cfg_(c) {
  const auto targets = pj_query_lm_targets(), teachers = pj_query_lm_teachers();
  check(std::find(targets.begin(), targets.end(), c.target) != targets.end(),
        fmt::format("unknown target '{}' (valid: {})", brief(c.target), fmt::join(targets, ", ")));
  check(
      std::find(teachers.begin(), teachers.end(), c.teacher) != teachers.end(),
      fmt::format("unknown teacher '{}' (valid: {})", brief(c.teacher), fmt::join(teachers, ", ")));
  check(c.length_sampling == "cycle" || c.length_sampling == "random",
        fmt::format("length sampling must be cycle or random, got '{}'", brief(c.length_sampling)));
  check(c.train_length >= 2, fmt::format("train length {} must be >= 2", c.train_length));
  for (const int64_t T : c.train_lengths)
    check(T >= 2 && T <= (int64_t{1} << 20),
          fmt::format("training sequence length {} must be in [2, 2^20]", T));
  check(std::isfinite(c.lambda) && c.lambda > 0,
        fmt::format("teacher lambda {} must be finite and > 0", c.lambda));
  check(std::isfinite(c.cycles), fmt::format("omega cycles {} must be finite", c.cycles));
  check(c.eval_batches >= 1 && c.eval_batch_size >= 1,
        fmt::format("eval batches {} and eval batch size {} must be >= 1", c.eval_batches,
                    c.eval_batch_size));
  omega_ = 2.0 * std::numbers::pi * c.cycles / static_cast<double>(c.train_length);
}

double PjQueryLmTeacher::kernel(double d) const {
  const double L = static_cast<double>(cfg_.train_length);
  if (cfg_.target == "affine") return -0.4 * probes::pj_target("linear", d, omega_, L);
  return probes::pj_target(cfg_.target, d, omega_, L);
}

std::vector<double> PjQueryLmTeacher::coefficients(int64_t length) const {
  check(length >= 2, fmt::format("sequence length {} must be >= 2", length));
  const auto n = static_cast<size_t>(length - 1);
  std::vector<double> c(n);
  for (size_t j = 0; j < n; ++j) c[j] = kernel(static_cast<double>(n - j));  // lag T-1-j
  if (cfg_.teacher == "signed") {
    double ss = 0;
    for (double v : c) ss += v * v;
    const double norm = std::max(std::sqrt(ss), 1e-12);
    for (double& v : c) v /= norm;
  } else {  // attention: softmax(lambda k) over the positions
    double m = -INFINITY;
    for (double& v : c) m = std::max(m, v *= cfg_.lambda);
    double z = 0;
    for (double& v : c) z += (v = std::exp(v - m));
    for (double& v : c) v /= z;
  }
  return c;
}

PjQueryLmGenerator::PjQueryLmGenerator(const PjQueryLmConfig& c, uint64_t generator_seed)
    : teacher_(c), gen_(generator_seed) {}

QueryLmBatch PjQueryLmGenerator::next(int64_t length, int64_t batch) {
  check(batch >= 1, fmt::format("batch size {} must be >= 1", batch));
  if (length != cached_length_) {
    coeff_ = teacher_.coefficients(length);
    cached_length_ = length;
  }
  QueryLmBatch out = draw_query_batch(gen_, batch, length, coeff_);
  double threshold = 0;
  if (teacher_.config().median_threshold) {  // torch.median: the lower middle value
    std::vector<double> s = out.scores;
    const auto mid = s.begin() + (static_cast<std::ptrdiff_t>(s.size()) - 1) / 2;
    std::nth_element(s.begin(), mid, s.end());
    threshold = *mid;
  }
  for (int64_t b = 0; b < batch; ++b)
    out.labels[static_cast<size_t>(b)] = out.scores[static_cast<size_t>(b)] > threshold ? 1 : 0;
  return out;
}

int64_t PjQueryLmGenerator::train_length_at(int64_t step) {
  const auto& c = teacher_.config();
  if (c.train_lengths.empty()) return c.train_length;
  const auto n = static_cast<int64_t>(c.train_lengths.size());
  const int64_t i = c.length_sampling == "cycle" ? step % n : gen_.randint(0, n);
  return c.train_lengths[static_cast<size_t>(i)];
}

PjQueryLmTrainStream::PjQueryLmTrainStream(const PjQueryLmConfig& c, int64_t seed)
    : gen_(c, c.data_seed + static_cast<uint64_t>(seed) * 1000003u) {}

QueryLmBatch PjQueryLmTrainStream::next(int64_t batch) {
  const int64_t T = gen_.train_length_at(step_++);
  return gen_.next(T, batch);
}

std::vector<QueryLmBatch> pj_query_lm_eval_set(const PjQueryLmConfig& c, int64_t seed,
                                               int64_t length) {
  PjQueryLmGenerator gen(
      c, c.eval_seed + static_cast<uint64_t>(seed) * 1009u + static_cast<uint64_t>(length));
  std::vector<QueryLmBatch> out;
  out.reserve(static_cast<size_t>(c.eval_batches));
  for (int64_t i = 0; i < c.eval_batches; ++i) out.push_back(gen.next(length, c.eval_batch_size));
  return out;
}

}  // namespace relpos::tasks
