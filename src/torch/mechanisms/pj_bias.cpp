#include "torch/pj_bias.hpp"

#include <cmath>

namespace relpos::nn {

namespace {

torch::Tensor rows(const std::vector<double>& v, int64_t H) {
  return torch::tensor(v, torch::kDouble).view({H, -1}).squeeze(1).to(torch::kFloat);
}

// softmax over the last axis with disabled entries exactly 0 (masked_fill with -inf)
torch::Tensor masked_softmax(const torch::Tensor& logits, const torch::Tensor& on) {
  return torch::softmax(logits.masked_fill(on.logical_not(),
                                           -std::numeric_limits<double>::infinity()),
                        -1);
}

}  // namespace

PjBiasTensors pj_initial_tensors(const PjBiasConfig& c, int heads) {
  const PjBiasParams p = pj_initial_params(c, heads);
  const int64_t H = heads, O = c.orders();
  PjBiasTensors t;
  t.omega = torch::tensor(p.omega, torch::kDouble).to(torch::kFloat);
  t.gate_logits = rows(p.gate_logits, H).view({H, 3});
  t.fj_alpha_logits = rows(p.fj_alpha_logits, H).view({H, O});
  t.lc_alpha_logits = rows(p.lc_alpha_logits, H).view({H, O});
  for (auto* z : {&t.fj_zeta_re, &t.fj_zeta_im, &t.lc_zeta_re, &t.lc_zeta_im})
    *z = torch::randn({H, O}) * c.zeta_std;
  t.raw_damping = torch::tensor(p.raw_damping, torch::kDouble).to(torch::kFloat);
  t.raw_slope = torch::tensor(p.raw_slope, torch::kDouble).to(torch::kFloat);
  return t;
}

torch::Tensor pj_lag_table(const PjBiasConfig& c, const PjBiasTensors& p, int64_t len) {
  const auto f64 = [](const torch::Tensor& x) { return x.to(torch::kDouble); };
  const int64_t H = p.omega.size(0), O = c.orders();
  const double L = c.L;
  const auto d = torch::arange(len, torch::kDouble);  // lags 0..len-1 (clamped at 0 by range)
  const auto on = torch::tensor({c.fj, c.affine, c.lc}, torch::kBool).view({1, 3});
  const auto g = masked_softmax(f64(p.gate_logits), on);  // [H, 3]
  const auto omega = f64(p.omega).view({H, 1});
  auto table = torch::zeros({H, len}, torch::kDouble);
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
    const auto ph = omega * psi.view({1, len});               // [H, len]
    const auto cs = torch::cos(ph), sn = torch::sin(ph);
    const auto a_re = alpha * f64(zre), a_im = alpha * f64(zim);  // [H, O]
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
    const auto env = c.lc_damped ? torch::exp(-damping * phi.view({1, len}) / L)
                                 : torch::ones({1, len}, torch::kDouble);
    table = table + g.select(1, 2).view({H, 1}) * branch(torch::stack(pw), phi, p.lc_alpha_logits,
                                                         p.lc_zeta_re, p.lc_zeta_im, env);
  }
  return table;
}

PjBiasParams pj_param_values(const PjBiasConfig& c, const PjBiasTensors& t) {
  PjBiasParams p;
  p.heads = static_cast<int>(t.omega.size(0));
  p.orders = c.orders();
  const auto vec = [](const torch::Tensor& x) {
    const auto y = x.detach().to(torch::kDouble).contiguous().flatten();
    return std::vector<double>(y.data_ptr<double>(), y.data_ptr<double>() + y.numel());
  };
  p.omega = vec(t.omega);
  p.gate_logits = vec(t.gate_logits);
  p.fj_alpha_logits = vec(t.fj_alpha_logits);
  p.lc_alpha_logits = vec(t.lc_alpha_logits);
  p.fj_zeta_re = vec(t.fj_zeta_re);
  p.fj_zeta_im = vec(t.fj_zeta_im);
  p.lc_zeta_re = vec(t.lc_zeta_re);
  p.lc_zeta_im = vec(t.lc_zeta_im);
  p.raw_damping = vec(t.raw_damping);
  p.raw_slope = vec(t.raw_slope);
  return p;
}

}  // namespace relpos::nn
