// The 2-D relative-position task (task.kind = "grid2d", tasks/grid2d.hpp, models/grid2d.hpp; the
// structured-2d experiment of issue 15) as a task and a model of the one training loop
// (trainer.hpp: resume, checkpoints and --nproc as for every run). Same configuration keys, AdamW,
// schedule, clipping and files as the language models, with what a grid needs instead:
//   - model.mechanism is a registry spec that rotates by 2-D vector positions (structured,
//     axial_rope, mixed_rope, structured(basis=exp), ...) or reads none (nope), run by the
//     model's nn::Attention; model.d_model / heads / layers / mlp_ratio as usual; every parameter
//     decays;
//   - eval.lengths are cell counts of square grids (64 = 8 x 8, 144 = 12 x 12); targets are the
//     cells' labels (accuracy, 2 classes);
//   - at the end, on the training grid's evaluation set: the accuracy with every position moved by
//     task.eval_offset (a grid translated beyond the training range), and translation equivariance:
//     max |logits(r + s) - logits(r)| / max |logits(r)| for the shift s = task.equivariance_shift,
//     in float32 and again with the trained model cast to float64.
// OUT/summary.json holds the usual fields plus "task": "grid2d" and "extra": {accuracy_shifted,
// equivariance_rel_f32, equivariance_abs_f32, equivariance_rel_f64, max_abs_logit, basis_max_dev
// = max |E - I| over layers and heads (a learned basis; 0 otherwise)}. eval, diagnose and the
// profiles of a grid2d run are not supported (they load language models).
#pragma once

#include <torch/torch.h>

#include "models/grid2d.hpp"
#include "tasks/grid2d.hpp"
#include "train/model.hpp"
#include "train/task.hpp"
#include "train/trainer.hpp"

namespace relpos::train {

models::Grid2dModelConfig grid2d_model_config(const TrainConfig& c);
tasks::Grid2dConfig grid2d_task_config(const TrainConfig& c);
// The grid2d checks of TrainConfig::validate (teacher, square lengths, shift and offset, model).
void validate_grid2d(const TrainConfig& c);

struct Grid2dEquivariance {
  double max_abs = 0;    // max |logits(r + s) - logits(r)|
  double max_logit = 0;  // max |logits(r)|
  double rel = 0;        // max_abs / max_logit
};
// Logits of `tokens` [B, side^2] at the grid's positions and at every position + (shift_row,
// shift_col), compared (in the model's dtype).
Grid2dEquivariance grid2d_equivariance(models::Grid2dNetImpl& model, const torch::Tensor& tokens,
                                       int64_t side, double shift_row, double shift_col);

// The task and the model the training loop (trainer.hpp) runs for task.kind = grid2d.
std::unique_ptr<Task> grid2d_task(const TrainConfig& c);
std::unique_ptr<TrainModel> grid2d_model(const TrainConfig& c);

}  // namespace relpos::train
