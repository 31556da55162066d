// Probe suites: the basis-level experiments of Jordan-RoPE (Tables 3, 4, 11, 6, 16) and PJ-RoPE
// (fixed-kernel recovery, GRAPE appendix Table 9), as lists of result cells with the paper's value
// and the spec's float64 re-derivation beside ours.
#pragma once

#include <string>
#include <vector>

namespace relpos::probes {

enum class Precision { F64, F32 };
std::string to_string(Precision p);

struct ProbeCell {
  std::string suite, table, target, method, metric;
  double ours = 0.0;
  std::string paper;         // the paper's value as printed ("" when it has none)
  std::string paper_method;  // winner cells: the paper's winner
  std::string reference;     // jordan-rope.md 6.2 float64 re-derivation as printed ("" none)
  std::string dtype;
  double cond = -1.0;    // condition number of the solve (-1: not applicable)
  std::string row, col;  // display labels for the paper-shaped table
  std::string check;     // "", "pass" or "FAIL" (sector containment checks)
};

// Target and best fit of each method family over the evaluation lags d = 0..n-1.
struct ProbeCurve {
  std::string table, target, family, method;  // family "target" holds the target itself
  std::vector<double> y;
  std::vector<double> x;  // abscissae (e.g. T); empty: the lags 0..n-1
};

struct SuiteResult {
  std::string suite;
  std::vector<ProbeCell> cells;
  std::vector<ProbeCurve> curves;  // filled only when asked for
};

// jordan-t3, jordan-t11 (Tables 11 and 4), jordan-t6, jordan-t16, pj-fixed, pj-grape-t9: the
// suites of `--suite all` (pinned by tests/golden.sh).
std::vector<std::string> probe_suite_names();
// Suites run only by name, outside `all`: pj-t3-adaptive (PJ-RoPE Table 3, adaptive sector
// recovery: trained kernels, float64 only; probes/pj_adaptive.hpp) and pj-t5 (PJ-RoPE Table 5,
// the Phase F light-cone stability and resolution probes; probes/lightcone.hpp): F32 is the
// reference's float32 protocol, F64 its --float64 run (callers default pj-t5 to F32, see
// default_precision).
std::vector<std::string> extra_probe_suite_names();
// The precision a suite runs in when none is asked for: F32 for pj-t5 (the reference's Phase F
// scripts default to float32), F64 for every other suite (the papers' re-derivations are float64).
Precision default_precision(const std::string& suite);
// Throws InputError for an unknown suite, listing the valid ones ("all" is resolved by callers).
SuiteResult run_probe_suite(const std::string& suite, Precision precision, bool keep_curves);

// Number formatting / agreement rules used by the tables and docs.
// Formats x with the digits of `like` (e.g. "0.054" -> 3 decimals, "8.14e-3" -> 2 in scientific);
// without `like`, 4 significant digits.
std::string format_like(double x, const std::string& like);
// x rounds to the printed value (to the printed digits).
bool matches_printed(double x, const std::string& printed);
// Paper tolerance of issue 3: within 0.002 absolute or 1% relative.
bool within_paper_tolerance(double x, const std::string& printed);

}  // namespace relpos::probes
