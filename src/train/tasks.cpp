// The tasks of tasks/ behind the training loop's Task interface.
#include <fmt/format.h>

#include "core/types.hpp"
#include "tasks/corpus.hpp"
#include "tasks/midi.hpp"
#include "tasks/midi_text.hpp"
#include "tasks/pj_query_lm.hpp"
#include "tasks/query_lm.hpp"
#include "tasks/text_lm.hpp"
#include "train/grid2d_train.hpp"
#include "train/task.hpp"

namespace relpos::train {

namespace {

torch::Tensor long_tensor(const std::vector<int64_t>& v, int64_t rows, int64_t cols) {
  return torch::tensor(v, torch::kLong).view({rows, cols});
}

// A query-LM batch: the label is the target of the last position, no loss elsewhere.
Batch to_batch(const tasks::QueryLmBatch& b) {
  Batch out;
  out.tokens = long_tensor(b.tokens, b.batch, b.length);
  out.targets = torch::full({b.batch, b.length}, -1, torch::kLong);
  out.targets.select(1, b.length - 1).copy_(torch::tensor(b.labels, torch::kLong));
  return out;
}

// The synthetic query-LM (jordan-rope.md 3.4-3.5): bits then QUERY; the label of the last position
// is the teacher's sign; loss over the logits of tokens 0 and 1 at the last position only.
class QueryLmTask : public Task {
 public:
  explicit QueryLmTask(const TrainConfig& c)
      : cfg_(config_of(c)), seed_(c.seed), stream_(tasks::query_lm_train_stream(cfg_, c.seed)) {}
  int64_t vocab() const override { return 3; }
  int64_t classes() const override { return 2; }
  bool language_model() const override { return false; }
  Batch next_train_batch(int64_t batch) override {
    return to_batch(stream_.next(cfg_.seq_len_train, batch));
  }
  std::vector<Batch> eval_set(int64_t length) override {
    std::vector<Batch> out;
    for (const auto& b : tasks::query_lm_eval_set(cfg_, seed_, length)) out.push_back(to_batch(b));
    return out;
  }

 private:
  static tasks::QueryLmConfig config_of(const TrainConfig& c) {
    tasks::QueryLmConfig q;
    q.benchmark = c.task.benchmark;
    q.seq_len_train = c.task.train_length;
    // the teacher's frequency uses the model's head dim (omega = theta^(-2 i / d_head))
    q.d_model = c.model.d_model;
    q.n_heads = c.model.heads;
    q.eval_lengths = c.eval.lengths;
    q.eval_batches = c.eval.batches;
    q.eval_batch_size = c.eval.batch_size;
    tasks::QueryLmTeacher check(q);  // a bad benchmark name fails here, before training
    return q;
  }
  tasks::QueryLmConfig cfg_;
  int64_t seed_;
  tasks::QueryLmGenerator stream_;
};

// The PJ-RoPE synthetic bridge (pj-rope.md 3.3): bits then QUERY, the label from a target kernel
// through the signed or attention teacher; training lengths cycled or drawn per step. Scored as
// the query-LM: the logits of tokens 0 and 1 at the last position only.
class PjQueryLmTask : public Task {
 public:
  explicit PjQueryLmTask(const TrainConfig& c)
      : cfg_(config_of(c)), seed_(c.seed), stream_(cfg_, c.seed) {}
  int64_t vocab() const override { return tasks::kQueryLmVocab; }
  int64_t classes() const override { return 2; }
  bool language_model() const override { return false; }
  Batch next_train_batch(int64_t batch) override { return to_batch(stream_.next(batch)); }
  std::vector<Batch> eval_set(int64_t length) override {
    std::vector<Batch> out;
    for (const auto& b : tasks::pj_query_lm_eval_set(cfg_, seed_, length))
      out.push_back(to_batch(b));
    return out;
  }

 private:
  static tasks::PjQueryLmConfig config_of(const TrainConfig& c) {
    tasks::PjQueryLmConfig q;
    q.target = c.task.target;
    q.teacher = c.task.teacher;
    q.lambda = c.task.teacher_lambda;
    q.cycles = c.task.omega_cycles;
    q.train_length = c.task.train_length;
    q.median_threshold = c.task.median_threshold;
    q.train_lengths = c.task.train_lengths;
    q.length_sampling = c.task.length_sampling;
    q.eval_batches = c.eval.batches;
    q.eval_batch_size = c.eval.batch_size;
    tasks::PjQueryLmTeacher check(q);  // named errors before training
    return q;
  }
  tasks::PjQueryLmConfig cfg_;
  int64_t seed_;
  tasks::PjQueryLmTrainStream stream_;
};

// Next-token prediction on a token corpus (bytes, characters, MIDI events) with the reference's
// window sampling: random training windows from one generator per seed, fixed evaluation windows.
class CorpusLmTask : public Task {
 public:
  CorpusLmTask(const TrainConfig& c, tasks::TokenCorpus corpus)
      : corpus_(std::move(corpus)),
        protocol_(protocol_of(c)),
        sampler_(static_cast<int64_t>(corpus_.train.size()), c.task.train_length,
                 tasks::lm_train_generator_seed(protocol_, c.seed)),
        eval_starts_(
            tasks::lm_eval_starts(static_cast<int64_t>(corpus_.validation.size()), protocol_)),
        full_split_(c.eval.full_split),
        eval_batch_size_(c.eval.batch_size) {}
  int64_t vocab() const override { return corpus_.vocab_size; }
  Batch next_train_batch(int64_t batch) override {
    return windows(corpus_.train, sampler_.next_starts(batch), protocol_.seq_len_train);
  }
  std::vector<Batch> eval_set(int64_t length) override {
    if (full_split_) {
      // every non-overlapping window that has a next-token target for each position
      const auto n = static_cast<int64_t>(corpus_.validation.size());
      std::vector<Batch> out;
      std::vector<int64_t> starts;
      for (int64_t s = 0; s + length + 1 <= n; s += length) {
        starts.push_back(s);
        if (static_cast<int64_t>(starts.size()) == eval_batch_size_ || s + 2 * length + 1 > n) {
          out.push_back(windows(corpus_.validation, starts, length));
          starts.clear();
        }
      }
      if (out.empty())
        throw InputError(fmt::format(
            "the validation split ({} tokens) is shorter than one window of {}", n, length + 1));
      return out;
    }
    for (const auto& e : eval_starts_)
      if (e.length == length) {
        std::vector<Batch> out;
        for (const auto& starts : e.batches)
          out.push_back(windows(corpus_.validation, starts, length));
        return out;
      }
    throw InputError(fmt::format("evaluation length {} is not in eval.lengths", length));
  }

 private:
  static tasks::LmProtocol protocol_of(const TrainConfig& c) {
    tasks::LmProtocol p;
    p.seq_len_train = c.task.train_length;
    p.batch_size = c.optim.batch;
    p.train_steps = c.optim.steps;
    p.eval_lengths = c.eval.lengths;
    p.eval_batches = c.eval.batches;
    p.eval_batch_size = c.eval.batch_size;
    p.train_sample_seed = static_cast<uint64_t>(c.task.train_sample_seed);
    p.eval_sample_seed = static_cast<uint64_t>(c.task.eval_sample_seed);
    return p;
  }
  static Batch windows(const std::vector<int64_t>& tokens, const std::vector<int64_t>& starts,
                       int64_t T) {
    const int64_t B = static_cast<int64_t>(starts.size());
    const auto w = long_tensor(tasks::gather_windows(tokens, starts, T), B, T + 1);
    return {w.narrow(1, 0, T).contiguous(), w.narrow(1, 1, T).contiguous()};
  }
  tasks::TokenCorpus corpus_;
  tasks::LmProtocol protocol_;
  tasks::WindowSampler sampler_;
  std::vector<tasks::EvalStarts> eval_starts_;
  bool full_split_;
  int64_t eval_batch_size_;
};

tasks::TokenCorpus load_corpus(const TaskConfig& t) {
  const bool split = t.validation_path.empty();
  if (t.kind == "bytes")
    return split ? tasks::byte_corpus_split(t.path, t.validation_fraction)
                 : tasks::byte_corpus(t.path, t.validation_path);
  if (t.kind == "chars")
    return (split ? tasks::char_corpus_split(t.path, t.validation_fraction)
                  : tasks::char_corpus(t.path, t.validation_path))
        .tokens;
  if (t.kind == "midi_text") {
    tasks::MusicnetTextOptions o;
    o.seed = static_cast<uint64_t>(t.midi_seed);
    o.max_files = t.midi_max_files;
    o.tokens.include_programs = t.midi_programs;
    o.tokens.include_controls = t.midi_controls;
    return tasks::byte_stream_split(tasks::musicnet_midi_text(t.path, o).text,
                                    t.validation_fraction);
  }
  tasks::MidiCorpusOptions o;
  o.eval_fraction = t.validation_fraction;
  return tasks::load_midi_corpus(t.path, o).tokens;
}

}  // namespace

std::unique_ptr<Task> make_task(const TrainConfig& c) {
  if (c.task.kind == "query_lm") return std::make_unique<QueryLmTask>(c);
  if (c.task.kind == "pj_query_lm") return std::make_unique<PjQueryLmTask>(c);
  if (c.task.kind == "grid2d") return grid2d_task(c);  // tokens on a grid of vector positions
  return std::make_unique<CorpusLmTask>(c, load_corpus(c.task));
}

}  // namespace relpos::train
