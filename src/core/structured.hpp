// Equivariant structured positional rotations (issue 15; paper: "Equivariant Structured Positional
// Rotations", Lemmas 1-3, Theorems 1-2), in float64 with Eigen. No LibTorch.
//
// A commuting family of skew generators L_1..L_dc in a head of dimension d is, by Lemma 1,
//   L_k = U [ (+)_u lambda_{k,u} J  (+)  0_{d_null} ] U^T,   J = [[0, -1], [1, 0]],
// with plane u in columns (2u, 2u+1) of the orthogonal U and the null space in columns 2m.. . A
// vector position r in R^dc rotates by R_STR(r) = expm(sum_k r_k L_k)
//   = U [ (+)_u R_2(theta_u(r)) (+) I ] U^T,   theta_u(r) = sum_k lambda_{k,u} r_k.
// Here: the family by construction (U from a learned W through Cayley or exp), its special cases
// (1-D RoPE, axial and mixed RoPE), Lemma 1 for any list of matrices, the Cayley post-rotations
// (structured and leaky), the logits of Theorem 1 and the Theorem 2 sweep, and the chain rule from
// dL/dU to W for the two basis maps. The fast apply is kernels/structured.hpp.
#pragma once

#include <Eigen/Dense>
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/mechanism.hpp"
#include "core/types.hpp"

namespace relpos::structured {

using Mat = Eigen::MatrixXd;
using Vec = Eigen::VectorXd;

// How the basis U comes from an unconstrained W (A = W - W^T; W = 0 gives I).
enum class BasisMap {
  Cayley,  // U = (I - A)^{-1} (I + A)
  Exp,     // U = expm(A)
};
std::string to_string(BasisMap m);

Mat skew_part(const Mat& W);  // W - W^T
Mat basis_from(BasisMap map, const Mat& W);
// grad_W of a loss whose gradient with respect to U = basis_from(map, W) is G (float64 chain rule:
// Cayley by the closed-form differential, exp by the Frechet derivative as the upper-right block of
// expm([[A^T, G], [0, A^T]])).
Mat basis_grad_w(BasisMap map, const Mat& W, const Mat& G);

// 2 x 2 rotation by theta (counter-clockwise).
Eigen::Matrix2d rot2(double theta);

// A commuting family by construction.
struct Family {
  Mat U;       // d x d orthogonal; plane u = columns (2u, 2u+1), null space = columns 2m..
  Mat lambda;  // [dc, m] plane frequencies per axis

  int d() const { return static_cast<int>(U.rows()); }
  int m() const { return static_cast<int>(lambda.cols()); }
  int dc() const { return static_cast<int>(lambda.rows()); }
  int d_null() const { return d() - 2 * m(); }
  Mat generator(int k) const;  // L_k
  std::vector<Mat> generators() const;
  Vec theta(const Vec& r) const;     // theta_u(r) = sum_k lambda_{k,u} r_k
  Mat rotation(const Vec& r) const;  // the closed form U [(+) R_2(theta_u(r)) (+) I] U^T
  Mat pi_act() const;
  Mat pi_null() const;
};

// Checks shapes (U square and orthogonal to 1e-10, 2m <= d, 1 <= dc <= 3, finite lambda);
// InputError naming the problem.
void check_family(const Family& f);
Family make_family(BasisMap map, const Mat& W, const Mat& lambda);
// W ~ N(0, w_scale^2), lambda ~ U(-lambda_max, lambda_max).
Family random_family(int d, int m, int dc, BasisMap map, std::mt19937_64& rng, double w_scale = 0.3,
                     double lambda_max = 1.0);
// 1-D RoPE: U = I, m = d/2, lambda_u = base^(-2u/d) on interleaved pairs.
Family rope_1d(int d, double base = 10000.0);
// Axial RoPE: U = I, the m planes (default d/2) split into dc contiguous groups (sizes differ by at
// most one, the first axes take the extra planes); axis k drives only its group, with the RoPE
// spectrum of a head of 2 m_k dims: lambda = base^(-2j/(2 m_k)), j = 0..m_k-1.
Family axial_rope(int d, int dc, double base = 100.0, int m = -1);
// Mixed RoPE (RoPE-Mixed's initialisation): U = I, every plane driven by every axis,
// lambda_{k,u} = f_u dir_u[k] with f_u = base^(-2u/(2m)) and dir_u a random unit vector in R^dc.
Family mixed_rope(int d, int dc, std::mt19937_64& rng, double base = 100.0, int m = -1);

// The spec family `structured` (a TransformKind::Structured term, core/mechanisms/structured.cpp)
// as Families on the pair layout's planes: P's column 2u is the unit vector of plane u's first
// coordinate, 2u + 1 of its second (interleaved: 2u, 2u + 1; half-split: u, u + D/2).
Mat layout_planes(int d, Layout layout);
// Head `head` at the term's initial values: U = P (E = I), lambda its initial [d_c, M].
Family term_family(const TransformTerm& t, int head, Layout layout);
// A random draw of what the term learns, for verify: lambda ~ U(-1, 1) (mixed, cayley, exp) and
// U = basis_from(map, W) P with W ~ N(0, 0.3^2) (cayley, exp); axial learns nothing (its own).
Family random_term_family(const TransformTerm& t, int head, Layout layout, std::mt19937_64& rng);

// The free parameterisation for near-commuting tests: L_k = family L_k + eps U (E_k (+) 0) U^T
// with E_k a random 2m x 2m skew matrix of unit spectral norm. The perturbation stays inside the
// active subspace, so Pi_act is still invariant under every L_k and the commutators are the only
// departure from Theorem 1 (leakage into the null space is eta_mix's part, by the post-rotation).
std::vector<Mat> perturbed_generators(const Family& f, double eps, std::mt19937_64& rng);
// eps = max_{a,b} ||[L_a, L_b]||_2 (0 for one generator).
double commutator_size(const std::vector<Mat>& L);
double spectral_norm(const Mat& A);

// Lemma 1 for any list of commuting skew matrices.
struct Decomposition {
  Mat U;       // planes first (columns 2u, 2u+1), then the null space
  Mat lambda;  // [dc, m]
  int m = 0;
  int d_null = 0;
  Mat pi_act, pi_null;
  double residual = 0;  // max_k ||U^T L_k U - block form||_2
  Family family() const { return {U, lambda}; }
};
// Real Schur form of a random generic combination sum_k c_k L_k (best of a few draws), lambda read
// from the 2 x 2 blocks of U^T L_k U; planes with every |lambda_{k,u}| <= tol max(1, max ||L_k||)
// go to the null space. InputError for an empty list, non-square or mismatched shapes, non-finite
// entries, non-skew matrices or commutators above commute_tol max(1, max ||L_k||)^2.
Decomposition decompose(const std::vector<Mat>& L, double tol = 1e-9, double commute_tol = 1e-8);

// R_STR(r) = expm(sum_k r_k L_k), dense (no closed form involved).
Mat rotation_expm(const std::vector<Mat>& L, const Vec& r);

// Lemma 3: P = (I - S)(I + S)^{-1} for skew S.
Mat cayley_post(const Mat& S);
// A random skew matrix with N(0, scale^2) entries above the diagonal.
Mat random_skew(int n, std::mt19937_64& rng, double scale = 1.0);
// A rows x cols matrix of independent N(0, 1) entries.
Mat normal_mat(int rows, int cols, std::mt19937_64& rng);
// The structured family: P = U diag(I_2m, Cayley(S_null)) U^T, as the Cayley transform of
// S = U (0 (+) S_null) U^T with a random S_null.
Mat structured_post(const Mat& U, int m, std::mt19937_64& rng, double scale = 0.5);
// A leaky post-rotation: S = U [[0, E], [-E^T, S_null]] U^T with ||E||_2 = eta. The active-active
// block of S stays zero, so the active block of P departs from I only through the leakage
// (O(eta^2)); eta_mix alone would not bound a rotation inside the active subspace.
Mat leaky_post(const Mat& U, int m, double eta, std::mt19937_64& rng, double scale = 0.5);
// eta_mix = ||B||_2 + ||C||_2, the off-diagonal blocks of U^T P U (active 2m, null d - 2m).
double eta_mix(const Mat& P, const Mat& U, int m);

// The logits of Theorem 1 (paper eq. 22-23) for generators L (commuting or not), the active
// subspace of U's first 2m columns and a post-rotation P: R_sp(r) = R_STR(r) P.
struct LogitModel {
  std::vector<Mat> L;
  Mat U;
  int m = 0;
  Mat P;  // identity when there is none

  Mat pi_act() const;
  // alpha_ij = (1/sqrt(2m)) (Pi R_sp(r_i) q_act)^T (Pi R_sp(r_j) k_act) for every pair: [T, T]
  // from positions [T, dc], queries and keys [T, d] (rows).
  Mat logits(const Mat& r, const Mat& q, const Mat& k) const;
  // (1/sqrt(2m)) q_act^T Pi R_STR(r_j - r_i) Pi k_act
  Mat relative_logits(const Mat& r, const Mat& q, const Mat& k) const;
  // |q_i,act| |k_j,act| / sqrt(2m): the logits' scale
  Mat scale(const Mat& q, const Mat& k) const;
};

// Theorem 1 on one model: the worst over pairs of |alpha_ij - relative form| and of
// |alpha_ij(r + s) - alpha_ij(r)|, each relative to |q_act| |k_act| / sqrt(2m).
struct Theorem1Check {
  double relative_err = 0, shift_err = 0;
  double max() const { return std::max(relative_err, shift_err); }
};
Theorem1Check theorem1_check(const LogitModel& model, const Mat& r, const Mat& q, const Mat& k,
                             const Vec& shift);

// Positions [T, dc] uniform in [-r_max, r_max].
Mat random_positions(int T, int dc, double r_max, std::mt19937_64& rng);

// Theorem 1 rows for the CLI: family kinds x dc.
struct Theorem1Row {
  std::string kind;  // learned-basis cayley, learned-basis exp, axial, mixed, matrices-only
  int dc = 0, d = 0, m = 0;
  bool post_rotation = false;   // a structured Cayley post-rotation (where d_null > 0)
  double max_err = 0;           // worst of the relative-form and shift errors
  double lemma1_residual = -1;  // matrices-only: the decomposition's residual
  bool pass = false;            // max_err <= 1e-12
};
inline constexpr double kTheorem1Tol = 1e-12;
std::vector<Theorem1Row> theorem1_rows(const std::vector<int>& dims, uint64_t seed);

// Theorem 2: deviation of alpha from the relative form against
// (eps |r_i|_1 |r_j|_1 + eta_mix) |q_act| |k_act|, over perturbation sizes and leakages. The bound
// as stated needs two things the paper leaves implicit, and the sweep builds them in: generator
// perturbations inside the active subspace (one that leaks out of it breaks eq. 23 with eps = 0 in
// d_c = 1), and post-rotations whose active block departs from I only through leakage (a rotation
// inside the active subspace has eta_mix = 0 and breaks eq. 23 at O(1)); tests show both.
struct SweepConfig {
  std::vector<int> dims{1, 2, 3};
  std::vector<double> eps{0, 1e-6, 1e-4, 1e-2, 1e-1};  // generator perturbation scale
  std::vector<double> eta{0, 1e-6, 1e-4, 1e-2, 1e-1};  // post-rotation leakage ||E||
  int families = 3;                                    // random families per cell
  int d = 16, m = 6;
  int positions = 10;
  double r_max = 8;
  uint64_t seed = 1;
};
struct SweepRow {
  int dc = 0;
  double eps_scale = 0, eta_scale = 0;
  double commutator = 0, eta_mix = 0;  // the largest over the cell's families
  int pairs = 0;
  double max_dev = 0;     // max |alpha - relative form|
  double worst_dev = 0;   // the deviation at the pair of the largest ratio
  double worst_term = 0;  // (eps |r_i|_1 |r_j|_1 + eta_mix) |q_act| |k_act| there
  double max_ratio = 0;   // max dev / term over pairs with term > 0 (0 when none)
};
struct SweepResult {
  std::vector<SweepRow> rows;
  double fitted_c = 0;       // max ratio over the sweep
  double exact_max_dev = 0;  // the largest deviation where the bound term is 0 (eps = eta = 0)
  int configs = 0, pairs = 0;
};
SweepResult theorem2_sweep(const SweepConfig& cfg);

}  // namespace relpos::structured
