// The attention ops: the fused kernel through the dispatcher (forward and every gradient) against
// the plain LibTorch composition in float64, causality, the mechanism-level call (transforms +
// biases), and bad input rejected with named errors.
#include <gtest/gtest.h>

#include <limits>

#include "torch/attention.hpp"

using namespace relpos;

namespace {

struct Case {
  int64_t B, Hq, Hk, Tq, Tk, D;
  bool causal = true;
  double window = 0;
  bool padding = false, real_positions = false, per_batch = false, biases = true;
};

// max |a - b| / max(max |b|, floor): relative, except for quantities that vanish exactly in exact
// arithmetic (the row sums of dS, the gradient to cq, are 0 by the shift invariance of softmax),
// which are compared to the floor (inputs are O(1))
double rel_err(const torch::Tensor& a, const torch::Tensor& b, double floor = 1e-300) {
  const double den = b.abs().max().item<double>();
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() /
         std::max(den, floor);
}

struct Inputs {
  torch::Tensor q, k, v;
  nn::AttentionArgs args;
  std::vector<torch::Tensor> leaves() const {
    std::vector<torch::Tensor> l{q, k, v};
    for (const auto& t : {args.lag_table, args.slopes, args.cq, args.ck})
      if (t.defined()) l.push_back(t);
    return l;
  }
  Inputs to(torch::ScalarType dt) const {
    Inputs r = *this;
    const auto cast = [&](const torch::Tensor& t, torch::ScalarType d) {
      return t.defined() ? t.detach().to(d).requires_grad_(true) : t;
    };
    r.q = cast(q, dt);
    r.k = cast(k, dt);
    r.v = cast(v, dt);
    r.args.lag_table = cast(args.lag_table, dt);
    r.args.slopes = cast(args.slopes, dt);
    // per-token scalars stay float64 (the kernel subtracts them in float64)
    r.args.cq = cast(args.cq, torch::kDouble);
    r.args.ck = cast(args.ck, torch::kDouble);
    return r;
  }
};

Inputs make_inputs(const Case& c, int seed) {
  torch::manual_seed(seed);
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  Inputs in;
  in.q = torch::randn({c.B, c.Hq, c.Tq, c.D}, f64);
  in.k = torch::randn({c.B, c.Hk, c.Tk, c.D}, f64);
  in.v = torch::randn({c.B, c.Hk, c.Tk, c.D}, f64);
  auto& a = in.args;
  a.causal = c.causal;
  a.window = c.window;
  if (c.real_positions) {
    // sorted fractional positions with gaps; queries at the end of the key range
    auto kp = torch::cumsum(torch::rand({c.per_batch ? c.B : 1, c.Tk}, f64) * 1.5 + 0.2, -1) + 3.0;
    auto qp = kp.narrow(-1, c.Tk - c.Tq, c.Tq) + 0.25;
    a.k_positions = c.per_batch ? kp : kp[0];
    a.q_positions = c.per_batch ? qp : qp[0];
  }
  if (c.padding) a.key_len = torch::randint(0, c.Tk + 1, {c.B}, torch::kLong);
  if (c.biases) {
    const int64_t L = std::max<int64_t>(c.Tk / 2, 1);  // lags beyond L use the last entry
    a.lag_table = torch::randn({c.Hq, L}, f64) * 0.5;
    a.slopes = torch::rand({c.Hq}, f64) * 0.3;
    // cumulative log-sums as FoX builds them: large values, differences small
    auto c_all = torch::cumsum(-torch::rand({c.B, c.Hq, c.Tk}, f64), -1) - 1e4;
    a.ck = c_all;
    a.cq = c_all.narrow(-1, c.Tk - c.Tq, c.Tq) + 0.1 * torch::randn({c.B, c.Hq, c.Tq}, f64);
  }
  return in;
}

// forward and gradients of sum(out * w) with respect to every leaf
std::vector<torch::Tensor> run(const Inputs& in, const torch::Tensor& w, bool fused) {
  const auto out = fused ? nn::fused_attention(in.q, in.k, in.v, in.args)[0]
                         : nn::composed_attention(in.q, in.k, in.v, in.args);
  auto grads = torch::autograd::grad({(out * w.to(out.scalar_type())).sum()}, in.leaves(), {},
                                     false, false, true);
  grads.insert(grads.begin(), out);
  return grads;
}

const char* kNames[] = {"out", "dq", "dk", "dv", "dlag", "dslopes", "dcq", "dck"};

void expect_match(const Case& c, int seed, torch::ScalarType dt, double tol) {
  const Inputs ref_in = make_inputs(c, seed).to(torch::kDouble);
  const Inputs in = ref_in.to(dt);
  const auto w = torch::randn({c.B, c.Hq, c.Tq, c.D}, torch::kDouble);
  const auto ref = run(ref_in, w, false);
  const auto got = run(in, w, true);
  ASSERT_EQ(ref.size(), got.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_EQ(got[i].defined(), ref[i].defined()) << kNames[i];
    if (!ref[i].defined()) continue;
    EXPECT_TRUE(torch::isfinite(got[i]).all().item<bool>()) << kNames[i];
    // floor 1 (the inputs are O(1)): a gradient that is exactly 0 in exact arithmetic (dq with a
    // single key) is compared absolutely; dcq, the row sums of dS (0 by the shift invariance of
    // softmax), against the scale of dck, the column sums of the same dS
    const double floor = kNames[i] == std::string("dcq")
                             ? std::max(1.0, ref.back().abs().max().item<double>())
                             : 1.0;
    EXPECT_LT(rel_err(got[i], ref[i], floor), tol) << kNames[i];
  }
}

}  // namespace

TEST(AttentionOp, FusedMatchesComposedOnRandomShapes) {
  const std::vector<Case> cases = {
      {1, 2, 2, 1, 1, 32},                                // T = 1
      {2, 4, 2, 37, 37, 32},                              // odd T, GQA
      {1, 2, 1, 5, 83, 64, true},                         // Tq != Tk (decode-like)
      {2, 2, 2, 70, 70, 32, true, 16.0},                  // sliding window
      {3, 2, 2, 40, 40, 32, true, 0, true},               // key padding, rows with no key
      {2, 2, 2, 33, 33, 48, true, 0, false, true, true},  // real per-batch positions
      {1, 4, 4, 29, 45, 32, false, 0, false, true},       // non-causal, real positions
      {1, 3, 3, 65, 130, 96, true, 20.0, true, true},     // everything at once
  };
  int seed = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "B" << c.B << " Hq" << c.Hq << " Hk" << c.Hk << " Tq"
                                      << c.Tq << " Tk" << c.Tk << " D" << c.D);
    expect_match(c, ++seed, torch::kFloat, 1e-5);
    expect_match(c, seed, torch::kDouble, 1e-11);
  }
}

TEST(AttentionOp, CausalityPerturbingKeyChangesNoEarlierOutput) {
  Case c{1, 2, 2, 50, 50, 32};
  const auto in = make_inputs(c, 7).to(torch::kFloat);
  const auto out = nn::fused_attention(in.q, in.k, in.v, in.args)[0];
  for (int64_t s : {0, 17, 49}) {
    auto k2 = in.k.detach().clone(), v2 = in.v.detach().clone();
    k2.select(2, s).add_(5.0);
    v2.select(2, s).add_(5.0);
    const auto out2 = nn::fused_attention(in.q, k2, v2, in.args)[0];
    const auto before = (out2 - out).narrow(2, 0, s).abs();
    EXPECT_EQ(before.numel() ? before.max().item<double>() : 0.0, 0.0) << "s=" << s;
    EXPECT_GT((out2 - out).narrow(2, s, 50 - s).abs().max().item<double>(), 0) << "s=" << s;
  }
}

TEST(AttentionOp, MechanismAttentionAppliesTransformsAndBiases) {
  torch::manual_seed(3);
  const int64_t B = 2, H = 4, T = 24, D = 32;
  for (const std::string spec : {"rope", "alibi", "jordan(m=2, regime=raw) + alibi", "damped_rope",
                                 "orthogonal_mix(seed=1) + rope"}) {
    SCOPED_TRACE(spec);
    nn::PositionEncoding enc(spec, D, H);
    const auto q = torch::randn({B, H, T, D}, torch::kDouble),
               k = torch::randn({B, H, T, D}, torch::kDouble),
               v = torch::randn({B, H, T, D}, torch::kDouble);
    enc->to(torch::kDouble);
    const auto got = nn::attention(q, k, v, *enc);
    // the reference: the module's transforms, then the composition with its ALiBi slopes
    const auto t = enc->forward(q, k);
    nn::AttentionArgs a;
    if (enc->alibi_slopes().defined()) a.slopes = enc->alibi_slopes().to(torch::kDouble);
    const auto ref = nn::composed_attention(t.q, t.k, v, a);
    EXPECT_LT(rel_err(got, ref), 1e-12);
    // Tq != Tk (the last queries against every key) takes the other path: same rows
    const auto last = nn::attention(q.narrow(2, T - 5, 5), k, v, *enc);
    EXPECT_LT(rel_err(last, got.narrow(2, T - 5, 5)), 1e-12);
    // shifting every position by the same amount changes nothing (exact relative mechanisms)
    nn::AttentionArgs shifted;
    shifted.q_positions = shifted.k_positions = torch::arange(T, torch::kDouble) + 7.0;
    EXPECT_LT(rel_err(nn::attention(q, k, v, *enc, shifted), got), 1e-9);
  }
}

TEST(AttentionOp, GroupedQueriesUseTheirKeyValueHeadsTransform) {
  torch::manual_seed(4);
  const int64_t B = 1, Hq = 4, Hk = 2, T = 19, D = 32;
  for (const std::string spec :
       {"rope", "alibi", "jordan(m=2, regime=raw)", "jordan(m=2, regime=raw) + alibi"}) {
    SCOPED_TRACE(spec);
    const auto q = torch::randn({B, Hq, T, D}, torch::kDouble),
               k = torch::randn({B, Hk, T, D}, torch::kDouble),
               v = torch::randn({B, Hk, T, D}, torch::kDouble);
    const auto got = nn::attention(q, k, v, spec);
    // the same with keys and values repeated per query head: initial parameters are equal across
    // heads, so the Hq-head encoding applies the same maps
    const auto ref = nn::attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), spec);
    EXPECT_LT(rel_err(got, ref), 1e-12);
  }
}

TEST(AttentionOp, BadInputIsNamed) {
  const auto q = torch::randn({1, 4, 8, 32}), k = torch::randn({1, 3, 8, 32}),
             v = torch::randn({1, 3, 8, 32});
  const auto expect_error = [](auto&& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error for " << what;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error([&] { nn::fused_attention(q, k, v); }, "must divide query heads");
  const auto k4 = torch::randn({1, 4, 8, 32}), v4 = torch::randn({1, 4, 8, 32});
  expect_error([&] { nn::fused_attention(q, k4, v4.to(torch::kDouble)); }, "one dtype");
  expect_error([&] { nn::fused_attention(q, k4, v4.narrow(2, 0, 5)); }, "differ in shape");
  nn::AttentionArgs a;
  a.lag_table = torch::zeros({3, 10});
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "lag_table must be [4, L]");
  a = {};
  a.q_positions = torch::full({8}, std::numeric_limits<double>::quiet_NaN(), torch::kDouble);
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "q_positions contain NaN");
  a = {};
  a.k_positions = torch::arange(8, torch::kDouble);
  a.k_positions[3] = std::numeric_limits<double>::infinity();
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "k_positions contain NaN or Inf");
  // int64 positions beyond 2^53 are refused before their conversion to float64, which would
  // round 2^60 + i to one value: every key would then look causal-visible to every query
  a = {};
  a.q_positions = a.k_positions = torch::arange(8, torch::kLong) + (int64_t{1} << 60);
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "q_positions span");
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "2^53");
  a.q_positions = torch::arange(8, torch::kLong);
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "k_positions span");
  a.k_positions = torch::arange(8, torch::kDouble) - 1e17;
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "2^53");
  // up to 2^53 they stay exact, and the causal mask holds there
  a = {};
  a.q_positions = a.k_positions = torch::arange(8, torch::kLong) + ((int64_t{1} << 53) - 8);
  const auto near = nn::fused_attention(q, k4, v4, a)[0];
  EXPECT_TRUE(torch::allclose(near, nn::fused_attention(q, k4, v4)[0], 1e-6, 1e-6));
  a = {};
  a.cq = torch::zeros({1, 4, 8});
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "needs both cq and ck");
  a = {};
  a.key_len = torch::ones({1});
  expect_error([&] { nn::fused_attention(q, k4, v4, a); }, "key_len must be an integer");
  expect_error([&] { nn::attention(q, k4, v4, "no_such_mechanism"); }, "no_such_mechanism");
}
