// Least-squares solvers of the basis probes, in float64 or float32 (T = double or float).
//
// ridge_fit: the Jordan-RoPE protocol, w = (X^T X + lambda I)^{-1} X^T y by LU (like
//   torch.linalg.solve), lambda on every coefficient including the intercept, no standardisation.
//   cond = 2-norm condition number of X^T X + lambda I (computed in float64).
// lstsq_fit: the PJ-RoPE protocol: standardise each column with the fit-set mean and unbiased std
//   (std clamped at 1e-8), append an intercept column last, solve by a rank-revealing complete
//   orthogonal decomposition (min-norm solution, like LAPACK gelsy behind torch.linalg.lstsq).
//   cond = s_max / max(s_min, 1e-12) of the standardised design with intercept (float64).
//   With standardise = false the raw columns are used (the GRAPE unit tests' projections).
#pragma once

#include <Eigen/Dense>

namespace relpos::probes {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
template <class T>
using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;

template <class T>
struct LinearFit {
  Vec<T> w;                  // coefficients on the (transformed) columns
  Vec<T> mean, scale;        // standardisation (lstsq only; empty for ridge)
  bool intercept_last = false;
  double cond = 0.0;

  // Predictions for raw feature rows X (same columns as the fit).
  Vec<T> predict(const Mat<T>& X) const;
};

template <class T>
LinearFit<T> ridge_fit(const Mat<T>& X, const Vec<T>& y, double lambda);

template <class T>
LinearFit<T> lstsq_fit(const Mat<T>& X, const Vec<T>& y, bool standardise = true);

// Condition number of the ridge normal matrix X^T X + lambda I in float64.
double ridge_condition(const Eigen::MatrixXd& X, double lambda);

struct Scores {
  double mse = 0.0;
  double r2 = 0.0;
};
// Jordan-RoPE: R^2 = 1 - MSE / max(mean((y - mean y)^2), 1e-12).
template <class T>
Scores jordan_scores(const Vec<T>& pred, const Vec<T>& y);
// PJ-RoPE / GRAPE: R^2 = 1 - SS_res / (SS_tot + 1e-12).
template <class T>
Scores pj_scores(const Vec<T>& pred, const Vec<T>& y);

}  // namespace relpos::probes
