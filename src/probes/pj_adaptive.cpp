#include "probes/pj_adaptive.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numbers>
#include <random>

#include "core/charts.hpp"
#include "core/types.hpp"
#include "probes/targets.hpp"

namespace relpos::probes::pj {

namespace {

// torch.nn.functional.softplus (beta 1, threshold 20) and its derivative.
double softplus(double x) {
  return x > 20.0 ? x : std::log1p(std::exp(x));
}
double softplus_grad(double x) {
  return x > 20.0 ? 1.0 : 1.0 / (1.0 + std::exp(-x));
}

std::vector<double> softmax(const double* z, int n) {
  const double m = *std::max_element(z, z + n);
  std::vector<double> s(static_cast<size_t>(n));
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += s[static_cast<size_t>(i)] = std::exp(z[i] - m);
  for (auto& v : s) v /= sum;
  return s;
}

// d loss / d logits of s = softmax(logits), given d loss / d s.
void softmax_backward(const std::vector<double>& s, const std::vector<double>& gs, double* out) {
  double dot = 0.0;
  for (size_t i = 0; i < s.size(); ++i) dot += s[i] * gs[i];
  for (size_t i = 0; i < s.size(); ++i) out[i] = s[i] * (gs[i] - dot);
}

// Standard normal draws from mt19937_64 by Box-Muller (the same stream on every standard library,
// which std::normal_distribution does not promise).
class NormalStream {
 public:
  explicit NormalStream(uint64_t seed) : rng_(seed) {}
  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // u1 in (0, 1], u2 in [0, 1)
    const double u1 = (static_cast<double>(rng_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::mt19937_64 rng_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

double mean_of(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}
double sample_std(const std::vector<double>& v) {
  if (v.size() < 2) return 0.0;
  const double m = mean_of(v);
  double s = 0.0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size() - 1));
}

}  // namespace

const char* sector_name(Sector s) {
  switch (s) {
    case Sector::FJ:
      return "FJ";
    case Sector::A:
      return "A";
    case Sector::LC:
      return "LC";
  }
  return "?";
}

LagBasis make_lag_basis(int n, double omega, double L) {
  if (n < 1) throw InputError(fmt::format("adaptive PJ lag window must hold >= 1 lag, got {}", n));
  if (!(L > 0.0)) throw InputError(fmt::format("adaptive PJ length L must be > 0, got {}", L));
  LagBasis b;
  for (int i = 0; i < n; ++i) {
    const double d = i;
    const double phi = lightcone_phi(d, L);
    b.x.push_back(d / L);
    b.cos_w.push_back(std::cos(omega * d));
    b.sin_w.push_back(std::sin(omega * d));
    b.beta.push_back(lightcone_beta(d, L));
    b.cos_phi.push_back(std::cos(omega * phi));
    b.sin_phi.push_back(std::sin(omega * phi));
  }
  return b;
}

AdaptivePJKernel::AdaptivePJKernel(int max_order, double omega, double L) : omega_(omega), L_(L) {
  if (max_order < 0 || max_order > 16)
    throw InputError(fmt::format("adaptive PJ max order must be in [0, 16], got {}", max_order));
  if (!(L > 0.0)) throw InputError(fmt::format("adaptive PJ length L must be > 0, got {}", L));
  if (!std::isfinite(omega))
    throw InputError(fmt::format("adaptive PJ omega must be finite, got {}", omega));
  layout_.orders = max_order + 1;
  p_.assign(static_cast<size_t>(layout_.size()), 0.0);
  init(0);
}

void AdaptivePJKernel::init(uint64_t seed, int order_init, double zeta_std) {
  const int R1 = layout_.orders;
  std::fill(p_.begin(), p_.end(), 0.0);
  p_[1] = -0.2;
  p_[2] = -0.2;
  if (order_init >= 0) {
    if (order_init >= R1)
      throw InputError(fmt::format("order_init {} is past the max order {}", order_init, R1 - 1));
    for (int r = 0; r < R1; ++r) {
      const double v = r == order_init ? 2.0 : -2.0;
      p_[static_cast<size_t>(layout_.fj_alpha() + r)] = v;
      p_[static_cast<size_t>(layout_.lc_alpha() + r)] = v;
    }
  }
  NormalStream n(seed);
  for (int off : {layout_.fj_zre(), layout_.fj_zim(), layout_.lc_zre(), layout_.lc_zim()})
    for (int r = 0; r < R1; ++r) p_[static_cast<size_t>(off + r)] = zeta_std * n.next();
  p_[static_cast<size_t>(layout_.damping_raw())] = -2.0;
  p_[static_cast<size_t>(layout_.affine())] = 0.0;
}

std::array<double, 3> AdaptivePJKernel::gates() const {
  const auto g = softmax(p_.data() + layout_.gates(), 3);
  return {g[0], g[1], g[2]};
}
std::vector<double> AdaptivePJKernel::fj_alpha() const {
  return softmax(p_.data() + layout_.fj_alpha(), layout_.orders);
}
std::vector<double> AdaptivePJKernel::lc_alpha() const {
  return softmax(p_.data() + layout_.lc_alpha(), layout_.orders);
}
double AdaptivePJKernel::damping() const {
  return softplus(p_[static_cast<size_t>(layout_.damping_raw())]);
}

AdaptivePJKernel::Parts AdaptivePJKernel::parts(const LagBasis& b) const {
  const int R1 = layout_.orders;
  const size_t n = b.size();
  const auto g = gates();
  const auto af = fj_alpha(), al = lc_alpha();
  const double c = damping(), a = p_[static_cast<size_t>(layout_.affine())];
  const double* fzr = p_.data() + layout_.fj_zre();
  const double* fzi = p_.data() + layout_.fj_zim();
  const double* lzr = p_.data() + layout_.lc_zre();
  const double* lzi = p_.data() + layout_.lc_zim();
  Parts out;
  out.fj.assign(static_cast<size_t>(R1), std::vector<double>(n));
  out.lc.assign(static_cast<size_t>(R1), std::vector<double>(n));
  out.affine.resize(n);
  out.pred.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const double x = b.x[i];
    double amp = std::exp(-c * x), bpow = 1.0, sfj = 0.0, slc = 0.0;
    for (int r = 0; r < R1; ++r) {
      const auto k = static_cast<size_t>(r);
      if (r > 0) {
        amp *= x / r;
        bpow *= b.beta[i];
      }
      out.fj[k][i] = af[k] * amp * (fzr[r] * b.cos_w[i] - fzi[r] * b.sin_w[i]);
      out.lc[k][i] = al[k] * bpow * (lzr[r] * b.cos_phi[i] - lzi[r] * b.sin_phi[i]);
      sfj += out.fj[k][i];
      slc += out.lc[k][i];
    }
    out.affine[i] = a * x;
    out.pred[i] = g[0] * sfj + g[1] * out.affine[i] + g[2] * slc;
  }
  return out;
}

std::vector<double> AdaptivePJKernel::predict(const LagBasis& b) const {
  return parts(b).pred;
}

double AdaptivePJKernel::loss(const LagBasis& b, const std::vector<double>& y,
                              std::vector<double>* grad) const {
  if (y.size() != b.size())
    throw InputError(fmt::format("adaptive PJ loss: {} targets for {} lags", y.size(), b.size()));
  const int R1 = layout_.orders;
  const size_t n = b.size();
  const auto g = gates();
  const auto af = fj_alpha(), al = lc_alpha();
  const double raw = p_[static_cast<size_t>(layout_.damping_raw())];
  const double c = softplus(raw), a = p_[static_cast<size_t>(layout_.affine())];
  const double* fzr = p_.data() + layout_.fj_zre();
  const double* fzi = p_.data() + layout_.fj_zim();
  const double* lzr = p_.data() + layout_.lc_zre();
  const double* lzi = p_.data() + layout_.lc_zim();
  // per-order complex coefficients alpha_r zeta_r (the cos and -sin weights)
  std::vector<double> fc(static_cast<size_t>(R1)), fs(fc), lc(fc), ls(fc);
  for (int r = 0; r < R1; ++r) {
    const auto k = static_cast<size_t>(r);
    fc[k] = af[k] * fzr[r], fs[k] = af[k] * fzi[r];
    lc[k] = al[k] * lzr[r], ls[k] = al[k] * lzi[r];
  }
  // Accumulators of e_d = d loss / d pred(d) = 2 (pred - y) / n against the features.
  std::vector<double> Afj(static_cast<size_t>(R1), 0.0), Bfj(Afj), Alc(Afj), Blc(Afj);
  std::vector<double> pc(static_cast<size_t>(R1)), ps(pc), qc(pc), qs(pc);
  double sse = 0.0, e_sfj = 0.0, e_slc = 0.0, e_x = 0.0, e_x_sfj = 0.0;
  const double scale = 2.0 / static_cast<double>(n);
  for (size_t i = 0; i < n; ++i) {
    const double x = b.x[i];
    double amp = std::exp(-c * x), bpow = 1.0, sfj = 0.0, slc = 0.0;
    for (int r = 0; r < R1; ++r) {
      const auto k = static_cast<size_t>(r);
      if (r > 0) {
        amp *= x / r;
        bpow *= b.beta[i];
      }
      pc[k] = amp * b.cos_w[i], ps[k] = amp * b.sin_w[i];
      qc[k] = bpow * b.cos_phi[i], qs[k] = bpow * b.sin_phi[i];
      sfj += fc[k] * pc[k] - fs[k] * ps[k];
      slc += lc[k] * qc[k] - ls[k] * qs[k];
    }
    const double res = g[0] * sfj + g[1] * a * x + g[2] * slc - y[i];
    sse += res * res;
    if (!grad) continue;
    const double e = scale * res;
    for (int r = 0; r < R1; ++r) {
      const auto k = static_cast<size_t>(r);
      Afj[k] += e * pc[k], Bfj[k] += e * ps[k];
      Alc[k] += e * qc[k], Blc[k] += e * qs[k];
    }
    e_sfj += e * sfj, e_slc += e * slc, e_x += e * x, e_x_sfj += e * x * sfj;
  }
  if (grad) {
    auto& G = *grad;
    G.assign(static_cast<size_t>(layout_.size()), 0.0);
    // gates
    const std::vector<double> gv{g[0], g[1], g[2]};
    softmax_backward(gv, {e_sfj, a * e_x, e_slc}, G.data() + layout_.gates());
    // zetas and order spectra
    std::vector<double> gaf(static_cast<size_t>(R1)), gal(gaf);
    for (int r = 0; r < R1; ++r) {
      const auto k = static_cast<size_t>(r);
      G[static_cast<size_t>(layout_.fj_zre() + r)] = g[0] * af[k] * Afj[k];
      G[static_cast<size_t>(layout_.fj_zim() + r)] = -g[0] * af[k] * Bfj[k];
      G[static_cast<size_t>(layout_.lc_zre() + r)] = g[2] * al[k] * Alc[k];
      G[static_cast<size_t>(layout_.lc_zim() + r)] = -g[2] * al[k] * Blc[k];
      gaf[k] = g[0] * (fzr[r] * Afj[k] - fzi[r] * Bfj[k]);
      gal[k] = g[2] * (lzr[r] * Alc[k] - lzi[r] * Blc[k]);
    }
    softmax_backward(af, gaf, G.data() + layout_.fj_alpha());
    softmax_backward(al, gal, G.data() + layout_.lc_alpha());
    // d sum_r FJ_r / d c = -x sum_r FJ_r
    G[static_cast<size_t>(layout_.damping_raw())] = -g[0] * e_x_sfj * softplus_grad(raw);
    G[static_cast<size_t>(layout_.affine())] = g[1] * e_x;
  }
  return sse / static_cast<double>(n);
}

Adam::Adam(size_t n, double lr, double beta1, double beta2, double eps)
    : lr_(lr), b1_(beta1), b2_(beta2), eps_(eps), m_(n, 0.0), v_(n, 0.0) {
  if (!(lr > 0.0)) throw InputError(fmt::format("Adam learning rate must be > 0, got {}", lr));
  if (!(beta1 >= 0.0 && beta1 < 1.0) || !(beta2 >= 0.0 && beta2 < 1.0))
    throw InputError(fmt::format("Adam betas must be in [0, 1), got {}, {}", beta1, beta2));
}

void Adam::step(std::vector<double>& p, const std::vector<double>& g) {
  if (p.size() != m_.size() || g.size() != m_.size())
    throw InputError(fmt::format("Adam over {} parameters got {} values and {} gradients",
                                 m_.size(), p.size(), g.size()));
  ++t_;
  const double bc1 = 1.0 - std::pow(b1_, t_);
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(b2_, t_));
  const double step_size = lr_ / bc1;
  for (size_t i = 0; i < p.size(); ++i) {
    m_[i] = b1_ * m_[i] + (1.0 - b1_) * g[i];  // exp_avg.lerp_(grad, 1 - beta1)
    v_[i] = b2_ * v_[i] + (1.0 - b2_) * g[i] * g[i];
    const double denom = std::sqrt(v_[i]) / bc2_sqrt + eps_;
    p[i] -= step_size * m_[i] / denom;
  }
}

double AdaptiveConfig::omega() const {
  return 2.0 * std::numbers::pi * cycles / L;
}

void AdaptiveConfig::check() const {
  if (!(L > 0.0)) throw InputError(fmt::format("adaptive PJ: L must be > 0, got {}", L));
  if (!(cycles > 0.0) || !std::isfinite(cycles))
    throw InputError(fmt::format("adaptive PJ: cycles must be > 0, got {}", cycles));
  if (max_order < 0 || max_order > 16)
    throw InputError(fmt::format("adaptive PJ: max order must be in [0, 16], got {}", max_order));
  if (train_len < 2 || eval_len < 2)
    throw InputError(fmt::format("adaptive PJ: train and eval lengths must be >= 2, got {} and {}",
                                 train_len, eval_len));
  if (steps < 0) throw InputError(fmt::format("adaptive PJ: steps must be >= 0, got {}", steps));
  if (!(lr > 0.0)) throw InputError(fmt::format("adaptive PJ: lr must be > 0, got {}", lr));
  if (restarts < 1)
    throw InputError(fmt::format("adaptive PJ: restarts must be >= 1, got {}", restarts));
  if (select != "train_mse" && select != "eval_mse")
    throw InputError(
        fmt::format("adaptive PJ: unknown selection '{}' (valid: train_mse, eval_mse)", select));
}

int argmax_first(const std::vector<double>& v) {
  if (v.empty()) throw InputError("argmax of an empty vector");
  size_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[best]) best = i;
  return static_cast<int>(best);
}

int mode_smallest(const std::vector<int>& v) {
  if (v.empty()) throw InputError("mode of an empty list");
  std::map<int, int> count;
  for (int x : v) ++count[x];
  int best = count.begin()->first, n = count.begin()->second;
  for (const auto& [x, c] : count)
    if (c > n) best = x, n = c;  // ascending keys: the smallest wins ties
  return best;
}

AdaptiveDiagnostics diagnose(const AdaptivePJKernel& k, const LagBasis& train,
                             const std::vector<double>& y_train, const LagBasis& eval,
                             const std::vector<double>& y_eval) {
  if (y_eval.size() != eval.size())
    throw InputError(
        fmt::format("adaptive PJ diagnostics: {} targets for {} lags", y_eval.size(), eval.size()));
  AdaptiveDiagnostics d;
  const int R1 = k.layout().orders;
  const auto& p = k.params();
  d.train_mse = k.loss(train, y_train, nullptr);
  d.gates = k.gates();
  d.damping = k.damping();
  d.affine = p[static_cast<size_t>(k.layout().affine())];
  const auto af = k.fj_alpha(), al = k.lc_alpha();
  double total = 0.0;
  for (int r = 0; r < R1; ++r) {
    const auto q = static_cast<size_t>(r);
    d.fj_mass.push_back(d.gates[0] * af[q] *
                        std::hypot(p[static_cast<size_t>(k.layout().fj_zre() + r)],
                                   p[static_cast<size_t>(k.layout().fj_zim() + r)]));
    d.lc_mass.push_back(d.gates[2] * al[q] *
                        std::hypot(p[static_cast<size_t>(k.layout().lc_zre() + r)],
                                   p[static_cast<size_t>(k.layout().lc_zim() + r)]));
    total += d.fj_mass[q] + d.lc_mass[q];
  }
  // the adaptive script divides by sum.clamp_min(finfo(dtype).eps)
  for (int r = 0; r < R1; ++r) {
    const auto q = static_cast<size_t>(r);
    d.normalized_mass.push_back((d.fj_mass[q] + d.lc_mass[q]) /
                                std::max(total, std::numeric_limits<double>::epsilon()));
  }
  const auto parts = k.parts(eval);
  const size_t n = eval.size();
  // C_r = g_FJ FJ_r + g_LC LC_r
  std::vector<std::vector<double>> C(static_cast<size_t>(R1), std::vector<double>(n));
  std::vector<double> sum(n, 0.0);
  for (int r = 0; r < R1; ++r)
    for (size_t i = 0; i < n; ++i) {
      const auto q = static_cast<size_t>(r);
      C[q][i] = d.gates[0] * parts.fj[q][i] + d.gates[2] * parts.lc[q][i];
      sum[i] += C[q][i];
    }
  double sum_norm = 0.0, ss_res = 0.0, ss_tot = 0.0;
  const double y_mean = mean_of(y_eval);
  for (size_t i = 0; i < n; ++i) {
    sum_norm += sum[i] * sum[i];
    const double e = parts.pred[i] - y_eval[i];
    ss_res += e * e;
    ss_tot += (y_eval[i] - y_mean) * (y_eval[i] - y_mean);
  }
  sum_norm = std::sqrt(sum_norm);
  d.eval_mse = ss_res / static_cast<double>(n);
  d.eval_r2 = 1.0 - ss_res / (ss_tot + 1e-12);
  for (int r = 0; r < R1; ++r) {
    const auto& c = C[static_cast<size_t>(r)];
    double norm = 0.0, loo = 0.0;
    for (size_t i = 0; i < n; ++i) {
      norm += c[i] * c[i];
      const double e = parts.pred[i] - c[i] - y_eval[i];
      loo += e * e;
    }
    d.energy.push_back(std::sqrt(norm) / (sum_norm + 1e-12));
    d.loo.push_back(loo / static_cast<double>(n) - d.eval_mse);
  }
  d.top_order_mass = argmax_first(d.normalized_mass);
  d.top_order_energy = argmax_first(d.energy);
  d.selected = static_cast<Sector>(argmax_first({d.gates[0], d.gates[1], d.gates[2]}));
  return d;
}

AdaptiveRun fit_adaptive(const std::string& target, uint64_t seed, const AdaptiveConfig& cfg) {
  cfg.check();
  const double omega = cfg.omega();
  const LagBasis train = make_lag_basis(cfg.train_len, omega, cfg.L);
  const LagBasis eval = make_lag_basis(cfg.eval_len, omega, cfg.L);
  std::vector<double> y_train(train.size()), y_eval(eval.size());
  for (size_t i = 0; i < y_eval.size(); ++i)
    y_eval[i] = pj_target(target, static_cast<double>(i), omega, cfg.L);
  for (size_t i = 0; i < y_train.size(); ++i)
    y_train[i] = pj_target(target, static_cast<double>(i), omega, cfg.L);
  AdaptiveRun run;
  run.target = target;
  run.seed = seed;
  double best = std::numeric_limits<double>::infinity();
  AdaptivePJKernel k(cfg.max_order, omega, cfg.L);
  std::vector<double> grad;
  for (int r = 0; r < cfg.restarts; ++r) {
    k.init(seed + 7919ULL * static_cast<uint64_t>(r),
           cfg.order_init_cycle ? r % (cfg.max_order + 1) : -1);
    Adam opt(k.params().size(), cfg.lr);
    for (int s = 0; s < cfg.steps; ++s) {
      k.loss(train, y_train, &grad);
      opt.step(k.params(), grad);
    }
    AdaptiveDiagnostics d = diagnose(k, train, y_train, eval, y_eval);
    run.restart_train_mse.push_back(d.train_mse);
    run.restart_eval_mse.push_back(d.eval_mse);
    const double score = cfg.select == "eval_mse" ? d.eval_mse : d.train_mse;
    // a NaN score never wins; the first restart is kept when every score is NaN
    if (r == 0 || score < best) {
      best = r == 0 && std::isnan(score) ? std::numeric_limits<double>::infinity() : score;
      run.restart = r;
      run.diag = std::move(d);
      run.params = k.params();
    }
  }
  return run;
}

std::vector<Sector> designed_sectors(const std::string& target) {
  if (target == "phase" || target == "first_jet" || target == "second_jet" || target == "third_jet")
    return {Sector::FJ};
  if (target == "linear") return {Sector::A};
  if (target == "recency_weak_jet") return {Sector::A, Sector::FJ};
  if (target == "lc_core" || target == "lc_affine") return {Sector::LC};
  throw InputError(fmt::format("no designed sector for target '{}' (valid: {})", target,
                               fmt::join(pj_target_names(), ", ")));
}

AdaptiveSweep run_adaptive_sweep(const AdaptiveConfig& cfg, const std::vector<std::string>& targets,
                                 const std::vector<uint64_t>& seeds) {
  cfg.check();
  if (seeds.empty()) throw InputError("adaptive PJ sweep needs at least one seed");
  if (targets.empty()) throw InputError("adaptive PJ sweep needs at least one target");
  AdaptiveSweep sw;
  sw.cfg = cfg;
  sw.seeds = seeds;
  for (const auto& t : targets) {
    AdaptiveSummary s;
    s.target = t;
    s.designed = designed_sectors(t);
    const int R1 = cfg.max_order + 1;
    std::vector<double> mse, r2;
    std::array<std::vector<double>, 3> gates;
    std::vector<int> top_mass, top_energy, sel;
    s.mass_mean.assign(static_cast<size_t>(R1), 0.0);
    s.energy_mean = s.loo_mean = s.mass_mean;
    s.recovered = true;
    for (uint64_t seed : seeds) {
      AdaptiveRun run = fit_adaptive(t, seed, cfg);
      const auto& d = run.diag;
      mse.push_back(d.eval_mse);
      r2.push_back(d.eval_r2);
      for (int g = 0; g < 3; ++g)
        gates[static_cast<size_t>(g)].push_back(d.gates[static_cast<size_t>(g)]);
      top_mass.push_back(d.top_order_mass);
      top_energy.push_back(d.top_order_energy);
      sel.push_back(static_cast<int>(d.selected));
      s.selected.push_back(d.selected);
      if (std::find(s.designed.begin(), s.designed.end(), d.selected) == s.designed.end())
        s.recovered = false;
      for (size_t r = 0; r < static_cast<size_t>(R1); ++r) {
        const double w = 1.0 / static_cast<double>(seeds.size());
        s.mass_mean[r] += w * d.normalized_mass[r];
        s.energy_mean[r] += w * d.energy[r];
        s.loo_mean[r] += w * d.loo[r];
      }
      sw.runs.push_back(std::move(run));
    }
    s.eval_mse_mean = mean_of(mse);
    s.eval_mse_std = sample_std(mse);
    s.eval_r2_mean = mean_of(r2);
    for (size_t g = 0; g < 3; ++g) {
      s.gate_mean[g] = mean_of(gates[g]);
      s.gate_std[g] = sample_std(gates[g]);
    }
    s.top_order_mass_mode = mode_smallest(top_mass);
    s.top_order_energy_mode = mode_smallest(top_energy);
    s.selected_mode = static_cast<Sector>(mode_smallest(sel));
    sw.summaries.push_back(std::move(s));
  }
  return sw;
}

}  // namespace relpos::probes::pj
