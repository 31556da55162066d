// GCC 12 at -O3 reports -Wmaybe-uninitialized inside Eigen's Householder and triangular products
// as instantiated by RealSchur and the eigen solvers here (false positives; the same code is clean
// at -O1): silenced for Eigen's headers only, which the first include below brings in.
// (clang, which builds the fuzzer, has no such warning and would reject the unknown option)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Dense>
#include <unsupported/Eigen/MatrixFunctions>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/structured.hpp"
#include "core/types.hpp"

namespace relpos::structured {

namespace {

Eigen::Matrix2d J2() {
  Eigen::Matrix2d J;
  J << 0, -1, 1, 0;
  return J;
}

bool all_finite(const Mat& A) {
  return A.allFinite();
}

// U^T L U in block form for frequencies lambda_{k, .} of one axis.
Mat block_form(const Mat& lambda, int k, int d) {
  Mat B = Mat::Zero(d, d);
  for (int u = 0; u < lambda.cols(); ++u) B.block(2 * u, 2 * u, 2, 2) = lambda(k, u) * J2();
  return B;
}

double max_norm(const std::vector<Mat>& L) {
  double s = 0;
  for (const auto& A : L) s = std::max(s, spectral_norm(A));
  return s;
}

Vec row_of(const Mat& A, int i) {
  return A.row(i).transpose();
}

}  // namespace

std::string to_string(BasisMap m) {
  return m == BasisMap::Cayley ? "cayley" : "exp";
}

Mat skew_part(const Mat& W) {
  return W - W.transpose();
}

Mat basis_from(BasisMap map, const Mat& W) {
  if (W.rows() != W.cols())
    throw InputError(fmt::format("structured: W is {} x {}, not square", W.rows(), W.cols()));
  if (!all_finite(W)) throw InputError("structured: W has a non-finite entry");
  const Mat A = skew_part(W);
  const Mat I = Mat::Identity(W.rows(), W.cols());
  if (map == BasisMap::Exp) return A.exp();
  // I - A is invertible for skew A (eigenvalues 1 - i mu)
  return (I - A).partialPivLu().solve(I + A);
}

Mat basis_grad_w(BasisMap map, const Mat& W, const Mat& G) {
  if (G.rows() != W.rows() || G.cols() != W.cols())
    throw InputError(fmt::format("structured: dL/dU is {} x {}, W is {} x {}", G.rows(), G.cols(),
                                 W.rows(), W.cols()));
  const Mat A = skew_part(W);
  const int n = static_cast<int>(A.rows());
  const Mat I = Mat::Identity(n, n);
  Mat gA;
  if (map == BasisMap::Cayley) {
    // E = (I-A)^{-1}(I+A), dE = (I-A)^{-1} dA (I + E): grad_A = (I-A)^{-T} G (I+E)^T
    const auto lu = (I - A).partialPivLu();
    const Mat E = lu.solve(I + A);
    gA = (I - A).transpose().partialPivLu().solve(G) * (I + E).transpose();
  } else {
    // grad_A = D expm(A^T)[G]: the upper-right block of expm([[A^T, G], [0, A^T]])
    Mat big = Mat::Zero(2 * n, 2 * n);
    big.topLeftCorner(n, n) = A.transpose();
    big.bottomRightCorner(n, n) = A.transpose();
    big.topRightCorner(n, n) = G;
    const Mat e = big.exp();
    gA = e.topRightCorner(n, n);
  }
  return gA - gA.transpose();  // A = W - W^T
}

Eigen::Matrix2d rot2(double theta) {
  Eigen::Matrix2d R;
  const double c = std::cos(theta), s = std::sin(theta);
  R << c, -s, s, c;
  return R;
}

// ---- the family -------------------------------------------------------------------------------

Mat Family::generator(int k) const {
  return U * block_form(lambda, k, d()) * U.transpose();
}

std::vector<Mat> Family::generators() const {
  std::vector<Mat> L;
  for (int k = 0; k < dc(); ++k) L.push_back(generator(k));
  return L;
}

Vec Family::theta(const Vec& r) const {
  if (r.size() != dc())
    throw InputError(
        fmt::format("structured: position has {} axes, the family {}", r.size(), dc()));
  return lambda.transpose() * r;
}

Mat Family::rotation(const Vec& r) const {
  const Vec th = theta(r);
  Mat inner = Mat::Identity(d(), d());
  for (int u = 0; u < m(); ++u) inner.block(2 * u, 2 * u, 2, 2) = rot2(th(u));
  return U * inner * U.transpose();
}

Mat Family::pi_act() const {
  const auto Ua = U.leftCols(2 * m());
  return Ua * Ua.transpose();
}

Mat Family::pi_null() const {
  const auto Un = U.rightCols(d_null());
  return Un * Un.transpose();
}

void check_family(const Family& f) {
  if (f.U.rows() != f.U.cols() || f.U.rows() == 0)
    throw InputError(
        fmt::format("structured: basis U is {} x {}, not square", f.U.rows(), f.U.cols()));
  if (f.dc() < 1 || f.dc() > 3)
    throw InputError(fmt::format("structured: {} position axes (d_c must be 1..3)", f.dc()));
  if (2 * f.m() > f.d())
    throw InputError(fmt::format("structured: {} planes do not fit head dim {}", f.m(), f.d()));
  if (!all_finite(f.U) || !all_finite(f.lambda))
    throw InputError("structured: basis or frequencies have a non-finite entry");
  const double err = (f.U.transpose() * f.U - Mat::Identity(f.d(), f.d())).cwiseAbs().maxCoeff();
  if (err > 1e-10)
    throw InputError(
        fmt::format("structured: basis U is not orthogonal (|U^T U - I| = {:.3g})", err));
}

Family make_family(BasisMap map, const Mat& W, const Mat& lambda) {
  Family f{basis_from(map, W), lambda};
  check_family(f);
  return f;
}

Family random_family(int d, int m, int dc, BasisMap map, std::mt19937_64& rng, double w_scale,
                     double lambda_max) {
  if (d < 2 || d % 2) throw InputError(fmt::format("structured: head dim {} is not even", d));
  std::normal_distribution<double> N(0.0, w_scale);
  std::uniform_real_distribution<double> Ul(-lambda_max, lambda_max);
  Mat W(d, d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) W(i, j) = N(rng);
  Mat lambda(std::max(dc, 0), std::max(m, 0));
  for (int k = 0; k < lambda.rows(); ++k)
    for (int u = 0; u < lambda.cols(); ++u) lambda(k, u) = Ul(rng);
  return make_family(map, W, lambda);
}

Family rope_1d(int d, double base) {
  if (d < 2 || d % 2) throw InputError(fmt::format("structured: head dim {} is not even", d));
  Mat lambda(1, d / 2);
  for (int u = 0; u < d / 2; ++u) lambda(0, u) = std::pow(base, -2.0 * u / d);
  return {Mat::Identity(d, d), lambda};
}

namespace {
int planes_or_default(int d, int m) {
  if (d < 2 || d % 2) throw InputError(fmt::format("structured: head dim {} is not even", d));
  if (m < 0) m = d / 2;
  if (m < 1 || 2 * m > d)
    throw InputError(fmt::format("structured: {} planes do not fit head dim {}", m, d));
  return m;
}
void check_dc(int dc) {
  if (dc < 1 || dc > 3)
    throw InputError(fmt::format("structured: {} position axes (d_c must be 1..3)", dc));
}
}  // namespace

Family axial_rope(int d, int dc, double base, int m) {
  m = planes_or_default(d, m);
  check_dc(dc);
  if (m < dc) throw InputError(fmt::format("structured: {} planes for {} axes", m, dc));
  Mat lambda = Mat::Zero(dc, m);
  int u = 0;
  for (int k = 0; k < dc; ++k) {
    const int mk = m / dc + (k < m % dc ? 1 : 0);
    for (int j = 0; j < mk; ++j, ++u) lambda(k, u) = std::pow(base, -2.0 * j / (2.0 * mk));
  }
  return {Mat::Identity(d, d), lambda};
}

Mat layout_planes(int d, Layout layout) {
  Mat P = Mat::Zero(d, d);
  for (int u = 0; u < d / 2; ++u) {
    const bool split = layout == Layout::HalfSplit;
    P(split ? u : 2 * u, 2 * u) = 1;
    P(split ? u + d / 2 : 2 * u + 1, 2 * u + 1) = 1;
  }
  return P;
}

Family term_family(const TransformTerm& t, int head, Layout layout) {
  if (!t.vector_positions())
    throw InputError(fmt::format("structured: '{}' is not a vector-position rotation", t.name));
  const int dc = t.vector_dims, M = t.planes;
  const auto heads = static_cast<int>(t.plane_freqs.size() / (static_cast<size_t>(dc) * M));
  if (head < 0 || head >= heads)
    throw InputError(fmt::format("structured: head {} of {}", head, heads));
  Mat lambda(dc, M);
  for (int k = 0; k < dc; ++k)
    for (int u = 0; u < M; ++u)
      lambda(k, u) = t.plane_freqs[(static_cast<size_t>(head) * dc + k) * M + u];
  return {layout_planes(2 * M, layout), lambda};
}

Family random_term_family(const TransformTerm& t, int head, Layout layout, std::mt19937_64& rng) {
  Family f = term_family(t, head, layout);
  if (t.basis == "axial") return f;
  std::uniform_real_distribution<double> Ul(-1.0, 1.0);
  for (int k = 0; k < f.lambda.rows(); ++k)
    for (int u = 0; u < f.lambda.cols(); ++u) f.lambda(k, u) = Ul(rng);
  if (t.basis == "cayley" || t.basis == "exp") {
    std::normal_distribution<double> N(0.0, 0.3);
    Mat W(f.d(), f.d());
    for (int i = 0; i < f.d(); ++i)
      for (int j = 0; j < f.d(); ++j) W(i, j) = N(rng);
    f.U = basis_from(t.basis == "exp" ? BasisMap::Exp : BasisMap::Cayley, W) * f.U;
  }
  return f;
}

Family mixed_rope(int d, int dc, std::mt19937_64& rng, double base, int m) {
  m = planes_or_default(d, m);
  check_dc(dc);
  std::normal_distribution<double> N(0.0, 1.0);
  Mat lambda(dc, m);
  for (int u = 0; u < m; ++u) {
    Vec dir(dc);
    for (int k = 0; k < dc; ++k) dir(k) = N(rng);
    dir /= dir.norm();
    lambda.col(u) = std::pow(base, -2.0 * u / (2.0 * m)) * dir;
  }
  return {Mat::Identity(d, d), lambda};
}

// ---- near-commuting families ------------------------------------------------------------------

double spectral_norm(const Mat& A) {
  if (A.size() == 0) return 0.0;
  // sqrt of the largest eigenvalue of the smaller Gram matrix: accurate relative to ||A||, and
  // JacobiSVD's QR preconditioner for non-square blocks trips GCC's -Wmaybe-uninitialized
  const Mat G = A.rows() <= A.cols() ? Mat(A * A.transpose()) : Mat(A.transpose() * A);
  const double top =
      Eigen::SelfAdjointEigenSolver<Mat>(G, Eigen::EigenvaluesOnly).eigenvalues().maxCoeff();
  return std::sqrt(std::max(top, 0.0));
}

std::vector<Mat> perturbed_generators(const Family& f, double eps, std::mt19937_64& rng) {
  check_family(f);
  std::vector<Mat> L = f.generators();
  if (eps == 0 || f.m() == 0) return L;
  const auto Ua = f.U.leftCols(2 * f.m());
  for (auto& Lk : L) {
    Mat E = random_skew(2 * f.m(), rng);
    E /= spectral_norm(E);
    Lk += eps * Ua * E * Ua.transpose();
  }
  return L;
}

double commutator_size(const std::vector<Mat>& L) {
  double eps = 0;
  for (size_t a = 0; a < L.size(); ++a)
    for (size_t b = a + 1; b < L.size(); ++b)
      eps = std::max(eps, spectral_norm(L[a] * L[b] - L[b] * L[a]));
  return eps;
}

// ---- Lemma 1 ----------------------------------------------------------------------------------

namespace {

// One draw: Schur vectors of sum_k c_k L_k, planes read off and ordered, or residual = inf.
Decomposition decompose_once(const std::vector<Mat>& L, double null_tol, std::mt19937_64& rng) {
  const int d = static_cast<int>(L[0].rows());
  const int dc = static_cast<int>(L.size());
  std::normal_distribution<double> N(0.0, 1.0);
  Mat M = Mat::Zero(d, d);
  for (const auto& Lk : L) M += N(rng) * Lk;
  const Eigen::RealSchur<Mat> schur(M);
  const Mat& T = schur.matrixT();
  const Mat& Q = schur.matrixU();
  std::vector<int> planes, nulls;  // first columns of 2 x 2 blocks; 1 x 1 columns
  for (int i = 0; i < d;) {
    if (i + 1 < d && T(i + 1, i) != 0.0) {
      planes.push_back(i);
      i += 2;
    } else {
      nulls.push_back(i);
      i += 1;
    }
  }
  std::vector<std::pair<int, Vec>> active;
  for (int i : planes) {
    Vec lam(dc);
    for (int k = 0; k < dc; ++k) {
      const Mat B = Q.middleCols(i, 2).transpose() * L[k] * Q.middleCols(i, 2);
      lam(k) = 0.5 * (B(1, 0) - B(0, 1));
    }
    if (lam.cwiseAbs().maxCoeff() > null_tol) {
      active.emplace_back(i, lam);
    } else {
      nulls.push_back(i);
      nulls.push_back(i + 1);
    }
  }
  Decomposition out;
  out.m = static_cast<int>(active.size());
  out.d_null = d - 2 * out.m;
  out.U.resize(d, d);
  out.lambda.resize(dc, out.m);
  for (int u = 0; u < out.m; ++u) {
    out.U.middleCols(2 * u, 2) = Q.middleCols(active[u].first, 2);
    out.lambda.col(u) = active[u].second;
  }
  std::sort(nulls.begin(), nulls.end());
  for (size_t j = 0; j < nulls.size(); ++j)
    out.U.col(2 * out.m + static_cast<int>(j)) = Q.col(nulls[j]);
  out.residual = 0;
  for (int k = 0; k < dc; ++k)
    out.residual = std::max(out.residual, spectral_norm(out.U.transpose() * L[k] * out.U -
                                                        block_form(out.lambda, k, d)));
  const auto Ua = out.U.leftCols(2 * out.m);
  const auto Un = out.U.rightCols(out.d_null);
  out.pi_act = Ua * Ua.transpose();
  out.pi_null = Un * Un.transpose();
  return out;
}

}  // namespace

Decomposition decompose(const std::vector<Mat>& L, double tol, double commute_tol) {
  if (L.empty()) throw InputError("structured: Lemma 1 needs at least one generator");
  const auto d = L[0].rows();
  if (d == 0) throw InputError("structured: empty generator");
  for (size_t k = 0; k < L.size(); ++k) {
    if (L[k].rows() != d || L[k].cols() != d)
      throw InputError(fmt::format("structured: generator {} is {} x {}, expected {} x {}", k,
                                   L[k].rows(), L[k].cols(), d, d));
    if (!all_finite(L[k]))
      throw InputError(fmt::format("structured: generator {} has a non-finite entry", k));
  }
  const double scale = std::max(1.0, max_norm(L));
  for (size_t k = 0; k < L.size(); ++k) {
    const double asym = spectral_norm(L[k] + L[k].transpose());
    if (asym > 1e-10 * scale)
      throw InputError(fmt::format(
          "structured: generator {} is not skew-symmetric (|L + L^T| = {:.3g})", k, asym));
  }
  const double eps = commutator_size(L);
  if (eps > commute_tol * scale * scale)
    throw InputError(
        fmt::format("structured: generators do not commute (max |[L_a, L_b]| = {:.3g} > {:.3g})",
                    eps, commute_tol * scale * scale));
  // A generic combination has distinct eigenvalue pairs except for planes with equal joint
  // frequencies, on which every L_k acts alike; a few draws guard against an unlucky near-tie.
  std::mt19937_64 rng(0x5eed5);
  Decomposition best;
  best.residual = std::numeric_limits<double>::infinity();
  for (int draw = 0; draw < 3; ++draw) {
    Decomposition d1 = decompose_once(L, tol * scale, rng);
    if (d1.residual < best.residual) best = std::move(d1);
    if (best.residual <= 1e-12 * scale) break;
  }
  return best;
}

Mat rotation_expm(const std::vector<Mat>& L, const Vec& r) {
  if (L.empty()) throw InputError("structured: no generators");
  if (static_cast<size_t>(r.size()) != L.size())
    throw InputError(fmt::format("structured: position has {} axes, there are {} generators",
                                 r.size(), L.size()));
  if (!r.allFinite()) throw InputError("structured: non-finite position");
  Mat A = Mat::Zero(L[0].rows(), L[0].cols());
  for (size_t k = 0; k < L.size(); ++k) A += r(static_cast<Eigen::Index>(k)) * L[k];
  return A.exp();
}

// ---- post-rotations ---------------------------------------------------------------------------

Mat cayley_post(const Mat& S) {
  if (S.rows() != S.cols())
    throw InputError(fmt::format("structured: S is {} x {}, not square", S.rows(), S.cols()));
  if (!all_finite(S)) throw InputError("structured: S has a non-finite entry");
  const double asym = spectral_norm(S + S.transpose());
  if (asym > 1e-10 * std::max(1.0, spectral_norm(S)))
    throw InputError(fmt::format("structured: S is not skew-symmetric (|S + S^T| = {:.3g})", asym));
  const Mat I = Mat::Identity(S.rows(), S.cols());
  // (I - S)(I + S)^{-1} = ((I + S)^{-T} (I - S)^T)^T, and I +- S commute
  return (I + S).partialPivLu().solve(I - S);
}

Mat random_skew(int n, std::mt19937_64& rng, double scale) {
  std::normal_distribution<double> N(0.0, scale);
  Mat S = Mat::Zero(n, n);
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j) {
      S(i, j) = N(rng);
      S(j, i) = -S(i, j);
    }
  return S;
}

namespace {
void check_basis_planes(const Mat& U, int m) {
  if (U.rows() != U.cols())
    throw InputError(fmt::format("structured: basis U is {} x {}, not square", U.rows(), U.cols()));
  if (m < 0 || 2 * m > U.rows())
    throw InputError(fmt::format("structured: {} planes do not fit head dim {}", m, U.rows()));
}
}  // namespace

Mat structured_post(const Mat& U, int m, std::mt19937_64& rng, double scale) {
  check_basis_planes(U, m);
  const int d = static_cast<int>(U.rows()), dn = d - 2 * m;
  Mat inner = Mat::Zero(d, d);
  inner.bottomRightCorner(dn, dn) = random_skew(dn, rng, scale);
  return cayley_post(U * inner * U.transpose());
}

Mat leaky_post(const Mat& U, int m, double eta, std::mt19937_64& rng, double scale) {
  check_basis_planes(U, m);
  const int d = static_cast<int>(U.rows()), dn = d - 2 * m;
  if (dn == 0 && eta != 0)
    throw InputError("structured: a leaky post-rotation needs a null space (2m < d)");
  Mat inner = Mat::Zero(d, d);
  inner.bottomRightCorner(dn, dn) = random_skew(dn, rng, scale);
  if (eta != 0 && m > 0) {
    std::normal_distribution<double> N(0.0, 1.0);
    Mat E(2 * m, dn);
    for (int i = 0; i < E.rows(); ++i)
      for (int j = 0; j < E.cols(); ++j) E(i, j) = N(rng);
    E *= eta / spectral_norm(E);
    inner.topRightCorner(2 * m, dn) = E;
    inner.bottomLeftCorner(dn, 2 * m) = -E.transpose();
  }
  return cayley_post(U * inner * U.transpose());
}

double eta_mix(const Mat& P, const Mat& U, int m) {
  check_basis_planes(U, m);
  if (P.rows() != U.rows() || P.cols() != U.cols())
    throw InputError(fmt::format("structured: P is {} x {}, U is {} x {}", P.rows(), P.cols(),
                                 U.rows(), U.cols()));
  const int d = static_cast<int>(U.rows()), dn = d - 2 * m;
  const Mat B = U.transpose() * P * U;
  return spectral_norm(B.topRightCorner(2 * m, dn)) + spectral_norm(B.bottomLeftCorner(dn, 2 * m));
}

// ---- logits -----------------------------------------------------------------------------------

Mat LogitModel::pi_act() const {
  const auto Ua = U.leftCols(2 * m);
  return Ua * Ua.transpose();
}

namespace {
void check_model(const LogitModel& mo, const Mat& r, const Mat& q, const Mat& k) {
  if (mo.L.empty()) throw InputError("structured: no generators");
  const auto d = mo.U.rows();
  if (mo.m < 1 || 2 * mo.m > d)
    throw InputError(fmt::format("structured: {} planes do not fit head dim {}", mo.m, d));
  if (r.cols() != static_cast<Eigen::Index>(mo.L.size()))
    throw InputError(fmt::format("structured: positions have {} axes, there are {} generators",
                                 r.cols(), mo.L.size()));
  if (q.rows() != r.rows() || k.rows() != r.rows() || q.cols() != d || k.cols() != d)
    throw InputError("structured: queries and keys must be [T, d] with T the positions' rows");
  if (mo.P.rows() != d || mo.P.cols() != d) throw InputError("structured: P must be d x d");
}
}  // namespace

Mat LogitModel::logits(const Mat& r, const Mat& q, const Mat& k) const {
  check_model(*this, r, q, k);
  const Mat Pi = pi_act();
  const auto T = r.rows();
  Mat qt(T, U.rows()), kt(T, U.rows());
  for (Eigen::Index i = 0; i < T; ++i) {
    // R_sp(r) = R_STR(r) P: the post-rotation acts first
    const Mat M = Pi * rotation_expm(L, row_of(r, static_cast<int>(i))) * P * Pi;
    qt.row(i) = (M * q.row(i).transpose()).transpose();
    kt.row(i) = (M * k.row(i).transpose()).transpose();
  }
  return qt * kt.transpose() / std::sqrt(2.0 * m);
}

Mat LogitModel::relative_logits(const Mat& r, const Mat& q, const Mat& k) const {
  check_model(*this, r, q, k);
  const Mat Pi = pi_act();
  const auto T = r.rows();
  Mat out(T, T);
  for (Eigen::Index i = 0; i < T; ++i)
    for (Eigen::Index j = 0; j < T; ++j) {
      const Vec dr = (r.row(j) - r.row(i)).transpose();
      const Vec qa = Pi * q.row(i).transpose(), ka = Pi * k.row(j).transpose();
      out(i, j) = qa.dot(Pi * rotation_expm(L, dr) * Pi * ka);
    }
  return out / std::sqrt(2.0 * m);
}

Mat LogitModel::scale(const Mat& q, const Mat& k) const {
  const Mat Pi = pi_act();
  const Vec nq = (q * Pi).rowwise().norm(), nk = (k * Pi).rowwise().norm();
  return nq * nk.transpose() / std::sqrt(2.0 * m);
}

Theorem1Check theorem1_check(const LogitModel& model, const Mat& r, const Mat& q, const Mat& k,
                             const Vec& shift) {
  if (shift.size() != r.cols())
    throw InputError(
        fmt::format("structured: shift has {} axes, positions {}", shift.size(), r.cols()));
  const Mat a = model.logits(r, q, k);
  const Mat rel = model.relative_logits(r, q, k);
  const Mat rs = r.rowwise() + shift.transpose();
  const Mat as = model.logits(rs, q, k);
  const Mat sc = model.scale(q, k).array().max(1e-300).matrix();
  Theorem1Check c;
  c.relative_err = ((a - rel).array().abs() / sc.array()).maxCoeff();
  c.shift_err = ((as - a).array().abs() / sc.array()).maxCoeff();
  return c;
}

Mat random_positions(int T, int dc, double r_max, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> Ur(-r_max, r_max);
  Mat r(T, dc);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < dc; ++k) r(t, k) = Ur(rng);
  return r;
}

Mat normal_mat(int rows, int cols, std::mt19937_64& rng) {
  std::normal_distribution<double> N(0.0, 1.0);
  Mat A(rows, cols);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) A(i, j) = N(rng);
  return A;
}

std::vector<Theorem1Row> theorem1_rows(const std::vector<int>& dims, uint64_t seed) {
  constexpr int d = 16, m = 6, T = 9;
  constexpr double r_max = 8;
  std::vector<Theorem1Row> rows;
  for (int dc : dims) {
    check_dc(dc);
    std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(dc));
    const auto run = [&](const std::string& kind, const std::vector<Mat>& L, const Mat& U, int mm,
                         bool post, double resid) {
      LogitModel mo{L, U, mm, post ? structured_post(U, mm, rng) : Mat::Identity(d, d)};
      const Mat r = random_positions(T, dc, r_max, rng);
      const Mat q = normal_mat(T, d, rng), k = normal_mat(T, d, rng);
      const Vec s = random_positions(1, dc, r_max, rng).row(0).transpose();
      Theorem1Row row{kind, dc, d, mm, post, theorem1_check(mo, r, q, k, s).max(), resid, false};
      row.pass = std::isfinite(row.max_err) && row.max_err <= kTheorem1Tol;
      rows.push_back(row);
    };
    for (BasisMap map : {BasisMap::Cayley, BasisMap::Exp}) {
      const Family f = random_family(d, m, dc, map, rng);
      run("learned-basis " + to_string(map), f.generators(), f.U, m, true, -1);
    }
    const Family ax = axial_rope(d, dc, 100.0, m);
    run("axial", ax.generators(), ax.U, m, true, -1);
    const Family mx = mixed_rope(d, dc, rng, 100.0, m);
    run("mixed", mx.generators(), mx.U, m, true, -1);
    // matrices only: axial RoPE conjugated by a random orthogonal matrix, through Lemma 1
    const Mat O = basis_from(BasisMap::Cayley, normal_mat(d, d, rng));
    std::vector<Mat> L;
    for (const auto& Lk : ax.generators()) L.push_back(O * Lk * O.transpose());
    const Decomposition dec = decompose(L);
    run("matrices-only (Lemma 1)", L, dec.U, dec.m, true, dec.residual);
  }
  return rows;
}

// ---- Theorem 2 --------------------------------------------------------------------------------

SweepResult theorem2_sweep(const SweepConfig& cfg) {
  if (cfg.d < 2 || cfg.d % 2 || cfg.m < 1 || 2 * cfg.m >= cfg.d)
    throw InputError(fmt::format(
        "structured: sweep needs an even head dim with a null space (d {}, m {})", cfg.d, cfg.m));
  if (cfg.positions < 1 || cfg.families < 1)
    throw InputError("structured: sweep needs positions >= 1 and families >= 1");
  SweepResult res;
  for (int dc : cfg.dims) {
    check_dc(dc);
    for (size_t ei = 0; ei < cfg.eps.size(); ++ei)
      for (size_t hi = 0; hi < cfg.eta.size(); ++hi) {
        const double e = cfg.eps[ei], h = cfg.eta[hi];
        if (!(e >= 0) || !(h >= 0) || !std::isfinite(e) || !std::isfinite(h))
          throw InputError(
              fmt::format("structured: sweep sizes must be finite and >= 0 ({}, {})", e, h));
        SweepRow row;
        row.dc = dc;
        row.eps_scale = e;
        row.eta_scale = h;
        for (int fi = 0; fi < cfg.families; ++fi) {
          std::seed_seq seq{cfg.seed, static_cast<uint64_t>(dc), static_cast<uint64_t>(ei),
                            static_cast<uint64_t>(hi), static_cast<uint64_t>(fi)};
          std::mt19937_64 rng(seq);
          const Family f =
              random_family(cfg.d, cfg.m, dc, fi % 2 ? BasisMap::Exp : BasisMap::Cayley, rng);
          LogitModel mo{perturbed_generators(f, e, rng), f.U, f.m(),
                        leaky_post(f.U, f.m(), h, rng)};
          const double eps_measured = commutator_size(mo.L);
          const double mix_measured = eta_mix(mo.P, f.U, f.m());
          row.commutator = std::max(row.commutator, eps_measured);
          row.eta_mix = std::max(row.eta_mix, mix_measured);
          // unperturbed families commute and structured P keep the null space by construction:
          // their measured commutator and leakage are rounding, and the bound term is 0 there
          const double eps = e == 0 ? 0.0 : eps_measured, mix = h == 0 ? 0.0 : mix_measured;
          const Mat r = random_positions(cfg.positions, dc, cfg.r_max, rng);
          const Mat q = normal_mat(cfg.positions, cfg.d, rng),
                    k = normal_mat(cfg.positions, cfg.d, rng);
          const Mat dev = (mo.logits(r, q, k) - mo.relative_logits(r, q, k)).cwiseAbs();
          const Mat Pi = mo.pi_act();
          const Vec nq = (q * Pi).rowwise().norm(), nk = (k * Pi).rowwise().norm();
          const Vec r1 = r.cwiseAbs().rowwise().sum();
          ++res.configs;
          for (int i = 0; i < cfg.positions; ++i)
            for (int j = 0; j < cfg.positions; ++j) {
              ++row.pairs;
              const double term = (eps * r1(i) * r1(j) + mix) * nq(i) * nk(j);
              row.max_dev = std::max(row.max_dev, dev(i, j));
              if (term > 0) {
                const double ratio = dev(i, j) / term;
                if (ratio > row.max_ratio) {
                  row.max_ratio = ratio;
                  row.worst_dev = dev(i, j);
                  row.worst_term = term;
                }
              } else {
                res.exact_max_dev = std::max(res.exact_max_dev, dev(i, j) / (nq(i) * nk(j)));
              }
            }
        }
        res.pairs += row.pairs;
        res.fitted_c = std::max(res.fitted_c, row.max_ratio);
        res.rows.push_back(row);
      }
  }
  return res;
}

}  // namespace relpos::structured
