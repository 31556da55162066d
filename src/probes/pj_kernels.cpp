#include "probes/pj_kernels.hpp"

#include <fmt/format.h>

#include <cmath>

#include "core/charts.hpp"
#include "core/jet_features.hpp"
#include "core/types.hpp"

namespace relpos::probes::pj {

namespace {
void check_L(double L) {
  if (!(L > 0.0)) throw InputError(fmt::format("PJ length L must be > 0, got {}", L));
}
void check_r(int r) {
  if (r < 0) throw InputError(fmt::format("PJ jet order r must be >= 0, got {}", r));
}
JetChart fj_chart(double L, double damping) {
  JetChart c;
  c.L = L;
  c.shear_scale = 1.0 / L;
  c.gamma = damping / L;
  return c;
}
JetChart lc_chart(double L) {
  JetChart c;
  c.chart = Chart::LightconeBeta;
  c.phase_chart = Chart::LightconePhi;
  c.L = L;
  c.factorial = false;
  return c;
}
double re_of(const JetValue& v, cd a) { return a.real() * v.re - a.imag() * v.im; }
}  // namespace

double rapidity(double d, double L) {
  check_L(L);
  return std::asinh(d / L);
}
double phi_l(double d, double L) {
  check_L(L);
  return lightcone_phi(d, L);
}
double beta_l(double d, double L) {
  check_L(L);
  return lightcone_beta(d, L);
}
double rho(double d, double L, const std::string& rho_type) {
  check_L(L);
  if (rho_type == "linear") return d / L;
  if (rho_type == "lightcone") return rapidity(d, L);
  throw InputError(fmt::format("unknown rho type '{}' (valid: linear, lightcone)", rho_type));
}

double fj_component(double d, double omega, int r, double L, double damping, cd amplitude) {
  check_L(L);
  check_r(r);
  return re_of(jet_feature(fj_chart(L, damping), omega, r, d), amplitude);
}
double lc_component(double d, double omega, int r, double L, cd amplitude) {
  check_L(L);
  check_r(r);
  return re_of(jet_feature(lc_chart(L), omega, r, d), amplitude);
}
double affine_component(double d, double L, double slope, const std::string& rho_type) {
  return -slope * rho(d, L, rho_type);
}

std::vector<std::vector<std::optional<int>>> distance_lags(int T, bool causal) {
  if (T < 1) throw InputError(fmt::format("distance_lags needs T >= 1, got {}", T));
  std::vector<std::vector<std::optional<int>>> out(static_cast<size_t>(T), std::vector<std::optional<int>>(static_cast<size_t>(T)));
  for (int i = 0; i < T; ++i)
    for (int j = 0; j < T; ++j)
      if (!causal || j <= i) out[static_cast<size_t>(i)][static_cast<size_t>(j)] = i - j;
  return out;
}

namespace {
void check_orders(size_t H, const Eigen::MatrixXd& alpha, const Eigen::MatrixXd& zre, const Eigen::MatrixXd& zim) {
  if (static_cast<size_t>(alpha.rows()) != H || zre.rows() != alpha.rows() || zim.rows() != alpha.rows() ||
      zre.cols() != alpha.cols() || zim.cols() != alpha.cols())
    throw InputError(fmt::format("alpha must be [H, R+1] with zetas of the same shape (H = {}, alpha {}x{})", H,
                                 alpha.rows(), alpha.cols()));
}
template <class F>
Components components(int T, const std::vector<double>& omega, const Eigen::MatrixXd& alpha,
                      const Eigen::MatrixXd& zre, const Eigen::MatrixXd& zim, F jet) {
  check_orders(omega.size(), alpha, zre, zim);
  Components c;
  c.heads = static_cast<int>(omega.size());
  c.orders = static_cast<int>(alpha.cols());
  for (int h = 0; h < c.heads; ++h)
    for (int r = 0; r < c.orders; ++r) {
      Eigen::MatrixXd g(T, T);
      const cd a = alpha(h, r) * cd(zre(h, r), zim(h, r));
      for (int i = 0; i < T; ++i)
        for (int j = 0; j < T; ++j) g(i, j) = re_of(jet(h, r, std::max(i - j, 0)), a);  // lags clamped at 0
      c.grid.push_back(std::move(g));
    }
  return c;
}
}  // namespace

Components fourier_jet_components(int T, const std::vector<double>& omega, const Eigen::MatrixXd& alpha,
                                  const Eigen::MatrixXd& zeta_re, const Eigen::MatrixXd& zeta_im, double L,
                                  const std::vector<double>& damping) {
  check_L(L);
  if (damping.size() != omega.size() && damping.size() != 1)
    throw InputError(fmt::format("damping must be a scalar or [H] (H = {}), got {}", omega.size(), damping.size()));
  return components(T, omega, alpha, zeta_re, zeta_im, [&](int h, int r, int d) {
    const double c = damping.size() == 1 ? damping[0] : damping[static_cast<size_t>(h)];
    return jet_feature(fj_chart(L, c), omega[static_cast<size_t>(h)], r, d);
  });
}

Components lightcone_components(int T, const std::vector<double>& omega, const Eigen::MatrixXd& alpha,
                                const Eigen::MatrixXd& zeta_re, const Eigen::MatrixXd& zeta_im, double L) {
  check_L(L);
  return components(T, omega, alpha, zeta_re, zeta_im,
                    [&](int h, int r, int d) { return jet_feature(lc_chart(L), omega[static_cast<size_t>(h)], r, d); });
}

std::vector<Eigen::MatrixXd> affine_bias(int T, const std::vector<double>& slope, double L, const std::string& rho_type) {
  std::vector<Eigen::MatrixXd> out;
  for (double s : slope) {
    Eigen::MatrixXd g(T, T);
    for (int i = 0; i < T; ++i)
      for (int j = 0; j < T; ++j) g(i, j) = affine_component(std::max(i - j, 0), L, s, rho_type);
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<Eigen::MatrixXd> combine_pj_bias(const Eigen::MatrixXd& gates, const Components* fj,
                                             const std::vector<Eigen::MatrixXd>* affine, const Components* lc,
                                             double future_value) {
  if (!fj && !affine && !lc) throw InputError("combine_pj_bias needs at least one sector");
  if (gates.cols() != 3) throw InputError(fmt::format("gates must be [H, 3], got {}x{}", gates.rows(), gates.cols()));
  const auto H = gates.rows();
  int T = 0;
  if (fj) T = static_cast<int>(fj->grid.front().rows());
  if (affine) T = static_cast<int>(affine->front().rows());
  if (lc) T = static_cast<int>(lc->grid.front().rows());
  if ((fj && fj->heads != H) || (lc && lc->heads != H) || (affine && static_cast<Eigen::Index>(affine->size()) != H))
    throw InputError(fmt::format("every component's head count must equal the gates' H = {}", H));
  std::vector<Eigen::MatrixXd> out;
  for (Eigen::Index h = 0; h < H; ++h) {
    Eigen::MatrixXd b = Eigen::MatrixXd::Zero(T, T);
    const int hi = static_cast<int>(h);
    if (fj)
      for (int r = 0; r < fj->orders; ++r) b += gates(h, 0) * fj->at(hi, r);
    if (affine) b += gates(h, 1) * (*affine)[static_cast<size_t>(h)];
    if (lc)
      for (int r = 0; r < lc->orders; ++r) b += gates(h, 2) * lc->at(hi, r);
    for (int i = 0; i < T; ++i)
      for (int j = i + 1; j < T; ++j) b(i, j) = future_value;
    out.push_back(std::move(b));
  }
  return out;
}

Eigen::MatrixXd parameter_effective_mass(const std::vector<double>& gate, const Eigen::MatrixXd& alpha,
                                         const Eigen::MatrixXd& zeta_re, const Eigen::MatrixXd& zeta_im) {
  check_orders(gate.size(), alpha, zeta_re, zeta_im);
  Eigen::MatrixXd m(alpha.rows(), alpha.cols());
  for (Eigen::Index h = 0; h < m.rows(); ++h)
    for (Eigen::Index r = 0; r < m.cols(); ++r)
      m(h, r) = gate[static_cast<size_t>(h)] * alpha(h, r) * std::hypot(zeta_re(h, r), zeta_im(h, r));
  return m;
}

Eigen::MatrixXd functional_energy(const Components& c, double eps) {
  Eigen::MatrixXd e(c.heads, c.orders);
  for (int h = 0; h < c.heads; ++h) {
    Eigen::MatrixXd sum = Eigen::MatrixXd::Zero(c.at(h, 0).rows(), c.at(h, 0).cols());
    for (int r = 0; r < c.orders; ++r) sum += c.at(h, r);
    for (int r = 0; r < c.orders; ++r) e(h, r) = c.at(h, r).norm() / (sum.norm() + eps);
  }
  return e;
}

Eigen::MatrixXd leave_one_order_out_mse(const Eigen::MatrixXd& target, const Components& c) {
  Eigen::MatrixXd out(c.heads, c.orders);
  for (int h = 0; h < c.heads; ++h) {
    Eigen::MatrixXd full = Eigen::MatrixXd::Zero(target.rows(), target.cols());
    for (int r = 0; r < c.orders; ++r) {
      if (c.at(h, r).rows() != target.rows() || c.at(h, r).cols() != target.cols())
        throw InputError("leave_one_order_out_mse: target and component shapes differ");
      full += c.at(h, r);
    }
    const double base = (full - target).squaredNorm() / static_cast<double>(target.size());
    for (int r = 0; r < c.orders; ++r)
      out(h, r) = (full - c.at(h, r) - target).squaredNorm() / static_cast<double>(target.size()) - base;
  }
  return out;
}

std::map<int, double> effective_mass(double gate, const std::map<int, double>& alpha,
                                     const std::map<int, double>& zeta_abs) {
  std::map<int, double> m;
  const auto get = [](const std::map<int, double>& x, int r) {
    const auto it = x.find(r);
    return it == x.end() ? 0.0 : it->second;
  };
  for (const auto& [r, v] : alpha) m[r] = 0.0;
  for (const auto& [r, v] : zeta_abs) m[r] = 0.0;
  for (auto& [r, v] : m) v = gate * get(alpha, r) * get(zeta_abs, r);
  return m;
}

std::map<int, double> normalized_mass(const std::map<int, double>& mass, double eps) {
  double total = 0.0;
  for (const auto& [r, v] : mass) total += std::max(0.0, v);
  std::map<int, double> out;
  for (const auto& [r, v] : mass) out[r] = std::max(0.0, v) / (total + eps);
  return out;
}

namespace {
void check_vectors(const std::vector<double>* first, const std::vector<double>& v) {
  if (v.empty()) throw InputError("PJ diagnostics need non-empty vectors");
  if (first && first->size() != v.size()) throw InputError("PJ diagnostics: vector lengths differ");
}
}  // namespace

std::map<int, double> functional_energy(const std::map<int, std::vector<double>>& components) {
  if (components.empty()) throw InputError("functional_energy needs at least one component");
  const auto& first = components.begin()->second;
  std::vector<double> sum(first.size(), 0.0);
  for (const auto& [r, v] : components) {
    check_vectors(&first, v);
    for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  const auto norm = [](const std::vector<double>& v) {
    double s = 0.0;
    for (double x : v) s += x * x;
    return std::sqrt(s);
  };
  std::map<int, double> e;
  for (const auto& [r, v] : components) e[r] = norm(v) / (norm(sum) + 1e-12);
  return e;
}

std::map<int, double> leave_one_order_out_mse(const std::vector<double>& target,
                                              const std::map<int, std::vector<double>>& components) {
  check_vectors(nullptr, target);
  std::vector<double> full(target.size(), 0.0);
  for (const auto& [r, v] : components) {
    check_vectors(&target, v);
    for (size_t i = 0; i < v.size(); ++i) full[i] += v[i];
  }
  const auto mse = [&](const std::vector<double>* minus) {
    double s = 0.0;
    for (size_t i = 0; i < target.size(); ++i) {
      const double e = full[i] - (minus ? (*minus)[i] : 0.0) - target[i];
      s += e * e;
    }
    return s / static_cast<double>(target.size());
  };
  const double base = mse(nullptr);
  std::map<int, double> out;
  for (const auto& [r, v] : components) out[r] = mse(&v) - base;
  return out;
}

Eigen::Matrix2cd jordan2_complex(double d, double omega, double eta, double gamma) {
  const cd s = std::exp(cd(-gamma, omega) * d);
  Eigen::Matrix2cd m;
  m << s, s * eta * d, 0.0, s;
  return m;
}

cd binomial_jet(cd z, int r, int d) {
  if (r < 0 || r > d) return 0.0;
  double c = 1.0;
  for (int k = 1; k <= r; ++k) c = c * (d - r + k) / k;
  return c * std::pow(z, d);
}

std::vector<cd> shift_minus_root(const std::vector<cd>& v, cd z) {
  std::vector<cd> out;
  for (size_t i = 0; i + 1 < v.size(); ++i) out.push_back(v[i + 1] - z * v[i]);
  return out;
}

int complex_rank(Eigen::MatrixXcd m, double tol) {
  const Eigen::Index rows = m.rows(), cols = m.cols();
  Eigen::Index rank = 0;
  for (Eigen::Index c = 0; c < cols && rank < rows; ++c) {
    Eigen::Index pivot = -1;
    for (Eigen::Index r = rank; r < rows; ++r)
      if (std::abs(m(r, c)) > tol) {
        pivot = r;
        break;
      }
    if (pivot < 0) continue;
    m.row(rank).swap(m.row(pivot));
    m.row(rank) /= m(rank, c);
    for (Eigen::Index r = 0; r < rows; ++r)
      if (r != rank && std::abs(m(r, c)) > tol) m.row(r) -= m(r, c) * m.row(rank);
    ++rank;
  }
  return static_cast<int>(rank);
}

void apply_exact_pj_rotary(Eigen::MatrixXd& q, Eigen::MatrixXd& k, double base, double train_length, double eta) {
  if (q.rows() != k.rows() || q.cols() != k.cols())
    throw InputError(fmt::format("exact PJ-rotary needs q and k of the same shape ({}x{} vs {}x{})", q.rows(),
                                 q.cols(), k.rows(), k.cols()));
  if (q.cols() % 4 != 0) throw InputError(fmt::format("exact PJ-rotary needs head dim % 4 == 0, got {}", q.cols()));
  const Eigen::Index B = q.cols() / 4;
  for (Eigen::Index p = 0; p < q.rows(); ++p) {
    const double c = eta * static_cast<double>(p) / train_length;
    for (Eigen::Index b = 0; b < B; ++b) {
      const double w = std::pow(base, -static_cast<double>(b) / static_cast<double>(B));
      const cd rot = std::polar(1.0, static_cast<double>(p) * w);
      const Eigen::Index o = 4 * b;
      const cd q0(q(p, o), q(p, o + 1)), q1(q(p, o + 2), q(p, o + 3));
      const cd k0(k(p, o), k(p, o + 1)), k1(k(p, o + 2), k(p, o + 3));
      const cd y0 = (q0 + c * q1) * rot, y1 = q1 * rot;      // query
      const cd x0 = k0 * rot, x1 = (k1 - c * k0) * rot;      // key (dual action)
      q(p, o) = y0.real(), q(p, o + 1) = y0.imag(), q(p, o + 2) = y1.real(), q(p, o + 3) = y1.imag();
      k(p, o) = x0.real(), k(p, o + 1) = x0.imag(), k(p, o + 2) = x1.real(), k(p, o + 3) = x1.imag();
    }
  }
}

}  // namespace relpos::probes::pj
