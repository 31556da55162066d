#include "tasks/query_lm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "core/parse.hpp"
#include "core/types.hpp"

// Where the spec (jordan-rope.md 3.4-3.5) leaves room, the reference code (run_kernel_lm.py)
// decides:
// - The reference evaluates K in float32 (omega rounded to float32, float32 cos and sum); we use
//   float64 throughout. Labels can differ only where |score| is within float32 rounding of 0.
// - x = d / seq_len_train (the kernel_lm training length, equal to position.train_context in every
//   config); tau for mixed_bounded uses the same L.
// - d_head = d_model // n_heads of the trained model sets omega (not the positional head dim).
// - "damped_mixed" is the spec's damped_wave formula with gamma = kernel_lm.gamma (1e-4).
// - A score of exactly 0 gives label 0 (`score > 0`).

namespace relpos::tasks {

namespace {

QueryLmConfig high_jet_base() {
  QueryLmConfig c;
  c.seq_len_train = 256;
  c.d_model = 192;
  c.n_heads = 4;
  c.n_layers = 3;
  c.mlp_ratio = 2;
  c.train_steps = 600;
  c.batch_size = 32;
  c.eval_every = 300;
  c.eval_lengths = {256, 512, 1024};
  c.eval_batches = 24;
  c.eval_batch_size = 4;
  return c;
}

// "<prefix><digits>" -> the order, -1 when `name` does not have that form.
int jet_order(const std::string& name, std::string_view prefix) {
  if (name.rfind(prefix, 0) != 0) return -1;
  const std::string_view tail = std::string_view(name).substr(prefix.size());
  if (tail.empty() ||
      !std::all_of(tail.begin(), tail.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
    return -1;
  const auto v = parse_int64(tail, 0, 64);
  return v ? static_cast<int>(*v) : -1;
}

}  // namespace

QueryLmConfig query_lm_table5() {
  return {};
}

QueryLmConfig query_lm_table10_second_jet() {
  QueryLmConfig c = high_jet_base();
  c.benchmark = "scaled_high_jet_r2";
  return c;
}

QueryLmConfig query_lm_table10_third_jet() {
  QueryLmConfig c = high_jet_base();
  c.benchmark = "scaled_high_jet_r3";
  return c;
}

QueryLmConfig query_lm_smoke() {
  QueryLmConfig c;
  c.seq_len_train = 64;
  c.d_model = 64;
  c.n_heads = 4;
  c.n_layers = 2;
  c.target_freq_index = 2;
  c.second_freq_index = 4;
  c.train_steps = 4;
  c.batch_size = 2;
  c.eval_every = 4;
  c.eval_lengths = {64, 128};
  c.eval_batches = 2;
  c.eval_batch_size = 1;
  c.seeds = {0};
  c.lr = 1e-3;
  c.weight_decay = 0.0;
  return c;
}

std::vector<std::string> query_lm_benchmarks() {
  return {"mixed_raw",       "mixed_bounded", "damped_mixed",
          "rhythm_envelope", "high_jet_r<r>", "scaled_high_jet_r<r>"};
}

QueryLmTeacher::QueryLmTeacher(const QueryLmConfig& c) : cfg_(c) {
  const std::string& b = c.benchmark;
  if (b == "mixed_raw") {
    kind_ = Kind::MixedRaw;
  } else if (b == "mixed_bounded") {
    kind_ = Kind::MixedBounded;
  } else if (b == "damped_mixed") {
    kind_ = Kind::DampedMixed;
  } else if (b == "rhythm_envelope") {
    kind_ = Kind::RhythmEnvelope;
  } else if (int r = jet_order(b, "high_jet_r"); r >= 0) {
    kind_ = Kind::HighJet;
    order_ = r;
  } else if (int s = jet_order(b, "scaled_high_jet_r"); s >= 0) {
    kind_ = Kind::ScaledHighJet;
    order_ = s;
  } else {
    throw InputError(fmt::format("query-LM: unknown benchmark '{}' (valid: {}; r in 0..64)",
                                 brief(b), fmt::join(query_lm_benchmarks(), ", ")));
  }
  if (c.seq_len_train < 2)
    throw InputError(fmt::format("query-LM: seq_len_train {} must be >= 2", c.seq_len_train));
  if (c.n_heads < 1 || c.d_model / c.n_heads < 1)
    throw InputError(fmt::format("query-LM: d_model {} / n_heads {} gives no head dimension",
                                 c.d_model, c.n_heads));
  if (!std::isfinite(c.theta) || c.theta <= 0 || !std::isfinite(c.gamma) ||
      !std::isfinite(c.scaled_c) || !std::isfinite(c.logit_scale))
    throw InputError("query-LM: theta, gamma, scaled_c and logit_scale must be finite, theta > 0");
  const auto d_head = static_cast<double>(c.d_model / c.n_heads);
  omega_ = std::pow(c.theta, -2.0 * static_cast<double>(c.target_freq_index) / d_head);
  omega2_ = std::pow(c.theta, -2.0 * static_cast<double>(c.second_freq_index) / d_head);
  double ss = 0;
  for (int64_t d = 1; d < c.seq_len_train; ++d) {
    const double k = raw(static_cast<double>(d));
    ss += k * k;
  }
  norm_ = std::max(std::sqrt(ss), 1e-6);
}

double QueryLmTeacher::raw(double d) const {
  const double L = static_cast<double>(cfg_.seq_len_train), x = d / L;
  const double c = std::cos(omega_ * d);
  switch (kind_) {
    case Kind::MixedRaw:
      return x * c;
    case Kind::MixedBounded:
      return (d / (1.0 + d / L)) / L * c;
    case Kind::DampedMixed:
      return std::exp(-cfg_.gamma * d) * (c + 0.75 * x * std::sin(omega_ * d));
    case Kind::RhythmEnvelope:
      return (0.25 + 0.85 * x) * (0.65 * c + 0.35 * std::sin(omega2_ * d));
    case Kind::HighJet:
      return std::pow(x, order_) * c;
    case Kind::ScaledHighJet:
      return std::pow(x, order_) * std::exp(-cfg_.scaled_c * x) * c;
  }
  return 0.0;
}

std::vector<double> QueryLmTeacher::kernel(int64_t length) const {
  if (length < 2)
    throw InputError(fmt::format("query-LM: sequence length {} must be >= 2", length));
  std::vector<double> k(static_cast<size_t>(length - 1));
  for (int64_t d = 1; d < length; ++d)
    k[static_cast<size_t>(d - 1)] = raw(static_cast<double>(d)) / norm_;
  return k;
}

QueryLmGenerator::QueryLmGenerator(const QueryLmConfig& c, uint64_t generator_seed)
    : teacher_(c), gen_(generator_seed) {}

QueryLmBatch draw_query_batch(TorchCpuGenerator& gen, int64_t batch, int64_t length,
                              const std::vector<double>& weight) {
  QueryLmBatch out;
  out.batch = batch;
  out.length = length;
  out.tokens.resize(static_cast<size_t>(batch * length));
  out.labels.resize(static_cast<size_t>(batch));
  out.scores.resize(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    int64_t* row = out.tokens.data() + b * length;
    double score = 0;
    for (int64_t j = 0; j < length - 1; ++j) {
      row[j] = gen.randint(0, 2);
      const double w = weight[static_cast<size_t>(j)];
      score += row[j] ? w : -w;
    }
    row[length - 1] = kQueryLmQuery;
    out.scores[static_cast<size_t>(b)] = score;
  }
  return out;
}

QueryLmBatch QueryLmGenerator::next(int64_t length, int64_t batch) {
  if (batch < 1) throw InputError(fmt::format("query-LM: batch size {} must be >= 1", batch));
  if (length != cached_length_) {
    kernel_ = teacher_.kernel(length);
    cached_length_ = length;
  }
  // bit j sits at lag T-1-j: its weight is the kernel at that lag
  std::vector<double> weight(static_cast<size_t>(length - 1));
  for (int64_t j = 0; j + 1 < length; ++j)
    weight[static_cast<size_t>(j)] = kernel_[static_cast<size_t>(length - 2 - j)];
  QueryLmBatch out = draw_query_batch(gen_, batch, length, weight);
  const QueryLmConfig& c = teacher_.config();
  for (int64_t b = 0; b < batch; ++b) {
    const double s = out.scores[static_cast<size_t>(b)];
    if (c.label_mode == QueryLmLabels::Threshold) {
      out.labels[static_cast<size_t>(b)] = s > 0 ? 1 : 0;
    } else {  // drawn after all bits of the batch, as the reference does
      const auto p = static_cast<float>(1.0 / (1.0 + std::exp(-c.logit_scale * s)));
      out.labels[static_cast<size_t>(b)] = gen_.bernoulli(p) ? 1 : 0;
    }
  }
  return out;
}

uint64_t query_lm_train_seed(const QueryLmConfig& c, int64_t seed) {
  return c.data_seed + static_cast<uint64_t>(seed) * 1000003u;
}

uint64_t query_lm_eval_seed(const QueryLmConfig& c, int64_t seed, int64_t length) {
  return c.eval_seed + static_cast<uint64_t>(seed) * 1009u + static_cast<uint64_t>(length);
}

QueryLmGenerator query_lm_train_stream(const QueryLmConfig& c, int64_t seed) {
  return QueryLmGenerator(c, query_lm_train_seed(c, seed));
}

std::vector<QueryLmBatch> query_lm_eval_set(const QueryLmConfig& c, int64_t seed, int64_t length) {
  if (c.eval_batches < 1 || c.eval_batch_size < 1)
    throw InputError(fmt::format("query-LM: eval batches {} and eval batch size {} must be >= 1",
                                 c.eval_batches, c.eval_batch_size));
  QueryLmGenerator gen(c, query_lm_eval_seed(c, seed, length));
  std::vector<QueryLmBatch> out;
  out.reserve(static_cast<size_t>(c.eval_batches));
  for (int64_t i = 0; i < c.eval_batches; ++i) out.push_back(gen.next(length, c.eval_batch_size));
  return out;
}

}  // namespace relpos::tasks
