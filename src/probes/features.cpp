#include "probes/features.hpp"

#include <fmt/format.h>

#include <cctype>

#include "core/charts.hpp"
#include "core/parse.hpp"
#include "core/spec.hpp"
#include "core/types.hpp"

namespace relpos::probes {

double Column::value(double d) const {
  if (kind == Kind::Ones) return 1.0;
  const JetValue v = jet_feature(chart, omega, r, d);
  return scale * (kind == Kind::Re ? v.re : v.im);
}

namespace {

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

Column ones() {
  return {Column::Kind::Ones, {}, 0.0, 0, 1.0, "one"};
}

// cos then sin of order r for every frequency (the reference's interleaving).
void add_jets(std::vector<Column>& cols, const JetChart& c, const std::vector<double>& omega, int r,
              double scale, const std::string& tag) {
  for (size_t k = 0; k < omega.size(); ++k)
    cols.push_back(
        {Column::Kind::Re, c, omega[k], r, scale, fmt::format("{}_r{}_cos{}", tag, r, k)});
  for (size_t k = 0; k < omega.size(); ++k)
    cols.push_back(
        {Column::Kind::Im, c, omega[k], r, scale, fmt::format("{}_r{}_sin{}", tag, r, k)});
}

// A non-oscillating column: the amplitude of J_r (omega = 0) times scale.
Column real_col(const JetChart& c, int r, double scale, const std::string& name) {
  return {Column::Kind::Re, c, 0.0, r, scale, name};
}

const char* kJordanMethods =
    "nope, rope, rope_matched_mM, alibi, rope_alibi, damped_rope, real_jordan, direct_sum, "
    "direct_sum_poly[_mM], jordan_rope, jordan_no_gamma, jordan_raw_tau, jordan_exact[_cCCC], "
    "jordan_mM, jordan_scaled_mM_cCCC";

}  // namespace

Dictionary jordan_dictionary(const std::string& method_in, const JordanGrid& g_in) {
  JordanGrid g = g_in;
  std::string method = method_in;
  // Pre-aliases of causal_delta_features.
  if (method == "jordan_no_gamma") {
    method = "jordan_rope";
    g.gamma = 0.0;
  } else if (method == "jordan_raw_tau") {
    method = "jordan_rope";
    g.bounded_tau = false;
  } else if (method == "jordan_exact" || method.rfind("jordan_exact_", 0) == 0) {
    const auto t = parse_name_tokens(method_in, 2, kTokM | kTokC | kTokEta | kTokEta1 | kTokScaled);
    method = "jordan_rope";
    g.bounded_tau = false;
    g.gamma = t.c.value_or(1.0) / g.L;
  }
  const auto omega_all = rope_frequencies(g.theta, g.head_dim, g.num_freqs);
  // Charts: plain (no damping, raw lag), normalised coordinates x = d/L and tau_n = tau(d)/L.
  JetChart plain;
  plain.L = g.L;
  JetChart x_chart = plain;
  x_chart.shear_scale = 1.0 / g.L;
  JetChart tau_chart = x_chart;
  tau_chart.chart = g.bounded_tau ? Chart::Bounded : Chart::Raw;
  JetChart decayed = plain;
  decayed.gamma = g.gamma;
  JetChart decayed_tau = tau_chart;
  decayed_tau.gamma = g.gamma;

  Dictionary dict{method_in, {ones()}};
  auto& cols = dict.columns;
  // the order token mM of a parametrised name with `words` family words
  const auto m_token = [&](size_t words, long dflt) {
    return static_cast<long>(parse_name_tokens(method, words, kTokM | kTokC).m.value_or(dflt));
  };
  if (method == "nope") return dict;
  if (method == "rope") {
    add_jets(cols, plain, omega_all, 0, 1.0, "rope");
  } else if (method.rfind("rope_matched_m", 0) == 0 && all_digits(method.substr(14))) {
    const long m = m_token(2, 1);
    if (m < 1) throw InputError(fmt::format("probe method '{}': m must be >= 1", method_in));
    const auto nf = std::max<size_t>(1, omega_all.size() / static_cast<size_t>(m));
    add_jets(cols, plain, std::vector<double>(omega_all.begin(), omega_all.begin() + nf), 0, 1.0,
             "rope");
  } else if (method == "alibi") {
    cols.push_back(real_col(x_chart, 1, 1.0, "x"));
  } else if (method == "rope_alibi") {
    add_jets(cols, plain, omega_all, 0, 1.0, "rope");
    cols.push_back(real_col(x_chart, 1, 1.0, "x"));
  } else if (method == "damped_rope") {
    add_jets(cols, decayed, omega_all, 0, 1.0, "damped");
  } else if (method == "real_jordan") {
    cols.push_back(real_col(decayed_tau, 0, 1.0, "decay"));
    cols.push_back(real_col(decayed_tau, 1, 1.0, "tau_decay"));
  } else if (method == "direct_sum") {
    add_jets(cols, plain, omega_all, 0, 1.0, "rope");
    cols.push_back(real_col(x_chart, 1, 1.0, "x"));
    cols.push_back(real_col(decayed_tau, 0, 1.0, "decay"));
    cols.push_back(real_col(decayed_tau, 1, 1.0, "tau_decay"));
  } else if (method == "direct_sum_poly" ||
             (method.rfind("direct_sum_poly_m", 0) == 0 && all_digits(method.substr(17)))) {
    // tau_n^r without factorial and without damping (bounded tau_n).
    const long m = m_token(3, 4);
    add_jets(cols, plain, omega_all, 0, 1.0, "rope");
    JetChart t = tau_chart;
    t.factorial = false;
    for (int r = 1; r < m; ++r) cols.push_back(real_col(t, r, 1.0, fmt::format("tau^{}", r)));
  } else if (method == "jordan_rope" ||
             (method.rfind("jordan_m", 0) == 0 && all_digits(method.substr(8)))) {
    const long m = method == "jordan_rope" ? 2 : m_token(1, 2);
    if (m < 1 || m > 12)
      throw InputError(fmt::format("probe method '{}': order must be 1..12", method_in));
    for (int r = 0; r < m; ++r) add_jets(cols, decayed_tau, omega_all, r, 1.0, "jet");
  } else if (method.rfind("jordan_scaled", 0) == 0) {
    const auto t = parse_name_tokens(method, 2, kTokM | kTokC);
    const long m = static_cast<long>(t.m.value_or(2));
    if (m < 1 || m > 12)
      throw InputError(fmt::format("probe method '{}': order must be 1..12", method_in));
    JetChart s = x_chart;
    s.gamma = t.c.value_or(1.0) / g.L;  // e^{-c x} = e^{-(c/L) d}
    for (int r = 0; r < m; ++r) add_jets(cols, s, omega_all, r, 1.0, "jet");
  } else {
    throw InputError(
        fmt::format("unknown probe method '{}' (valid: {})", method_in, kJordanMethods));
  }
  return dict;
}

std::vector<std::string> pj_fixed_bases(int max_order) {
  std::vector<std::string> b{"rope", "alibi", "alibi_lc", "rope_alibi"};
  for (int k = 1; k <= max_order; ++k) b.push_back(fmt::format("jordan_R{}", k));
  for (int k = 1; k <= max_order; ++k) b.push_back(fmt::format("scaled_R{}", k));
  for (int k = 1; k <= max_order; ++k) b.push_back(fmt::format("scaled_R{}_affine", k));
  b.push_back(fmt::format("lc_R{}", max_order));
  b.push_back(fmt::format("lc_R{}_affine", max_order));
  return b;
}

namespace {
// Monomial Fourier jets (d/L)^r (cos, sin)(omega d), r = 0..R, optionally damped e^{-c x}.
void add_monomial_jets(std::vector<Column>& cols, double omega, double L, int R, double c) {
  JetChart ch;
  ch.L = L;
  ch.shear_scale = 1.0 / L;
  ch.gamma = c / L;
  ch.factorial = false;
  for (int r = 0; r <= R; ++r) {
    cols.push_back({Column::Kind::Re, ch, omega, r, 1.0, fmt::format("x^{}cos", r)});
    cols.push_back({Column::Kind::Im, ch, omega, r, 1.0, fmt::format("x^{}sin", r)});
  }
}
// Light-cone jets beta^r (cos, sin)(omega phi_L(d)), r = 0..R.
void add_lc_jets(std::vector<Column>& cols, double omega, double L, int R) {
  JetChart ch;
  ch.chart = Chart::LightconeBeta;
  ch.phase_chart = Chart::LightconePhi;
  ch.L = L;
  ch.factorial = false;
  for (int r = 0; r <= R; ++r) {
    cols.push_back({Column::Kind::Re, ch, omega, r, 1.0, fmt::format("beta^{}cos", r)});
    cols.push_back({Column::Kind::Im, ch, omega, r, 1.0, fmt::format("beta^{}sin", r)});
  }
}
Column x_col(double L) {
  JetChart ch;
  ch.L = L;
  ch.shear_scale = 1.0 / L;
  return {Column::Kind::Re, ch, 0.0, 1, 1.0, "x"};
}
Column eta_col(double L) {  // eta_L(d) = asinh(d/L) = phi_L(d) / L
  JetChart ch;
  ch.chart = Chart::LightconePhi;
  ch.L = L;
  ch.shear_scale = 1.0 / L;
  return {Column::Kind::Re, ch, 0.0, 1, 1.0, "eta"};
}
void add_rope(std::vector<Column>& cols, double omega, double L) {
  add_monomial_jets(cols, omega, L, 0, 0.0);
}

// "<prefix><digits>[<suffix>]" -> digits, or -1.
long suffix_order(const std::string& s, const std::string& prefix, const std::string& suffix) {
  if (s.rfind(prefix, 0) != 0 || s.size() <= prefix.size() + suffix.size()) return -1;
  if (s.compare(s.size() - suffix.size(), suffix.size(), suffix) != 0) return -1;
  const std::string mid = s.substr(prefix.size(), s.size() - prefix.size() - suffix.size());
  const auto v = parse_int64(mid, 0, 999999999);
  return all_digits(mid) && v ? static_cast<long>(*v) : -1;
}
}  // namespace

Dictionary pj_dictionary(const std::string& basis, double omega, double L) {
  Dictionary dict{basis, {}};
  auto& cols = dict.columns;
  long k = -1;
  if (basis == "rope") {
    add_rope(cols, omega, L);
  } else if (basis == "alibi") {
    cols.push_back(x_col(L));
  } else if (basis == "alibi_lc") {
    cols.push_back(eta_col(L));
  } else if (basis == "rope_alibi") {
    add_rope(cols, omega, L);
    cols.push_back(x_col(L));
  } else if ((k = suffix_order(basis, "jordan_R", "")) >= 1) {
    add_monomial_jets(cols, omega, L, static_cast<int>(k), 0.0);
  } else if ((k = suffix_order(basis, "scaled_R", "_affine")) >= 1) {
    add_monomial_jets(cols, omega, L, static_cast<int>(k), 0.1);
    cols.push_back(x_col(L));
  } else if ((k = suffix_order(basis, "scaled_R", "")) >= 1) {
    add_monomial_jets(cols, omega, L, static_cast<int>(k), 0.1);
  } else if ((k = suffix_order(basis, "lc_R", "_affine")) >= 1) {
    add_lc_jets(cols, omega, L, static_cast<int>(k));
    cols.push_back(eta_col(L));
  } else if ((k = suffix_order(basis, "lc_R", "")) >= 1) {
    add_lc_jets(cols, omega, L, static_cast<int>(k));
  } else {
    throw InputError(
        fmt::format("unknown PJ basis '{}' (valid: rope, alibi, alibi_lc, rope_alibi, jordan_R<k>, "
                    "scaled_R<k>, "
                    "scaled_R<k>_affine, lc_R<k>, lc_R<k>_affine)",
                    basis));
  }
  if (k > 12) throw InputError(fmt::format("PJ basis '{}': order must be 1..12", basis));
  return dict;
}

Dictionary grape_dictionary(const std::string& basis, double omega, double L) {
  Dictionary dict{basis, {}};
  auto& cols = dict.columns;
  long k = -1;
  if (basis == "grape_m_rope") {
    add_rope(cols, omega, L);
  } else if (basis == "grape_a_alibi") {
    cols.push_back(x_col(L));
  } else if (basis == "grape_ma_rope_alibi") {
    add_rope(cols, omega, L);
    cols.push_back(x_col(L));
  } else if ((k = suffix_order(basis, "pj_fj_r", "")) >= 0) {
    add_monomial_jets(cols, omega, L, static_cast<int>(k), 0.0);
  } else if ((k = suffix_order(basis, "pj_lc_r", "_affine")) >= 0) {
    add_lc_jets(cols, omega, L, static_cast<int>(k));
    cols.push_back(eta_col(L));
  } else if ((k = suffix_order(basis, "pj_lc_r", "")) >= 0) {
    add_lc_jets(cols, omega, L, static_cast<int>(k));
  } else {
    throw InputError(
        fmt::format("unknown GRAPE basis '{}' (valid: grape_m_rope, grape_a_alibi, "
                    "grape_ma_rope_alibi, pj_fj_r<R>, "
                    "pj_lc_r<R>, pj_lc_r<R>_affine)",
                    basis));
  }
  if (k > 12) throw InputError(fmt::format("GRAPE basis '{}': order must be 0..12", basis));
  return dict;
}

Eigen::MatrixXd build_matrix(const Dictionary& dict, const std::vector<double>& lags) {
  Eigen::MatrixXd X(static_cast<Eigen::Index>(lags.size()),
                    static_cast<Eigen::Index>(dict.columns.size()));
  for (Eigen::Index j = 0; j < X.cols(); ++j) {
    const Column& c = dict.columns[static_cast<size_t>(j)];
    for (Eigen::Index i = 0; i < X.rows(); ++i) X(i, j) = c.value(lags[static_cast<size_t>(i)]);
  }
  return X;
}

std::vector<double> lag_range(int count) {
  std::vector<double> d(static_cast<size_t>(std::max(count, 0)));
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<double>(i);
  return d;
}

}  // namespace relpos::probes
