#include "train/model.hpp"

#include "train/grid2d_train.hpp"
#include "train/trainer.hpp"

namespace relpos::train {

LmModel::LmModel(const TrainConfig& c, int64_t vocab) {
  models::ModelConfig mc = c.model;
  mc.vocab = vocab;
  model_ = models::TransformerLM(mc);
}

void LmModel::summarize(nlohmann::json& s) {
  s["mechanism_stats"] = nlohmann::json::parse(mechanism_stats_json(*model_));
}

std::unique_ptr<TrainModel> make_model(const TrainConfig& c, int64_t vocab) {
  if (c.task.kind == "grid2d") return grid2d_model(c);  // tokens on a grid of vector positions
  return std::make_unique<LmModel>(c, vocab);
}

}  // namespace relpos::train
