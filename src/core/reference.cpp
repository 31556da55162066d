#include "core/reference.hpp"

#include <fmt/format.h>

#include <unsupported/Eigen/MatrixFunctions>

#include "core/charts.hpp"

namespace relpos::reference {

namespace {

// Visits every block of every segment with its parameter index.
template <class F>
void for_each_block(const Mechanism& m, const ParamValues& p, int head, F&& f) {
  for (const auto& s : m.segments())
    for (int b = 0; b < s.blocks; ++b)
      f(s, b, static_cast<size_t>(head) * p.blocks + s.first_block + b);
}

}  // namespace

Eigen::MatrixXd fixed_map(const TransformTerm& t, int D, bool inverse_transpose) {
  if (t.kind != TransformKind::FixedLinear)  // (a vector-position rotation has no scalar map)
    throw InputError(fmt::format(
        "'{}' rotates by vector positions: its maps are structured::Family rotations of r in "
        "R^{}, not maps of a scalar position",
        t.name, t.vector_dims));
  const auto& v = inverse_transpose ? t.matrix_inv_t : t.matrix;
  Eigen::MatrixXd M(D, D);
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) M(i, j) = v[static_cast<size_t>(i) * D + j];
  return M;
}

namespace {
// The fixed maps applied before the position-driven term, as one matrix L (and L^{-T}): the
// relative operator of the whole mechanism is L^{-1} G(d) L (maps after it cancel).
std::pair<Eigen::MatrixXd, Eigen::MatrixXd> maps_before_position(const Mechanism& m) {
  const int D = m.head_dim;
  Eigen::MatrixXd L = Eigen::MatrixXd::Identity(D, D), Lit;
  for (const auto& t : m.transforms) {
    if (t.position_driven()) break;
    L = fixed_map(t, D, false) * L;
  }
  // by a general inverse, not from the term's stored M^{-T}: the reference checks that data
  Lit = L.inverse().transpose();
  return {L, Lit};
}
}  // namespace

namespace {
int covered_pairs(const Mechanism& m) {
  int n = 0;
  for (const auto& s : m.segments()) n = std::max(n, s.first_pair + s.pairs());
  return n;
}
}  // namespace

int pair_span(const Mechanism& m, Layout layout) {
  return layout == Layout::HalfSplit && !m.segments().empty() ? 2 * covered_pairs(m)
                                                              : m.head_dim;
}

Eigen::MatrixXd key_map(const Mechanism& m, const ParamValues& p, int head, double pos,
                        Layout layout) {
  const int D = m.head_dim;
  Eigen::MatrixXd A = Eigen::MatrixXd::Identity(D, D);
  for (const auto& t : m.transforms)
    A = (t.position_driven() ? jordan_key_map(m, p, head, pos, layout) : fixed_map(t, D, false)) *
        A;
  return A;
}

Eigen::MatrixXd jordan_key_map(const Mechanism& m, const ParamValues& p, int head, double pos,
                               Layout layout) {
  const int D = m.head_dim, span = pair_span(m, layout);
  Eigen::MatrixXd A = Eigen::MatrixXd::Identity(D, D);
  const size_t hb = static_cast<size_t>(p.heads) * p.blocks;
  for_each_block(m, p, head, [&](const JordanSegment& s, int b, size_t i) {
    const int n = 2 * s.order;
    const double t = -pos;
    const double u = s.shear_scale * chart_value(s.chart, t, s.L);
    Eigen::MatrixXd rot = Eigen::MatrixXd::Zero(n, n), nil = Eigen::MatrixXd::Zero(n, n);
    for (int r = 0; r < s.order; ++r) {
      rot(2 * r, 2 * r) = rot(2 * r + 1, 2 * r + 1) = -p.gamma[i] * t;
      rot(2 * r, 2 * r + 1) = -s.omega[b] * t;
      rot(2 * r + 1, 2 * r) = s.omega[b] * t;
      if (r + 1 < s.order) nil(2 * r, 2 * r + 2) = nil(2 * r + 1, 2 * r + 3) = 1.0;
    }
    Eigen::MatrixXd blk;
    if (s.shear == ShearMode::Gates) {
      Eigen::MatrixXd U = p.alpha0[i] * Eigen::MatrixXd::Identity(n, n);
      Eigen::MatrixXd Nk = Eigen::MatrixXd::Identity(n, n);
      double pw = 1.0;
      for (int k = 1; k < s.order; ++k) {
        Nk = Nk * nil;
        pw *= u / k;
        U += p.gates[(k - 1) * hb + i] * pw * Nk;
      }
      blk = rot.exp() * U;
    } else {
      const double eta = s.shear == ShearMode::Exponential ? p.eta[i] : 0.0;
      Eigen::MatrixXd gen = rot + eta * u * nil;
      blk = gen.exp();
    }
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < n; ++c) {
        const int jr = s.first_pair + b * s.order + r / 2, jc = s.first_pair + b * s.order + c / 2;
        A(real_index(layout, span, jr, r % 2), real_index(layout, span, jc, c % 2)) = blk(r, c);
      }
  });
  return A;
}

Eigen::MatrixXd query_map(const Mechanism& m, const ParamValues& p, int head, double pos,
                          Layout layout) {
  return key_map(m, p, head, pos, layout).inverse().transpose();
}

namespace {
// Entries of the closed-form G(d): for each block, slot pair (r, col) with col >= r carries
// e^{-gamma d} (c_{col-r}/c_0) R(omega d). Calls f(row_pair, col_pair, a, cos, sin).
template <class F>
void for_each_relative_entry(const Mechanism& m, const ParamValues& p, int head, double d, F&& f) {
  const size_t hb = static_cast<size_t>(p.heads) * p.blocks;
  for_each_block(m, p, head, [&](const JordanSegment& s, int b, size_t i) {
    double c[16];
    const double u = s.shear_scale * chart_value(s.chart, d, s.L);
    shear_coefficients(s.shear, s.order, p.eta[i], p.gates.data() + i, hb, p.alpha0[i], u, c);
    const double damp = std::exp(-p.gamma[i] * d);
    double sn, cs;
    accurate_sincos(s.omega[b], d, &sn, &cs);
    for (int r = 0; r < s.order; ++r)
      for (int col = r; col < s.order; ++col)
        f(s.first_pair + b * s.order + r, s.first_pair + b * s.order + col,
          damp * c[col - r] / c[0], cs, sn);
  });
}

}  // namespace

Eigen::MatrixXd relative_operator(const Mechanism& m, const ParamValues& p, int head, double d,
                                  Layout layout) {
  const auto [L, Lit] = maps_before_position(m);
  return Lit.transpose() * jordan_relative_operator(m, p, head, d, layout) * L;
}

Eigen::MatrixXd jordan_relative_operator(const Mechanism& m, const ParamValues& p, int head,
                                         double d, Layout layout) {
  const int D = m.head_dim, span = pair_span(m, layout);
  Eigen::MatrixXd G = Eigen::MatrixXd::Identity(D, D);
  for_each_relative_entry(m, p, head, d, [&](int jr, int jc, double a, double cs, double sn) {
    const int r0 = real_index(layout, span, jr, 0), r1 = real_index(layout, span, jr, 1);
    const int c0 = real_index(layout, span, jc, 0), c1 = real_index(layout, span, jc, 1);
    G(r0, c0) = a * cs;
    G(r0, c1) = -a * sn;
    G(r1, c0) = a * sn;
    G(r1, c1) = a * cs;
  });
  return G;
}

double relative_score(const Mechanism& m, const ParamValues& p, int head, double d,
                      const double* q_in, const double* k_in, Layout layout) {
  const int D = m.head_dim, span = pair_span(m, layout);
  // q^T L^{-1} G(d) L k = (L^{-T} q)^T G(d) (L k), L the fixed maps before the position term
  Eigen::VectorXd qv = Eigen::Map<const Eigen::VectorXd>(q_in, D),
                  kv = Eigen::Map<const Eigen::VectorXd>(k_in, D);
  for (const auto& t : m.transforms) {
    if (t.position_driven()) break;
    const Eigen::MatrixXd M = fixed_map(t, D, false);
    qv = M.inverse().transpose() * qv;  // the stored M^{-T} is what the reference checks
    kv = M * kv;
  }
  const double *q = qv.data(), *k = kv.data();
  double s = 0;
  for_each_relative_entry(m, p, head, d, [&](int jr, int jc, double a, double cs, double sn) {
    const double qr = q[real_index(layout, span, jr, 0)], qi = q[real_index(layout, span, jr, 1)];
    const double kr = k[real_index(layout, span, jc, 0)], ki = k[real_index(layout, span, jc, 1)];
    s += a * (qr * (cs * kr - sn * ki) + qi * (sn * kr + cs * ki));
  });
  for (int j = covered_pairs(m); j < span / 2; ++j)
    for (int c = 0; c < 2; ++c)
      s += q[real_index(layout, span, j, c)] * k[real_index(layout, span, j, c)];
  for (int e = span; e < D; ++e) s += q[e] * k[e];
  return s;
}

LiftedPair alibi_lift(double slope, double i, double j) {
  const auto U = [](double t) {
    Eigen::Matrix2d u;
    u << 1.0, t, 0.0, 1.0;
    return u;
  };
  const Eigen::Matrix2d Ai = U(-i), Aj = U(-j);
  return {Ai.inverse().transpose() * Eigen::Vector2d(-slope, 0.0), Aj * Eigen::Vector2d(0.0, 1.0)};
}

}  // namespace relpos::reference
