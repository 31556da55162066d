// Spec grammar (core/spec.hpp), reference-name aliases and the registry's builder
// (core/registry.hpp): errors and the Mechanism fields of every reference alias (spec 1.3-1.8).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/charts.hpp"
#include "core/mechanism.hpp"
#include "core/parse.hpp"
#include "core/registry.hpp"
#include "core/spec.hpp"

using namespace relpos;

namespace {

using Args = std::vector<std::pair<std::string, std::string>>;

// The spec must fail with InputError whose message contains every one of `needles`.
void expect_input_error(const std::string& spec, int head_dim, int heads,
                        const std::vector<std::string>& needles) {
  SCOPED_TRACE("spec '" + spec + "'");
  try {
    build_mechanism(spec, head_dim, heads);
    ADD_FAILURE() << "no InputError";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

void expect_parse_error(const std::string& spec, const std::string& needle) {
  SCOPED_TRACE("spec '" + spec + "'");
  try {
    parse_spec(spec);
    ADD_FAILURE() << "no InputError";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_NE(msg.find("'" + spec + "'"), std::string::npos)
        << "message must quote the spec: " << msg;
  }
}

JordanSegment only_segment(const Mechanism& m) {
  EXPECT_EQ(m.segments().size(), 1u);
  return m.segments().at(0);
}

// sign -1: RoPE segments store -omega (they rotate by +omega p, the RoFormer convention)
void expect_prefix_grid(const JordanSegment& s, int hd, double sign = 1.0) {
  ASSERT_EQ(static_cast<int>(s.omega.size()), s.blocks);
  for (int b = 0; b < s.blocks; ++b)
    EXPECT_NEAR(s.omega[b], sign * std::pow(10000.0, -2.0 * b / hd), 1e-15) << "block " << b;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Grammar

TEST(SpecGrammar, SingleBareTerm) {
  const auto t = parse_spec("rope");
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].name, "rope");
  EXPECT_TRUE(t[0].args.empty());
  const auto e = parse_spec("rope()");
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].name, "rope");
  EXPECT_TRUE(e[0].args.empty());
}

TEST(SpecGrammar, ArgumentsInOrderWithWhitespace) {
  const auto t = parse_spec("  jordan ( m = 3 ,regime=scaled,  c=0.5 )  +\talibi ");
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].name, "jordan");
  EXPECT_EQ(t[0].args, (Args{{"m", "3"}, {"regime", "scaled"}, {"c", "0.5"}}));
  EXPECT_EQ(t[1].name, "alibi");
  EXPECT_TRUE(t[1].args.empty());
}

TEST(SpecGrammar, PlusSeparatesTermsOnlyOutsideParentheses) {
  const auto t = parse_spec("a(x=1)+b(y=2/3, z=w)+c_1");
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0].name, "a");
  EXPECT_EQ(t[0].args, (Args{{"x", "1"}}));
  EXPECT_EQ(t[1].args, (Args{{"y", "2/3"}, {"z", "w"}}));
  EXPECT_EQ(t[2].name, "c_1");
  const auto u = parse_spec("f(x=1+2)");
  ASSERT_EQ(u.size(), 1u);
  EXPECT_EQ(u[0].args, (Args{{"x", "1+2"}}));
}

TEST(SpecGrammar, Errors) {
  expect_parse_error("rope(", "unbalanced '('");
  expect_parse_error("rope(theta=1", "unbalanced '('");
  expect_parse_error("rope)", "unbalanced ')'");
  expect_parse_error("rope(theta=1))(", "unbalanced ')'");
  expect_parse_error("rope(theta)", "not key=value");
  expect_parse_error("jordan(m=2, 3)", "not key=value");
  expect_parse_error("rope(theta=1, theta=2)", "given twice");
  expect_parse_error("rope + ", "empty term");
  expect_parse_error("+ rope", "empty term");
  expect_parse_error("rope ++ alibi", "empty term");
  expect_parse_error("", "empty term");
  expect_parse_error("rope(theta=)", "empty value");
  expect_parse_error("rope(1x=2)", "bad key");
  expect_parse_error("ro pe", "bad mechanism name");
  expect_parse_error("rope(theta=1) x", "must end with ')'");
}

// ---------------------------------------------------------------------------------------------
// Reference aliases (spec 1.4 naming rules)

TEST(SpecAliases, ExpandToSpecStrings) {
  EXPECT_EQ(expand_reference_alias("jordan_rope"),
            "jordan(m=2, regime=stabilized, direction=paper)");
  EXPECT_EQ(expand_reference_alias("jordan_raw_tau"), "jordan(m=2, regime=raw, direction=paper)");
  EXPECT_EQ(expand_reference_alias("rope_alibi"), "rope + alibi");
  EXPECT_EQ(expand_reference_alias("damped_rope_alibi"), "damped_rope + alibi");
  // plain mechanism names and unknown names are not aliases
  for (const std::string n : {"rope", "alibi", "jordan", "damped_rope", "foo", "jordan_foo"})
    EXPECT_EQ(expand_reference_alias(n), "") << n;
}

TEST(SpecAliases, NameParsingRules) {
  const auto m = [](const std::string& name) { return build_mechanism(name, 48, 4); };
  {  // c token = digits/100, eta token >= 3 digits = digits/1000 (spec 5: gamma 0.5/L, eta 0.005)
    const auto s = only_segment(m("jordan_exact_c050_eta005"));
    EXPECT_DOUBLE_EQ(s.gamma_init, 0.5 / 1024);
    EXPECT_DOUBLE_EQ(s.eta_init, 0.005);
    EXPECT_DOUBLE_EQ(s.eta_max, 0.1);
    EXPECT_EQ(s.order, 2);
  }
  {  // `_eta1` switches eta_max only; defaults c = 1, m = 2
    const auto s = only_segment(m("jordan_exact_c010_eta1"));
    EXPECT_DOUBLE_EQ(s.eta_init, 0.0);
    EXPECT_DOUBLE_EQ(s.eta_max, 1.0);
    const auto d = only_segment(m("jordan_exact_scaled"));
    EXPECT_DOUBLE_EQ(d.gamma_init, 1.0 / 1024);
    EXPECT_EQ(d.order, 2);
  }
  {
    const auto s = only_segment(m("jordan_exact_m4_c010_eta010"));
    EXPECT_EQ(s.order, 4);
    EXPECT_DOUBLE_EQ(s.gamma_init, 0.1 / 1024);
    EXPECT_DOUBLE_EQ(s.eta_init, 0.01);
  }
  {  // jetmix gate tokens -> digits/100, default order 4
    const auto s = only_segment(m("jordan_jetmix_m4_c150_g050_g030_g020"));
    EXPECT_EQ(s.order, 4);
    EXPECT_EQ(s.gate_init, (std::vector<double>{0.5, 0.3, 0.2}));
  }
  // gate count must match the order
  expect_input_error("jordan_jetmix_m3_c150_g010", 48, 4, {"gates"});
}

TEST(SpecAliases, JordanRopeIsStabilizedOrderTwo) {
  const auto m = build_mechanism("jordan_rope", 32, 2);
  EXPECT_EQ(m.name, "jordan");
  const auto& s = only_segment(m);
  EXPECT_EQ(s.order, 2);
  EXPECT_EQ(s.blocks, 8);
  EXPECT_EQ(s.first_pair, 0);
  EXPECT_EQ(s.chart, Chart::Bounded);
  EXPECT_DOUBLE_EQ(s.L, 1024.0);
  EXPECT_DOUBLE_EQ(s.shear_scale, 1.0);
  EXPECT_EQ(s.shear, ShearMode::Exponential);
  EXPECT_TRUE(s.damped);
  EXPECT_TRUE(s.learn_gamma);
  EXPECT_DOUBLE_EQ(s.gamma_init, 1e-4);
  EXPECT_DOUBLE_EQ(s.gamma_min, 1e-4);
  EXPECT_DOUBLE_EQ(s.eta_init, 0.0);
  EXPECT_DOUBLE_EQ(s.eta_max, 0.1);
  EXPECT_TRUE(s.learn_eta);
  EXPECT_DOUBLE_EQ(s.max_exponent, 30.0);
  EXPECT_FALSE(m.slope_bias() != nullptr);
  EXPECT_FALSE(m.transform_exact());
  EXPECT_EQ(m.center, CenterMode::None);  // approximate: no centring by default
  // spec 1.3 example: hd 32, m 2 uses omega_0..omega_7 = 10000^(-b/16)
  expect_prefix_grid(s, 32);
}

TEST(SpecAliases, RawTauNoGammaAndEta) {
  {
    const auto m = build_mechanism("jordan_raw_tau", 32, 2);
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 2);
    EXPECT_EQ(s.chart, Chart::Raw);
    EXPECT_DOUBLE_EQ(s.shear_scale, 1.0);
    EXPECT_DOUBLE_EQ(s.gamma_init, 1e-4);
    EXPECT_DOUBLE_EQ(s.gamma_min, 1e-4);
    EXPECT_DOUBLE_EQ(s.eta_max, 0.1);
    EXPECT_TRUE(m.transform_exact());
    // exact: a fixed centre in the middle of the training context by default
    EXPECT_EQ(m.center, CenterMode::Fixed);
    EXPECT_DOUBLE_EQ(m.center_value, 512.0);
  }
  {
    const auto m = build_mechanism("jordan_no_gamma", 32, 2);
    const auto& s = only_segment(m);
    EXPECT_EQ(s.chart, Chart::Bounded);
    EXPECT_FALSE(s.damped);
    EXPECT_FALSE(s.learn_gamma);
    EXPECT_EQ(s.shear, ShearMode::Exponential);
    const auto p = default_params(m);
    for (double g : p.gamma) EXPECT_EQ(g, 0.0);
  }
  {
    const auto& s = only_segment(build_mechanism("jordan_eta020", 32, 2));
    EXPECT_EQ(s.chart, Chart::Bounded);
    EXPECT_DOUBLE_EQ(s.eta_init, 0.02);
    EXPECT_DOUBLE_EQ(s.eta_max, 0.1);
    EXPECT_DOUBLE_EQ(s.gamma_init, 1e-4);
  }
  {
    const auto m = build_mechanism("jordan_m3", 48, 2);
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 3);
    EXPECT_EQ(s.blocks, 8);  // hd / (2m)
    EXPECT_EQ(s.chart, Chart::Bounded);
    EXPECT_DOUBLE_EQ(s.shear_scale, 1.0);
    expect_prefix_grid(s, 48);  // first hd/(2m) entries of theta^(-2b/hd)
  }
}

TEST(SpecAliases, ScaledExact) {
  {
    const auto m = build_mechanism("jordan_exact_c010", 64, 4);
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 2);
    EXPECT_EQ(s.blocks, 16);
    EXPECT_EQ(s.chart, Chart::Raw);
    EXPECT_DOUBLE_EQ(s.shear_scale, 1.0 / 1024);
    EXPECT_DOUBLE_EQ(s.gamma_init, 0.1 / 1024);
    EXPECT_DOUBLE_EQ(s.gamma_min, 0.0);
    EXPECT_TRUE(s.learn_gamma);
    EXPECT_DOUBLE_EQ(s.eta_init, 0.0);
    EXPECT_DOUBLE_EQ(s.eta_max, 0.1);
    EXPECT_TRUE(s.learn_eta);
    EXPECT_TRUE(m.transform_exact());
    EXPECT_FALSE(m.slope_bias() != nullptr);
    expect_prefix_grid(s, 64);
  }
  {
    const auto m = build_mechanism("jordan_exact_m3_c050_eta100_eta1", 48, 4);
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 3);
    EXPECT_EQ(s.blocks, 8);
    EXPECT_EQ(s.chart, Chart::Raw);
    EXPECT_DOUBLE_EQ(s.shear_scale, 1.0 / 1024);
    EXPECT_DOUBLE_EQ(s.gamma_init, 0.5 / 1024);
    EXPECT_DOUBLE_EQ(s.eta_init, 0.1);
    EXPECT_DOUBLE_EQ(s.eta_max, 1.0);
    expect_prefix_grid(s, 48);
    const auto p = default_params(m);
    ASSERT_EQ(p.eta.size(), 4u * 8u);
    for (double e : p.eta) EXPECT_DOUBLE_EQ(e, 0.1);
    for (double g : p.gamma) EXPECT_DOUBLE_EQ(g, 0.5 / 1024);
  }
  {
    const auto m = build_mechanism("jordan_exact_c150_eta010_alibi", 32, 6);
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 2);
    EXPECT_DOUBLE_EQ(s.gamma_init, 1.5 / 1024);
    EXPECT_DOUBLE_EQ(s.eta_init, 0.01);
    EXPECT_DOUBLE_EQ(s.eta_max, 0.1);
    ASSERT_TRUE(m.slope_bias() != nullptr);
    EXPECT_EQ(m.slope_bias()->slopes, alibi_slopes(6));
    EXPECT_EQ(m.name, "jordan");
  }
  {  // options of the spec form reach the segment (spec 5: L 20 gives gamma 0.5/20)
    const auto& s =
        only_segment(build_mechanism("jordan(m=2, regime=scaled, c=0.5, L=20, eta0=0.005)", 8, 1));
    EXPECT_DOUBLE_EQ(s.gamma_init, 0.5 / 20);
    EXPECT_DOUBLE_EQ(s.shear_scale, 1.0 / 20);
    EXPECT_DOUBLE_EQ(s.eta_init, 0.005);
  }
}

TEST(SpecAliases, JetGates) {
  {
    const auto m = build_mechanism("jordan_jetmix_m3_c150_g010_g005", 48, 2);
    EXPECT_EQ(m.name, "jetmix");
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 3);
    EXPECT_EQ(s.blocks, 8);
    EXPECT_EQ(s.shear, ShearMode::Gates);
    EXPECT_EQ(s.chart, Chart::Bounded);  // jetmix inherits bounded tau (spec 1.8)
    EXPECT_DOUBLE_EQ(s.shear_scale, 1.0 / 1024);
    EXPECT_EQ(s.gate_init, (std::vector<double>{0.1, 0.05}));
    EXPECT_DOUBLE_EQ(s.gate_max, 1.0);
    EXPECT_TRUE(s.learn_gates);
    EXPECT_DOUBLE_EQ(s.alpha0_init, 1.0);
    EXPECT_FALSE(s.learn_alpha0);
    EXPECT_FALSE(m.transform_exact());
    EXPECT_EQ(m.gate_rows(), 2);
    expect_prefix_grid(s, 48);
    const auto p = default_params(m);
    const size_t hb = 2u * 8u;
    ASSERT_EQ(p.gates.size(), 2 * hb);
    EXPECT_DOUBLE_EQ(p.gates[0], 0.1);
    EXPECT_DOUBLE_EQ(p.gates[hb + 3], 0.05);
  }
  {
    const auto m = build_mechanism("jordan_jetmixfull_m4_c150_g100_g050_g030_g020", 32, 2);
    EXPECT_EQ(m.name, "jetmixfull");
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 4);
    EXPECT_EQ(s.blocks, 4);
    EXPECT_EQ(s.shear, ShearMode::Gates);
    EXPECT_EQ(s.chart, Chart::Bounded);
    EXPECT_DOUBLE_EQ(s.shear_scale, 1.0 / 1024);
    EXPECT_DOUBLE_EQ(s.alpha0_init, 1.0);
    EXPECT_EQ(s.gate_init, (std::vector<double>{0.5, 0.3, 0.2}));
    EXPECT_DOUBLE_EQ(s.gate_max, 2.0);
    EXPECT_TRUE(s.learn_gates);
    EXPECT_TRUE(s.learn_alpha0);
    EXPECT_EQ(m.gate_rows(), 3);
  }
  {
    const auto m = build_mechanism("jordan_jetmix_m3_c150_g010_g005_alibi", 48, 4);
    ASSERT_TRUE(m.slope_bias() != nullptr);
    EXPECT_EQ(m.slope_bias()->slopes, alibi_slopes(4));
  }
}

// Spec 1.4 table / section 5: jetmix and jetmixfull have gamma init c/L and gamma_min 0
// (`jordan_jetmix_m4_c150_g050_g030_g020` at L 20 gives gamma 1.5/20), like scaled-exact.
TEST(SpecAliases, JetGateDampingIsCOverL) {
  for (const std::string spec :
       {"jordan_jetmix_m3_c150_g010_g005", "jordan_jetmixfull_m4_c150_g100_g050_g030_g020",
        "jetmix(m=3, c=1.5, gates=0.1/0.05)"}) {
    const auto& s = only_segment(build_mechanism(spec, 48, 2));
    EXPECT_DOUBLE_EQ(s.gamma_init, 1.5 / 1024) << spec;
    EXPECT_DOUBLE_EQ(s.gamma_min, 0.0) << spec;
  }
  const auto& s =
      only_segment(build_mechanism("jetmix(m=4, c=1.5, L=20, gates=0.5/0.3/0.2)", 48, 2));
  EXPECT_DOUBLE_EQ(s.gamma_init, 1.5 / 20);
}

TEST(SpecAliases, RopeAlibiAndDampedRope) {
  {
    const auto m = build_mechanism("rope_alibi", 16, 4);
    EXPECT_EQ(m.name, "rope");
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 1);
    EXPECT_EQ(s.blocks, 8);
    EXPECT_FALSE(s.damped);
    EXPECT_EQ(s.shear, ShearMode::None);
    expect_prefix_grid(s, 16, -1.0);  // all hd/2 frequencies, rotating by +omega p
    ASSERT_TRUE(m.slope_bias() != nullptr);
    EXPECT_EQ(m.slope_bias()->slopes, (std::vector<double>{0.25, 0.0625, 0.015625, 0.00390625}));
    EXPECT_EQ(m.exactness(), "exact + augmented bias");
  }
  {
    const auto m = build_mechanism("alibi", 16, 8);
    EXPECT_FALSE(m.has_transform());
    ASSERT_TRUE(m.slope_bias() != nullptr);
    EXPECT_EQ(m.slope_bias()->slopes.size(), 8u);
    EXPECT_EQ(m.exactness(), "augmented exact");
  }
  {  // spec 1.5: order 2, eta forced 0, hd/4 frequencies each on two pairs, gamma 1e-4 / 1e-4
    const auto m = build_mechanism("damped_rope", 32, 2);
    const auto& s = only_segment(m);
    EXPECT_EQ(s.order, 2);
    EXPECT_EQ(s.blocks, 8);
    EXPECT_EQ(s.shear, ShearMode::None);
    EXPECT_TRUE(s.damped);
    EXPECT_TRUE(s.learn_gamma);
    EXPECT_DOUBLE_EQ(s.gamma_init, 1e-4);
    EXPECT_DOUBLE_EQ(s.gamma_min, 1e-4);
    expect_prefix_grid(s, 32, -1.0);  // rope's sense (direction=rope, the default)
    EXPECT_TRUE(m.transform_exact());
    const auto& s1 = only_segment(build_mechanism("damped_rope(m=1)", 32, 2));
    EXPECT_EQ(s1.order, 1);
    EXPECT_EQ(s1.blocks, 16);
    expect_prefix_grid(s1, 32, -1.0);
  }
}

TEST(SpecAliases, DirectSumLayout) {
  const int D = 32;
  const auto m = build_mechanism("direct_sum", D, 2);
  ASSERT_EQ(m.segments().size(), 2u);
  const auto& r = m.segments()[0];
  EXPECT_EQ(r.order, 1);
  EXPECT_EQ(r.first_pair, 0);
  EXPECT_EQ(r.first_block, 0);
  EXPECT_EQ(r.blocks, D / 4);
  EXPECT_FALSE(r.damped);
  ASSERT_EQ(static_cast<int>(r.omega.size()), D / 4);
  for (int k = 0; k < D / 4; ++k)  // RoPE built for dim D/2: theta^(-2k/(D/2))
    EXPECT_NEAR(r.omega[k], -std::pow(10000.0, -2.0 * k / (D / 2)), 1e-15) << k;
  const auto& j = m.segments()[1];
  EXPECT_EQ(j.order, 2);
  EXPECT_EQ(j.first_pair, D / 4);
  EXPECT_EQ(j.first_block, D / 4);
  EXPECT_EQ(j.blocks, D / 8);
  EXPECT_EQ(j.chart, Chart::Bounded);
  EXPECT_EQ(j.shear, ShearMode::Exponential);
  EXPECT_TRUE(j.damped);
  EXPECT_DOUBLE_EQ(j.eta_max, 0.1);
  for (double w : j.omega) EXPECT_EQ(w, 0.0);
  EXPECT_EQ(m.total_blocks(), D / 4 + D / 8);
  EXPECT_FALSE(m.transform_exact());
  EXPECT_TRUE(build_mechanism("direct_sum(regime=raw)", D, 2).transform_exact());
  {
    const auto rj = build_mechanism("real_jordan", 16, 1);
    const auto& s = only_segment(rj);
    EXPECT_EQ(s.order, 2);
    EXPECT_EQ(s.blocks, 4);
    for (double w : s.omega) EXPECT_EQ(w, 0.0);
  }
}

TEST(SpecBuild, CentreModes) {
  // auto on an exact map: fixed floor(L/2), the same for every call (prefill + decode compose)
  const auto a = build_mechanism("jordan(m=2, regime=raw)", 8, 1);
  EXPECT_EQ(a.center, CenterMode::Fixed);
  EXPECT_TRUE(a.center_auto);
  EXPECT_DOUBLE_EQ(a.resolve_center(0, 100), 512.0);
  EXPECT_DOUBLE_EQ(a.resolve_center(5000, 5001), 512.0);
  EXPECT_DOUBLE_EQ(build_mechanism("jordan(m=2, regime=raw, L=101)", 8, 1).resolve_center(0, 9),
                   50.0);
  // a diagnostic over one window centres it there
  EXPECT_DOUBLE_EQ(a.window_center(10, 21), 15.0);
  EXPECT_EQ(build_mechanism("jordan(m=2, regime=raw, center=none)", 8, 1).center, CenterMode::None);
  EXPECT_EQ(build_mechanism("jordan(m=2, regime=stabilized, center=mid)", 8, 1).center,
            CenterMode::Mid);
  const auto f = build_mechanism("jordan(m=2, regime=raw, center=12.5)", 8, 1);
  EXPECT_EQ(f.center, CenterMode::Fixed);
  EXPECT_DOUBLE_EQ(f.resolve_center(0, 100), 12.5);
  const auto mid = build_mechanism("damped_rope(center=mid)", 8, 1);
  EXPECT_DOUBLE_EQ(mid.resolve_center(10, 21), 15.0);  // floor((10 + 21) / 2)
  EXPECT_DOUBLE_EQ(build_mechanism("damped_rope", 8, 1).resolve_center(10, 21), 512.0);
  EXPECT_DOUBLE_EQ(f.window_center(0, 100), 12.5);  // an explicit centre is kept
  EXPECT_DOUBLE_EQ(build_mechanism("jordan_rope", 8, 1).resolve_center(10, 21), 0.0);
}

// ---------------------------------------------------------------------------------------------
// Builder errors: every one is an InputError that names the problem.

TEST(SpecBuild, UnknownNameListsValidNames) {
  expect_input_error("jordna(m=2)", 64, 4,
                     {"jordna", "rope", "jordan", "alibi", "damped_rope", "direct_sum", "jetmix"});
  expect_input_error("rope + alibii", 64, 4, {"alibii", "valid"});
}

TEST(SpecBuild, UnknownKeyListsValidKeys) {
  expect_input_error("jordan(mm=2)", 64, 4, {"mm", "regime", "eta0", "eta_max", "theta", "grid"});
  expect_input_error("rope(L=3)", 64, 4, {"'L'", "theta"});
  expect_input_error("nope(x=1)", 64, 4, {"'x'", "none"});
}

TEST(SpecBuild, BadValues) {
  expect_input_error("jordan(L=0)", 64, 4, {"L", "range"});
  expect_input_error("jordan(L=-5)", 64, 4, {"L"});
  expect_input_error("jordan(L=abc)", 64, 4, {"L", "abc"});
  expect_input_error("jordan(L=12abc)", 64, 4, {"12abc"});
  expect_input_error("jordan(L=inf)", 64, 4, {"inf"});
  expect_input_error("jordan(m=2.5)", 64, 4, {"m", "integer"});
  expect_input_error("jordan(m=9)", 64, 4, {"m"});
  expect_input_error("jordan(regime=exact)", 64, 4, {"regime", "raw", "scaled", "stabilized"});
  expect_input_error("jordan(learn_eta=maybe)", 64, 4, {"learn_eta"});
  expect_input_error("jordan(c=-1, regime=scaled)", 64, 4, {"c"});
  expect_input_error("rope", 0, 4, {"head dim"});
  expect_input_error("rope", 64, 0, {"head count"});
}

// Regression (issue 7): values outside what the references and kernels can represent.
TEST(SpecBuild, NumericOptionsHaveRanges) {
  expect_input_error("jordan(regime=scaled, c=1e308)", 64, 4, {"c=1e308", "range"});
  expect_input_error("jordan(L=1e-300)", 64, 4, {"L=1e-300", "range"});
  expect_input_error("rope(theta=1e-300)", 64, 4, {"theta=1e-300", "range"});
  expect_input_error("jordan(regime=raw, center=1e308)", 64, 4, {"center=1e308", "range"});
  expect_input_error("damped_rope(max_exp=710)", 64, 4, {"max_exp", "range"});
  expect_input_error("jordan(gamma0=1e5)", 64, 4, {"gamma0", "range"});
  expect_input_error("jordan(m=1e300)", 64, 4, {"m", "integer"});
  expect_input_error("jetmix(m=3, gates=1e300/0.1)", 48, 4, {"gates"});
  expect_input_error("jordan(L=1024x)", 64, 4, {"1024x"});
  expect_input_error("jordan(L=0x10)", 64, 4, {"0x10"});
  expect_input_error("rope", kMaxHeadDim + 2, 4, {"head dim"});
  expect_input_error("rope", 64, kMaxHeads + 1, {"head count"});
  EXPECT_NO_THROW(build_mechanism("damped_rope(gamma0=10, max_exp=700)", 16, 1));
  EXPECT_NO_THROW(build_mechanism("jordan(L=+2048, c=+1, regime=scaled)", 64, 1));
  // every catalogued numeric option shows its range
  for (const auto& m : mechanism_catalog())
    for (const auto& o : m.options) {
      if (o.key == "L" || o.key == "theta" || o.key == "max_exp" || o.key == "center") {
        EXPECT_TRUE(o.has_range()) << m.name << " " << o.key;
      }
    }
}

// Regression (issue 7): reference names are parsed strictly; a typo is never read as a default.
TEST(SpecAliases, TrailingJunkIsAnError) {
  expect_input_error("jordan_exact_m3_c05O", 48, 4, {"c05O", "unknown token"});
  expect_input_error("jordan_exact_m3_c050_zzz", 48, 4, {"zzz"});
  expect_input_error("jordan_exact_c010_c020", 48, 4, {"c020", "repeats"});
  expect_input_error("jordan_exact_eta05", 48, 4, {"eta05"});  // eta needs 3+ digits
  expect_input_error("jordan_exactly", 48, 4, {"unknown mechanism", "jordan_exactly"});
  expect_input_error("jordan_jetmixXYZ_m3_g010_g005", 48, 4, {"unknown mechanism"});
  expect_input_error("jordan_jetmix_m3_g010_g005x", 48, 4, {"g005x"});
  expect_input_error("jordan_jetmix_m3_c150", 48, 4, {"no gate tokens"});
  expect_input_error("jordan_m99999999999", 48, 4, {"m99999999999", "9 decimal digits"});
  expect_input_error("jordan_exact_m99999999999", 48, 4, {"m99999999999"});
  expect_input_error("jordan_eta99999999999999999999", 48, 4, {"eta99999999999999999999"});
  expect_input_error("jordan_m9", 48, 4, {"m", "[1, 8]"});
  expect_input_error("jordan_exact_m3_c050_alibi_alibi", 48, 4, {"unknown token 'alibi'"});
  // what the reference accepts still expands
  EXPECT_EQ(expand_reference_alias("jordan_exact_scaled"),
            "jordan(m=2, regime=scaled, c=1, eta0=0, eta_max=0.1, direction=paper)");
  EXPECT_EQ(expand_reference_alias("jordan_exact_m3_c050_eta100_eta1_alibi"),
            "jordan(m=3, regime=scaled, c=0.5, eta0=0.1, eta_max=1, direction=paper) + alibi");
  EXPECT_EQ(expand_reference_alias("jordan_jetmixfull_m4_c150_g100_g050_g030_g020"),
            "jetmixfull(m=4, c=1.5, alpha=1/0.5/0.3/0.2, direction=paper)");
}

// Regression (issue 7): a 100 KB spec is named in a message by its start and length only.
TEST(SpecBuild, LongSpecsAreShortenedInMessages) {
  const std::string huge = "rope(theta=" + std::string(100000, '1') + ")";
  for (const std::string& spec :
       {huge, std::string(100000, 'x'), "rope + " + std::string(50000, '(')}) {
    try {
      build_mechanism(spec, 64, 4);
      ADD_FAILURE() << "no error";
    } catch (const InputError& e) {
      EXPECT_LT(std::string(e.what()).size(), 1000u);
    }
  }
}

TEST(SpecBuild, HeadDimMustDivideByTwoM) {
  expect_input_error("jordan(m=3)", 64, 4, {"64", "divisible by 6"});
  expect_input_error("jordan(m=5, regime=scaled)", 64, 4, {"divisible by 10"});
  expect_input_error("direct_sum", 12, 4, {"divisible by 8"});
  expect_input_error("real_jordan", 6, 4, {"divisible by 4"});
  expect_input_error("rope", 7, 4, {"divisible by 2"});
  expect_input_error("jetmix(m=4, gates=0.1/0.1/0.1)", 36, 4, {"divisible by 8"});
  EXPECT_NO_THROW(build_mechanism("jordan(m=3)", 48, 4));
}

// Several transforms compose in spec order; at most one of them may be position-driven.
TEST(SpecBuild, TransformsComposeWithOnePositionDrivenTerm) {
  expect_input_error("rope + jordan", 64, 4, {"two position-driven transforms"});
  expect_input_error("rope_alibi + damped_rope", 64, 4, {"two position-driven transforms"});
  const auto m = build_mechanism("orthogonal_mix(seed=3) + rope + alibi", 8, 2);
  ASSERT_EQ(m.transforms.size(), 2u);
  EXPECT_EQ(m.transforms[0].kind, TransformKind::FixedLinear);
  EXPECT_TRUE(m.transforms[0].orthogonal_fixed());
  EXPECT_EQ(m.transforms[1].kind, TransformKind::JordanBlocks);
  EXPECT_EQ(m.position_term(), &m.transforms[1]);
  ASSERT_EQ(m.biases.size(), 1u);
  EXPECT_EQ(m.biases[0].shape, BiasShape::LagTable);
  EXPECT_TRUE(m.transform_exact());
  // the fixed map is orthogonal: M M^T = I
  const auto& M = m.transforms[0].matrix;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      double s = 0;
      for (int k = 0; k < 8; ++k) s += M[i * 8 + k] * M[j * 8 + k];
      EXPECT_NEAR(s, i == j ? 1.0 : 0.0, 1e-14);
    }
  // the parameter schema: gamma and eta per head and block (RoPE: none learnable)
  const auto d = build_mechanism("jordan(m=2, regime=raw)", 8, 2);
  ASSERT_EQ(d.params.size(), 2u);
  EXPECT_EQ(d.params[0].name, "gamma");
  EXPECT_EQ(d.params[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(d.params[0].reparam, Reparam::SoftplusFloor);
  EXPECT_TRUE(d.params[0].any_learnable());
  EXPECT_EQ(d.params[1].reparam, Reparam::BoundedTanh);
  EXPECT_FALSE(m.params[0].any_learnable());
  expect_input_error("alibi + alibi", 64, 4, {"alibi twice"});
  EXPECT_TRUE(build_mechanism("jordan(m=2, regime=scaled, c=0.1) + alibi", 64, 4).slope_bias() !=
              nullptr);
  EXPECT_TRUE(build_mechanism("alibi + rope", 64, 4).slope_bias() != nullptr);
}

// A reference method name used as one term of a composed spec expands in place (registry.cpp's own
// example: `jordan_exact_c010 + alibi`), giving the same mechanism as the `_alibi` suffix form.
// Only a bare name is an alias: before commit 94811e6 the whole string "jordan_exact_c010 + alibi"
// was taken as one alias (tokens {jordan, exact, "c010 + alibi"}) and silently became
// jordan(c=1) without ALiBi.
TEST(SpecBuild, ReferenceNameComposesWithBiasTerms) {
  EXPECT_EQ(expand_reference_alias("jordan_exact_c010 + alibi"), "");
  const auto m = build_mechanism("jordan_exact_c010 + alibi", 64, 4);
  EXPECT_TRUE(m.slope_bias() != nullptr);
  EXPECT_DOUBLE_EQ(only_segment(m).gamma_init, 0.1 / 1024);
  EXPECT_EQ(m.spec, build_mechanism("jordan_exact_c010_alibi", 64, 4).spec);
  EXPECT_NO_THROW(build_mechanism("jordan_jetmix_m3_c150_g010_g005 + alibi", 48, 4));
}

TEST(SpecBuild, EtaMustBeBelowEtaMax) {
  expect_input_error("jordan(eta0=0.1)", 64, 4, {"eta0", "eta_max"});
  expect_input_error("jordan(eta0=-0.2, eta_max=0.15)", 64, 4, {"eta_max"});
  expect_input_error("real_jordan(eta0=1)", 64, 4, {"eta_max"});
  expect_input_error("jordan(eta_max=0)", 64, 4, {"eta_max"});
  EXPECT_NO_THROW(build_mechanism("jordan(eta0=-0.09)", 64, 4));
}

TEST(SpecBuild, JetGateLists) {
  expect_input_error("jetmix(m=3, gates=0.1)", 48, 4, {"m-1 = 2", "got 1"});
  expect_input_error("jetmix(m=2, gates=0.1/0.2)", 48, 4, {"m-1 = 1", "got 2"});
  expect_input_error("jetmix(m=3, gates=0.1/x)", 48, 4, {"gates"});
  expect_input_error("jetmix(m=3, gates=0.1/1.5)", 48, 4, {"gate_max"});
  expect_input_error("jetmix(m=3, regime=raw)", 48, 4, {"regime"});
  expect_input_error("jetmixfull(m=3, alpha=1/0.5)", 48, 4, {"m = 3", "got 2"});
  expect_input_error("jetmixfull(m=2, alpha=0/0.5)", 48, 4, {"alpha_0"});
  expect_input_error("jetspec(m=3, alpha=0.5/0.2/0.1)", 48, 4, {"sum to 1"});
  expect_input_error("jetspec(m=3, alpha=0.9/0.2/0.1)", 48, 4, {"sum to 1"});
  expect_input_error("jetspec(m=3, alpha=0.7/0.2)", 48, 4, {"m = 3"});
  expect_input_error("jetspec(m=3, alpha=1.1/0.2/-0.3)", 48, 4, {"non-negative"});
  EXPECT_NO_THROW(build_mechanism("jetspec(m=3, alpha=0.5/0.3/0.2)", 48, 4));
}

TEST(SpecBuild, CanonicalSpecSpellsEveryOption) {
  const auto m = build_mechanism("jordan_exact_m3_c050_eta100_eta1", 48, 4);
  for (const std::string kv : {"jordan(", "m=3", "regime=scaled", "c=0.5", "eta0=0.1", "eta_max=1",
                               "L=1024", "theta=10000", "max_exp=30"})
    EXPECT_NE(m.spec.find(kv), std::string::npos) << kv << " not in " << m.spec;
  // the canonical spec builds the same mechanism
  const auto again = build_mechanism(m.spec, 48, 4);
  EXPECT_EQ(again.spec, m.spec);
  EXPECT_DOUBLE_EQ(again.segments().at(0).gamma_init, m.segments().at(0).gamma_init);
}

TEST(SpecBuild, EveryDefaultSpecBuildsWithItsCatalogEntry) {
  std::vector<std::string> names;
  for (const auto& info : mechanism_catalog()) names.push_back(info.name);
  for (const auto& spec : verify_default_specs()) {
    bool built = false;
    for (int D : {64, 48, 60}) try {
        const auto m = build_mechanism(spec, D, 4);
        EXPECT_NE(std::find(names.begin(), names.end(), m.name), names.end()) << spec;
        built = true;
        break;
      } catch (const InputError&) {
      }
    EXPECT_TRUE(built) << spec;
  }
}

// The mechanism JSON carries each Jordan term's segments field for field: other backends (the
// Triton kernels, python/relpos/gpu/transform.py) build the per-position maps from it.
TEST(MechanismJson, SegmentsDescribeEachJordanTerm) {
  int checked = 0;
  for (const auto& spec : verify_default_specs()) {
    for (int D : {64, 48, 60}) try {
        const auto m = build_mechanism(spec, D, 4);
        const auto j = mechanism_json(m);
        ASSERT_EQ(j["transforms"].size(), m.transforms.size()) << spec;
        for (size_t t = 0; t < m.transforms.size(); ++t) {
          const auto& term = m.transforms[t];
          const auto& tj = j["transforms"][t];
          if (term.kind != TransformKind::JordanBlocks) {
            EXPECT_FALSE(tj.contains("segments")) << spec;
            continue;
          }
          ASSERT_EQ(tj["segments"].size(), term.segments.size()) << spec;
          for (size_t i = 0; i < term.segments.size(); ++i) {
            const auto& s = term.segments[i];
            const auto& sj = tj["segments"][i];
            EXPECT_EQ(sj["first_pair"], s.first_pair) << spec;
            EXPECT_EQ(sj["first_block"], s.first_block) << spec;
            EXPECT_EQ(sj["blocks"], s.blocks) << spec;
            EXPECT_EQ(sj["order"], s.order) << spec;
            EXPECT_EQ(sj["omega"].get<std::vector<double>>(), s.omega) << spec;
            EXPECT_EQ(sj["grid"]["theta"], s.grid.theta) << spec;
            EXPECT_EQ(sj["grid"]["dim"], s.grid.dim) << spec;
            EXPECT_EQ(sj["chart"], to_string(s.chart)) << spec;
            EXPECT_EQ(sj["L"], s.L) << spec;
            EXPECT_EQ(sj["shear_scale"], s.shear_scale) << spec;
            EXPECT_EQ(sj["shear"], s.shear == ShearMode::None          ? "none"
                                   : s.shear == ShearMode::Exponential ? "exponential"
                                                                       : "gates")
                << spec;
            EXPECT_EQ(sj["damped"], s.damped) << spec;
            EXPECT_EQ(sj["max_exponent"], s.max_exponent) << spec;
            ++checked;
          }
        }
        break;
      } catch (const InputError&) {
      }
  }
  EXPECT_GT(checked, 20);
}

// ---------------------------------------------------------------------------------------------
// Strict number parsing (core/parse.hpp): every user-facing number goes through it.

TEST(StrictParse, WholeTextFiniteNumbersOnly) {
  EXPECT_EQ(parse_finite_double("1.5"), 1.5);
  EXPECT_EQ(parse_finite_double("+2"), 2.0);
  EXPECT_EQ(parse_finite_double("-1e3"), -1000.0);
  for (const char* bad : {"", "nan", "inf", "-inf", "1e400", "0abc", "4xyz", " 1", "1 ", "++1",
                          "+-1", "1,5", "0x10", "1e", "."})
    EXPECT_FALSE(parse_finite_double(bad).has_value()) << "'" << bad << "'";
  EXPECT_EQ(parse_int64("42", 0, 100), 42);
  EXPECT_FALSE(parse_int64("101", 0, 100).has_value());
  EXPECT_FALSE(parse_int64("99999999999999999999", 0, INT64_MAX).has_value());
  EXPECT_FALSE(parse_int64("4.0", 0, 100).has_value());
  EXPECT_EQ(parse_uint64("18446744073709551615"), UINT64_MAX);
  EXPECT_FALSE(parse_uint64("18446744073709551616").has_value());
  EXPECT_FALSE(parse_uint64("99999999999999999999999").has_value());
  EXPECT_FALSE(parse_uint64("-1").has_value());
  EXPECT_EQ(brief("short"), "short");
  EXPECT_LT(brief(std::string(100000, 'a')).size(), 220u);
}
