// PJ-RoPE scalar kernels and diagnostics (pj-rope.md 1.1, 1.2, 1.4, 1.5, 1.7), float64, on top of
// the shared jet feature (core/jet_features.hpp). They back the ported reference unit tests and the
// fixed-kernel targets; the Fourier-jet and light-cone components are J_r with the FJ or LC chart.
#pragma once

#include <Eigen/Dense>
#include <complex>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace relpos::probes::pj {

using cd = std::complex<double>;

// Coordinates (L <= 0 throws InputError).
double rapidity(double d, double L);  // eta_L(d) = asinh(d/L)
double phi_l(double d, double L);     // L asinh(d/L)
double beta_l(double d, double L);    // d / sqrt(d^2 + L^2)
double rho(double d, double L, const std::string& rho_type);  // "linear": d/L, "lightcone": eta_L(d)

// Re[amplitude ((d/L)^r / r!) e^{-damping d/L} e^{i omega d}]
double fj_component(double d, double omega, int r, double L, double damping = 0.0, cd amplitude = 1.0);
// Re[amplitude beta_L(d)^r e^{i omega phi_L(d)}]  (no factorial, no damping)
double lc_component(double d, double omega, int r, double L, cd amplitude = 1.0);
// -slope rho(d)
double affine_component(double d, double L, double slope = 1.0, const std::string& rho_type = "linear");
// T x T lags i - j; nullopt above the diagonal when causal. T < 1 throws.
std::vector<std::vector<std::optional<int>>> distance_lags(int T, bool causal = true);

// Per-head, per-order T x T component grids over lags i - j clamped at 0 (the tensor backend).
struct Components {
  int heads = 0, orders = 0;
  std::vector<Eigen::MatrixXd> grid;  // grid[h * orders + r]
  const Eigen::MatrixXd& at(int h, int r) const { return grid[static_cast<size_t>(h * orders + r)]; }
};
// C_{h,r}(d) = (d/L)^r/r! e^{-c_h d/L} alpha_{h,r} (zre cos(omega_h d) - zim sin(omega_h d))
Components fourier_jet_components(int T, const std::vector<double>& omega, const Eigen::MatrixXd& alpha,
                                  const Eigen::MatrixXd& zeta_re, const Eigen::MatrixXd& zeta_im, double L,
                                  const std::vector<double>& damping);
// C_{h,r}(d) = beta_L(d)^r alpha_{h,r} (zre cos(omega_h phi_L(d)) - zim sin(omega_h phi_L(d)))
Components lightcone_components(int T, const std::vector<double>& omega, const Eigen::MatrixXd& alpha,
                                const Eigen::MatrixXd& zeta_re, const Eigen::MatrixXd& zeta_im, double L);
// -slope_h rho(d) per head (no intercept)
std::vector<Eigen::MatrixXd> affine_bias(int T, const std::vector<double>& slope, double L,
                                         const std::string& rho_type = "linear");
// bias_h = g_{h,0} sum_r FJ + g_{h,1} affine + g_{h,2} sum_r LC; missing sectors skipped (all
// missing throws); future entries (j > i) set to future_value.
std::vector<Eigen::MatrixXd> combine_pj_bias(const Eigen::MatrixXd& gates, const Components* fj,
                                             const std::vector<Eigen::MatrixXd>* affine, const Components* lc,
                                             double future_value = 0.0);

// Diagnostics, tensor form.
Eigen::MatrixXd parameter_effective_mass(const std::vector<double>& gate, const Eigen::MatrixXd& alpha,
                                         const Eigen::MatrixXd& zeta_re, const Eigen::MatrixXd& zeta_im);
Eigen::MatrixXd functional_energy(const Components& c, double eps = 1e-12);  // H x orders
// Delta_{h,r} = mean((full - C_r - y)^2) - mean((full - y)^2), target broadcast over heads.
Eigen::MatrixXd leave_one_order_out_mse(const Eigen::MatrixXd& target, const Components& c);

// Diagnostics, dict form (diagnostics.py).
std::map<int, double> effective_mass(double gate, const std::map<int, double>& alpha,
                                     const std::map<int, double>& zeta_abs);
std::map<int, double> normalized_mass(const std::map<int, double>& mass, double eps = 1e-12);
std::map<int, double> functional_energy(const std::map<int, std::vector<double>>& components);
std::map<int, double> leave_one_order_out_mse(const std::vector<double>& target,
                                              const std::map<int, std::vector<double>>& components);

// exp(d ((-gamma + i omega) I + eta N)) for a 2x2 complex Jordan block.
Eigen::Matrix2cd jordan2_complex(double d, double omega, double eta = 1.0, double gamma = 0.0);

// Binomial jets and difference modules (PJ-RoPE Proposition 2).
cd binomial_jet(cd z, int r, int d);  // C(d, r) z^d, 0 for r < 0
std::vector<cd> shift_minus_root(const std::vector<cd>& v, cd z);  // v[k+1] - z v[k]
int complex_rank(Eigen::MatrixXcd m, double tol = 1e-9);           // Gauss-Jordan with pivot tolerance

// Exact PJ-rotary on rows p = 0..T-1 of q, k (T x hd, hd % 4 == 0): blocks of 4 reals = two complex
// channels sharing omega_b = base^(-b/B); query y0 = z0 + c_p z1, key y1 = z1 - c_p z0,
// c_p = eta p / train_length, then both channels times e^{i p omega_b}.
void apply_exact_pj_rotary(Eigen::MatrixXd& q, Eigen::MatrixXd& k, double base = 10000.0,
                           double train_length = 1024.0, double eta = 1.0);

}  // namespace relpos::probes::pj
