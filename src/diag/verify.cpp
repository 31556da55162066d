#include "diag/verify.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <random>

#include "core/reference.hpp"
#include "core/registry.hpp"
#include "core/structured.hpp"
#include "kernels/mechanism_apply.hpp"
#include "kernels/structured.hpp"
#include "kernels/transform.hpp"

namespace relpos::diag {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<double> sample_positions(const VerifyOptions& o, std::mt19937_64& rng) {
  const double N = static_cast<double>(o.max_lag);
  std::vector<double> p = {0, 1, 2, 3, 7, N / 2, N - 1, N};
  std::uniform_int_distribution<int64_t> U(0, o.max_lag);
  while (static_cast<int>(p.size()) < o.positions) {
    const auto x = static_cast<double>(U(rng));
    p.push_back(x);  // clusters give short lags everywhere in the window
    if (x + 1 <= N) p.push_back(x + 1);
    if (x + 5 <= N) p.push_back(x + 5);
  }
  std::sort(p.begin(), p.end());
  p.erase(std::unique(p.begin(), p.end()), p.end());
  return p;
}

template <class T>
struct Applied {
  std::vector<T> q, k;
};

// Runs the fast kernel on [1, H, K, D] inputs at the given positions and centre.
template <class T>
Applied<T> apply(const Mechanism& m, const ParamValues& pv, Layout layout,
                 const std::vector<double>& pos, double center, const std::vector<double>& q,
                 const std::vector<double>& k, bool wrong_query = false) {
  // the one call path: every transform term in order, as the torch layer runs them
  const auto plan = kernels::MechanismPlan::from(m, layout);
  kernels::Dims dims{1, m.heads, static_cast<int64_t>(pos.size())};
  kernels::Positions P{pos.data(), false, center};
  const kernels::ParamBuffers<T> par(pv);
  const auto trig = kernels::build_trig_table<T>(plan.position, dims, P);
  Applied<T> out;
  std::vector<T> qi(q.begin(), q.end()), ki(k.begin(), k.end());
  out.q.resize(q.size());
  out.k.resize(k.size());
  if (wrong_query) {  // the primal map on queries too
    kernels::mechanism_forward<T>(plan, dims, P, par.view(), trig.view(), nullptr, qi.data(),
                                  nullptr, out.q.data());
    kernels::mechanism_forward<T>(plan, dims, P, par.view(), trig.view(), nullptr, ki.data(),
                                  nullptr, out.k.data());
  } else {
    kernels::mechanism_forward<T>(plan, dims, P, par.view(), trig.view(), qi.data(), ki.data(),
                                  out.q.data(), out.k.data());
  }
  return out;
}

// Rows (length D) of a [H, K, D] buffer in units of their largest entry: x = row / scale with
// |x_i| <= 1, so products and sums of x never overflow; the row's own value is x * scale.
struct ScaledRows {
  std::vector<double> x;
  std::vector<double> scale;  // max |row_i|: 0 for a zero row, NaN / inf for a non-finite one
  std::vector<double> norm;   // Euclidean norm, scaled (NaN / inf for a non-finite row)
};

template <class T>
ScaledRows scale_rows(const std::vector<T>& v, int D) {
  ScaledRows r;
  const size_t rows = v.size() / D;
  r.x.assign(v.size(), 0.0);
  r.scale.resize(rows);
  r.norm.resize(rows);
  for (size_t i = 0; i < rows; ++i) {
    const T* src = v.data() + i * D;
    double* dst = r.x.data() + i * D;
    double mx = 0;
    for (int c = 0; c < D; ++c) mx = max_nan(mx, std::abs(static_cast<double>(src[c])));
    r.scale[i] = mx;
    r.norm[i] = mx;
    if (mx == 0 || !std::isfinite(mx)) continue;
    double s = 0;
    for (int c = 0; c < D; ++c) {
      dst[c] = static_cast<double>(src[c]) / mx;
      s += dst[c] * dst[c];
    }
    r.norm[i] = mx * std::sqrt(s);
  }
  return r;
}

template <class T>
std::vector<double> row_norms(const std::vector<T>& v, int D) {
  std::vector<double> n(v.size() / D);
  for (size_t i = 0; i < n.size(); ++i) n[i] = scaled_norm(v.data() + i * D, D);
  return n;
}

// Dot product of two scaled rows (entries in [-1, 1]: cannot overflow).
double dot(const double* a, const double* b, int D) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int i = 0;
  for (; i + 4 <= D; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < D; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// The transformed rows of one kernel application, scaled.
struct Transformed {
  ScaledRows q, k;
};
template <class T>
Transformed scaled(Applied<T>&& a, int D) {
  Transformed t{scale_rows(a.q, D), scale_rows(a.k, D)};
  a = {};
  return t;
}

struct PairStats {
  double rel = 0, rel_qk = 0, shift = 0;
  // first non-finite (or, for scores, out-of-dtype-range) value seen; 0 when none
  double bad_ref = 0, bad_score = 0, bad_shifted_score = 0;
};

using LD = long double;
static_assert(std::numeric_limits<LD>::max_exponent >=
                  2 * std::numeric_limits<double>::max_exponent,
              "products of two doubles must not overflow long double");

// long double -> double without undefined behaviour: beyond the double range is +-inf
double to_double(LD x) {
  if (std::isnan(x)) return kNaN;
  if (std::abs(x) > static_cast<LD>(std::numeric_limits<double>::max()))
    return x > 0 ? kInf : -kInf;
  return static_cast<double>(x);
}
// num / den for num, den >= 0; 0 / 0 = 0 (nothing to compare), x / 0 = inf
double ratio(LD num, LD den) {
  if (den == 0) return num == 0 ? 0.0 : kInf;
  return to_double(num / den);
}

void note_bad(double& slot, double v) {
  if (slot == 0) slot = std::isnan(v) ? kNaN : v;
}

// Scores every pair i >= j of every head through the transformed rows `a` against the float64
// closed form; with `b` (the same inputs at positions shifted by C, same centre) also the shift
// residual. Everything is computed in units of the rows' largest entries, so a score or a norm
// that overflows shows as inf / NaN instead of turning a residual into 0. `score_max`: the largest
// score the dtype holds.
PairStats score_pairs(const Mechanism& m, const ParamValues& pv, Layout layout,
                      const std::vector<double>& pos, const std::vector<double>& q,
                      const std::vector<double>& k, const std::vector<double>& qn,
                      const std::vector<double>& kn, const Transformed& a, const Transformed* b,
                      double score_max) {
  const int D = m.head_dim, K = static_cast<int>(pos.size());
  PairStats st;
  for (int h = 0; h < m.heads; ++h)
    for (int i = 0; i < K; ++i)
      for (int j = 0; j <= i; ++j) {
        const size_t ri = static_cast<size_t>(h) * K + i, rj = static_cast<size_t>(h) * K + j;
        const double ref = reference::relative_score(m, pv, h, pos[i] - pos[j], q.data() + ri * D,
                                                     k.data() + rj * D, layout);
        if (!std::isfinite(ref)) note_bad(st.bad_ref, ref);
        // Scores are recombined from the scaled dot products in long double (x87 / binary128
        // exponent range): a product of two finite row scales cannot overflow there, so
        // score(p + C) - score(p) of two e^700-sized scores is their true (huge) difference,
        // not inf - inf or 0 * inf = NaN. Only the final ratios return to double.
        const double sq = a.q.scale[ri], sk = a.k.scale[rj];
        double rel = kNaN, rel_qk = kNaN;
        LD s0 = kNaN;  // the score q~.k~
        if (std::isfinite(sq) && std::isfinite(sk) && std::isfinite(ref)) {
          // a vanished transformed row (underflow) scores 0
          s0 =
              sq == 0 || sk == 0
                  ? 0.0L
                  : static_cast<LD>(dot(a.q.x.data() + ri * D, a.k.x.data() + rj * D, D)) * sq * sk;
          if (!(std::abs(s0) <= score_max)) note_bad(st.bad_score, to_double(s0));
          const LD err = std::abs(s0 - static_cast<LD>(ref));
          rel = ratio(err, static_cast<LD>(a.q.norm[ri]) * a.k.norm[rj]);
          rel_qk = ratio(err, static_cast<LD>(qn[ri]) * kn[rj]);
        }
        st.rel = max_nan(st.rel, rel);
        st.rel_qk = max_nan(st.rel_qk, rel_qk);
        if (!b) continue;
        const double tq = b->q.scale[ri], tk = b->k.scale[rj];
        double shift = kNaN;
        if (std::isfinite(tq) && std::isfinite(tk) && !std::isnan(s0)) {
          const LD s1 =
              tq == 0 || tk == 0
                  ? 0.0L
                  : static_cast<LD>(dot(b->q.x.data() + ri * D, b->k.x.data() + rj * D, D)) * tq *
                        tk;
          if (!(std::abs(s1) <= score_max)) note_bad(st.bad_shifted_score, to_double(s1));
          shift = ratio(std::abs(s1 - s0), static_cast<LD>(a.q.norm[ri]) * a.k.norm[rj]);
        }
        st.shift = max_nan(st.shift, shift);
      }
  return st;
}

// max |x~|/|x| over rows (NaN and inf propagate).
double growth(const ScaledRows& t, const std::vector<double>& in_norm) {
  double g = 0;
  for (size_t r = 0; r < in_norm.size(); ++r) g = max_nan(g, t.norm[r] / in_norm[r]);
  return g;
}

// Largest |gamma (p - c0)| over a window against each damped segment's clamp; reports the
// segment where it binds the most.
struct ClampCheck {
  bool binds = false;
  int segment = -1;
  double max_gp = 0, max_exp = 0;
};
ClampCheck clamp_check(const Mechanism& m, const ParamValues& pv, double max_abs_pos) {
  ClampCheck c;
  double worst = -1;
  for (size_t si = 0; si < m.segments().size(); ++si) {
    const auto& s = m.segments()[si];
    if (!s.damped) continue;
    double gmax = 0;
    for (int h = 0; h < pv.heads; ++h)
      for (int b = 0; b < s.blocks; ++b)
        gmax = max_nan(gmax,
                       std::abs(pv.gamma[static_cast<size_t>(h) * pv.blocks + s.first_block + b]));
    const double gp = gmax * max_abs_pos;
    // same test as the kernels (|gamma p| > max_exp), NaN counted as binding
    const bool binds = !(gp <= s.max_exponent);
    const double ratio = std::isnan(gp) ? kInf : gp / s.max_exponent;
    if (binds && ratio > worst) {
      worst = ratio;
      c = {true, static_cast<int>(si), gp, s.max_exponent};
    }
  }
  return c;
}

template <class T>
const char* dtype_name() {
  return sizeof(T) == 8 ? "float64" : "float32";
}

// What the dtype cannot hold: a clamp bound max_exp beyond log(max) (e^x overflows; float32:
// 88.72, float64: 709.78) or a parameter beyond max.
template <class T>
std::vector<std::string> dtype_range_problems(const Mechanism& m, const ParamValues& pv) {
  std::vector<std::string> out;
  const double lim = std::log(static_cast<double>(std::numeric_limits<T>::max()));
  for (size_t si = 0; si < m.segments().size(); ++si) {
    const auto& s = m.segments()[si];
    if (s.damped && !(s.max_exponent <= lim))
      out.push_back(fmt::format(
          "segment {}: max_exp = {:g} exceeds the {} exponent range (e^x overflows for x > {:.2f})",
          si, s.max_exponent, dtype_name<T>(), lim));
  }
  const double vmax = static_cast<double>(std::numeric_limits<T>::max());
  const std::pair<const char*, const std::vector<double>*> arrays[] = {
      {"gamma", &pv.gamma}, {"eta", &pv.eta}, {"gates", &pv.gates}, {"alpha0", &pv.alpha0}};
  for (const auto& [name, v] : arrays)
    for (double x : *v)
      if (!(std::abs(x) <= vmax)) {
        out.push_back(fmt::format("parameter {} = {:g} is not representable in {}", name, x,
                                  dtype_name<T>()));
        break;
      }
  return out;
}

std::string window_reason(const char* window, double lo, double hi, double c0,
                          const ClampCheck& c) {
  return fmt::format(
      "exponent clamp binds in the {} window [{:g}, {:g}] around c0 = {:g}: segment {} has max "
      "|gamma (p - c0)| = {:.4g} > max_exp = {:g}",
      window, lo, hi, c0, c.segment, c.max_gp, c.max_exp);
}

std::string join(const std::vector<std::string>& parts) {
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : "; ") + p;
  return s;
}

// A row's description of what is verified: the spec as given and built, its declared exactness.
template <class T>
VerifyRow row_of(const std::string& spec, const Mechanism& m) {
  VerifyRow row;
  row.spec = spec;
  row.canonical = m.spec;
  row.head_dim = m.head_dim;
  row.declared = m.exactness();
  row.transform_exact = m.transform_exact();
  row.dtype = sizeof(T) == 8 ? "f64" : "f32";
  return row;
}

template <class T>
VerifyRow run_one(const std::string& spec, const Mechanism& m, const ParamValues& pv,
                  const VerifyOptions& o, const std::vector<double>& pos,
                  const std::vector<double>& q, const std::vector<double>& k,
                  const std::vector<double>& qn, const std::vector<double>& kn) {
  VerifyRow row = row_of<T>(spec, m);
  const int D = m.head_dim;
  const double pmin = pos.front(), pmax = pos.back(), C = o.shift;
  row.center = m.window_center(pmin, pmax);
  const double c0 = row.center;
  const ClampCheck cc = clamp_check(m, pv, std::max(std::abs(pmin - c0), std::abs(pmax - c0)));
  const ClampCheck cs =
      clamp_check(m, pv, std::max(std::abs(pmin + C - c0), std::abs(pmax + C - c0)));
  const ClampCheck cu = clamp_check(m, pv, std::max(std::abs(pmin), std::abs(pmax)));
  row.clamp_bound = cc.binds;
  row.clamp_bound_shifted = cs.binds;
  row.clamp_bound_uncentered = cu.binds;

  std::vector<std::string> fail = dtype_range_problems<T>(m, pv), clamp;
  if (!fail.empty()) {
    // the kernel would run e^x into inf / NaN (or take parameters it cannot hold): not run
    fail.back() += " (kernel not run)";
    row.residual = row.residual_qk = row.shift_residual = kNaN;
    row.key_growth = row.query_growth = row.key_growth_uncentered = row.query_growth_uncentered =
        kNaN;
  } else {
    PairStats st;
    double shifted_kg = 0, shifted_qg = 0;
    {
      const Transformed a = scaled(apply<T>(m, pv, o.layout, pos, c0, q, k), D);
      row.key_growth = growth(a.k, kn);
      row.query_growth = growth(a.q, qn);
      // shift invariance with a fixed centre, so the shift really moves the absolute positions
      std::vector<double> shifted(pos);
      for (auto& x : shifted) x += C;
      const Transformed b = scaled(apply<T>(m, pv, o.layout, shifted, c0, q, k), D);
      shifted_kg = growth(b.k, kn);
      shifted_qg = growth(b.q, qn);
      st = score_pairs(m, pv, o.layout, pos, q, k, qn, kn, a, &b,
                       static_cast<double>(std::numeric_limits<T>::max()));
    }
    row.residual = st.rel;
    row.residual_qk = st.rel_qk;
    row.shift_residual = st.shift;
    {
      const Transformed a0 = scaled(apply<T>(m, pv, o.layout, pos, 0.0, q, k), D);
      row.key_growth_uncentered = growth(a0.k, kn);
      row.query_growth_uncentered = growth(a0.q, qn);
    }
    // one entry naming every non-finite quantity: "non-finite key growth (inf), residual (nan)"
    std::string bad;
    const auto nonfinite = [&](const char* what, double v) {
      if (!std::isfinite(v))
        bad += fmt::format("{}{} ({})", bad.empty() ? "non-finite " : ", ", what, v);
    };
    nonfinite("reference score", st.bad_ref);
    nonfinite("key growth", row.key_growth);
    nonfinite("query growth", row.query_growth);
    nonfinite("shift-test key growth", shifted_kg);
    nonfinite("shift-test query growth", shifted_qg);
    nonfinite("uncentred key growth", row.key_growth_uncentered);
    nonfinite("uncentred query growth", row.query_growth_uncentered);
    nonfinite("relative residual", row.residual);
    nonfinite("relative residual / |q||k|", row.residual_qk);
    nonfinite("shift residual", row.shift_residual);
    if (!bad.empty()) fail.push_back(bad);
    if (st.bad_score != 0)
      fail.push_back(
          fmt::format("score q~.k~ = {:.3g} overflows {}", st.bad_score, dtype_name<T>()));
    if (st.bad_shifted_score != 0)
      fail.push_back(fmt::format("shifted score q~.k~ = {:.3g} overflows {}", st.bad_shifted_score,
                                 dtype_name<T>()));
  }
  if (m.slope_bias()) {
    row.alibi_lift_residual = 0;
    for (double slope : m.slope_bias()->slopes)
      for (size_t i = 0; i < pos.size(); ++i)
        for (size_t j = 0; j <= i; ++j) {
          const auto l = reference::alibi_lift(slope, pos[i], pos[j]);
          const double err = std::abs(l.q.dot(l.k) + slope * (pos[i] - pos[j]));
          row.alibi_lift_residual =
              max_nan(row.alibi_lift_residual, err / (l.q.stableNorm() * l.k.stableNorm()));
        }
    if (!std::isfinite(row.alibi_lift_residual))
      fail.push_back(fmt::format("non-finite alibi lift residual ({})", row.alibi_lift_residual));
  }
  if (cc.binds) clamp.push_back(window_reason("centred", pmin, pmax, c0, cc));
  if (cs.binds && !cc.binds)
    clamp.push_back(window_reason("shift-test", pmin + C, pmax + C, c0, cs));
  // residuals judged for exact mechanisms in fp64 (non-finite ones are already failures)
  std::vector<std::string> resid;
  if (row.dtype == "f64" && row.transform_exact) {
    const auto above = [&](const char* what, double v) {
      if (std::isfinite(v) && v > o.exact_tol)
        resid.push_back(fmt::format("{} {:.3g} above {:g}", what, v, o.exact_tol));
    };
    above("relative residual", row.residual);
    above("shift residual", row.shift_residual);
    if (m.slope_bias()) above("alibi lift residual", row.alibi_lift_residual);
  }
  std::vector<std::string> reasons;
  if (!fail.empty()) {
    row.status = "FAIL";
    reasons = fail;
    reasons.insert(reasons.end(), clamp.begin(), clamp.end());
    reasons.insert(reasons.end(), resid.begin(), resid.end());
  } else if (!clamp.empty()) {
    // verify's numbers do not describe the mechanism where the clamp binds: every row fails
    row.status = "CLAMPED";
    reasons = clamp;
    reasons.insert(reasons.end(), resid.begin(), resid.end());
  } else if (row.dtype == "f32") {
    row.status = "INFO";
  } else if (!row.transform_exact) {
    row.status = "APPROX";
  } else if (!resid.empty()) {
    row.status = "FAIL";
    reasons = resid;
  } else {
    row.status = "PASS";
  }
  row.reason = join(reasons);
  return row;
}

Mechanism build_for_verify(const std::string& spec, const VerifyOptions& o) {
  try {
    return build_mechanism(spec, o.head_dim, o.heads);
  } catch (const InputError&) {
    if (!o.auto_head_dim) throw;
    // orders 3 and 5 need head dims divisible by 6 and 10: try the nearest multiples of 2m
    for (int m = 2; m <= 8; ++m) {
      const int D = 2 * m * ((o.head_dim + 2 * m - 1) / (2 * m));
      try {
        return build_mechanism(spec, D, o.heads);
      } catch (const InputError&) {
      }
    }
    throw;
  }
}

// Mechanism, sampled positions and random q, k shared by the checks of one spec.
struct Sample {
  Mechanism m;
  std::mt19937_64 rng;
  std::vector<double> pos, q, k;
  std::vector<double> qn, kn;  // row norms of q, k
};
Sample make_sample(Mechanism m, const VerifyOptions& o) {
  Sample s{std::move(m), std::mt19937_64(o.seed), {}, {}, {}, {}, {}};
  s.pos = sample_positions(o, s.rng);
  // a dynamic context-extension rule is checked at this window's length: exact within one call
  s.m = scaled_for_length(s.m, context_length(s.pos.data(), s.pos.size()));
  std::normal_distribution<double> N01;
  const size_t n = static_cast<size_t>(s.m.heads) * s.pos.size() * s.m.head_dim;
  s.q.resize(n);
  s.k.resize(n);
  for (auto& x : s.q) x = N01(s.rng);
  for (auto& x : s.k) x = N01(s.rng);
  s.qn = row_norms(s.q, s.m.head_dim);
  s.kn = row_norms(s.k, s.m.head_dim);
  return s;
}
Sample make_sample(const std::string& spec, const VerifyOptions& o) {
  return make_sample(build_for_verify(spec, o), o);
}

// Time model, nanoseconds on one core (see kVerifyBudgetSeconds). Measured with Release builds
// (GCC 12, -O3) on the development machine: per scored pair, a fixed part, per coordinate of the
// two scaled dot products, per Jordan block of the closed form (exp + sincos + shear series), per
// entry of its upper triangle, per coordinate left untouched; per coordinate of each kernel
// application with its scaling.
constexpr double kNsPair = 40.0, kNsDotCoord = 0.5, kNsBlock = 30.0, kNsEntry = 1.5,
                 kNsFreeCoord = 0.5, kNsRowCoord = 25.0;

struct SpecCost {
  double seconds = 0, bytes = 0;
  int64_t pairs = 0;
};
SpecCost mechanism_cost(const Mechanism& m, const VerifyOptions& o, size_t ndtypes) {
  std::mt19937_64 rng(o.seed);
  const auto K = static_cast<double>(sample_positions(o, rng).size());
  const double D = m.head_dim, H = m.heads, rows = 2.0 * static_cast<double>(ndtypes);
  double blocks = 0, entries = 0, covered = 0;
  int max_order = 1;
  for (const auto& s : m.segments()) {
    blocks += s.blocks;
    entries += static_cast<double>(s.blocks) * s.order * (s.order + 1) / 2;
    covered = std::max(covered, 2.0 * (s.first_pair + s.pairs()));
    max_order = std::max(max_order, s.order);
  }
  const double pairs = H * K * (K + 1) / 2;
  const double pair_ns = kNsPair + 2 * D * kNsDotCoord + blocks * kNsBlock + entries * kNsEntry +
                         (D - covered) * kNsFreeCoord;
  const double kernel_ns = 3 * H * K * D * kNsRowCoord * max_order;
  SpecCost c;
  c.seconds = rows * (pairs * pair_ns + kernel_ns) * 1e-9;
  // q, k and their norms; two scaled applications (q, k) live while scoring; a kernel call's own
  // copies of its inputs and outputs: about 12 buffers of H K D doubles
  c.bytes = 12.0 * 8.0 * H * K * D;
  c.pairs = static_cast<int64_t>(rows * pairs);
  return c;
}

SpecCost spec_cost(const std::string& spec, const VerifyOptions& o, size_t ndtypes) {
  return mechanism_cost(build_for_verify(spec, o), o, ndtypes);
}

// A rotation by vector positions (TransformKind::Structured): token t of the sample sits at the
// cell of raster index pos[t] in a grid of side ceil(max_lag^(1/d_c)) per axis (as many cells as
// the scalar window has lags). Through the fast kernel (kernels::structured_forward) on q and k,
// scored against the closed form of Theorem 1, q_i^T R(r_j - r_i) k_j = sum_u (U^T q_i)_u^T
// R_2(theta_u(r_j - r_i)) (U^T k_j)_u in float64, over every pair (the map is not causal); the
// shift residual moves every position by (C, ..., C). Orthogonal maps: no centre, no clamp.
template <class T>
VerifyRow run_structured(const std::string& spec, const Mechanism& m,
                         const std::vector<structured::Family>& fam, const VerifyOptions& o,
                         const std::vector<double>& pos, const std::vector<double>& q,
                         const std::vector<double>& k, const std::vector<double>& qn,
                         const std::vector<double>& kn) {
  VerifyRow row = row_of<T>(spec, m);
  const TransformTerm& term = *m.structured_term();
  const int D = m.head_dim, H = m.heads, dc = term.vector_dims, M = term.planes;
  const auto K = static_cast<int64_t>(pos.size());
  const double side =
      std::max(1.0, std::ceil(std::pow(static_cast<double>(o.max_lag) + 1, 1.0 / dc)));
  std::vector<double> r(static_cast<size_t>(K) * dc), rs(r.size());
  for (int64_t t = 0; t < K; ++t) {
    double rest = std::floor(pos[static_cast<size_t>(t)]);
    for (int c = 0; c < dc; ++c) {
      r[static_cast<size_t>(t * dc + c)] = std::fmod(rest, side);
      rs[static_cast<size_t>(t * dc + c)] = r[static_cast<size_t>(t * dc + c)] + o.shift;
      rest = std::floor(rest / side);
    }
  }
  std::vector<T> U(static_cast<size_t>(H) * D * D), lam(static_cast<size_t>(H) * dc * M);
  for (int h = 0; h < H; ++h) {
    const auto& f = fam[static_cast<size_t>(h)];
    for (int i = 0; i < D; ++i)
      for (int j = 0; j < D; ++j)
        U[(static_cast<size_t>(h) * D + i) * D + j] = static_cast<T>(f.U(i, j));
    for (int c = 0; c < dc; ++c)
      for (int u = 0; u < M; ++u)
        lam[(static_cast<size_t>(h) * dc + c) * M + u] = static_cast<T>(f.lambda(c, u));
  }
  kernels::StructuredDims dims;
  dims.B = 1;
  dims.H = H;
  dims.T = K;
  dims.D = D;
  dims.M = M;
  dims.DC = dc;
  dims.basis_per_head = dims.freqs_per_head = true;
  const auto rotated = [&](const std::vector<double>& x, const std::vector<double>& at) {
    std::vector<T> in(x.begin(), x.end()), out(x.size());
    kernels::structured_forward<T>(dims, false, in.data(), U.data(), lam.data(), at.data(),
                                   out.data());
    return std::vector<double>(out.begin(), out.end());
  };
  const auto qt = rotated(q, r), kt = rotated(k, r), qs = rotated(q, rs), ks = rotated(k, rs);
  double rel = 0, shift = 0, growth_q = 0, growth_k = 0;
  for (int h = 0; h < H; ++h) {
    const auto& f = fam[static_cast<size_t>(h)];
    for (int64_t i = 0; i < K; ++i) {
      const size_t ri = (static_cast<size_t>(h) * K + i) * D;
      const Eigen::VectorXd zq = f.U.transpose() * Eigen::Map<const Eigen::VectorXd>(&q[ri], D);
      growth_q = max_nan(growth_q, std::sqrt(dot(&qt[ri], &qt[ri], D)) / qn[ri / D]);
      growth_k = max_nan(growth_k, std::sqrt(dot(&kt[ri], &kt[ri], D)) / kn[ri / D]);
      for (int64_t j = 0; j < K; ++j) {
        const size_t rj = (static_cast<size_t>(h) * K + j) * D;
        const Eigen::VectorXd zk = f.U.transpose() * Eigen::Map<const Eigen::VectorXd>(&k[rj], D);
        double want = 0;
        for (int u = 0; u < M; ++u) {
          double th = 0;
          for (int c = 0; c < dc; ++c)
            th += f.lambda(c, u) *
                  (r[static_cast<size_t>(j * dc + c)] - r[static_cast<size_t>(i * dc + c)]);
          const double cs = std::cos(th), sn = std::sin(th);
          want += zq(2 * u) * (cs * zk(2 * u) - sn * zk(2 * u + 1)) +
                  zq(2 * u + 1) * (sn * zk(2 * u) + cs * zk(2 * u + 1));
        }
        const double scale = qn[ri / D] * kn[rj / D];
        const double got = dot(&qt[ri], &kt[rj], D);
        rel = max_nan(rel, std::abs(got - want) / scale);
        shift = max_nan(shift, std::abs(dot(&qs[ri], &ks[rj], D) - got) / scale);
      }
    }
  }
  row.residual = row.residual_qk = rel;
  row.shift_residual = shift;
  row.key_growth = row.key_growth_uncentered = growth_k;
  row.query_growth = row.query_growth_uncentered = growth_q;
  std::vector<std::string> reasons;
  for (auto [what, v] : {std::pair{"relative residual", rel}, std::pair{"shift residual", shift}})
    if (!std::isfinite(v))
      reasons.push_back(fmt::format("non-finite {} ({})", what, v));
    else if (row.dtype == "f64" && v > o.exact_tol)
      reasons.push_back(fmt::format("{} {:.3g} above {:g}", what, v, o.exact_tol));
  row.status = !reasons.empty() ? "FAIL" : row.dtype == "f32" ? "INFO" : "PASS";
  row.reason = join(reasons);
  return row;
}

std::vector<VerifyRow> verify_one(const std::string& spec, Sample s, const VerifyOptions& o,
                                  const std::vector<std::string>& dtypes, std::ostream* progress,
                                  const std::string& prefix) {
  std::vector<VerifyRow> rows;
  if (const TransformTerm* st = s.m.structured_term()) {
    std::vector<structured::Family> def, rnd;
    for (int h = 0; h < s.m.heads; ++h) {
      def.push_back(structured::term_family(*st, h, o.layout));
      rnd.push_back(structured::random_term_family(*st, h, o.layout, s.rng));
    }
    for (const auto* f : {&def, &rnd})
      for (const auto& dt : dtypes) {
        VerifyRow r = dt == "f32"
                          ? run_structured<float>(spec, s.m, *f, o, s.pos, s.q, s.k, s.qn, s.kn)
                          : run_structured<double>(spec, s.m, *f, o, s.pos, s.q, s.k, s.qn, s.kn);
        r.params = f == &def ? "default" : "random";
        rows.push_back(std::move(r));
      }
    return rows;
  }
  const ParamValues def = default_params(s.m);
  const ParamValues rnd = random_params(s.m, s.rng);
  const size_t total = 2 * dtypes.size();
  for (const auto* pv : {&def, &rnd})
    for (const auto& dt : dtypes) {
      const char* params = pv == &def ? "default" : "random";
      if (progress) {
        *progress << fmt::format("{} row {}/{} ({}, {})\n", prefix, rows.size() + 1, total, params,
                                 dt);
        progress->flush();
      }
      VerifyRow r = dt == "f32" ? run_one<float>(spec, s.m, *pv, o, s.pos, s.q, s.k, s.qn, s.kn)
                                : run_one<double>(spec, s.m, *pv, o, s.pos, s.q, s.k, s.qn, s.kn);
      r.params = params;
      rows.push_back(std::move(r));
    }
  return rows;
}

// A run estimated above this many seconds reports progress.
constexpr double kProgressSeconds = 3.0;

}  // namespace

VerifyCost estimate_verify_cost(const std::vector<std::string>& specs, const VerifyOptions& o,
                                const std::vector<std::string>& dtypes) {
  VerifyCost c;
  for (const auto& s : specs) {
    const SpecCost sc = spec_cost(s, o, dtypes.size());
    c.seconds += sc.seconds;
    c.bytes = std::max(c.bytes, sc.bytes);
    c.pairs += sc.pairs;
    c.spec_seconds.push_back(sc.seconds);
  }
  return c;
}

void check_verify_budget(const VerifyCost& c) {
  if (c.seconds > kVerifyBudgetSeconds)
    throw InputError(fmt::format(
        "verify: the run would take about {:.0f} s on one core ({} scored position pairs over "
        "specs x parameter sets x dtypes x heads, each O(head_dim x order)), above the limit of "
        "{:g} s; lower --positions, --heads, --head-dim or the number of --enc specs",
        c.seconds, c.pairs, kVerifyBudgetSeconds));
  if (c.bytes > kVerifyBudgetBytes)
    throw InputError(fmt::format(
        "verify: the run would need about {:.1f} GiB of buffers (heads x positions x head_dim), "
        "above the limit of {:g} GiB; lower --positions, --heads or --head-dim",
        c.bytes / (1u << 30), kVerifyBudgetBytes / (1u << 30)));
}

std::vector<VerifyRow> verify_spec(const std::string& spec, const VerifyOptions& o,
                                   const std::vector<std::string>& dtypes) {
  return verify_specs({spec}, o, dtypes);
}

std::vector<VerifyRow> verify_specs(const std::vector<std::string>& specs, const VerifyOptions& o,
                                    const std::vector<std::string>& dtypes,
                                    std::ostream* progress) {
  const VerifyCost cost = estimate_verify_cost(specs, o, dtypes);
  check_verify_budget(cost);
  if (cost.seconds <= kProgressSeconds) progress = nullptr;
  if (progress)
    *progress << fmt::format("verify: {} spec(s), estimated {:.0f} s\n", specs.size(),
                             cost.seconds);
  std::vector<VerifyRow> rows;
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string prefix = fmt::format("verify: spec {}/{} {}", i + 1, specs.size(), specs[i]);
    if (progress) {
      *progress << fmt::format("{} (~{:.1f} s)\n", prefix, cost.spec_seconds[i]);
      progress->flush();
    }
    // row lines only where one spec alone takes a while
    std::ostream* row_progress = cost.spec_seconds[i] > kProgressSeconds ? progress : nullptr;
    for (auto& r : verify_one(specs[i], make_sample(specs[i], o), o, dtypes, row_progress, prefix))
      rows.push_back(std::move(r));
  }
  return rows;
}

std::vector<VerifyRow> verify_mechanism(const Mechanism& m, const std::string& label,
                                        const VerifyOptions& o,
                                        const std::vector<std::string>& dtypes) {
  const SpecCost sc = mechanism_cost(m, o, dtypes.size());
  VerifyCost cost;
  cost.seconds = sc.seconds;
  cost.bytes = sc.bytes;
  cost.pairs = sc.pairs;
  check_verify_budget(cost);
  return verify_one(label, make_sample(m, o), o, dtypes, nullptr, "");
}

double wrong_contragredient_residual(const std::string& spec, const VerifyOptions& o) {
  Sample s = make_sample(spec, o);
  const ParamValues pv = random_params(s.m, s.rng);
  const double c = s.m.window_center(s.pos.front(), s.pos.back());
  const Transformed a = scaled(
      apply<double>(s.m, pv, o.layout, s.pos, c, s.q, s.k, /*wrong_query=*/true), s.m.head_dim);
  return score_pairs(s.m, pv, o.layout, s.pos, s.q, s.k, s.qn, s.kn, a, nullptr,
                     std::numeric_limits<double>::max())
      .rel;
}

nlohmann::json to_json(const diag::VerifyRow& r) {
  return {
      {"spec", r.spec},
      {"canonical", r.canonical},
      {"head_dim", r.head_dim},
      {"declared", r.declared},
      {"transform_exact", r.transform_exact},
      {"params", r.params},
      {"dtype", r.dtype},
      {"center", r.center},
      {"relative_residual", r.residual},
      {"relative_residual_qk_norm", r.residual_qk},
      {"shift_residual", r.shift_residual},
      {"key_growth_centered", r.key_growth},
      {"query_growth_centered", r.query_growth},
      {"key_growth_uncentered", r.key_growth_uncentered},
      {"query_growth_uncentered", r.query_growth_uncentered},
      {"clamp_bound_centered", r.clamp_bound},
      {"clamp_bound_uncentered", r.clamp_bound_uncentered},
      {"clamp_bound_shifted", r.clamp_bound_shifted},
      {"alibi_lift_residual",
       r.alibi_lift_residual < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.alibi_lift_residual)},
      {"status", r.status},
      {"reason", r.reason}};
}

}  // namespace relpos::diag
