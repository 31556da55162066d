#include "torch/grape_generators.hpp"

#include <fmt/format.h>

#include <array>
#include <cmath>

#include "core/types.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Below this |w| the values come from the three-term series (its error, w^3 / 5040, is far
// below the dtype's epsilon there); the closed forms need w != 0.
double value_threshold(torch::ScalarType t) {
  return t == torch::kDouble ? 1e-8 : 1e-4;
}

// Taylor coefficients of S1'(w) = sum_{k>=1} k (-1)^k w^{k-1} / (2k+1)! (shift 1) and
// S2'(w) = sum_{k>=1} k (-1)^k w^{k-1} / (2k+2)! (shift 2), k = 1..10: for |w| < 1 the first
// omitted term is below 11 / 23! ~ 4e-22.
constexpr int kDerivTerms = 10;

std::array<double, kDerivTerms> derivative_coefficients(int shift) {
  std::array<double, kDerivTerms> c{};
  for (int k = 1; k <= kDerivTerms; ++k) {
    double fact = 1;
    for (int i = 2; i <= 2 * k + shift; ++i) fact *= i;
    c[k - 1] = (k % 2 ? -1.0 : 1.0) * k / fact;
  }
  return c;
}

torch::Tensor horner(const torch::Tensor& w, const std::array<double, kDerivTerms>& c) {
  auto acc = torch::full_like(w, c[kDerivTerms - 1]);
  for (int i = kDerivTerms - 2; i >= 0; --i) acc = acc * w + c[i];
  return acc;
}

// {sin(sqrt z) / sqrt z, cos(sqrt z)} for z != 0 (z < 0: sinh, cosh of sqrt(-z)); each branch is
// evaluated at an argument that is safe for it, so no NaN or Inf reaches a gradient.
std::pair<torch::Tensor, torch::Tensor> sinc_cos(const torch::Tensor& z) {
  const auto pos = z > 0;
  const auto one = torch::ones_like(z);
  const auto rp = torch::where(pos, z, one).sqrt();
  const auto rn = torch::where(pos, one, -z).sqrt();
  return {torch::where(pos, rp.sin() / rp, rn.sinh() / rn), torch::where(pos, rp.cos(), rn.cosh())};
}

variable_list s_values(const torch::Tensor& w) {
  const auto small = w.abs() < value_threshold(w.scalar_type());
  const auto ws = torch::where(small, torch::ones_like(w), w);
  const auto s1c = sinc_cos(ws).first;
  const auto half = sinc_cos(0.25 * ws).first;  // 1 - cos r = 2 sin^2(r/2): no cancellation
  const auto s2c = 0.5 * half * half;
  const auto s1s = 1.0 + w * (-1.0 / 6 + w / 120);
  const auto s2s = 0.5 + w * (-1.0 / 24 + w / 720);
  return {torch::where(small, s1s, s1c), torch::where(small, s2s, s2c)};
}

variable_list s_derivatives(const torch::Tensor& w) {
  static const auto c1 = derivative_coefficients(1), c2 = derivative_coefficients(2);
  const auto small = w.abs() < 1.0;
  const auto ws = torch::where(small, torch::full_like(w, 2.0), w);
  const auto [s1, c] = sinc_cos(ws);
  const auto half = sinc_cos(0.25 * ws).first;
  const auto s2 = 0.5 * half * half;
  const auto d1 = (c - s1) / (2 * ws), d2 = (s1 - 2 * s2) / (2 * ws);
  return {torch::where(small, horner(w, c1), d1), torch::where(small, horner(w, c2), d2)};
}

class RodriguesSFunction : public torch::autograd::Function<RodriguesSFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& w) {
    ctx->save_for_backward({w});
    return s_values(w);
  }
  // written with torch ops on the saved w, so a create_graph backward differentiates it again
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto w = ctx->get_saved_variables()[0];
    const auto d = s_derivatives(w);
    return {grad[0] * d[0] + grad[1] * d[1]};
  }
};

void require(bool ok, const std::string& what) {
  if (!ok) throw InputError(what);
}

void require_float(const torch::Tensor& t, const char* fn, const char* name) {
  require(t.defined(), fmt::format("{}: {} is undefined", fn, name));
  require(op_util::storable(t.scalar_type()),
          fmt::format("{}: {} must be float32, float64, bfloat16 or float16", fn, name));
}

void require_x(const torch::Tensor& x, const char* fn) {
  require_float(x, fn, "x");
  require(x.dim() == 4, fmt::format("{}: x must be [B, H, T, D], got {} dims", fn, x.dim()));
}

// positions [T] or [B, T] as [Bp, 1, T] in dtype ct
torch::Tensor positions_as(const torch::Tensor& positions, const torch::Tensor& x,
                           torch::ScalarType ct, const char* fn) {
  const int64_t B = x.size(0), T = x.size(2);
  require(positions.defined(), fmt::format("{}: positions is undefined", fn));
  const bool ok = (positions.dim() == 1 && positions.size(0) == T) ||
                  (positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T);
  require(ok, fmt::format("{}: positions must be [T] or [B, T] with T = {}, B = {}", fn, T, B));
  return positions.to(ct).reshape({positions.dim() == 2 ? B : 1, 1, T});
}

torch::ScalarType coefficient_dtype(std::initializer_list<torch::Tensor> params,
                                    const torch::Tensor& positions) {
  auto ct = torch::kFloat;  // half parameters: coefficients in float32
  for (const auto& p : params) ct = c10::promoteTypes(ct, p.scalar_type());
  if (c10::isFloatingType(positions.scalar_type()))
    ct = c10::promoteTypes(ct, positions.scalar_type());
  return ct;
}

}  // namespace

std::vector<torch::Tensor> rodrigues_s(const torch::Tensor& w) {
  require_float(w, "rodrigues_s", "w");
  return RodriguesSFunction::apply(w);
}

torch::Tensor rodrigues_rotate(const torch::Tensor& x_in, const torch::Tensor& a,
                               const torch::Tensor& b, const torch::Tensor& omega,
                               const torch::Tensor& positions, bool inverse) {
  const char* fn = "rodrigues_rotate";
  require_x(x_in, fn);
  const auto x = op_util::computed(x_in);  // half storage: mixed in float32
  require_float(a, fn, "a");
  require_float(b, fn, "b");
  require_float(omega, fn, "omega");
  const int64_t H = x.size(1), D = x.size(3);
  require(a.sizes() == b.sizes(), fmt::format("{}: a and b must have one shape", fn));
  require((a.dim() == 1 && a.size(0) == D) || (a.dim() == 2 && a.size(0) == H && a.size(1) == D),
          fmt::format("{}: a, b must be [H, D] or [D] with H = {}, D = {}", fn, H, D));
  require(omega.numel() == 1 || (omega.dim() == 1 && omega.size(0) == H),
          fmt::format("{}: omega must be a scalar or [H] with H = {}", fn, H));
  const int64_t Ha = a.dim() == 2 ? H : 1;

  // per head and position: alpha, beta, gamma, s^2 and f1, f2 in the coefficient dtype
  const auto ct = coefficient_dtype({a, b, omega}, positions);
  const auto ac = a.to(ct).reshape({Ha, D}), bc = b.to(ct).reshape({Ha, D});
  const auto alpha = (ac * ac).sum(-1), beta = (bc * bc).sum(-1), gamma = (ac * bc).sum(-1);
  const auto s2 = alpha * beta - gamma * gamma;  // may round below 0: S1, S2 are entire in w
  const auto pos = positions_as(positions, x, ct, fn);
  const auto phi = (inverse ? -1.0 : 1.0) * omega.to(ct).reshape({1, -1, 1}) * pos;
  const auto S = RodriguesSFunction::apply(phi * phi * s2.view({1, Ha, 1}));
  const auto xt = x.scalar_type();
  const auto f1 = (phi * S[0]).unsqueeze(-1).to(xt);  // [Bp, H or 1, T, 1]
  const auto f2 = (phi * phi * S[1]).unsqueeze(-1).to(xt);
  const auto al = alpha.to(xt).view({1, Ha, 1, 1}), be = beta.to(xt).view({1, Ha, 1, 1}),
             ga = gamma.to(xt).view({1, Ha, 1, 1});

  // the O(D) mixing in x's dtype
  const auto ax = a.to(xt).reshape({Ha, D, 1}), bx = b.to(xt).reshape({Ha, D, 1});
  const auto u = torch::matmul(x, ax), v = torch::matmul(x, bx);  // [B, H, T, 1]
  const auto ca = f1 * v + f2 * (ga * v - be * u);
  const auto cb = f2 * (ga * u - al * v) - f1 * u;
  return (x + ca * ax.view({1, Ha, 1, D}) + cb * bx.view({1, Ha, 1, D})).to(x_in.scalar_type());
}

torch::Tensor orthogonal_basis(const torch::Tensor& W, bool use_exp) {
  const char* fn = "orthogonal_basis";
  require_float(W, fn, "W");
  require((W.dim() == 2 || W.dim() == 3) && W.size(-1) == W.size(-2),
          fmt::format("{}: W must be [D, D] or [H, D, D]", fn));
  const auto A = W - W.transpose(-1, -2);
  if (use_exp) return torch::linalg_matrix_exp(A);
  const auto I = torch::eye(W.size(-1), W.options());
  return torch::linalg_solve(I - A, I + A);
}

torch::Tensor thin_basis(const torch::Tensor& W, int64_t r, bool use_exp) {
  require(r >= 1 && W.dim() >= 2 && r <= W.size(-1),
          fmt::format("thin_basis: need 1 <= r <= D, got r = {}", r));
  return orthogonal_basis(W, use_exp).narrow(-1, 0, r);
}

torch::Tensor basis_rotate(const torch::Tensor& x_in, const torch::Tensor& E,
                           const torch::Tensor& cos, const torch::Tensor& sin, bool inverse) {
  const char* fn = "basis_rotate";
  require_x(x_in, fn);
  const auto x = op_util::computed(x_in);  // half storage: mixed in float32
  require_float(E, fn, "E");
  const int64_t H = x.size(1), D = x.size(3);
  require(D % 2 == 0, fmt::format("{}: D must be even, got {}", fn, D));
  require((E.dim() == 2 || (E.dim() == 3 && E.size(0) == H)) && E.size(-1) == D && E.size(-2) == D,
          fmt::format("{}: E must be [D, D] or [H, D, D] with H = {}, D = {}", fn, H, D));
  require(cos.defined() && sin.defined() && cos.size(-1) == D / 2 && sin.size(-1) == D / 2,
          fmt::format("{}: cos and sin must end in D/2 = {}", fn, D / 2));
  const auto Et = E.to(x.scalar_type());
  const auto y = torch::matmul(x, Et);  // rows: (E^T x)^T
  const auto y1 = y.narrow(-1, 0, D / 2), y2 = y.narrow(-1, D / 2, D / 2);
  const auto c = cos.to(x.scalar_type()), s = (inverse ? -sin : sin).to(x.scalar_type());
  const auto z = torch::cat({y1 * c - y2 * s, y1 * s + y2 * c}, -1);
  return (torch::matmul(z, Et.transpose(-1, -2))).to(x_in.scalar_type());
}

torch::Tensor thin_rotate(const torch::Tensor& x_in, const torch::Tensor& E_r,
                          const torch::Tensor& M, const torch::Tensor& positions, bool inverse) {
  const char* fn = "thin_rotate";
  require_x(x_in, fn);
  const auto x = op_util::computed(x_in);  // half storage: mixed in float32
  require_float(E_r, fn, "E_r");
  require_float(M, fn, "M");
  const int64_t H = x.size(1), D = x.size(3);
  require((E_r.dim() == 2 || (E_r.dim() == 3 && E_r.size(0) == H)) && E_r.size(-2) == D,
          fmt::format("{}: E_r must be [D, r] or [H, D, r] with H = {}, D = {}", fn, H, D));
  const int64_t r = E_r.size(-1);
  require((M.dim() == 2 || (M.dim() == 3 && M.size(0) == H)) && M.size(-1) == r && M.size(-2) == r,
          fmt::format("{}: M must be [r, r] or [H, r, r] with H = {}, r = {}", fn, H, r));

  const auto ct = coefficient_dtype({M}, positions);
  const auto Mc = M.to(ct);
  const auto L = (Mc - Mc.transpose(-1, -2)).reshape({1, M.dim() == 3 ? H : 1, 1, r, r});
  const auto n = positions_as(positions, x, ct, fn).unsqueeze(-1).unsqueeze(-1);  // [Bp,1,T,1,1]
  const auto nL = (inverse ? -1.0 : 1.0) * n * L;  // [Bp, H or 1, T, r, r]
  const auto K = (torch::linalg_matrix_exp(nL) - torch::eye(r, nL.options())).to(x.scalar_type());

  const auto Ex = E_r.to(x.scalar_type());
  const auto y = torch::matmul(x, Ex);                           // [B, H, T, r]: E_r^T x
  const auto z = torch::matmul(K, y.unsqueeze(-1)).squeeze(-1);  // (exp(n L_r) - I) E_r^T x
  return (x + torch::matmul(z, Ex.transpose(-1, -2))).to(x_in.scalar_type());
}

torch::Tensor thin_generator_init(int64_t r, double base, int64_t D, torch::ScalarType dtype) {
  require(r >= 2 && r % 2 == 0 && r <= D,
          fmt::format("thin_generator_init: r must be even with 2 <= r <= D, got r = {}, D = {}", r,
                      D));
  require(base > 0, "thin_generator_init: base must be positive");
  auto M = torch::zeros({r, r}, torch::kDouble);
  auto acc = M.accessor<double, 2>();
  for (int64_t m = 0; m < r / 2; ++m)
    acc[m][m + r / 2] = std::pow(base, -2.0 * double(m) / double(D));
  return M.to(dtype);
}

}  // namespace relpos::nn
