// A mechanism as plain data: which Jordan-block segments act on which complex coordinates of a
// head, which additive biases are added to the logits, and how parameters are initialised. Built
// from a spec string by the registry (core/registry.hpp); consumed by kernels, diagnostics and the
// torch modules. Every transform in the first three papers' baselines (RoPE, damped RoPE, Jordan
// blocks of any order, real unipotent blocks, jet gates and spectra, direct sums) is a list of
// segments.
#pragma once

#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/types.hpp"

namespace relpos {

// How the factorization centre c0 is chosen: scores use A(i-c0)^{-1} A(j-c0) (Jordan-RoPE App. A).
// The centre must be the same for every call whose keys and queries are scored together (a
// prefill and its decode steps): only None and Fixed guarantee that.
enum class CenterMode {
  None,   // c0 = 0: the reference repository's convention
  Mid,    // c0 = middle of the position window of each call (one-shot use only)
  Fixed,  // c0 = a given value; center=auto gives floor(L/2) for exact damped maps
};

// One family of order-m Jordan blocks over `blocks` consecutive groups of m complex coordinates.
// Block b (global index first_block + b) has frequency omega[b]; its parameters gamma, eta (or
// gates and alpha0) are per head and per block. Relative operator of one block (complex form):
//   G(d) = e^{(-gamma + i omega) d} * U(d),  U(d) = sum_r c_r(s sigma(d)) N^r,
// keys get G(-p), queries get G(-p)^{-T} (Jordan-RoPE Proposition 1).
struct JordanSegment {
  int first_pair = 0;   // complex coordinate where the segment starts
  int first_block = 0;  // global block index (column of the per-block parameter arrays)
  int blocks = 0;
  int order = 1;
  std::vector<double> omega;  // per block
  Chart chart = Chart::Raw;
  double L = 1024.0;         // chart scale
  double shear_scale = 1.0;  // s: 1 for raw / stabilized, 1/L for scaled-exact and jet gates
  ShearMode shear = ShearMode::None;
  bool damped = false;         // gamma present (false: gamma == 0)
  double max_exponent = 30.0;  // |gamma p| clamp before exp (reference: 30)

  // Parameterisation (used by the torch modules and by verify's random draws).
  double gamma_init = 0.0, gamma_min = 0.0;
  double gamma_random_max = 0.0;  // verify draws gamma in [gamma_min, gamma_random_max]
  bool learn_gamma = false;
  double eta_init = 0.0, eta_max = 0.1;
  bool learn_eta = false;
  std::vector<double> gate_init;  // order-1 jet gates g_1..g_{m-1}
  double gate_max = 1.0;
  bool learn_gates = false;
  double alpha0_init = 1.0;
  bool learn_alpha0 = false;
  bool spectrum_softmax = false;  // (alpha_0..alpha_{m-1}) = softmax(logits): learned simplex

  int pairs() const { return blocks * order; }
  // Exact one-parameter representation (group law holds, score is a pure lag function)?
  bool exact() const;
};

struct AlibiBias {
  std::vector<double> slopes;  // per head; bias(h, i, j) = -slope_h * (i - j)
};

struct Mechanism {
  std::string spec;  // canonical spec string (all options spelled out)
  std::string name;  // first term's name
  int head_dim = 0;
  int heads = 0;
  std::vector<JordanSegment> segments;  // complex coordinates not covered are left untouched
  std::optional<AlibiBias> alibi;
  CenterMode center = CenterMode::None;
  double center_value = 0.0;
  bool center_auto = false;  // the spec left center=auto

  int total_blocks() const;
  int gate_rows() const;  // max order - 1 over gate segments (rows of the gates array)
  bool transform_exact() const;
  bool has_transform() const { return !segments.empty(); }
  // "exact", "approximate", "augmented exact" (bias-only ALiBi), ...
  std::string exactness() const;
  // Centre for a call whose positions span [pmin, pmax].
  double resolve_center(double pmin, double pmax) const;
  // Centre for a diagnostic that scores one window [pmin, pmax] on its own (verify): the window's
  // middle when the spec left center=auto on an exact map (one window is consistent with itself,
  // and the middle keeps |gamma (p - c0)| smallest), else resolve_center.
  double window_center(double pmin, double pmax) const;
};

// Concrete parameter values of one layer, float64. Layout shared with kernels and torch modules:
// gamma/eta/alpha0[h * NB + block], gates[(k-1) * H * NB + h * NB + block] for k = 1..gate_rows.
struct ParamValues {
  int heads = 0, blocks = 0, gate_rows = 0;
  std::vector<double> gamma, eta, gates, alpha0;
};

ParamValues default_params(const Mechanism& m);
// Random draw inside the documented ranges (gamma in [gamma_min, gamma_random_max],
// eta in [-eta_max, eta_max], gates in [-gate_max, gate_max], spectra on the simplex).
ParamValues random_params(const Mechanism& m, std::mt19937_64& rng);

// Nilpotent coefficient series of a block at chart argument u = s * sigma(t):
// c_0..c_{m-1} (key, primal) and the power-series inverse ic_0..ic_{m-1} (query, contragredient).
void shear_coefficients(ShearMode mode, int order, double eta, const double* gates,
                        size_t gate_stride, double alpha0, double u, double* c);
void inverse_series(int order, const double* c, double* ic);

// Primitive lag feature of one block and jet order r at lag d (both real components):
//   e^{-gamma d} * coef_r(d) * (cos omega d, sin omega d), coef_r the U(d) coefficient of N^r.
// With eta = 1 (exponential mode) this is the paper's basis (s sigma(d))^r / r! e^{-gamma d} e^{i w
// d}.
struct LagFeature {
  std::string name;
  double value;
};
// Features at lag d with |gamma d| clamped at each segment's max_exp, as the kernels clamp.
std::vector<LagFeature> lag_features(const Mechanism& m, const ParamValues& p, int head, double d);

// max over damped segments (and heads, or one head when head >= 0) of |gamma| * t / max_exp:
// above 1 the exponent clamp binds at distance t from the centre.
double clamp_ratio(const Mechanism& m, const ParamValues& p, double t, int head = -1);

}  // namespace relpos
