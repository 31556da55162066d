#include "torch/composed.hpp"

#include <fmt/format.h>

#include "core/charts.hpp"

namespace relpos::nn {

namespace {

// sigma(t) on a tensor, from the chart formulas.
torch::Tensor chart_t(Chart c, const torch::Tensor& t, double L) {
  switch (c) {
    case Chart::Raw:
      return t;
    case Chart::Bounded:
      return t / (1 + t.abs() / L);
    case Chart::LightconePhi:
      return L * torch::asinh(t / L);
    case Chart::LightconeBeta:
      return t / torch::sqrt(t * t + L * L);
  }
  return t;
}

std::vector<torch::Tensor> jordan_qk(const Mechanism& m, Layout layout, const KernelParams& kp,
                                     const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& positions, double center) {
  const int64_t D = m.head_dim, P = D / 2;
  const auto dt = q.scalar_type();
  // split into real / imaginary parts of the complex coordinates: [B, H, T, D/2]
  const auto split = [&](const torch::Tensor& x) {
    if (layout == Layout::Interleaved) {
      auto v = x.view({x.size(0), x.size(1), x.size(2), P, 2});
      return std::make_pair(v.select(-1, 0), v.select(-1, 1));
    }
    return std::make_pair(x.narrow(-1, 0, P), x.narrow(-1, P, P));
  };
  const auto join = [&](const torch::Tensor& re, const torch::Tensor& im) {
    if (layout == Layout::Interleaved) return torch::stack({re, im}, -1).flatten(-2);
    return torch::cat({re, im}, -1);
  };
  // p' [B or 1, 1, T, 1]
  auto p = (positions.to(torch::kDouble) - center);
  p = (p.dim() == 1 ? p.view({1, 1, -1, 1}) : p.view({p.size(0), 1, p.size(1), 1}));
  const auto [qr, qi] = split(q);
  const auto [kr, ki] = split(k);
  std::vector<torch::Tensor> out_qr, out_qi, out_kr, out_ki;
  int64_t covered = 0;
  for (const auto& s : m.segments()) {
    const int64_t n = s.pairs(), M = s.order, NBs = s.blocks;
    covered = std::max<int64_t>(covered, s.first_pair + n);
    const auto omega = torch::tensor(s.omega, torch::kDouble).view({1, 1, 1, NBs});
    const auto ang = -(p * omega);  // [.,1,T,NBs]
    const auto cs = torch::cos(ang).to(dt).unsqueeze(-1), sn = torch::sin(ang).to(dt).unsqueeze(-1);
    const auto seg = [&](const torch::Tensor& x) {
      return x.narrow(-1, s.first_pair, n).reshape({x.size(0), x.size(1), x.size(2), NBs, M});
    };
    const auto blocks = torch::indexing::Slice(s.first_block, s.first_block + NBs);
    const auto gamma =
        kp.gamma.index({torch::indexing::Slice(), blocks}).to(dt).view({1, -1, 1, NBs});
    const auto a = (gamma * p.to(dt));  // key exponent gamma p'
    const auto ek = torch::exp(a.clamp(-s.max_exponent, s.max_exponent)).unsqueeze(-1);
    const auto eq = torch::exp((-a).clamp(-s.max_exponent, s.max_exponent)).unsqueeze(-1);
    // coefficient series c_0..c_{M-1} per [., H, T, NBs]
    const auto u = (s.shear_scale * chart_t(s.chart, -p, s.L)).to(dt);
    std::vector<torch::Tensor> c(M), ic(M);
    if (s.shear == ShearMode::Gates) {
      c[0] = kp.alpha0.index({torch::indexing::Slice(), blocks}).to(dt).view({1, -1, 1, NBs});
      auto pw = torch::ones_like(u);
      for (int64_t r = 1; r < M; ++r) {
        pw = pw * u / r;
        c[r] =
            kp.gates[r - 1].index({torch::indexing::Slice(), blocks}).to(dt).view({1, -1, 1, NBs}) *
            pw;
      }
    } else {
      const auto eta =
          s.shear == ShearMode::Exponential
              ? kp.eta.index({torch::indexing::Slice(), blocks}).to(dt).view({1, -1, 1, NBs})
              : torch::zeros({1, 1, 1, NBs}, q.options());
      c[0] = torch::ones({1, 1, 1, 1}, q.options());
      for (int64_t r = 1; r < M; ++r) c[r] = c[r - 1] * eta * u / r;
    }
    ic[0] = 1 / c[0];
    for (int64_t r = 1; r < M; ++r) {
      auto acc = c[1] * ic[r - 1];
      for (int64_t j = 2; j <= r; ++j) acc = acc + c[j] * ic[r - j];
      ic[r] = -acc / c[0];
    }
    const auto apply = [&](const torch::Tensor& xr, const torch::Tensor& xi, bool key) {
      const auto zr = seg(xr) * cs - seg(xi) * sn, zi = seg(xr) * sn + seg(xi) * cs;
      std::vector<torch::Tensor> yr(M), yi(M);
      for (int64_t r = 0; r < M; ++r) {
        torch::Tensor ar, ai;
        for (int64_t col = key ? r : 0; col < (key ? M : r + 1); ++col) {
          const auto w = (key ? c[col - r] : ic[r - col]).unsqueeze(-1).squeeze(-1);
          const auto tr = w * zr.select(-1, col), ti = w * zi.select(-1, col);
          ar = ar.defined() ? ar + tr : tr;
          ai = ai.defined() ? ai + ti : ti;
        }
        const auto e = (key ? ek : eq).squeeze(-1);
        yr[r] = ar * e;
        yi[r] = ai * e;
      }
      const auto sh = xr.sizes();
      return std::make_pair(torch::stack(yr, -1).reshape({sh[0], sh[1], sh[2], n}),
                            torch::stack(yi, -1).reshape({sh[0], sh[1], sh[2], n}));
    };
    auto [yqr, yqi] = apply(qr, qi, false);
    auto [ykr, yki] = apply(kr, ki, true);
    out_qr.push_back(yqr), out_qi.push_back(yqi), out_kr.push_back(ykr), out_ki.push_back(yki);
  }
  if (covered < P) {
    out_qr.push_back(qr.narrow(-1, covered, P - covered));
    out_qi.push_back(qi.narrow(-1, covered, P - covered));
    out_kr.push_back(kr.narrow(-1, covered, P - covered));
    out_ki.push_back(ki.narrow(-1, covered, P - covered));
  }
  return {join(torch::cat(out_qr, -1), torch::cat(out_qi, -1)),
          join(torch::cat(out_kr, -1), torch::cat(out_ki, -1))};
}

}  // namespace

std::vector<torch::Tensor> composed_transform_qk(const Mechanism& m, Layout layout,
                                                 const KernelParams& kp, const torch::Tensor& q,
                                                 const torch::Tensor& k,
                                                 const torch::Tensor& positions, double center) {
  torch::Tensor qq = q, kk = k;
  for (const auto& t : m.transforms) {
    if (t.vector_positions())
      throw InputError(
          fmt::format("composed: '{}' rotates by vector positions, not scalar ones", t.name));
    if (t.position_driven()) {
      auto out = jordan_qk(m, layout, kp, qq, kk, positions, center);
      qq = out[0];
      kk = out[1];
    } else {
      const auto D = static_cast<int64_t>(m.head_dim);
      const auto M = torch::tensor(t.matrix, torch::kDouble).view({D, D}).to(q.scalar_type());
      const auto Mit =
          torch::tensor(t.matrix_inv_t, torch::kDouble).view({D, D}).to(q.scalar_type());
      qq = torch::matmul(qq, Mit.t());
      kk = torch::matmul(kk, M.t());
    }
  }
  return {qq, kk};
}

}  // namespace relpos::nn
