// verify's judgement: exact mechanisms pass at 1e-12 in fp64, approximate ones show a residual,
// and a wrong contragredient is caught.
#include <gtest/gtest.h>

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
  for (const auto& spec : verify_default_specs()) {
    for (const auto& r : diag::verify_spec(spec, small_opts(), {"f64", "f32"})) {
      SCOPED_TRACE(spec + " " + r.params + " " + r.dtype);
      EXPECT_NE(r.status, "FAIL") << "residual " << r.residual;
      EXPECT_NE(r.status, "CLAMPED");
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
  for (const std::string spec : {"jordan(m=2, regime=stabilized)", "jetmix(m=3, gates=0.1/0.05)",
                                 "real_jordan"}) {
    const auto rows = diag::verify_spec(spec, small_opts(), {"f64"});
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
  const auto rows = diag::verify_spec("jordan(m=2, regime=scaled, c=2, L=1024, center=none)", o, {"f64"});
  EXPECT_TRUE(rows[0].clamp_bound);  // gamma p = 2/1024 * 32768 = 64 > 30
  EXPECT_EQ(rows[0].status, "CLAMPED");
  const auto centred = diag::verify_spec("jordan(m=2, regime=scaled, c=1.5, L=1024)", o, {"f64"});
  EXPECT_FALSE(centred[0].clamp_bound);
  EXPECT_EQ(centred[0].status, "PASS");
}
