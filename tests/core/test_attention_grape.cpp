// GRAPE's biases in the fused attention kernel (issue 14): gated slopes -(p_i - p_j)(gq_i + gk_j)
// and path integrals sum_{l=j+1..slot(i)} beta_h logsigmoid(s pq_i . pk_l). The float64 reference
// (materialised per row, straight from the definitions) is checked against central differences;
// the fp32 and fp64 kernels against the reference, values and every gradient, in each backward
// scheme, on shapes with grouped queries, decode-like Tq < Tk, windows and ragged tiles;
// causality; and the special cases: constant key gates are the slope form, a query-independent
// potential is FoX's cq/ck form.
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/attention/attention.hpp"
#include "test_util.hpp"

using namespace relpos;
using namespace relpos::kernels;

namespace {

struct GrapeCase {
  AttentionDims d;
  int64_t P = 0;  // probe width; 0: no path integral
  bool gates = true, causal = true;
  double window = 0;
  // positions p_k[j] = j + gaps, p_q[i] = p_k[slot(i)] - lag: tiles between a query's slot and its
  // first visible key hold edges (the kernels fold them in); key padding: batch 0 sees Tk - 37
  bool positions = false, padding = false;
};

// Inputs of one case, float64; every bias optional as the case says.
struct Inputs {
  GrapeCase c;
  std::vector<double> q, k, v, dout, gq, gk, pq, pk, beta, posq, posk;
  std::vector<int64_t> key_len;

  explicit Inputs(const GrapeCase& cs, uint64_t seed) : c(cs) {
    std::mt19937_64 rng(seed);
    const auto& d = c.d;
    q = test::normal_vec(static_cast<size_t>(d.B * d.Hq * d.Tq * d.D), rng);
    k = test::normal_vec(static_cast<size_t>(d.B * d.Hk * d.Tk * d.D), rng);
    v = test::normal_vec(k.size(), rng);
    dout = test::normal_vec(q.size(), rng);
    if (c.gates) {
      gq = test::normal_vec(static_cast<size_t>(d.B * d.Hq * d.Tq), rng, 0.03);
      gk = test::normal_vec(static_cast<size_t>(d.B * d.Hq * d.Tk), rng, 0.03);
    }
    if (c.P) {
      pq = test::normal_vec(static_cast<size_t>(d.B * d.Hq * d.Tq * c.P), rng);
      pk = test::normal_vec(static_cast<size_t>(d.B * d.Hq * d.Tk * c.P), rng);
      for (int64_t h = 0; h < d.Hq; ++h) beta.push_back(test::uniform(rng, 0.05, 0.6));
    }
    // the float kernels get the inputs rounded: give the reference the same values
    for (auto* x : {&q, &k, &v, &dout, &gq, &gk, &pq, &pk, &beta})
      for (double& y : *x) y = static_cast<double>(static_cast<float>(y));
    if (c.positions) {
      for (int64_t j = 0; j < d.Tk; ++j) posk.push_back(static_cast<double>(j + j / 50 * 3));
      for (int64_t i = 0; i < d.Tq; ++i) posq.push_back(posk[d.Tk - d.Tq + i] - 70.5);
    }
    if (c.padding)
      for (int64_t b = 0; b < d.B; ++b) key_len.push_back(b == 0 ? d.Tk - 37 : d.Tk);
  }
  AttentionPositions positions() const {
    return {posq.empty() ? nullptr : posq.data(), posk.empty() ? nullptr : posk.data(), false};
  }
};

template <class T>
std::vector<T> as(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

template <class T>
T* ptr_or_null(std::vector<T>& x) {
  return x.empty() ? nullptr : x.data();
}

AttentionOptions options(const Inputs& in) {
  AttentionOptions o;
  o.causal = in.c.causal;
  o.window = in.c.window;
  o.key_len = in.key_len.empty() ? nullptr : in.key_len.data();
  return o;
}

// Output and gradients (q, k, v, gq, gk, path_q, path_k, beta) of one implementation.
struct Result {
  std::vector<std::vector<double>> parts;
};

template <class T>
Result run_kernel(const Inputs& in, AttentionBackwardScheme scheme) {
  const auto& d = in.c.d;
  auto q = as<T>(in.q), k = as<T>(in.k), v = as<T>(in.v), dout = as<T>(in.dout);
  auto gq = as<T>(in.gq), gk = as<T>(in.gk), pq = as<T>(in.pq), pk = as<T>(in.pk),
       beta = as<T>(in.beta);
  AttentionBias<T> bias;
  bias.gq = ptr_or_null(gq);
  bias.gk = ptr_or_null(gk);
  bias.path_q = ptr_or_null(pq);
  bias.path_k = ptr_or_null(pk);
  bias.path_beta = ptr_or_null(beta);
  bias.path_dim = in.c.P;
  bias.path_scale = in.c.P ? 1.0 / static_cast<double>(in.c.P) : 1.0;
  AttentionOptions o = options(in);
  o.backward = scheme;
  std::vector<T> out(q.size()), lse(static_cast<size_t>(d.B * d.Hq * d.Tq));
  attention_forward<T>(d, q.data(), k.data(), v.data(), in.positions(), bias, o, out.data(),
                       lse.data());
  std::vector<T> dq(q.size()), dk(k.size()), dv(v.size()), dgq(gq.size()), dgk(gk.size()),
      dpq(pq.size()), dpk(pk.size()), dbeta(beta.size());
  AttentionBiasGrads<T> g;
  g.gq = ptr_or_null(dgq);
  g.gk = ptr_or_null(dgk);
  g.path_q = ptr_or_null(dpq);
  g.path_k = ptr_or_null(dpk);
  g.path_beta = ptr_or_null(dbeta);
  attention_backward<T>(d, q.data(), k.data(), v.data(), in.positions(), bias, o, dout.data(),
                        out.data(), lse.data(), dq.data(), dk.data(), dv.data(), g);
  Result r;
  for (const auto* x : {&out, &dq, &dk, &dv, &dgq, &dgk, &dpq, &dpk, &dbeta})
    r.parts.emplace_back(x->begin(), x->end());
  return r;
}

AttentionBias<double> reference_bias(Inputs& in) {
  AttentionBias<double> b;
  b.gq = ptr_or_null(in.gq);
  b.gk = ptr_or_null(in.gk);
  b.path_q = ptr_or_null(in.pq);
  b.path_k = ptr_or_null(in.pk);
  b.path_beta = ptr_or_null(in.beta);
  b.path_dim = in.c.P;
  b.path_scale = in.c.P ? 1.0 / static_cast<double>(in.c.P) : 1.0;
  return b;
}

Result run_reference(Inputs& in) {
  const auto& d = in.c.d;
  const auto bias = reference_bias(in);
  const auto o = options(in);
  std::vector<double> out(in.q.size());
  attention_reference(d, in.q.data(), in.k.data(), in.v.data(), in.positions(), bias, o, out.data(),
                      nullptr);
  std::vector<double> dq(in.q.size()), dk(in.k.size()), dv(in.v.size()), dgq(in.gq.size()),
      dgk(in.gk.size()), dpq(in.pq.size()), dpk(in.pk.size()), dbeta(in.beta.size());
  AttentionBiasGrads<double> g;
  g.gq = ptr_or_null(dgq);
  g.gk = ptr_or_null(dgk);
  g.path_q = ptr_or_null(dpq);
  g.path_k = ptr_or_null(dpk);
  g.path_beta = ptr_or_null(dbeta);
  attention_reference_backward(d, in.q.data(), in.k.data(), in.v.data(), in.positions(), bias, o,
                               in.dout.data(), dq.data(), dk.data(), dv.data(), g);
  Result r;
  for (const auto* x : {&out, &dq, &dk, &dv, &dgq, &dgk, &dpq, &dpk, &dbeta}) r.parts.push_back(*x);
  return r;
}

// max |a - b| / max |b| (norm-wise relative error)
double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0, m = 1e-300;
  for (size_t i = 0; i < b.size(); ++i) {
    e = std::max(e, std::abs(a[i] - b[i]));
    m = std::max(m, std::abs(b[i]));
  }
  return e / m;
}

const char* kPart[] = {"out", "dq", "dk", "dv", "dgq", "dgk", "dpath_q", "dpath_k", "dbeta"};

std::vector<GrapeCase> cases() {
  return {
      {{1, 2, 2, 300, 300, 16}, 8, true, true, 0},    // several groups of tiles, ragged last tile
      {{2, 4, 2, 517, 517, 32}, 4, true, true, 0},    // grouped queries
      {{1, 2, 1, 70, 333, 16}, 8, true, true, 0},     // decode-like: queries the last 70 slots
      {{1, 2, 2, 290, 290, 16}, 8, true, true, 100},  // sliding window
      {{2, 3, 3, 200, 200, 16}, 0, true, true, 0},    // gated slopes alone
      {{1, 2, 2, 90, 90, 16}, 4, true, false, 0},     // non-causal
      {{1, 2, 1, 100, 150, 16}, 8, true, false, 40},  // non-causal, windowed, decode-like
      {{1, 2, 2, 280, 280, 16}, 8, true, true, 0, true},         // positions: folded edges
      {{1, 2, 2, 280, 280, 16}, 8, false, true, 90, true},       // positions and a window
      {{2, 2, 1, 200, 270, 16}, 4, true, true, 0, false, true},  // key padding
      // the decode kernel (g x Tq <= 16 rows per key/value head): gated slopes over key chunks
      {{2, 4, 2, 3, 700, 16}, 0, true, true, 0},
      {{1, 2, 2, 1, 500, 16}, 0, true, true, 50, true},
      // and the path integral there: each key chunk shifted by the edges of the chunks above it,
      // on the transposed (> 4 rows) and the row-major path, with the window, other positions,
      // key padding and no causality
      {{2, 4, 2, 3, 700, 16}, 8, true, true, 0},
      {{1, 2, 2, 1, 600, 16}, 8, true, true, 0},
      {{1, 2, 1, 2, 300, 16}, 8, true, true, 40, true},
      {{2, 2, 1, 4, 270, 16}, 4, true, true, 0, false, true},
      {{1, 2, 1, 3, 150, 16}, 8, true, false, 40},
  };
}

}  // namespace

// The float64 reference's gradients of the gates, probes and beta against central differences of
// its own forward (L = sum out * dout): the reference the kernels are judged by is right. Causal
// decode-like, and non-causal with a window on other positions and key padding.
TEST(AttentionGrape, ReferenceGradientsMatchFiniteDifferences) {
  for (const GrapeCase& c : {GrapeCase{{1, 2, 1, 9, 13, 4}, 4, true, true, 0},
                             GrapeCase{{2, 2, 2, 11, 11, 4}, 3, true, false, 4.0, false, true}}) {
    Inputs in(c, 5);
    if (!c.causal)  // positions with gaps and an offset (edges still on the slots)
      for (int64_t j = 0; j < c.d.Tk; ++j) {
        in.posk.push_back(1.5 * static_cast<double>(j) + (j > 6 ? 2 : 0));
        in.posq.push_back(in.posk.back() - 0.75);
      }
    const Result r = run_reference(in);
    const auto loss = [&] {
      std::vector<double> out(in.q.size());
      attention_reference(c.d, in.q.data(), in.k.data(), in.v.data(), in.positions(),
                          reference_bias(in), options(in), out.data(), nullptr);
      double s = 0;
      for (size_t i = 0; i < out.size(); ++i) s += out[i] * in.dout[i];
      return s;
    };
    std::vector<std::pair<std::vector<double>*, int>> params = {
        {&in.gq, 4}, {&in.gk, 5}, {&in.pq, 6}, {&in.pk, 7}, {&in.beta, 8}};
    for (auto& [x, part] : params)
      for (size_t i = 0; i < x->size(); i += 2) {
        const double h = 1e-6, x0 = (*x)[i];
        (*x)[i] = x0 + h;
        const double up = loss();
        (*x)[i] = x0 - h;
        const double dn = loss();
        (*x)[i] = x0;
        const double fd = (up - dn) / (2 * h);
        EXPECT_NEAR(r.parts[part][i], fd, 1e-6 * std::max(1.0, std::abs(fd)))
            << kPart[part] << "[" << i << "] causal=" << c.causal;
      }
  }
}

// The fp32 and fp64 kernels against the reference in each backward scheme (a path integral
// always takes PerHead: asking for TwoPass must still give the right gradients).
TEST(AttentionGrape, KernelsMatchTheReference) {
  uint64_t seed = 11;
  for (const auto& c : cases()) {
    Inputs in(c, seed++);
    const Result ref = run_reference(in);
    for (auto scheme : {AttentionBackwardScheme::Auto, AttentionBackwardScheme::PerHead,
                        AttentionBackwardScheme::TwoPass}) {
      const Result f32 = run_kernel<float>(in, scheme), f64 = run_kernel<double>(in, scheme);
      for (size_t p = 0; p < ref.parts.size(); ++p) {
        if (ref.parts[p].empty()) continue;
        SCOPED_TRACE(::testing::Message() << kPart[p] << " T=" << c.d.Tq << "/" << c.d.Tk << " P="
                                          << c.P << " scheme=" << static_cast<int>(scheme));
        // beta's gradient sums dS against long path sums over whole rows; without the kernel's
        // zero-row-sum projection of dS (backward_per_head) the fp32 rounding of Delta reached
        // 2.1e-5 here on the windowed case; with it, at most 5.3e-7 over these cases. Other
        // gradients reach 9.8e-6 (the gates') and, in the baseline build on an Intel Xeon,
        // 1.44e-5 (path_q of the decode case with key padding): fp32 rounding of sums over
        // hundreds of keys, hence 3e-5
        EXPECT_LT(rel(f32.parts[p], ref.parts[p]), 3e-5);
        EXPECT_LT(rel(f64.parts[p], ref.parts[p]), 1e-10);
      }
    }
  }
}

// Changing the keys, values, key gates and key probes after slot i leaves out rows <= i
// unchanged, bit for bit (fp32 kernel): gated slopes alone, the path integral alone, both.
TEST(AttentionGrape, Causality) {
  const int64_t cut = 150, D = 16, P = 8, T = 260;
  for (const GrapeCase& c : {GrapeCase{{1, 2, 2, T, T, D}, 0, true, true, 0},
                             GrapeCase{{1, 2, 2, T, T, D}, P, false, true, 0},
                             GrapeCase{{1, 2, 2, T, T, D}, P, true, true, 0}}) {
    Inputs in(c, 3);
    const auto base = run_kernel<float>(in, AttentionBackwardScheme::Auto).parts[0];
    std::mt19937_64 rng(9);
    for (int64_t bh = 0; bh < 2; ++bh)
      for (int64_t j = cut + 1; j < T; ++j) {
        for (int64_t e = 0; e < D; ++e) {
          in.k[(bh * T + j) * D + e] += 1.0;
          in.v[(bh * T + j) * D + e] -= 2.0;
        }
        if (c.gates) in.gk[bh * T + j] += 0.5;
        if (c.P)
          for (int64_t p = 0; p < P; ++p) in.pk[(bh * T + j) * P + p] = test::uniform(rng, -3, 3);
      }
    const auto changed = run_kernel<float>(in, AttentionBackwardScheme::Auto).parts[0];
    for (int64_t bh = 0; bh < 2; ++bh)
      for (int64_t i = 0; i <= cut; ++i)
        for (int64_t e = 0; e < D; ++e)
          ASSERT_EQ(changed[(bh * T + i) * D + e], base[(bh * T + i) * D + e])
              << "row " << i << " gates " << c.gates << " P " << c.P;
  }
}

// The decode kernel's path integral (its key chunks shifted by the edges above them at the
// merge) against the last rows of the tiled forward, on 700 keys (several chunks): finite inputs,
// then a NaN, +inf or -inf in one key probe entry near the top, in the middle and near the bottom
// (an edge of -inf hides every key below it; NaN poisons them). Which output entries are NaN must
// agree, and the rest to fp32 rounding; with one thread and with the default threads.
TEST(AttentionGrape, DecodePathIntegralIsTheForwardsLastRows) {
  const int64_t Tk = 700, D = 16, P = 8;
  const double kNaN = std::numeric_limits<double>::quiet_NaN(),
               kInf = std::numeric_limits<double>::infinity();
  // B, Hq, Hk, decode rows: dot-product rows (g Tq <= 4) and transposed lanes (6)
  for (const auto& [B, Hq, Hk, n] :
       std::vector<std::array<int64_t, 4>>{{1, 2, 2, 1}, {1, 2, 1, 2}, {2, 4, 2, 3}}) {
    Inputs full(GrapeCase{{B, Hq, Hk, Tk, Tk, D}, P, false, true, 0}, 21);
    for (int64_t at : {Tk - 3, int64_t{400}, int64_t{70}})
      for (double value : {0.0, kNaN, kInf, -kInf}) {
        Inputs in = full;
        if (value != 0.0)
          for (int64_t b = 0; b < B; ++b)  // head 1, entry 2 of key probe `at`
            in.pk[((b * Hq + 1) * Tk + at) * P + 2] = value;
        // the decode problem: the last n query rows
        Inputs dec = in;
        dec.c.d.Tq = n;
        dec.q.clear();
        dec.pq.clear();
        for (int64_t bh = 0; bh < B * Hq; ++bh) {
          const auto rows = [&](const std::vector<double>& x, int64_t w, std::vector<double>& to) {
            to.insert(to.end(), x.begin() + (bh * Tk + Tk - n) * w, x.begin() + (bh + 1) * Tk * w);
          };
          rows(in.q, D, dec.q);
          rows(in.pq, P, dec.pq);
        }
        dec.dout.assign(dec.q.size(), 0.0);
        const auto forward = [](const Inputs& x) {
          auto q = as<float>(x.q), k = as<float>(x.k), v = as<float>(x.v), pq = as<float>(x.pq),
               pk = as<float>(x.pk), beta = as<float>(x.beta);
          AttentionBias<float> bias;
          bias.path_q = pq.data();
          bias.path_k = pk.data();
          bias.path_beta = beta.data();
          bias.path_dim = x.c.P;
          bias.path_scale = 1.0 / static_cast<double>(x.c.P);
          std::vector<float> out(q.size()), lse(q.size() / static_cast<size_t>(x.c.d.D));
          attention_forward<float>(x.c.d, q.data(), k.data(), v.data(), x.positions(), bias,
                                   options(x), out.data(), lse.data());
          return out;
        };
        const std::vector<float> want = forward(in);
        for (int threads : {1, 0}) {
          const int old = omp_get_max_threads();
          if (threads) omp_set_num_threads(threads);
          const std::vector<float> got = forward(dec);
          omp_set_num_threads(old);
          double err = 0;
          int nans = 0;
          for (int64_t bh = 0; bh < B * Hq; ++bh)
            for (int64_t i = 0; i < n; ++i)
              for (int64_t e = 0; e < D; ++e) {
                const float w = want[((bh * Tk) + Tk - n + i) * D + e],
                            g = got[(bh * n + i) * D + e];
                ASSERT_EQ(std::isnan(w), std::isnan(g))
                    << "B " << B << " Hq " << Hq << " rows " << n << " at " << at << " value "
                    << value << " bh " << bh << " row " << i;
                nans += std::isnan(g);
                if (!std::isnan(g)) err = std::max(err, std::abs(double(w) - double(g)));
              }
          EXPECT_LT(err, 1e-5) << "rows " << n << " at " << at << " value " << value;
          // a NaN probe poisons its head's rows (every row is above key `at`)
          EXPECT_EQ(nans, std::isnan(value) ? B * n * D : 0) << "rows " << n << " at " << at;
        }
      }
  }
}

// Constant key gates m_h and no query gate are the slope form; a path integral whose edge depends
// on l only (P = 1, pq = 1, pk = a_l, beta = 1) is FoX's cq/ck form with c = the inclusive
// cumulative sum of logsigmoid(a_l): values to 1e-12 in float64 (the float64 kernels), and the
// gradients by the chain rule: dL/de_l = sum_{m >= l} (dcq_m + dck_m) (cq = ck = c, Tq = Tk),
// d pk_l = sigmoid(-a_l) dL/de_l, d beta = sum_l logsigmoid(a_l) dL/de_l; the gates' gradient
// summed over the keys is the slope gradient.
TEST(AttentionGrape, SpecialCasesAreTheSlopeAndFoxForms) {
  const int64_t H = 3, T = 300, D = 8;
  const AttentionDims d{1, H, H, T, T, D};
  std::mt19937_64 rng(21);
  const auto q = test::normal_vec(static_cast<size_t>(H * T * D), rng),
             k = test::normal_vec(q.size(), rng), v = test::normal_vec(q.size(), rng),
             dout = test::normal_vec(q.size(), rng);
  const auto a = test::normal_vec(static_cast<size_t>(H * T), rng);
  // out and the gradients (accumulated into g's arrays)
  const auto run = [&](const AttentionBias<double>& bias, const AttentionBiasGrads<double>& g) {
    std::vector<double> out(q.size()), lse(static_cast<size_t>(H * T)), dq(q.size()), dk(q.size()),
        dv(q.size());
    attention_forward<double>(d, q.data(), k.data(), v.data(), {}, bias, {}, out.data(),
                              lse.data());
    attention_backward<double>(d, q.data(), k.data(), v.data(), {}, bias, {}, dout.data(),
                               out.data(), lse.data(), dq.data(), dk.data(), dv.data(), g);
    out.insert(out.end(), dq.begin(), dq.end());
    out.insert(out.end(), dk.begin(), dk.end());
    return out;
  };
  const std::vector<double> m = {0.5, 0.25, 0.125};
  std::vector<double> gk(static_cast<size_t>(H * T)), dgk(gk.size()), dslopes(H);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < T; ++j) gk[h * T + j] = m[h];
  AttentionBias<double> gated, slopes;
  gated.gk = gk.data();
  slopes.slopes = m.data();
  AttentionBiasGrads<double> ggated, gslopes;
  ggated.gk = dgk.data();
  gslopes.slopes = dslopes.data();
  EXPECT_LT(rel(run(gated, ggated), run(slopes, gslopes)), 1e-12);
  std::vector<double> dgk_sum(H);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < T; ++j) dgk_sum[h] += dgk[h * T + j];
  EXPECT_LT(rel(dgk_sum, dslopes), 1e-12);

  std::vector<double> ones(a.size(), 1.0), beta(H, 1.0), c(a.size()), ls(a.size());
  for (int64_t h = 0; h < H; ++h) {
    double run_sum = 0;
    for (int64_t j = 0; j < T; ++j) {
      const double x = a[h * T + j];
      ls[h * T + j] = std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x)));
      run_sum += ls[h * T + j];
      c[h * T + j] = run_sum;
    }
  }
  AttentionBias<double> path, fox;
  path.path_q = ones.data();
  path.path_k = a.data();
  path.path_beta = beta.data();
  path.path_dim = 1;
  fox.cq = fox.ck = c.data();
  std::vector<double> dpq(a.size()), dpk(a.size()), dbeta(H), dcq(a.size()), dck(a.size());
  AttentionBiasGrads<double> gpath, gfox;
  gpath.path_q = dpq.data();
  gpath.path_k = dpk.data();
  gpath.path_beta = dbeta.data();
  gfox.cq = dcq.data();
  gfox.ck = dck.data();
  EXPECT_LT(rel(run(path, gpath), run(fox, gfox)), 1e-12);
  std::vector<double> want_dpk(a.size()), want_dbeta(H);
  for (int64_t h = 0; h < H; ++h) {
    double de = 0;  // dL/de_l = sum_{m >= l} (dcq_m + dck_m)
    for (int64_t l = T - 1; l >= 1; --l) {
      de += dcq[h * T + l] + dck[h * T + l];
      want_dpk[h * T + l] = de / (1.0 + std::exp(a[h * T + l]));
      want_dbeta[h] += de * ls[h * T + l];
    }
  }
  EXPECT_LT(rel(dpk, want_dpk), 1e-10);
  EXPECT_LT(rel(dbeta, want_dbeta), 1e-10);
}

TEST(AttentionGrape, BadArgumentsAreNamed) {
  const AttentionDims d{1, 1, 1, 4, 4, 4};
  std::vector<float> x(16), out(16);
  const auto forward = [&](const AttentionBias<float>& b) {
    attention_forward<float>(d, x.data(), x.data(), x.data(), {}, b, {}, out.data(), nullptr);
  };
  AttentionBias<float> b;
  b.path_q = x.data();  // no path_k / beta
  b.path_dim = 4;
  EXPECT_THROW(forward(b), InputError);
  b.path_k = x.data();
  EXPECT_THROW(forward(b), InputError);  // no beta
  b.path_beta = x.data();
  b.path_dim = 0;
  EXPECT_THROW(forward(b), InputError);
  b.path_dim = 4;
  EXPECT_NO_THROW(forward(b));
  AttentionBias<float> gates;  // either gate alone is fine
  gates.gk = x.data();
  EXPECT_NO_THROW(forward(gates));
  gates.gk = nullptr;
  gates.gq = x.data();
  EXPECT_NO_THROW(forward(gates));
}
