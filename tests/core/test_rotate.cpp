// Plane rotations by per-token angles (kernels/rotate.hpp): the forward against the 2 x 2 matrix
// written out in float64, the inverse flag as the exact inverse, the backward as the adjoint
// (<g, R x> = <R^T g, x>), the angle gradient (through the cos/sin gradients) against central
// differences in float64, shared angles (summed over the batch), both layouts, untouched pairs
// past P, in-place calls, float32; the frame table kernel (cos_sin) within 2 ulp of float64.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <tuple>
#include <vector>

#include "core/types.hpp"
#include "kernels/rotate.hpp"
#include "test_util.hpp"

using namespace relpos;
using namespace relpos::kernels;

namespace {

// y = R(s phi) x by the matrix, float64.
std::vector<double> rotate_by_definition(const RotateDims& d, Layout layout, bool inverse,
                                         const std::vector<double>& x,
                                         const std::vector<double>& phi) {
  std::vector<double> y = x;
  const double s = inverse ? -1 : 1;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t p = 0; p < d.P; ++p) {
          const int64_t row = ((b * d.H + h) * d.T + t) * d.D;
          const int64_t i = row + (layout == Layout::Interleaved ? 2 * p : p);
          const int64_t j = layout == Layout::Interleaved ? i + 1 : i + d.D / 2;
          const double a = s * phi[((d.angles_per_batch ? b : 0) * d.T + t) * d.P + p];
          y[i] = std::cos(a) * x[i] - std::sin(a) * x[j];
          y[j] = std::sin(a) * x[i] + std::cos(a) * x[j];
        }
  return y;
}

template <class F>
std::vector<double> map(const std::vector<double>& a, F f) {
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = f(a[i]);
  return out;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

TEST(RotatePairs, ForwardInverseAdjointAndAngleGradient) {
  std::mt19937_64 rng(11);
  for (Layout layout : {Layout::Interleaved, Layout::HalfSplit})
    for (bool shared : {false, true})
      for (bool inverse : {false, true})
        for (auto [B, H, T, D, P] :
             {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{1, 1, 1, 2, 1},
              {2, 3, 5, 8, 4},
              {3, 2, 7, 10, 3},
              {2, 1, 4, 90, 45}}) {
          const RotateDims d{B, H, T, D, P, !shared};
          const auto x = test::normal_vec(static_cast<size_t>(B * H * T * D), rng);
          auto phi = test::normal_vec(static_cast<size_t>((shared ? 1 : B) * T * P), rng);
          for (auto& a : phi) a *= 3;
          std::vector<double> y(x.size()), back(x.size());
          const auto c = map(phi, [](double v) { return std::cos(v); }),
                     sn = map(phi, [](double v) { return std::sin(v); });
          rotate_pairs_forward<double>(d, layout, inverse, x.data(), c.data(), sn.data(), y.data());
          const auto want = rotate_by_definition(d, layout, inverse, x, phi);
          for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], want[i], 1e-14);
          // the inverse flag undoes the forward
          rotate_pairs_forward<double>(d, layout, !inverse, y.data(), c.data(), sn.data(),
                                       back.data());
          for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(back[i], x[i], 1e-13);
          // backward: the adjoint, and the angle gradient of L = <g, y> by central differences
          const auto g = test::normal_vec(x.size(), rng);
          std::vector<double> dx(x.size()), dc(phi.size()), ds(phi.size()), dphi(phi.size());
          rotate_pairs_backward<double>(d, layout, inverse, x.data(), c.data(), sn.data(), g.data(),
                                        dx.data(), dc.data(), ds.data());
          for (size_t k = 0; k < phi.size(); ++k) dphi[k] = -sn[k] * dc[k] + c[k] * ds[k];
          EXPECT_NEAR(dot(g, y), dot(dx, x), 1e-11 * (1 + std::abs(dot(g, y))));
          const double eps = 1e-6;
          for (size_t k = 0; k < phi.size(); ++k) {
            auto hi = phi, lo = phi;
            hi[k] += eps;
            lo[k] -= eps;
            const double fd = (dot(g, rotate_by_definition(d, layout, inverse, x, hi)) -
                               dot(g, rotate_by_definition(d, layout, inverse, x, lo))) /
                              (2 * eps);
            ASSERT_NEAR(dphi[k], fd, 1e-7 * (1 + std::abs(fd))) << "angle " << k;
          }
          // in place gives the same
          auto inplace = x;
          rotate_pairs_forward<double>(d, layout, inverse, inplace.data(), c.data(), sn.data(),
                                       inplace.data());
          EXPECT_EQ(inplace, y);
          auto g_inplace = g;
          rotate_pairs_backward<double>(d, layout, inverse, x.data(), c.data(), sn.data(),
                                        g_inplace.data(), g_inplace.data(), nullptr, nullptr);
          EXPECT_EQ(g_inplace, dx);
        }
}

TEST(RotatePairs, Float32MatchesFloat64AndRejectsBadShapes) {
  std::mt19937_64 rng(5);
  const RotateDims d{2, 2, 9, 12, 6, true};
  const auto x = test::normal_vec(static_cast<size_t>(2 * 2 * 9 * 12), rng);
  const auto phi = test::normal_vec(static_cast<size_t>(2 * 9 * 6), rng);
  std::vector<double> y(x.size());
  const auto c = map(phi, [](double v) { return std::cos(v); }),
             sn = map(phi, [](double v) { return std::sin(v); });
  rotate_pairs_forward<double>(d, Layout::Interleaved, false, x.data(), c.data(), sn.data(),
                               y.data());
  const std::vector<float> xf(x.begin(), x.end()), cf(c.begin(), c.end()), sf(sn.begin(), sn.end());
  std::vector<float> yf(xf.size());
  rotate_pairs_forward<float>(d, Layout::Interleaved, false, xf.data(), cf.data(), sf.data(),
                              yf.data());
  for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(yf[i], y[i], 2e-6 * (1 + std::abs(y[i])));
  EXPECT_THROW(rotate_pairs_forward<double>({1, 1, 1, 3, 1, true}, Layout::Interleaved, false,
                                            x.data(), c.data(), sn.data(), y.data()),
               InputError);
  EXPECT_THROW(rotate_pairs_forward<double>({1, 1, 1, 4, 3, true}, Layout::Interleaved, false,
                                            x.data(), c.data(), sn.data(), y.data()),
               InputError);
}

// float32 on the vector path (interleaved pairs: tiles of 64 rows, W pairs a step and a scalar
// tail) against the float64 definition: forward, inverse, the backward without angle gradients
// (R^T g: the definition with the inverse flag flipped), pairs past P untouched, in place; P
// below, at and past a vector's pairs, T across tiles, shared and per-batch angles, both layouts.
TEST(RotatePairs, Float32VectorPathMatchesFloat64) {
  std::mt19937_64 rng(17);
  for (Layout layout : {Layout::Interleaved, Layout::HalfSplit})
    for (bool shared : {false, true})
      for (bool inverse : {false, true})
        for (auto [B, H, T, D, P] :
             {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{2, 3, 70, 80, 37},
              {1, 2, 130, 64, 32},
              {2, 4, 67, 80, 37},  // heads turned two to a tile, a frame per batch
              {1, 1, 3, 48, 8},
              {2, 1, 65, 34, 17}}) {
          const RotateDims d{B, H, T, D, P, !shared};
          const auto x = test::normal_vec(static_cast<size_t>(B * H * T * D), rng);
          const auto g = test::normal_vec(x.size(), rng);
          auto phi = test::normal_vec(static_cast<size_t>((shared ? 1 : B) * T * P), rng);
          for (auto& a : phi) a *= 3;
          const auto want = rotate_by_definition(d, layout, inverse, x, phi);
          const auto want_dx = rotate_by_definition(d, layout, !inverse, g, phi);
          const auto f32 = [](const std::vector<double>& v) {
            return std::vector<float>(v.begin(), v.end());
          };
          const auto xf = f32(x), gf = f32(g),
                     cf = f32(map(phi, [](double v) { return std::cos(v); })),
                     sf = f32(map(phi, [](double v) { return std::sin(v); }));
          std::vector<float> y(xf.size()), dx(xf.size());
          rotate_pairs_forward<float>(d, layout, inverse, xf.data(), cf.data(), sf.data(),
                                      y.data());
          rotate_pairs_backward<float>(d, layout, inverse, xf.data(), cf.data(), sf.data(),
                                       gf.data(), dx.data(), nullptr, nullptr);
          for (size_t i = 0; i < y.size(); ++i) {
            ASSERT_NEAR(y[i], want[i], 2e-6 * (1 + std::abs(want[i]))) << "forward " << i;
            ASSERT_NEAR(dx[i], want_dx[i], 2e-6 * (1 + std::abs(want_dx[i]))) << "backward " << i;
          }
          auto inplace = xf;
          rotate_pairs_forward<float>(d, layout, inverse, inplace.data(), cf.data(), sf.data(),
                                      inplace.data());
          EXPECT_EQ(inplace, y);
          auto g_inplace = gf;
          rotate_pairs_backward<float>(d, layout, inverse, xf.data(), cf.data(), sf.data(),
                                       g_inplace.data(), g_inplace.data(), nullptr, nullptr);
          EXPECT_EQ(g_inplace, dx);
        }
}

// Rotations whose inputs and outputs fill rot::kStreamFootprint (32 MB) write 64-byte aligned
// outputs with streaming stores: the same values as the cached stores of a misaligned output,
// forward, backward and in place.
TEST(RotatePairs, StreamedOutputsMatchCachedStores) {
  std::mt19937_64 rng(23);
  const RotateDims d{1, 8, 8192, 64, 32, false};  // 16 MB read, as much written
  const size_t n = static_cast<size_t>(d.B * d.H * d.T * d.D);
  const auto f32 = [](const std::vector<double>& v) {
    return std::vector<float>(v.begin(), v.end());
  };
  const auto x = f32(test::normal_vec(n, rng));
  const auto phi = test::normal_vec(static_cast<size_t>(d.T * d.P), rng);
  const auto cf = f32(map(phi, [](double v) { return std::cos(v); })),
             sf = f32(map(phi, [](double v) { return std::sin(v); }));
  std::vector<float> buf(2 * n + 64);
  float* aligned = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) / sizeof(float);
  float* y[2] = {aligned, aligned + n + 1};  // streamed, stored through the cache
  for (Layout layout : {Layout::Interleaved, Layout::HalfSplit})
    for (bool inverse : {false, true}) {
      SCOPED_TRACE(test::layout_name(layout));
      for (float* out : y)
        rotate_pairs_forward<float>(d, layout, inverse, x.data(), cf.data(), sf.data(), out);
      EXPECT_TRUE(std::equal(y[0], y[0] + n, y[1])) << "forward, inverse " << inverse;
      for (float* out : y)
        rotate_pairs_backward<float>(d, layout, inverse, x.data(), cf.data(), sf.data(), x.data(),
                                     out, nullptr, nullptr);
      EXPECT_TRUE(std::equal(y[0], y[0] + n, y[1])) << "backward, inverse " << inverse;
      std::copy(x.begin(), x.end(), y[0]);
      rotate_pairs_forward<float>(d, layout, inverse, y[0], cf.data(), sf.data(), y[0]);
      rotate_pairs_forward<float>(d, layout, inverse, x.data(), cf.data(), sf.data(), y[1]);
      EXPECT_TRUE(std::equal(y[0], y[0] + n, y[1])) << "in place, inverse " << inverse;
    }
}

// Half storage: rotate_pairs_half gives the float kernel's result on the widened words, rounded
// once (bit for bit), for both formats, layouts, directions, shared or per-batch angles, partial
// pairs and tiles, in place too; with the check it reports a NaN / Inf input and a float16
// overflow, and a clean call reports nothing.
TEST(RotatePairs, HalfStorageIsTheFloatKernelRoundedOnce) {
  std::mt19937_64 rng(29);
  for (HalfType type : {HalfType::BFloat16, HalfType::Float16})
    for (Layout layout : {Layout::Interleaved, Layout::HalfSplit})
      for (bool inverse : {false, true})
        for (auto [B, H, T, D, P, shared] :
             {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool>{2, 3, 70, 64, 32, true},
              {2, 2, 130, 80, 37, false},
              {1, 1, 5, 24, 12, true},
              {2, 1, 9, 32, 16, false}}) {
          SCOPED_TRACE(testing::Message() << (type == HalfType::BFloat16 ? "bf16 " : "fp16 ")
                                          << test::layout_name(layout) << " inverse " << inverse
                                          << " D " << D << " P " << P);
          const RotateDims d{B, H, T, D, P, !shared};
          const size_t n = static_cast<size_t>(B * H * T * D);
          std::vector<uint16_t> xh(n);
          for (auto& w : xh)
            w = float_to_half(type, static_cast<float>(4 * test::uniform(rng, -1.0, 1.0)));
          std::vector<float> xf(n), cf, sf;
          for (size_t i = 0; i < n; ++i) xf[i] = half_to_float(type, xh[i]);
          for (int64_t i = 0; i < (shared ? 1 : B) * T * P; ++i) {
            const double a = 3 * test::uniform(rng, -1.0, 1.0);
            cf.push_back(static_cast<float>(std::cos(a)));
            sf.push_back(static_cast<float>(std::sin(a)));
          }
          std::vector<float> yf(n);
          rotate_pairs_forward<float>(d, layout, inverse, xf.data(), cf.data(), sf.data(),
                                      yf.data());
          std::vector<uint16_t> want(n), yh(n);
          for (size_t i = 0; i < n; ++i) want[i] = float_to_half(type, yf[i]);
          EXPECT_FALSE(rotate_pairs_half(d, layout, inverse, type, xh.data(), cf.data(), sf.data(),
                                         yh.data(), true));
          EXPECT_EQ(yh, want);
          auto inplace = xh;
          rotate_pairs_half(d, layout, inverse, type, inplace.data(), cf.data(), sf.data(),
                            inplace.data(), false);
          EXPECT_EQ(inplace, want);
          auto bad = xh;
          bad[std::uniform_int_distribution<size_t>(0, n - 1)(rng)] =
              type == HalfType::BFloat16 ? 0x7FC0 : 0x7C00;  // NaN, +Inf
          EXPECT_TRUE(rotate_pairs_half(d, layout, inverse, type, bad.data(), cf.data(), sf.data(),
                                        yh.data(), true));
        }
  // (6e4, 6e4) turned by pi/4 is (0, 8.5e4): past float16's 65504, an infinity the check reports
  const RotateDims d{1, 1, 1, 2, 1, false};
  const float c = std::cos(std::numbers::pi_v<float> / 4),
              s = std::sin(std::numbers::pi_v<float> / 4);
  const uint16_t big = float_to_half(HalfType::Float16, 6e4f);
  const std::vector<uint16_t> x{big, big};
  std::vector<uint16_t> y(2);
  EXPECT_TRUE(rotate_pairs_half(d, Layout::Interleaved, false, HalfType::Float16, x.data(), &c, &s,
                                y.data(), true));
  // the same overflow in rows of whole AVX-512 registers of pairs (turned in registers there)
  const RotateDims wide{1, 1, 1, 32, 16, false};
  const std::vector<uint16_t> xw(32, big);
  const std::vector<float> cw(16, c), sw(16, s);
  std::vector<uint16_t> yw(32);
  for (Layout layout : {Layout::Interleaved, Layout::HalfSplit})
    EXPECT_TRUE(rotate_pairs_half(wide, layout, false, HalfType::Float16, xw.data(), cw.data(),
                                  sw.data(), yw.data(), true));
}

// Half rotations large enough to be streamed past the cache (inputs and outputs >=
// rot::kStreamFootprint) give the bits of the float kernel rounded once, and report a NaN stored
// in their last row.
TEST(RotatePairs, StreamedHalfStorageIsTheFloatKernelRoundedOnce) {
  std::mt19937_64 rng(31);
  const RotateDims d{1, 4, 32768, 64, 32, false};  // 8 Mi words: 16 MiB in, 16 MiB out
  const size_t n = static_cast<size_t>(d.B * d.H * d.T * d.D);
  std::vector<float> cf, sf;
  for (int64_t i = 0; i < d.T * d.P; ++i) {
    const double a = 3 * test::uniform(rng, -1.0, 1.0);
    cf.push_back(static_cast<float>(std::cos(a)));
    sf.push_back(static_cast<float>(std::sin(a)));
  }
  std::vector<float> xf(n), yf(n);
  std::vector<uint16_t> xh(n), buf(n + 32), want(n);
  // a 64-byte aligned output: streamed (misaligned ones take cached stores)
  uint16_t* yh = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) / 2;
  for (HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
    for (size_t i = 0; i < n; ++i) {
      xh[i] = float_to_half(type, static_cast<float>(4 * test::uniform(rng, -1.0, 1.0)));
      xf[i] = half_to_float(type, xh[i]);
    }
    for (Layout layout : {Layout::Interleaved, Layout::HalfSplit})
      for (bool inverse : {false, true}) {
        SCOPED_TRACE(testing::Message() << (type == HalfType::BFloat16 ? "bf16 " : "fp16 ")
                                        << test::layout_name(layout) << " inverse " << inverse);
        rotate_pairs_forward<float>(d, layout, inverse, xf.data(), cf.data(), sf.data(), yf.data());
        for (size_t i = 0; i < n; ++i) want[i] = float_to_half(type, yf[i]);
        EXPECT_FALSE(
            rotate_pairs_half(d, layout, inverse, type, xh.data(), cf.data(), sf.data(), yh, true));
        EXPECT_TRUE(std::equal(want.begin(), want.end(), yh));
      }
    const uint16_t saved = xh[n - 5];
    xh[n - 5] = type == HalfType::BFloat16 ? 0x7FC0 : 0x7C00;  // NaN, +Inf
    EXPECT_TRUE(rotate_pairs_half(d, Layout::Interleaved, false, type, xh.data(), cf.data(),
                                  sf.data(), yh, true));
    xh[n - 5] = saved;
  }
}

namespace {

// |got - want| in units of the float spacing at want (float64 want)
double float_ulps(float got, double want) {
  const float w = std::abs(static_cast<float>(want));
  const double spacing = static_cast<double>(std::nextafter(w, INFINITY)) - w;
  return std::abs(static_cast<double>(got) - want) / spacing;
}

// Angles where a sin/cos goes wrong: each quadrant's edges (k pi/4 and next to them), tiny and
// subnormal ones, the long positions of a 1M-token context, the top of the float64 reduction's
// range (2^29) and past it (libm), the float limits.
std::vector<double> trig_angles(std::mt19937_64& rng) {
  std::vector<double> a;
  std::uniform_real_distribution<double> u(-1, 1);
  for (double scale : {3.2, 100.0, 3e4, 1e6, 5.3e8, 1e12})
    for (int i = 0; i < 4001; ++i) a.push_back(scale * u(rng));
  for (int k = -400; k <= 400; ++k) {
    const float e = static_cast<float>(k * std::numbers::pi / 4);
    a.push_back(e);
    a.push_back(std::nextafter(e, INFINITY));
    a.push_back(std::nextafter(e, -INFINITY));
  }
  for (double x : {0.0, -0.0, 1e-40, -1e-30, 1e-4, 536870912.0, -536870976.0, 3.4e38, -3.4e38})
    a.push_back(x);
  return a;
}

}  // namespace

TEST(RotatePairs, CosSinFloat32WithinTwoUlpAndFloat64Exact) {
  std::mt19937_64 rng(23);
  const auto a = trig_angles(rng);
  const std::vector<float> af(a.begin(), a.end());
  // every length's tail, and an unaligned start
  for (const int64_t off : {0, 1, 5})
    for (const int64_t n : {static_cast<int64_t>(af.size()) - off, int64_t{13}, int64_t{0}}) {
      std::vector<float> c(static_cast<size_t>(n)), s(c.size());
      cos_sin<float>(af.data() + off, n, c.data(), s.data());
      for (int64_t i = 0; i < n; ++i) {
        const double x = af[off + i];
        ASSERT_LE(float_ulps(c[i], std::cos(x)), 2.0) << "cos " << x;
        ASSERT_LE(float_ulps(s[i], std::sin(x)), 2.0) << "sin " << x;
      }
    }
  std::vector<double> c(a.size()), s(a.size());
  cos_sin<double>(a.data(), static_cast<int64_t>(a.size()), c.data(), s.data());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(c[i], std::cos(a[i])) << a[i];
    ASSERT_EQ(s[i], std::sin(a[i])) << a[i];
  }
}

TEST(RotatePairs, CosSinOfNonFiniteAnglesIsNaNAndTouchesNothingElse) {
  std::vector<float> a(37);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.3f * static_cast<float>(i) - 5;
  a[3] = NAN;
  a[11] = INFINITY;
  a[20] = -INFINITY;
  std::vector<float> c(a.size()), s(a.size());
  cos_sin<float>(a.data(), static_cast<int64_t>(a.size()), c.data(), s.data());
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) {
      EXPECT_TRUE(std::isnan(c[i]) && std::isnan(s[i])) << i;
      continue;
    }
    EXPECT_LE(float_ulps(c[i], std::cos(static_cast<double>(a[i]))), 2.0) << i;
    EXPECT_LE(float_ulps(s[i], std::sin(static_cast<double>(a[i]))), 2.0) << i;
  }
  EXPECT_THROW(cos_sin<float>(a.data(), -1, c.data(), s.data()), InputError);
}
