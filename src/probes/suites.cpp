#include "probes/suites.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numbers>
#include <set>

#include "core/charts.hpp"
#include "core/types.hpp"
#include "probes/features.hpp"
#include "probes/pj_adaptive.hpp"
#include "probes/lightcone.hpp"
#include "probes/solvers.hpp"
#include "probes/targets.hpp"

namespace relpos::probes {

std::string to_string(Precision p) { return p == Precision::F64 ? "f64" : "f32"; }

std::vector<std::string> probe_suite_names() {
  return {"jordan-t3", "jordan-t11", "jordan-t6", "jordan-t16", "pj-fixed", "pj-grape-t9"};
}
std::vector<std::string> extra_probe_suite_names() {
  return {"pj-t3-adaptive", "pj-t5"};
}
Precision default_precision(const std::string& suite) {
  return suite == "pj-t5" ? Precision::F32 : Precision::F64;
}

// ---------------------------------------------------------------------------------------------
// Printed numbers

namespace {
struct Printed {
  double value = 0.0;
  bool sci = false;
  int digits = 0;  // decimals (fixed) or mantissa decimals (scientific)
  int exponent = 0;
};
bool parse_printed(const std::string& s, Printed* p) {
  if (s.empty()) return false;
  try {
    p->value = std::stod(s);
  } catch (const std::exception&) {
    return false;
  }
  const auto e = s.find_first_of("eE");
  const std::string mant = s.substr(0, e);
  const auto dot = mant.find('.');
  p->digits = dot == std::string::npos ? 0 : static_cast<int>(mant.size() - dot - 1);
  p->sci = e != std::string::npos;
  p->exponent = p->sci ? std::stoi(s.substr(e + 1)) : 0;
  return true;
}
}  // namespace

std::string format_like(double x, const std::string& like) {
  Printed p;
  if (!std::isfinite(x)) return fmt::format("{}", x);
  if (!parse_printed(like, &p)) {
    const double a = std::abs(x);
    if (a != 0.0 && (a < 1e-3 || a >= 1e5)) return fmt::format("{:.3e}", x);
    return fmt::format("{:.4f}", x);
  }
  if (p.sci) {
    // same exponent as printed when sensible, e.g. 6.40e-3 next to 8.14e-3
    const double m = x / std::pow(10.0, p.exponent);
    if (std::abs(m) >= 0.1 && std::abs(m) < 100.0) return fmt::format("{:.{}f}e{}", m, p.digits, p.exponent);
    return fmt::format("{:.{}e}", x, p.digits);
  }
  return fmt::format("{:.{}f}", x, p.digits);
}

bool matches_printed(double x, const std::string& printed) {
  Printed p;
  if (!parse_printed(printed, &p)) return false;
  const double unit = std::pow(10.0, (p.sci ? p.exponent : 0) - p.digits);
  return std::abs(x - p.value) <= 0.5 * unit * (1.0 + 1e-9);
}

bool within_paper_tolerance(double x, const std::string& printed) {
  Printed p;
  if (!parse_printed(printed, &p)) return false;
  const double e = std::abs(x - p.value);
  return e <= 0.002 || e <= 0.01 * std::abs(p.value);
}

namespace {

// ---------------------------------------------------------------------------------------------
// Paper values (jordan-rope.md 6.1) and the float64 re-derivation (6.2), as printed.

struct RefRow {
  const char* table;
  const char* target;
  const char* method;  // "*" for winner cells
  const char* metric;
  const char* paper;
  const char* reference;
  const char* paper_method;
};

constexpr RefRow kRefs[] = {
    // Table 3: MSE at 8192.
    {"3", "phase", "rope", "mse", "0.000", "0.000", ""},
    {"3", "linear", "rope", "mse", "17.618", "17.618", ""},
    {"3", "mixed", "rope", "mse", "8.791", "8.791", ""},
    {"3", "phase", "damped_rope", "mse", "0.054", "0.054", ""},
    {"3", "linear", "damped_rope", "mse", "17.583", "17.583", ""},
    {"3", "mixed", "damped_rope", "mse", "9.510", "9.510", ""},
    {"3", "phase", "rope_alibi", "mse", "0.000", "0.000", ""},
    {"3", "linear", "rope_alibi", "mse", "0.000", "0.000", ""},
    {"3", "mixed", "rope_alibi", "mse", "8.791", "8.791", ""},
    {"3", "phase", "alibi", "mse", "0.505", "0.505", ""},
    {"3", "linear", "alibi", "mse", "0.000", "0.000", ""},
    {"3", "mixed", "alibi", "mse", "10.666", "10.666", ""},
    {"3", "phase", "direct_sum", "mse", "0.000", "0.000", ""},
    {"3", "linear", "direct_sum", "mse", "0.000", "0.000", ""},
    {"3", "mixed", "direct_sum", "mse", "8.819", "8.834", ""},
    {"3", "phase", "jordan_rope", "mse", "0.039", "0.039", ""},
    {"3", "linear", "jordan_rope", "mse", "50.463", "51.74", ""},
    {"3", "mixed", "jordan_rope", "mse", "7.414", "7.419", ""},
    {"3", "phase", "jordan_raw_tau", "mse", "0.004", "0.004", ""},
    {"3", "linear", "jordan_raw_tau", "mse", "462.392", "484.9", ""},
    {"3", "mixed", "jordan_raw_tau", "mse", "1.975", "2.037", ""},
    {"3", "phase", "jordan_exact_c010", "mse", "0.011", "0.004", ""},
    {"3", "linear", "jordan_exact_c010", "mse", "541.274", "496.4", ""},
    {"3", "mixed", "jordan_exact_c010", "mse", "2.011", "1.970", ""},
    {"3", "phase", "jordan_exact_scaled", "mse", "0.309", "0.308", ""},
    {"3", "linear", "jordan_exact_scaled", "mse", "20.485", "20.55", ""},
    {"3", "mixed", "jordan_exact_scaled", "mse", "10.254", "10.247", ""},
    // Table 11: MSE at 8192 (phase drift / seasonal / damped wave / rhythm / motif).
    {"11", "phase_drift", "rope", "mse", "0.004", "0.004", ""},
    {"11", "seasonal_trend", "rope", "mse", "7.120", "7.120", ""},
    {"11", "damped_wave", "rope", "mse", "1.345", "1.345", ""},
    {"11", "rhythm_envelope", "rope", "mse", "3.449", "3.449", ""},
    {"11", "motif_spacing", "rope", "mse", "0.693", "0.693", ""},
    {"11", "phase_drift", "alibi", "mse", "0.505", "0.505", ""},
    {"11", "seasonal_trend", "alibi", "mse", "9.996", "9.996", ""},
    {"11", "damped_wave", "alibi", "mse", "2.103", "2.103", ""},
    {"11", "rhythm_envelope", "alibi", "mse", "4.671", "4.671", ""},
    {"11", "motif_spacing", "alibi", "mse", "1.093", "1.093", ""},
    {"11", "phase_drift", "rope_alibi", "mse", "0.004", "0.004", ""},
    {"11", "seasonal_trend", "rope_alibi", "mse", "7.121", "7.121", ""},
    {"11", "damped_wave", "rope_alibi", "mse", "1.346", "1.346", ""},
    {"11", "rhythm_envelope", "rope_alibi", "mse", "3.450", "3.450", ""},
    {"11", "motif_spacing", "rope_alibi", "mse", "0.696", "0.696", ""},
    {"11", "phase_drift", "damped_rope", "mse", "0.056", "0.056", ""},
    {"11", "seasonal_trend", "damped_rope", "mse", "8.164", "8.164", ""},
    {"11", "damped_wave", "damped_rope", "mse", "1.493", "1.493", ""},
    {"11", "rhythm_envelope", "damped_rope", "mse", "3.901", "3.901", ""},
    {"11", "motif_spacing", "damped_rope", "mse", "0.829", "0.829", ""},
    {"11", "phase_drift", "direct_sum", "mse", "0.004", "0.004", ""},
    {"11", "seasonal_trend", "direct_sum", "mse", "7.145", "7.156", ""},
    {"11", "damped_wave", "direct_sum", "mse", "1.345", "1.346", ""},
    {"11", "rhythm_envelope", "direct_sum", "mse", "3.457", "3.453", ""},
    {"11", "motif_spacing", "direct_sum", "mse", "0.711", "0.729", ""},
    {"11", "phase_drift", "jordan_rope", "mse", "0.041", "0.040", ""},
    {"11", "seasonal_trend", "jordan_rope", "mse", "6.395", "6.352", ""},
    {"11", "damped_wave", "jordan_rope", "mse", "0.935", "0.937", ""},
    {"11", "rhythm_envelope", "jordan_rope", "mse", "3.034", "3.022", ""},
    {"11", "motif_spacing", "jordan_rope", "mse", "0.511", "0.491", ""},
    {"11", "phase_drift", "jordan_no_gamma", "mse", "0.003", "0.003", ""},
    {"11", "seasonal_trend", "jordan_no_gamma", "mse", "4.632", "4.651", ""},
    {"11", "damped_wave", "jordan_no_gamma", "mse", "0.608", "0.611", ""},
    {"11", "rhythm_envelope", "jordan_no_gamma", "mse", "2.226", "2.242", ""},
    {"11", "motif_spacing", "jordan_no_gamma", "mse", "0.265", "0.274", ""},
    {"11", "phase_drift", "jordan_raw_tau", "mse", "0.005", "0.004", ""},
    {"11", "seasonal_trend", "jordan_raw_tau", "mse", "1.686", "1.711", ""},
    {"11", "damped_wave", "jordan_raw_tau", "mse", "0.000", "0.000", ""},
    {"11", "rhythm_envelope", "jordan_raw_tau", "mse", "0.835", "0.835", ""},
    {"11", "motif_spacing", "jordan_raw_tau", "mse", "0.229", "0.271", ""},
    {"11", "phase_drift", "jordan_m3", "mse", "0.028", "0.028", ""},
    {"11", "seasonal_trend", "jordan_m3", "mse", "4.832", "4.836", ""},
    {"11", "damped_wave", "jordan_m3", "mse", "0.543", "0.543", ""},
    {"11", "rhythm_envelope", "jordan_m3", "mse", "2.302", "2.304", ""},
    {"11", "motif_spacing", "jordan_m3", "mse", "0.259", "0.260", ""},
    // Table 4: best method per benchmark (MSE at 8192).
    {"4", "phase_drift", "*", "best_mse", "0.003", "0.003", "jordan_no_gamma"},
    {"4", "seasonal_trend", "*", "best_mse", "1.686", "1.711", "jordan_raw_tau"},
    {"4", "damped_wave", "*", "best_mse", "0.000", "0.000", "jordan_raw_tau"},
    {"4", "rhythm_envelope", "*", "best_mse", "0.835", "0.835", "jordan_raw_tau"},
    {"4", "motif_spacing", "*", "best_mse", "0.229", "0.260", "jordan_raw_tau"},
    // Table 6 (head_dim 96).
    {"6", "high_jet_r1", "-", "min_order", "2", "", ""},
    {"6", "scaled_high_jet_r2", "-", "min_order", "3", "", ""},
    {"6", "scaled_high_jet_r3", "-", "min_order", "4", "", ""},
    {"6", "high_jet_r1", "jordan_scaled_m2_c010", "r2", "0.8387", "0.8387", ""},
    {"6", "scaled_high_jet_r2", "jordan_scaled_m2_c010", "r2", "0.2908", "0.2908", ""},
    {"6", "scaled_high_jet_r3", "jordan_scaled_m2_c010", "r2", "0.0396", "0.0396", ""},
    {"6", "high_jet_r1", "*", "best_mse", "8.14e-3", "6.4e-3", "jordan_scaled_m4_c010"},
    {"6", "scaled_high_jet_r2", "*", "best_mse", "3.14e-6", "2.2e-6", "jordan_scaled_m3_c010"},
    {"6", "scaled_high_jet_r3", "*", "best_mse", "1.61", "1.58", "jordan_scaled_m4_c010"},
    {"6", "high_jet_r1", "*", "best_r2", "0.9992", "0.9994", "jordan_scaled_m4_c010"},
    {"6", "scaled_high_jet_r2", "*", "best_r2", "1.0000", "1.0000", "jordan_scaled_m3_c010"},
    {"6", "scaled_high_jet_r3", "*", "best_r2", "0.9997", "0.9997", "jordan_scaled_m4_c010"},
    {"6", "high_jet_r1", "*", "best_control_r2", "0.1757", "0.1757", ""},
    {"6", "scaled_high_jet_r2", "*", "best_control_r2", "0.0326", "0.0326", ""},
    {"6", "scaled_high_jet_r3", "*", "best_control_r2", "0.0033", "0.0033", ""},
    // Table 16: R^2 at 8192.
    {"16", "scaled_high_jet_r1", "jordan_scaled_m2_c010", "r2", "1.0000", "1.0000", ""},
    {"16", "scaled_high_jet_r1", "jordan_scaled_m3_c010", "r2", "1.0000", "1.0000", ""},
    {"16", "scaled_high_jet_r1", "jordan_scaled_m4_c010", "r2", "0.9989", "0.9999", ""},
    {"16", "scaled_high_jet_r1", "*", "best_control_r2", "0.2979", "0.2979", ""},
    {"16", "scaled_high_jet_r2", "jordan_scaled_m2_c010", "r2", "0.2908", "0.2908", ""},
    {"16", "scaled_high_jet_r2", "jordan_scaled_m3_c010", "r2", "1.0000", "1.0000", ""},
    {"16", "scaled_high_jet_r2", "jordan_scaled_m4_c010", "r2", "0.9995", "0.9996", ""},
    {"16", "scaled_high_jet_r2", "*", "best_control_r2", "0.0326", "0.0326", ""},
    {"16", "scaled_high_jet_r3", "jordan_scaled_m2_c010", "r2", "0.0396", "0.0396", ""},
    {"16", "scaled_high_jet_r3", "jordan_scaled_m3_c010", "r2", "0.3740", "0.3740", ""},
    {"16", "scaled_high_jet_r3", "jordan_scaled_m4_c010", "r2", "0.9997", "0.9997", ""},
    {"16", "scaled_high_jet_r3", "*", "best_control_r2", "0.0033", "0.0033", ""},
};

const RefRow* find_ref(const std::string& table, const std::string& target, const std::string& method,
                       const std::string& metric) {
  for (const auto& r : kRefs)
    if (table == r.table && target == r.target && metric == r.metric && (method == r.method || std::string(r.method) == "*"))
      return &r;
  return nullptr;
}

// Display names of the paper's rows.
std::string paper_label(const std::string& m) {
  static const std::map<std::string, std::string> names = {
      {"rope", "RoPE"},
      {"damped_rope", "Damped RoPE"},
      {"rope_alibi", "RoPE+ALiBi"},
      {"alibi", "ALiBi"},
      {"direct_sum", "Direct-sum"},
      {"direct_sum_poly_m4", "Direct-sum poly m=4"},
      {"jordan_rope", "Stabilized"},
      {"jordan_no_gamma", "Jordan (gamma=0)"},
      {"jordan_raw_tau", "Exact/raw"},
      {"jordan_exact_c010", "Scaled-exact c=.1"},
      {"jordan_exact_scaled", "Scaled-exact c=1"},
      {"jordan_m3", "Jordan (m=3)"},
      {"jordan_m4", "Jordan (m=4)"},
      {"rope_matched_m2", "RoPE matched m=2"},
      {"rope_matched_m3", "RoPE matched m=3"},
      {"rope_matched_m4", "RoPE matched m=4"},
      {"jordan_scaled_m2_c010", "Scaled m=2 c=.1"},
      {"jordan_scaled_m3_c010", "Scaled m=3 c=.1"},
      {"jordan_scaled_m4_c010", "Scaled m=4 c=.1"},
  };
  const auto it = names.find(m);
  return it == names.end() ? m : it->second;
}

std::string family_of(const std::string& m) {
  if (m.rfind("direct_sum", 0) == 0 || m == "real_jordan") return "direct_sum";
  if (m == "jordan_raw_tau" || m.rfind("jordan_exact", 0) == 0 || m.rfind("jordan_scaled", 0) == 0)
    return "jordan_exact";
  if (m.rfind("jordan", 0) == 0) return "jordan_stabilized";
  return "rope";
}

ProbeCell make_cell(const std::string& suite, const std::string& table, const std::string& target,
                    const std::string& method, const std::string& metric, double ours, Precision p,
                    double cond) {
  ProbeCell c;
  c.suite = suite;
  c.table = table;
  c.target = target;
  c.method = method;
  c.metric = metric;
  c.ours = ours;
  c.dtype = to_string(p);
  c.cond = cond;
  if (const RefRow* r = find_ref(table, target, method, metric)) {
    c.paper = r->paper;
    c.reference = r->reference;
    c.paper_method = r->paper_method;
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Jordan-RoPE fixed-kernel probes

constexpr int kFitLags = 1024;
constexpr int kEvalLags = 8192;
constexpr double kRidge = 1e-4;

struct Outcome {
  Scores s;
  double cond = 0.0;
};

struct JordanRun {
  std::map<std::pair<std::string, std::string>, Outcome> out;  // (target, method)
  std::vector<ProbeCurve> curves;
  const Outcome& at(const std::string& t, const std::string& m) const { return out.at({t, m}); }
};

template <class T>
JordanRun run_jordan_t(const JordanGrid& g, const JordanTargetParams& tp, const std::vector<std::string>& targets,
                       const std::vector<std::string>& methods, bool keep_curves, const std::string& table) {
  JordanRun run;
  const auto lags = lag_range(kEvalLags);
  std::map<std::string, Vec<T>> ys;
  for (const auto& t : targets) {
    Eigen::VectorXd y(kEvalLags);
    for (int i = 0; i < kEvalLags; ++i) y(i) = jordan_target(t, lags[static_cast<size_t>(i)], tp);
    ys[t] = y.cast<T>();
    if (keep_curves)
      run.curves.push_back(
          {table, t, "target", "target", std::vector<double>(y.data(), y.data() + y.size()), {}});
  }
  std::map<std::pair<std::string, std::string>, size_t> best_curve;  // (target, family) -> curve index
  for (const auto& m : methods) {
    const Eigen::MatrixXd X = build_matrix(jordan_dictionary(m, g), lags);
    const Mat<T> Xt = X.cast<T>();
    const Mat<T> Xfit = Xt.topRows(kFitLags);
    const double cond = ridge_condition(X.topRows(kFitLags), kRidge);
    for (const auto& t : targets) {
      const Vec<T>& y = ys[t];
      LinearFit<T> fit = ridge_fit<T>(Xfit, y.head(kFitLags), kRidge);
      const Vec<T> pred = Xt * fit.w;
      const Scores s = jordan_scores<T>(pred, y);
      run.out[{t, m}] = {s, cond};
      if (!keep_curves) continue;
      const auto key = std::make_pair(t, family_of(m));
      const auto it = best_curve.find(key);
      if (it != best_curve.end() && run.out.at({t, run.curves[it->second].method}).s.mse <= s.mse) continue;
      ProbeCurve c{table, t, family_of(m), m, {}, {}};
      c.y.resize(static_cast<size_t>(pred.size()));
      for (Eigen::Index i = 0; i < pred.size(); ++i) c.y[static_cast<size_t>(i)] = static_cast<double>(pred(i));
      if (it == best_curve.end()) {
        best_curve[key] = run.curves.size();
        run.curves.push_back(std::move(c));
      } else {
        run.curves[it->second] = std::move(c);
      }
    }
  }
  return run;
}

JordanRun run_jordan(Precision p, const JordanGrid& g, const JordanTargetParams& tp,
                     const std::vector<std::string>& targets, const std::vector<std::string>& methods,
                     bool keep_curves, const std::string& table) {
  return p == Precision::F64 ? run_jordan_t<double>(g, tp, targets, methods, keep_curves, table)
                             : run_jordan_t<float>(g, tp, targets, methods, keep_curves, table);
}

JordanTargetParams jordan_target_params(const JordanGrid& g) {
  JordanTargetParams tp;
  tp.omega = std::pow(g.theta, -2.0 * 3 / g.head_dim);   // target_freq_index 3
  tp.omega2 = std::pow(g.theta, -2.0 * 5 / g.head_dim);  // second_freq_index 5
  tp.L = g.L;
  tp.gamma = g.gamma;
  return tp;
}

void add_mse_table(SuiteResult& r, const JordanRun& run, const std::string& table,
                   const std::vector<std::string>& targets, const std::vector<std::string>& methods, Precision p,
                   bool with_r2) {
  for (const auto& m : methods)
    for (const auto& t : targets) {
      const Outcome& o = run.at(t, m);
      ProbeCell c = make_cell(r.suite, table, t, m, "mse", o.s.mse, p, o.cond);
      c.row = paper_label(m);
      c.col = t;
      r.cells.push_back(c);
    }
  if (!with_r2) return;
  for (const auto& m : methods)
    for (const auto& t : targets) {
      const Outcome& o = run.at(t, m);
      ProbeCell c = make_cell(r.suite, table + "-r2", t, m, "r2", o.s.r2, p, o.cond);
      c.row = paper_label(m);
      c.col = t;
      r.cells.push_back(c);
    }
}

// Best (minimum MSE) method over a list.
std::string best_of(const JordanRun& run, const std::string& t, const std::vector<std::string>& methods) {
  std::string best;
  for (const auto& m : methods)
    if (best.empty() || run.at(t, m).s.mse < run.at(t, best).s.mse) best = m;
  return best;
}

SuiteResult suite_t3(Precision p, bool curves) {
  SuiteResult r{"jordan-t3", {}, {}};
  const JordanGrid g;
  const std::vector<std::string> targets{"phase", "linear", "mixed"};
  const std::vector<std::string> methods{"rope",        "damped_rope",    "rope_alibi",        "alibi",
                                         "direct_sum",  "jordan_rope",    "jordan_raw_tau",    "jordan_exact_c010",
                                         "jordan_exact_scaled"};
  JordanRun run = run_jordan(p, g, jordan_target_params(g), targets, methods, curves, "3");
  add_mse_table(r, run, "3", targets, methods, p, false);
  r.curves = std::move(run.curves);
  return r;
}

SuiteResult suite_t11(Precision p, bool curves) {
  SuiteResult r{"jordan-t11", {}, {}};
  const JordanGrid g;
  const std::vector<std::string> targets{"phase_drift", "seasonal_trend", "damped_wave", "rhythm_envelope",
                                         "motif_spacing"};
  const std::vector<std::string> methods{"rope",       "alibi",       "rope_alibi",      "damped_rope",    "direct_sum",
                                         "jordan_rope", "jordan_no_gamma", "jordan_raw_tau", "jordan_m3"};
  JordanRun run = run_jordan(p, g, jordan_target_params(g), targets, methods, curves, "11");
  add_mse_table(r, run, "11", targets, methods, p, true);
  for (const auto& t : targets) {
    const std::string w = best_of(run, t, methods);
    ProbeCell c = make_cell(r.suite, "4", t, w, "best_mse", run.at(t, w).s.mse, p, run.at(t, w).cond);
    c.row = t;
    c.col = "best";
    r.cells.push_back(c);
    // the paper's winner's value beside it
    if (!c.paper_method.empty() && c.paper_method != w) {
      ProbeCell q = make_cell(r.suite, "4", t, c.paper_method, "paper_winner_mse", run.at(t, c.paper_method).s.mse, p,
                              run.at(t, c.paper_method).cond);
      q.row = t;
      q.col = "paper's winner";
      r.cells.push_back(q);
    }
  }
  r.curves = std::move(run.curves);
  return r;
}

const std::vector<std::string>& highjet_methods() {
  static const std::vector<std::string> m{
      "rope",      "rope_matched_m2", "rope_matched_m3",       "rope_matched_m4",       "rope_alibi",
      "direct_sum", "direct_sum_poly_m4", "jordan_rope",       "jordan_m3",             "jordan_m4",
      "jordan_scaled_m2_c010", "jordan_scaled_m3_c010", "jordan_scaled_m4_c010"};
  return m;
}
const std::vector<std::string> kControls{"rope", "rope_matched_m2", "rope_matched_m3", "rope_matched_m4", "rope_alibi",
                                         "direct_sum", "direct_sum_poly_m4"};
const std::vector<std::string> kHighJetBases{"jordan_rope", "jordan_m3", "jordan_m4", "jordan_scaled_m2_c010",
                                             "jordan_scaled_m3_c010", "jordan_scaled_m4_c010"};

JordanGrid grid96() {
  JordanGrid g;
  g.head_dim = 96;
  return g;
}

std::string best_r2_of(const JordanRun& run, const std::string& t, const std::vector<std::string>& methods) {
  std::string best;
  for (const auto& m : methods)
    if (best.empty() || run.at(t, m).s.r2 > run.at(t, best).s.r2) best = m;
  return best;
}

SuiteResult suite_t6(Precision p, bool curves) {
  SuiteResult r{"jordan-t6", {}, {}};
  const JordanGrid g = grid96();
  const std::vector<std::string> targets{"high_jet_r1", "scaled_high_jet_r2", "scaled_high_jet_r3"};
  JordanRun run = run_jordan(p, g, jordan_target_params(g), targets, highjet_methods(), curves, "6");
  const int min_order[] = {2, 3, 4};
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    const auto add = [&](const std::string& m, const std::string& metric, double v, double cond, const std::string& col) {
      ProbeCell c = make_cell(r.suite, "6", t, m, metric, v, p, cond);
      c.row = t;
      c.col = col;
      r.cells.push_back(c);
    };
    add("-", "min_order", min_order[i], -1.0, "min order");
    const auto& s2 = run.at(t, "jordan_scaled_m2_c010");
    add("jordan_scaled_m2_c010", "r2", s2.s.r2, s2.cond, "scaled m=2 R^2");
    const std::string b = best_of(run, t, kHighJetBases);
    add(b, "best_mse", run.at(t, b).s.mse, run.at(t, b).cond, "best high-jet MSE");
    add(b, "best_r2", run.at(t, b).s.r2, run.at(t, b).cond, "best high-jet R^2");
    const std::string c = best_r2_of(run, t, kControls);
    add(c, "best_control_r2", run.at(t, c).s.r2, run.at(t, c).cond, "best control R^2");
  }
  add_mse_table(r, run, "6-detail", targets, highjet_methods(), p, true);
  r.curves = std::move(run.curves);
  return r;
}

SuiteResult suite_t16(Precision p, bool curves) {
  SuiteResult r{"jordan-t16", {}, {}};
  const JordanGrid g = grid96();
  const std::vector<std::string> targets{"scaled_high_jet_r1", "scaled_high_jet_r2", "scaled_high_jet_r3"};
  JordanRun run = run_jordan(p, g, jordan_target_params(g), targets, highjet_methods(), curves, "16");
  for (const auto& t : targets) {
    for (const std::string m : {"jordan_scaled_m2_c010", "jordan_scaled_m3_c010", "jordan_scaled_m4_c010"}) {
      ProbeCell c = make_cell(r.suite, "16", t, m, "r2", run.at(t, m).s.r2, p, run.at(t, m).cond);
      c.row = t;
      c.col = paper_label(m) + " R^2";
      r.cells.push_back(c);
    }
    const std::string b = best_r2_of(run, t, kControls);
    ProbeCell c = make_cell(r.suite, "16", t, b, "best_control_r2", run.at(t, b).s.r2, p, run.at(t, b).cond);
    c.row = t;
    c.col = "best control R^2";
    r.cells.push_back(c);
  }
  add_mse_table(r, run, "16-detail", targets, highjet_methods(), p, true);
  r.curves = std::move(run.curves);
  return r;
}

// ---------------------------------------------------------------------------------------------
// PJ-RoPE fixed-kernel recovery and GRAPE projection (lstsq protocol)

struct PjOutcome {
  Scores s;
  double cond = 0.0;
};

template <class T>
PjOutcome pj_fit_t(const Eigen::MatrixXd& X, const Eigen::VectorXd& y, int fit_rows) {
  const Mat<T> Xt = X.cast<T>();
  const Vec<T> yt = y.cast<T>();
  const LinearFit<T> f = lstsq_fit<T>(Xt.topRows(fit_rows), yt.head(fit_rows), true);
  return {pj_scores<T>(f.predict(Xt), yt), f.cond};
}
PjOutcome pj_fit(Precision p, const Eigen::MatrixXd& X, const Eigen::VectorXd& y, int fit_rows) {
  return p == Precision::F64 ? pj_fit_t<double>(X, y, fit_rows) : pj_fit_t<float>(X, y, fit_rows);
}

// Bases that contain a target exactly, and the target's designed sector (exact bases plus the
// sector family it is designed for). recency_weak_jet (-0.4x + 0.15 x^2 cos) is contained by no
// fixed basis: its designed sector is Fourier-jet + affine.
struct Sector {
  std::set<std::string> exact, designed;
};
Sector pj_sector(const std::string& t) {
  if (t == "phase") return {{"rope", "rope_alibi", "jordan_R1", "jordan_R2", "jordan_R3"}, {}};
  if (t == "linear")
    return {{"alibi", "rope_alibi", "scaled_R1_affine", "scaled_R2_affine", "scaled_R3_affine"}, {}};
  if (t == "first_jet") return {{"jordan_R1", "jordan_R2", "jordan_R3"}, {}};
  if (t == "second_jet") return {{"scaled_R2", "scaled_R3", "scaled_R2_affine", "scaled_R3_affine"}, {}};
  if (t == "third_jet") return {{"scaled_R3", "scaled_R3_affine"}, {}};
  if (t == "lc_core") return {{"lc_R3", "lc_R3_affine"}, {}};
  if (t == "lc_affine") return {{"lc_R3_affine"}, {}};
  return {{},
          {"jordan_R1", "jordan_R2", "jordan_R3", "scaled_R1", "scaled_R2", "scaled_R3", "scaled_R1_affine",
           "scaled_R2_affine", "scaled_R3_affine", "alibi", "rope_alibi"}};
}
Sector grape_sector(const std::string& t) {
  if (t == "phase") return {{"grape_m_rope", "grape_ma_rope_alibi", "pj_fj_r1", "pj_fj_r2"}, {}};
  if (t == "affine") return {{"grape_a_alibi", "grape_ma_rope_alibi"}, {}};
  if (t == "first_jet") return {{"pj_fj_r1", "pj_fj_r2"}, {}};
  if (t == "second_jet") return {{"pj_fj_r2"}, {}};
  return {{"pj_lc_r3"}, {}};  // lc_core
}

constexpr double kExactR2 = 0.999999;

SuiteResult suite_pj_fixed(Precision p) {
  SuiteResult r{"pj-fixed", {}, {}};
  const double L = 1024.0;
  const int T = 8192;
  const auto lags = lag_range(T);
  const auto bases = pj_fixed_bases(3);
  const auto targets = pj_target_names();
  for (const int cycles : {5, 17, 61}) {
    const double omega = 2.0 * std::numbers::pi * cycles / L;
    const std::string table = fmt::format("fixed w={}c", cycles);
    std::map<std::pair<std::string, std::string>, PjOutcome> out;
    std::map<std::string, Eigen::VectorXd> ys;
    for (const auto& t : targets) {
      Eigen::VectorXd y(T);
      for (int i = 0; i < T; ++i) y(i) = pj_target(t, lags[static_cast<size_t>(i)], omega, L);
      ys[t] = y;
    }
    for (const auto& b : bases) {
      const Eigen::MatrixXd X = build_matrix(pj_dictionary(b, omega, L), lags);
      for (const auto& t : targets) out[{t, b}] = pj_fit(p, X, ys[t], static_cast<int>(L));
    }
    for (const auto& b : bases)
      for (const auto& t : targets) {
        const auto& o = out.at({t, b});
        ProbeCell c = make_cell(r.suite, table, t, b, "r2", o.s.r2, p, o.cond);
        c.row = b;
        c.col = t;
        r.cells.push_back(c);
      }
    for (const auto& t : targets) {
      std::string best;
      for (const auto& b : bases)
        if (best.empty() || out.at({t, b}).s.mse < out.at({t, best}).s.mse) best = b;
      const Sector sec = pj_sector(t);
      const bool in_sector = sec.exact.count(best) || sec.designed.count(best);
      const bool exact_ok = sec.exact.empty() || out.at({t, best}).s.r2 > kExactR2;
      const auto& o = out.at({t, best});
      for (const auto& [metric, v] : {std::pair<std::string, double>{"best_r2", o.s.r2}, {"best_mse", o.s.mse}}) {
        ProbeCell c = make_cell(r.suite, fmt::format("fixed-best w={}c", cycles), t, best, metric, v, p, o.cond);
        c.row = t;
        c.col = metric == "best_r2" ? "best R^2" : "best MSE";
        c.check = in_sector && exact_ok ? "pass" : "FAIL";
        r.cells.push_back(c);
      }
    }
  }
  return r;
}

SuiteResult suite_grape(Precision p) {
  SuiteResult r{"pj-grape-t9", {}, {}};
  const double L = 1024.0;
  const double omega = 2.0 * std::numbers::pi * 17 / L;
  const int T = 32768;
  const auto lags = lag_range(T);
  const std::vector<std::string> bases{"grape_m_rope", "grape_a_alibi", "grape_ma_rope_alibi",
                                       "pj_fj_r1",     "pj_fj_r2",      "pj_lc_r3"};
  const auto targets = grape_target_names();
  std::map<std::string, Eigen::VectorXd> ys;
  for (const auto& t : targets) {
    Eigen::VectorXd y(T);
    for (int i = 0; i < T; ++i) y(i) = grape_target(t, lags[static_cast<size_t>(i)], omega, L);
    ys[t] = y;
  }
  std::map<std::pair<std::string, std::string>, PjOutcome> out;
  for (const auto& b : bases) {
    const Eigen::MatrixXd X = build_matrix(grape_dictionary(b, omega, L), lags);
    for (const auto& t : targets) out[{t, b}] = pj_fit(p, X, ys[t], static_cast<int>(L));
  }
  for (const auto& t : targets) {
    const Sector sec = grape_sector(t);
    std::string best;
    for (const auto& b : bases)
      if (best.empty() || out.at({t, b}).s.mse < out.at({t, best}).s.mse) best = b;
    for (const auto& b : bases) {
      const auto& o = out.at({t, b});
      ProbeCell c = make_cell(r.suite, "9", t, b, "r2", o.s.r2, p, o.cond);
      c.row = t;
      c.col = b;
      if (sec.exact.count(b)) c.check = o.s.r2 > kExactR2 ? "pass" : "FAIL";
      r.cells.push_back(c);
    }
    const auto& o = out.at({t, best});
    ProbeCell c = make_cell(r.suite, "9-best", t, best, "best_r2", o.s.r2, p, o.cond);
    c.row = t;
    c.col = "best basis R^2";
    c.check = sec.exact.count(best) && o.s.r2 > kExactR2 ? "pass" : "FAIL";
    r.cells.push_back(c);
  }
  return r;
}

// PJ-RoPE Table 3, adaptive part: the reference protocol (pj-rope.md 3.2), 3 seeds; one row per
// teacher with seed means, top-order modes and the designed-sector check.
SuiteResult suite_pj_adaptive(Precision p) {
  if (p != Precision::F64)
    throw InputError("probe suite pj-t3-adaptive runs in float64 only (--dtype f64)");
  SuiteResult r{"pj-t3-adaptive", {}, {}};
  const pj::AdaptiveSweep sw =
      pj::run_adaptive_sweep(pj::AdaptiveConfig{}, pj_target_names(), {0, 1, 2});
  for (const auto& s : sw.summaries) {
    const auto add = [&](const std::string& method, const std::string& metric, double v,
                         const std::string& col) {
      ProbeCell c = make_cell(r.suite, "t3-adaptive", s.target, method, metric, v, p, -1.0);
      c.row = s.target;
      c.col = col;
      r.cells.push_back(std::move(c));
      return &r.cells.back();
    };
    add("adaptive", "eval_mse", s.eval_mse_mean, "eval MSE (mean)");
    add("adaptive", "gate_fj", s.gate_mean[0], "g_FJ");
    add("adaptive", "gate_a", s.gate_mean[1], "g_A");
    add("adaptive", "gate_lc", s.gate_mean[2], "g_LC");
    const bool no_order = s.selected_mode == pj::Sector::A;  // the caption's dash
    add("adaptive", "top_order_mass", no_order ? -1.0 : s.top_order_mass_mode, "top order (mass)");
    add("adaptive", "top_order_energy", no_order ? -1.0 : s.top_order_energy_mode,
        "top order (energy)");
    std::string sel, designed;
    for (const auto x : s.selected) sel += std::string(sel.empty() ? "" : " ") + pj::sector_name(x);
    for (const auto x : s.designed)
      designed += std::string(designed.empty() ? "" : "+") + pj::sector_name(x);
    int hits = 0;
    for (const auto x : s.selected)
      hits += std::find(s.designed.begin(), s.designed.end(), x) != s.designed.end();
    ProbeCell* c = add(fmt::format("{} / designed {}", sel, designed), "sector", hits,
                       "selected per seed / designed");
    c->check = s.recovered ? "pass" : "FAIL";
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// PJ-RoPE Table 5 (Phase F light-cone stability and resolution probes, pj-rope.md 3.7)

ProbeCell make_t5_cell(const std::string& table, const std::string& target,
                       const std::string& method, const std::string& metric, double v,
                       const std::string& row, const std::string& col, Precision p) {
  ProbeCell c;
  c.suite = "pj-t5";
  c.table = table;
  c.target = target;
  c.method = method;
  c.metric = metric;
  c.ours = v;
  c.dtype = to_string(p);
  c.row = row;
  c.col = col;
  return c;
}

// p is the arithmetic of every probe: F32 is the reference's default protocol (its scripts run in
// float32, `--float64` switches; pj-rope.md 3 and 5.2), F64 its --float64 run. The retrieval
// "precisions" fp32 / int8 / int4 are a separate axis: what is done to the features before scoring.
SuiteResult suite_pj_t5(Precision p, bool curves) {
  namespace lc = relpos::probes::lc;
  const lc::Dtype dtype = p == Precision::F32 ? lc::Dtype::F32 : lc::Dtype::F64;
  lc::StabilityOptions so;
  so.dtype = dtype;
  lc::CacheOptions co;
  co.dtype = dtype;
  lc::RetrievalOptions ro;
  ro.dtype = dtype;
  lc::TrainedOptions to;
  to.dtype = dtype;
  const auto t5_cell = [p](const std::string& table, const std::string& target,
                           const std::string& method, const std::string& metric, double v,
                           const std::string& row, const std::string& col) {
    return make_t5_cell(table, target, method, metric, v, row, col, p);
  };
  SuiteResult r{"pj-t5", {}, {}};
  const int Tmax = 32768;
  std::vector<int> Ts;
  for (int T = 1024; T <= Tmax; T *= 2) Ts.push_back(T);
  const std::vector<lc::Variant> focus{lc::Variant::Raw, lc::Variant::Scaled,
                                       lc::Variant::LcPhaseOnly, lc::Variant::Lc,
                                       lc::Variant::LcWrongScale};
  const auto& variants = lc::all_variants();

  // Stability and cache probes at every T, every variant.
  std::map<std::pair<lc::Variant, int>, lc::StabilityRow> stab;
  std::map<std::pair<lc::Variant, int>, lc::CacheRow> cache;
  for (lc::Variant v : variants)
    for (int T : Ts) {
      stab[{v, T}] = lc::phase_f_stability(v, T, so);
      cache[{v, T}] = lc::phase_f_cache_quantization(v, T, co);
    }
  // Retrieval (every variant) and the trained classifier (focus rows) at T = 32768.
  std::map<std::pair<lc::Variant, lc::Quant>, std::vector<lc::RetrievalRow>> retr;
  std::map<std::pair<lc::Variant, lc::Quant>, std::vector<lc::TrainedRow>> trained;
  for (lc::Variant v : variants)
    for (lc::Quant q : lc::all_quants())
      retr[{v, q}] = lc::phase_f_retrieval_resolution(v, Tmax, q, ro);
  for (lc::Variant v : focus)
    for (lc::Quant q : lc::all_quants())
      trained[{v, q}] = lc::phase_f_trained_resolution(v, Tmax, q, to);
  const auto at_bucket = [](const auto& rows, const std::string& b) {
    for (const auto& x : rows)
      if (x.bucket == b) return x;
    throw InputError(fmt::format("pj-t5: bucket {} missing", b));
  };

  // Table 5 overview at T = 32768.
  const std::string hard = "x16_32";
  const auto overview = [&](lc::Variant v, const std::string& table) {
    const std::string name = lc::to_string(v);
    const auto& s = stab.at({v, Tmax});
    const auto& c = cache.at({v, Tmax});
    const std::vector<std::tuple<std::string, std::string, std::string, double>> cols{
        {"stability", "qk_norm_proxy_final", "QK proxy", s.qk_proxy_final},
        {"stability", "local_phase_ratio_final", "phase ratio (last lag)", s.phase_ratio_final},
        {"stability", "local_phase_ratio_far_mean", "phase ratio (far mean)",
         s.phase_ratio_far_mean},
        {"stability", "far_phase_span_radians", "far span (rad)", s.far_phase_span},
        {"cache", "logit_std", "cache logit std", c.logit_std},
        {"stability", "int8_quant_error_tensor", "int8 err", s.int8_error_tensor},
        {"stability", "int4_quant_error_tensor", "int4 err", s.int4_error_tensor},
    };
    for (const auto& [method, metric, col, v2] : cols)
      r.cells.push_back(t5_cell(table, name, method, metric, v2, name, col));
    for (lc::Quant q : lc::all_quants()) {
      const auto x = at_bucket(retr.at({v, q}), hard);
      r.cells.push_back(t5_cell(table, name, "retrieval",
                                fmt::format("top1_{}_{}", lc::to_string(q), hard), x.top1, name,
                                fmt::format("top1 {}", lc::to_string(q))));
    }
    for (lc::Quant q : {lc::Quant::Fp32, lc::Quant::Int4}) {
      const auto it = trained.find({v, q});
      if (it == trained.end()) continue;
      const auto x = at_bucket(it->second, hard);
      r.cells.push_back(t5_cell(
          table, name, "trained", fmt::format("hard_pair_acc_{}_{}", lc::to_string(q), hard),
          x.hard_pair_accuracy, name, fmt::format("hard-pair acc {}", lc::to_string(q))));
    }
  };
  for (lc::Variant v : focus) overview(v, "5");
  for (lc::Variant v : variants)
    if (std::find(focus.begin(), focus.end(), v) == focus.end()) overview(v, "5-other");

  // Details at T = 32768: every metric (rows) x variant (columns).
  for (lc::Variant v : variants) {
    const std::string name = lc::to_string(v);
    for (const auto& [metric, val] : lc::stability_metrics(stab.at({v, Tmax})))
      r.cells.push_back(t5_cell("5-stability", name, "stability", metric, val, metric, name));
    const auto& c = cache.at({v, Tmax});
    const std::vector<std::pair<std::string, double>> cm{
        {"logit_std", c.logit_std},
        {"key_norm_final", c.key_norm_final},
        {"key_norm_max", c.key_norm_max},
        {"key_norm_mean", c.key_norm_mean},
        {"key_norm_far_mean", c.key_norm_far_mean},
        {"cache_abs_max", c.cache_abs_max},
        {"logit_abs_max", c.logit_abs_max},
        {"int8_cache_error_tensor", c.cache_error[0][0]},
        {"int8_cache_error_channel", c.cache_error[0][1]},
        {"int4_cache_error_tensor", c.cache_error[1][0]},
        {"int4_cache_error_channel", c.cache_error[1][1]},
        {"int8_cache_far_error_tensor", c.cache_error_far[0][0]},
        {"int8_cache_far_error_channel", c.cache_error_far[0][1]},
        {"int4_cache_far_error_tensor", c.cache_error_far[1][0]},
        {"int4_cache_far_error_channel", c.cache_error_far[1][1]},
        {"int8_logit_error_tensor", c.logit_error[0][0]},
        {"int8_logit_error_channel", c.logit_error[0][1]},
        {"int4_logit_error_tensor", c.logit_error[1][0]},
        {"int4_logit_error_channel", c.logit_error[1][1]},
        {"nonfinite_count", static_cast<double>(c.nonfinite_count)}};
    for (const auto& [metric, val] : cm)
      r.cells.push_back(t5_cell("5-cache", name, "cache", metric, val, metric, name));
    for (lc::Quant q : lc::all_quants())
      for (const auto& x : retr.at({v, q})) {
        const std::vector<std::pair<std::string, double>> rm{{"top1", x.top1},
                                                             {"within_1", x.within1},
                                                             {"within_8", x.within8},
                                                             {"within_64", x.within64},
                                                             {"bucket_acc", x.bucket_accuracy},
                                                             {"mean_abs_err", x.mean_abs_error},
                                                             {"median_abs_err", x.median_abs_error},
                                                             {"margin", x.mean_margin},
                                                             {"mean_tie_count", x.mean_tie_count}};
        for (const auto& [metric, val] : rm) {
          const std::string m = fmt::format("{} {} {}", lc::to_string(q), x.bucket, metric);
          r.cells.push_back(t5_cell("5-retrieval", name, "retrieval", m, val, m, name));
        }
      }
  }
  for (lc::Variant v : focus) {
    const std::string name = lc::to_string(v);
    for (lc::Quant q : lc::all_quants())
      for (const auto& x : trained.at({v, q})) {
        const std::vector<std::pair<std::string, double>> tm{
            {"hard_pair_acc", x.hard_pair_accuracy},
            {"pos_accept", x.pos_accept},
            {"hard_neg_accept", x.hard_negative_accept},
            {"random_neg_accept", x.random_negative_accept},
            {"hard_gap_mean", x.hard_gap_mean},
            {"hard_gap_median", x.hard_gap_median},
            {"hard_feature_dist_mean", x.hard_feature_distance_mean},
            {"final_train_loss", x.final_loss}};
        for (const auto& [metric, val] : tm) {
          const std::string m = fmt::format("{} {} {}", lc::to_string(q), x.bucket, metric);
          r.cells.push_back(t5_cell("5-trained", name, "trained", m, val, m, name));
        }
      }
  }

  // Stability curves against T: one table per metric (variants x T), and the plotted curves.
  std::vector<std::string> metric_names;
  for (const auto& [m, val] : lc::stability_metrics(stab.at({variants[0], Tmax})))
    metric_names.push_back(m);
  metric_names.push_back("cache_logit_std");
  for (size_t k = 0; k < metric_names.size(); ++k) {
    const std::string& m = metric_names[k];
    for (lc::Variant v : variants) {
      ProbeCurve curve{"5-T", m, lc::to_string(v), lc::to_string(v), {}, {}};
      for (int T : Ts) {
        const double val = k + 1 < metric_names.size()
                               ? lc::stability_metrics(stab.at({v, T}))[k].second
                               : cache.at({v, T}).logit_std;
        r.cells.push_back(t5_cell(
            "5-T " + m, lc::to_string(v), k + 1 < metric_names.size() ? "stability" : "cache",
            fmt::format("{} T={}", m, T), val, lc::to_string(v), fmt::format("T={}", T)));
        curve.x.push_back(T);
        curve.y.push_back(val);
      }
      if (curves) r.curves.push_back(std::move(curve));
    }
  }
  return r;
}
}  // namespace

SuiteResult run_probe_suite(const std::string& suite, Precision precision, bool keep_curves) {
  if (suite == "jordan-t3") return suite_t3(precision, keep_curves);
  if (suite == "jordan-t11" || suite == "jordan-t4") return suite_t11(precision, keep_curves);
  if (suite == "jordan-t6") return suite_t6(precision, keep_curves);
  if (suite == "jordan-t16") return suite_t16(precision, keep_curves);
  if (suite == "pj-fixed") return suite_pj_fixed(precision);
  if (suite == "pj-grape-t9") return suite_grape(precision);
  if (suite == "pj-t3-adaptive") return suite_pj_adaptive(precision);
  if (suite == "pj-t5") return suite_pj_t5(precision, keep_curves);
  throw InputError(fmt::format("unknown probe suite '{}' (valid: {}, {}, all)", suite,
                               fmt::join(probe_suite_names(), ", "),
                               fmt::join(extra_probe_suite_names(), ", ")));
}

}  // namespace relpos::probes
