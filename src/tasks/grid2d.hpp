// The 2-D synthetic relative-position task (issue 15, item 5; structured rotations paper Sec. 2):
// the query-LM's idea on a grid. Every cell of a side x side grid holds a random bit; the label of
// every cell is the sign of a fixed teacher kernel over 2-D lags applied to the other cells' bits
// (non-causal: every cell sees every other cell):
//
//   score_i = sum_{j != i} (2 bit_j - 1) K(r_j - r_i),     label_i = [score_i > 0]
//
// with r = (row, col) and the "oblique" teacher
//
//   K(d) = exp(-|d|^2 / (2 sigma^2)) cos(omega (d_row cos(alpha) + d_col sin(alpha))),
//
// a Gaussian bump times a plane wave whose wave vector points at alpha from the row axis (35
// degrees by default). cos(a . d) = cos(a_r d_r) cos(a_c d_c) - sin(a_r d_r) sin(a_c d_c) is not
// a sum of a function of d_row and one of d_col, which is what one axial-RoPE logit can express
// (its planes turn with d_row or with d_col alone); a mixed-RoPE plane whose frequency vector is
// parallel to a turns with a . d itself. K(0) = 0 (a cell's own bit does not count), and K is even,
// so flipping every bit flips every score: labels are balanced (P[label = 1] = 1/2) with the
// threshold 0, no calibration needed. Scores of exactly 0 (a cell with no other cell) are label 0.
//
// Tokens: BIT0 = 0, BIT1 = 1 (vocabulary 2), cell t = row * side + col in row-major order.
// Streams: the training stream of run s draws its bits from TorchCpuGenerator(data_seed + s *
// 1000003); the evaluation set of run s on a side x side grid from eval_seed + s * 1009 + side^2
// (a fresh generator per call, so it is the same set every time).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tasks/rng.hpp"

namespace relpos::tasks {

inline constexpr int64_t kGrid2dVocab = 2;

struct Grid2dConfig {
  std::string teacher = "oblique";  // the only teacher so far
  int64_t side = 8;                 // training grid: side x side cells
  double sigma = 2.0;               // Gaussian width in cells
  double omega = 1.1;               // wave number, rad / cell
  double alpha_deg = 35.0;          // wave direction from the row axis
  uint64_t data_seed = 7207;
  uint64_t eval_seed = 9209;
  int64_t eval_batches = 8;
  int64_t eval_batch_size = 32;
};

// Teacher names accepted in Grid2dConfig::teacher (for messages).
std::vector<std::string> grid2d_teachers();

// The side of a square grid of `cells` cells; InputError when `cells` is not a square >= 4.
int64_t grid2d_side(int64_t cells);

// A configuration checked once (InputError naming a bad teacher, side, sigma or batch size).
class Grid2dTeacher {
 public:
  explicit Grid2dTeacher(const Grid2dConfig& c);
  // K(d_row, d_col) (0 at d = 0)
  double kernel(double d_row, double d_col) const;
  const Grid2dConfig& config() const { return cfg_; }

 private:
  Grid2dConfig cfg_;
  double a_row_ = 0, a_col_ = 0;  // the wave vector omega (cos alpha, sin alpha)
};

// One batch of grids: tokens, labels and scores [batch, side * side] row-major.
struct Grid2dBatch {
  int64_t batch = 0;
  int64_t side = 0;
  std::vector<int64_t> tokens;
  std::vector<int64_t> labels;
  std::vector<double> scores;
};

// batch grids of side x side random bits (gen.randint(0, 2) per cell, grid after grid, row-major)
// labelled by the teacher.
Grid2dBatch draw_grid2d_batch(const Grid2dTeacher& teacher, TorchCpuGenerator& gen, int64_t batch,
                              int64_t side);

class Grid2dTrainStream {
 public:
  Grid2dTrainStream(const Grid2dConfig& c, int64_t seed);
  Grid2dBatch next(int64_t batch);  // grids of c.side x c.side

 private:
  Grid2dTeacher teacher_;
  TorchCpuGenerator gen_;
};

uint64_t grid2d_train_seed(const Grid2dConfig& c, int64_t seed);
uint64_t grid2d_eval_seed(const Grid2dConfig& c, int64_t seed, int64_t side);

// The evaluation set of run `seed` on a side x side grid: c.eval_batches batches of
// c.eval_batch_size grids (the same every call).
std::vector<Grid2dBatch> grid2d_eval_set(const Grid2dConfig& c, int64_t seed, int64_t side);

}  // namespace relpos::tasks
