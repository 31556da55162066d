#include "probes/solvers.hpp"

#include <Eigen/SVD>
#include <algorithm>
#include <cmath>
#include <limits>

namespace relpos::probes {

template <class T>
Vec<T> LinearFit<T>::predict(const Mat<T>& X) const {
  if (mean.size() == 0) return X * w;
  const Eigen::Index p = X.cols();
  const Mat<T> Z = (X.rowwise() - mean.transpose()).array().rowwise() / scale.transpose().array();
  return Z * w.head(p) + Vec<T>::Constant(X.rows(), w(p));
}

template <class T>
LinearFit<T> ridge_fit(const Mat<T>& X, const Vec<T>& y, double lambda) {
  LinearFit<T> f;
  Mat<T> A = X.transpose() * X;
  A.diagonal().array() += static_cast<T>(lambda);
  const Vec<T> b = X.transpose() * y;
  f.w = A.partialPivLu().solve(b);
  f.cond = ridge_condition(X.template cast<double>(), lambda);
  return f;
}

template <class T>
LinearFit<T> lstsq_fit(const Mat<T>& X, const Vec<T>& y, bool standardise) {
  LinearFit<T> f;
  const Eigen::Index n = X.rows(), p = X.cols();
  f.mean = Vec<T>::Zero(p);
  f.scale = Vec<T>::Ones(p);
  if (standardise) {
    f.mean = X.colwise().mean().transpose();
    for (Eigen::Index j = 0; j < p; ++j) {
      const T ss = (X.col(j).array() - f.mean(j)).square().sum();
      f.scale(j) = std::max(std::sqrt(ss / static_cast<T>(n - 1)), static_cast<T>(1e-8));
    }
  }
  Mat<T> Z(n, p + 1);
  Z.leftCols(p) = (X.rowwise() - f.mean.transpose()).array().rowwise() / f.scale.transpose().array();
  Z.col(p).setOnes();
  Eigen::CompleteOrthogonalDecomposition<Mat<T>> cod;
  cod.setThreshold(std::numeric_limits<T>::epsilon() * static_cast<T>(std::max(n, p + 1)));
  cod.compute(Z);
  f.w = cod.solve(y);
  f.intercept_last = true;
  const Eigen::VectorXd sv = Z.template cast<double>().jacobiSvd().singularValues();
  f.cond = sv(0) / std::max(sv(sv.size() - 1), 1e-12);
  return f;
}

double ridge_condition(const Eigen::MatrixXd& X, double lambda) {
  Eigen::MatrixXd A = X.transpose() * X;
  A.diagonal().array() += lambda;
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(A, Eigen::EigenvaluesOnly);
  const auto& ev = es.eigenvalues();
  return ev(ev.size() - 1) / std::max(ev(0), std::numeric_limits<double>::min());
}

namespace {
template <class T>
void residuals(const Vec<T>& pred, const Vec<T>& y, double* ss_res, double* ss_tot) {
  const Eigen::Index n = y.size();
  double mean = 0.0;
  for (Eigen::Index i = 0; i < n; ++i) mean += static_cast<double>(y(i));
  mean /= static_cast<double>(n);
  *ss_res = 0.0;
  *ss_tot = 0.0;
  for (Eigen::Index i = 0; i < n; ++i) {
    const double e = static_cast<double>(pred(i)) - static_cast<double>(y(i));
    const double t = static_cast<double>(y(i)) - mean;
    *ss_res += e * e;
    *ss_tot += t * t;
  }
}
}  // namespace

template <class T>
Scores jordan_scores(const Vec<T>& pred, const Vec<T>& y) {
  double ss_res = 0.0, ss_tot = 0.0;
  residuals(pred, y, &ss_res, &ss_tot);
  const double n = static_cast<double>(y.size());
  return {ss_res / n, 1.0 - (ss_res / n) / std::max(ss_tot / n, 1e-12)};
}

template <class T>
Scores pj_scores(const Vec<T>& pred, const Vec<T>& y) {
  double ss_res = 0.0, ss_tot = 0.0;
  residuals(pred, y, &ss_res, &ss_tot);
  return {ss_res / static_cast<double>(y.size()), 1.0 - ss_res / (ss_tot + 1e-12)};
}

#define RELPOS_PROBE_INSTANTIATE(T)                                                   \
  template struct LinearFit<T>;                                                       \
  template LinearFit<T> ridge_fit<T>(const Mat<T>&, const Vec<T>&, double);           \
  template LinearFit<T> lstsq_fit<T>(const Mat<T>&, const Vec<T>&, bool);             \
  template Scores jordan_scores<T>(const Vec<T>&, const Vec<T>&);                     \
  template Scores pj_scores<T>(const Vec<T>&, const Vec<T>&);
RELPOS_PROBE_INSTANTIATE(double)
RELPOS_PROBE_INSTANTIATE(float)
#undef RELPOS_PROBE_INSTANTIATE

}  // namespace relpos::probes
