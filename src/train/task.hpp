// What the training loop needs from a task (the data of tasks/ as tensors): a training stream and
// fixed evaluation sets at any length. Targets use -1 for positions without a loss; a task may
// restrict the loss to the first `classes()` logits (the query-LM scores 2 of its 3 tokens).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "train/config.hpp"

namespace relpos::train {

struct Batch {
  torch::Tensor tokens;   // [B, T] int64
  torch::Tensor targets;  // [B, T] int64, -1 = no loss at that position
};

class Task {
 public:
  virtual ~Task() = default;
  virtual int64_t vocab() const = 0;
  virtual int64_t classes() const { return vocab(); }  // logits scored: the first classes()
  // true: report perplexity (language models); false: accuracy of a classification
  virtual bool language_model() const { return true; }
  // The next batch of the training stream (batch rows of train_length tokens). The stream is a
  // function of the run's seed only, so a resumed run replays it to where it stopped.
  virtual Batch next_train_batch(int64_t batch) = 0;
  // The evaluation set at `length` (the same batches at every call).
  virtual std::vector<Batch> eval_set(int64_t length) = 0;
};

// The task of a configuration for run `seed`; InputError names a missing file or a bad setting
// before any training starts.
std::unique_ptr<Task> make_task(const TrainConfig& c);

}  // namespace relpos::train
