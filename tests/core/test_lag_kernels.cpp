// Learned lag tables (core/lag_kernel.hpp), catalog-wide: every mechanism with one declares its
// parameters consistently, its table is finite and a function of the lag alone, and the attention
// kernels' bias is that table. The formulas of the families from outside our papers against values
// computed by hand: T5's buckets (buckets=32, max_distance=128) and KERPLE's log / power kernels.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/registry.hpp"
#include "kernels/attention/mechanism_attention.hpp"

using namespace relpos;

namespace {

// The smallest head dim of 8..96 that the mechanism's defaults accept.
int head_dim_for(const std::string& name) {
  for (int D = 8; D <= 96; D += 2) try {
      build_mechanism(name, D, 3);
      return D;
    } catch (const InputError&) {
    }
  return 0;
}

const LagKernel& kernel_of(const Mechanism& m) {
  const BiasTerm* b = m.learned_lag_bias();
  if (!b) throw std::logic_error("no learned lag table");
  return *b->learned;
}

double inverse_softplus(double v) {
  return std::log(std::expm1(v));
}

}  // namespace

TEST(LagKernels, EveryLearnedTableOfTheCatalogIsConsistent) {
  int found = 0;
  for (const auto& info : mechanism_catalog()) {
    if (info.kind != "bias") continue;
    SCOPED_TRACE(info.name);
    const int D = head_dim_for(info.name), H = 3;
    ASSERT_GT(D, 0);
    const Mechanism m = build_mechanism(info.name, D, H);
    if (!m.learned_lag_bias()) continue;
    ++found;
    const LagKernel& k = kernel_of(m);
    EXPECT_EQ(k.term(), m.learned_lag_bias()->name);
    // parameters: unique names, initial values of their shapes, deterministic
    const auto params = k.params(H);
    ASSERT_FALSE(params.empty());
    std::set<std::string> names;
    for (const auto& p : params) {
      EXPECT_TRUE(names.insert(p.name).second) << p.name;
      ASSERT_FALSE(p.shape.empty());
      EXPECT_EQ(p.shape[0], H) << p.name;
      EXPECT_EQ(static_cast<int64_t>(p.init.size()), p.numel()) << p.name;
    }
    EXPECT_EQ(initial_lag_values(k, H), initial_lag_values(k, H));
    // the table: finite, and a longer table starts with the shorter one (a function of the lag)
    const auto t40 = initial_lag_table(k, H, 40), t300 = initial_lag_table(k, H, 300);
    ASSERT_EQ(t40.size(), static_cast<size_t>(H * 40));
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < 300; ++d) {
        const double x = t300[static_cast<size_t>(h * 300 + d)];
        ASSERT_TRUE(std::isfinite(x)) << h << " " << d;
        if (d < 40) {
          EXPECT_EQ(x, t40[static_cast<size_t>(h * 40 + d)]);
        }
      }
    // a spec string's table differs between heads or from zero: the bias is not plain attention
    EXPECT_NE(*std::max_element(t300.begin(), t300.end()),
              *std::min_element(t300.begin(), t300.end()));
    // a kernel reporting constant_from n: its table is constant from lag n on (the attention
    // kernels read longer lags at a table's last entry)
    const int64_t from = k.constant_from();
    if (from < 299) {
      for (int h = 0; h < H; ++h) {
        for (int d = static_cast<int>(from); d < 300; ++d) {
          EXPECT_EQ(t300[static_cast<size_t>(h * 300 + d)],
                    t300[static_cast<size_t>(h * 300 + from)])
              << k.term() << " lag " << d;
        }
      }
    }
    // the attention kernels' bias of the spec is that table (lags 0..max_lag, at most to
    // constant_from)
    const auto bias = kernels::attention_bias_of<double>(m, H, 299);
    const int64_t len = from < 300 ? from + 1 : 300;
    ASSERT_EQ(bias.lag_len, len);
    EXPECT_EQ(bias.complete, from < 300);
    for (int h = 0; h < H; ++h)
      for (int64_t d = 0; d < len; ++d)
        EXPECT_EQ(bias.lag_table[static_cast<size_t>(h * len + d)],
                  t300[static_cast<size_t>(h * 300 + d)]);
    // wrong parameter shapes are named
    auto bad = initial_lag_values(k, H);
    bad[0].pop_back();
    try {
      lag_table(k, bad, H, 10);
      ADD_FAILURE() << "no error";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(params[0].name), std::string::npos) << e.what();
    }
  }
  EXPECT_GE(found, 3);  // pj_bias, t5_bias, kerple at least
}

TEST(LagKernels, T5BucketsMatchTheFormulaByHand) {
  // buckets 32, max_distance 128: lags 0..15 exact; n >= 16: 16 + floor(16 log(n/16) / log 8),
  // at most 31. By hand: 16 -> 16, 20 -> 16 + 1.717 -> 17, 32 -> 16 + 5.333 -> 21,
  // 64 -> 16 + 10.667 -> 26, 100 -> 16 + 14.100 -> 30, 127 -> 16 + 15.94 -> 31, 128 and beyond ->
  // 31
  const Mechanism m = build_mechanism("t5_bias(buckets=32, max_distance=128)", 8, 2);
  const LagKernel& k = kernel_of(m);
  const auto params = k.params(2);
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(params[0].name, "t5_bucket_bias");
  EXPECT_EQ(params[0].shape, (std::vector<int64_t>{2, 32}));
  // weights 100 h + b: the table shows the bucket of each lag
  std::vector<double> w;
  for (int h = 0; h < 2; ++h)
    for (int b = 0; b < 32; ++b) w.push_back(100.0 * h + b);
  const int64_t len = 1001;
  const auto t = lag_table(k, {w}, 2, len);
  const std::vector<std::pair<int, int>> want = {{0, 0},    {1, 1},    {15, 15},  {16, 16},
                                                 {20, 17},  {32, 21},  {64, 26},  {100, 30},
                                                 {127, 31}, {128, 31}, {1000, 31}};
  for (const auto& [n, b] : want) {
    EXPECT_EQ(t[static_cast<size_t>(n)], b) << "lag " << n;
    EXPECT_EQ(t[static_cast<size_t>(len + n)], 100 + b) << "lag " << n;
  }
  // the last bucket from 16 log(n / 16) / log 8 >= 15, n >= 16 * 8^(15/16) = 112.4: n = 113
  // (112 -> 16 + 14.97 -> 30, 113 -> 16 + 15.04 -> 31)
  EXPECT_EQ(t[112], 30);
  EXPECT_EQ(k.constant_from(), 113);
  EXPECT_EQ(kernel_of(build_mechanism("kerple", 8, 1)).constant_from(), LagKernel::kUnbounded);
  // the initial weights: seeded, small, non-zero
  double mx = 0;
  for (double x : params[0].init) mx = std::max(mx, std::abs(x));
  EXPECT_GT(mx, 0.0);
  EXPECT_LT(mx, 0.2);
  EXPECT_NE(build_mechanism("t5_bias(seed=1)", 8, 2).learned_lag_bias()->learned->params(2)[0].init,
            params[0].init);
  EXPECT_THROW(build_mechanism("t5_bias(buckets=32, max_distance=16)", 8, 2), InputError);
  EXPECT_THROW(build_mechanism("t5_bias(buckets=1)", 8, 2), InputError);
}

TEST(LagKernels, KerpleKernelsMatchTheFormulaByHand) {
  // r1 = softplus(raw1) = 2; log: r2 = softplus(raw2) = 0.5, b(d) = -2 log(1 + d / 2)
  const Mechanism lg = build_mechanism("kerple(kernel=log)", 8, 1);
  const LagParamValues v = {{inverse_softplus(2.0)}, {inverse_softplus(0.5)}};
  const auto t = lag_table(kernel_of(lg), v, 1, 5);
  EXPECT_NEAR(t[0], 0.0, 1e-15);
  EXPECT_NEAR(t[2], -2.0 * std::log(2.0), 1e-14);
  EXPECT_NEAR(t[3], -1.8325814637483102, 1e-14);  // -2 log 2.5
  // power: r2 = 2 sigmoid(raw2) = 1.5 (raw2 = log 3), b(d) = -2 d^1.5
  const Mechanism pw = build_mechanism("kerple(kernel=power)", 8, 1);
  const auto p = lag_table(kernel_of(pw), {{inverse_softplus(2.0)}, {std::log(3.0)}}, 1, 5);
  EXPECT_EQ(p[0], 0.0);
  EXPECT_NEAR(p[1], -2.0, 1e-14);
  EXPECT_NEAR(p[4], -16.0, 1e-13);
  // initial r1, r2 inside their documented ranges
  const auto params = kernel_of(build_mechanism("kerple(r1_max=3, r2_max=1.5)", 8, 4)).params(4);
  ASSERT_EQ(params.size(), 2u);
  EXPECT_EQ(params[0].name, "kerple_raw_r1");
  for (double raw : params[0].init) {
    const double r1 = std::log1p(std::exp(raw));
    EXPECT_GE(r1, 0.01 - 1e-12);
    EXPECT_LE(r1, 3.0 + 1e-12);
  }
  EXPECT_THROW(build_mechanism("kerple(kernel=power, r2_max=2)", 8, 1), InputError);
  EXPECT_THROW(build_mechanism("kerple(kernel=cubic)", 8, 1), InputError);
  // one learned lag table per mechanism
  EXPECT_THROW(build_mechanism("kerple + t5_bias", 8, 1), InputError);
}
