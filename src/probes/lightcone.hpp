// PJ-RoPE Phase F: light-cone stability and resolution probes (pj-rope.md 3.7; paper Table 5 and
// Fig. 6), no LibTorch. One coordinate family (raw, scaled, clipped, log, lc_amp_only,
// lc_phase_only, lc, lc_wrong_scale) with jet amplitudes A_r(d) = env(d) a(d)^r (/ r!) and phase
// psi(d); four probes over it: coordinate stability against T, the quantised key cache, untrained
// self-retrieval and the trained hard-negative pairwise classifier (a tiny MLP with manual
// backprop and torch-style AdamW).
//
// Arithmetic. The reference's Phase F scripts default to float32 (`--float64` switches; pj-rope.md
// 3 and 5.2), and several deterministic cells depend on it (phases near T = 32768 carry ~2e-4 rad
// of float32 rounding, which decides near-ties in retrieval and the wrapped-phase collisions).
// Every probe therefore takes a Dtype (default F32, the reference protocol; F64 is its --float64
// run) and is one implementation templated on the scalar type: the tensors the reference holds in
// its dtype (coordinates, `omega * psi` rounded to that type before cos/sin, features,
// quantisation, row normalisation, cosine scores, standardisation) are computed in it. Reductions
// over T (sums, means, norms over lags) accumulate in double and are rounded to the scalar type:
// torch's float32 sums are cascade sums accurate to a few ulps, which a plain float loop over 32768
// terms is not.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace relpos::probes::lc {

// The scalar type of a probe run: F32 (the reference's default) or F64 (its --float64).
enum class Dtype { F32, F64 };
std::string to_string(Dtype d);  // "f32", "f64"

template <class Real>
using Mat = Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic>;

enum class Variant { Raw, Scaled, Clipped, Log, LcAmpOnly, LcPhaseOnly, Lc, LcWrongScale };

// The reference's default --variants order (it also feeds the trained probe's seeds).
const std::vector<Variant>& all_variants();
std::string to_string(Variant v);
Variant parse_variant(const std::string& name);  // InputError naming the valid ones
int variant_index(Variant v);                    // position in all_variants()

struct Coords {
  double L = 1024.0;
  double damping = 0.1;  // the scaled variant's envelope e^{-c d/L}
  int R = 3;             // highest jet order
};

// The coordinates in the scalar type Real (float or double; L and the damping rounded to Real):
// every operation rounds to Real, as the reference's tensors of that dtype do.
template <class Real>
Real amplitude_coordinate(Variant v, Real d, const Coords& c);  // a(d)
template <class Real>
Real phase_coordinate(Variant v, Real d, const Coords& c);  // psi(d)
template <class Real>
Real envelope(Variant v, Real d, const Coords& c);  // env(d)
bool uses_factorial(Variant v);                     // 1/r! (FJ-style)
// A_r(d) = env(d) a(d)^r / (r! if FJ-style), r = 0..R; a^r by repeated multiplication in Real
// (torch's integer-exponent pow for r <= 3).
template <class Real>
Real jet_amplitude(Variant v, int r, Real d, const Coords& c);

// omega = 2 pi cycles / L (in double; the probes round it to their scalar type)
double omega_of_cycles(double cycles, double L);
// Rows: one per lag; columns: for each omega of the grid, for r = 0..R: [A_r cos(omega psi),
// A_r sin(omega psi)]. With the default grid (5, 17, 61 cycles over L) and R = 3: 24 columns.
// Computed in Real: the lag, A_r and psi in Real, omega rounded to Real, the phase `omega * psi`
// rounded to Real before cos/sin (pj-rope.md 5.2: about 2e-4 rad of float32 error at d = 32k).
template <class Real>
Mat<Real> position_features_as(Variant v, const std::vector<double>& lags, const Coords& c,
                               const std::vector<double>& cycles = {5.0, 17.0, 61.0});
// position_features_as in the run's dtype, returned as double (exact for float).
Eigen::MatrixXd position_features(Variant v, const std::vector<double>& lags, const Coords& c,
                                  const std::vector<double>& cycles = {5.0, 17.0, 61.0},
                                  Dtype dtype = Dtype::F32);

// ---------------------------------------------------------------------------------------------
// Quantisation and small numerics, exposed for the tests.

// The quantisation helpers compute in the matrix's scalar type (float or double), as torch does
// in the tensor's dtype.
template <class Real>
Real round_half_even(Real x);
int quant_qmax(int bits);  // 2^(b-1) - 1: 127 (int8), 7 (int4); bits in [2, 16]
// Symmetric quantisation: scale = amax / qmax, q = clamp(round_half_even(x / scale), -qmax, qmax)
// * scale; amax == 0 maps to zeros.
template <class Real>
Real quantize_value(Real x, Real scale, int qmax);
// Whole-tensor (one amax) or per-column (column amax) symmetric quantisation.
template <class Real>
Mat<Real> quantize_tensor(const Mat<Real>& x, int bits);
template <class Real>
Mat<Real> quantize_columns(const Mat<Real>& x, int bits);
// ||q - x|| / ||x||: differences in Real, sums of squares accumulated in double, rounded to Real
template <class Real>
Real relative_error(const Mat<Real>& q, const Mat<Real>& x);
// round_half_even(linspace(lo, hi, n)), unique, ascending
std::vector<int> rounded_linspace(int lo, int hi, int n);
double lower_median(std::vector<double> v);  // torch.median: the lower middle value; NaN if empty
// Index of the largest entry; ties go to the first (smallest) index.
template <class Real>
Eigen::Index first_argmax(const Eigen::Matrix<Real, Eigen::Dynamic, 1>& s);

// ---------------------------------------------------------------------------------------------
// phase_f_stability

struct StabilityOptions {
  Coords coords;
  double cycles = 17.0;  // the single frequency (omega = 0.104311 at L = 1024)
  double bias_scale = 1.0;
  int far_samples = 4096;
  double collision_threshold = 1e-3;
  Dtype dtype = Dtype::F32;  // the reference's default
};

struct StabilityRow {
  Variant variant = Variant::Raw;
  int T = 0;
  double qk_proxy_final = 0, qk_proxy_max = 0, qk_proxy_mean = 0;
  double bias_abs_max = 0, bias_rms = 0, weighted_logit_std = 0;
  double softmax_entropy = 0, softmax_support = 0, softmax_avg_distance = 0;
  double int8_error_tensor = 0, int8_error_per_order = 0, int4_error_tensor = 0,
         int4_error_per_order = 0;
  double phase_ratio_final = 0, phase_ratio_far_mean = 0, far_phase_span = 0;
  double far_local_collision_rate = 0, wrapped_collision_rate = 0, wrapped_gap_median = 0;
  double far_gram_condition = 0;
  int far_sample_count = 0;
  long nonfinite_count = 0;
};

// Choices where pj-rope.md 3.7 is silent: the weighted logit std is the population std with weights
// T - d; the softmax is over d = 0..T-1; the wrapped nearest gap is each sampled phase's circular
// nearest-neighbour gap, its median the lower middle value; the far Gram condition number is
// cond(X^T X) = cond(X)^2 of the far design standardised with the unbiased std (clamped at 1e-12),
// its SVD in the run's scalar type. In F32 every tensor (amplitudes, psi, K, the quantised matrix,
// the wrapped phases `(omega psi) mod 2 pi` and their gaps, the far design) is float: e.g. the
// last-lag LC increment is the float32 difference 0.03125 the reference exports (pj-rope.md 5.3).
StabilityRow phase_f_stability(Variant v, int T, const StabilityOptions& o = {});

// Named metrics of a row (name, value), in the order of pj-rope.md 3.7.
std::vector<std::pair<std::string, double>> stability_metrics(const StabilityRow& r);

// ---------------------------------------------------------------------------------------------
// phase_f_cache_quantization

struct CacheOptions {
  Coords coords;
  std::vector<double> cycles{5.0, 17.0, 61.0};
  int cache_dim = 128;
  uint64_t seed = 0;
  Dtype dtype = Dtype::F32;  // features, mixes and keys; the logits are always float64
};

struct CacheRow {
  Variant variant = Variant::Raw;
  int T = 0;
  double logit_std = 0;  // unbiased std of s_j = keys_j . q / sqrt(dim) over j = 0..T-1
  double key_norm_final = 0, key_norm_max = 0, key_norm_mean = 0, key_norm_far_mean = 0;
  double cache_abs_max = 0, logit_abs_max = 0;
  // [bits 8, 4] x [per tensor, per channel]
  double cache_error[2][2] = {}, cache_error_far[2][2] = {}, logit_error[2][2] = {};
  long nonfinite_count = 0;
};

// The random mixes key_mix, query_mix ([features, dim], N(0, 1) / sqrt(features)) are drawn in
// that order, row-major, from std::mt19937_64(seed) through a Box-Muller transform of 53-bit
// uniforms: not torch's generator stream (which cannot and need not be reproduced).
Eigen::MatrixXd gaussian_matrix(int rows, int cols, double scale, std::mt19937_64& gen);
// The features, the mixes (rounded to the dtype), the keys and the query are in the run's dtype;
// the logits s_j = keys_j . q / sqrt(dim) are computed in float64, as in the reference (pj-rope.md
// 3.7 and 5.2: raw and lc_phase_only logits reach ~1e24, whose squares overflow float32), and so
// are the logits of the quantised keys. Key norms and cache errors are in the dtype.
CacheRow phase_f_cache_quantization(Variant v, int T, const CacheOptions& o = {});

// ---------------------------------------------------------------------------------------------
// Buckets shared by the retrieval and trained probes

struct Bucket {
  std::string name;
  int lo = 0, hi = 0;  // inclusive lag range, clipped at T - 1
};
// train [1, L-1], x1_4 [L, 4L-1], x4_16 [4L, 16L-1], x16_32 [16L, 32L-1]; empty ones dropped.
std::vector<Bucket> lag_buckets(int T, int L);

enum class Quant { Fp32, Int8, Int4 };
const std::vector<Quant>& all_quants();  // the --precisions order (feeds the trained seeds)
std::string to_string(Quant q);
// fp32: each entry cast to float (and back to Real: the identity in the float32 protocol; in the
// float64 one the features are rounded to float and scored in double, the spec not saying whether
// the reference scores that column in float32); int8/int4: per-column symmetric quantisation in
// Real.
template <class Real>
Mat<Real> apply_precision(const Mat<Real>& f, Quant q);

// ---------------------------------------------------------------------------------------------
// phase_f_retrieval_resolution (deterministic)

struct RetrievalOptions {
  Coords coords;
  std::vector<double> cycles{5.0, 17.0, 61.0};
  int queries = 128;
  double tie_eps = 1e-6;
  Dtype dtype = Dtype::F32;  // the reference's default
};

struct RetrievalRow {
  Variant variant = Variant::Raw;
  Quant precision = Quant::Fp32;
  std::string bucket;
  int queries = 0;
  double top1 = 0, within1 = 0, within8 = 0, within64 = 0, bucket_accuracy = 0;
  double mean_abs_error = 0, median_abs_error = 0, mean_margin = 0, mean_tie_count = 0;
};

// Candidates: lags 1..T-1 (per-column quantisation scales over all of them). Features,
// quantisation, L2 normalisation and the cosine scores are in the run's dtype (pj-rope.md 3.7: "a
// float32 cast", the script's default dtype), so in F32 near-ties (aliased lags whose cosines
// differ below a float ulp) are decided by float32 rounding, as in the reference. Queries:
// round_half_even(linspace(lo, hi, 128)), unique. One row per bucket.
std::vector<RetrievalRow> phase_f_retrieval_resolution(Variant v, int T, Quant q,
                                                       const RetrievalOptions& o = {});
// Self-retrieval over unit rows (already quantised and normalised); target indices into rows.
// Scores, the margin and the tie test `score >= target - eps` are in the rows' scalar type (eps
// rounded to it).
struct RetrievalScore {
  Eigen::Index prediction = 0;
  double margin = 0;  // target score - best non-target score
  int ties = 0;       // candidates with score >= target score - eps (the target included)
};
template <class Real>
RetrievalScore retrieve(const Mat<Real>& unit_rows, Eigen::Index target, double tie_eps);

// ---------------------------------------------------------------------------------------------
// The pairwise classifier: MLP in -> h -> GELU -> h -> GELU -> 1 (float64, manual backprop)

double gelu(double x);       // exact: x Phi(x), Phi through erf
double gelu_grad(double x);  // Phi(x) + x phi(x)

struct Mlp {
  // Linear layers as torch stores them: W [out, in], b [out]
  Eigen::MatrixXd W1, W2, W3;
  Eigen::VectorXd b1, b2, b3;
  // torch.nn.Linear's default initialisation: kaiming_uniform(a = sqrt(5)) weights and
  // U(-1/sqrt(fan_in), 1/sqrt(fan_in)) biases, i.e. both U(+-1/sqrt(fan_in)), drawn in layer
  // order (W1, b1, W2, b2, W3, b3) from std::mt19937_64(seed) (not torch's stream).
  static Mlp init(int in, int hidden, uint64_t seed);
  int parameter_count() const;
  std::vector<double> flatten() const;
  void assign(const std::vector<double>& p);
};

// Logits for the rows of x ([n, in]).
Eigen::VectorXd mlp_forward(const Mlp& m, const Eigen::MatrixXd& x);
// Mean over rows of w_i * BCE-with-logits(logit_i, y_i) / sum(w) and its gradient (same layout as
// Mlp::flatten). Row weights let a repeated row be evaluated once.
double mlp_bce_loss_grad(const Mlp& m, const Eigen::MatrixXd& x, const Eigen::VectorXd& y,
                         const Eigen::VectorXd& w, Mlp* grad);

// torch.optim.AdamW: p -= lr wd p; m, v moments; p -= lr mhat / (sqrt(vhat) + eps), with
// bias corrections 1 - beta^t.
struct AdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  std::vector<double> m, v;
  long step_count = 0;
  void step(std::vector<double>& params, const std::vector<double>& grad);
};

// ---------------------------------------------------------------------------------------------
// phase_f_trained_resolution

struct TrainedOptions {
  Coords coords;
  std::vector<double> cycles{5.0, 17.0, 61.0};
  int hidden = 96, steps = 320, batch = 512;  // half positives, half negatives
  double lr = 1e-3, weight_decay = 0.01;
  int queries = 96;
  uint64_t seed = 0;         // run seed = seed + 1009 variant_index + 9176 precision_index
  Dtype dtype = Dtype::F32;  // the features and their standardisation
};

struct TrainedRow {
  Variant variant = Variant::Raw;
  Quant precision = Quant::Fp32;
  std::string bucket;
  int queries = 0;
  double final_loss = 0;
  double pos_accept = 0, random_negative_accept = 0, hard_negative_accept = 0;
  double hard_pair_accuracy = 0;  // 0.5 (pos_accept + 1 - hard_negative_accept)
  double hard_gap_mean = 0, hard_gap_median = 0, hard_feature_distance_mean = 0;
};

// Features of lags 1..T-1 quantised per column (scales over all of them), standardised with the
// mean and unbiased std (clamped at 1e-6) of the train window 1..L-1, all in the run's dtype; the
// MLP (its streams are ours anyway) and the nearest-neighbour search then run in float64 on those
// standardised features (exact casts). Each step: batch/2 random
// distinct train-window pairs (negatives) and batch/2 zero rows (positives, evaluated once with
// weight batch/2: the same loss and gradient). Batches come from std::mt19937_64(run seed xor
// 0x9e3779b97f4a7c15). The random negative of query k is the lag (37k + 1) mod span past the
// target inside the bucket (1 when that is 0).
std::vector<TrainedRow> phase_f_trained_resolution(Variant v, int T, Quant q,
                                                   const TrainedOptions& o = {});

}  // namespace relpos::probes::lc
