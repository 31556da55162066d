// Every mechanism of the catalog, whatever its family, through the generic paths: the registry
// builds it with its defaults, verify judges it, and the kernels' one call path (every transform
// term in order) equals the dense float64 reference maps. A new family file needs no test edit to
// be covered here (docs/architecture.md, "Adding a mechanism").
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <random>

#include "core/reference.hpp"
#include "core/registry.hpp"
#include "core/structured.hpp"
#include "diag/verify.hpp"
#include "kernels/mechanism_apply.hpp"
#include "kernels/structured.hpp"
#include "test_util.hpp"

using namespace relpos;

namespace {

// The smallest head dim of 8..96 that the mechanism's defaults accept.
int head_dim_for(const std::string& name) {
  for (int D = 8; D <= 96; D += 2) try {
      build_mechanism(name, D, 2);
      return D;
    } catch (const InputError&) {
    }
  return 0;
}

}  // namespace

TEST(Catalog, EveryMechanismVerifiesAndItsKernelsMatchTheReferenceMaps) {
  std::mt19937_64 rng(7);
  for (const auto& info : mechanism_catalog()) {
    SCOPED_TRACE(info.name);
    // a context-extension rule (kind "scaling") modifies a rotary term: checked on RoPE
    const std::string spec =
        info.kind == "scaling" ? fmt::format("rope + {}", info.name) : info.name;
    const int D = head_dim_for(spec);
    ASSERT_GT(D, 0) << "no head dim in 8..96 fits the defaults";
    const Mechanism m = build_mechanism(spec, D, 2);
    EXPECT_FALSE(m.spec.empty());
    // verify: exact mechanisms pass, nothing fails
    diag::VerifyOptions o;
    o.max_lag = 2048;
    o.positions = 16;
    o.heads = 2;
    o.head_dim = D;
    for (const auto& r : diag::verify_spec(spec, o, {"f64"})) {
      EXPECT_TRUE(r.status == "PASS" || r.status == "APPROX") << r.status << ": " << r.reason;
      if (info.exactness == "exact") {
        EXPECT_EQ(r.status, "PASS");
      }
    }
    if (const TransformTerm* st = m.structured_term()) {
      // vector positions: the fast kernel against the dense closed form R(r) of each head's
      // family (random draws of what it learns), both layouts
      for (auto layout : {Layout::Interleaved, Layout::HalfSplit})
        for (int h = 0; h < 2; ++h) {
          const auto f = structured::random_term_family(*st, h, layout, rng);
          const auto r = structured::random_positions(5, f.dc(), 40, rng);
          const auto x = test::normal_vec(static_cast<size_t>(5 * D), rng);
          std::vector<double> U(static_cast<size_t>(D * D)), lam(f.lambda.size()), pos(r.size()),
              y(x.size());
          for (int i = 0; i < D; ++i)
            for (int j = 0; j < D; ++j) U[static_cast<size_t>(i * D + j)] = f.U(i, j);
          for (int c = 0; c < f.dc(); ++c)
            for (int u = 0; u < f.m(); ++u)
              lam[static_cast<size_t>(c * f.m() + u)] = f.lambda(c, u);
          for (int t = 0; t < 5; ++t)
            for (int c = 0; c < f.dc(); ++c) pos[static_cast<size_t>(t * f.dc() + c)] = r(t, c);
          kernels::StructuredDims sd;
          sd.T = 5;
          sd.D = D;
          sd.M = f.m();
          sd.DC = f.dc();
          kernels::structured_forward<double>(sd, false, x.data(), U.data(), lam.data(), pos.data(),
                                              y.data());
          for (int t = 0; t < 5; ++t) {
            const Eigen::Map<const Eigen::VectorXd> xv(x.data() + t * D, D),
                got(y.data() + t * D, D);
            const Eigen::VectorXd want = f.rotation(r.row(t).transpose()) * xv;
            EXPECT_LT((got - want).norm(), 1e-10 * (1 + want.norm())) << to_string(layout);
          }
        }
      continue;
    }
    // the one call path against the dense references, both layouts, random parameters
    for (auto layout : {Layout::Interleaved, Layout::HalfSplit}) {
      const ParamValues pv = random_params(m, rng);
      const std::vector<double> pos = {0, 3, 17.5, 400};
      const kernels::Dims dims{1, 2, static_cast<int64_t>(pos.size())};
      const double c0 = m.window_center(0, 400);
      const kernels::Positions P{pos.data(), false, c0};
      const auto plan = kernels::MechanismPlan::from(m, layout);
      const kernels::ParamBuffers<double> par(pv);
      const auto trig = kernels::build_trig_table<double>(plan.position, dims, P);
      const auto q = test::normal_vec(static_cast<size_t>(2 * pos.size() * D), rng);
      const auto k = test::normal_vec(q.size(), rng);
      std::vector<double> qo(q.size()), ko(k.size());
      kernels::mechanism_forward<double>(plan, dims, P, par.view(), trig.view(), q.data(), k.data(),
                                         qo.data(), ko.data());
      for (int h = 0; h < 2; ++h)
        for (size_t t = 0; t < pos.size(); ++t) {
          const size_t row = (static_cast<size_t>(h) * pos.size() + t) * D;
          const Eigen::Map<const Eigen::VectorXd> qv(q.data() + row, D), kv(k.data() + row, D);
          const Eigen::VectorXd want_k = reference::key_map(m, pv, h, pos[t] - c0, layout) * kv;
          const Eigen::VectorXd want_q = reference::query_map(m, pv, h, pos[t] - c0, layout) * qv;
          const Eigen::Map<const Eigen::VectorXd> got_k(ko.data() + row, D),
              got_q(qo.data() + row, D);
          EXPECT_LT((got_k - want_k).norm(), 1e-10 * (1 + want_k.norm())) << to_string(layout);
          EXPECT_LT((got_q - want_q).norm(), 1e-10 * (1 + want_q.norm())) << to_string(layout);
        }
    }
  }
}

// A fixed map before the position term conjugates the relative operator: with a non-orthogonal M
// the queries need M^{-T}; verify must catch a wrong contragredient there too.
TEST(Catalog, FixedMapsNeedTheirInverseTransposeOnQueries) {
  Mechanism m =
      build_mechanism("orthogonal_mix(seed=5) + jordan(m=2, regime=raw, eta0=0.05)", 8, 1);
  auto& fixed = m.transforms[0];
  // M = Q diag(1..8): invertible, not orthogonal; M^{-T} = Q diag(1/1..1/8)
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      fixed.matrix[i * 8 + j] *= (j + 1);
      fixed.matrix_inv_t[i * 8 + j] /= (j + 1);
    }
  diag::VerifyOptions o;
  o.max_lag = 1024;
  o.positions = 12;
  o.heads = 1;
  o.head_dim = 8;
  for (const auto& r : diag::verify_mechanism(m, "scaled mix + jordan", o, {"f64"}))
    EXPECT_EQ(r.status, "PASS") << r.reason;
  fixed.matrix_inv_t = fixed.matrix;  // the primal map on queries
  for (const auto& r : diag::verify_mechanism(m, "wrong mix + jordan", o, {"f64"}))
    EXPECT_EQ(r.status, "FAIL");
}
