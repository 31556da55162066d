// A mechanism as plain data: its transform terms (which map acts on queries, keys, values and
// outputs, driven by which "time"), its additive bias terms, and the schema of its parameters.
// Built from a spec string by the registry (core/registry.hpp, one file per family under
// core/mechanisms/); consumed by kernels, diagnostics and the torch modules. Every transform in the
// first three papers' baselines (RoPE, damped RoPE, Jordan blocks of any order, real unipotent
// blocks, jet gates and spectra, direct sums) is a Jordan-block term, a list of
// segments.
#pragma once

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/lag_kernel.hpp"
#include "core/rope_scaling.hpp"
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
  FrequencyGrid grid;         // |omega_b| = theta^(-2b/dim) as built (core/rope_scaling.hpp)
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

// ---------------------------------------------------------------------------------------------
// The mechanism model (DESIGN.md section 1): transform terms (T), bias terms (B), and the schema of
// the learnable parameters. Kernels, verify, the references and the torch layer read only this.

// What drives a transform's "time": integer/real positions, a scanned content phase
// Phi_t = sum_{s<t} w_s (GRAPE-M contextual, JoFormer per-token angles), or a vector position
// r in R^{d_c} (structured rotations: TransformKind::Structured, a call's positions [T, d_c]).
enum class TimeSource { Position, ContentPhase, VectorPosition };

// Which tensors a transform acts on: queries get A^{-T}, keys A, values A (journey transforms)
// and outputs A^{-1}. Queries and keys always come together.
struct Roles {
  bool values = false, outputs = false;
  std::string str() const;
};

// How a ContentPhase term accumulates per-token increments a_s into its phase (kernels/scan.hpp):
// the papers' causal exclusive sum, or the JoFormer reference code's time-reversed inclusive sum
// (which reads later tokens: kept to reproduce that code, and documented as a causality leak).
enum class PhaseScan { Exclusive, ReversedInclusive };

enum class TransformKind {
  JordanBlocks,  // block-diagonal Jordan family over `segments` (RoPE ... jet spectra)
  FixedLinear,   // a constant D x D map M (no position): keys get M, queries M^{-T}
  // R(r) = U [ (+)_u R_2(theta_u(r)) ] U^T, theta_u(r) = sum_k lambda_{k,u} r_k, for vector
  // positions r in R^{d_c} (core/structured.hpp); keys and queries both get R(r) (orthogonal).
  // U = I on the pair layout's planes at init; a learned U = E P_layout (E = cayley / exp).
  Structured,
};

// One position-wise map. Several compose in spec order: k~ = A_n ... A_1 k. At most one term may
// be driven by a time source (two position-driven maps do not compose into a relative map in
// general); fixed linear maps around it conjugate its relative operator.
struct TransformTerm {
  std::string name;  // the spec term it came from
  TransformKind kind = TransformKind::JordanBlocks;
  TimeSource time = TimeSource::Position;
  Roles roles;
  std::vector<JordanSegment> segments;    // JordanBlocks: coordinates not covered stay untouched
  std::vector<double> matrix;             // FixedLinear: M, row-major D x D
  std::vector<double> matrix_inv_t;       // FixedLinear: M^{-T}, row-major
  PhaseScan scan = PhaseScan::Exclusive;  // ContentPhase: how the phase is accumulated
  // GRAPE-M: a rotation whose per-plane frequencies are learned by the model (log-frequencies
  // lambda, theta_m = exp(lambda_m / frequency_scale), initialised at the segments' omega); the
  // model passes the frames (torch/grape.hpp), the segments give the initial (RoPE) frames
  bool learned_frequencies = false;
  double frequency_scale = 1.0;
  // GRAPE-M's learned commuting basis (Alg. 1): "none", or E = "cayley" / "exp" of a learned skew
  // matrix (q, k -> E R E^T q, k; E = I at init)
  // Structured: "axial" (fixed lambda), "mixed" (learned lambda), "cayley" / "exp" (learned
  // lambda and a learned basis E of that map)
  std::string basis = "none";
  // Structured: d_c, the planes M (= D/2: every pair turns), and the initial lambda per head
  // [H, d_c, M] row-major (axial: the RoPE spectrum per axis group; otherwise RoPE-Mixed's axial
  // magnitudes along a seeded random direction per head and plane)
  int vector_dims = 0;
  int planes = 0;
  std::vector<double> plane_freqs;

  bool position_driven() const { return kind == TransformKind::JordanBlocks; }
  bool vector_positions() const { return kind == TransformKind::Structured; }
  bool exact() const;             // a group law holds (fixed maps: always)
  bool orthogonal_fixed() const;  // FixedLinear with M^{-T} == M
};

// Additive logit biases, computed by the attention kernel from O(T) state (DESIGN.md 1 (B)).
enum class BiasShape {
  LagTable,      // b_h(i - j): one table per head (slope form: b_h(d) = -slope_h d)
  Separable,     // c_h(i) - c_h(j) from per-token scalars (FoX)
  PathIntegral,  // sum_{l=j+1..i} psi_h(i, l) (GRAPE-AP)
  GatedSlope,    // -(i - j) (g_h(i) + g_h(j)) from per-token gates (GRAPE-A)
};
struct BiasTerm {
  std::string name;
  BiasShape shape = BiasShape::LagTable;
  std::vector<double> slopes;  // LagTable in slope form (ALiBi): per head
  // augmented exact: realised by the unipotent lift [[1, t], [0, 1]] (verify checks it)
  bool unipotent_lift = false;
  // LagTable learned from parameters (core/lag_kernel.hpp: PJ-RoPE, T5 buckets, KERPLE, ...):
  // the kernel gets the table built from them for the call's lags. Shared and immutable, so a
  // Mechanism stays a copyable value.
  std::shared_ptr<const LagKernel> learned;
  // Content-dependent biases (GRAPE: Separable, PathIntegral, GatedSlope): their per-token
  // scalars or probes come from the token representations, so a model computes them
  // (torch/grape.hpp); `slopes` holds the per-head ALiBi slopes they scale. gate: "k", "q" or
  // "qk" (GatedSlope); paper_form: the paper's parameterisation instead of the reference code's;
  // probe_dim: P (PathIntegral).
  std::string gate = {};
  bool paper_form = false;
  int probe_dim = 0;
  bool content_dependent() const { return shape != BiasShape::LagTable; }
};

// The learnable (or fixed) parameters of a mechanism, declared once here and built by the
// registry: the torch module creates its tensors from this list, verify draws random values in
// the same ranges. Values are per head and per block of the Jordan term ([H, NB]; gates
// [rows, H, NB]; a learned spectrum [m, H, NB] whose row 0 is alpha_0 and rows 1.. the gates).
enum class BlockParam { Gamma, Eta, Gates, Alpha0, Spectrum };
enum class Reparam {
  SoftplusFloor,   // value = softplus(raw) + floor[block]
  BoundedTanh,     // value = bound[block] * tanh(raw)
  SoftmaxSimplex,  // value = softmax(raw) over the first axis
};
struct ParamSpec {
  std::string name;  // "gamma", "eta", "gates", "alpha0", "spectrum"
  BlockParam slot = BlockParam::Gamma;
  std::vector<int64_t> shape;
  Reparam reparam = Reparam::SoftplusFloor;
  std::vector<double> bound;  // per block: the softplus floor or the tanh bound
  std::vector<bool> learn;    // per block: learnable (else fixed at its initial value)
  bool any_learnable() const;
};

struct Mechanism {
  std::string spec;  // canonical spec string (all options spelled out)
  std::string name;  // first term's name
  int head_dim = 0;
  int heads = 0;
  std::vector<TransformTerm> transforms;  // in the order they are applied
  std::vector<BiasTerm> biases;
  std::vector<ParamSpec> params;
  CenterMode center = CenterMode::None;
  double center_value = 0.0;
  bool center_auto = false;  // the spec left center=auto
  // context extension of the rotary frequencies, if any (core/rope_scaling.hpp)
  RopeScalingState rope_scaling;

  // The position-driven Jordan term's segments (empty when there is none).
  const std::vector<JordanSegment>& segments() const;
  const TransformTerm* position_term() const;
  const TransformTerm* structured_term() const;  // the vector-position rotation, if any
  const BiasTerm* slope_bias() const;            // the slope-form lag bias, if any
  const BiasTerm* learned_lag_bias() const;  // the learned lag table (BiasTerm::learned), if any
  const BiasTerm* content_bias() const;      // a content-dependent (GRAPE) bias, if any
  int total_blocks() const;
  int gate_rows() const;  // max order - 1 over gate segments (rows of the gates array)
  bool transform_exact() const;
  bool has_transform() const { return !transforms.empty(); }
  // "exact", "approximate", "augmented exact" (bias-only ALiBi), ...
  std::string exactness() const;
  // Centre for a call whose positions span [pmin, pmax].
  double resolve_center(double pmin, double pmax) const;
  // Centre for a diagnostic that scores one window [pmin, pmax] on its own (verify): the window's
  // middle when the spec left center=auto on an exact map (one window is consistent with itself,
  // and the middle keeps |gamma (p - c0)| smallest), else resolve_center.
  double window_center(double pmin, double pmax) const;
};

// The parameter schema of a mechanism's Jordan term (what the registry stores in `params`).
std::vector<ParamSpec> jordan_param_schema(const Mechanism& m);

// The per-head, per-block parameters of a Jordan-block term, declared once: float64 values here
// (ParamValues), pointers in the kernels (kernels::Params / ParamGrads), tensors in the torch layer
// (nn::KernelParams). Layout: gamma/eta/alpha0[h * NB + block], gates[(k-1) * H * NB + h * NB +
// block] for k = 1..gate_rows (a learned spectrum is alpha0 plus the gates).
template <class V>
struct BlockParamSet {
  V gamma{}, eta{}, gates{}, alpha0{};
  // f(name, member) for each of the four, in this order
  template <class F>
  void for_each(F&& f) {
    f("gamma", gamma);
    f("eta", eta);
    f("gates", gates);
    f("alpha0", alpha0);
  }
};

// Concrete parameter values of one layer, float64.
struct ParamValues : BlockParamSet<std::vector<double>> {
  ParamValues() = default;  // not an aggregate: GCC 12 misreads {} of a derived aggregate
  int heads = 0, blocks = 0, gate_rows = 0;
};

ParamValues default_params(const Mechanism& m);
// The values of one schema slot, row-major in its ParamSpec shape (a spectrum: alpha0 then gates).
std::vector<double> slot_values(const ParamValues& p, BlockParam slot);
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
// Why lag_features do not describe the scores of `m` (empty when they do), from its terms: a
// content-dependent bias (per-token scalars, gates or probes computed from the tokens), a
// transform driven by a content phase scanned from the tokens or by vector positions, or a
// learned lag table (its values are not among the primitive features). `relpos kernel` refuses
// such a mechanism by name rather than print a table without its terms.
std::string lag_features_refusal(const Mechanism& m);

// max over damped segments (and heads, or one head when head >= 0) of |gamma| * t / max_exp:
// above 1 the exponent clamp binds at distance t from the centre.
double clamp_ratio(const Mechanism& m, const ParamValues& p, double t, int head = -1);

}  // namespace relpos
