#include "core/pj_bias.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numbers>

#include "core/types.hpp"

namespace relpos {

double softplus(double x) {
  return x > 20 ? x : std::log1p(std::exp(x));
}
double inverse_softplus(double v) {
  return v > 20 ? v : std::log(std::expm1(v));
}

double pj_jet(PjJetBasis b, double d, int r, double L) {
  double v = 1.0;
  switch (b) {
    case PjJetBasis::Monomial:
      for (int k = 0; k < r; ++k) v *= d / L;
      return v;
    case PjJetBasis::Factorial:
      for (int k = 1; k <= r; ++k) v *= d / (L * k);
      return v;
    case PjJetBasis::Binomial:
      for (int k = 1; k <= r; ++k) v *= (d - (k - 1)) / (L * k);
      return v;
  }
  return v;
}

PjBiasParams pj_initial_params(const PjBiasConfig& c, int heads, std::mt19937_64& rng) {
  if (heads < 1) throw InputError("pj_bias: heads must be >= 1");
  const int H = heads, O = c.orders();
  PjBiasParams p;
  p.heads = H;
  p.orders = O;
  for (int h = 0; h < H; ++h) {
    const double cycles = H == 1 ? c.init_cycles : 1.0 + (c.init_cycles - 1.0) * h / (H - 1);
    p.omega.push_back(2.0 * std::numbers::pi * cycles / c.L);
  }
  const auto logits = [](const std::string& init, int n, const std::vector<bool>& on,
                         const std::vector<std::string>& names) {
    std::vector<double> v(static_cast<size_t>(n), 0.0);
    if (init == "uniform") return v;
    for (int i = 0; i < n; ++i) {
      v[i] = -2.0;
      if (init == names[i] && on[i]) v[i] = 2.0;
    }
    // the preferred entry disabled or out of range: the reference leaves the logits at 0
    if (std::find(v.begin(), v.end(), 2.0) == v.end()) std::fill(v.begin(), v.end(), 0.0);
    return v;
  };
  const std::vector<bool> sectors_on{c.fj, c.affine, c.lc};
  const auto gl = logits(c.gate_init, 3, sectors_on, {"fj", "affine", "lc"});
  std::vector<std::string> order_names;
  for (int r = 0; r < O; ++r) order_names.push_back(fmt::format("r{}", r));
  const auto al =
      logits(c.order_init, O, std::vector<bool>(static_cast<size_t>(O), true), order_names);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int h = 0; h < H; ++h) {
    p.gate_logits.insert(p.gate_logits.end(), gl.begin(), gl.end());
    p.fj_alpha_logits.insert(p.fj_alpha_logits.end(), al.begin(), al.end());
    p.lc_alpha_logits.insert(p.lc_alpha_logits.end(), al.begin(), al.end());
    p.raw_damping.push_back(inverse_softplus(c.init_damping));
    p.raw_slope.push_back(inverse_softplus(c.init_slope));
  }
  // the reference draws every zeta whichever sectors are on (same RNG use for every choice)
  for (auto* z : {&p.fj_zeta_re, &p.fj_zeta_im, &p.lc_zeta_re, &p.lc_zeta_im})
    for (int i = 0; i < H * O; ++i) z->push_back(c.zeta_std * normal(rng));
  return p;
}

PjBiasParams pj_initial_params(const PjBiasConfig& c, int heads) {
  std::mt19937_64 rng(c.seed);
  return pj_initial_params(c, heads, rng);
}

void check_pj_params(const PjBiasConfig& c, const PjBiasParams& p, int heads) {
  const size_t H = static_cast<size_t>(heads), O = static_cast<size_t>(c.orders());
  const auto want = [&](const char* name, const std::vector<double>& v, size_t n) {
    if (v.size() != n)
      throw InputError(
          fmt::format("pj_bias: parameter '{}' has {} values, expected {}", name, v.size(), n));
  };
  if (p.heads != heads || p.orders != c.orders())
    throw InputError(
        fmt::format("pj_bias: parameters are for {} heads and {} orders, expected {} and {}",
                    p.heads, p.orders, heads, c.orders()));
  want("omega", p.omega, H);
  want("gate_logits", p.gate_logits, 3 * H);
  want("fj_alpha_logits", p.fj_alpha_logits, O * H);
  want("lc_alpha_logits", p.lc_alpha_logits, O * H);
  want("fj_zeta_re", p.fj_zeta_re, O * H);
  want("fj_zeta_im", p.fj_zeta_im, O * H);
  want("lc_zeta_re", p.lc_zeta_re, O * H);
  want("lc_zeta_im", p.lc_zeta_im, O * H);
  want("raw_damping", p.raw_damping, H);
  want("raw_slope", p.raw_slope, H);
}

namespace {

// softmax of n logits at v[offset..], entries with on[i] == false exactly 0
std::vector<double> masked_softmax(const double* v, int n, const std::vector<bool>& on) {
  double mx = -INFINITY;
  for (int i = 0; i < n; ++i)
    if (on[i]) mx = std::max(mx, v[i]);
  std::vector<double> out(static_cast<size_t>(n), 0.0);
  double s = 0;
  for (int i = 0; i < n; ++i)
    if (on[i]) s += out[i] = std::exp(v[i] - mx);
  for (auto& x : out) x /= s;
  return out;
}

}  // namespace

std::vector<double> pj_gates(const PjBiasConfig& c, const PjBiasParams& p, int h) {
  return masked_softmax(&p.gate_logits[static_cast<size_t>(3 * h)], 3, {c.fj, c.affine, c.lc});
}

double PjLagTerms::total() const {
  double s = affine;
  for (double x : fj) s += x;
  for (double x : lc) s += x;
  return s;
}

PjLagTerms pj_lag_terms(const PjBiasConfig& c, const PjBiasParams& p, int h, double d) {
  d = std::max(d, 0.0);  // the reference clamps lags at 0; the causal mask hides the future
  const int O = c.orders();
  const auto g = pj_gates(c, p, h);
  const std::vector<bool> all(static_cast<size_t>(O), true);
  const size_t o = static_cast<size_t>(h * O);
  const double L = c.L, om = p.omega[h], damp = softplus(p.raw_damping[h]);
  PjLagTerms t;
  if (c.fj) {
    const auto alpha = masked_softmax(&p.fj_alpha_logits[o], O, all);
    const double env = std::exp(-damp * d / L), cs = std::cos(om * d), sn = std::sin(om * d);
    for (int r = 0; r < O; ++r)
      t.fj.push_back(g[0] * pj_jet(c.basis, d, r, L) * env * alpha[r] *
                     (p.fj_zeta_re[o + r] * cs - p.fj_zeta_im[o + r] * sn));
  }
  if (c.affine) {
    const double rho = c.rho == PjRho::Linear ? d / L : std::asinh(d / L);
    t.affine = -g[1] * softplus(p.raw_slope[h]) * rho;
  }
  if (c.lc) {
    const auto alpha = masked_softmax(&p.lc_alpha_logits[o], O, all);
    const double phi = L * std::asinh(d / L), beta = d / std::sqrt(d * d + L * L);
    const double env = c.lc_damped ? std::exp(-damp * phi / L) : 1.0;
    const double cs = std::cos(om * phi), sn = std::sin(om * phi);
    double br = 1.0;
    for (int r = 0; r < O; ++r, br *= beta)
      t.lc.push_back(g[2] * br * env * alpha[r] *
                     (p.lc_zeta_re[o + r] * cs - p.lc_zeta_im[o + r] * sn));
  }
  return t;
}

std::vector<double> pj_lag_table(const PjBiasConfig& c, const PjBiasParams& p, int64_t len) {
  check_pj_params(c, p, p.heads);
  if (len < 1) throw InputError("pj_bias: the lag table needs at least one lag");
  std::vector<double> out(static_cast<size_t>(p.heads * len));
  for (int h = 0; h < p.heads; ++h)
    for (int64_t d = 0; d < len; ++d)
      out[static_cast<size_t>(h * len + d)] = pj_lag_terms(c, p, h, static_cast<double>(d)).total();
  return out;
}

namespace {

// the parameters in the kernel's order: state-dict name suffix, member, values per head, and
// whether the table depends on it under a config (the sectors left off read nothing)
struct PjField {
  const char* name;
  std::vector<double> PjBiasParams::*member;
  int per_head;  // 1, 3 (gate logits) or 0: one per order
  bool (*read)(const PjBiasConfig&);
};
using Config = const PjBiasConfig&;
constexpr PjField kPjFields[] = {
    {"omega", &PjBiasParams::omega, 1, [](Config c) { return c.fj || c.lc; }},
    // a softmax over one entry (one sector on, or orders up to 0) is 1 whatever its logit
    {"gate_logits", &PjBiasParams::gate_logits, 3,
     [](Config c) { return c.fj + c.affine + c.lc > 1; }},
    {"fj_alpha_logits", &PjBiasParams::fj_alpha_logits, 0,
     [](Config c) { return c.fj && c.orders() > 1; }},
    {"lc_alpha_logits", &PjBiasParams::lc_alpha_logits, 0,
     [](Config c) { return c.lc && c.orders() > 1; }},
    {"fj_zeta_re", &PjBiasParams::fj_zeta_re, 0, [](Config c) { return c.fj; }},
    {"fj_zeta_im", &PjBiasParams::fj_zeta_im, 0, [](Config c) { return c.fj; }},
    {"lc_zeta_re", &PjBiasParams::lc_zeta_re, 0, [](Config c) { return c.lc; }},
    {"lc_zeta_im", &PjBiasParams::lc_zeta_im, 0, [](Config c) { return c.lc; }},
    // the light-cone term is damped only with lc_damping (the paper's form)
    {"raw_damping", &PjBiasParams::raw_damping, 1,
     [](Config c) { return c.fj || (c.lc && c.lc_damped); }},
    {"raw_slope", &PjBiasParams::raw_slope, 1, [](Config c) { return c.affine; }},
};

}  // namespace

std::vector<LagParam> PjLagKernel::params(int heads) const {
  const PjBiasParams p = pj_initial_params(c_, heads);
  std::vector<LagParam> out;
  for (const auto& f : kPjFields) {
    LagParam lp;
    lp.name = fmt::format("pj_{}", f.name);
    lp.shape = f.per_head == 1 ? std::vector<int64_t>{heads}
                               : std::vector<int64_t>{heads, f.per_head ? f.per_head : c_.orders()};
    lp.init = p.*f.member;
    lp.trained = f.read(c_);
    out.push_back(std::move(lp));
  }
  return out;
}

std::vector<double> PjLagKernel::table(const LagParamValues& values, int heads, int64_t len) const {
  PjBiasParams p = pj_params_from(c_, values);
  if (p.heads != heads)
    throw InputError(fmt::format("pj_bias: parameters for {} heads, expected {}", p.heads, heads));
  return pj_lag_table(c_, p, len);
}

const PjBiasConfig* pj_config(const BiasTerm& b) {
  // the one cast from the generic kernel to PJ's: the diagnostics report PJ's own sectors
  const auto* k = dynamic_cast<const PjLagKernel*>(b.learned.get());
  return k ? &k->config() : nullptr;
}

PjBiasParams pj_params_from(const PjBiasConfig& c, const LagParamValues& values) {
  if (values.size() != std::size(kPjFields))
    throw InputError(fmt::format("pj_bias: {} parameter arrays, expected {}", values.size(),
                                 std::size(kPjFields)));
  PjBiasParams p;
  p.heads = static_cast<int>(values[0].size());
  p.orders = c.orders();
  for (size_t i = 0; i < values.size(); ++i) p.*kPjFields[i].member = values[i];
  return p;
}

LagParamValues pj_lag_values(const PjBiasParams& p) {
  LagParamValues v;
  for (const auto& f : kPjFields) v.push_back(p.*f.member);
  return v;
}

}  // namespace relpos
