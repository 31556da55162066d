// The fused attention kernels (kernels/attention/attention.hpp) against the float64 reference
// (materialised logits) on random shapes, positions, masks and biases; the float64 kernel's
// gradients against central finite differences; causality, fully masked rows and the decode case.
#include <gtest/gtest.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/types.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/isa.hpp"
#include "test_util.hpp"

using namespace relpos;
using namespace relpos::kernels;

namespace {

enum class Pos { Default, IntegerGaps, Fractional };

struct Case {
  AttentionDims d;
  bool causal = true;
  bool exclude_self = false;
  double window = 0;
  bool padding = false;
  bool left_padding = false;  // key_start
  bool segments = false;      // packed sequences
  Pos pos = Pos::Default;
  bool per_batch = false;
  bool lag = false, slopes = false, tokens = false;
  double scale = 0;
  double token_offset = 0;  // added to every per-token scalar (long cumulative sums)
  AttentionBackwardScheme scheme = AttentionBackwardScheme::Auto;
  std::string name() const {
    std::string s;
    for (int64_t x : {d.B, d.Hq, d.Hk, d.Tq, d.Tk, d.D}) s += std::to_string(x) + ' ';
    s += causal ? (exclude_self ? "strictly causal" : "causal") : "full";
    if (window > 0) s += " window " + std::to_string(window);
    for (auto [on, what] : {std::pair{padding, " padded"}, std::pair{left_padding, " left-padded"},
                            std::pair{segments, " segments"}, std::pair{lag, " lag"},
                            std::pair{slopes, " slopes"}, std::pair{tokens, " tokens"}})
      if (on) s += what;
    if (scheme == AttentionBackwardScheme::PerHead) s += " per-head backward";
    if (scheme == AttentionBackwardScheme::TwoPass) s += " two-pass backward";
    return s;
  }
};

// Inputs in float64; the float kernel gets them rounded (and the reference the rounded values).
struct Data {
  Case c;
  std::vector<double> q, k, v, dout, pq, pk, lag, slopes, cq, ck;
  std::vector<int64_t> key_len, key_start, q_seg, k_seg;

  AttentionPositions positions() const {
    return {pq.empty() ? nullptr : pq.data(), pk.empty() ? nullptr : pk.data(), c.per_batch};
  }
  AttentionOptions options() const {
    AttentionOptions o{c.causal, c.window, key_len.empty() ? nullptr : key_len.data(),
                       c.scale,  c.scheme, c.exclude_self};
    if (!key_start.empty()) o.key_start = key_start.data();
    if (!q_seg.empty()) o.q_segments = q_seg.data(), o.k_segments = k_seg.data();
    return o;
  }
  size_t nq() const { return static_cast<size_t>(c.d.B * c.d.Hq * c.d.Tq * c.d.D); }
  size_t nk() const { return static_cast<size_t>(c.d.B * c.d.Hk * c.d.Tk * c.d.D); }
  size_t rows() const { return static_cast<size_t>(c.d.B * c.d.Hq * c.d.Tq); }
};

std::vector<double> rounded(std::vector<double> v) {
  for (auto& x : v) x = static_cast<double>(static_cast<float>(x));
  return v;
}

Data make_data(const Case& c, std::mt19937_64& rng) {
  Data x{c, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  const auto& d = c.d;
  x.q = test::normal_vec(x.nq(), rng);
  x.k = test::normal_vec(x.nk(), rng);
  x.v = test::normal_vec(x.nk(), rng);
  x.dout = test::normal_vec(x.nq(), rng);
  if (c.pos != Pos::Default) {
    // keys ascending with gaps; queries at the last Tq key positions (plus a fraction of a gap
    // for fractional positions), so the causal boundary falls inside tiles
    const int64_t P = c.per_batch ? d.B : 1;
    for (int64_t b = 0; b < P; ++b) {
      double p = std::round(test::uniform(rng, -20.0, 20.0));
      std::vector<double> row;
      for (int64_t j = 0; j < d.Tk; ++j) {
        row.push_back(p);
        const double gaps[] = {1.0, 1.0, 2.0, 3.0};
        p += c.pos == Pos::Fractional ? test::uniform(rng, 0.25, 2.0)
                                      : gaps[std::uniform_int_distribution<int>(0, 3)(rng)];
      }
      x.pk.insert(x.pk.end(), row.begin(), row.end());
      for (int64_t i = 0; i < d.Tq; ++i) {
        const int64_t j = std::max<int64_t>(0, d.Tk - d.Tq + i);
        x.pq.push_back(row[j] + (c.pos == Pos::Fractional ? test::uniform(rng, -0.5, 0.5) : 0.0));
      }
    }
  }
  if (c.padding)
    for (int64_t b = 0; b < d.B; ++b)
      x.key_len.push_back(std::uniform_int_distribution<int64_t>(d.Tk / 2, d.Tk)(rng));
  if (c.left_padding)
    for (int64_t b = 0; b < d.B; ++b)
      x.key_start.push_back(std::uniform_int_distribution<int64_t>(0, d.Tk / 3)(rng));
  if (c.segments)
    // contiguous documents of 1..40 keys per row; query i is key slot Tk - Tq + i
    for (int64_t b = 0; b < d.B; ++b) {
      std::vector<int64_t> row;
      for (int64_t id = 7 * b; static_cast<int64_t>(row.size()) < d.Tk; ++id)
        row.insert(row.end(), std::uniform_int_distribution<int64_t>(1, 40)(rng), id);
      row.resize(static_cast<size_t>(d.Tk));
      x.k_seg.insert(x.k_seg.end(), row.begin(), row.end());
      for (int64_t i = 0; i < d.Tq; ++i)
        x.q_seg.push_back(row[static_cast<size_t>(std::max<int64_t>(0, d.Tk - d.Tq + i))]);
    }
  if (c.lag)
    x.lag = test::normal_vec(static_cast<size_t>(d.Hq * std::max<int64_t>(3, d.Tk / 2)), rng, 0.5);
  if (c.slopes)
    for (int64_t h = 0; h < d.Hq; ++h) x.slopes.push_back(test::uniform(rng, 0.01, 0.3));
  if (c.tokens) {
    // FoX-like cumulative sums of negative log gates, per (b, h), over each range
    auto walk = [&](int64_t T, std::vector<double>& out) {
      for (int64_t bh = 0; bh < d.B * d.Hq; ++bh) {
        double s = c.token_offset;
        for (int64_t t = 0; t < T; ++t) out.push_back(s -= test::uniform(rng, 0.0, 0.3));
      }
    };
    walk(d.Tq, x.cq);
    walk(d.Tk, x.ck);
  }
  return x;
}

template <class T>
struct Result {
  std::vector<T> out, lse, dq, dk, dv, dlag, dslopes;
  std::vector<double> dcq, dck;
};

template <class T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// The float kernels' biases of x over float copies of its lag table and slopes.
AttentionBias<float> float_bias(const Data& x, const std::vector<float>& lag,
                                const std::vector<float>& slopes) {
  AttentionBias<float> bias;
  if (!lag.empty())
    bias.lag_table = lag.data(), bias.lag_len = static_cast<int64_t>(lag.size()) / x.c.d.Hq;
  if (!slopes.empty()) bias.slopes = slopes.data();
  if (!x.cq.empty()) bias.cq = x.cq.data(), bias.ck = x.ck.data();
  return bias;
}

// Zeroed gradients of every bias of `bias` (the float kernels accumulate into them).
struct FloatGrads {
  std::vector<float> dlag, dslopes;
  std::vector<double> dcq, dck;
  AttentionBiasGrads<float> g;
};
FloatGrads zero_grads(const AttentionBias<float>& bias, const Data& x) {
  FloatGrads r;
  if (bias.lag_table)
    r.dlag.assign(static_cast<size_t>(x.c.d.Hq * bias.lag_len), 0.0f),
        r.g.lag_table = r.dlag.data();
  if (bias.slopes)
    r.dslopes.assign(static_cast<size_t>(x.c.d.Hq), 0.0f), r.g.slopes = r.dslopes.data();
  if (bias.cq) {
    r.dcq.assign(x.cq.size(), 0.0), r.g.cq = r.dcq.data();
    r.dck.assign(x.ck.size(), 0.0), r.g.ck = r.dck.data();
  }
  return r;
}

// Runs the kernel <T> (reference = false) or the float64 reference on x.
template <class T>
Result<T> run(const Data& x, bool reference = false, bool backward = true) {
  const auto q = cast<T>(x.q), k = cast<T>(x.k), v = cast<T>(x.v), dout = cast<T>(x.dout);
  const auto lag = cast<T>(x.lag), slopes = cast<T>(x.slopes);
  AttentionBias<T> bias;
  if (!lag.empty())
    bias.lag_table = lag.data(), bias.lag_len = static_cast<int64_t>(lag.size()) / x.c.d.Hq;
  if (!slopes.empty()) bias.slopes = slopes.data();
  if (!x.cq.empty()) bias.cq = x.cq.data(), bias.ck = x.ck.data();
  Result<T> r;
  r.out.assign(x.nq(), T(7));  // garbage: every entry must be written
  r.lse.assign(x.rows(), T(7));
  if (reference) {
    if constexpr (std::is_same_v<T, double>)
      attention_reference(x.c.d, q.data(), k.data(), v.data(), x.positions(), bias, x.options(),
                          r.out.data(), r.lse.data());
  } else {
    attention_forward<T>(x.c.d, q.data(), k.data(), v.data(), x.positions(), bias, x.options(),
                         r.out.data(), r.lse.data());
  }
  if (!backward) return r;
  r.dq.assign(x.nq(), T(7));
  r.dk.assign(x.nk(), T(7));
  r.dv.assign(x.nk(), T(7));
  AttentionBiasGrads<T> g;
  if (bias.lag_table) r.dlag.assign(lag.size(), T(0)), g.lag_table = r.dlag.data();
  if (bias.slopes) r.dslopes.assign(slopes.size(), T(0)), g.slopes = r.dslopes.data();
  if (bias.cq) {
    r.dcq.assign(x.cq.size(), 0.0), g.cq = r.dcq.data();
    r.dck.assign(x.ck.size(), 0.0), g.ck = r.dck.data();
  }
  if (reference) {
    if constexpr (std::is_same_v<T, double>)
      attention_reference_backward(x.c.d, q.data(), k.data(), v.data(), x.positions(), bias,
                                   x.options(), dout.data(), r.dq.data(), r.dk.data(), r.dv.data(),
                                   g);
  } else {
    attention_backward<T>(x.c.d, q.data(), k.data(), v.data(), x.positions(), bias, x.options(),
                          dout.data(), r.out.data(), r.lse.data(), r.dq.data(), r.dk.data(),
                          r.dv.data(), g);
  }
  return r;
}

// ||a - b|| / max(||b||, floor); -inf entries must agree and are left out.
template <class T, class U>
double rel_err(const std::vector<T>& a, const std::vector<U>& b, double floor = 1e-300) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (std::isinf(y) || std::isinf(x)) {
      EXPECT_EQ(x, y) << "entry " << i;
      continue;
    }
    EXPECT_FALSE(std::isnan(x)) << "entry " << i;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num) / std::max({std::sqrt(den), floor, 1e-300});
}

template <class T>
void expect_matches_reference(const Data& x, const Result<T>& got, const Result<double>& ref,
                              double tol) {
  SCOPED_TRACE(x.c.name());
  EXPECT_LT(rel_err(got.out, ref.out), tol) << "out";
  EXPECT_LT(rel_err(got.lse, ref.lse), tol) << "lse";
  // dq and dk vanish where each row sees one key (the softmax gradient is then exactly 0):
  // measured against the scale of dv there
  const double dv_scale = test::norm(ref.dv.data(), static_cast<int64_t>(ref.dv.size()));
  EXPECT_LT(rel_err(got.dq, ref.dq, dv_scale), tol) << "dq";
  EXPECT_LT(rel_err(got.dk, ref.dk, dv_scale), tol) << "dk";
  EXPECT_LT(rel_err(got.dv, ref.dv), tol) << "dv";
  // a lag entry's gradient sums dS over its keys; where a row's keys all fall on one (clamped)
  // entry that sum is exactly 0 (softmax) and rounding is all that is left: dv's scale again
  EXPECT_LT(rel_err(got.dlag, ref.dlag, dv_scale), tol) << "lag table";
  // dL/ds_h = -sum dS_ij (p_i - p_j): rounding of Delta_i = dout_i . out_i (relative eps) is
  // multiplied by the mean lag without the cancellation the exact sum has, so its error scale
  // is max|lag| ||Delta||
  double max_lag = 0, delta2 = 0;
  for (size_t r = 0; r < x.rows(); ++r) {
    double s = 0;
    for (int64_t e = 0; e < x.c.d.D; ++e) s += ref.out[r * x.c.d.D + e] * x.dout[r * x.c.d.D + e];
    delta2 += s * s;
  }
  for (int64_t b = 0; b < (x.c.per_batch ? x.c.d.B : 1); ++b)
    for (int64_t i = 0; i < x.c.d.Tq; ++i)
      for (int64_t j = 0; j < x.c.d.Tk; ++j)
        max_lag = std::max(max_lag, std::abs(x.positions().query(b, i, x.c.d.Tq, x.c.d.Tk) -
                                             x.positions().key(b, j, x.c.d.Tk)));
  EXPECT_LT(rel_err(got.dslopes, ref.dslopes, max_lag * std::sqrt(delta2)), tol) << "slopes";
  // the row sums of dL/dlogit vanish (softmax is shift-invariant), so dcq is ~0: measured
  // against the scale of dck
  EXPECT_LT(rel_err(got.dck, ref.dck), tol) << "ck";
  EXPECT_LT(rel_err(got.dcq, ref.dcq, test::norm(ref.dck.data(), ref.dck.size())), tol) << "cq";
}

std::vector<Case> random_cases() {
  std::vector<Case> cs;
  auto add = [&](AttentionDims d, auto&& f) {
    Case c;
    c.d = d;
    f(c);
    cs.push_back(c);
  };
  add({1, 1, 1, 1, 1, 32}, [](Case&) {});
  add({2, 4, 2, 37, 37, 64}, [](Case& c) { c.lag = c.slopes = true; });
  add({2, 2, 1, 13, 75, 48}, [](Case& c) {
    c.window = 20, c.padding = true, c.pos = Pos::IntegerGaps, c.per_batch = true, c.tokens = true;
  });
  add({1, 3, 3, 70, 70, 80}, [](Case& c) {
    c.causal = false, c.lag = c.slopes = c.tokens = true, c.pos = Pos::Fractional, c.scale = 0.3;
  });
  add({1, 2, 1, 1, 150, 32}, [](Case& c) { c.lag = c.slopes = c.tokens = c.padding = true; });
  add({2, 2, 2, 65, 130, 40},
      [](Case& c) { c.window = 7.5, c.pos = Pos::Fractional, c.lag = c.slopes = c.tokens = true; });
  add({1, 2, 1, 20, 33, 16}, [](Case& c) { c.causal = false, c.window = 10, c.lag = true; });
  add({1, 4, 1, 97, 97, 64}, [](Case& c) {
    c.tokens = true, c.token_offset = -1e5, c.pos = Pos::IntegerGaps, c.padding = true;
  });
  add({3, 2, 2, 33, 33, 33}, [](Case& c) { c.slopes = true, c.padding = true; });
  // several groups of key tiles in the forward (kGk * kBk = 256 keys), lag tables as slices
  // of the reversed table (default positions) and clamped at both ends
  add({1, 2, 1, 300, 600, 32}, [](Case& c) { c.lag = c.padding = true; });
  add({2, 2, 2, 530, 530, 16}, [](Case& c) { c.lag = c.slopes = true; });
  add({1, 2, 2, 290, 290, 24}, [](Case& c) { c.window = 100, c.lag = c.tokens = true; });
  // strict causality (PJ-RoPE's include_self = false): row 0 sees nothing, tiles on the diagonal
  add({2, 2, 1, 150, 150, 24}, [](Case& c) { c.exclude_self = true, c.lag = c.slopes = true; });
  add({1, 2, 2, 40, 90, 16}, [](Case& c) {
    c.exclude_self = true, c.pos = Pos::IntegerGaps, c.padding = true, c.tokens = true;
  });
  // left padding (key_start) and packed sequences (segments), alone and with every bias
  add({2, 2, 1, 150, 150, 32}, [](Case& c) { c.left_padding = true, c.lag = c.tokens = true; });
  add({2, 4, 2, 200, 200, 16}, [](Case& c) { c.segments = true, c.slopes = c.tokens = true; });
  add({1, 2, 2, 70, 300, 24},
      [](Case& c) { c.segments = c.left_padding = c.padding = true, c.window = 50, c.lag = true; });
  add({2, 2, 1, 90, 90, 16}, [](Case& c) {
    c.segments = true, c.causal = false, c.pos = Pos::IntegerGaps, c.per_batch = true;
  });
  // the decode kernel (g x Tq <= 16 query rows per key/value head): dot-product rows (<= 4) and
  // transposed lanes, several key chunks across threads merged by their log-sum-exp, every
  // bias and mask
  add({2, 4, 2, 2, 1500, 32}, [](Case& c) {
    c.lag = c.slopes = c.tokens = c.padding = true, c.pos = Pos::IntegerGaps, c.per_batch = true;
  });
  add({1, 8, 2, 3, 700, 24},
      [](Case& c) { c.window = 50, c.left_padding = c.segments = true, c.lag = c.tokens = true; });
  add({2, 2, 2, 5, 900, 16},
      [](Case& c) { c.exclude_self = true, c.pos = Pos::Fractional, c.slopes = c.tokens = true; });
  add({1, 4, 4, 1, 2000, 64},
      [](Case& c) { c.causal = false, c.window = 300, c.lag = c.padding = true; });
  add({2, 6, 3, 8, 333, 40}, [](Case& c) { c.segments = c.left_padding = true, c.slopes = true; });
  // the dot-product rows' blocks (4 rows x 1 key, 2 x 2, 1 x 4) and their tails: 3 rows (a
  // block of 2 and a single row), key tiles ending in 1-3 keys, D a multiple of 16 or not
  add({1, 3, 1, 1, 131, 48}, [](Case& c) { c.lag = c.slopes = true; });
  add({2, 2, 2, 1, 67, 16}, [](Case& c) { c.tokens = c.padding = true; });
  add({1, 4, 1, 1, 70, 64}, [](Case& c) { c.pos = Pos::Fractional, c.slopes = true; });
  add({1, 2, 1, 2, 65, 20}, [](Case& c) { c.lag = true; });
  // every case under both backward schemes
  const size_t n = cs.size();
  for (size_t i = 0; i < n; ++i)
    for (auto scheme : {AttentionBackwardScheme::PerHead, AttentionBackwardScheme::TwoPass}) {
      cs.push_back(cs[i]);
      cs.back().scheme = scheme;
    }
  return cs;
}

// random_cases and three of them with keys and values read in place from cache rows (k_rows
// past Tk).
std::vector<Case> cases_with_cache_rows() {
  std::vector<Case> cases = random_cases();
  for (Case c : {cases[1], cases[4], cases[19]}) {
    c.d.k_rows = c.d.Tk + 5;
    cases.push_back(c);
  }
  return cases;
}

}  // namespace

// Lag table index: nearest integer, clamped to the table (negative lags to entry 0).
TEST(AttentionKernel, LagIndexRoundsAndClamps) {
  EXPECT_EQ(attention_lag_index(0.0, 5), 0);
  EXPECT_EQ(attention_lag_index(2.0, 5), 2);
  EXPECT_EQ(attention_lag_index(2.4, 5), 2);
  EXPECT_EQ(attention_lag_index(2.6, 5), 3);
  EXPECT_EQ(attention_lag_index(4.0, 5), 4);
  EXPECT_EQ(attention_lag_index(1e9, 5), 4);
  EXPECT_EQ(attention_lag_index(-3.0, 5), 0);
  EXPECT_EQ(attention_lag_index(7.0, 1), 0);
}

// Bad arguments are input errors, before any work.
TEST(AttentionKernel, RejectsBadArguments) {
  std::vector<float> x(64, 0.0f), out(64), lse(8);
  AttentionDims d{1, 3, 2, 2, 2, 4};  // 2 key heads do not divide 3 query heads
  EXPECT_THROW(
      attention_forward<float>(d, x.data(), x.data(), x.data(), {}, {}, {}, out.data(), lse.data()),
      InputError);
  d = {1, 2, 1, 2, 2, 4};
  AttentionBias<float> bias;
  bias.lag_table = x.data();  // lag_len 0
  EXPECT_THROW(attention_forward<float>(d, x.data(), x.data(), x.data(), {}, bias, {}, out.data(),
                                        lse.data()),
               InputError);
  std::vector<double> c(8, 0.0);
  AttentionBias<float> half;
  half.cq = c.data();  // ck missing
  EXPECT_THROW(attention_forward<float>(d, x.data(), x.data(), x.data(), {}, half, {}, out.data(),
                                        lse.data()),
               InputError);
}

TEST(AttentionKernel, FloatMatchesReference) {
  std::mt19937_64 rng(1);
  for (const Case& c : random_cases()) {
    const Data x = make_data(c, rng);
    // the reference sees exactly the values the float kernel sees
    Data xr = x;
    for (auto* v : {&xr.q, &xr.k, &xr.v, &xr.dout, &xr.lag, &xr.slopes}) *v = rounded(*v);
    expect_matches_reference(x, run<float>(x), run<double>(xr, true), 1e-5);
  }
}

TEST(AttentionKernel, DoubleMatchesReference) {
  std::mt19937_64 rng(2);
  for (const Case& c : random_cases()) {
    const Data x = make_data(c, rng);
    expect_matches_reference(x, run<double>(x), run<double>(x, true), 1e-12);
  }
}

// Gradients of L = sum(out * dout) of the float64 kernel against central differences, every
// input and bias parameter, on a tiny problem with every feature on.
TEST(AttentionKernel, DoubleGradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(3);
  Case c;
  c.d = {2, 2, 1, 4, 6, 3};
  c.window = 4.5, c.padding = true, c.pos = Pos::Fractional, c.per_batch = true;
  c.lag = c.slopes = c.tokens = true;
  Data x = make_data(c, rng);
  x.key_len = {6, 4};
  const Result<double> g = run<double>(x);
  auto loss = [&](const Data& y) {
    const auto r = run<double>(y, false, false);
    double s = 0;
    for (size_t i = 0; i < r.out.size(); ++i) s += r.out[i] * y.dout[i];
    return s;
  };
  auto check = [&](std::vector<double> Data::*field, const auto& grad, const char* what) {
    ASSERT_EQ((x.*field).size(), grad.size()) << what;
    const double h = 1e-6;
    for (size_t i = 0; i < grad.size(); ++i) {
      Data y = x;
      (y.*field)[i] += h;
      const double up = loss(y);
      (y.*field)[i] -= 2 * h;
      const double fd = (up - loss(y)) / (2 * h);
      EXPECT_NEAR(static_cast<double>(grad[i]), fd, 1e-7 * std::max(1.0, std::abs(fd)))
          << what << "[" << i << "]";
    }
  };
  check(&Data::q, g.dq, "q");
  check(&Data::k, g.dk, "k");
  check(&Data::v, g.dv, "v");
  check(&Data::lag, g.dlag, "lag table");
  check(&Data::slopes, g.dslopes, "slopes");
  check(&Data::cq, g.dcq, "cq");
  check(&Data::ck, g.dck, "ck");
}

// Perturbing key s (its k and v rows, every key/value head) leaves every output row whose
// position is before p_k[s] bit-for-bit unchanged, and changes the others.
TEST(AttentionKernel, Causality) {
  std::mt19937_64 rng(4);
  Case c;
  c.d = {1, 4, 2, 100, 100, 32};
  c.pos = Pos::Fractional, c.lag = c.slopes = c.tokens = true;
  const Data x = make_data(c, rng);
  const auto base = run<float>(x, false, false);
  for (int64_t s : {0, 31, 57, 64, 99}) {
    Data y = x;
    for (int64_t hk = 0; hk < c.d.Hk; ++hk)
      for (int64_t e = 0; e < c.d.D; ++e) {
        y.k[(hk * c.d.Tk + s) * c.d.D + e] += 0.5;
        y.v[(hk * c.d.Tk + s) * c.d.D + e] -= 0.25;
      }
    const auto got = run<float>(y, false, false);
    // the first row at or after the key: its logit for s is close to the row max
    int64_t first_after = -1;
    for (int64_t i = 0; i < c.d.Tq; ++i)
      if (x.pq[i] >= x.pk[s] && (first_after < 0 || x.pq[i] < x.pq[first_after])) first_after = i;
    for (int64_t h = 0; h < c.d.Hq; ++h)
      for (int64_t i = 0; i < c.d.Tq; ++i) {
        bool same = true;
        for (int64_t e = 0; e < c.d.D; ++e) {
          const size_t at = static_cast<size_t>((h * c.d.Tq + i) * c.d.D + e);
          same = same && got.out[at] == base.out[at];
        }
        if (x.pq[i] < x.pk[s]) {
          EXPECT_TRUE(same) << "key " << s << " head " << h << " row " << i;
        } else if (i == first_after) {
          EXPECT_FALSE(same) << "key " << s << " head " << h << " row " << i;
        }
      }
  }
}

// Rows without any visible key (padding to zero keys, a window that ends before the first key,
// a causal query before every key) give zero outputs and gradients, lse = -inf, no NaN.
TEST(AttentionKernel, MaskedRowsGiveZeros) {
  std::mt19937_64 rng(5);
  Case c;
  c.d = {2, 2, 1, 5, 70, 16};
  c.padding = true, c.window = 3, c.pos = Pos::IntegerGaps, c.lag = c.slopes = c.tokens = true;
  Data x = make_data(c, rng);
  x.key_len = {0, 50};
  x.pk.clear();
  for (int64_t j = 0; j < c.d.Tk; ++j) x.pk.push_back(static_cast<double>(j));
  x.pq = {-1.0, 10.0, 49.0, 55.0, 200.0};  // batch 1: rows 0, 3 and 4 see no key
  const bool visible[2][5] = {{false, false, false, false, false},
                              {false, true, true, false, false}};
  auto test_kind = [&](auto tag) {
    using T = decltype(tag);
    const auto r = run<T>(x);
    const auto ref = run<double>(x, true);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 5; ++i) {
          const int64_t row = (b * 2 + h) * 5 + i;
          EXPECT_EQ(std::isinf(r.lse[row]), !visible[b][i]) << row;
          for (int64_t e = 0; e < c.d.D; ++e) {
            const size_t at = static_cast<size_t>(row * c.d.D + e);
            EXPECT_FALSE(std::isnan(r.out[at]) || std::isnan(r.dq[at]));
            if (!visible[b][i]) {
              EXPECT_EQ(r.out[at], T(0));
              EXPECT_EQ(r.dq[at], T(0));
            }
          }
          if (!visible[b][i]) {
            EXPECT_EQ(r.dcq[row], 0.0);
          }
        }
    // keys of batch 0 (all padded) get nothing
    for (size_t at = 0; at < x.nk() / 2; ++at) {
      EXPECT_EQ(r.dk[at], T(0));
      EXPECT_EQ(r.dv[at], T(0));
    }
    for (const auto* v : {&r.dk, &r.dv, &r.dlag, &r.dslopes})
      for (T y : *v) EXPECT_TRUE(std::isfinite(y));
    EXPECT_LT(rel_err(r.out, ref.out), 1e-5);
    EXPECT_LT(rel_err(r.dk, ref.dk), 1e-5);
    EXPECT_LT(rel_err(r.dlag, ref.dlag), 1e-5);
  };
  test_kind(float{});
  test_kind(double{});
}

// Decode: one query against 1000 keys equals the last row of the full causal forward.
TEST(AttentionKernel, DecodeMatchesLastRowOfFullForward) {
  std::mt19937_64 rng(6);
  Case c;
  c.d = {1, 2, 1, 1000, 1000, 32};
  c.lag = c.slopes = c.tokens = true;
  const Data full = make_data(c, rng);
  Data dec = full;
  dec.c.d.Tq = 1;
  dec.q.clear(), dec.dout.clear(), dec.cq.clear();
  const int64_t T = c.d.Tq, D = c.d.D;
  for (int64_t h = 0; h < c.d.Hq; ++h) {
    dec.q.insert(dec.q.end(), full.q.begin() + ((h + 1) * T - 1) * D,
                 full.q.begin() + (h + 1) * T * D);
    dec.dout.insert(dec.dout.end(), D, 1.0);
    dec.cq.push_back(full.cq[(h + 1) * T - 1]);
  }
  const auto a = run<float>(full, false, false), b = run<float>(dec, false, false);
  for (int64_t h = 0; h < c.d.Hq; ++h) {
    for (int64_t e = 0; e < D; ++e)
      EXPECT_NEAR(b.out[h * D + e], a.out[((h + 1) * T - 1) * D + e], 1e-6) << h << " " << e;
    EXPECT_NEAR(b.lse[h], a.lse[(h + 1) * T - 1], 1e-5);
  }
}

// Keys and values read in place from a cache's storage (k_rows > Tk rows per head, NaN past
// Tk): the same outputs as contiguous copies, on the decode kernel's two paths and the tiled
// forward; the backward refuses such a layout.
TEST(AttentionKernel, KeysReadInPlaceFromCacheRows) {
  std::mt19937_64 rng(8);
  for (const AttentionDims& d :
       {AttentionDims{2, 4, 2, 1, 300, 32}, AttentionDims{1, 8, 1, 2, 129, 16},
        AttentionDims{2, 2, 2, 70, 150, 32}}) {
    Case c;
    c.d = d;
    c.lag = c.slopes = true;
    const Data x = make_data(c, rng);
    const int64_t rows = d.Tk + 37, D = d.D, heads = d.B * d.Hk;
    const auto q = cast<float>(x.q), k = cast<float>(x.k), v = cast<float>(x.v);
    std::vector<float> ks(heads * rows * D, std::nanf("")), vs(ks);
    for (int64_t h = 0; h < heads; ++h) {
      std::copy_n(k.begin() + h * d.Tk * D, d.Tk * D, ks.begin() + h * rows * D);
      std::copy_n(v.begin() + h * d.Tk * D, d.Tk * D, vs.begin() + h * rows * D);
    }
    const auto lag = cast<float>(x.lag), slopes = cast<float>(x.slopes);
    const AttentionBias<float> bias{lag.data(), static_cast<int64_t>(lag.size()) / d.Hq,
                                    slopes.data()};
    std::vector<float> out(x.nq()), lse(x.rows()), out2(x.nq()), lse2(x.rows());
    attention_forward<float>(d, q.data(), k.data(), v.data(), {}, bias, {}, out.data(), lse.data());
    AttentionDims in_place = d;
    in_place.k_rows = rows;
    attention_forward<float>(in_place, q.data(), ks.data(), vs.data(), {}, bias, {}, out2.data(),
                             lse2.data());
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], out2[i]) << i;
    for (size_t i = 0; i < lse.size(); ++i) ASSERT_EQ(lse[i], lse2[i]) << i;
    std::vector<float> dq(x.nq()), dk(heads * rows * D), dv(dk);
    const std::vector<float> dout(x.nq(), 1.0f);
    EXPECT_THROW(attention_backward<float>(in_place, q.data(), ks.data(), vs.data(), {}, bias, {},
                                           dout.data(), out2.data(), lse2.data(), dq.data(),
                                           dk.data(), dv.data(), {}),
                 InputError);
  }
  AttentionDims short_rows{1, 1, 1, 1, 10, 8};
  short_rows.k_rows = 9;
  std::vector<float> z(80), o(8), l(1);
  EXPECT_THROW(attention_forward<float>(short_rows, z.data(), z.data(), z.data(), {}, {}, {},
                                        o.data(), l.data()),
               InputError);
}

// Half storage (attention_forward_half, attention_backward_half): on every random case (both
// backward schemes), both half types, and keys read in place from cache rows (forward only),
// the output and the gradients dq, dk, dv are the float kernels' on the widened operands rounded
// once, bit for bit; lse and the per-token gradients are the float kernels' exactly (the lag
// table and slope gradients to their summation order). A NaN in v reaches the same rows.
// Under Isa::Avx512Bf16 and Isa::Amx a bfloat16 call with D a multiple of 32 multiplies bf16 pairs
// (AVX512-BF16 dot products or AMX tiles) and rounds the probabilities (and dS) to bf16 for their
// products: every result is then within 2^-7 of the tensor's largest entry plus 2^-7 relative of
// the float kernels', NaN in the same places (the avx512 run of the kernel tests keeps the
// bit-for-bit check).
TEST(AttentionKernel, HalfStorageIsTheFloatKernelRoundedOnce) {
  std::mt19937_64 rng(9);
  const std::vector<Case> cases = cases_with_cache_rows();
  for (const Case& c : cases)
    for (const HalfType type : {HalfType::BFloat16, HalfType::Float16}) {
      SCOPED_TRACE(c.name() + (c.d.k_rows ? " in place" : "") +
                   (type == HalfType::BFloat16 ? " bf16" : " fp16"));
      Data x = make_data(c, rng);
      const AttentionDims& d = c.d;
      // keys and values in their storage layout: d.key_rows() rows per head, NaN past Tk
      const int64_t rows = d.key_rows(), D = d.D;
      const auto to_half = [&](const std::vector<double>& src, int64_t heads, int64_t T,
                               int64_t stride) {
        std::vector<uint16_t> h(static_cast<size_t>(heads * stride * D),
                                float_to_half(type, std::nanf("")));
        for (int64_t hh = 0; hh < heads; ++hh)
          for (int64_t t = 0; t < T * D; ++t)
            h[hh * stride * D + t] = float_to_half(type, static_cast<float>(src[hh * T * D + t]));
        return h;
      };
      const auto widened = [&](const std::vector<uint16_t>& h) {
        std::vector<float> f(h.size());
        for (size_t i = 0; i < h.size(); ++i) f[i] = half_to_float(type, h[i]);
        return f;
      };
      if (c.d.B * c.d.Hk > 1) x.v[D + 3] = std::nan("");  // key 0's row of head 1 (or key 1)
      const auto qh = to_half(x.q, d.B * d.Hq, d.Tq, d.Tq),
                 kh = to_half(x.k, d.B * d.Hk, d.Tk, rows),
                 vh = to_half(x.v, d.B * d.Hk, d.Tk, rows);
      const auto qf = widened(qh), kf = widened(kh), vf = widened(vh);
      const auto lag = cast<float>(x.lag), slopes = cast<float>(x.slopes);
      const AttentionBias<float> bias = float_bias(x, lag, slopes);
      std::vector<float> out(x.nq()), lse(x.rows()), lse_h(x.rows(), 7.0f);
      std::vector<uint16_t> out_h(x.nq(), 0x1234);
      attention_forward<float>(d, qf.data(), kf.data(), vf.data(), x.positions(), bias, x.options(),
                               out.data(), lse.data());
      attention_forward_half(d, type, qh.data(), kh.data(), vh.data(), x.positions(), bias,
                             x.options(), out_h.data(), lse_h.data());
      const auto same = [&](const std::vector<float>& f, const std::vector<uint16_t>& h,
                            const char* what) {
        for (size_t i = 0; i < f.size(); ++i) {
          if (std::isnan(f[i])) {
            ASSERT_TRUE(std::isnan(half_to_float(type, h[i]))) << what << " " << i;
            continue;
          }
          ASSERT_EQ(h[i], float_to_half(type, f[i])) << what << " " << i << " " << f[i];
        }
      };
      const auto same_float = [](const auto& a, const auto& b, const char* what) {
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i)
          ASSERT_TRUE(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))) << what << " " << i;
      };
      // Isa::Avx512Bf16 or Amx, bf16, D a multiple of 32: products in bf16 pairs (probabilities
      // and dS rounded to bf16 for their products): within 2^-7 of the largest entry plus 2^-7
      // relative, NaN in the same places
      const bool pairs =
          type == HalfType::BFloat16 && D % 32 == 0 && selected_isa() >= Isa::Avx512Bf16;
      const auto close = [&](const auto& f, const auto& h, const char* what) {
        ASSERT_EQ(f.size(), h.size());
        double top = 0;
        for (auto y : f) top = std::isfinite(y) ? std::max(top, std::abs(double(y))) : top;
        for (size_t i = 0; i < f.size(); ++i) {
          double hv = h[i];
          if constexpr (std::is_same_v<std::decay_t<decltype(h[0])>, uint16_t>)
            hv = half_to_float(type, h[i]);
          ASSERT_EQ(std::isnan(double(f[i])), std::isnan(hv)) << what << " " << i;
          if (std::isfinite(double(f[i]))) {
            ASSERT_NEAR(hv, f[i], 0x1p-7 * (top + std::abs(double(f[i])))) << what << " " << i;
          } else {
            ASSERT_TRUE(std::isnan(hv) || hv == f[i]) << what << " " << i;
          }
        }
      };
      if (pairs) {
        close(out, out_h, "out");
        close(lse, lse_h, "lse");
      } else {
        same(out, out_h, "out");
        same_float(lse, lse_h, "lse");
      }
      if (d.k_rows) continue;  // the backward reads contiguous keys only
      // the backward reads the half output, as the op's autograd saves it
      const auto douth = to_half(x.dout, d.B * d.Hq, d.Tq, d.Tq);
      const auto doutf = widened(douth), outf = widened(out_h);
      const auto grads = [&] { return zero_grads(bias, x); };
      FloatGrads gf = grads(), gh = grads();
      std::vector<float> dq(x.nq()), dk(x.nk()), dv(x.nk());
      std::vector<uint16_t> dqh(x.nq(), 0x1234), dkh(x.nk(), 0x1234), dvh(x.nk(), 0x1234);
      attention_backward<float>(d, qf.data(), kf.data(), vf.data(), x.positions(), bias,
                                x.options(), doutf.data(), outf.data(), lse_h.data(), dq.data(),
                                dk.data(), dv.data(), gf.g);
      attention_backward_half(d, type, qh.data(), kh.data(), vh.data(), x.positions(), bias,
                              x.options(), douth.data(), out_h.data(), lse_h.data(), dqh.data(),
                              dkh.data(), dvh.data(), gh.g);
      if (pairs) {
        close(dq, dqh, "dq");
        close(dk, dkh, "dk");
        close(dv, dvh, "dv");
        close(gf.dlag, gh.dlag, "lag");
        close(gf.dslopes, gh.dslopes, "slopes");
        close(gf.dcq, gh.dcq, "cq");
        close(gf.dck, gh.dck, "ck");
        continue;
      }
      same(dq, dqh, "dq");
      same(dk, dkh, "dk");
      same(dv, dvh, "dv");
      // the lag table and slope gradients are summed over threads in the order they finish
      for (const auto& [a, b] : {std::pair{&gf.dlag, &gh.dlag}, {&gf.dslopes, &gh.dslopes}}) {
        float top = 0;
        for (float y : *a) top = std::isnan(y) ? top : std::max(top, std::abs(y));
        for (size_t i = 0; i < a->size(); ++i) {
          if (std::isnan((*a)[i]) && std::isnan((*b)[i])) continue;
          ASSERT_NEAR((*a)[i], (*b)[i], 1e-5f * top) << i;
        }
      }
      same_float(gf.dcq, gh.dcq, "cq");
      same_float(gf.dck, gh.dck, "ck");
    }
}

// Strided rows (RowStrides: v, out, dout and dv laid out token-major, [B, T, H, D] seen as
// [B, H, T, D], with a gap after each token's heads that holds NaN): on every random case (both
// backward schemes), float and both half storages, the output, lse and the gradients are the
// contiguous call's bit for bit (the bias gradients summed across threads: to their order), the
// gaps untouched; with keys read in place from cache rows too (forward only).
TEST(AttentionKernel, StridedRowsAreTheContiguousCall) {
  std::mt19937_64 rng(10);
  const std::vector<Case> cases = cases_with_cache_rows();
  // x ([B][H][T][D], T rows per head of which the first n are used) token-major with a gap of
  // `gap` values after each token's heads; fill elsewhere
  const auto token_major = [](int64_t H, int64_t T, int64_t D, int64_t gap) {
    return RowStrides{T * (H * D + gap), D, H * D + gap};
  };
  const auto lay_out = []<class W>(const std::vector<W>& x, int64_t B, int64_t H, int64_t T,
                                   int64_t D, const RowStrides& s, W fill) {
    std::vector<W> y(static_cast<size_t>(B * s.batch), fill);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t)
          std::copy_n(x.begin() + ((b * H + h) * T + t) * D, D,
                      y.begin() + b * s.batch + h * s.head + t * s.token);
    return y;
  };
  const auto gather = []<class W>(const std::vector<W>& y, int64_t B, int64_t H, int64_t T,
                                  int64_t D, const RowStrides& s) {
    std::vector<W> x(static_cast<size_t>(B * H * T * D));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t)
          std::copy_n(y.begin() + b * s.batch + h * s.head + t * s.token, D,
                      x.begin() + ((b * H + h) * T + t) * D);
    return x;
  };
  const auto same = [](const auto& a, const auto& b, const char* what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) {
      if constexpr (std::is_same_v<std::decay_t<decltype(a[0])>, uint16_t>) {
        ASSERT_EQ(a[i], b[i]) << what << " " << i;
      } else {
        ASSERT_TRUE(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))) << what << " " << i;
      }
    }
  };
  const auto near = [](const std::vector<float>& a, const std::vector<float>& b, const char* what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    float top = 0;
    for (float y : a) top = std::isnan(y) ? top : std::max(top, std::abs(y));
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::isnan(a[i]) && std::isnan(b[i])) continue;
      ASSERT_NEAR(a[i], b[i], 1e-4f * top + 1e-6f) << what;  // summed in thread order
    }
  };
  for (const Case& c : cases)
    for (int storage = 0; storage < 3; ++storage) {  // float, bfloat16, float16
      const HalfType type = storage == 1 ? HalfType::BFloat16 : HalfType::Float16;
      SCOPED_TRACE(c.name() + (c.d.k_rows ? " in place" : "") +
                   (storage == 0   ? " float"
                    : storage == 1 ? " bf16"
                                   : " fp16"));
      Data x = make_data(c, rng);
      if (c.d.B * c.d.Hk > 1) x.v[c.d.D + 3] = std::nan("");  // a NaN value reaches its rows
      const AttentionDims& d = c.d;
      const int64_t rows = d.key_rows(), D = d.D;
      AttentionDims sd = d;
      sd.v_strides = token_major(d.Hk, rows, D, 3);
      sd.out_strides = token_major(d.Hq, d.Tq, D, 5);
      sd.dout_strides = token_major(d.Hq, d.Tq, D, 2);
      sd.dv_strides = token_major(d.Hk, d.Tk, D, 4);
      // k and v: rows per head, NaN past Tk (in place) and in the gaps
      const auto kv = [&](const std::vector<double>& src) {
        std::vector<float> y(static_cast<size_t>(d.B * d.Hk * rows * D), std::nanf(""));
        for (int64_t h = 0; h < d.B * d.Hk; ++h)
          for (int64_t t = 0; t < d.Tk * D; ++t)
            y[h * rows * D + t] = static_cast<float>(src[h * d.Tk * D + t]);
        return y;
      };
      const auto lag = cast<float>(x.lag), slopes = cast<float>(x.slopes);
      const AttentionBias<float> bias = float_bias(x, lag, slopes);
      const auto grads = [&] { return zero_grads(bias, x); };
      // one storage: W the word (float or uint16_t), the calls through fwd and bwd
      const auto check = [&]<class W>(auto to_w, W nan, auto fwd, auto bwd) {
        std::vector<W> q, k, v, dout;
        for (double y : x.q) q.push_back(to_w(static_cast<float>(y)));
        for (float y : kv(x.k)) k.push_back(to_w(y));
        for (float y : kv(x.v)) v.push_back(to_w(y));
        for (double y : x.dout) dout.push_back(to_w(static_cast<float>(y)));
        const auto vs = lay_out(v, d.B, d.Hk, rows, D, sd.v_strides, nan);
        std::vector<W> out(x.nq()), outs(static_cast<size_t>(d.B * sd.out_strides.batch), nan);
        std::vector<float> lse(x.rows()), lses(x.rows());
        fwd(d, q, k, v, out, lse);
        fwd(sd, q, k, vs, outs, lses);
        same(gather(outs, d.B, d.Hq, d.Tq, D, sd.out_strides), out, "out");
        same(lses, lse, "lse");
        const auto gaps = lay_out(out, d.B, d.Hq, d.Tq, D, sd.out_strides, nan);
        for (size_t i = 0; i < gaps.size(); ++i) {  // the gaps as they were
          if constexpr (std::is_same_v<W, float>) {
            ASSERT_EQ(std::isnan(gaps[i]), std::isnan(outs[i])) << "gap " << i;
          } else {
            ASSERT_EQ(gaps[i] == nan, outs[i] == nan) << "gap " << i;
          }
        }
        if (d.k_rows) return;  // the backward reads contiguous keys only
        const auto douts = lay_out(dout, d.B, d.Hq, d.Tq, D, sd.dout_strides, nan);
        std::vector<W> dq(x.nq()), dk(x.nk()), dv(x.nk()), dqs(dq), dks(dk),
            dvs(static_cast<size_t>(d.B * sd.dv_strides.batch), nan);
        FloatGrads g = grads(), gs = grads();
        bwd(d, q, k, v, dout, out, lse, dq, dk, dv, g.g);
        bwd(sd, q, k, vs, douts, outs, lses, dqs, dks, dvs, gs.g);
        same(dqs, dq, "dq");
        same(dks, dk, "dk");
        same(gather(dvs, d.B, d.Hk, d.Tk, D, sd.dv_strides), dv, "dv");
        same(gs.dcq, g.dcq, "cq");
        same(gs.dck, g.dck, "ck");
        near(gs.dlag, g.dlag, "lag");
        near(gs.dslopes, g.dslopes, "slopes");
      };
      if (storage == 0) {
        check([](float y) { return y; }, std::nanf(""),
              [&](const AttentionDims& dd, auto& q, auto& k, auto& v, auto& out, auto& lse) {
                attention_forward<float>(dd, q.data(), k.data(), v.data(), x.positions(), bias,
                                         x.options(), out.data(), lse.data());
              },
              [&](const AttentionDims& dd, auto& q, auto& k, auto& v, auto& dout, auto& out,
                  auto& lse, auto& dq, auto& dk, auto& dv, const AttentionBiasGrads<float>& g) {
                attention_backward<float>(dd, q.data(), k.data(), v.data(), x.positions(), bias,
                                          x.options(), dout.data(), out.data(), lse.data(),
                                          dq.data(), dk.data(), dv.data(), g);
              });
      } else {
        check([&](float y) { return float_to_half(type, y); }, float_to_half(type, std::nanf("")),
              [&](const AttentionDims& dd, auto& q, auto& k, auto& v, auto& out, auto& lse) {
                attention_forward_half(dd, type, q.data(), k.data(), v.data(), x.positions(), bias,
                                       x.options(), out.data(), lse.data());
              },
              [&](const AttentionDims& dd, auto& q, auto& k, auto& v, auto& dout, auto& out,
                  auto& lse, auto& dq, auto& dk, auto& dv, const AttentionBiasGrads<float>& g) {
                attention_backward_half(dd, type, q.data(), k.data(), v.data(), x.positions(), bias,
                                        x.options(), dout.data(), out.data(), lse.data(), dq.data(),
                                        dk.data(), dv.data(), g);
              });
      }
    }
}

// One timing line of DISABLED_AttentionTiming.
static void time_attention(bool biases) {
  std::mt19937_64 rng(7);
  Case c;
  c.d = {1, 8, 8, 4096, 4096, 64};
  c.lag = c.slopes = c.tokens = biases;
  const Data x = make_data(c, rng);
  const auto q = cast<float>(x.q), k = cast<float>(x.k), v = cast<float>(x.v),
             dout = cast<float>(x.dout);
  std::vector<float> out(x.nq()), lse(x.rows()), dq(x.nq()), dk(x.nk()), dv(x.nk());
  const auto lag = cast<float>(x.lag), slopes = cast<float>(x.slopes);
  std::vector<float> glag(lag.size()), gslopes(slopes.size());
  std::vector<double> gcq(x.cq.size()), gck(x.ck.size());
  AttentionBias<float> bias;
  AttentionBiasGrads<float> grads;
  if (biases) {
    bias = {lag.data(), static_cast<int64_t>(lag.size()) / c.d.Hq, slopes.data(), x.cq.data(),
            x.ck.data()};
    grads = {glag.data(), gslopes.data(), gcq.data(), gck.data()};
  }
  using clock = std::chrono::steady_clock;
  auto fwd = [&] {
    attention_forward<float>(c.d, q.data(), k.data(), v.data(), {}, bias, {}, out.data(),
                             lse.data());
  };
  auto bwd = [&] {
    attention_backward<float>(c.d, q.data(), k.data(), v.data(), {}, bias, {}, dout.data(),
                              out.data(), lse.data(), dq.data(), dk.data(), dv.data(), grads);
  };
  // best of 5, wall clock and process CPU time: the development VM is shared, and its load
  // shows in the wall clock alone
  auto cpu_now = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  auto best = [&](auto&& f, double* cpu) {
    double t = 1e30;
    *cpu = 1e30;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = clock::now();
      const double c0 = cpu_now();
      f();
      *cpu = std::min(*cpu, cpu_now() - c0);
      t = std::min(t, std::chrono::duration<double>(clock::now() - t0).count());
    }
    return t;
  };
  double cf, cb;
  const double tf = best(fwd, &cf);
  fwd();
  const double tb = best(bwd, &cb);
  const double flops = 8.0 * 4.0 * 4096.0 * 4096.0 * 64.0 / 2.0;  // causal forward, 8 heads
  const int threads = omp_get_max_threads();
  std::printf(
      "attention B=1 H=8 T=4096 D=64 fp32 causal%s (%s, %d threads): forward %.1f ms wall "
      "(%.1f GFLOP/s), %.1f ms CPU (%.1f GFLOP/s per core); backward %.1f ms wall, %.1f ms CPU; "
      "forward+backward %.1f ms wall (%.1f GFLOP/s counting 3.5x the forward flops), %.1f ms "
      "CPU (%.1f GFLOP/s per core)\n",
      biases ? " + lag table, slopes, per-token biases" : "", kernel_isa(), threads, tf * 1e3,
      flops / tf * 1e-9, cf * 1e3, flops / cf * 1e-9, tb * 1e3, cb * 1e3, (tf + tb) * 1e3,
      3.5 * flops / (tf + tb) * 1e-9, (cf + cb) * 1e3, 3.5 * flops / (cf + cb) * 1e-9);
}

// Timings at B=1, H=8, T=4096, D=64, float, causal, without and with every bias (not run by
// default): relpos_core_tests --gtest_filter='*AttentionTiming*' --gtest_also_run_disabled_tests
TEST(AttentionKernel, DISABLED_AttentionTiming) {
  time_attention(false);
  time_attention(true);
}
