// relpos's LibTorch-free layer from an installed package (find_package(relpos), relpos::kernels):
// parse a spec, build the mechanism, transform queries and keys, run the fused causal attention,
// then decode token by token through the KV cache, all on raw float buffers [B, H, T, D].
//
// Every result is checked against values computed here in float64 from definitions: the query and
// key maps of core/reference.hpp (dense matrices from a matrix exponential, no kernel code), the
// paper's closed-form relative score, ALiBi's slopes 2^(-8 (h + 1) / H) and a plain softmax.
// Exit code 0 when every check passes, 1 otherwise (each check prints its error and tolerance).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "relpos/core/charts.hpp"
#include "relpos/core/reference.hpp"
#include "relpos/core/registry.hpp"
#include "relpos/core/types.hpp"
#include "relpos/kernels/attention/kv_cache.hpp"
#include "relpos/kernels/attention/mechanism_attention.hpp"
#include "relpos/kernels/mechanism_apply.hpp"

namespace {

using relpos::Layout;
namespace kern = relpos::kernels;

int failures = 0;

void check(const char* what, double err, double tol) {
  const bool ok = err <= tol;  // false for NaN too
  std::printf("%-58s %s  (error %.3g, tolerance %.3g)\n", what, ok ? "ok  " : "FAIL", err, tol);
  if (!ok) ++failures;
}

// Index of element (b, h, t, d) of a contiguous [B, H, T, D] buffer.
size_t at(int64_t b, int64_t h, int64_t t, int64_t d, int64_t H, int64_t T, int64_t D) {
  return static_cast<size_t>(((b * H + h) * T + t) * D + d);
}

// Token t of a [B, H, T, D] buffer as [B, H, D] (the KV cache's layout of one token).
std::vector<float> token(const std::vector<float>& x, int64_t B, int64_t H, int64_t T, int64_t D,
                         int64_t t) {
  std::vector<float> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const auto first = x.begin() + static_cast<std::ptrdiff_t>(at(b, h, t, 0, H, T, D));
      out.insert(out.end(), first, first + D);
    }
  return out;
}

// Tokens [t0, t1) of a [B, H, T, D] buffer as [B, H, t1 - t0, D].
std::vector<float> tokens(const std::vector<float>& x, int64_t B, int64_t H, int64_t T, int64_t D,
                          int64_t t0, int64_t t1) {
  std::vector<float> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const auto first = x.begin() + static_cast<std::ptrdiff_t>(at(b, h, t0, 0, H, T, D));
      out.insert(out.end(), first, first + (t1 - t0) * D);
    }
  return out;
}

// max |a - b| / max(1, max |b|)
template <class A>
double max_rel_err(const std::vector<A>& a, const std::vector<double>& b) {
  double num = 0, den = 1;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - b[i]);
    num = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(num, d);
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

}  // namespace

int main() {
  // Grouped-query attention: 4 query heads share 2 key/value heads.
  const std::string spec = "jordan(m=2, regime=raw, eta0=0.05) + alibi";
  constexpr int64_t B = 2, Hq = 4, Hk = 2, T = 11, D = 16, group = Hq / Hk;
  constexpr Layout layout = Layout::Interleaved;
  std::printf("relpos kernels example: %s, D = %lld, %lld query / %lld key heads, kernels: %s\n",
              spec.c_str(), static_cast<long long>(D), static_cast<long long>(Hq),
              static_cast<long long>(Hk), kern::kernel_isa());

  // 1. Errors: every input error is a relpos::InputError (a std::runtime_error) naming the
  //    problem; here an unknown option key.
  try {
    relpos::build_mechanism("jordan(m=2, bogus_key=1)", D, Hq);
    check("a bad spec is refused", 1, 0);
  } catch (const relpos::InputError& e) {
    const bool named = std::string(e.what()).find("bogus_key") != std::string::npos;
    std::printf("  InputError: %s\n", e.what());
    check("a bad spec is refused with a message naming the key", named ? 0 : 1, 0);
  }

  // 2. The mechanism for the query heads (its biases are per query head), its parameters per
  //    key/value head (query head h uses row h / group).
  const relpos::Mechanism m = relpos::build_mechanism(spec, D, Hq);
  const relpos::ParamValues p = relpos::default_params(relpos::build_mechanism(spec, D, Hk));

  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const auto random = [&](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& e : x) e = uni(rng);
    return x;
  };
  const std::vector<float> q = random(B * Hq * T * D), k = random(B * Hk * T * D),
                           v = random(B * Hk * T * D);
  std::vector<double> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<double>(t);

  // 3. Transform: queries get A(p)^{-T}, keys A(p), about the mechanism's centre c.
  const double c = m.resolve_center(pos.front(), pos.back());
  const kern::Positions kpos{pos.data(), false, c};
  const kern::MechanismPlan plan = kern::MechanismPlan::from(m, layout);
  const kern::HeadParams hp = kern::attention_head_params(m, p, Hq, Hk);
  const kern::ParamBuffers<float> qpar(hp.q), kpar(hp.k);
  const auto trig = kern::build_trig_table<float>(plan.position, {B, Hq, T}, kpos);
  std::vector<float> qt(q.size()), kt(k.size());
  kern::mechanism_forward<float>(plan, {B, Hq, T}, kpos, qpar.view(), trig.view(), q.data(),
                                 nullptr, qt.data(), nullptr);
  kern::mechanism_forward<float>(plan, {B, Hk, T}, kpos, kpar.view(), trig.view(), nullptr,
                                 k.data(), nullptr, kt.data());

  // the same maps as dense float64 matrices (core/reference.hpp)
  std::vector<double> qt_ref(q.size()), kt_ref(k.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < Hq; ++h) {
        const Eigen::MatrixXd A =
            relpos::reference::query_map(m, p, static_cast<int>(h / group), pos[t] - c, layout);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j)
            qt_ref[at(b, h, t, i, Hq, T, D)] += A(i, j) * q[at(b, h, t, j, Hq, T, D)];
      }
      for (int64_t g = 0; g < Hk; ++g) {
        const Eigen::MatrixXd A =
            relpos::reference::key_map(m, p, static_cast<int>(g), pos[t] - c, layout);
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j)
            kt_ref[at(b, g, t, i, Hk, T, D)] += A(i, j) * k[at(b, g, t, j, Hk, T, D)];
      }
    }
  check("transformed queries = float64 reference maps", max_rel_err(qt, qt_ref), 1e-5);
  check("transformed keys = float64 reference maps", max_rel_err(kt, kt_ref), 1e-5);

  // The point of a relative encoding: the transformed scores depend on i - j only, and equal the
  // paper's closed form q^T G(i - j) k (no centre, no positions).
  double rel = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < T; ++i)
        for (int64_t j = 0; j < T; ++j) {
          const int64_t g = h / group;
          double s = 0;
          std::vector<double> qi(D), kj(D);
          for (int64_t d = 0; d < D; ++d) {
            s += static_cast<double>(qt[at(b, h, i, d, Hq, T, D)]) * kt[at(b, g, j, d, Hk, T, D)];
            qi[d] = q[at(b, h, i, d, Hq, T, D)];
            kj[d] = k[at(b, g, j, d, Hk, T, D)];
          }
          const double want = relpos::reference::relative_score(
              m, p, static_cast<int>(g), pos[i] - pos[j], qi.data(), kj.data(), layout);
          rel = std::max(rel, std::abs(s - want) / std::max(1.0, std::abs(want)));
        }
  check("scores q~_i . k~_j = closed form q^T G(i - j) k", rel, 1e-4);

  // 4. Fused causal attention with the mechanism's transforms and ALiBi bias.
  std::vector<float> out(q.size()), lse(static_cast<size_t>(B * Hq * T));
  const kern::AttentionPositions apos{pos.data(), pos.data(), false};
  kern::mechanism_attention_forward<float>(m, p, layout, {B, Hq, Hk, T, T, D}, q.data(), k.data(),
                                           v.data(), apos, {}, out.data(), lse.data());

  // plain float64 attention on the reference-transformed q and k: logits scale q~ . k~ -
  // slope_h (i - j) over the keys j <= i, softmax, times v
  std::vector<double> slopes(Hq);
  for (int64_t h = 0; h < Hq; ++h)
    slopes[h] = std::pow(2.0, -8.0 * static_cast<double>(h + 1) / static_cast<double>(Hq));
  const std::vector<double> lib_slopes = relpos::alibi_slopes(static_cast<int>(Hq));
  double slope_err = 0;
  for (int64_t h = 0; h < Hq; ++h)
    slope_err = std::max(slope_err, std::abs(lib_slopes[h] - slopes[h]));
  check("ALiBi slopes = 2^(-8 (h + 1) / H)", slope_err, 1e-15);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> out_ref(q.size()), lse_ref(lse.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t g = h / group;
        std::vector<double> logit(static_cast<size_t>(i + 1));
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d)
            s += qt_ref[at(b, h, i, d, Hq, T, D)] * kt_ref[at(b, g, j, d, Hk, T, D)];
          logit[j] = scale * s - slopes[h] * (pos[i] - pos[j]);
          mx = std::max(mx, logit[j]);
        }
        double z = 0;
        for (double& l : logit) z += (l = std::exp(l - mx));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t d = 0; d < D; ++d)
            out_ref[at(b, h, i, d, Hq, T, D)] += logit[j] / z * v[at(b, g, j, d, Hk, T, D)];
        lse_ref[static_cast<size_t>((b * Hq + h) * T + i)] = mx + std::log(z);
      }
  check("fused attention output = plain float64 softmax attention", max_rel_err(out, out_ref),
        1e-5);
  check("fused attention log-sum-exp = plain float64", max_rel_err(lse, lse_ref), 1e-5);

  // 5. Decoding: prefill the first tokens as one block, then one token per step; each step's
  //    query scores against every cached key and gives that token's row of the full attention.
  //    Chunks of 4 tokens: the cache re-centres its keys per chunk
  //    (kernels/attention/kv_cache.hpp).
  kern::KvCacheOptions copt;
  copt.layout = layout;
  copt.chunk = 4;
  kern::KvCache<float> cache(m, p, B, Hq, Hk, D, copt);
  constexpr int64_t prefill = 6;
  cache.append(tokens(k, B, Hk, T, D, 0, prefill), tokens(v, B, Hk, T, D, 0, prefill),
               std::span<const double>(pos.data(), prefill));
  double dec = 0;
  std::vector<float> step_out(static_cast<size_t>(B * Hq * D));
  for (int64_t t = prefill; t < T; ++t) {
    cache.append(token(k, B, Hk, T, D, t), token(v, B, Hk, T, D, t), pos[t]);
    cache.decode(token(q, B, Hq, T, D, t), pos[t], step_out);
    std::vector<double> want;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t d = 0; d < D; ++d) want.push_back(out_ref[at(b, h, t, d, Hq, T, D)]);
    dec = std::max(dec, max_rel_err(step_out, want));
  }
  std::printf("  KV cache: %lld tokens in %lld chunks after %lld decode steps\n",
              static_cast<long long>(cache.size()), static_cast<long long>(cache.chunks()),
              static_cast<long long>(T - prefill));
  check("decode steps = rows of the plain float64 attention", dec, 1e-5);
  check("KV cache holds every token", static_cast<double>(std::abs(cache.size() - T)), 0);

  // a cache with a head count that does not divide the query heads is refused
  try {
    kern::KvCache<float> bad(m, p, B, Hq, 3, D, copt);
    check("a bad KV cache shape is refused", 1, 0);
  } catch (const relpos::InputError& e) {
    std::printf("  InputError: %s\n", e.what());
    check("a bad KV cache shape is refused", 0, 0);
  }

  std::printf(failures ? "FAILED: %d check(s)\n" : "all checks passed\n", failures);
  return failures ? 1 : 0;
}
