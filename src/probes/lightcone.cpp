#include "probes/lightcone.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "core/types.hpp"
#include "probes/pj_kernels.hpp"

namespace relpos::probes::lc {

namespace {

constexpr double kPi = std::numbers::pi;

// Uniform double in [0, 1) from the top 53 bits.
double uniform01(std::mt19937_64& gen) {
  return static_cast<double>(gen() >> 11) * 0x1.0p-53;
}
// Uniform index in [0, n) by a 64 x 64 -> 128-bit multiply (bias below 2^-40 for our n).
int uniform_index(std::mt19937_64& gen, int n) {
  const unsigned __int128 p = static_cast<unsigned __int128>(gen()) * static_cast<uint64_t>(n);
  return static_cast<int>(p >> 64);
}

double factorial(int r) {
  double f = 1.0;
  for (int k = 2; k <= r; ++k) f *= k;
  return f;
}

void check_T(int T, const char* probe) {
  if (T < 4) throw InputError(fmt::format("{}: T must be >= 4, got {}", probe, T));
}

void check_coords(const Coords& c) {
  if (!(c.L > 0.0)) throw InputError(fmt::format("light-cone probes: L must be > 0, got {}", c.L));
  if (c.R < 0 || c.R > 16)
    throw InputError(fmt::format("light-cone probes: jet order R must be in [0, 16], got {}", c.R));
}

template <class Derived>
long count_nonfinite(const Eigen::DenseBase<Derived>& m) {
  long n = 0;
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j) n += !std::isfinite(m(i, j));
  return n;
}

template <class Real>
using Vec = Eigen::Matrix<Real, Eigen::Dynamic, 1>;

// Reductions over many entries of a Real tensor: Eigen's (vectorised) reductions over the entries
// cast to double, rounded to Real by the caller (torch's float32 sums are cascade sums, accurate to
// a few ulps; a plain float loop over 32768 terms is not). In double these are the reductions the
// float64-only probes used, so the float64 numbers are unchanged.
template <class Derived>
double dsum(const Eigen::DenseBase<Derived>& x) {
  return x.derived().template cast<double>().sum();
}
template <class Derived>
double dsum_squares(const Eigen::DenseBase<Derived>& x) {
  return x.derived().template cast<double>().array().square().sum();
}
template <class Real, class Derived>
Real mean_as(const Eigen::DenseBase<Derived>& x) {
  return static_cast<Real>(dsum(x) / static_cast<double>(x.size()));
}
template <class Real, class Derived>
Real norm_as(const Eigen::DenseBase<Derived>& x) {
  return static_cast<Real>(std::sqrt(dsum_squares(x)));
}

// Row-wise L2 normalisation x / max(||x||, 1e-12) (torch.nn.functional.normalize), in Real (the
// row norm over the 24 features in Real, as torch's float32 norm).
template <class Real>
Mat<Real> normalize_rows(const Mat<Real>& f) {
  Mat<Real> out = f;
  for (Eigen::Index i = 0; i < f.rows(); ++i)
    out.row(i) /= std::max(f.row(i).norm(), static_cast<Real>(1e-12));
  return out;
}

// Unbiased std of a Real vector: the mean rounded to Real, deviations in Real, the sum of squares
// accumulated in double, the result rounded to Real.
template <class Real, class Derived>
Real unbiased_std(const Eigen::DenseBase<Derived>& x) {
  if (x.size() < 2) return Real(0);
  const Real mu = mean_as<Real>(x);
  const double ss = dsum_squares((x.derived().array() - mu).matrix());
  return static_cast<Real>(std::sqrt(ss / static_cast<double>(x.size() - 1)));
}

// Real x^r by repeated multiplication (torch's integer-exponent pow: x*x, x*x*x).
template <class Real>
Real int_pow(Real x, int r) {
  Real p = 1;
  for (int k = 0; k < r; ++k) p = k == 0 ? x : static_cast<Real>(p * x);
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Coordinates

const std::vector<Variant>& all_variants() {
  static const std::vector<Variant> v{Variant::Raw, Variant::Scaled,      Variant::Clipped,
                                      Variant::Log, Variant::LcAmpOnly,   Variant::LcPhaseOnly,
                                      Variant::Lc,  Variant::LcWrongScale};
  return v;
}

std::string to_string(Dtype d) {
  return d == Dtype::F32 ? "f32" : "f64";
}

std::string to_string(Variant v) {
  switch (v) {
    case Variant::Raw:
      return "raw";
    case Variant::Scaled:
      return "scaled";
    case Variant::Clipped:
      return "clipped";
    case Variant::Log:
      return "log";
    case Variant::LcAmpOnly:
      return "lc_amp_only";
    case Variant::LcPhaseOnly:
      return "lc_phase_only";
    case Variant::Lc:
      return "lc";
    case Variant::LcWrongScale:
      return "lc_wrong_scale";
  }
  return "?";
}

Variant parse_variant(const std::string& name) {
  std::vector<std::string> names;
  for (Variant v : all_variants()) {
    if (to_string(v) == name) return v;
    names.push_back(to_string(v));
  }
  throw InputError(fmt::format("unknown light-cone coordinate variant '{}' (valid: {})", name,
                               fmt::join(names, ", ")));
}

int variant_index(Variant v) {
  const auto& a = all_variants();
  return static_cast<int>(std::find(a.begin(), a.end(), v) - a.begin());
}

// The formulas of pj::beta_l, pj::phi_l and pj::rapidity (core/charts.hpp), each operation rounded
// to Real: beta = d / sqrt(d^2 + L^2), phi = L asinh(d/L), eta = asinh(d/L).
template <class Real>
Real amplitude_coordinate(Variant v, Real d, const Coords& c) {
  const Real L = static_cast<Real>(c.L);
  switch (v) {
    case Variant::Raw:
      return d;
    case Variant::Scaled:
    case Variant::LcPhaseOnly:
      return d / L;
    case Variant::Clipped:
      return std::min(static_cast<Real>(d / L), Real(1));
    case Variant::Log:
      return std::log1p(static_cast<Real>(d / L));
    case Variant::LcAmpOnly:
    case Variant::Lc:
    case Variant::LcWrongScale:
      return d / std::sqrt(static_cast<Real>(static_cast<Real>(d * d) + static_cast<Real>(L * L)));
  }
  return Real(0);
}

template <class Real>
Real phase_coordinate(Variant v, Real d, const Coords& c) {
  const Real L = static_cast<Real>(c.L);
  switch (v) {
    case Variant::LcPhaseOnly:
    case Variant::Lc:
      return L * std::asinh(static_cast<Real>(d / L));
    case Variant::LcWrongScale:
      return std::asinh(static_cast<Real>(d / L));  // missing outer L (the control)
    default:
      return d;
  }
}

template <class Real>
Real envelope(Variant v, Real d, const Coords& c) {
  if (v != Variant::Scaled) return Real(1);
  const Real cd = static_cast<Real>(static_cast<Real>(c.damping) * d);
  return std::exp(static_cast<Real>(-(cd / static_cast<Real>(c.L))));
}

bool uses_factorial(Variant v) {
  return !(v == Variant::LcAmpOnly || v == Variant::Lc || v == Variant::LcWrongScale);
}

template <class Real>
Real jet_amplitude(Variant v, int r, Real d, const Coords& c) {
  if (r < 0) throw InputError(fmt::format("jet order r must be >= 0, got {}", r));
  const Real a = int_pow(amplitude_coordinate(v, d, c), r);
  const Real ar = uses_factorial(v) ? static_cast<Real>(a / static_cast<Real>(factorial(r))) : a;
  return static_cast<Real>(envelope(v, d, c) * ar);
}

template float amplitude_coordinate(Variant, float, const Coords&);
template double amplitude_coordinate(Variant, double, const Coords&);
template float phase_coordinate(Variant, float, const Coords&);
template double phase_coordinate(Variant, double, const Coords&);
template float envelope(Variant, float, const Coords&);
template double envelope(Variant, double, const Coords&);
template float jet_amplitude(Variant, int, float, const Coords&);
template double jet_amplitude(Variant, int, double, const Coords&);

double omega_of_cycles(double cycles, double L) {
  return 2.0 * kPi * cycles / L;
}

template <class Real>
Mat<Real> position_features_as(Variant v, const std::vector<double>& lags, const Coords& c,
                               const std::vector<double>& cycles) {
  check_coords(c);
  if (cycles.empty()) throw InputError("position_features: the frequency grid is empty");
  const int R1 = c.R + 1;
  Mat<Real> f(static_cast<Eigen::Index>(lags.size()),
              static_cast<Eigen::Index>(cycles.size()) * R1 * 2);
  std::vector<Real> amp(static_cast<size_t>(R1));
  std::vector<Real> omega;
  for (double cy : cycles) omega.push_back(static_cast<Real>(omega_of_cycles(cy, c.L)));
  for (size_t i = 0; i < lags.size(); ++i) {
    const Real d = static_cast<Real>(lags[i]);
    const Real psi = phase_coordinate(v, d, c);
    for (int r = 0; r < R1; ++r) amp[static_cast<size_t>(r)] = jet_amplitude(v, r, d, c);
    for (size_t w = 0; w < cycles.size(); ++w) {
      const Real th = omega[w] * psi;  // rounded to Real before cos/sin (pj-rope.md 5.2)
      const Real co = std::cos(th), si = std::sin(th);
      for (int r = 0; r < R1; ++r) {
        const Eigen::Index col = (static_cast<Eigen::Index>(w) * R1 + r) * 2;
        f(static_cast<Eigen::Index>(i), col) = amp[static_cast<size_t>(r)] * co;
        f(static_cast<Eigen::Index>(i), col + 1) = amp[static_cast<size_t>(r)] * si;
      }
    }
  }
  return f;
}
template Mat<float> position_features_as(Variant, const std::vector<double>&, const Coords&,
                                         const std::vector<double>&);
template Mat<double> position_features_as(Variant, const std::vector<double>&, const Coords&,
                                          const std::vector<double>&);

Eigen::MatrixXd position_features(Variant v, const std::vector<double>& lags, const Coords& c,
                                  const std::vector<double>& cycles, Dtype dtype) {
  return dtype == Dtype::F32 ? position_features_as<float>(v, lags, c, cycles).cast<double>()
                             : position_features_as<double>(v, lags, c, cycles);
}

// ---------------------------------------------------------------------------------------------
// Quantisation and small numerics

template <class Real>
Real round_half_even(Real x) {
  const Real f = std::floor(x);
  const Real diff = x - f;  // exact
  if (diff > Real(0.5)) return f + Real(1);
  if (diff < Real(0.5)) return f;
  return std::fmod(f, Real(2)) == Real(0) ? f : f + Real(1);
}
template float round_half_even(float);
template double round_half_even(double);

int quant_qmax(int bits) {
  if (bits < 2 || bits > 16)
    throw InputError(fmt::format("quantisation bits must be in [2, 16], got {}", bits));
  return (1 << (bits - 1)) - 1;
}

template <class Real>
Real quantize_value(Real x, Real scale, int qmax) {
  if (!(scale > Real(0))) return Real(0);
  const Real q = std::clamp(round_half_even(static_cast<Real>(x / scale)), -static_cast<Real>(qmax),
                            static_cast<Real>(qmax));
  return q * scale;
}
template float quantize_value(float, float, int);
template double quantize_value(double, double, int);

template <class Real>
Mat<Real> quantize_tensor(const Mat<Real>& x, int bits) {
  const int qmax = quant_qmax(bits);
  const Real scale = x.size() ? x.cwiseAbs().maxCoeff() / static_cast<Real>(qmax) : Real(0);
  return x.unaryExpr([&](Real v) { return quantize_value(v, scale, qmax); });
}
template Mat<float> quantize_tensor(const Mat<float>&, int);
template Mat<double> quantize_tensor(const Mat<double>&, int);

template <class Real>
Mat<Real> quantize_columns(const Mat<Real>& x, int bits) {
  const int qmax = quant_qmax(bits);
  Mat<Real> q(x.rows(), x.cols());
  for (Eigen::Index j = 0; j < x.cols(); ++j) {
    const Real scale =
        x.rows() ? x.col(j).cwiseAbs().maxCoeff() / static_cast<Real>(qmax) : Real(0);
    q.col(j) = x.col(j).unaryExpr([&](Real v) { return quantize_value(v, scale, qmax); });
  }
  return q;
}
template Mat<float> quantize_columns(const Mat<float>&, int);
template Mat<double> quantize_columns(const Mat<double>&, int);

template <class Real>
Real relative_error(const Mat<Real>& q, const Mat<Real>& x) {
  const Real n = norm_as<Real>(x);
  if (!(n > Real(0))) return Real(0);
  const Mat<Real> diff = q - x;
  return norm_as<Real>(diff) / n;
}
template float relative_error(const Mat<float>&, const Mat<float>&);
template double relative_error(const Mat<double>&, const Mat<double>&);

std::vector<int> rounded_linspace(int lo, int hi, int n) {
  std::vector<int> out;
  if (n <= 0 || hi < lo) return out;
  for (int i = 0; i < n; ++i) {
    const double t = n == 1 ? lo : lo + (static_cast<double>(hi) - lo) * i / (n - 1);
    out.push_back(static_cast<int>(round_half_even(t)));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

double lower_median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  const size_t k = (v.size() - 1) / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

template <class Real>
Eigen::Index first_argmax(const Eigen::Matrix<Real, Eigen::Dynamic, 1>& s) {
  Eigen::Index best = 0;
  for (Eigen::Index i = 1; i < s.size(); ++i)
    if (s(i) > s(best)) best = i;
  return best;
}
template Eigen::Index first_argmax(const Eigen::Matrix<float, Eigen::Dynamic, 1>&);
template Eigen::Index first_argmax(const Eigen::Matrix<double, Eigen::Dynamic, 1>&);

// ---------------------------------------------------------------------------------------------
// phase_f_stability

namespace {

template <class Real>
StabilityRow phase_f_stability_as(Variant v, int T, const StabilityOptions& o) {
  const Coords& c = o.coords;
  const int R1 = c.R + 1;
  const Real omega = static_cast<Real>(omega_of_cycles(o.cycles, c.L));
  const Real bias_scale = static_cast<Real>(o.bias_scale);
  const Real threshold = static_cast<Real>(o.collision_threshold);
  const Real two_pi = static_cast<Real>(2.0 * kPi);
  StabilityRow row;
  row.variant = v;
  row.T = T;

  Mat<Real> A(T, R1);  // [T, R+1] jet amplitudes
  Vec<Real> psi(T), K(T);
  for (int d = 0; d < T; ++d) {
    const Real dr = static_cast<Real>(d);
    for (int r = 0; r < R1; ++r) A(d, r) = jet_amplitude(v, r, dr, c);
    psi(d) = phase_coordinate(v, dr, c);
    const Real th = omega * psi(d);  // rounded to Real before cos
    K(d) = bias_scale * A(d, c.R) * std::cos(th);
  }
  row.nonfinite_count = count_nonfinite(A) + count_nonfinite(psi) + count_nonfinite(K);

  // QK proxy: L2 norm over orders of the amplitudes (no phase).
  Vec<Real> qk(T);
  for (int d = 0; d < T; ++d) qk(d) = A.row(d).norm();
  row.qk_proxy_final = qk(T - 1);
  row.qk_proxy_max = qk.maxCoeff();
  row.qk_proxy_mean = mean_as<Real>(qk);

  // The top-order scalar kernel K(d) = A_R(d) cos(omega psi(d)).
  row.bias_abs_max = K.cwiseAbs().maxCoeff();
  row.bias_rms = static_cast<Real>(std::sqrt(dsum_squares(K) / T));
  {
    // weights T - d (exact in float below 2^24); products in Real, sums in double
    double sw = 0.0, swk = 0.0;
    for (int d = 0; d < T; ++d) {
      const Real w = static_cast<Real>(T - d);
      sw += w;
      swk += static_cast<Real>(w * K(d));
    }
    const Real mu = static_cast<Real>(swk / sw);
    double var = 0.0;
    for (int d = 0; d < T; ++d) {
      const Real dev = K(d) - mu;
      var += static_cast<Real>(static_cast<Real>(static_cast<Real>(T - d) * dev) * dev);
    }
    row.weighted_logit_std = static_cast<Real>(std::sqrt(var / sw));
  }
  {
    const Real m = K.maxCoeff();
    Vec<Real> e(T);
    for (int d = 0; d < T; ++d) e(d) = std::exp(static_cast<Real>(K(d) - m));
    const Real z = static_cast<Real>(dsum(e));
    double H = 0.0, dist = 0.0;
    for (int d = 0; d < T; ++d) {
      const Real p = e(d) / z;
      if (p > Real(0)) H -= static_cast<Real>(p * std::log(p));
      dist += static_cast<Real>(p * static_cast<Real>(d));
    }
    row.softmax_entropy = static_cast<Real>(H);
    row.softmax_support = std::exp(static_cast<Real>(H));
    row.softmax_avg_distance = static_cast<Real>(dist);
  }

  // Quantisation of the amplitude matrix (phase excluded).
  row.int8_error_tensor = relative_error<Real>(quantize_tensor<Real>(A, 8), A);
  row.int8_error_per_order = relative_error<Real>(quantize_columns<Real>(A, 8), A);
  row.int4_error_tensor = relative_error<Real>(quantize_tensor<Real>(A, 4), A);
  row.int4_error_per_order = relative_error<Real>(quantize_columns<Real>(A, 4), A);

  // Phase resolution over the far window [T/2, T-1]; increments of psi in Real (in float32 the
  // last LC increment is 0.03125, the reference's export).
  const int far = T / 2;
  row.phase_ratio_final = static_cast<Real>(psi(T - 1) - psi(T - 2));
  {
    double s = 0.0;
    int n = 0, coll = 0;
    for (int k = far; k <= T - 2; ++k) {
      const Real inc = std::abs(static_cast<Real>(psi(k + 1) - psi(k)));
      s += inc;
      ++n;
      coll += static_cast<Real>(omega * inc) < threshold;
    }
    row.phase_ratio_far_mean = static_cast<Real>(s / n);
    row.far_local_collision_rate = static_cast<double>(coll) / n;
  }
  row.far_phase_span =
      std::abs(static_cast<Real>(omega * static_cast<Real>(psi(T - 1) - psi(far))));

  const std::vector<int> lags = rounded_linspace(far, T - 1, o.far_samples);
  row.far_sample_count = static_cast<int>(lags.size());
  {
    // theta = (omega psi) mod 2 pi in Real (torch.remainder: fmod, then + 2 pi below zero)
    std::vector<Real> theta;
    theta.reserve(lags.size());
    for (int d : lags) {
      Real t = std::fmod(static_cast<Real>(omega * psi(d)), two_pi);
      if (t < Real(0)) t += two_pi;
      theta.push_back(t);
    }
    std::sort(theta.begin(), theta.end());
    const size_t n = theta.size();
    std::vector<double> nn(n);
    for (size_t i = 0; i < n; ++i) {
      const Real wrap = static_cast<Real>(theta[0] + two_pi);
      const Real next = i + 1 < n ? static_cast<Real>(theta[i + 1] - theta[i])
                                  : static_cast<Real>(wrap - theta[i]);
      const Real prev = i > 0 ? static_cast<Real>(theta[i] - theta[i - 1])
                              : static_cast<Real>(wrap - theta[n - 1]);
      nn[i] = std::min(next, prev);
    }
    int below = 0;
    for (double g : nn) below += static_cast<Real>(g) < threshold;
    row.wrapped_collision_rate = static_cast<double>(below) / static_cast<double>(n);
    row.wrapped_gap_median = lower_median(nn);
  }
  {
    // Condition number of the Gram matrix X^T X of the standardised far design
    // [A_r cos(omega psi), A_r sin(omega psi)]_{r=0..R} (= cond(X)^2), SVD in Real.
    Mat<Real> X(static_cast<Eigen::Index>(lags.size()), 2 * R1);
    for (size_t i = 0; i < lags.size(); ++i) {
      const int d = lags[i];
      const Real th = omega * psi(d);
      const Real co = std::cos(th), si = std::sin(th);
      for (int r = 0; r < R1; ++r) {
        X(static_cast<Eigen::Index>(i), 2 * r) = A(d, r) * co;
        X(static_cast<Eigen::Index>(i), 2 * r + 1) = A(d, r) * si;
      }
    }
    for (Eigen::Index j = 0; j < X.cols(); ++j) {
      const Vec<Real> col = X.col(j);
      const Real sd = std::max(unbiased_std<Real>(col), static_cast<Real>(1e-12));
      X.col(j) = (col.array() - mean_as<Real>(col)) / sd;
    }
    const long bad = count_nonfinite(X);
    row.nonfinite_count += bad;
    if (bad == 0) {
      const Eigen::JacobiSVD<Mat<Real>> svd(X);
      const auto& s = svd.singularValues();
      const double smin = s(s.size() - 1);
      row.far_gram_condition = smin > 0.0 ? std::pow(static_cast<double>(s(0)) / smin, 2)
                                          : std::numeric_limits<double>::infinity();
    } else {
      row.far_gram_condition = std::numeric_limits<double>::quiet_NaN();
    }
  }
  return row;
}

}  // namespace

StabilityRow phase_f_stability(Variant v, int T, const StabilityOptions& o) {
  check_T(T, "phase_f_stability");
  check_coords(o.coords);
  return o.dtype == Dtype::F32 ? phase_f_stability_as<float>(v, T, o)
                               : phase_f_stability_as<double>(v, T, o);
}

std::vector<std::pair<std::string, double>> stability_metrics(const StabilityRow& r) {
  return {{"qk_norm_proxy_final", r.qk_proxy_final},
          {"qk_norm_proxy_max", r.qk_proxy_max},
          {"qk_norm_proxy_mean", r.qk_proxy_mean},
          {"bias_abs_max", r.bias_abs_max},
          {"bias_rms", r.bias_rms},
          {"weighted_logit_std", r.weighted_logit_std},
          {"softmax_entropy", r.softmax_entropy},
          {"softmax_support", r.softmax_support},
          {"softmax_avg_distance", r.softmax_avg_distance},
          {"int8_quant_error_tensor", r.int8_error_tensor},
          {"int8_quant_error_per_order", r.int8_error_per_order},
          {"int4_quant_error_tensor", r.int4_error_tensor},
          {"int4_quant_error_per_order", r.int4_error_per_order},
          {"local_phase_ratio_final", r.phase_ratio_final},
          {"local_phase_ratio_far_mean", r.phase_ratio_far_mean},
          {"far_phase_span_radians", r.far_phase_span},
          {"far_local_collision_rate", r.far_local_collision_rate},
          {"wrapped_phase_collision_rate", r.wrapped_collision_rate},
          {"wrapped_phase_gap_median", r.wrapped_gap_median},
          {"far_gram_condition_number", r.far_gram_condition},
          {"far_sample_count", r.far_sample_count},
          {"nonfinite_count", static_cast<double>(r.nonfinite_count)}};
}

// ---------------------------------------------------------------------------------------------
// phase_f_cache_quantization

Eigen::MatrixXd gaussian_matrix(int rows, int cols, double scale, std::mt19937_64& gen) {
  Eigen::MatrixXd m(rows, cols);
  // Box-Muller, row-major, both outputs used in turn
  bool have = false;
  double spare = 0.0;
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      double z;
      if (have) {
        z = spare;
        have = false;
      } else {
        const double u1 = 1.0 - uniform01(gen);  // (0, 1]
        const double u2 = uniform01(gen);
        const double rad = std::sqrt(-2.0 * std::log(u1));
        z = rad * std::cos(2.0 * kPi * u2);
        spare = rad * std::sin(2.0 * kPi * u2);
        have = true;
      }
      m(i, j) = z * scale;
    }
  return m;
}

namespace {

template <class Real>
CacheRow phase_f_cache_quantization_as(Variant v, int T, const CacheOptions& o) {
  std::vector<double> pos(static_cast<size_t>(T));
  for (int i = 0; i < T; ++i) pos[static_cast<size_t>(i)] = i;
  const Mat<Real> F = position_features_as<Real>(v, pos, o.coords, o.cycles);
  const int nf = static_cast<int>(F.cols());
  std::mt19937_64 gen(o.seed);
  const Mat<Real> key_mix =
      gaussian_matrix(nf, o.cache_dim, 1.0 / std::sqrt(nf), gen).template cast<Real>();
  const Mat<Real> query_mix =
      gaussian_matrix(nf, o.cache_dim, 1.0 / std::sqrt(nf), gen).template cast<Real>();
  const Mat<Real> keys = F * key_mix;
  const Vec<Real> q = (F.row(T - 1) * query_mix).transpose();
  // The logits in float64 (the reference's; raw reaches ~1e24, whose square overflows float32).
  const Eigen::VectorXd qd = q.template cast<double>();
  const double inv = 1.0 / std::sqrt(static_cast<double>(o.cache_dim));
  const Eigen::VectorXd s = keys.template cast<double>() * qd * inv;

  CacheRow row;
  row.variant = v;
  row.T = T;
  row.nonfinite_count = count_nonfinite(keys) + count_nonfinite(s);
  row.logit_std = unbiased_std<double>(s);
  Vec<Real> norms(T);
  for (int i = 0; i < T; ++i) norms(i) = keys.row(i).norm();
  const int far = T / 2;
  row.key_norm_final = norms(T - 1);
  row.key_norm_max = norms.maxCoeff();
  row.key_norm_mean = mean_as<Real>(norms);
  row.key_norm_far_mean = mean_as<Real>(norms.tail(T - far));
  row.cache_abs_max = keys.cwiseAbs().maxCoeff();
  row.logit_abs_max = s.cwiseAbs().maxCoeff();
  const int bits[2] = {8, 4};
  for (int b = 0; b < 2; ++b)
    for (int mode = 0; mode < 2; ++mode) {
      const Mat<Real> kq =
          mode == 0 ? quantize_tensor<Real>(keys, bits[b]) : quantize_columns<Real>(keys, bits[b]);
      row.cache_error[b][mode] = relative_error<Real>(kq, keys);
      row.cache_error_far[b][mode] =
          relative_error<Real>(kq.bottomRows(T - far), keys.bottomRows(T - far));
      const Eigen::VectorXd sq = kq.template cast<double>() * qd * inv;
      row.logit_error[b][mode] = relative_error<double>(sq, s);
    }
  return row;
}

}  // namespace

CacheRow phase_f_cache_quantization(Variant v, int T, const CacheOptions& o) {
  check_T(T, "phase_f_cache_quantization");
  if (o.cache_dim < 1) throw InputError(fmt::format("cache dim must be >= 1, got {}", o.cache_dim));
  return o.dtype == Dtype::F32 ? phase_f_cache_quantization_as<float>(v, T, o)
                               : phase_f_cache_quantization_as<double>(v, T, o);
}

// ---------------------------------------------------------------------------------------------
// Buckets and precisions

std::vector<Bucket> lag_buckets(int T, int L) {
  const std::vector<Bucket> all{{"train", 1, L - 1},
                                {"x1_4", L, 4 * L - 1},
                                {"x4_16", 4 * L, 16 * L - 1},
                                {"x16_32", 16 * L, 32 * L - 1}};
  std::vector<Bucket> out;
  for (Bucket b : all) {
    b.hi = std::min(b.hi, T - 1);
    if (b.lo <= b.hi) out.push_back(b);
  }
  return out;
}

const std::vector<Quant>& all_quants() {
  static const std::vector<Quant> q{Quant::Fp32, Quant::Int8, Quant::Int4};
  return q;
}

std::string to_string(Quant q) {
  switch (q) {
    case Quant::Fp32:
      return "fp32";
    case Quant::Int8:
      return "int8";
    case Quant::Int4:
      return "int4";
  }
  return "?";
}

template <class Real>
Mat<Real> apply_precision(const Mat<Real>& f, Quant q) {
  switch (q) {
    case Quant::Fp32:
      return f.template cast<float>().template cast<Real>();
    case Quant::Int8:
      return quantize_columns<Real>(f, 8);
    case Quant::Int4:
      return quantize_columns<Real>(f, 4);
  }
  return f;
}
template Mat<float> apply_precision(const Mat<float>&, Quant);
template Mat<double> apply_precision(const Mat<double>&, Quant);

namespace {
std::vector<double> lags_1_to(int T) {
  std::vector<double> lags(static_cast<size_t>(T - 1));
  for (int d = 1; d < T; ++d) lags[static_cast<size_t>(d - 1)] = d;
  return lags;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// phase_f_retrieval_resolution

template <class Real>
RetrievalScore retrieve(const Mat<Real>& unit_rows, Eigen::Index target, double tie_eps) {
  const Vec<Real> s = unit_rows * unit_rows.row(target).transpose();
  const Real eps = static_cast<Real>(tie_eps);
  const Real bar = s(target) - eps;  // the tie bar, rounded to Real
  RetrievalScore r;
  r.prediction = first_argmax<Real>(s);
  Real best_other = -std::numeric_limits<Real>::infinity();
  for (Eigen::Index j = 0; j < s.size(); ++j) {
    if (j != target) best_other = std::max(best_other, s(j));
    r.ties += s(j) >= bar;
  }
  r.margin = static_cast<Real>(s(target) - best_other);
  return r;
}
template RetrievalScore retrieve(const Mat<float>&, Eigen::Index, double);
template RetrievalScore retrieve(const Mat<double>&, Eigen::Index, double);

namespace {

template <class Real>
std::vector<RetrievalRow> phase_f_retrieval_resolution_as(Variant v, int T, Quant q,
                                                          const RetrievalOptions& o) {
  const Mat<Real> F = normalize_rows<Real>(
      apply_precision<Real>(position_features_as<Real>(v, lags_1_to(T), o.coords, o.cycles), q));
  const int L = static_cast<int>(std::lround(o.coords.L));
  std::vector<RetrievalRow> rows;
  for (const Bucket& b : lag_buckets(T, L)) {
    const auto targets = rounded_linspace(b.lo, b.hi, o.queries);
    RetrievalRow row;
    row.variant = v;
    row.precision = q;
    row.bucket = b.name;
    row.queries = static_cast<int>(targets.size());
    std::vector<double> errs;
    for (int t : targets) {
      const RetrievalScore s = retrieve<Real>(F, t - 1, o.tie_eps);
      const int pred = static_cast<int>(s.prediction) + 1;
      const int err = std::abs(pred - t);
      errs.push_back(err);
      row.top1 += err == 0;
      row.within1 += err <= 1;
      row.within8 += err <= 8;
      row.within64 += err <= 64;
      row.bucket_accuracy += pred >= b.lo && pred <= b.hi;
      row.mean_margin += s.margin;
      row.mean_tie_count += s.ties;
    }
    const double n = static_cast<double>(targets.size());
    for (double* m : {&row.top1, &row.within1, &row.within8, &row.within64, &row.bucket_accuracy,
                      &row.mean_margin, &row.mean_tie_count})
      *m /= n;
    double se = 0.0;
    for (double e : errs) se += e;
    row.mean_abs_error = se / n;
    row.median_abs_error = lower_median(errs);
    rows.push_back(row);
  }
  return rows;
}

}  // namespace

std::vector<RetrievalRow> phase_f_retrieval_resolution(Variant v, int T, Quant q,
                                                       const RetrievalOptions& o) {
  check_T(T, "phase_f_retrieval_resolution");
  return o.dtype == Dtype::F32 ? phase_f_retrieval_resolution_as<float>(v, T, q, o)
                               : phase_f_retrieval_resolution_as<double>(v, T, q, o);
}

// ---------------------------------------------------------------------------------------------
// The MLP

double gelu(double x) {
  return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2));
}

double gelu_grad(double x) {
  const double Phi = 0.5 * (1.0 + std::erf(x / std::numbers::sqrt2));
  const double phi = std::exp(-0.5 * x * x) / std::sqrt(2.0 * kPi);
  return Phi + x * phi;
}

Mlp Mlp::init(int in, int hidden, uint64_t seed) {
  if (in < 1 || hidden < 1)
    throw InputError(fmt::format("MLP sizes must be >= 1, got in {} hidden {}", in, hidden));
  std::mt19937_64 gen(seed);
  const auto uniform = [&](Eigen::Index r, Eigen::Index c, int fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    Eigen::MatrixXd m(r, c);
    for (Eigen::Index i = 0; i < r; ++i)
      for (Eigen::Index j = 0; j < c; ++j) m(i, j) = (2.0 * uniform01(gen) - 1.0) * bound;
    return m;
  };
  Mlp m;
  m.W1 = uniform(hidden, in, in);
  m.b1 = uniform(hidden, 1, in);
  m.W2 = uniform(hidden, hidden, hidden);
  m.b2 = uniform(hidden, 1, hidden);
  m.W3 = uniform(1, hidden, hidden);
  m.b3 = uniform(1, 1, hidden);
  return m;
}

int Mlp::parameter_count() const {
  return static_cast<int>(W1.size() + b1.size() + W2.size() + b2.size() + W3.size() + b3.size());
}

std::vector<double> Mlp::flatten() const {
  std::vector<double> p;
  p.reserve(static_cast<size_t>(parameter_count()));
  const auto put = [&](const auto& m) { p.insert(p.end(), m.data(), m.data() + m.size()); };
  put(W1);
  put(b1);
  put(W2);
  put(b2);
  put(W3);
  put(b3);
  return p;
}

void Mlp::assign(const std::vector<double>& p) {
  if (static_cast<int>(p.size()) != parameter_count())
    throw InputError(fmt::format("MLP parameter vector has {} entries, expected {}", p.size(),
                                 parameter_count()));
  size_t at = 0;
  const auto take = [&](auto& m) {
    std::copy(p.begin() + static_cast<std::ptrdiff_t>(at),
              p.begin() + static_cast<std::ptrdiff_t>(at + static_cast<size_t>(m.size())),
              m.data());
    at += static_cast<size_t>(m.size());
  };
  take(W1);
  take(b1);
  take(W2);
  take(b2);
  take(W3);
  take(b3);
}

namespace {
struct Activations {
  Eigen::MatrixXd z1, a1, z2, a2;
  Eigen::VectorXd z3;
};
Activations forward_all(const Mlp& m, const Eigen::MatrixXd& x) {
  Activations a;
  a.z1 = (x * m.W1.transpose()).rowwise() + m.b1.transpose();
  a.a1 = a.z1.unaryExpr([](double v) { return gelu(v); });
  a.z2 = (a.a1 * m.W2.transpose()).rowwise() + m.b2.transpose();
  a.a2 = a.z2.unaryExpr([](double v) { return gelu(v); });
  a.z3 = (a.a2 * m.W3.transpose()).col(0).array() + m.b3(0);
  return a;
}
}  // namespace

Eigen::VectorXd mlp_forward(const Mlp& m, const Eigen::MatrixXd& x) {
  if (x.cols() != m.W1.cols())
    throw InputError(fmt::format("MLP input has {} columns, expected {}", x.cols(), m.W1.cols()));
  return forward_all(m, x).z3;
}

double mlp_bce_loss_grad(const Mlp& m, const Eigen::MatrixXd& x, const Eigen::VectorXd& y,
                         const Eigen::VectorXd& w, Mlp* grad) {
  if (x.cols() != m.W1.cols() || y.size() != x.rows() || w.size() != x.rows())
    throw InputError("mlp_bce_loss_grad: input, label and weight sizes do not agree");
  const Activations a = forward_all(m, x);
  const double wsum = w.sum();
  double loss = 0.0;
  Eigen::VectorXd g3(x.rows());
  for (Eigen::Index i = 0; i < x.rows(); ++i) {
    const double z = a.z3(i);
    loss += w(i) * (std::max(z, 0.0) - z * y(i) + std::log1p(std::exp(-std::abs(z))));
    const double sig = z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : std::exp(z) / (1.0 + std::exp(z));
    g3(i) = w(i) * (sig - y(i)) / wsum;
  }
  if (grad) {
    grad->W3 = g3.transpose() * a.a2;
    grad->b3 = Eigen::VectorXd::Constant(1, g3.sum());
    const Eigen::MatrixXd dz2 =
        (g3 * m.W3).cwiseProduct(a.z2.unaryExpr([](double v) { return gelu_grad(v); }));
    grad->W2 = dz2.transpose() * a.a1;
    grad->b2 = dz2.colwise().sum().transpose();
    const Eigen::MatrixXd dz1 =
        (dz2 * m.W2).cwiseProduct(a.z1.unaryExpr([](double v) { return gelu_grad(v); }));
    grad->W1 = dz1.transpose() * x;
    grad->b1 = dz1.colwise().sum().transpose();
  }
  return loss / wsum;
}

void AdamW::step(std::vector<double>& params, const std::vector<double>& grad) {
  if (grad.size() != params.size()) throw InputError("AdamW: gradient and parameter sizes differ");
  if (m.empty()) {
    m.assign(params.size(), 0.0);
    v.assign(params.size(), 0.0);
  }
  ++step_count;
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step_count));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step_count));
  const double step_size = lr / bc1;
  const double bc2_sqrt = std::sqrt(bc2);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i] *= 1.0 - lr * weight_decay;  // decoupled weight decay
    m[i] = beta1 * m[i] + (1.0 - beta1) * grad[i];
    v[i] = beta2 * v[i] + (1.0 - beta2) * grad[i] * grad[i];
    const double denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    params[i] -= step_size * m[i] / denom;
  }
}

// ---------------------------------------------------------------------------------------------
// phase_f_trained_resolution

std::vector<TrainedRow> phase_f_trained_resolution(Variant v, int T, Quant q,
                                                   const TrainedOptions& o) {
  check_T(T, "phase_f_trained_resolution");
  const int L = static_cast<int>(std::lround(o.coords.L));
  if (L < 3 || L > T)
    throw InputError(
        fmt::format("phase_f_trained_resolution: need 3 <= L <= T, got L {} T {}", L, T));
  if (o.batch < 2 || o.batch % 2 || o.steps < 0 || o.hidden < 1)
    throw InputError(fmt::format(
        "phase_f_trained_resolution: batch must be even and >= 2, steps >= 0, hidden >= 1 (got "
        "{}, {}, {})",
        o.batch, o.steps, o.hidden));
  // Features of lags 1..T-1 at the precision, standardised with the train window's statistics
  // (lags 1..L-1; unbiased std clamped at 1e-6).
  const int ntrain = L - 1;
  const auto standardised = [&](auto zero) {
    using Real = decltype(zero);
    Mat<Real> Fr =
        apply_precision<Real>(position_features_as<Real>(v, lags_1_to(T), o.coords, o.cycles), q);
    for (Eigen::Index j = 0; j < Fr.cols(); ++j) {
      const auto tr = Fr.col(j).head(ntrain);
      const Real mu = mean_as<Real>(tr);
      const Real sd = std::max(unbiased_std<Real>(tr), static_cast<Real>(1e-6));
      Fr.col(j) = (Fr.col(j).array() - mu) / sd;
    }
    return Eigen::MatrixXd(Fr.template cast<double>());  // exact; the MLP runs in float64
  };
  const Eigen::MatrixXd F = o.dtype == Dtype::F32 ? standardised(0.0f) : standardised(0.0);
  const Eigen::Index nf = F.cols();
  const uint64_t seed =
      o.seed + 1009ull * static_cast<uint64_t>(variant_index(v)) +
      9176ull * static_cast<uint64_t>(std::find(all_quants().begin(), all_quants().end(), q) -
                                      all_quants().begin());
  Mlp mlp = Mlp::init(static_cast<int>(nf), o.hidden, seed);
  std::mt19937_64 gen(seed ^ 0x9e3779b97f4a7c15ull);  // the batch stream (init used `seed`)
  AdamW opt;
  opt.lr = o.lr;
  opt.weight_decay = o.weight_decay;
  // One zero row stands for the batch/2 identical positives (weight batch/2): the same loss and
  // gradient as evaluating them one by one.
  const int half = o.batch / 2;
  Eigen::MatrixXd X(half + 1, nf);
  Eigen::VectorXd y = Eigen::VectorXd::Zero(half + 1), w = Eigen::VectorXd::Ones(half + 1);
  X.row(0).setZero();
  y(0) = 1.0;
  w(0) = half;
  Mlp grad = mlp;
  std::vector<double> params = mlp.flatten();
  double loss = 0.0;
  for (int step = 0; step < o.steps; ++step) {
    for (int i = 0; i < half; ++i) {
      const int a = uniform_index(gen, ntrain);
      int b = uniform_index(gen, ntrain - 1);
      if (b >= a) ++b;
      X.row(i + 1) = (F.row(a) - F.row(b)).cwiseAbs();
    }
    loss = mlp_bce_loss_grad(mlp, X, y, w, &grad);
    opt.step(params, grad.flatten());
    mlp.assign(params);
  }

  const double pos_logit = mlp_forward(mlp, Eigen::MatrixXd::Zero(1, nf))(0);
  std::vector<TrainedRow> rows;
  for (const Bucket& b : lag_buckets(T, L)) {
    const auto targets = rounded_linspace(b.lo, b.hi, o.queries);
    const int span = b.hi - b.lo + 1;
    const Eigen::MatrixXd Fb = F.middleRows(b.lo - 1, span);
    Eigen::MatrixXd hard(static_cast<Eigen::Index>(targets.size()), nf),
        rnd(static_cast<Eigen::Index>(targets.size()), nf);
    TrainedRow row;
    row.variant = v;
    row.precision = q;
    row.bucket = b.name;
    row.queries = static_cast<int>(targets.size());
    row.final_loss = loss;
    std::vector<double> gaps;
    double dist_sum = 0.0;
    for (size_t k = 0; k < targets.size(); ++k) {
      const int t = targets[k];
      const Eigen::RowVectorXd ft = F.row(t - 1);
      // the nearest in-bucket neighbour in standardised feature space (first on ties)
      const Eigen::VectorXd d2 = (Fb.rowwise() - ft).rowwise().squaredNorm();
      Eigen::Index best = -1;
      for (Eigen::Index j = 0; j < span; ++j)
        if (b.lo + j != t && (best < 0 || d2(j) < d2(best))) best = j;
      if (best < 0) best = 0;  // one-lag bucket: the target itself
      hard.row(static_cast<Eigen::Index>(k)) = (Fb.row(best) - ft).cwiseAbs();
      gaps.push_back(std::abs(static_cast<double>(b.lo + best - t)));
      dist_sum += std::sqrt(d2(best));
      int off = static_cast<int>((37ll * static_cast<long long>(k) + 1) % span);
      if (off == 0 && span > 1) off = 1;
      const int neg = b.lo + (t - b.lo + off) % span;
      rnd.row(static_cast<Eigen::Index>(k)) = (F.row(neg - 1) - ft).cwiseAbs();
    }
    const Eigen::VectorXd lh = mlp_forward(mlp, hard), lr = mlp_forward(mlp, rnd);
    const double n = static_cast<double>(targets.size());
    row.pos_accept = pos_logit >= 0.0 ? 1.0 : 0.0;
    row.hard_negative_accept = (lh.array() >= 0.0).cast<double>().sum() / n;
    row.random_negative_accept = (lr.array() >= 0.0).cast<double>().sum() / n;
    row.hard_pair_accuracy = 0.5 * (row.pos_accept + 1.0 - row.hard_negative_accept);
    double gs = 0.0;
    for (double g : gaps) gs += g;
    row.hard_gap_mean = gs / n;
    row.hard_gap_median = lower_median(gaps);
    row.hard_feature_distance_mean = dist_sum / n;
    rows.push_back(row);
  }
  return rows;
}

}  // namespace relpos::probes::lc
