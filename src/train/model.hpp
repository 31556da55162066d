// What the training loop (train/trainer.cpp) needs from a model, so that one loop - with resume,
// checkpoints and data parallel workers - trains every model: the language models
// (models/transformer.hpp) and the grid model of the structured-2d experiment (models/grid2d.hpp,
// train/grid2d_train.hpp). A model maps a task's token batches [B, T] to logits [B, T, V].
#pragma once

#include <torch/torch.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "models/transformer.hpp"
#include "train/config.hpp"

namespace relpos::train {

class TrainModel {
 public:
  virtual ~TrainModel() = default;
  virtual torch::nn::Module& module() = 0;
  virtual torch::Tensor forward(const torch::Tensor& tokens) = 0;
  // AdamW's groups: parameters with weight decay, and those without
  virtual std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> decay_groups() = 0;
  // summary.json's fields about the trained model (mechanism statistics, the task's own checks
  // of the trained model); may move the model to float64 (it is called last)
  virtual void summarize(nlohmann::json& summary) = 0;
  virtual int64_t parameter_count() = 0;
};

// A language model of the transformer presets (models/transformer.hpp); summary.json gets its
// mechanism statistics.
class LmModel : public TrainModel {
 public:
  LmModel(const TrainConfig& c, int64_t vocab);
  explicit LmModel(models::TransformerLM model) : model_(std::move(model)) {}
  torch::nn::Module& module() override { return *model_; }
  torch::Tensor forward(const torch::Tensor& tokens) override { return model_->forward(tokens); }
  std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> decay_groups() override {
    return model_->decay_groups();
  }
  void summarize(nlohmann::json& summary) override;
  int64_t parameter_count() override { return model_->parameter_count(); }
  models::TransformerLM& lm() { return model_; }

 private:
  models::TransformerLM model_{nullptr};
};

// The model of a configuration over a task's vocabulary, initialised from torch's generator
// (seed it first).
std::unique_ptr<TrainModel> make_model(const TrainConfig& c, int64_t vocab);

}  // namespace relpos::train
