// GRAPE-M generators beyond the canonical RoPE planes (torch/grape_generators.hpp): the rank-2
// Rodrigues form against torch::linalg_matrix_exp of the generator, from a parallel to b (s = 0)
// to s = 10, its orthogonality, relative law and inverse, gradients against finite differences and
// against autograd through matrix_exp (smooth at s = 0), the S1 / S2 series against long-double
// references; the learned Cayley / exp basis (orthogonal, W = 0 is plain half-split RoPE bit for
// bit, relative law, gradient in W); the thin non-commuting form (group law, orthogonality, RoPE
// on r coordinates, gradients in M and W); and that the three forms agree on the rotation sign.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <functional>
#include <vector>

#include "torch/grape_generators.hpp"

using namespace relpos;

namespace {

const auto kF64 = torch::TensorOptions().dtype(torch::kDouble);

double max_abs(const torch::Tensor& a) {
  return a.abs().max().item<double>();
}

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-30);
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() / scale;
}

// a, b [D] with s = sqrt(|a|^2 |b|^2 - (a.b)^2); s = 0 is b = 2a, parallel in exact arithmetic
// (alpha beta - gamma^2 is then exactly 0)
std::pair<torch::Tensor, torch::Tensor> pair_with_s(int64_t D, double s) {
  auto a = torch::randn({D}, kF64);
  a = a / a.norm() * 1.3;
  if (s == 0) return {a, 2 * a};
  auto p = torch::randn({D}, kF64);
  p = p - p.dot(a) / a.dot(a) * a;
  p = p / p.norm();
  return {a, 0.7 * a + (s / 1.3) * p};
}

// L = a b^T - b a^T per head: a, b [H, D] -> [H, D, D]
torch::Tensor generator(const torch::Tensor& a, const torch::Tensor& b) {
  return a.unsqueeze(-1) * b.unsqueeze(-2) - b.unsqueeze(-1) * a.unsqueeze(-2);
}

// exp(phi_{h,t} L_h) x per token: x [B, H, T, D], L [H, D, D], phi [H, T]
torch::Tensor expm_rotate(const torch::Tensor& x, const torch::Tensor& L,
                          const torch::Tensor& phi) {
  const auto G = torch::linalg_matrix_exp(phi.unsqueeze(-1).unsqueeze(-1) * L.unsqueeze(1));
  return torch::matmul(G, x.unsqueeze(-1)).squeeze(-1);
}

// The matrix G of a per-token map at one position: feed the D basis vectors as D tokens (head h).
// fn(x [1, H, D, D], positions [D]) -> [1, H, D, D]; the output rows are the columns of G.
torch::Tensor matrix_of(
    const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& fn, int64_t H,
    int64_t D, double n, int64_t h = 0) {
  const auto x = torch::eye(D, kF64).expand({1, H, D, D}).contiguous();
  return fn(x, torch::full({D}, n, kF64))[0][h].t();
}

// The spec's RoPE (2.1): pair (m, m + D/2) -> (x_m c + x_{m+D/2} s, -x_m s + x_{m+D/2} c), angle
// positions_t * theta_m; planes m >= planes untouched. x [B, H, T, D], positions [T].
torch::Tensor spec_rope(const torch::Tensor& x, const torch::Tensor& positions, double base,
                        int64_t planes) {
  const int64_t D = x.size(-1);
  auto out = x.clone();
  for (int64_t m = 0; m < planes; ++m) {
    const auto ang = positions * std::pow(base, -2.0 * double(m) / double(D));
    const auto c = ang.cos(), s = ang.sin();
    const auto x0 = x.select(-1, m), x1 = x.select(-1, m + D / 2);
    out.select(-1, m).copy_(x0 * c + x1 * s);
    out.select(-1, m + D / 2).copy_(-x0 * s + x1 * c);
  }
  return out;
}

// Central differences of loss() in every element of p (modified in place, then restored).
torch::Tensor fd_grad(const std::function<double()>& loss, const torch::Tensor& p,
                      double h = 1e-6) {
  torch::NoGradGuard guard;
  auto flat = p.view({-1});
  auto g = torch::zeros({flat.numel()}, kF64);
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const double v = flat[i].item<double>();
    flat[i].fill_(v + h);
    const double up = loss();
    flat[i].fill_(v - h);
    const double down = loss();
    flat[i].fill_(v);
    g[i] = (up - down) / (2 * h);
  }
  return g.view(p.sizes());
}

// max |analytic - fd| / max(1, max |fd|)
double grad_err(const torch::Tensor& analytic, const torch::Tensor& fd) {
  return (analytic - fd).abs().max().item<double>() / std::max(1.0, max_abs(fd));
}

}  // namespace

// ---------------------------------------------------------------- S1, S2

TEST(GrapeGenerators, SeriesValuesAndDerivatives) {
  using LD = long double;
  // long-double references; derivatives from the closed forms where they do not cancel
  auto ref = [](LD w) {
    std::array<LD, 4> r{};  // S1, S2, S1', S2'
    if (std::fabs(w) < 1e-3L) {
      LD s1 = 0, s2 = 0, d1 = 0, d2 = 0, f = 1;  // f = (2k+1)!
      for (int k = 0; k < 12; ++k) {
        if (k > 0) f *= LD(2 * k) * LD(2 * k + 1);
        const LD t = std::pow(-w, LD(k));
        s1 += t / f;
        s2 += t / (f * LD(2 * k + 2));
        if (k > 0) {
          d1 += LD(k) * std::pow(-1.0L, LD(k)) * std::pow(w, LD(k - 1)) / f;
          d2 += LD(k) * std::pow(-1.0L, LD(k)) * std::pow(w, LD(k - 1)) / (f * LD(2 * k + 2));
        }
      }
      return std::array<LD, 4>{s1, s2, d1, d2};
    }
    const LD q = std::sqrt(std::fabs(w));
    const LD s1 = w > 0 ? std::sin(q) / q : std::sinh(q) / q;
    const LD c = w > 0 ? std::cos(q) : std::cosh(q);
    const LD s2 = (1 - c) / w;
    r = {s1, s2, (c - s1) / (2 * w), (s1 - 2 * s2) / (2 * w)};
    return r;
  };
  const std::vector<double> ws = {0,      1e-300, -1e-12, 1e-12,   1e-9, 1e-8, 1.0000001e-8,
                                  3e-7,   1e-5,   9.9e-5, 1.01e-4, 2e-3, -0.3, 0.5,
                                  0.9999, 1.0,    1.0001, 2.5,     30,   2500, -4};
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    const double tol = dtype == torch::kDouble ? 4e-15 : 2e-6;
    auto w = torch::tensor(ws, kF64).to(dtype).requires_grad_(true);
    const auto S = nn::rodrigues_s(w);
    const auto d1 = torch::autograd::grad({S[0].sum()}, {w}, {}, true)[0];
    const auto d2 = torch::autograd::grad({S[1].sum()}, {w})[0];
    for (size_t i = 0; i < ws.size(); ++i) {
      const auto r = ref(LD(w[i].item<double>()));
      const double got[4] = {S[0][i].item<double>(), S[1][i].item<double>(), d1[i].item<double>(),
                             d2[i].item<double>()};
      for (int j = 0; j < 4; ++j) {
        const double want = double(r[j]);
        EXPECT_LE(std::fabs(got[j] - want), tol * std::max(1.0, std::fabs(want)))
            << "w = " << ws[i] << " dtype " << dtype << " quantity " << j << ": " << got[j]
            << " vs " << want;
      }
    }
  }
  // the backward is differentiable: S1''(0) = 1/60, S2''(0) = 1/360 from the series branch
  auto w0 = torch::zeros({1}, kF64).requires_grad_(true);
  const auto S0 = nn::rodrigues_s(w0);
  const auto g1 = torch::autograd::grad({S0[0].sum()}, {w0}, {}, true, true)[0];
  const auto g2 = torch::autograd::grad({S0[1].sum()}, {w0}, {}, true, true)[0];
  EXPECT_NEAR(torch::autograd::grad({g1.sum()}, {w0})[0].item<double>(), 1.0 / 60, 1e-15);
  EXPECT_NEAR(torch::autograd::grad({g2.sum()}, {w0})[0].item<double>(), 1.0 / 360, 1e-15);
}

// ---------------------------------------------------------------- rank-2 Rodrigues

TEST(GrapeGenerators, RodriguesMatchesMatrixExp) {
  torch::manual_seed(1);
  const int64_t D = 5;
  const double omega = 1.25;
  const auto om = torch::tensor(omega, kF64);
  const auto pos = torch::tensor(std::vector<double>{0, 0.3, 50, -0.3}, kF64) / omega;
  const auto x = torch::randn({2, 1, 4, D}, kF64);
  for (double s : {0.0, 1e-9, 1e-3, 1.0, 10.0}) {
    const auto [a, b] = pair_with_s(D, s);
    const auto got = nn::rodrigues_rotate(x, a, b, om, pos);
    const auto want = expm_rotate(x, generator(a, b).unsqueeze(0), (omega * pos).unsqueeze(0));
    EXPECT_LE(rel_err(got, want), 1e-12) << "s = " << s;
    for (double phi : {0.0, 0.3, 50.0}) {
      const auto fn = [&, a = a, b = b](const torch::Tensor& xx, const torch::Tensor& p) {
        return nn::rodrigues_rotate(xx, a, b, om, p);
      };
      const auto G = matrix_of(fn, 1, D, phi / omega);
      EXPECT_LE(max_abs(G.t().mm(G) - torch::eye(D, kF64)), 1e-12) << "s " << s << " phi " << phi;
      const auto Gref = torch::linalg_matrix_exp(phi * generator(a, b));
      EXPECT_LE(max_abs(G - Gref), 1e-12) << "s " << s << " phi " << phi;
    }
  }
}

TEST(GrapeGenerators, RodriguesRelativeLawAndInverse) {
  torch::manual_seed(2);
  const int64_t B = 2, H = 3, T = 5, D = 6;
  const auto a = torch::randn({H, D}, kF64), b = torch::randn({H, D}, kF64);
  const auto om = torch::rand({H}, kF64) + 0.2;
  const auto q = torch::randn({B, H, T, D}, kF64), k = torch::randn({B, H, T, D}, kF64);
  const auto pi = torch::rand({T}, kF64) * 40, pj = torch::rand({T}, kF64) * 40;
  const auto lhs =
      (nn::rodrigues_rotate(q, a, b, om, pi) * nn::rodrigues_rotate(k, a, b, om, pj)).sum(-1);
  const auto rhs = (q * nn::rodrigues_rotate(k, a, b, om, pj - pi)).sum(-1);
  EXPECT_LE(rel_err(lhs, rhs), 1e-12);

  const auto fwd = nn::rodrigues_rotate(q, a, b, om, pi);
  EXPECT_LE(
      rel_err(nn::rodrigues_rotate(q, a, b, om, pi, true), nn::rodrigues_rotate(q, a, b, om, -pi)),
      1e-14);
  EXPECT_LE(rel_err(nn::rodrigues_rotate(fwd, a, b, om, pi, true), q), 1e-12);
  // per-batch positions [B, T] equal one call per sequence
  const auto pb = torch::stack({pi, pj});
  const auto both = nn::rodrigues_rotate(q, a, b, om, pb);
  EXPECT_LE(rel_err(both[0], fwd[0]), 1e-15);
  EXPECT_LE(rel_err(both[1], nn::rodrigues_rotate(q, a, b, om, pj)[1]), 1e-15);
  // shared a, b [D] and scalar omega broadcast over heads
  const auto shared = nn::rodrigues_rotate(q, a[0], b[0], om[0], pi);
  const auto expanded =
      nn::rodrigues_rotate(q, a[0].expand({H, D}), b[0].expand({H, D}), om[0].expand({H}), pi);
  EXPECT_LE(rel_err(shared, expanded), 1e-15);
}

TEST(GrapeGenerators, RodriguesGradients) {
  torch::manual_seed(3);
  const int64_t B = 1, H = 2, T = 3, D = 4;
  const auto pos = torch::tensor(std::vector<double>{0.5, 1.7, 3.0}, kF64);
  const auto g = torch::randn({B, H, T, D}, kF64);
  for (double s : {0.0, 1e-9, 1.0}) {
    std::vector<torch::Tensor> as, bs;
    for (int64_t h = 0; h < H; ++h) {
      const auto [a, b] = pair_with_s(D, s * (h + 1));
      as.push_back(a);
      bs.push_back(b);
    }
    auto x = torch::randn({B, H, T, D}, kF64).requires_grad_(true);
    auto a = torch::stack(as).requires_grad_(true), b = torch::stack(bs).requires_grad_(true);
    auto om = torch::tensor(std::vector<double>{0.8, 1.1}, kF64).requires_grad_(true);
    const auto out = nn::rodrigues_rotate(x, a, b, om, pos);
    (out * g).sum().backward();
    for (const auto* t : {&x, &a, &b, &om})
      ASSERT_TRUE(torch::isfinite(t->grad()).all().item<bool>()) << "s = " << s;
    // autograd through matrix_exp of the full generator: smooth at s = 0
    std::vector<torch::Tensor> ref;
    {
      auto x2 = x.detach().clone().requires_grad_(true),
           a2 = a.detach().clone().requires_grad_(true),
           b2 = b.detach().clone().requires_grad_(true),
           om2 = om.detach().clone().requires_grad_(true);
      const auto o2 = expm_rotate(x2, generator(a2, b2), om2.unsqueeze(-1) * pos.unsqueeze(0));
      EXPECT_LE(rel_err(out, o2), 1e-13);
      (o2 * g).sum().backward();
      ref = {x2.grad(), a2.grad(), b2.grad(), om2.grad()};
    }
    const auto loss = [&] {
      return (nn::rodrigues_rotate(x, a, b, om, pos) * g).sum().item<double>();
    };
    const std::vector<const torch::Tensor*> params = {&x, &a, &b, &om};
    const char* names[] = {"x", "a", "b", "omega"};
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = *params[i];
      EXPECT_LE(grad_err(p.grad(), ref[i]), 1e-12) << names[i] << " s = " << s;
      EXPECT_LE(grad_err(p.grad(), fd_grad(loss, p)), 1e-8) << names[i] << " s = " << s;
    }
  }
}

TEST(GrapeGenerators, RodriguesFloat32) {
  torch::manual_seed(4);
  const int64_t B = 2, H = 2, T = 6, D = 8;
  const auto x = torch::randn({B, H, T, D}, kF64);
  const auto a = torch::randn({H, D}, kF64), b = torch::randn({H, D}, kF64);
  const auto om = torch::tensor(std::vector<double>{0.3, 1.2}, kF64);
  const auto pos = torch::arange(T, kF64) * 4.5;
  const auto want = nn::rodrigues_rotate(x, a, b, om, pos);
  const auto f = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
  // float32 everything but float64 positions: float64 angles, float32 mixing
  const auto got = nn::rodrigues_rotate(f(x), f(a), f(b), f(om), pos);
  EXPECT_EQ(got.scalar_type(), torch::kFloat);
  EXPECT_LE(rel_err(got, want), 1e-5);
  // all float32
  const auto got32 = nn::rodrigues_rotate(f(x), f(a), f(b), f(om), f(pos));
  EXPECT_EQ(got32.scalar_type(), torch::kFloat);
  EXPECT_LE(rel_err(got32, want), 1e-5);
  // parallel a, b in float32 (s^2 = 0 exactly): finite gradient, the identity map up to float32
  // rounding of u = a.x, v = b.x
  auto a32 = f(a[0]).clone().requires_grad_(true);
  const auto out = nn::rodrigues_rotate(f(x), a32, 2 * a32, f(om), f(pos));
  out.sum().backward();
  EXPECT_TRUE(torch::isfinite(a32.grad()).all().item<bool>());
  EXPECT_LE(rel_err(out, x), 1e-5);
}

// ---------------------------------------------------------------- learned commuting basis

TEST(GrapeGenerators, BasisOrthogonal) {
  torch::manual_seed(5);
  const auto W = torch::randn({3, 8, 8}, kF64) * 0.5;
  for (bool use_exp : {false, true}) {
    const auto E = nn::orthogonal_basis(W, use_exp);
    const auto I = torch::eye(8, kF64);
    EXPECT_LE(max_abs(torch::matmul(E.transpose(-1, -2), E) - I), 1e-12) << use_exp;
    EXPECT_LE(max_abs(torch::linalg_det(E) - 1), 1e-12) << use_exp;
    const auto E32 = nn::orthogonal_basis(W.to(torch::kFloat), use_exp);
    EXPECT_EQ(E32.scalar_type(), torch::kFloat);
    EXPECT_LE(max_abs(torch::matmul(E32.transpose(-1, -2), E32) - I.to(torch::kFloat)), 1e-6);
    EXPECT_LE(rel_err(E32, E), 1e-5);
    // one shared W [D, D]
    EXPECT_LE(rel_err(nn::orthogonal_basis(W[1], use_exp), E[1]), 1e-15);
  }
  // the Cayley map of A is (I - A)^{-1} (I + A) exactly as written
  const auto A = W[0] - W[0].t();
  const auto I = torch::eye(8, kF64);
  EXPECT_LE(max_abs(nn::orthogonal_basis(W[0]) - torch::linalg_inv(I - A).mm(I + A)), 1e-12);
}

TEST(GrapeGenerators, BasisZeroIsPlainRope) {
  torch::manual_seed(6);
  const int64_t B = 2, H = 2, T = 5, D = 8;
  const auto x = torch::randn({B, H, T, D}, kF64);
  const auto ang = torch::rand({T, D / 2}, kF64) * 10;
  const auto c = ang.cos(), s = ang.sin();
  const auto x1 = x.narrow(-1, 0, D / 2), x2 = x.narrow(-1, D / 2, D / 2);
  const auto plain = torch::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
  const auto plain_inv = torch::cat({x1 * c + x2 * s, -x1 * s + x2 * c}, -1);
  for (bool use_exp : {false, true}) {
    const auto E = nn::orthogonal_basis(torch::zeros({H, D, D}, kF64), use_exp);
    EXPECT_TRUE(torch::equal(E, torch::eye(D, kF64).expand({H, D, D}))) << use_exp;
    EXPECT_TRUE(torch::equal(nn::basis_rotate(x, E, c, s), plain)) << use_exp;
    EXPECT_TRUE(torch::equal(nn::basis_rotate(x, E, c, s, true), plain_inv)) << use_exp;
  }
}

TEST(GrapeGenerators, BasisRelativeLaw) {
  torch::manual_seed(7);
  const int64_t B = 2, H = 2, T = 6, D = 8;
  const auto freqs = torch::pow(10000.0, -torch::arange(D / 2, kF64) * 2.0 / D);
  const auto table = [&](const torch::Tensor& p) {
    const auto ang = p.unsqueeze(-1) * freqs;
    return std::make_pair(ang.cos(), ang.sin());
  };
  const auto q = torch::randn({B, H, T, D}, kF64), k = torch::randn({B, H, T, D}, kF64);
  const auto pi = torch::rand({T}, kF64) * 60, pj = torch::rand({T}, kF64) * 60;
  for (bool use_exp : {false, true}) {
    const auto E = nn::orthogonal_basis(torch::randn({H, D, D}, kF64), use_exp);
    const auto [ci, si] = table(pi);
    const auto [cj, sj] = table(pj);
    const auto [cr, sr] = table(pj - pi);
    const auto lhs = (nn::basis_rotate(q, E, ci, si) * nn::basis_rotate(k, E, cj, sj)).sum(-1);
    const auto rhs = (q * nn::basis_rotate(k, E, cr, sr)).sum(-1);
    EXPECT_LE(rel_err(lhs, rhs), 1e-12) << use_exp;
    const auto fwd = nn::basis_rotate(q, E, ci, si);
    EXPECT_LE(rel_err(nn::basis_rotate(fwd, E, ci, si, true), q), 1e-12) << use_exp;
  }
}

TEST(GrapeGenerators, BasisGradient) {
  torch::manual_seed(8);
  const int64_t B = 1, H = 2, T = 3, D = 4;
  const auto ang = torch::rand({T, D / 2}, kF64) * 5;
  const auto c = ang.cos(), s = ang.sin();
  const auto g = torch::randn({B, H, T, D}, kF64);
  for (bool use_exp : {false, true}) {
    auto x = torch::randn({B, H, T, D}, kF64).requires_grad_(true);
    auto W = (torch::randn({H, D, D}, kF64) * 0.5).requires_grad_(true);
    const auto loss_t = [&] {
      return (nn::basis_rotate(x, nn::orthogonal_basis(W, use_exp), c, s) * g).sum();
    };
    loss_t().backward();
    const auto loss = [&] { return loss_t().item<double>(); };
    EXPECT_LE(grad_err(W.grad(), fd_grad(loss, W)), 1e-8) << use_exp;
    EXPECT_LE(grad_err(x.grad(), fd_grad(loss, x)), 1e-8) << use_exp;
  }
}

// ---------------------------------------------------------------- thin non-commuting form

TEST(GrapeGenerators, ThinGroupLawAndOrthogonality) {
  torch::manual_seed(9);
  const int64_t H = 2, D = 8, r = 4;
  const auto E_r = nn::thin_basis(torch::randn({H, D, D}, kF64) * 0.6, r);
  ASSERT_EQ(E_r.sizes(), (std::vector<int64_t>{H, D, r}));
  EXPECT_LE(max_abs(torch::matmul(E_r.transpose(-1, -2), E_r) - torch::eye(r, kF64)), 1e-12);
  const auto M = torch::randn({H, r, r}, kF64);
  const auto fn = [&](const torch::Tensor& x, const torch::Tensor& p) {
    return nn::thin_rotate(x, E_r, M, p);
  };
  const double i = 2.5, j = 7.25;
  for (int64_t h = 0; h < H; ++h) {
    const auto Gi = matrix_of(fn, H, D, i, h), Gj = matrix_of(fn, H, D, j, h);
    const auto Gji = matrix_of(fn, H, D, j - i, h);
    EXPECT_LE(max_abs(Gi.t().mm(Gj) - Gji), 1e-12) << h;
    EXPECT_LE(max_abs(Gi.t().mm(Gi) - torch::eye(D, kF64)), 1e-12) << h;
    // the closed form I + E_r (exp(n L_r) - I) E_r^T
    const auto L = M[h] - M[h].t();
    const auto Er = E_r[h];
    const auto want = torch::eye(D, kF64) +
                      Er.mm(torch::linalg_matrix_exp(j * L) - torch::eye(r, kF64)).mm(Er.t());
    EXPECT_LE(max_abs(Gj - want), 1e-13) << h;
  }
  // the learned generator E_r L_r E_r^T does not commute with the canonical RoPE planes
  const auto big = E_r[0].mm(M[0] - M[0].t()).mm(E_r[0].t());
  const auto rope = nn::thin_generator_init(D, 10000, D, torch::kDouble);
  const auto canon = rope - rope.t();
  EXPECT_GT(max_abs(big.mm(canon) - canon.mm(big)), 1e-3);
  // inverse and per-batch positions
  const auto x = torch::randn({2, H, 3, D}, kF64);
  const auto p = torch::rand({3}, kF64) * 30;
  const auto fwd = nn::thin_rotate(x, E_r, M, p);
  EXPECT_LE(rel_err(nn::thin_rotate(fwd, E_r, M, p, true), x), 1e-12);
  EXPECT_LE(rel_err(nn::thin_rotate(x, E_r, M, torch::stack({p, p})), fwd), 1e-15);
}

TEST(GrapeGenerators, ThinInitIsRopeOnSubspace) {
  torch::manual_seed(10);
  const int64_t B = 2, H = 2, T = 7, D = 8, r = 4;
  const double base = 10000;
  const auto M = nn::thin_generator_init(r, base, D, torch::kDouble);
  EXPECT_EQ(nn::thin_generator_init(r, base, D).scalar_type(), torch::kFloat);
  const auto x = torch::randn({B, H, T, D}, kF64);
  const auto pos = torch::arange(T, kF64) * 17.3;
  // E_r = e_0, e_1, e_{D/2}, e_{D/2+1}: the first r/2 planes of the width-D half-split RoPE
  const auto I = torch::eye(D, kF64);
  const auto cols = torch::tensor(std::vector<int64_t>{0, 1, D / 2, D / 2 + 1});
  const auto E_planes = I.index_select(1, cols);
  const auto got = nn::thin_rotate(x, E_planes, M, pos);
  const auto want = spec_rope(x, pos, base, r / 2);
  EXPECT_LE(rel_err(got, want), 1e-12);
  for (int64_t m : {2, 3}) {  // the other coordinates are untouched, bit for bit
    EXPECT_TRUE(torch::equal(got.select(-1, m), x.select(-1, m)));
    EXPECT_TRUE(torch::equal(got.select(-1, m + D / 2), x.select(-1, m + D / 2)));
  }
  // E_r = e_0..e_{r-1}: a width-r half-split RoPE on those coordinates, frequencies base^(-2m/D)
  const auto first = nn::thin_rotate(x, I.narrow(1, 0, r), M, pos);
  auto want_first = x.clone();
  for (int64_t m = 0; m < r / 2; ++m) {
    const auto ang = pos * std::pow(base, -2.0 * m / D);
    const auto x0 = x.select(-1, m), x1 = x.select(-1, m + r / 2);
    want_first.select(-1, m).copy_(x0 * ang.cos() + x1 * ang.sin());
    want_first.select(-1, m + r / 2).copy_(-x0 * ang.sin() + x1 * ang.cos());
  }
  EXPECT_LE(rel_err(first, want_first), 1e-12);
  EXPECT_TRUE(torch::equal(first.narrow(-1, r, D - r), x.narrow(-1, r, D - r)));
}

TEST(GrapeGenerators, ThinGradients) {
  torch::manual_seed(11);
  const int64_t B = 1, H = 2, T = 3, D = 5, r = 3;  // odd r: a generic so(3), not a plane
  const auto pos = torch::tensor(std::vector<double>{0.0, 1.5, 4.0}, kF64);
  const auto g = torch::randn({B, H, T, D}, kF64);
  auto x = torch::randn({B, H, T, D}, kF64).requires_grad_(true);
  auto W = (torch::randn({H, D, D}, kF64) * 0.5).requires_grad_(true);
  auto M = (torch::randn({H, r, r}, kF64) * 0.7).requires_grad_(true);
  for (bool use_exp : {false, true}) {
    for (auto* t : {&x, &W, &M})
      if (t->grad().defined()) t->mutable_grad().zero_();
    const auto loss_t = [&] {
      return (nn::thin_rotate(x, nn::thin_basis(W, r, use_exp), M, pos) * g).sum();
    };
    loss_t().backward();
    const auto loss = [&] { return loss_t().item<double>(); };
    EXPECT_LE(grad_err(M.grad(), fd_grad(loss, M)), 1e-8) << use_exp;
    EXPECT_LE(grad_err(W.grad(), fd_grad(loss, W)), 1e-8) << use_exp;
    if (!use_exp) {  // x enters linearly; once is enough
      EXPECT_LE(grad_err(x.grad(), fd_grad(loss, x)), 1e-8);
    }
  }
}

// ---------------------------------------------------------------- conventions

// The three forms rotate the same way: the Rodrigues plane a = e_m, b = e_{m+D/2} with omega =
// theta_m, the thin form from thin_generator_init, and basis_rotate with E = I and
// sin = -sin(t theta_m) all give the spec's RoPE (a rotation by -t theta_m).
TEST(GrapeGenerators, ConventionsAgree) {
  torch::manual_seed(12);
  const int64_t B = 1, H = 2, T = 5, D = 8;
  const double base = 100;
  const auto x = torch::randn({B, H, T, D}, kF64);
  const auto pos = torch::arange(T, kF64) * 3.1;
  const auto rope = spec_rope(x, pos, base, D / 2);
  // all planes: thin form with r = D on the half-split ordering, and basis_rotate with E = I
  const auto M = nn::thin_generator_init(D, base, D, torch::kDouble);
  EXPECT_LE(rel_err(nn::thin_rotate(x, torch::eye(D, kF64), M, pos), rope), 1e-12);
  const auto ang = pos.unsqueeze(-1) * torch::pow(base, -torch::arange(D / 2, kF64) * 2.0 / D);
  EXPECT_LE(rel_err(nn::basis_rotate(x, torch::eye(D, kF64), ang.cos(), -ang.sin()), rope), 1e-15);
  // one plane m: the Rodrigues form
  auto one = x.clone();
  for (int64_t m = 0; m < D / 2; ++m) {
    const auto a = torch::zeros({D}, kF64).index_fill_(0, torch::tensor({m}), 1.0);
    const auto b = torch::zeros({D}, kF64).index_fill_(0, torch::tensor({m + D / 2}), 1.0);
    one = nn::rodrigues_rotate(one, a, b, torch::tensor(std::pow(base, -2.0 * m / D), kF64), pos);
  }
  EXPECT_LE(rel_err(one, rope), 1e-12);
}
