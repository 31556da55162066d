// Plain float64 references written from the papers' formulas, with Eigen. Slow on purpose: the
// fast kernels and the verify command are checked against these.
#pragma once

#include <Eigen/Dense>

#include "core/mechanism.hpp"

namespace relpos::reference {

// Real coordinate of the (re, im) component of complex coordinate j in a head of dimension D.
// Real index of component (0: real, 1: imaginary) of complex coordinate j, pairs addressed in
// `span` coordinates (pair_span).
inline int real_index(Layout layout, int span, int j, int component) {
  return layout == Layout::Interleaved ? 2 * j + component : j + component * (span / 2);
}

// The coordinates the pairs are addressed in: the head dim, except in the half-split layout,
// where pairs are (j, j + span/2) over the covered pairs, span = 2 x covered pairs (GPT-NeoX's
// partial rotary: rotate_half on the first rotary_dim coordinates; the whole head when every
// pair is covered). The coordinates past the span are untouched.
int pair_span(const Mechanism& m, Layout layout);

// Primal (key) map A(p) = G(-p) of one head at centred position p, as a dense D x D matrix built
// with Eigen's matrix exponential of the realified generator (no closed form involved):
//   exponential shear: A(p) = expm( t (-gamma I + omega J) + eta s sigma(t) N ),  t = -p;
//   jet gates:         A(p) = expm( t (-gamma I + omega J) ) * (alpha_0 I + sum g_k (s
//   sigma(t))^k/k! N^k).
// No exponent clamp: this is the mathematics, the clamp is an implementation choice.
Eigen::MatrixXd key_map(const Mechanism& m, const ParamValues& p, int head, double pos,
                        Layout layout);
// The Jordan-block term's map alone (the whole key map is the product of every term's map, in
// order, with fixed linear terms contributing their matrix M).
Eigen::MatrixXd jordan_key_map(const Mechanism& m, const ParamValues& p, int head, double pos,
                               Layout layout);
// A fixed linear term's matrix M (or M^{-T}).
Eigen::MatrixXd fixed_map(const TransformTerm& t, int D, bool inverse_transpose);
// Contragredient (query) map A(p)^{-T}, by a general matrix inverse.
Eigen::MatrixXd query_map(const Mechanism& m, const ParamValues& p, int head, double pos,
                          Layout layout);
// The paper's closed-form relative operator G(d): per block e^{-gamma d} R(omega d) (x) U(d) with
// U(d) = sum_r (c_r/c_0) N^r, c_r the shear coefficients at s sigma(d), conjugated by the fixed
// maps L applied before the position term: L^{-1} G(d) L. For exact mechanisms this equals
// A(i)^{-1} A(j) with d = i - j; for bounded charts it is the explicit-kernel diagnostic.
Eigen::MatrixXd relative_operator(const Mechanism& m, const ParamValues& p, int head, double d,
                                  Layout layout);
Eigen::MatrixXd jordan_relative_operator(const Mechanism& m, const ParamValues& p, int head,
                                         double d, Layout layout);

// q^T G(d) k without forming G (same closed form, O(D m)).
double relative_score(const Mechanism& m, const ParamValues& p, int head, double d, const double* q,
                      const double* k, Layout layout);

// ALiBi as an augmented exact action: with U(t) = [[1, t], [0, 1]] and A(t) = U(-t), the lifted
// query (-slope, 0) and key (0, 1) give <A(i)^{-T} q_e, A(j) k_e> = -slope (i - j).
struct LiftedPair {
  Eigen::Vector2d q, k;
};
LiftedPair alibi_lift(double slope, double i, double j);

}  // namespace relpos::reference
