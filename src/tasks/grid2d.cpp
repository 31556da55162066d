#include "tasks/grid2d.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/types.hpp"

namespace relpos::tasks {

std::vector<std::string> grid2d_teachers() {
  return {"oblique"};
}

int64_t grid2d_side(int64_t cells) {
  auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(cells))));
  while (side * side > cells) --side;
  while ((side + 1) * (side + 1) <= cells) ++side;
  if (cells < 4 || side * side != cells)
    throw InputError(fmt::format(
        "grid2d: a length must be the number of cells of a square grid (side >= 2: 4, 9, 16, ..., "
        "64, ...), got {}",
        cells));
  return side;
}

Grid2dTeacher::Grid2dTeacher(const Grid2dConfig& c) : cfg_(c) {
  const auto names = grid2d_teachers();
  if (std::find(names.begin(), names.end(), c.teacher) == names.end())
    throw InputError(
        fmt::format("grid2d: unknown teacher '{}' (known: {})", c.teacher, fmt::join(names, ", ")));
  if (c.side < 2 || c.side > 4096)
    throw InputError(fmt::format("grid2d: side must be in [2, 4096], got {}", c.side));
  if (!(c.sigma > 0 && std::isfinite(c.sigma)))
    throw InputError(fmt::format("grid2d: sigma must be finite and > 0, got {}", c.sigma));
  if (!std::isfinite(c.omega) || !std::isfinite(c.alpha_deg))
    throw InputError("grid2d: omega and alpha_deg must be finite");
  if (c.eval_batches < 1 || c.eval_batch_size < 1)
    throw InputError(fmt::format("grid2d: eval batches ({}) and batch size ({}) must be >= 1",
                                 c.eval_batches, c.eval_batch_size));
  const double alpha = c.alpha_deg * std::numbers::pi / 180.0;
  a_row_ = c.omega * std::cos(alpha);
  a_col_ = c.omega * std::sin(alpha);
}

double Grid2dTeacher::kernel(double d_row, double d_col) const {
  if (d_row == 0 && d_col == 0) return 0.0;
  const double r2 = d_row * d_row + d_col * d_col;
  return std::exp(-r2 / (2 * cfg_.sigma * cfg_.sigma)) * std::cos(a_row_ * d_row + a_col_ * d_col);
}

Grid2dBatch draw_grid2d_batch(const Grid2dTeacher& teacher, TorchCpuGenerator& gen, int64_t batch,
                              int64_t side) {
  if (batch < 1 || side < 2)
    throw InputError(
        fmt::format("grid2d: batch ({}) must be >= 1 and side ({}) >= 2", batch, side));
  const int64_t T = side * side;
  // the kernel on every lag of this grid, (2 side - 1)^2 values, indexed by (d_row + side - 1)
  const int64_t w = 2 * side - 1;
  std::vector<double> K(static_cast<size_t>(w * w));
  for (int64_t dr = -(side - 1); dr <= side - 1; ++dr)
    for (int64_t dc = -(side - 1); dc <= side - 1; ++dc)
      K[static_cast<size_t>((dr + side - 1) * w + dc + side - 1)] =
          teacher.kernel(static_cast<double>(dr), static_cast<double>(dc));
  Grid2dBatch b;
  b.batch = batch;
  b.side = side;
  b.tokens.resize(static_cast<size_t>(batch * T));
  b.labels.resize(b.tokens.size());
  b.scores.resize(b.tokens.size());
  for (auto& t : b.tokens) t = gen.randint(0, 2);
  for (int64_t g = 0; g < batch; ++g) {
    const int64_t* bits = b.tokens.data() + g * T;
    for (int64_t i = 0; i < T; ++i) {
      const int64_t ri = i / side, ci = i % side;
      double s = 0;
      for (int64_t j = 0; j < T; ++j) {
        const int64_t dr = j / side - ri, dc = j % side - ci;
        s += static_cast<double>(2 * bits[j] - 1) *
             K[static_cast<size_t>((dr + side - 1) * w + dc + side - 1)];
      }
      b.scores[static_cast<size_t>(g * T + i)] = s;
      b.labels[static_cast<size_t>(g * T + i)] = s > 0 ? 1 : 0;
    }
  }
  return b;
}

Grid2dTrainStream::Grid2dTrainStream(const Grid2dConfig& c, int64_t seed)
    : teacher_(c), gen_(grid2d_train_seed(c, seed)) {}

Grid2dBatch Grid2dTrainStream::next(int64_t batch) {
  return draw_grid2d_batch(teacher_, gen_, batch, teacher_.config().side);
}

uint64_t grid2d_train_seed(const Grid2dConfig& c, int64_t seed) {
  return c.data_seed + static_cast<uint64_t>(seed) * 1000003ULL;
}

uint64_t grid2d_eval_seed(const Grid2dConfig& c, int64_t seed, int64_t side) {
  return c.eval_seed + static_cast<uint64_t>(seed) * 1009ULL + static_cast<uint64_t>(side * side);
}

std::vector<Grid2dBatch> grid2d_eval_set(const Grid2dConfig& c, int64_t seed, int64_t side) {
  const Grid2dTeacher teacher(c);
  TorchCpuGenerator gen(grid2d_eval_seed(c, seed, side));
  std::vector<Grid2dBatch> out;
  for (int64_t i = 0; i < c.eval_batches; ++i)
    out.push_back(draw_grid2d_batch(teacher, gen, c.eval_batch_size, side));
  return out;
}

}  // namespace relpos::tasks
