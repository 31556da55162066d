// Feature dictionaries of the basis-level probes: which lag functions a mechanism's primitive basis
// contains. Every column is a primitive jet feature of core/jet_features.hpp (or the intercept),
// so the probes and the mechanisms share one formula.
//
// Jordan-RoPE (`causal_delta_features`, spec jordan-rope.md 1.9): intercept first, then the columns
// of the method in the reference order (all cos of jet order r, all sin of order r, next r).
// PJ-RoPE fixed-kernel recovery (pj-rope.md 3.1) and the GRAPE special cases (1.8, 3.6): no
// intercept here; the lstsq protocol standardises the columns and appends the intercept last.
#pragma once

#include <Eigen/Dense>
#include <string>
#include <vector>

#include "core/jet_features.hpp"

namespace relpos::probes {

// One column: the cos (re) or sin (im) component of J_r(d) for frequency omega, times `scale`;
// or the constant 1 (intercept).
struct Column {
  enum class Kind { Ones, Re, Im };
  Kind kind = Kind::Ones;
  JetChart chart;
  double omega = 0.0;
  int r = 0;
  double scale = 1.0;
  std::string name;

  double value(double d) const;
};

struct Dictionary {
  std::string method;  // reference method / basis name
  std::vector<Column> columns;
};

// Jordan-RoPE probe grid (spec 1.9, 3.1-3.3).
struct JordanGrid {
  int head_dim = 64;
  int num_freqs = 16;
  double theta = 10000.0;
  double gamma = 1e-4;
  double L = 1024.0;
  bool bounded_tau = true;
};

// Methods: nope, rope, rope_matched_mM, alibi, rope_alibi, damped_rope, real_jordan, direct_sum,
// direct_sum_poly[_mM], jordan_rope, jordan_no_gamma, jordan_raw_tau, jordan_exact[...][_cCCC],
// jordan_mM, jordan_scaled_mM_cCCC. Throws InputError naming the method and the valid forms.
Dictionary jordan_dictionary(const std::string& method, const JordanGrid& g);

// PJ-RoPE fixed-kernel bases (3.1): rope, alibi, alibi_lc, rope_alibi, jordan_R{k}, scaled_R{k},
// scaled_R{k}_affine, lc_R{k}, lc_R{k}_affine (k >= 1), for one frequency omega and scale L.
Dictionary pj_dictionary(const std::string& basis, double omega, double L);
std::vector<std::string> pj_fixed_bases(int max_order);  // the 15 bases of the script for R = 3

// GRAPE special cases (1.8): grape_m_rope [cos, sin], grape_a_alibi [x], grape_ma_rope_alibi
// [cos, sin, x], pj_fj_r{R} (monomial jets r = 0..R), pj_lc_r{R} (light-cone jets, no affine),
// pj_lc_r{R}_affine (plus eta_L).
Dictionary grape_dictionary(const std::string& basis, double omega, double L);

// rows = lags, one column per dictionary column.
Eigen::MatrixXd build_matrix(const Dictionary& dict, const std::vector<double>& lags);

std::vector<double> lag_range(int count);  // 0, 1, ..., count-1

}  // namespace relpos::probes
