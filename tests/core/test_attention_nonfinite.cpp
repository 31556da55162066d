// Non-finite values in the fused attention kernels (docs/errors.md, "Non-finite values"): a NaN or
// Inf that no row sees (causality, window, key padding, the positions past a decode) changes no
// output bit, and one that rows see makes exactly those rows non-finite, in float32 and float64,
// forward, both backward schemes and decode through KvCache, with grouped-query heads and the lag
// table, slope, per-token and gated-slope biases.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/mechanism.hpp"
#include "core/registry.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/attention/kv_cache.hpp"

using namespace relpos;
using namespace relpos::kernels;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Config {
  int64_t B = 2, Hq = 4, Hk = 2, Tq = 150, Tk = 150, D = 16;
  bool causal = true;
  double window = 0;
  bool padding = false;
  bool lag = false, slopes = false, tokens = false, gates = false;
  AttentionBackwardScheme scheme = AttentionBackwardScheme::PerHead;
  std::string name() const {
    std::string s = std::to_string(Tq) + "x" + std::to_string(Tk);
    s += causal ? " causal" : " full";
    if (window > 0) s += " window";
    if (padding) s += " padded";
    if (lag) s += " lag";
    if (slopes) s += " slopes";
    if (tokens) s += " tokens";
    if (gates) s += " gates";
    s += scheme == AttentionBackwardScheme::PerHead ? " per-head" : " two-pass";
    return s;
  }
};

// Every input of a call in float64 (rounded to T for the float kernel).
struct Inputs {
  std::vector<double> q, k, v, dout, lag, slopes, cq, ck, gq, gk;
  std::vector<int64_t> key_len;
};

template <class T>
struct Outputs {
  std::vector<T> out, lse, dq, dk, dv, glag, gslopes, ggq, ggk;
  std::vector<double> gcq, gck;
};

Inputs make_inputs(const Config& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> N(0.0, 1.0);
  const auto fill = [&](int64_t n, double sd = 1.0) {
    std::vector<double> x(static_cast<size_t>(n));
    for (auto& e : x) e = sd * N(rng);
    return x;
  };
  Inputs in;
  in.q = fill(c.B * c.Hq * c.Tq * c.D);
  in.k = fill(c.B * c.Hk * c.Tk * c.D);
  in.v = fill(c.B * c.Hk * c.Tk * c.D);
  in.dout = fill(c.B * c.Hq * c.Tq * c.D);
  if (c.lag) in.lag = fill(c.Hq * 40, 0.5);
  if (c.slopes) in.slopes = fill(c.Hq, 0.05);
  if (c.tokens) {
    in.cq = fill(c.B * c.Hq * c.Tq, 0.5);
    in.ck = fill(c.B * c.Hq * c.Tk, 0.5);
  }
  if (c.gates) {
    in.gq = fill(c.B * c.Hq * c.Tq, 0.02);
    in.gk = fill(c.B * c.Hq * c.Tk, 0.02);
  }
  if (c.padding)
    for (int64_t b = 0; b < c.B; ++b) in.key_len.push_back(b == 0 ? c.Tk - 37 : c.Tk);
  return in;
}

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}
template <class T>
const T* ptr(const std::vector<T>& x) {
  return x.empty() ? nullptr : x.data();
}
template <class T>
T* ptr(std::vector<T>& x) {
  return x.empty() ? nullptr : x.data();
}

template <class T>
Outputs<T> run(const Config& c, const Inputs& in, bool backward) {
  const AttentionDims d{c.B, c.Hq, c.Hk, c.Tq, c.Tk, c.D};
  const auto q = cast<T>(in.q), k = cast<T>(in.k), v = cast<T>(in.v), dout = cast<T>(in.dout),
             lag = cast<T>(in.lag), slopes = cast<T>(in.slopes), gq = cast<T>(in.gq),
             gk = cast<T>(in.gk);
  AttentionBias<T> bias;
  bias.lag_table = ptr(lag);
  bias.lag_len = c.lag ? 40 : 0;
  bias.slopes = ptr(slopes);
  bias.cq = ptr(in.cq);
  bias.ck = ptr(in.ck);
  bias.gq = ptr(gq);
  bias.gk = ptr(gk);
  AttentionOptions o;
  o.causal = c.causal;
  o.window = c.window;
  o.key_len = ptr(in.key_len);
  o.backward = c.scheme;
  Outputs<T> r;
  r.out.resize(q.size());
  r.lse.resize(static_cast<size_t>(c.B * c.Hq * c.Tq));
  attention_forward<T>(d, q.data(), k.data(), v.data(), {}, bias, o, r.out.data(), r.lse.data());
  if (!backward) return r;
  r.dq.resize(q.size());
  r.dk.resize(k.size());
  r.dv.resize(v.size());
  r.glag.assign(lag.size(), T(0));
  r.gslopes.assign(slopes.size(), T(0));
  r.gcq.assign(in.cq.size(), 0.0);
  r.gck.assign(in.ck.size(), 0.0);
  r.ggq.assign(gq.size(), T(0));
  r.ggk.assign(gk.size(), T(0));
  AttentionBiasGrads<T> g;
  g.lag_table = ptr(r.glag);
  g.slopes = ptr(r.gslopes);
  g.cq = ptr(r.gcq);
  g.ck = ptr(r.gck);
  g.gq = ptr(r.ggq);
  g.gk = ptr(r.ggk);
  attention_backward<T>(d, q.data(), k.data(), v.data(), {}, bias, o, dout.data(), r.out.data(),
                        r.lse.data(), r.dq.data(), r.dk.data(), r.dv.data(), g);
  return r;
}

// Who sees what (default positions: query i at Tk - Tq + i, key j at j).
struct Visibility {
  Config c;
  std::vector<int64_t> key_len;
  bool sees(int64_t b, int64_t i, int64_t j) const {
    const int64_t kl = key_len.empty() ? c.Tk : key_len[b];
    if (j >= kl) return false;
    const double pq = static_cast<double>(c.Tk - c.Tq + i), pk = static_cast<double>(j);
    if (c.causal && !(pk <= pq)) return false;
    return !(c.window > 0) || pq - pk < c.window;
  }
  bool sees_any(int64_t b, int64_t i) const {
    for (int64_t j = 0; j < c.Tk; ++j)
      if (sees(b, i, j)) return true;
    return false;
  }
};

// Where a value is injected, and the rows it reaches.
enum class Site { Q, K, V, Dout, Ck, Gk, Lag };
const char* site_name(Site s) {
  switch (s) {
    case Site::Q:
      return "q";
    case Site::K:
      return "k";
    case Site::V:
      return "v";
    case Site::Dout:
      return "dout";
    case Site::Ck:
      return "ck";
    case Site::Gk:
      return "gk";
    case Site::Lag:
      return "lag table";
  }
  return "?";
}

struct Injection {
  Site site;
  int64_t b = 0, h = 0, t = 0, e = 0;  // h: the tensor's head; t: the row (lag: the entry)
  double value = kNaN;
};

// The query rows (b, h, i) an injection reaches, as flat row indices of [B, Hq, Tq].
std::set<int64_t> reached_rows(const Visibility& vis, const Injection& x) {
  const Config& c = vis.c;
  std::set<int64_t> rows;
  const int64_t group = c.Hq / c.Hk;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Tq; ++i) {
        bool hit = false;
        switch (x.site) {
          case Site::Q:
          case Site::Dout:
            hit = b == x.b && h == x.h && i == x.t && vis.sees_any(b, i);
            break;
          case Site::K:
          case Site::V:
            hit = b == x.b && h / group == x.h && vis.sees(b, i, x.t);
            break;
          case Site::Ck:
          case Site::Gk:
            hit = b == x.b && h == x.h && vis.sees(b, i, x.t);
            break;
          case Site::Lag:
            for (int64_t j = 0; j < c.Tk && !hit; ++j) {
              const int64_t lag = std::clamp<int64_t>(c.Tk - c.Tq + i - j, 0, 39);
              hit = h == x.h && lag == x.t && vis.sees(b, i, j);
            }
            break;
        }
        if (hit) rows.insert((b * c.Hq + h) * c.Tq + i);
      }
  return rows;
}

// The key rows (b, hk, j) of [B, Hk, Tk] that the reached query rows see.
std::set<int64_t> keys_of(const Visibility& vis, const std::set<int64_t>& rows) {
  const Config& c = vis.c;
  std::set<int64_t> keys;
  for (int64_t row : rows) {
    const int64_t i = row % c.Tq, h = (row / c.Tq) % c.Hq, b = row / (c.Tq * c.Hq);
    for (int64_t j = 0; j < c.Tk; ++j)
      if (vis.sees(b, i, j)) keys.insert((b * c.Hk + h / (c.Hq / c.Hk)) * c.Tk + j);
  }
  return keys;
}

Inputs inject(const Config& c, Inputs in, const Injection& x) {
  const int64_t D = c.D;
  switch (x.site) {
    case Site::Q:
      in.q[((x.b * c.Hq + x.h) * c.Tq + x.t) * D + x.e] = x.value;
      break;
    case Site::K:
      in.k[((x.b * c.Hk + x.h) * c.Tk + x.t) * D + x.e] = x.value;
      break;
    case Site::V:
      in.v[((x.b * c.Hk + x.h) * c.Tk + x.t) * D + x.e] = x.value;
      break;
    case Site::Dout:
      in.dout[((x.b * c.Hq + x.h) * c.Tq + x.t) * D + x.e] = x.value;
      break;
    case Site::Ck:
      in.ck[(x.b * c.Hq + x.h) * c.Tk + x.t] = x.value;
      break;
    case Site::Gk:
      in.gk[(x.b * c.Hq + x.h) * c.Tk + x.t] = x.value;
      break;
    case Site::Lag:
      in.lag[x.h * 40 + x.t] = x.value;
      break;
  }
  return in;
}

template <class T>
bool row_finite(const std::vector<T>& x, int64_t row, int64_t width) {
  for (int64_t e = 0; e < width; ++e)
    if (!std::isfinite(static_cast<double>(x[row * width + e]))) return false;
  return true;
}
template <class T>
bool row_same(const std::vector<T>& a, const std::vector<T>& b, int64_t row, int64_t width) {
  return std::memcmp(a.data() + row * width, b.data() + row * width, sizeof(T) * width) == 0;
}

// Rows in `reached` are non-finite (when `must_reach`), every other row is bit for bit the
// baseline's.
template <class T>
void expect_rows(const char* what, const std::vector<T>& base, const std::vector<T>& got,
                 int64_t width, const std::set<int64_t>& reached, bool must_reach,
                 const std::string& ctx) {
  const int64_t rows = static_cast<int64_t>(base.size()) / width;
  int bad = 0;
  for (int64_t r = 0; r < rows && bad < 3; ++r) {
    if (reached.count(r)) {
      if (must_reach && row_finite(got, r, width)) {
        ADD_FAILURE() << ctx << ": " << what << " row " << r << " sees the value but is finite";
        ++bad;
      }
    } else if (!row_same(base, got, r, width)) {
      ADD_FAILURE() << ctx << ": " << what << " row " << r << " does not see the value but changed";
      ++bad;
    }
  }
}

template <class T>
void check_injection(const Config& c, const Inputs& in, const Outputs<T>& base,
                     const Injection& x) {
  const Visibility vis{c, in.key_len};
  const std::set<int64_t> rows = reached_rows(vis, x), keys = keys_of(vis, rows);
  const Outputs<T> got = run<T>(c, inject(c, in, x), true);
  const std::string ctx =
      c.name() + (sizeof(T) == 4 ? " float" : " double") + ", " + std::to_string(x.value) + " in " +
      site_name(x.site) + " (b " + std::to_string(x.b) + ", head " + std::to_string(x.h) +
      ", row " + std::to_string(x.t) + "), reaching " + std::to_string(rows.size()) + " rows";
  // NaN anywhere, and Inf in values and grad_out, reach every row that sees them; an Inf in q or
  // k may give a -Inf logit (weight 0), so for those only the rows that do not see it are checked
  const bool exact = std::isnan(x.value) || x.site == Site::V || x.site == Site::Dout;
  const bool forward_site = x.site != Site::Dout;
  const bool logit_site = x.site != Site::V && x.site != Site::Dout;
  expect_rows("out", base.out, got.out, c.D, forward_site ? rows : std::set<int64_t>{}, exact, ctx);
  expect_rows("lse", base.lse, got.lse, 1, logit_site ? rows : std::set<int64_t>{}, exact, ctx);
  expect_rows("dq", base.dq, got.dq, c.D, rows, exact, ctx);
  expect_rows("dk", base.dk, got.dk, c.D, keys, exact, ctx);
  // dv = P^T dout: reached through P (logits) or dout, not through v itself
  expect_rows("dv", base.dv, got.dv, c.D, x.site == Site::V ? std::set<int64_t>{} : keys, exact,
              ctx);
  if (rows.empty()) {  // nothing sees it: every bias gradient is unchanged too
    EXPECT_TRUE(got.ggq == base.ggq && got.ggk == base.ggk) << ctx;
    // the lag table and slope gradients are summed over threads in whatever order they finish:
    // equal up to that rounding, and finite
    for (const auto* pair : {&got.glag, &got.gslopes}) {
      const std::vector<T>& want = pair == &got.glag ? base.glag : base.gslopes;
      for (size_t x = 0; x < want.size(); ++x)
        EXPECT_NEAR(static_cast<double>((*pair)[x]), static_cast<double>(want[x]),
                    1e-4 * (1 + std::abs(static_cast<double>(want[x]))))
            << ctx;
    }
    EXPECT_TRUE(
        got.gcq.size() == base.gcq.size() &&
        (got.gcq.empty() || 0 == std::memcmp(got.gcq.data(), base.gcq.data(), 8 * got.gcq.size())))
        << ctx;  // memcmp of an empty vector's null data is undefined
    EXPECT_TRUE(
        got.gck.size() == base.gck.size() &&
        (got.gck.empty() || 0 == std::memcmp(got.gck.data(), base.gck.data(), 8 * got.gck.size())))
        << ctx;  // memcmp of an empty vector's null data is undefined
  }
}

// Injection sites at the mask's edges and inside it: the last key (seen by the last row only, in
// causal attention), key 0 (hidden by a window), a key in the padding, the first and last query
// rows, a random row, each with NaN; the edge sites with +Inf and -Inf too.
template <class T>
void check_config(const Config& c, uint64_t seed) {
  const Inputs in = make_inputs(c, seed);
  const Outputs<T> base = run<T>(c, in, true);
  for (size_t x = 0; x < base.out.size(); ++x)
    ASSERT_TRUE(std::isfinite(static_cast<double>(base.out[x]))) << c.name();
  std::mt19937_64 rng(seed + 1);
  const auto pick = [&](int64_t n) {
    return static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
  };
  std::vector<Injection> sites;
  for (double value : {kNaN, kInf, -kInf}) {
    const int64_t e = pick(c.D);
    // every site with NaN; the infinities at the mask's edges only (the suite stays fast)
    const bool nan = std::isnan(value);
    for (int64_t j : nan ? std::vector<int64_t>{c.Tk - 1, 0, c.Tk - 20, pick(c.Tk)}
                         : std::vector<int64_t>{c.Tk - 1, 0}) {
      sites.push_back({Site::K, 0, pick(c.Hk), j, e, value});
      sites.push_back({Site::V, 0, pick(c.Hk), j, e, value});
      if (c.tokens) sites.push_back({Site::Ck, 0, pick(c.Hq), j, 0, value});
      if (c.gates) sites.push_back({Site::Gk, 0, pick(c.Hq), j, 0, value});
    }
    for (int64_t i :
         nan ? std::vector<int64_t>{0, c.Tq - 1, pick(c.Tq)} : std::vector<int64_t>{c.Tq - 1}) {
      sites.push_back({Site::Q, pick(c.B), pick(c.Hq), i, e, value});
      sites.push_back({Site::Dout, pick(c.B), pick(c.Hq), i, e, value});
    }
    if (c.lag) sites.push_back({Site::Lag, 0, pick(c.Hq), pick(40), 0, value});
  }
  for (const Injection& x : sites) check_injection<T>(c, in, base, x);
}

std::vector<Config> configs() {
  std::vector<Config> out;
  Config c;
  out.push_back(c);  // causal, every tile kind
  c.window = 20;     // key 0 hidden from row 20 on
  out.push_back(c);
  c.window = 0;
  c.padding = true;  // batch 0 has 37 padded keys
  c.lag = c.slopes = true;
  out.push_back(c);
  c.scheme = AttentionBackwardScheme::TwoPass;
  c.tokens = c.gates = true;
  c.lag = c.slopes = false;
  out.push_back(c);
  c.padding = false;
  c.tokens = c.gates = false;
  c.Tq = 70;  // queries are the last 70 positions (the decode convention)
  c.window = 33;
  out.push_back(c);
  c.causal = false;  // only the window and the padding mask
  c.padding = true;
  out.push_back(c);
  c.Tq = 1;  // one decode row against 150 keys
  c.causal = true;
  c.window = 0;
  c.scheme = AttentionBackwardScheme::PerHead;
  out.push_back(c);
  // the decode kernel's two paths with biases: 2 rows per key/value head as dot products, 6 as
  // transposed lanes over several key tiles
  c.Tq = 1;
  c.padding = false;
  c.tokens = c.gates = true;
  out.push_back(c);
  c.Tq = 3;
  c.Tk = 600;
  c.window = 100;
  c.padding = true;
  c.tokens = c.gates = false;
  c.lag = c.slopes = true;
  out.push_back(c);
  return out;
}

// One thread for a scope (every config but the first: parallel regions of these small problems
// cost far more than their work on a loaded machine; the first keeps the threaded paths covered).
class OneThread {
 public:
  OneThread() : old_(omp_get_max_threads()) { omp_set_num_threads(1); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;
  ~OneThread() { omp_set_num_threads(old_); }

 private:
  int old_;
};

template <class T>
void check_all(uint64_t seed) {
  const std::vector<Config> cs = configs();
  check_config<T>(cs[0], seed);
  const OneThread one;
  for (size_t x = 1; x < cs.size(); ++x) check_config<T>(cs[x], seed + x);
}

}  // namespace

TEST(AttentionNonFinite, MaskedValuesChangeNothingAndVisibleOnesReachExactlyTheirRowsFloat) {
  check_all<float>(100);
}

TEST(AttentionNonFinite, MaskedValuesChangeNothingAndVisibleOnesReachExactlyTheirRowsDouble) {
  check_all<double>(200);
}

// The reproductions: NaN in one element of q gives that row NaN (not 0 with lse -inf);
// a NaN key is NaN for the rows that see it and nothing else.
TEST(AttentionNonFinite, NanInQueryOrKeyIsNanNotZeroFloat) {
  const AttentionDims d{1, 1, 1, 6, 6, 4};
  std::mt19937_64 rng(3);
  std::normal_distribution<float> N;
  std::vector<float> x(24), out(24), lse(6);
  for (auto& e : x) e = N(rng);
  auto q = x;
  q[3 * 4] = std::numeric_limits<float>::quiet_NaN();
  attention_forward<float>(d, q.data(), x.data(), x.data(), {}, {}, {}, out.data(), lse.data());
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(i == 3, std::isnan(lse[i])) << "row " << i;
    EXPECT_EQ(i == 3, std::isnan(out[i * 4])) << "row " << i;
  }
  auto k = x;
  k[2 * 4 + 1] = std::numeric_limits<float>::quiet_NaN();
  attention_forward<float>(d, x.data(), k.data(), x.data(), {}, {}, {}, out.data(), lse.data());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(i >= 2, std::isnan(lse[i])) << "row " << i;
}

// Decode through the KV cache: a NaN cached at a later position changes no bit of a decode that
// cannot see it (its chunk is merged with the others), and makes a decode that sees it NaN.
template <class T>
void check_cache() {
  const int64_t B = 2, Hq = 4, Hk = 2, D = 16, n = 40;
  const Mechanism m = build_mechanism("rope", static_cast<int>(D), static_cast<int>(Hq));
  std::mt19937_64 rng(11);
  std::normal_distribution<double> N;
  const auto fill = [&](int64_t count) {
    std::vector<T> x(static_cast<size_t>(count));
    for (auto& e : x) e = static_cast<T>(N(rng));
    return x;
  };
  const auto k = fill(B * Hk * n * D), v = fill(B * Hk * n * D), q = fill(B * Hq * D);
  std::vector<double> pos(n);
  for (int64_t t = 0; t < n; ++t) pos[t] = static_cast<double>(t);
  for (const double value : {kNaN, kInf}) {
    for (const bool in_v : {false, true}) {
      const int64_t bad = 25;  // the position holding the value
      auto k2 = k, v2 = v;
      (in_v ? v2 : k2)[((1 * Hk + 1) * n + bad) * D + 3] = static_cast<T>(value);
      KvCacheOptions o;
      o.chunk = 8;
      const ParamValues par = default_params(m);
      KvCache<T> clean(m, par, B, Hq, Hk, D, o), dirty(m, par, B, Hq, Hk, D, o);
      clean.append(k, v, pos);
      dirty.append(k2, v2, pos);
      for (const double p : {2.0, 24.0, 25.0, 39.0}) {
        std::vector<T> o1(q.size()), o2(q.size()), l1(B * Hq), l2(B * Hq);
        clean.decode(q, p, o1, l1);
        dirty.decode(q, p, o2, l2);
        for (int64_t r = 0; r < B * Hq; ++r) {
          const bool sees = p >= bad && r / Hq == 1 && (r % Hq) / (Hq / Hk) == 1;
          const std::string ctx = std::to_string(value) + (in_v ? " in v" : " in k") +
                                  ", decode at " + std::to_string(p) + ", row " + std::to_string(r);
          if (!sees) {
            EXPECT_EQ(0, std::memcmp(o1.data() + r * D, o2.data() + r * D, sizeof(T) * D)) << ctx;
            EXPECT_EQ(0, std::memcmp(&l1[r], &l2[r], sizeof(T))) << ctx;
          } else if (std::isnan(value) || in_v) {
            bool finite = true;
            for (int64_t e = 0; e < D; ++e) finite &= std::isfinite(o2[r * D + e]);
            EXPECT_FALSE(finite) << ctx;
          }
        }
      }
    }
  }
}

TEST(KvCacheNonFinite, LaterNanChangesNoEarlierDecodeFloat) {
  check_cache<float>();
}
TEST(KvCacheNonFinite, LaterNanChangesNoEarlierDecodeDouble) {
  check_cache<double>();
}
