// Cost of one training step (forward, backward, AdamW) of a model with different mechanisms and
// attention paths, measured in one process with the configurations interleaved round by round
// (medians of the rounds), so that the ratios do not depend on when each was measured.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/transformer.hpp"

namespace relpos::train {

struct StepBenchCase {
  std::string mechanism;
  std::string attention = "fused";  // fused | composed
};

// Markdown table: tokens/s (median), ms per step, ratio of step time to the first case, every
// round's time. `base` is the model (its mechanism and attention are replaced by each case's).
std::string step_benchmark(const models::ModelConfig& base, int64_t T, int64_t batch, int rounds,
                           const std::vector<StepBenchCase>& cases, int threads);

}  // namespace relpos::train
