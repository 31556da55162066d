// GRAPE's biases in the fused attention kernel (issue 14): gated slopes -(p_i - p_j)(gq_i + gk_j)
// and path integrals sum_{l=j+1..slot(i)} beta_h logsigmoid(s pq_i . pk_l). The float64 reference
// (materialised per row, straight from the definitions) is checked against central differences;
// the fp32 and fp64 kernels against the reference, values and every gradient, in each backward
// scheme, on shapes with grouped queries, decode-like Tq < Tk, windows and ragged tiles;
// causality; and the special cases: constant key gates are the slope form, a query-independent
// potential is FoX's cq/ck form.
#include <gtest/gtest.h>

#include <cmath>
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
};

// Inputs of one case, float64; every bias optional as the case says.
struct Inputs {
  GrapeCase c;
  std::vector<double> q, k, v, dout, gq, gk, pq, pk, beta;

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
  AttentionOptions o;
  o.causal = in.c.causal;
  o.window = in.c.window;
  o.backward = scheme;
  std::vector<T> out(q.size()), lse(static_cast<size_t>(d.B * d.Hq * d.Tq));
  attention_forward<T>(d, q.data(), k.data(), v.data(), {}, bias, o, out.data(), lse.data());
  std::vector<T> dq(q.size()), dk(k.size()), dv(v.size()), dgq(gq.size()), dgk(gk.size()),
      dpq(pq.size()), dpk(pk.size()), dbeta(beta.size());
  AttentionBiasGrads<T> g;
  g.gq = ptr_or_null(dgq);
  g.gk = ptr_or_null(dgk);
  g.path_q = ptr_or_null(dpq);
  g.path_k = ptr_or_null(dpk);
  g.path_beta = ptr_or_null(dbeta);
  attention_backward<T>(d, q.data(), k.data(), v.data(), {}, bias, o, dout.data(), out.data(),
                        lse.data(), dq.data(), dk.data(), dv.data(), g);
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

AttentionOptions options(const GrapeCase& c) {
  AttentionOptions o;
  o.causal = c.causal;
  o.window = c.window;
  return o;
}

Result run_reference(Inputs& in) {
  const auto& d = in.c.d;
  const auto bias = reference_bias(in);
  const auto o = options(in.c);
  std::vector<double> out(in.q.size());
  attention_reference(d, in.q.data(), in.k.data(), in.v.data(), {}, bias, o, out.data(), nullptr);
  std::vector<double> dq(in.q.size()), dk(in.k.size()), dv(in.v.size()), dgq(in.gq.size()),
      dgk(in.gk.size()), dpq(in.pq.size()), dpk(in.pk.size()), dbeta(in.beta.size());
  AttentionBiasGrads<double> g;
  g.gq = ptr_or_null(dgq);
  g.gk = ptr_or_null(dgk);
  g.path_q = ptr_or_null(dpq);
  g.path_k = ptr_or_null(dpk);
  g.path_beta = ptr_or_null(dbeta);
  attention_reference_backward(d, in.q.data(), in.k.data(), in.v.data(), {}, bias, o,
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
  };
}

}  // namespace

// The float64 reference's gradients of the gates, probes and beta against central differences of
// its own forward (L = sum out * dout): the reference the kernels are judged by is right.
TEST(AttentionGrape, ReferenceGradientsMatchFiniteDifferences) {
  GrapeCase c{{1, 2, 1, 9, 13, 4}, 4, true, true, 0};
  Inputs in(c, 5);
  const Result r = run_reference(in);
  const auto loss = [&] {
    std::vector<double> out(in.q.size());
    attention_reference(c.d, in.q.data(), in.k.data(), in.v.data(), {}, reference_bias(in),
                        options(c), out.data(), nullptr);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += out[i] * in.dout[i];
    return s;
  };
  std::vector<std::pair<std::vector<double>*, int>> params = {
      {&in.gq, 4}, {&in.gk, 5}, {&in.pq, 6}, {&in.pk, 7}, {&in.beta, 8}};
  for (auto& [x, part] : params)
    for (size_t i = 0; i < x->size(); i += 3) {
      const double h = 1e-6, x0 = (*x)[i];
      (*x)[i] = x0 + h;
      const double up = loss();
      (*x)[i] = x0 - h;
      const double dn = loss();
      (*x)[i] = x0;
      const double fd = (up - dn) / (2 * h);
      EXPECT_NEAR(r.parts[part][i], fd, 1e-6 * std::max(1.0, std::abs(fd)))
          << kPart[part] << "[" << i << "]";
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
        // beta's gradient sums T x (window or T/2) edge terms per head: its fp32 rounding grows
        // with their number (absolute error ~5e-4 on values of 10..900 here; fp64 agrees to 1e-10)
        EXPECT_LT(rel(f32.parts[p], ref.parts[p]), p == 8 ? 5e-5 : 1e-5);
        EXPECT_LT(rel(f64.parts[p], ref.parts[p]), 1e-10);
      }
    }
  }
}

// Changing the keys, values, key gates and key probes after slot i leaves out rows <= i
// unchanged, bit for bit (fp32 kernel).
TEST(AttentionGrape, Causality) {
  GrapeCase c{{1, 2, 2, 260, 260, 16}, 8, true, true, 0};
  Inputs in(c, 3);
  const auto base = run_kernel<float>(in, AttentionBackwardScheme::Auto).parts[0];
  const int64_t cut = 150, D = 16, P = 8, T = 260;
  std::mt19937_64 rng(9);
  for (int64_t bh = 0; bh < 2; ++bh)
    for (int64_t j = cut + 1; j < T; ++j) {
      for (int64_t e = 0; e < D; ++e) {
        in.k[(bh * T + j) * D + e] += 1.0;
        in.v[(bh * T + j) * D + e] -= 2.0;
      }
      in.gk[bh * T + j] += 0.5;
      for (int64_t p = 0; p < P; ++p) in.pk[(bh * T + j) * P + p] = test::uniform(rng, -3, 3);
    }
  const auto changed = run_kernel<float>(in, AttentionBackwardScheme::Auto).parts[0];
  for (int64_t bh = 0; bh < 2; ++bh)
    for (int64_t i = 0; i <= cut; ++i)
      for (int64_t e = 0; e < D; ++e)
        ASSERT_EQ(changed[(bh * T + i) * D + e], base[(bh * T + i) * D + e]) << "row " << i;
}

// Constant key gates m_h and no query gate are the slope form; a path integral whose edge depends
// on l only (P = 1, pq = 1, pk = a_l, beta = 1) is FoX's cq/ck form with c = the inclusive
// cumulative sum of logsigmoid(a_l); both to 1e-12 in float64.
TEST(AttentionGrape, SpecialCasesAreTheSlopeAndFoxForms) {
  const AttentionDims d{1, 3, 3, 150, 150, 8};
  std::mt19937_64 rng(21);
  const auto q = test::normal_vec(static_cast<size_t>(3 * 150 * 8), rng),
             k = test::normal_vec(q.size(), rng), v = test::normal_vec(q.size(), rng);
  const auto a = test::normal_vec(static_cast<size_t>(3 * 150), rng);
  const auto run = [&](const AttentionBias<double>& bias) {
    std::vector<double> out(q.size());
    attention_forward<double>(d, q.data(), k.data(), v.data(), {}, bias, {}, out.data(), nullptr);
    return out;
  };
  const std::vector<double> m = {0.5, 0.25, 0.125};
  std::vector<double> gk(static_cast<size_t>(3 * 150));
  for (int64_t h = 0; h < 3; ++h)
    for (int64_t j = 0; j < 150; ++j) gk[h * 150 + j] = m[h];
  AttentionBias<double> gated, slopes;
  gated.gk = gk.data();
  slopes.slopes = m.data();
  EXPECT_LT(rel(run(gated), run(slopes)), 1e-12);

  std::vector<double> ones(a.size(), 1.0), beta(3, 1.0), c(a.size());
  for (int64_t h = 0; h < 3; ++h) {
    double run_sum = 0;
    for (int64_t j = 0; j < 150; ++j) {
      const double x = a[h * 150 + j];
      run_sum += std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x)));
      c[h * 150 + j] = run_sum;
    }
  }
  AttentionBias<double> path, fox;
  path.path_q = ones.data();
  path.path_k = a.data();
  path.path_beta = beta.data();
  path.path_dim = 1;
  fox.cq = fox.ck = c.data();
  EXPECT_LT(rel(run(path), run(fox)), 1e-12);
}

TEST(AttentionGrape, BadArgumentsAreNamed) {
  const AttentionDims d{1, 1, 1, 4, 4, 4};
  std::vector<float> x(16), out(16);
  AttentionBias<float> b;
  b.path_q = x.data();  // no path_k / beta
  b.path_dim = 4;
  EXPECT_THROW(
      attention_forward<float>(d, x.data(), x.data(), x.data(), {}, b, {}, out.data(), nullptr),
      InputError);
  b.path_k = b.path_beta = x.data();
  const std::vector<double> pos = {0, 1, 2, 3};
  AttentionPositions p;
  p.q = p.k = pos.data();
  EXPECT_THROW(
      attention_forward<float>(d, x.data(), x.data(), x.data(), p, b, {}, out.data(), nullptr),
      InputError);  // the path integral runs on the default positions
}
