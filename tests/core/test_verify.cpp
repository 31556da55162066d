// verify's judgement: exact mechanisms pass at 1e-12 in fp64, approximate ones show a residual,
// and a wrong contragredient is caught.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/registry.hpp"
#include "diag/verify.hpp"

using namespace relpos;

namespace {
diag::VerifyOptions small_opts() {
  diag::VerifyOptions o;
  o.positions = 40;
  o.heads = 2;
  return o;
}
}  // namespace

TEST(Verify, EveryDefaultSpecMeetsItsDeclaration) {
  // At lags up to 16384: from about 20480 on, the jet mechanisms' default damping (gamma
  // = 1.5/1024, uncentred) binds the exponent clamp, and a bound clamp now fails every row (see
  // ClampFailsEveryRowIncludingApproximateAndF32).
  auto o = small_opts();
  o.max_lag = 16384;
  for (const auto& spec : verify_default_specs()) {
    for (const auto& r : diag::verify_spec(spec, o, {"f64", "f32"})) {
      SCOPED_TRACE(spec + " " + r.params + " " + r.dtype);
      EXPECT_NE(r.status, "FAIL") << "residual " << r.residual << ": " << r.reason;
      EXPECT_NE(r.status, "CLAMPED") << r.reason;
      EXPECT_EQ(r.reason, "");
      if (r.dtype == "f64" && r.transform_exact) {
        EXPECT_LE(r.residual, 1e-12);
      }
      if (r.dtype == "f32" && r.transform_exact) {
        EXPECT_LE(r.residual, 1e-5);
      }
      if (r.transform_exact && r.dtype == "f64") {
        EXPECT_LE(r.shift_residual, 1e-12);
      }
      if (r.alibi_lift_residual >= 0) {
        EXPECT_LE(r.alibi_lift_residual, 1e-14);
      }
    }
  }
}

TEST(Verify, ApproximateMechanismsShowAResidualAtRandomParameters) {
  auto o = small_opts();
  o.max_lag = 16384;  // where jetmix's clamp does not bind (at 32768 it does: CLAMPED)
  for (const std::string spec :
       {"jordan(m=2, regime=stabilized)", "jetmix(m=3, gates=0.1/0.05)", "real_jordan"}) {
    const auto rows = diag::verify_spec(spec, o, {"f64"});
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_EQ(rows[1].status, "APPROX");
    EXPECT_GT(rows[1].residual, 1e-6) << spec;
  }
}

TEST(Verify, WrongContragredientIsCaught) {
  // The primal action on queries breaks the relative law for every non-orthogonal map ...
  for (const std::string spec : {"jordan(m=2, regime=raw)", "damped_rope",
                                 "jordan(m=3, regime=scaled, eta0=0.1, eta_max=1)"})
    EXPECT_GT(diag::wrong_contragredient_residual(spec, small_opts()), 1e-3) << spec;
  // ... and is harmless for orthogonal ones (RoPE), where A^{-T} = A.
  EXPECT_LT(diag::wrong_contragredient_residual("rope", small_opts()), 1e-12);
}

TEST(Verify, UncenteredScaledExactBindsTheClampAtLongContext) {
  auto o = small_opts();
  const auto rows =
      diag::verify_spec("jordan(m=2, regime=scaled, c=2, L=1024, center=none)", o, {"f64"});
  EXPECT_TRUE(rows[0].clamp_bound);  // gamma p = 2/1024 * 32768 = 64 > 30
  EXPECT_EQ(rows[0].status, "CLAMPED");
  const auto centred = diag::verify_spec("jordan(m=2, regime=scaled, c=1.5, L=1024)", o, {"f64"});
  EXPECT_FALSE(centred[0].clamp_bound);
  EXPECT_EQ(centred[0].status, "PASS");
}

namespace {
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
bool is_failure(const diag::VerifyRow& r) {
  return r.status == "FAIL" || r.status == "CLAMPED";
}
}  // namespace

TEST(Verify, ClampFailsEveryRowIncludingApproximateAndF32) {
  // jetmix is approximate and uncentred: gamma = 1.5/1024 at p = 32768 gives 48 > max_exp = 30
  auto o = small_opts();
  o.positions = 8;
  const auto rows = diag::verify_spec("jetmix(m=3, gates=0.1/0.05)", o, {"f64", "f32"});
  ASSERT_EQ(rows.size(), 4u);
  for (const auto& r : rows) {
    SCOPED_TRACE(r.params + " " + r.dtype);
    EXPECT_TRUE(r.clamp_bound);
    EXPECT_EQ(r.status, "CLAMPED");
    EXPECT_TRUE(contains(r.reason, "clamp binds in the centred window")) << r.reason;
    EXPECT_TRUE(contains(r.reason, "> max_exp = 30")) << r.reason;
  }
}

// Issue reproduction 1: growth inf (sums of squares overflow), clamp bound, shift residual ~1e160,
// and yet PASS.
TEST(Verify, DampedRopeWithAHugeClampBoundIsNotPass) {
  auto o = small_opts();
  o.max_lag = 1000;
  o.head_dim = 16;
  const auto rows = diag::verify_spec("damped_rope(gamma0=10, max_exp=700)", o, {"f64"});
  ASSERT_EQ(rows.size(), 2u);
  for (const auto& r : rows) {
    SCOPED_TRACE(r.params);
    EXPECT_NE(r.status, "PASS");
    EXPECT_TRUE(is_failure(r)) << r.status;
    EXPECT_TRUE(r.clamp_bound);
    EXPECT_TRUE(contains(r.reason, "clamp") || contains(r.reason, "non-finite key growth"))
        << r.reason;
    EXPECT_TRUE(contains(r.reason, "max_exp = 700")) << r.reason;
    // scaled norms: e^700-sized keys have a finite norm
    EXPECT_TRUE(std::isfinite(r.key_growth)) << r.key_growth;
    EXPECT_GT(r.key_growth, 1e300);
  }
}

// Issue reproduction 2: an exact order-8 raw block at lags up to 10^6 loses the score to
// cancellation (|k~|/|k| ~ 1e28); its shift residual is far above 1e-12.
TEST(Verify, RawOrderEightAtOneMillionIsNotPass) {
  auto o = small_opts();
  o.max_lag = 1000000;
  const auto rows =
      diag::verify_spec("jordan(m=8, regime=raw, zero_gamma=true, eta0=0.09)", o, {"f64"});
  ASSERT_EQ(rows.size(), 2u);
  for (const auto& r : rows) {
    SCOPED_TRACE(r.params);
    EXPECT_NE(r.status, "PASS");
    EXPECT_EQ(r.status, "FAIL");
    EXPECT_TRUE(contains(r.reason, "above 1e-12")) << r.reason;
  }
}

// Issue reproduction 3: a scaled regime whose damping and shear overflow (gamma = c/L = 1e300).
// Built as a legal mechanism and then edited, so that the test does not depend on what the spec
// parser accepts for L.
TEST(Verify, OverflowingScaledRegimeFails) {
  Mechanism m = build_mechanism("jordan(regime=scaled)", 16, 2);
  for (auto& s : m.transforms[0].segments) {
    s.L = 1e-300;
    s.shear_scale = 1e300;
    s.gamma_init = s.gamma_random_max = 1e300;
  }
  auto o = small_opts();
  o.max_lag = 1000000;
  const auto rows = diag::verify_mechanism(m, "jordan(regime=scaled, L=1e-300)", o, {"f64", "f32"});
  ASSERT_EQ(rows.size(), 4u);
  for (const auto& r : rows) {
    SCOPED_TRACE(r.params + " " + r.dtype);
    EXPECT_NE(r.status, "PASS");
    EXPECT_NE(r.status, "INFO");
    EXPECT_TRUE(is_failure(r)) << r.status;
    EXPECT_FALSE(r.reason.empty());
    if (r.dtype == "f32") {
      EXPECT_EQ(r.status, "FAIL");
      EXPECT_TRUE(contains(r.reason, "not representable in float32")) << r.reason;
    }
  }
  // at random parameters the keys overflow: named, not dropped
  EXPECT_EQ(rows[2].status, "FAIL");
  EXPECT_TRUE(contains(rows[2].reason, "non-finite")) << rows[2].reason;
}

TEST(Verify, MaxAndNormPropagateNaNAndDoNotOverflow) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(std::isnan(diag::max_nan(0.0, nan)));
  EXPECT_TRUE(std::isnan(diag::max_nan(nan, 1.0)));
  EXPECT_TRUE(std::isnan(diag::max_nan(inf, nan)));
  EXPECT_EQ(diag::max_nan(1.0, inf), inf);
  EXPECT_EQ(diag::max_nan(2.0, 1.0), 2.0);
  double acc = 0;
  for (double x : {1.0, nan, 3.0}) acc = diag::max_nan(acc, x);
  EXPECT_TRUE(std::isnan(acc));

  const std::vector<double> big = {1e200, -1e200, 0.0};
  EXPECT_NEAR(diag::scaled_norm(big.data(), big.size()) / 1e200, std::sqrt(2.0), 1e-15);
  const std::vector<double> tiny = {3e-200, 4e-200};
  EXPECT_NEAR(diag::scaled_norm(tiny.data(), tiny.size()) / 1e-200, 5.0, 1e-14);
  const std::vector<float> bigf = {3e38f, 3e38f};
  EXPECT_NEAR(diag::scaled_norm(bigf.data(), bigf.size()),
              std::sqrt(2.0) * static_cast<double>(3e38f), 1e24);
  const std::vector<double> withnan = {1.0, nan, inf}, withinf = {1.0, -inf, 2.0}, zero = {0, 0};
  EXPECT_TRUE(std::isnan(diag::scaled_norm(withnan.data(), withnan.size())));
  EXPECT_EQ(diag::scaled_norm(withinf.data(), withinf.size()), inf);
  EXPECT_EQ(diag::scaled_norm(zero.data(), zero.size()), 0.0);
}

TEST(Verify, Float32RowFailsWhenMaxExpExceedsItsExponentRange) {
  // e^x overflows float32 above ~88.72: max_exp = 100 cannot be honoured in f32, even where the
  // clamp does not bind; float64 (limit ~709.78) is fine
  auto o = small_opts();
  o.max_lag = 1000;
  const auto rows = diag::verify_spec("damped_rope(max_exp=100)", o, {"f64", "f32"});
  ASSERT_EQ(rows.size(), 4u);
  for (const auto& r : rows) {
    SCOPED_TRACE(r.params + " " + r.dtype);
    EXPECT_FALSE(r.clamp_bound);
    if (r.dtype == "f32") {
      EXPECT_EQ(r.status, "FAIL");
      EXPECT_TRUE(contains(r.reason, "max_exp = 100 exceeds the float32 exponent range"))
          << r.reason;
    } else {
      EXPECT_EQ(r.status, "PASS") << r.reason;
    }
  }
  // above float64's range too (the registry refuses max_exp > 709; set it on the mechanism)
  Mechanism big = build_mechanism("damped_rope(max_exp=700)", o.head_dim, o.heads);
  big.transforms[0].segments[0].max_exponent = 710;
  const auto f64 = diag::verify_mechanism(big, "damped_rope(max_exp=710)", o, {"f64"});
  EXPECT_EQ(f64[0].status, "FAIL");
  EXPECT_TRUE(contains(f64[0].reason, "float64 exponent range")) << f64[0].reason;
}

TEST(Verify, WorkBudgetRefusesTheLargestSizes) {
  diag::VerifyOptions o;
  o.positions = 2000;
  o.heads = 256;
  o.head_dim = 4096;
  try {
    diag::verify_spec("rope", o, {"f64", "f32"});
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_TRUE(contains(e.what(), "limit of 60 s")) << e.what();
  }
  EXPECT_THROW(diag::verify_specs(verify_default_specs(), o, {"f64"}), InputError);
  // the estimate of a small run is small, and the default CLI run fits
  EXPECT_LT(diag::estimate_verify_cost({"rope"}, small_opts(), {"f64", "f32"}).seconds, 1.0);
  EXPECT_LT(
      diag::estimate_verify_cost(verify_default_specs(), diag::VerifyOptions{}, {"f64", "f32"})
          .seconds,
      diag::kVerifyBudgetSeconds);
}

// The PJ-RoPE mechanisms pass the relative law in float64 (the exact PJ-rotary map of order 2 in
// the reference's channel order and of order 3, and the learned PJ lag table).
TEST(Verify, PjMechanismsPassTheRelativeLaw) {
  for (const char* spec : {"pj_rotary", "pj_rotary(m=3, L=256)", "pj_rotary(channels=jordan)",
                           "pj_bias(sectors=fj/affine/lc, R=2)", "rope + pj_bias"}) {
    const auto rows = diag::verify_spec(spec, small_opts(), {"f64"});
    ASSERT_FALSE(rows.empty()) << spec;
    for (const auto& r : rows) EXPECT_EQ(r.status, "PASS") << spec << " " << r.reason;
  }
}
