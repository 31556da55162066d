// Equivariant structured rotations (core/structured.hpp, kernels/structured.hpp): Theorem 1 in
// fp64 for commuting families in d_c = 1..3 (with and without a structured Cayley post-rotation),
// Lemma 1 on families built by construction and given only as matrices, Lemma 2 (orthogonality,
// group law, commuting with Pi_act), Lemma 3 (Cayley post-rotations, eta_mix), the RoPE special
// cases, the kernel against the dense float64 closed form, its backward and the chain rule to W
// against central differences, the Theorem 2 sweep, and named errors on bad input.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/registry.hpp"
#include "core/structured.hpp"
#include "core/types.hpp"
#include "kernels/structured.hpp"
#include "test_util.hpp"

using namespace relpos;
using namespace relpos::structured;
using relpos::kernels::StructuredDims;

namespace {

Mat random_orthogonal(int d, std::mt19937_64& rng) {
  return basis_from(BasisMap::Cayley, normal_mat(d, d, rng));
}

// Every recovered plane's frequency vector equals (up to sign) a distinct original one.
void expect_same_planes(const Mat& want, const Mat& got, double tol) {
  ASSERT_EQ(want.rows(), got.rows());
  ASSERT_EQ(want.cols(), got.cols());
  std::vector<bool> used(static_cast<size_t>(want.cols()), false);
  for (int u = 0; u < got.cols(); ++u) {
    int best = -1;
    double err = 1e300;
    for (int v = 0; v < want.cols(); ++v) {
      if (used[static_cast<size_t>(v)]) continue;
      const double e =
          std::min((want.col(v) - got.col(u)).norm(), (want.col(v) + got.col(u)).norm());
      if (e < err) {
        err = e;
        best = v;
      }
    }
    ASSERT_GE(best, 0);
    used[static_cast<size_t>(best)] = true;
    EXPECT_LT(err, tol) << "plane " << u;
  }
}

// 1-D RoPE on interleaved pairs, theta_u = base^(-2u/D), written out.
Mat rope_matrix(int D, double pos, double base = 10000.0) {
  Mat R = Mat::Identity(D, D);
  for (int u = 0; u < D / 2; ++u) {
    const double a = pos * std::pow(base, -2.0 * u / D);
    R(2 * u, 2 * u) = std::cos(a);
    R(2 * u, 2 * u + 1) = -std::sin(a);
    R(2 * u + 1, 2 * u) = std::sin(a);
    R(2 * u + 1, 2 * u + 1) = std::cos(a);
  }
  return R;
}

// A kernel problem: per-head bases and frequencies, per-batch positions, float64 buffers.
struct KernelCase {
  StructuredDims d;
  std::vector<double> x, U, lambda, pos;

  Family family(int64_t h) const {
    const int64_t hu = d.basis_per_head ? h : 0, hl = d.freqs_per_head ? h : 0;
    Family f;
    f.U = Eigen::Map<const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
        U.data() + hu * d.D * d.D, d.D, d.D);
    f.lambda =
        Eigen::Map<const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
            lambda.data() + hl * d.DC * d.M, d.DC, d.M);
    return f;
  }
  Vec position(int64_t b, int64_t t) const {
    Vec r(d.DC);
    for (int64_t k = 0; k < d.DC; ++k)
      r(k) = pos[((d.positions_per_batch ? b : 0) * d.T + t) * d.DC + k];
    return r;
  }
  // the dense float64 closed form R(+-r) x, row by row
  std::vector<double> reference(const std::vector<double>& in, bool inverse) const {
    std::vector<double> y(in.size());
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.H; ++h) {
        const Family f = family(h);
        for (int64_t t = 0; t < d.T; ++t) {
          const int64_t row = ((b * d.H + h) * d.T + t) * d.D;
          const Vec r = position(b, t);
          const Mat R = f.rotation(inverse ? Vec(-r) : r);
          const Vec out = R * Eigen::Map<const Vec>(in.data() + row, d.D);
          for (int64_t i = 0; i < d.D; ++i) y[row + i] = out(i);
        }
      }
    return y;
  }
};

KernelCase make_case(int64_t B, int64_t H, int64_t T, int64_t D, int64_t M, int64_t DC,
                     bool per_batch, bool per_head_basis, bool per_head_freqs,
                     std::mt19937_64& rng) {
  KernelCase c;
  c.d = {B, H, T, D, M, DC, per_batch, per_head_basis, per_head_freqs, true};
  c.x = test::normal_vec(static_cast<size_t>(B * H * T * D), rng);
  for (int64_t h = 0; h < (per_head_basis ? H : 1); ++h) {
    const Mat Uh = random_orthogonal(static_cast<int>(D), rng);
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) c.U.push_back(Uh(i, j));
  }
  for (int64_t i = 0; i < (per_head_freqs ? H : 1) * DC * M; ++i)
    c.lambda.push_back(test::uniform(rng, -1.0, 1.0));
  for (int64_t i = 0; i < (per_batch ? B : 1) * T * DC; ++i)
    c.pos.push_back(test::uniform(rng, -8.0, 8.0));
  return c;
}

double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / (den > 0 ? den : 1.0);
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

std::vector<double> forward64(const KernelCase& c, bool inverse, const std::vector<double>& U,
                              const std::vector<double>& lambda) {
  std::vector<double> y(c.x.size());
  kernels::structured_forward<double>(c.d, inverse, c.x.data(), U.data(), lambda.data(),
                                      c.pos.data(), y.data());
  return y;
}

}  // namespace

TEST(StructuredTheorem1, LogitsAreRelativeForCommutingFamilies) {
  std::mt19937_64 rng(1);
  for (int dc = 1; dc <= 3; ++dc)
    for (BasisMap map : {BasisMap::Cayley, BasisMap::Exp})
      for (bool post : {false, true}) {
        const Family f = random_family(14, 5, dc, map, rng);
        const LogitModel mo{f.generators(), f.U, f.m(),
                            post ? structured_post(f.U, f.m(), rng) : Mat::Identity(14, 14)};
        const Mat r = random_positions(9, dc, 8.0, rng);
        const Mat q = normal_mat(9, 14, rng), k = normal_mat(9, 14, rng);
        const Vec s = random_positions(1, dc, 8.0, rng).row(0).transpose();
        const Theorem1Check c = theorem1_check(mo, r, q, k, s);
        EXPECT_LT(c.relative_err, 1e-12)
            << "dc " << dc << " " << to_string(map) << " post " << post;
        EXPECT_LT(c.shift_err, 1e-12) << "dc " << dc << " " << to_string(map) << " post " << post;
      }
  // the CLI's rows: every family kind in every d_c
  for (const auto& row : theorem1_rows({1, 2, 3}, 7)) {
    EXPECT_TRUE(row.pass) << row.kind << " dc " << row.dc << ": " << row.max_err;
    if (row.lemma1_residual >= 0) {
      EXPECT_LT(row.lemma1_residual, 1e-12) << row.kind;
    }
  }
}

TEST(StructuredLemma1, RecoversAFamilyBuiltByConstruction) {
  std::mt19937_64 rng(2);
  for (int dc = 1; dc <= 3; ++dc)
    for (int m : {3, 6}) {
      const Family f = random_family(12, m, dc, dc == 2 ? BasisMap::Exp : BasisMap::Cayley, rng);
      const Decomposition dec = decompose(f.generators());
      EXPECT_EQ(dec.m, m);
      EXPECT_EQ(dec.d_null, 12 - 2 * m);
      EXPECT_LT(dec.residual, 1e-12);
      expect_same_planes(f.lambda, dec.lambda, 1e-12);
      EXPECT_LT((dec.pi_act - f.pi_act()).norm(), 1e-12);
      EXPECT_LT((dec.pi_null - f.pi_null()).norm(), 1e-12);
      EXPECT_LT((dec.U.transpose() * dec.U - Mat::Identity(12, 12)).norm(), 1e-12);
      EXPECT_LT((dec.pi_act * dec.pi_act - dec.pi_act).norm(), 1e-12);
      EXPECT_LT((dec.pi_act * dec.pi_null).norm(), 1e-12);
    }
}

TEST(StructuredLemma1, MatricesOnlyAxialRopeInARandomBasisWithNullSpace) {
  std::mt19937_64 rng(3);
  for (int dc = 1; dc <= 3; ++dc) {
    const Family ax = axial_rope(16, dc, 100.0, 6);  // 4 null dims
    const Mat O = random_orthogonal(16, rng);
    std::vector<Mat> L;
    for (const auto& Lk : ax.generators()) L.push_back(O * Lk * O.transpose());
    const Decomposition dec = decompose(L);
    EXPECT_EQ(dec.m, 6);
    EXPECT_EQ(dec.d_null, 4);
    EXPECT_LT(dec.residual, 1e-12);
    expect_same_planes(ax.lambda, dec.lambda, 1e-12);
    EXPECT_LT((dec.pi_act - O * ax.pi_act() * O.transpose()).norm(), 1e-12);
    // and the recovered family rotates like the matrices: R_STR(r) = expm(A(r))
    const Vec r = random_positions(1, dc, 8.0, rng).row(0).transpose();
    EXPECT_LT((dec.family().rotation(r) - rotation_expm(L, r)).norm(), 1e-12);
  }
}

TEST(StructuredLemma1, PlanesWithEqualFrequenciesStillDecompose) {
  std::mt19937_64 rng(14);
  Family f = random_family(12, 4, 2, BasisMap::Exp, rng);
  f.lambda.col(1) = f.lambda.col(0);   // a repeated joint eigenvalue
  f.lambda.col(3) = -f.lambda.col(2);  // and one repeated up to orientation
  const Decomposition dec = decompose(f.generators());
  EXPECT_EQ(dec.m, 4);
  EXPECT_LT(dec.residual, 1e-12);
  expect_same_planes(f.lambda, dec.lambda, 1e-12);
  EXPECT_LT((dec.pi_act - f.pi_act()).norm(), 1e-12);
}

TEST(StructuredLemma1, RefusesNonSkewAndNonCommutingGenerators) {
  std::mt19937_64 rng(4);
  const Family f = random_family(8, 3, 2, BasisMap::Cayley, rng);
  auto L = f.generators();
  L[1](0, 0) += 0.1;  // no longer skew
  try {
    decompose(L);
    FAIL() << "non-skew accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("not skew-symmetric"), std::string::npos) << e.what();
  }
  const auto P = perturbed_generators(f, 0.1, rng);
  try {
    decompose(P);
    FAIL() << "non-commuting accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("do not commute"), std::string::npos) << e.what();
  }
  EXPECT_GT(commutator_size(P), 1e-3);
  EXPECT_LT(commutator_size(f.generators()), 1e-14);
  EXPECT_THROW(decompose({}), InputError);
  EXPECT_THROW(decompose({Mat::Zero(4, 4), Mat::Zero(6, 6)}), InputError);
}

TEST(StructuredRotation, OrthogonalDetOneGroupLawAndCommutesWithPiAct) {
  std::mt19937_64 rng(5);
  for (int dc = 1; dc <= 3; ++dc) {
    const Family f = random_family(10, 4, dc, BasisMap::Exp, rng);
    const auto L = f.generators();
    const Vec r = random_positions(1, dc, 8.0, rng).row(0).transpose();
    const Vec s = random_positions(1, dc, 8.0, rng).row(0).transpose();
    const Mat R = f.rotation(r), Rs = f.rotation(s);
    EXPECT_LT((R - rotation_expm(L, r)).norm(), 1e-12);
    EXPECT_LT((R.transpose() * R - Mat::Identity(10, 10)).norm(), 1e-12);
    EXPECT_NEAR(R.determinant(), 1.0, 1e-12);
    EXPECT_LT((R.transpose() * Rs - f.rotation(s - r)).norm(), 1e-12);
    EXPECT_LT(
        (rotation_expm(L, r).transpose() * rotation_expm(L, s) - rotation_expm(L, s - r)).norm(),
        1e-12);
    EXPECT_LT((R * f.pi_act() - f.pi_act() * R).norm(), 1e-12);
    EXPECT_LT(((R - Mat::Identity(10, 10)) * f.pi_null()).norm(), 1e-12);  // identity on null
  }
}

TEST(StructuredPostRotation, CayleyStructuredAndLeaky) {
  std::mt19937_64 rng(6);
  const Family f = random_family(12, 4, 2, BasisMap::Cayley, rng);
  const Mat I = Mat::Identity(12, 12);
  const Mat P = cayley_post(random_skew(12, rng));
  EXPECT_LT((P.transpose() * P - I).norm(), 1e-12);
  EXPECT_NEAR(P.determinant(), 1.0, 1e-12);
  const Mat Ps = structured_post(f.U, f.m(), rng);
  EXPECT_LT((Ps.transpose() * Ps - I).norm(), 1e-12);
  EXPECT_NEAR(Ps.determinant(), 1.0, 1e-12);
  const auto Ua = f.U.leftCols(2 * f.m());
  EXPECT_LT((Ps * Ua - Ua).norm(), 1e-12);  // fixes the active subspace pointwise
  EXPECT_LT((f.pi_act() * Ps * f.pi_act() - f.pi_act()).norm(), 1e-12);
  EXPECT_LT(eta_mix(Ps, f.U, f.m()), 1e-13);
  double last = 0;
  for (double eta : {1e-4, 1e-2, 1e-1}) {
    const Mat Pl = leaky_post(f.U, f.m(), eta, rng);
    EXPECT_LT((Pl.transpose() * Pl - I).norm(), 1e-12);
    EXPECT_NEAR(Pl.determinant(), 1.0, 1e-12);
    const double mix = eta_mix(Pl, f.U, f.m());
    EXPECT_GT(mix, last);
    EXPECT_GT(mix, 0.5 * eta);
    EXPECT_LT(mix, 8 * eta);
    last = mix;
  }
  EXPECT_THROW(cayley_post(normal_mat(5, 5, rng)), InputError);
}

TEST(StructuredRope, OneDimensionalEqualsRope) {
  std::mt19937_64 rng(7);
  for (int D : {2, 8, 64}) {
    const Family f = rope_1d(D);
    for (double p : {0.0, 1.0, -3.5, 1234.0}) {
      Vec r(1);
      r << p;
      EXPECT_LT((f.rotation(r) - rope_matrix(D, p)).norm(), 1e-12) << "D " << D << " p " << p;
    }
  }
  // and through the kernel (U = I)
  const int D = 16, T = 5;
  const Family f = rope_1d(D);
  StructuredDims d{1, 1, T, D, D / 2, 1, false, false, false, true};
  std::vector<double> U(f.U.data(), f.U.data() + D * D),
      lam(f.lambda.data(), f.lambda.data() + D / 2);
  std::vector<double> pos{0, 1, 7, -2, 100}, x = test::normal_vec(T * D, rng), y(x.size());
  kernels::structured_forward<double>(d, false, x.data(), U.data(), lam.data(), pos.data(),
                                      y.data());
  for (int t = 0; t < T; ++t) {
    const Vec want = rope_matrix(D, pos[t]) * Eigen::Map<const Vec>(x.data() + t * D, D);
    for (int i = 0; i < D; ++i) EXPECT_NEAR(y[t * D + i], want(i), 1e-12);
  }
}

TEST(StructuredRope, AxialAlongXEqualsRopeOnItsPlanes) {
  const int D = 16;
  const Family ax = axial_rope(D, 2, 10000.0);  // 4 planes per axis
  for (double x : {0.5, 3.0, -11.0}) {
    Vec r(2);
    r << x, 0.0;
    Mat want = Mat::Identity(D, D);
    want.topLeftCorner(8, 8) = rope_matrix(8, x);
    EXPECT_LT((ax.rotation(r) - want).norm(), 1e-12) << x;
  }
  // mixed RoPE drives every plane by both axes; 1-D mixed is RoPE up to the planes' signs
  std::mt19937_64 rng(8);
  const Family mx = mixed_rope(D, 2, rng);
  for (int u = 0; u < mx.m(); ++u)
    EXPECT_NEAR(mx.lambda.col(u).norm(), std::pow(100.0, -2.0 * u / D), 1e-14);
}

TEST(StructuredKernel, ForwardMatchesDenseReferenceAndInverseUndoesIt) {
  std::mt19937_64 rng(9);
  struct Shape {
    int64_t B, H, T, D, M, DC;
    bool per_batch, per_head_basis, per_head_freqs;
  };
  for (const Shape& s :
       {Shape{2, 3, 7, 10, 3, 2, true, true, true}, Shape{3, 2, 5, 8, 4, 3, false, true, false},
        Shape{1, 1, 1, 2, 1, 1, false, false, false}, Shape{2, 2, 131, 12, 5, 1, true, false, true},
        Shape{2, 4, 97, 16, 6, 3, true, true, true}}) {
    const KernelCase c = make_case(s.B, s.H, s.T, s.D, s.M, s.DC, s.per_batch, s.per_head_basis,
                                   s.per_head_freqs, rng);
    for (bool inverse : {false, true}) {
      const auto want = c.reference(c.x, inverse);
      const auto y = forward64(c, inverse, c.U, c.lambda);
      EXPECT_LT(max_rel(y, want), 1e-12) << "T " << s.T << " inverse " << inverse;
      // float32
      const auto xf = test::cast_vec<float>(c.x), Uf = test::cast_vec<float>(c.U),
                 lf = test::cast_vec<float>(c.lambda);
      std::vector<float> yf(xf.size());
      kernels::structured_forward<float>(c.d, inverse, xf.data(), Uf.data(), lf.data(),
                                         c.pos.data(), yf.data());
      EXPECT_LT(max_rel(std::vector<double>(yf.begin(), yf.end()), want), 1e-5) << "fp32 T " << s.T;
    }
    // inverse undoes forward, in place
    std::vector<double> y = forward64(c, false, c.U, c.lambda);
    kernels::structured_forward<double>(c.d, true, y.data(), c.U.data(), c.lambda.data(),
                                        c.pos.data(), y.data());
    EXPECT_LT(max_rel(y, c.x), 1e-12);
  }
}

TEST(StructuredKernel, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(10);
  for (bool inverse : {false, true}) {
    KernelCase c = make_case(2, 2, 5, 8, 3, 2, true, true, false, rng);
    c.d.check_basis = false;  // the differences move U off the orthogonal group
    const auto G = test::normal_vec(c.x.size(), rng);
    std::vector<double> dx(c.x.size()), dU(c.U.size()), dl(c.lambda.size());
    kernels::structured_backward<double>(c.d, inverse, c.x.data(), c.U.data(), c.lambda.data(),
                                         c.pos.data(), G.data(), dx.data(), dU.data(), dl.data());
    // dx: the adjoint, <G, R x> = <dx, x>, and the inverse applied to G
    EXPECT_NEAR(dot(G, forward64(c, inverse, c.U, c.lambda)), dot(dx, c.x),
                1e-12 * test::norm(G.data(), G.size()) * test::norm(c.x.data(), c.x.size()));
    KernelCase cg = c;
    cg.x = G;
    EXPECT_LT(max_rel(dx, forward64(cg, !inverse, c.U, c.lambda)), 1e-12);
    const double h = 1e-6;
    const auto loss = [&](const std::vector<double>& U, const std::vector<double>& lam) {
      return dot(G, forward64(c, inverse, U, lam));
    };
    for (size_t i = 0; i < c.U.size(); ++i) {
      auto Up = c.U, Um = c.U;
      Up[i] += h;
      Um[i] -= h;
      const double fd = (loss(Up, c.lambda) - loss(Um, c.lambda)) / (2 * h);
      const int64_t col = static_cast<int64_t>(i) % c.d.D;
      if (col >= 2 * c.d.M) {
        EXPECT_EQ(dU[i], 0.0);  // null columns are never read
      }
      EXPECT_NEAR(dU[i], fd, 1e-6 * std::max(1.0, std::abs(fd))) << "U[" << i << "]";
    }
    for (size_t i = 0; i < c.lambda.size(); ++i) {
      auto lp = c.lambda, lm = c.lambda;
      lp[i] += h;
      lm[i] -= h;
      const double fd = (loss(c.U, lp) - loss(c.U, lm)) / (2 * h);
      EXPECT_NEAR(dl[i], fd, 1e-6 * std::max(1.0, std::abs(fd))) << "lambda[" << i << "]";
    }
    // dx alone (no parameter gradients), in place over dy
    auto g2 = G;
    kernels::structured_backward<double>(c.d, inverse, c.x.data(), c.U.data(), c.lambda.data(),
                                         c.pos.data(), g2.data(), g2.data(), nullptr, nullptr);
    EXPECT_LT(max_rel(g2, dx), 1e-15);
  }
}

TEST(StructuredKernel, BackwardReductionIsTheSameForAnyThreadCount) {
  std::mt19937_64 rng(13);
  const KernelCase c = make_case(2, 3, 301, 16, 6, 2, true, false, true, rng);  // threaded size
  const auto G = test::normal_vec(c.x.size(), rng);
  std::vector<std::vector<double>> dUs, dls;
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<double> dx(c.x.size()), dU(c.U.size()), dl(c.lambda.size());
    kernels::structured_backward<double>(c.d, false, c.x.data(), c.U.data(), c.lambda.data(),
                                         c.pos.data(), G.data(), dx.data(), dU.data(), dl.data());
    dUs.push_back(dU);
    dls.push_back(dl);
  }
  omp_set_num_threads(saved);
  for (size_t i = 1; i < dUs.size(); ++i) {
    EXPECT_EQ(dUs[i], dUs[0]) << "threads " << i + 1;
    EXPECT_EQ(dls[i], dls[0]) << "threads " << i + 1;
  }
}

TEST(StructuredKernel, ChainRuleToWForCayleyAndExp) {
  std::mt19937_64 rng(11);
  for (BasisMap map : {BasisMap::Cayley, BasisMap::Exp}) {
    KernelCase c = make_case(2, 1, 6, 6, 2, 2, true, false, false, rng);
    const Mat W = 0.4 * normal_mat(6, 6, rng);
    const auto set_u = [&](const Mat& Wv) {
      const Mat U = basis_from(map, Wv);
      std::vector<double> out;
      for (int i = 0; i < 6; ++i)
        for (int j = 0; j < 6; ++j) out.push_back(U(i, j));
      return out;
    };
    const auto G = test::normal_vec(c.x.size(), rng);
    const auto U0 = set_u(W);
    std::vector<double> dx(c.x.size()), dU(36), dl(c.lambda.size());
    kernels::structured_backward<double>(c.d, false, c.x.data(), U0.data(), c.lambda.data(),
                                         c.pos.data(), G.data(), dx.data(), dU.data(), dl.data());
    const Mat gU = Eigen::Map<const Eigen::Matrix<double, 6, 6, Eigen::RowMajor>>(dU.data());
    const Mat gW = basis_grad_w(map, W, gU);
    const double h = 1e-6;
    for (int i = 0; i < 6; ++i)
      for (int j = 0; j < 6; ++j) {
        Mat Wp = W, Wm = W;
        Wp(i, j) += h;
        Wm(i, j) -= h;
        const double fd = (dot(G, forward64(c, false, set_u(Wp), c.lambda)) -
                           dot(G, forward64(c, false, set_u(Wm), c.lambda))) /
                          (2 * h);
        EXPECT_NEAR(gW(i, j), fd, 1e-6 * std::max(1.0, std::abs(fd)))
            << to_string(map) << " W(" << i << "," << j << ")";
      }
  }
}

TEST(StructuredTheorem2, BoundHoldsOverASmallSweep) {
  SweepConfig cfg;
  cfg.eps = {0, 1e-4, 1e-2};
  cfg.eta = {0, 1e-3, 1e-1};
  cfg.families = 2;
  cfg.positions = 6;
  const SweepResult res = theorem2_sweep(cfg);
  EXPECT_EQ(res.rows.size(), 3u * 3 * 3);
  EXPECT_EQ(res.configs, 3 * 3 * 3 * 2);
  EXPECT_TRUE(std::isfinite(res.fitted_c));
  EXPECT_GT(res.fitted_c, 0.0);
  EXPECT_LT(res.fitted_c, 10.0);  // an absolute constant of order one
  EXPECT_LT(res.exact_max_dev, 1e-12);
  for (const auto& row : res.rows) {
    EXPECT_LE(row.max_ratio, res.fitted_c);
    if (row.eps_scale == 0 && row.eta_scale == 0) {
      EXPECT_EQ(row.max_ratio, 0.0);
    }
    if (row.dc > 1 && row.eps_scale > 0) {
      EXPECT_GT(row.commutator, 0.0);
    }
    if (row.eta_scale > 0) {
      EXPECT_GT(row.eta_mix, 0.0);
    }
  }
}

// What Theorem 2's eta_mix does not see: a post-rotation that turns the active subspace inside
// itself (no leakage, eta_mix = 0) breaks eq. 23 at O(1), though the logits stay shift invariant.
// The sweep's leaky post-rotations keep S's active-active block zero for this reason.
TEST(StructuredTheorem2, EtaMixAloneDoesNotBoundAnActiveBlockRotation) {
  std::mt19937_64 rng(15);
  const Family f = random_family(16, 6, 2, BasisMap::Cayley, rng);
  Mat inner = Mat::Zero(16, 16);
  inner.topLeftCorner(12, 12) = random_skew(12, rng, 0.3);
  const LogitModel mo{f.generators(), f.U, 6, cayley_post(f.U * inner * f.U.transpose())};
  EXPECT_LT(eta_mix(mo.P, f.U, 6), 1e-13);
  const Mat r = random_positions(8, 2, 8.0, rng);
  const Mat q = normal_mat(8, 16, rng), k = normal_mat(8, 16, rng);
  const Theorem1Check c =
      theorem1_check(mo, r, q, k, random_positions(1, 2, 8.0, rng).row(0).transpose());
  EXPECT_GT(c.relative_err, 0.1);
  EXPECT_LT(c.shift_err, 1e-12);
}

// Nor does eps see generators that leak out of the active subspace: one generator always commutes
// with itself (eps = 0), yet with Pi_act of the unperturbed family the logits leave the relative
// form at O(perturbation^2). perturbed_generators() stays inside the active subspace for this.
TEST(StructuredTheorem2, GeneratorLeakageIsOutsideTheBound) {
  std::mt19937_64 rng(16);
  const Family f = random_family(16, 6, 1, BasisMap::Cayley, rng);
  Mat E = random_skew(16, rng);
  E /= spectral_norm(E);
  const LogitModel mo{{f.generator(0) + 1e-2 * E}, f.U, 6, Mat::Identity(16, 16)};
  EXPECT_EQ(commutator_size(mo.L), 0.0);
  const Mat r = random_positions(8, 1, 8.0, rng);
  const Mat q = normal_mat(8, 16, rng), k = normal_mat(8, 16, rng);
  EXPECT_GT((mo.logits(r, q, k) - mo.relative_logits(r, q, k)).cwiseAbs().maxCoeff(), 1e-6);
  // the in-subspace perturbation of the same size keeps Theorem 1 exact in d_c = 1
  const LogitModel inside{perturbed_generators(f, 1e-2, rng), f.U, 6, Mat::Identity(16, 16)};
  EXPECT_LT((inside.logits(r, q, k) - inside.relative_logits(r, q, k)).cwiseAbs().maxCoeff(),
            1e-12);
}

TEST(StructuredErrors, BadInputIsNamed) {
  std::mt19937_64 rng(12);
  const auto expect_error = [](const auto& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error, expected '" << needle << "'";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  KernelCase c = make_case(1, 1, 3, 8, 2, 2, false, false, false, rng);
  std::vector<double> y(c.x.size());
  const auto run = [&](const StructuredDims& d, const std::vector<double>& U,
                       const std::vector<double>& pos) {
    kernels::structured_forward<double>(d, false, c.x.data(), U.data(), c.lambda.data(), pos.data(),
                                        y.data());
  };
  StructuredDims odd = c.d;
  odd.D = 7;
  expect_error([&] { run(odd, c.U, c.pos); }, "odd");
  StructuredDims wide = c.d;
  wide.M = 5;
  expect_error([&] { run(wide, c.U, c.pos); }, "do not fit");
  auto badU = c.U;
  badU[0] += 0.01;
  expect_error([&] { run(c.d, badU, c.pos); }, "not orthogonal");
  auto nan_pos = c.pos;
  nan_pos[3] = std::nan("");
  expect_error([&] { run(c.d, c.U, nan_pos); }, "not finite");
  StructuredDims dc4 = c.d;
  dc4.DC = 4;
  expect_error([&] { run(dc4, c.U, c.pos); }, "d_c");
  // core: odd head dims, too many planes, position axes that do not match
  expect_error([&] { rope_1d(7); }, "not even");
  expect_error([&] { random_family(8, 5, 1, BasisMap::Cayley, rng); }, "do not fit");
  expect_error([&] { axial_rope(8, 4); }, "d_c");
  const Family f = random_family(8, 3, 2, BasisMap::Exp, rng);
  expect_error([&] { f.rotation(Vec::Zero(3)); }, "axes");
  expect_error([&] { rotation_expm(f.generators(), Vec::Zero(1)); }, "axes");
  expect_error([&] { rotation_expm(f.generators(), Vec::Constant(2, std::nan(""))); },
               "non-finite");
  Family bent = f;
  bent.U(0, 0) += 0.1;
  expect_error([&] { check_family(bent); }, "not orthogonal");
  expect_error([&] { leaky_post(rope_1d(8).U, 4, 0.1, rng); }, "null space");
}

// The spec family: axial at its defaults is core's axial RoPE on the pair layout's planes; mixed
// starts at the same magnitudes along unit directions (seeded: the same spec, the same values);
// the terms refuse what they cannot honour.
TEST(StructuredFamily, InitialValuesFollowTheFormulas) {
  const Mechanism ax = build_mechanism("structured(dims=2, basis=axial, theta=100)", 16, 3);
  // the reference names of the structured-2d experiment
  EXPECT_EQ(build_mechanism("axial_rope", 16, 3).spec, ax.spec);
  EXPECT_EQ(build_mechanism("mixed_rope", 16, 3).spec,
            build_mechanism("structured(basis=mixed)", 16, 3).spec);
  EXPECT_TRUE(build_mechanism("structured", 16, 3).structured_term()->basis == "cayley");
  const TransformTerm& t = *ax.structured_term();
  EXPECT_EQ(t.vector_dims, 2);
  EXPECT_EQ(t.planes, 8);
  EXPECT_FALSE(t.learned_frequencies);
  const structured::Family want = structured::axial_rope(16, 2, 100.0);
  for (int h = 0; h < 3; ++h) {
    const auto f = structured::term_family(t, h, Layout::HalfSplit);
    EXPECT_LT((f.lambda - want.lambda).cwiseAbs().maxCoeff(), 1e-15);
    // plane u is the half-split pair (u, u + 8)
    for (int u = 0; u < 8; ++u) {
      EXPECT_EQ(f.U(u, 2 * u), 1.0);
      EXPECT_EQ(f.U(u + 8, 2 * u + 1), 1.0);
    }
    EXPECT_LT((f.U.transpose() * f.U - structured::Mat::Identity(16, 16)).norm(), 1e-15);
  }
  const Mechanism mx = build_mechanism("structured(dims=3, basis=mixed, seed=4)", 12, 2);
  const Mechanism mx2 = build_mechanism("structured(dims=3, basis=mixed, seed=4)", 12, 2);
  EXPECT_EQ(mx.structured_term()->plane_freqs, mx2.structured_term()->plane_freqs);
  EXPECT_TRUE(mx.structured_term()->learned_frequencies);
  const structured::Family axial3 = structured::axial_rope(12, 3, 100.0);
  for (int h = 0; h < 2; ++h) {
    const auto f = structured::term_family(*mx.structured_term(), h, Layout::Interleaved);
    for (int u = 0; u < 6; ++u)
      EXPECT_NEAR(f.lambda.col(u).norm(), axial3.lambda.col(u).norm(), 1e-14) << u;
    EXPECT_EQ(f.U, structured::Mat::Identity(12, 12));  // interleaved planes: P = I
  }
  EXPECT_THROW(build_mechanism("structured(dims=4)", 16, 1), InputError);
  EXPECT_THROW(build_mechanism("structured(dims=3)", 4, 1), InputError);  // 2 planes, 3 axes
  EXPECT_THROW(build_mechanism("structured + alibi", 16, 2), InputError);
  EXPECT_THROW(build_mechanism("rope + structured", 16, 2), InputError);
  EXPECT_THROW(build_mechanism("structured(basis=diagonal)", 16, 2), InputError);
}
