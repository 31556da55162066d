// GRAPE's content-dependent biases (core/mechanisms/grape.cpp; spec grape-joformer.md 2.5-2.8):
//   grape_a   gated slopes -(i - j)(gq_i + gk_j): gq_i = omega_h softplus(v_h . q_i / sqrt D),
//             gk_j = omega_h softplus(u_h . k_j / sqrt D) on the scored q and k (unit u, v in the
//             reference form, raw in the paper's); omega_h = softplus(rho_h) m_h (reference,
//             rho = softplus^{-1}(1)) or softplus(rho_h) (paper, rho = softplus^{-1}(m_h))
//   fox       c_i - c_j with c_t = sum_{s<=t} log sigmoid(w_h . x_s + b_h), b = 0 (float64 sums:
//             the kernel subtracts them before rounding)
//   grape_ap  path integral sum_{l=j+1..i} beta_h logsigmoid(p_i . R_l p^_l / P) with probes
//             p = W_p x, the key probe RMS-normalised and rotated by l rad; beta_h = m_h
//             (reference) or softplus(rho_h) and the query probe normalised too (paper)
//   grape_m   q and k turned by -t theta_m per plane, theta_m = exp(lambda_m / s) learned (s = 16;
//             1 with context=true), at positions t or at the causal content phase
//             Phi_t = sum_{s<t} sigmoid((w.x_s + b) / 16); basis=cayley|exp: E R E^T with a learned
//             orthogonal E (E = I at init: GRAPE-M exactly)
// The parameters are created in the reference module's order and with its initialisation, so a
// seeded model draws the same numbers as before this runtime existed.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "core/types.hpp"
#include "kernels/rotate.hpp"
#include "torch/grape_generators.hpp"
#include "torch/journey.hpp"
#include "torch/mechanisms/content_runtime.hpp"
#include "torch/op_util.hpp"
#include "torch/scan.hpp"

namespace relpos::nn {

namespace {

// softplus^{-1}(y) = ln(e^y - 1), for initialising softplus-parameterised scales
torch::Tensor inverse_softplus(const torch::Tensor& y) {
  return torch::log(torch::expm1(y));
}

// ALiBi slopes m_h of the term (a float32 buffer in the reference), in `dt`
torch::Tensor slopes(const BiasTerm& t, torch::ScalarType dt) {
  return torch::tensor(t.slopes, torch::kDouble).to(torch::kFloat).to(dt);
}

// x / sqrt(mean(x^2) + eps) over the last axis, eps = the dtype's machine epsilon (torch's
// RMSNorm default), computed in float32 at least (the reference's RMSNorm casts to fp32)
torch::Tensor rms(const torch::Tensor& x) {
  const bool dbl = x.scalar_type() == torch::kDouble;
  const auto xf = dbl ? x : x.to(torch::kFloat);
  const double eps = dbl ? DBL_EPSILON : FLT_EPSILON;
  return (xf * torch::rsqrt(xf.square().mean(-1, true) + eps)).to(x.scalar_type());
}

// a Linear(model_dim, out) registered as submodule `name`; its weight (and bias)
std::vector<torch::Tensor> linear(torch::nn::Module& owner, const char* name, int64_t in,
                                  int64_t out, bool bias) {
  auto l =
      owner.register_module(name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)));
  if (!bias) return {l->weight};
  torch::nn::init::zeros_(l->bias);
  return {l->weight, l->bias};
}

// W x (+ b) for inputs [B, T, model_dim], checking model_dim against the weight
torch::Tensor project(const BiasTerm& t, const torch::Tensor& x, const torch::Tensor& w,
                      const torch::Tensor& b = {}) {
  if (x.size(2) != w.size(1))
    throw InputError(fmt::format("{}: inputs have model_dim {}; the projection was built for {}",
                                 t.name, x.size(2), w.size(1)));
  return torch::nn::functional::linear(x, w.to(x.scalar_type()),
                                       b.defined() ? b.to(x.scalar_type()) : b);
}

// project's product for a host step of a few tokens, in plain loops: x [B, T, M] by w [N, M]
// (and + b [N]) into [B, T, N] of x's dtype. For a decode step ATen's linear and its BLAS call
// cost several times the product, most of all on cold caches (a layer's step in a many-layer
// decoder). A larger product (a prefill, a wide batch) goes to BLAS, and so does anything linear
// would refuse (a weight or bias of another shape or device: its error).
torch::Tensor project_host(const BiasTerm& t, const torch::Tensor& x, const torch::Tensor& w,
                           const torch::Tensor& b = {}) {
  constexpr int64_t kMaxProducts = int64_t{1} << 20;  // (16 tokens of 512 x 64)
  const bool loops = x.dim() == 3 && w.dim() == 2 && x.size(2) == w.size(1) && x.is_cpu() &&
                     w.is_cpu() &&
                     (!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0) && b.is_cpu())) &&
                     x.size(0) * x.size(1) * w.size(0) * w.size(1) <= kMaxProducts;
  if (!loops) return project(t, x, w, b).contiguous();
  const auto xs = x.contiguous();
  const auto ws = op_util::stored(w, x.scalar_type()).contiguous();
  const auto bs = b.defined() ? op_util::stored(b, x.scalar_type()).contiguous() : b;
  const int64_t rows = x.size(0) * x.size(1), M = x.size(2), N = w.size(0);
  auto out = torch::empty({x.size(0), x.size(1), N}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "relpos_project_host", [&] {
    const scalar_t *X = xs.data_ptr<scalar_t>(), *W = ws.data_ptr<scalar_t>();
    const scalar_t* B = bs.defined() ? bs.data_ptr<scalar_t>() : nullptr;
    scalar_t* Y = out.data_ptr<scalar_t>();
    constexpr int64_t U = 8;  // independent partial sums: a loop that vectorises
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < N; ++n) {
        const scalar_t *xr = X + r * M, *wn = W + n * M;
        scalar_t acc[U] = {};
        int64_t j = 0;
        for (; j + U <= M; j += U)
          for (int64_t u = 0; u < U; ++u) acc[u] += xr[j + u] * wn[j + u];
        scalar_t sum = 0;
        for (int64_t u = 0; u < U; ++u) sum += acc[u];
        for (; j < M; ++j) sum += xr[j] * wn[j];
        Y[r * N + n] = B ? sum + B[n] : sum;
      }
  });
  return out;
}

// Refuses a parameter of another shape than its term makes for the call's query heads (one a
// user assigned: the host loops would read past its end, the ATen forms fail with a shape
// error). want[i]: the shape of names(t)[i], -1 for a size checked elsewhere (a projection's
// model_dim: project's error).
void check_param_shapes(const BiasTerm& t, const std::vector<torch::Tensor>& p,
                        const std::vector<std::string>& names,
                        const std::vector<std::vector<int64_t>>& want) {
  for (size_t i = 0; i < p.size() && i < want.size(); ++i) {
    const auto& x = p[i];
    if (!x.defined()) continue;  // (an absent bias: linear's)
    bool ok = x.dim() == static_cast<int64_t>(want[i].size());
    for (size_t d = 0; ok && d < want[i].size(); ++d)
      ok = want[i][d] < 0 || x.size(static_cast<int64_t>(d)) == want[i][d];
    if (!ok) {
      std::vector<std::string> shape;
      for (const int64_t n : want[i]) shape.push_back(n < 0 ? "model_dim" : std::to_string(n));
      throw InputError(fmt::format("{}: parameter {} is [{}]; the module's term needs [{}]", t.name,
                                   names[i], fmt::join(x.sizes(), ", "), fmt::join(shape, ", ")));
    }
  }
}

// A cached step on the host without autograd (a decode step): the side tensors are then computed
// in one pass of plain loops, as the ATen forms below would compute them. A decode step's dozen
// small ops cost more than its attention at a few thousand keys (docs/performance.md).
bool host_step(const ContentCall& c, const std::vector<torch::Tensor>& p) {
  if (!c.past_lengths.defined() || !c.inputs.is_cpu() || !c.q.is_cpu() ||
      !c.inputs.is_floating_point() || op_util::is_half(c.inputs.scalar_type()) ||
      c.inputs.scalar_type() != c.q.scalar_type())
    return false;
  if (!torch::GradMode::is_enabled()) return true;
  if (c.inputs.requires_grad()) return false;
  for (const auto& t : p)
    if (t.requires_grad()) return false;
  return true;
}

// -------- grape_a

std::vector<std::string> gated_names(const BiasTerm& t) {
  std::vector<std::string> n;
  if (t.gate != "q") n.push_back("gate_u");
  if (t.gate != "k") n.push_back("gate_v");
  n.push_back("gate_rho");
  return n;
}

std::vector<torch::Tensor> gated_create(const BiasTerm& t, torch::nn::Module& owner, int64_t,
                                        int64_t heads, int64_t D) {
  std::vector<torch::Tensor> p;
  if (t.gate != "q")
    p.push_back(
        owner.register_parameter("gate_u", torch::randn({heads, D}) / std::sqrt(double(D))));
  if (t.gate != "k")
    p.push_back(
        owner.register_parameter("gate_v", torch::randn({heads, D}) / std::sqrt(double(D))));
  const auto m = slopes(t, torch::kDouble);
  p.push_back(owner.register_parameter(
      "gate_rho",
      inverse_softplus(t.paper_form ? m : torch::ones({heads}, torch::kDouble)).to(torch::kFloat)));
  return p;
}

// A cached step's gates in plain loops (the query gates and the new keys' gates), where nothing
// records their gradients: the same numbers as the ATen forms below to rounding.
bool gated_host_step(const ContentCall& c, const std::vector<torch::Tensor>& p) {
  if (!c.past_lengths.defined() || !c.q.is_cpu() || !c.k.is_cpu() ||
      (c.q.scalar_type() != torch::kFloat && c.q.scalar_type() != torch::kDouble) ||
      c.k.scalar_type() != c.q.scalar_type())
    return false;
  if (!torch::GradMode::is_enabled()) return true;
  if (c.q.requires_grad() || c.k.requires_grad()) return false;
  return std::none_of(p.begin(), p.end(), [](const torch::Tensor& t) { return t.requires_grad(); });
}

std::vector<torch::Tensor> gated_host(const BiasTerm& t, const std::vector<torch::Tensor>& p,
                                      const ContentCall& c, AttentionArgs& a) {
  const auto dt = c.q.scalar_type();
  const int64_t B = c.q.size(0), H = c.q.size(1), T = c.q.size(2), D = c.q.size(3);
  const auto q = c.q.contiguous(), k = c.k.contiguous();
  const auto rho = op_util::stored(p.back(), dt).contiguous(), m = slopes(t, dt).contiguous();
  std::vector<torch::Tensor> side;
  AT_DISPATCH_FLOATING_TYPES(dt, "relpos_gated_host_step", [&] {
    using S = scalar_t;
    const auto softplus = [](S x) { return x > S(20) ? x : S(std::log1p(std::exp(x))); };
    const S* r = rho.data_ptr<S>();
    const S* ms = m.data_ptr<S>();
    const S root = S(std::sqrt(double(D)));
    // gates [B, H, T] of rows y ([B, Hy, T, D], query head h reading row head h / (H / Hy))
    const auto gates = [&](const torch::Tensor& dir, const torch::Tensor& y) {
      const auto d = op_util::stored(dir, dt).contiguous();
      auto out = torch::empty({B, H, T}, q.options());
      const S* dp = d.data_ptr<S>();
      const S* yp = y.data_ptr<S>();
      S* o = out.data_ptr<S>();
      const int64_t Hy = y.size(1), per = H / Hy;
      std::vector<S> unit(static_cast<size_t>(D));
      for (int64_t h = 0; h < H; ++h) {
        S norm = 1;
        if (!t.paper_form) {
          S ss = 0;
          for (int64_t e = 0; e < D; ++e) ss += dp[h * D + e] * dp[h * D + e];
          norm = std::max(S(std::sqrt(ss)), S(1e-6));
        }
        for (int64_t e = 0; e < D; ++e)
          unit[e] = t.paper_form ? dp[h * D + e] : dp[h * D + e] / norm;
        const S omega = t.paper_form ? softplus(r[h]) : softplus(r[h]) * ms[h];
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i < T; ++i) {
            const S* row = yp + ((b * Hy + h / per) * T + i) * D;
            S z = 0;
            for (int64_t e = 0; e < D; ++e) z += row[e] * unit[e];
            o[(b * H + h) * T + i] = softplus(z / root) * omega;
          }
      }
      return out;
    };
    size_t i = 0;
    if (t.gate != "q") side.push_back(gates(p[i++], k));
    if (t.gate != "k") a.gq = gates(p[i++], q);
  });
  return side;
}

std::vector<torch::Tensor> gated_prepare(const BiasTerm& t, const std::vector<torch::Tensor>& p,
                                         const ContentCall& c, AttentionArgs& a) {
  const int64_t H = c.q.size(1), D = c.q.size(3);
  std::vector<std::vector<int64_t>> want(p.size(), {H, D});  // gate_u, gate_v
  if (!want.empty()) want.back() = {H};                      // gate_rho
  check_param_shapes(t, p, gated_names(t), want);
  if (gated_host_step(c, p)) return gated_host(t, p, c, a);
  const auto dt = c.q.scalar_type();
  const auto rho = p.back().to(dt);
  const auto omega =
      t.paper_form ? torch::softplus(rho) : torch::softplus(rho) * slopes(t, dt).to(rho.device());
  // passed pre-multiplied: the kernel adds -(i - j)(gq_i + gk_j)
  const auto gates = [&](const torch::Tensor& dir, const torch::Tensor& y) {
    auto d = dir.to(dt);
    if (!t.paper_form) d = d / d.norm(2, -1, true).clamp_min(1e-6);
    const auto z = torch::einsum("bhtd,hd->bht", {y, d}) / std::sqrt(double(D));
    return torch::softplus(z) * omega.view({1, H, 1});
  };
  size_t i = 0;
  std::vector<torch::Tensor> side;
  // grouped heads: query head h's key gates read its key/value head's keys
  const int64_t g = H / c.k.size(1);
  if (t.gate != "q") side.push_back(gates(p[i++], g == 1 ? c.k : c.k.repeat_interleave(g, 1)));
  if (t.gate != "k") a.gq = gates(p[i++], c.q);
  return side;
}

void gated_attach(const std::vector<torch::Tensor>& keys, AttentionArgs& a) {
  if (!keys.empty()) a.gk = keys[0];
}

// -------- fox

std::vector<std::string> fox_names(const BiasTerm&) {
  return {"fox.weight", "fox.bias"};
}

std::vector<torch::Tensor> fox_create(const BiasTerm&, torch::nn::Module& owner, int64_t model_dim,
                                      int64_t heads, int64_t) {
  return linear(owner, "fox", model_dim, heads, true);
}

// c continued from each row's last cached key: c_t = c_last + sum_{s<=t} log sigmoid(z_s), the
// log-sigmoids in z's dtype and the sums in float64 (as below)
torch::Tensor fox_host_step(const BiasTerm& t, const std::vector<torch::Tensor>& p,
                            const ContentCall& c) {
  const auto z = project_host(t, c.inputs, p[0], p[1]);  // [B, T, H]
  const int64_t B = z.size(0), T = z.size(1), H = z.size(2);
  auto cq = torch::empty({B, H, T}, z.options().dtype(torch::kDouble));
  const auto L = c.past_lengths.to(torch::kLong).contiguous();
  const int64_t* len = L.data_ptr<int64_t>();
  const bool cached = !c.past.empty() && c.past[0].size(2) > 0;
  const auto past = cached ? c.past[0].accessor<double, 3>() : cq.accessor<double, 3>();
  auto out = cq.accessor<double, 3>();
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "relpos_fox_host_step", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const double c0 = cached && len[b] > 0 ? past[b][h][len[b] - 1] : 0.0;
        double run = 0.0;
        for (int64_t i = 0; i < T; ++i) {
          const scalar_t x = zp[(b * T + i) * H + h];
          run += static_cast<double>(std::min(x, scalar_t(0)) - std::log1p(std::exp(-std::abs(x))));
          out[b][h][i] = c0 + run;
        }
      }
  });
  return cq;
}

std::vector<torch::Tensor> fox_prepare(const BiasTerm& t, const std::vector<torch::Tensor>& p,
                                       const ContentCall& c, AttentionArgs& a) {
  check_param_shapes(t, p, fox_names(t), {{c.q.size(1), -1}, {c.q.size(1)}});
  if (host_step(c, p)) {
    a.cq = fox_host_step(t, p, c);
    return {a.cq};
  }
  const auto logf =
      torch::log_sigmoid(project(t, c.inputs, p[0], p[1])).transpose(1, 2).to(torch::kDouble);
  const int64_t B = logf.size(0), H = logf.size(1);
  // c continues from each row's last cached key
  torch::Tensor c0 = torch::zeros({B, H, 1}, logf.options());
  if (!c.past.empty() && c.past[0].size(2) > 0) {
    const auto last = (c.past_lengths - 1).clamp_min(0).view({B, 1, 1}).expand({B, H, 1});
    c0 = c.past[0].gather(2, last) * (c.past_lengths > 0).view({B, 1, 1});
  }
  a.cq = c0 + torch::cumsum(logf, 2);
  return {a.cq};
}

void fox_attach(const std::vector<torch::Tensor>& keys, AttentionArgs& a) {
  a.ck = keys.at(0);
}

// -------- grape_ap

std::vector<std::string> path_names(const BiasTerm& t) {
  std::vector<std::string> n{"probe.weight"};
  if (t.paper_form) n.push_back("probe_rho");
  return n;
}

std::vector<torch::Tensor> path_create(const BiasTerm& t, torch::nn::Module& owner,
                                       int64_t model_dim, int64_t heads, int64_t) {
  auto p = linear(owner, "probe", model_dim, heads * t.probe_dim, false);
  if (t.paper_form)
    p.push_back(owner.register_parameter(
        "probe_rho", inverse_softplus(slopes(t, torch::kDouble)).to(torch::kFloat)));
  return p;
}

// The probes of a host step: path_k the key probes RMS-normalised (sums in float64) and turned by
// their position in every plane (the rotation kernel), path_q the query probes (normalised in the
// paper's form), beta per head; the same numbers as the ATen forms below to rounding.
std::vector<torch::Tensor> path_host_step(const BiasTerm& t, const std::vector<torch::Tensor>& p,
                                          const ContentCall& c, AttentionArgs& a) {
  const int64_t B = c.q.size(0), H = c.q.size(1), T = c.q.size(2), P = t.probe_dim;
  const auto probes = project_host(t, c.inputs, p[0]);  // [B, T, H P]
  const auto opts = probes.options();
  auto path_k = torch::empty({B, H, T, P}, opts), path_q = torch::empty({B, H, T, P}, opts);
  auto beta = torch::empty({H}, opts);
  const auto pos = op_util::stored(c.positions, torch::kDouble).contiguous();  // [T] or [B, T]
  const auto rho =
      t.paper_form ? op_util::stored(p[1], probes.scalar_type()).contiguous() : torch::Tensor();
  const int64_t pos_rows = pos.dim() == 1 ? 1 : B;
  AT_DISPATCH_FLOATING_TYPES(probes.scalar_type(), "relpos_path_host_step", [&] {
    using S = scalar_t;
    const double eps = std::is_same_v<S, double> ? DBL_EPSILON : FLT_EPSILON;
    const S* x = probes.data_ptr<S>();
    S *k = path_k.data_ptr<S>(), *q = path_q.data_ptr<S>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < T; ++i) {
          const S* xi = x + (b * T + i) * H * P + h * P;
          double ss = 0.0;
          for (int64_t j = 0; j < P; ++j) ss += double(xi[j]) * double(xi[j]);
          const S r = S(1.0 / std::sqrt(ss / double(P) + eps));
          S* ki = k + ((b * H + h) * T + i) * P;
          S* qi = q + ((b * H + h) * T + i) * P;
          for (int64_t j = 0; j < P; ++j) {
            ki[j] = xi[j] * r;
            qi[j] = t.paper_form ? ki[j] : xi[j];
          }
        }
    // every plane turns by the position (l rad at position l)
    std::vector<S> cs(static_cast<size_t>(pos_rows * T * P / 2)), sn(cs.size());
    const double* pp = pos.data_ptr<double>();
    for (int64_t i = 0; i < pos_rows * T; ++i) {
      const S angle = static_cast<S>(pp[i]);
      const auto at = cs.begin() + i * (P / 2);
      std::fill(at, at + P / 2, std::cos(angle));
      std::fill(sn.begin() + i * (P / 2), sn.begin() + (i + 1) * (P / 2), std::sin(angle));
    }
    kernels::rotate_pairs_forward<S>({B, H, T, P, P / 2, pos_rows > 1}, Layout::HalfSplit, false, k,
                                     cs.data(), sn.data(), k);
    S* bp = beta.data_ptr<S>();
    for (int64_t h = 0; h < H; ++h) {
      if (t.paper_form) {
        const S r = rho.data_ptr<S>()[h];  // softplus, threshold 20 as torch's
        bp[h] = r > S(20) ? r : std::log1p(std::exp(r));
      } else {
        bp[h] = static_cast<S>(static_cast<float>(t.slopes.at(static_cast<size_t>(h))));
      }
    }
  });
  a.path_q = path_q;
  a.path_beta = beta;
  a.path_scale = 1.0 / static_cast<double>(P);
  return {path_k};
}

std::vector<torch::Tensor> path_prepare(const BiasTerm& t, const std::vector<torch::Tensor>& p,
                                        const ContentCall& c, AttentionArgs& a) {
  check_param_shapes(t, p, path_names(t), {{c.q.size(1) * t.probe_dim, -1}, {c.q.size(1)}});
  if (host_step(c, p)) return path_host_step(t, p, c, a);
  const auto dt = c.q.scalar_type();
  const int64_t B = c.q.size(0), H = c.q.size(1), T = c.q.size(2), P = t.probe_dim;
  const auto probes = project(t, c.inputs, p[0]).view({B, T, H, P}).transpose(1, 2).to(dt);
  // l rad per plane at each token's position: [T, P/2] or [B, T, P/2]
  const auto angles = c.positions.to(dt).unsqueeze(-1).expand(
      c.positions.dim() == 1 ? std::vector<int64_t>{T, P / 2} : std::vector<int64_t>{B, T, P / 2});
  const auto path_k = rotate_pairs(rms(probes), Frame::of(angles), false, Layout::HalfSplit);
  a.path_q = t.paper_form ? rms(probes) : probes.contiguous();
  a.path_beta = t.paper_form ? torch::softplus(p[1].to(dt)) : slopes(t, dt).to(c.q.device());
  a.path_scale = 1.0 / static_cast<double>(P);
  return {path_k};
}

void path_attach(const std::vector<torch::Tensor>& keys, AttentionArgs& a) {
  a.path_k = keys.at(0);
}

// -------- grape_m

std::vector<std::string> rotation_names(const TransformTerm& t) {
  std::vector<std::string> n{"log_freq"};
  if (t.basis != "none") n.push_back("basis_w");
  if (t.time == TimeSource::ContentPhase) {
    n.push_back("ctx_w");
    n.push_back("ctx_b");
  }
  return n;
}

std::vector<torch::Tensor> rotation_create(const TransformTerm& t, torch::nn::Module& owner,
                                           int64_t model_dim, int64_t /*kv_heads*/, int64_t D) {
  // lambda_m = s ln theta_m at the initial spectrum (segments store -theta: frame angle
  // = -omega p, journey.hpp); no random draws
  std::vector<double> lam;
  for (const auto& seg : t.segments)
    for (double w : seg.omega) lam.push_back(t.frequency_scale * std::log(-w));
  std::vector<torch::Tensor> p{
      owner.register_parameter("log_freq", torch::tensor(lam, torch::kDouble).to(torch::kFloat))};
  if (t.basis != "none")  // E = I at init: GRAPE-M (and RoPE) exactly
    p.push_back(owner.register_parameter("basis_w", torch::zeros({D, D})));
  if (t.time == TimeSource::ContentPhase) {
    // the reference's init: w = 0, b = softplus^{-1}(1e-3), so omega = sigmoid(b / 16) ~ 0.394
    p.push_back(owner.register_parameter("ctx_w", torch::zeros({model_dim})));
    p.push_back(owner.register_parameter("ctx_b", torch::full({1}, std::log(std::expm1(1e-3)))));
  }
  return p;
}

Rotated rotation_rotate(const TransformTerm& t, const std::vector<torch::Tensor>& p,
                        const RotationCall& c) {
  const auto dt = c.q.scalar_type();
  const auto theta = torch::exp(p[0] / t.frequency_scale).to(dt);
  Rotated out;
  torch::Tensor angles;
  if (t.time == TimeSource::ContentPhase) {
    const auto& x = c.inputs;
    const auto& w = p[p.size() - 2];
    if (x.size(2) != w.size(0))
      throw InputError(fmt::format("{}: inputs have model_dim {}; the phase was built for {}",
                                   t.name, x.size(2), w.size(0)));
    const auto om = torch::sigmoid(
        (torch::matmul(x, w.to(x.scalar_type())) + p.back().to(x.scalar_type())) / 16.0);  // [B, T]
    const Phases ph = continued_phases(om.unsqueeze(-1), c.phase, c.starts);  // [B, T, 1]
    out.phase_end = ph.end;
    angles = ph.phases.to(dt) * theta;  // [B, T, D/2]
  } else {
    angles = c.positions.to(dt).unsqueeze(-1) * theta;  // [T, D/2] or [B, T, D/2]
  }
  const Frame f = Frame::of(angles);
  if (t.basis != "none") {
    // E R E^T with the frame's planes (basis_rotate turns half-split pairs by +angle, as
    // rotate_pairs does); angles [B, T, D/2] broadcast over heads
    if (c.layout != Layout::HalfSplit)
      throw InputError(fmt::format(
          "{}: a learned basis turns half-split planes: build the module with the half-split "
          "pair layout",
          t.name));
    const auto E = orthogonal_basis(p[1].to(dt), t.basis == "exp");
    const auto cs = f.cos.dim() == 3 ? f.cos.unsqueeze(1) : f.cos,
               sn = f.sin.dim() == 3 ? f.sin.unsqueeze(1) : f.sin;
    out.q = basis_rotate(c.q, E, cs, sn);
    out.k = basis_rotate(c.k, E, cs, sn);
  } else {
    out.q = rotate_pairs(c.q, f, false, c.layout);
    out.k = rotate_pairs(c.k, f, false, c.layout);
  }
  return out;
}

}  // namespace

RotationRuntime grape_m_rotation_runtime() {
  return {rotation_names, rotation_create, rotation_rotate};
}

ContentRuntime grape_a_content_runtime() {
  return {false, gated_names, gated_create, gated_prepare, gated_attach};
}
ContentRuntime fox_content_runtime() {
  return {true, fox_names, fox_create, fox_prepare, fox_attach};
}
ContentRuntime grape_ap_content_runtime() {
  return {true, path_names, path_create, path_prepare, path_attach};
}

}  // namespace relpos::nn
