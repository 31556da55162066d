// `relpos verify`: numerical check of every mechanism's declared exactness against the float64
// closed form of the papers, through the fast kernels.
#pragma once

#include <cstdint>
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
  std::string declared;   // exact / approximate / augmented exact ...
  bool transform_exact = true;
  std::string params;  // "default" or "random"
  std::string dtype;   // "f64" or "f32"
  double center = 0;
  double residual = 0;        // max |q~.k~ - q^T G(i-j) k| / (|q~| |k~|)
  double residual_qk = 0;     // same, normalised by |q| |k|
  double shift_residual = 0;  // max |score(p + C) - score(p)| / (|q~| |k~|), fixed centre
  double key_growth = 0, query_growth = 0;                      // max |x~|/|x|, centred
  double key_growth_uncentered = 0, query_growth_uncentered = 0;  // c0 = 0
  bool clamp_bound = false;             // exponent clamp binds in the centred window
  bool clamp_bound_uncentered = false;  // ... with c0 = 0
  double alibi_lift_residual = -1;      // < 0: no ALiBi term
  std::string status;  // PASS, FAIL, CLAMPED (exact but clamp binds), APPROX, INFO (fp32)
};

std::vector<VerifyRow> verify_spec(const std::string& spec, const VerifyOptions& opt,
                                   const std::vector<std::string>& dtypes);

// Test hook: the same residual with a deliberately wrong query action (primal map on queries);
// verify must see a large residual for any non-orthogonal mechanism.
double wrong_contragredient_residual(const std::string& spec, const VerifyOptions& opt);

}  // namespace relpos::diag
