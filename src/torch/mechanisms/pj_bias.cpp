// The PJ-RoPE bias's torch runtime (core/pj_bias.hpp): the lag table [H, len] built from the
// module's tensors with LibTorch ops in float64 (O(H len (R+1)), never T x T), so autograd carries
// the kernel's lag-table gradient to omega, the gate and order logits, the complex amplitudes,
// the damping and the slope. The core's float64 table is the reference it is tested against.
#include "core/pj_bias.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "torch/mechanisms/lag_runtime.hpp"

namespace relpos::nn {

namespace {

const PjBiasConfig& config_of(const LagKernel& k) {
  return dynamic_cast<const PjLagKernel&>(k).config();  // this runtime's own kernel type
}

// the parameters by name, in PjLagKernel::params() order
struct PjTensors {
  torch::Tensor omega, gate_logits, fj_alpha_logits, lc_alpha_logits;
  torch::Tensor fj_zeta_re, fj_zeta_im, lc_zeta_re, lc_zeta_im;
  torch::Tensor raw_damping, raw_slope;
  explicit PjTensors(const std::vector<torch::Tensor>& v)
      : omega(v.at(0)),
        gate_logits(v.at(1)),
        fj_alpha_logits(v.at(2)),
        lc_alpha_logits(v.at(3)),
        fj_zeta_re(v.at(4)),
        fj_zeta_im(v.at(5)),
        lc_zeta_re(v.at(6)),
        lc_zeta_im(v.at(7)),
        raw_damping(v.at(8)),
        raw_slope(v.at(9)) {}
};

// softmax over the last axis with disabled entries exactly 0 (masked_fill with -inf)
torch::Tensor masked_softmax(const torch::Tensor& logits, const torch::Tensor& on) {
  return torch::softmax(
      logits.masked_fill(on.logical_not(), -std::numeric_limits<double>::infinity()), -1);
}

// Initial values: the core's deterministic initialisation, with the zetas drawn from torch's
// generator (zeta_std N(0, 1)), as the reference's nn.Module does. float32 tensors.
std::vector<torch::Tensor> pj_initial(const LagKernel& k, int heads) {
  const PjBiasConfig& c = config_of(k);
  std::vector<torch::Tensor> t;
  for (const auto& p : k.params(heads))
    t.push_back(torch::tensor(p.init, torch::kDouble).view(p.shape).to(torch::kFloat));
  const int64_t H = heads, O = c.orders();
  for (size_t i = 4; i < 8; ++i) t[i] = torch::randn({H, O}) * c.zeta_std;  // re, im; fj, lc
  return t;
}

torch::Tensor pj_table(const LagKernel& kernel, const std::vector<torch::Tensor>& params,
                       int64_t len) {
  const PjBiasConfig& c = config_of(kernel);
  const PjTensors p(params);
  const auto f64 = [](const torch::Tensor& x) { return x.to(torch::kDouble); };
  const int64_t H = p.omega.size(0), O = c.orders();
  const double L = c.L;
  const auto f64opt = p.omega.options().dtype(torch::kDouble);  // on the parameters' device
  const auto d = torch::arange(len, f64opt);  // lags 0..len-1 (clamped at 0 by range)
  const auto on = torch::tensor({c.fj, c.affine, c.lc}, torch::kBool).view({1, 3}).to(d.device());
  const auto g = masked_softmax(f64(p.gate_logits), on);  // [H, 3]
  const auto omega = f64(p.omega).view({H, 1});
  auto table = torch::zeros({H, len}, f64opt);
  // order r's amplitude over d: [O, len]
  const auto jets = [&](const torch::Tensor& x) {
    std::vector<torch::Tensor> r;
    auto acc = torch::ones_like(x);
    for (int64_t k = 0; k < O; ++k) {
      r.push_back(acc);
      switch (c.basis) {
        case PjJetBasis::Monomial:
          acc = acc * x / L;
          break;
        case PjJetBasis::Factorial:
          acc = acc * x / (L * static_cast<double>(k + 1));
          break;
        case PjJetBasis::Binomial:
          acc = acc * (x - static_cast<double>(k)) / (L * static_cast<double>(k + 1));
          break;
      }
    }
    return torch::stack(r);
  };
  // sum_r alpha_{h,r} A_r(d) (zre_{h,r} cos(omega_h psi) - zim_{h,r} sin(omega_h psi))
  const auto branch = [&](const torch::Tensor& amp, const torch::Tensor& psi,
                          const torch::Tensor& alpha_logits, const torch::Tensor& zre,
                          const torch::Tensor& zim, const torch::Tensor& env) {
    const auto alpha = torch::softmax(f64(alpha_logits), -1);  // [H, O]
    const auto ph = omega * psi.view({1, len});                // [H, len]
    const auto cs = torch::cos(ph), sn = torch::sin(ph);
    const auto a_re = alpha * f64(zre), a_im = alpha * f64(zim);              // [H, O]
    const auto re = torch::matmul(a_re, amp), im = torch::matmul(a_im, amp);  // [H, len]
    return env * (re * cs - im * sn);
  };
  const auto damping = torch::nn::functional::softplus(f64(p.raw_damping)).view({H, 1});
  if (c.fj) {
    const auto env = torch::exp(-damping * d.view({1, len}) / L);
    table = table + g.select(1, 0).view({H, 1}) *
                        branch(jets(d), d, p.fj_alpha_logits, p.fj_zeta_re, p.fj_zeta_im, env);
  }
  if (c.affine) {
    const auto rho = c.rho == PjRho::Linear ? d / L : torch::asinh(d / L);
    const auto slope = torch::nn::functional::softplus(f64(p.raw_slope)).view({H, 1});
    table = table - g.select(1, 1).view({H, 1}) * slope * rho.view({1, len});
  }
  if (c.lc) {
    const auto phi = L * torch::asinh(d / L), beta = d / torch::sqrt(d * d + L * L);
    std::vector<torch::Tensor> pw;
    auto acc = torch::ones_like(beta);
    for (int64_t k = 0; k < O; ++k, acc = acc * beta) pw.push_back(acc);
    const auto env =
        c.lc_damped ? torch::exp(-damping * phi.view({1, len}) / L) : torch::ones({1, len}, f64opt);
    table = table + g.select(1, 2).view({H, 1}) * branch(torch::stack(pw), phi, p.lc_alpha_logits,
                                                         p.lc_zeta_re, p.lc_zeta_im, env);
  }
  return table;
}

// The learned sector gates (softmax over the enabled sectors, mean over heads) and the order
// masses of the PJ reference's summaries: gate x alpha_r x |zeta_r| per order r of the FJ and LC
// branches (raw, unnormalised, mean over heads), and their high-order mass, the sum over r >= 2
// (spec pj-rope.md 3.5, Fig. 4 bottom left, Table 4b).
std::vector<std::pair<std::string, double>> pj_stats(const LagKernel& kernel,
                                                     const std::vector<torch::Tensor>& params) {
  const PjBiasConfig& c = config_of(kernel);
  const PjTensors p(params);
  const auto f64 = [](const torch::Tensor& x) { return x.detach().to(torch::kDouble).cpu(); };
  const auto on = torch::tensor({c.fj, c.affine, c.lc}, torch::kBool).view({1, 3});
  const auto g = masked_softmax(f64(p.gate_logits), on);  // [H, 3]
  std::vector<std::pair<std::string, double>> out;
  const char* sectors[] = {"fj", "affine", "lc"};
  for (int s = 0; s < 3; ++s)
    if (c.enabled(s))
      out.emplace_back(fmt::format("gate_{}", sectors[s]), g.select(1, s).mean().item<double>());
  double high = 0;
  const auto masses = [&](int s, const torch::Tensor& alpha_logits, const torch::Tensor& zre,
                          const torch::Tensor& zim) {
    const auto alpha = torch::softmax(f64(alpha_logits), -1);  // [H, O]
    const auto mass = g.select(1, s).view({-1, 1}) * alpha * torch::hypot(f64(zre), f64(zim));
    const auto per_order = mass.mean(0);  // [O]
    for (int64_t r = 0; r < per_order.size(0); ++r) {
      const double m = per_order[r].item<double>();
      out.emplace_back(fmt::format("{}_mass_r{}", sectors[s], r), m);
      if (r >= 2) high += m;
    }
  };
  if (c.fj) masses(0, p.fj_alpha_logits, p.fj_zeta_re, p.fj_zeta_im);
  if (c.lc) masses(2, p.lc_alpha_logits, p.lc_zeta_re, p.lc_zeta_im);
  if (c.fj || c.lc) out.emplace_back("high_order_mass", high);
  return out;
}

}  // namespace

LagRuntime pj_bias_lag_runtime() {
  return {pj_initial, pj_table, pj_stats};
}

}  // namespace relpos::nn
