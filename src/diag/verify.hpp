// `relpos verify`: numerical check of every mechanism's declared exactness against the float64
// closed form of the papers, through the fast kernels.
//
// Every quantity is computed without overflow of its own (norms scaled by the largest entry, as
// BLAS nrm2 does; scores and residuals in units of the rows' largest entries), maxima propagate
// NaN, and a row never passes when one of its numbers is not finite, when the exponent clamp binds
// in a window it evaluates, or when the dtype cannot hold the mechanism's exponents. Each failing
// row names its reason.
#pragma once

#include <cmath>
#include <cstdint>
#include <iosfwd>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/mechanism.hpp"

namespace relpos::diag {

struct VerifyOptions {
  int64_t max_lag = 32768;  // positions are drawn in [0, max_lag]
  int head_dim = 64;
  bool auto_head_dim = true;  // if head_dim does not fit the mechanism, use the nearest that does
  int heads = 4;
  int positions = 80;  // sampled positions (all pairs i >= j are scored)
  uint64_t seed = 1;
  Layout layout = Layout::Interleaved;
  double shift = 1000.0;     // shift-invariance constant
  double exact_tol = 1e-12;  // fp64 bound for mechanisms declared exact
};

struct VerifyRow {
  std::string spec;       // as given
  std::string canonical;  // every option spelled out
  int head_dim = 0;
  std::string declared;  // exact / approximate / augmented exact ...
  bool transform_exact = true;
  std::string params;  // "default" or "random"
  std::string dtype;   // "f64" or "f32"
  double center = 0;
  double residual = 0;        // max |q~.k~ - q^T G(i-j) k| / (|q~| |k~|)
  double residual_qk = 0;     // same, normalised by |q| |k|
  double shift_residual = 0;  // max |score(p + C) - score(p)| / (|q~| |k~|), fixed centre
  double key_growth = 0, query_growth = 0;                        // max |x~|/|x|, centred
  double key_growth_uncentered = 0, query_growth_uncentered = 0;  // c0 = 0
  bool clamp_bound = false;             // exponent clamp binds in the centred window
  bool clamp_bound_uncentered = false;  // ... with c0 = 0 (reported, not judged: c0 = 0 is only
                                        // evaluated for the uncentred growth)
  bool clamp_bound_shifted = false;     // ... in the shift-test window [pmin + C, pmax + C], c0
  double alibi_lift_residual = -1;      // < 0: no ALiBi term
  // PASS, FAIL, CLAMPED (the exponent clamp binds in an evaluated window), APPROX, INFO (fp32).
  // FAIL: a non-finite quantity, a mechanism exponent the dtype cannot hold, or (exact, fp64) a
  // residual above exact_tol. FAIL and CLAMPED are failures.
  std::string status;
  std::string reason;  // why the row is FAIL / CLAMPED ("; "-separated); empty when clean
};

std::vector<VerifyRow> verify_spec(const std::string& spec, const VerifyOptions& opt,
                                   const std::vector<std::string>& dtypes);

// Work limits of one verify run (all specs together). The time model counts, per spec and row
// (parameter set x dtype) and head, every pair of sampled positions: two dot products of head_dim
// (centred and shifted scores) and the float64 closed-form score (per block: one exp and one
// sincos, per Jordan entry a few flops); plus three kernel applications per row. Its constants
// were measured on one core of the development machine (see verify.cpp).
inline constexpr double kVerifyBudgetSeconds = 60.0;
inline constexpr double kVerifyBudgetBytes = 4.0 * (1u << 30);  // peak buffers, 4 GiB

struct VerifyCost {
  double seconds = 0;  // estimated single-core run time
  double bytes = 0;    // estimated peak buffer memory of the largest spec
  int64_t pairs = 0;   // scored (head, i, j) pairs over all specs and rows
  std::vector<double> spec_seconds;
};
VerifyCost estimate_verify_cost(const std::vector<std::string>& specs, const VerifyOptions& opt,
                                const std::vector<std::string>& dtypes);
// Throws InputError naming the limit (and the estimate) when `cost` exceeds the budget.
void check_verify_budget(const VerifyCost& cost);

// All specs in order, after check_verify_budget; when the estimate exceeds a few seconds, progress
// lines "verify: spec i/N ..." go to `progress` (if not null).
std::vector<VerifyRow> verify_specs(const std::vector<std::string>& specs, const VerifyOptions& opt,
                                    const std::vector<std::string>& dtypes,
                                    std::ostream* progress = nullptr);

// The same checks on a mechanism built elsewhere (its own head_dim and heads; opt's head_dim and
// heads are not used). `label` fills VerifyRow::spec.
std::vector<VerifyRow> verify_mechanism(const Mechanism& m, const std::string& label,
                                        const VerifyOptions& opt,
                                        const std::vector<std::string>& dtypes);

// Test hook: the same residual with a deliberately wrong query action (primal map on queries);
// verify must see a large residual for any non-orthogonal mechanism.
double wrong_contragredient_residual(const std::string& spec, const VerifyOptions& opt);

// max that propagates NaN (std::max(acc, NaN) keeps acc and so drops it).
inline double max_nan(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return a < b ? b : a;
}

// Euclidean norm scaled by the largest |x_i| (BLAS nrm2): finite for every finite input short of
// sqrt(n) * max|x_i| overflowing; NaN if any entry is NaN, else inf if any entry is infinite.
template <class T>
double scaled_norm(const T* x, size_t n) {
  double mx = 0;
  for (size_t i = 0; i < n; ++i) mx = max_nan(mx, std::abs(static_cast<double>(x[i])));
  if (mx == 0 || !std::isfinite(mx)) return mx;
  double s = 0;
  for (size_t i = 0; i < n; ++i) {
    const double y = static_cast<double>(x[i]) / mx;
    s += y * y;
  }
  return mx * std::sqrt(s);
}

// One row as JSON (the CLI's --format json and the Python package's relpos.verify).
nlohmann::json to_json(const VerifyRow& r);

}  // namespace relpos::diag
