// Public wrappers of the attention kernels (argument checks, ISA dispatch) and the float64
// references.
#include "kernels/attention/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/types.hpp"
#include "kernels/isa.hpp"

namespace relpos::kernels {

// Declarations of the per-ISA builds (attention_isa.inc).
#define RELPOS_DECLARE_ISA(NS)                                                                   \
  namespace NS {                                                                                 \
  template <class T>                                                                             \
  void attention_forward(const AttentionDims&, const T*, const T*, const T*,                     \
                         const AttentionPositions&, const AttentionBias<T>&,                     \
                         const AttentionOptions&, T*, T*);                                       \
  void attention_forward_half(const AttentionDims&, HalfType, const uint16_t*, const uint16_t*,  \
                              const uint16_t*, const AttentionPositions&,                        \
                              const AttentionBias<float>&, const AttentionOptions&, uint16_t*,   \
                              float*);                                                           \
  void attention_backward_half(const AttentionDims&, HalfType, const uint16_t*, const uint16_t*, \
                               const uint16_t*, const AttentionPositions&,                       \
                               const AttentionBias<float>&, const AttentionOptions&,             \
                               const uint16_t*, const uint16_t*, const float*, uint16_t*,        \
                               uint16_t*, uint16_t*, const AttentionBiasGrads<float>&,           \
                               const float*);                                                    \
  template <class T>                                                                             \
  void attention_backward(const AttentionDims&, const T*, const T*, const T*,                    \
                          const AttentionPositions&, const AttentionBias<T>&,                    \
                          const AttentionOptions&, const T*, const T*, const T*, T*, T*, T*,     \
                          const AttentionBiasGrads<T>&, const T*);                               \
  }
RELPOS_ISA_FOR_EACH(RELPOS_DECLARE_ISA)
#undef RELPOS_DECLARE_ISA

namespace {

template <class T>
void check(const AttentionDims& d, const AttentionBias<T>& bias, const AttentionOptions& o) {
  if (d.B < 1 || d.Hq < 1 || d.Hk < 1 || d.Tq < 1 || d.Tk < 1 || d.D < 1)
    throw InputError("attention: every dimension must be positive");
  if (d.k_rows != 0 && d.k_rows < d.Tk)
    throw InputError("attention: k_rows (rows per key/value head) must be 0 or >= Tk");
  if (bias.key_rows != 0 && bias.key_rows < d.Tk)
    throw InputError("attention: key_rows (rows per head of ck, gk, path_k) must be 0 or >= Tk");
  if (d.Hq % d.Hk)
    throw InputError("attention: key/value heads (" + std::to_string(d.Hk) +
                     ") must divide query heads (" + std::to_string(d.Hq) + ")");
  const int64_t lag_len = bias.lag_len, max_lag_len = (int64_t{1} << 31) - 1;
  if (bias.lag_table && (lag_len < 1 || lag_len > max_lag_len))
    throw InputError("attention: a lag table needs 1 <= lag_len < 2^31");
  if (static_cast<bool>(bias.cq) != static_cast<bool>(bias.ck))
    throw InputError("attention: per-token biases need both cq and ck");
  if (bias.path_q && (!bias.path_k || !bias.path_beta || bias.path_dim < 1))
    throw InputError(
        "attention: a path integral needs path_q, path_k, path_beta and path_dim >= 1");
  if (bias.path_q && !std::isfinite(bias.path_scale))
    throw InputError("attention: path_scale must be finite");
  if (static_cast<bool>(o.q_segments) != static_cast<bool>(o.k_segments))
    throw InputError("attention: segment ids need both q_segments and k_segments");
  if (!(o.window >= 0)) throw InputError("attention: window must be >= 0");
  if (!(o.scale >= 0)) throw InputError("attention: scale must be >= 0 (0: 1/sqrt(D))");
}

// logsigmoid(z) = min(z, 0) - log1p(e^{-|z|}), without overflow
double log_sigmoid(double z) {
  return std::min(z, 0.0) - std::log1p(std::exp(-std::abs(z)));
}

// The path integral's edge argument z(i, l) = path_scale pq[b,h,i] . pk[b,h,l].
double path_z(const AttentionDims& d, const AttentionBias<double>& bias, int64_t b, int64_t h,
              int64_t i, int64_t l) {
  const int64_t P = bias.path_dim;
  const double* a = bias.path_q + ((b * d.Hq + h) * d.Tq + i) * P;
  const double* c = bias.path_k + (bias.key_row(d, b, h) + l) * P;
  double z = 0;
  for (int64_t p = 0; p < P; ++p) z += a[p] * c[p];
  return bias.path_scale * z;
}

// Query row i's key slot (edges of the path integral run up to it).
int64_t path_slot(const AttentionDims& d, int64_t i) {
  return d.Tk - d.Tq + i;
}

// Row r's logits against every key (-inf where not visible); returns whether any is visible.
bool reference_logits(const AttentionDims& d, const double* q, const double* k,
                      const AttentionPositions& pos, const AttentionBias<double>& bias,
                      const AttentionOptions& o, int64_t b, int64_t h, int64_t i,
                      std::vector<double>& s) {
  const int64_t hk = h / (d.Hq / d.Hk);
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(d.D));
  const int64_t kl = o.key_len ? std::clamp<int64_t>(o.key_len[b], 0, d.Tk) : d.Tk;
  const double* qi = q + ((b * d.Hq + h) * d.Tq + i) * d.D;
  const double pq = pos.query(b, i, d.Tq, d.Tk);
  bool any = false;
  s.assign(static_cast<size_t>(d.Tk), -std::numeric_limits<double>::infinity());
  // the path integral of every key: suffix[j] = sum_{l=j+1..slot(i)} beta logsigmoid(z(i, l))
  std::vector<double> suffix;
  if (bias.path_q) {
    suffix.assign(static_cast<size_t>(d.Tk), 0.0);
    const int64_t top = std::min(path_slot(d, i), d.Tk - 1);
    double run = 0;
    for (int64_t j = d.Tk - 1; j >= 0; --j) {
      suffix[j] = run;
      if (j >= 1 && j <= top) run += bias.path_beta[h] * log_sigmoid(path_z(d, bias, b, h, i, j));
    }
  }
  const int64_t ks = o.key_start ? std::clamp<int64_t>(o.key_start[b], 0, d.Tk) : 0;
  for (int64_t j = ks; j < kl; ++j) {
    if (o.q_segments && o.q_segments[b * d.Tq + i] != o.k_segments[b * d.Tk + j]) continue;
    const double pk = pos.key(b, j, d.Tk);
    if (o.causal && !(pk <= pq)) continue;
    if (o.causal && o.exclude_self && !(pk < pq)) continue;
    if (o.window > 0 && !(pq - pk < o.window)) continue;
    const double* kj = k + ((b * d.Hk + hk) * d.Tk + j) * d.D;
    double x = 0;
    for (int64_t e = 0; e < d.D; ++e) x += qi[e] * kj[e];
    x *= scale;
    if (bias.lag_table)
      x += bias.lag_table[h * bias.lag_len + attention_lag_index(pq - pk, bias.lag_len)];
    if (bias.slopes) x -= bias.slopes[h] * (pq - pk);
    if (bias.cq) x += bias.cq[(b * d.Hq + h) * d.Tq + i] - bias.ck[bias.key_row(d, b, h) + j];
    const double gate = (bias.gq ? bias.gq[(b * d.Hq + h) * d.Tq + i] : 0.0) +
                        (bias.gk ? bias.gk[bias.key_row(d, b, h) + j] : 0.0);
    x -= (pq - pk) * gate;
    if (bias.path_q) x += suffix[j];
    s[j] = x;
    any = true;
  }
  return any;
}

}  // namespace

template <class T>
void attention_forward(const AttentionDims& dims, const T* q, const T* k, const T* v,
                       const AttentionPositions& pos, const AttentionBias<T>& bias,
                       const AttentionOptions& options, T* out, T* lse) {
  check(dims, bias, options);
  RELPOS_ISA_DISPATCH(attention_forward<T>, dims, q, k, v, pos, bias, options, out, lse);
}

void attention_forward_half(const AttentionDims& dims, HalfType type, const uint16_t* q,
                            const uint16_t* k, const uint16_t* v, const AttentionPositions& pos,
                            const AttentionBias<float>& bias, const AttentionOptions& options,
                            uint16_t* out, float* lse) {
  check(dims, bias, options);
  RELPOS_ISA_DISPATCH(attention_forward_half, dims, type, q, k, v, pos, bias, options, out, lse);
}

template <class T>
void check_backward(const AttentionDims& dims, const AttentionBias<T>& bias,
                    const AttentionOptions& options, const void* dout, const void* out,
                    const void* lse, const AttentionBiasGrads<T>& grads) {
  check(dims, bias, options);
  if (!dout || !out || !lse) throw InputError("attention backward needs dout, out and lse");
  if (dims.key_rows() != dims.Tk)
    throw InputError("attention backward: keys and values must be contiguous (k_rows 0 or Tk)");
  if (grads.lag_table && !bias.lag_table)
    throw InputError("attention: a lag table gradient needs the lag table");
  if (grads.slopes && !bias.slopes) throw InputError("attention: a slope gradient needs slopes");
  if ((grads.cq || grads.ck) && !bias.cq)
    throw InputError("attention: per-token gradients need the per-token biases");
  if ((grads.gq && !bias.gq) || (grads.gk && !bias.gk))
    throw InputError("attention: a gate gradient needs its gates");
  if ((grads.path_q || grads.path_k || grads.path_beta) && !bias.path_q)
    throw InputError("attention: probe gradients need the path integral");
}

template <class T>
void attention_backward(const AttentionDims& dims, const T* q, const T* k, const T* v,
                        const AttentionPositions& pos, const AttentionBias<T>& bias,
                        const AttentionOptions& options, const T* dout, const T* out, const T* lse,
                        T* dq, T* dk, T* dv, const AttentionBiasGrads<T>& grads, const T* dlse) {
  check_backward(dims, bias, options, dout, out, lse, grads);
  RELPOS_ISA_DISPATCH(attention_backward<T>, dims, q, k, v, pos, bias, options, dout, out, lse, dq,
                      dk, dv, grads, dlse);
}

void attention_backward_half(const AttentionDims& dims, HalfType type, const uint16_t* q,
                             const uint16_t* k, const uint16_t* v, const AttentionPositions& pos,
                             const AttentionBias<float>& bias, const AttentionOptions& options,
                             const uint16_t* dout, const uint16_t* out, const float* lse,
                             uint16_t* dq, uint16_t* dk, uint16_t* dv,
                             const AttentionBiasGrads<float>& grads, const float* dlse) {
  check_backward(dims, bias, options, dout, out, lse, grads);
  RELPOS_ISA_DISPATCH(attention_backward_half, dims, type, q, k, v, pos, bias, options, dout, out,
                      lse, dq, dk, dv, grads, dlse);
}

#define RELPOS_INSTANTIATE(T)                                                                    \
  template void attention_forward<T>(const AttentionDims&, const T*, const T*, const T*,         \
                                     const AttentionPositions&, const AttentionBias<T>&,         \
                                     const AttentionOptions&, T*, T*);                           \
  template void attention_backward<T>(const AttentionDims&, const T*, const T*, const T*,        \
                                      const AttentionPositions&, const AttentionBias<T>&,        \
                                      const AttentionOptions&, const T*, const T*, const T*, T*, \
                                      T*, T*, const AttentionBiasGrads<T>&, const T*);
RELPOS_INSTANTIATE(float)
RELPOS_INSTANTIATE(double)
#undef RELPOS_INSTANTIATE

void attention_reference(const AttentionDims& d, const double* q, const double* k, const double* v,
                         const AttentionPositions& pos, const AttentionBias<double>& bias,
                         const AttentionOptions& o, double* out, double* lse) {
  check(d, bias, o);
  std::vector<double> s;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Tq; ++i) {
        const int64_t row = (b * d.Hq + h) * d.Tq + i, hk = h / (d.Hq / d.Hk);
        double* oi = out + row * d.D;
        std::fill(oi, oi + d.D, 0.0);
        if (!reference_logits(d, q, k, pos, bias, o, b, h, i, s)) {
          if (lse) lse[row] = -std::numeric_limits<double>::infinity();
          continue;
        }
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - m));
        for (int64_t j = 0; j < d.Tk; ++j) {
          const double* vj = v + ((b * d.Hk + hk) * d.Tk + j) * d.D;
          for (int64_t e = 0; e < d.D; ++e) oi[e] += s[j] / sum * vj[e];
        }
        if (lse) lse[row] = m + std::log(sum);
      }
}

void attention_reference_backward(const AttentionDims& d, const double* q, const double* k,
                                  const double* v, const AttentionPositions& pos,
                                  const AttentionBias<double>& bias, const AttentionOptions& o,
                                  const double* dout, double* dq, double* dk, double* dv,
                                  const AttentionBiasGrads<double>& g) {
  check(d, bias, o);
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(d.D));
  const size_t nq = static_cast<size_t>(d.B * d.Hq * d.Tq * d.D);
  const size_t nk = static_cast<size_t>(d.B * d.Hk * d.Tk * d.D);
  if (dq) std::fill(dq, dq + nq, 0.0);
  if (dk) std::fill(dk, dk + nk, 0.0);
  if (dv) std::fill(dv, dv + nk, 0.0);
  std::vector<double> s, dp;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h)
      for (int64_t i = 0; i < d.Tq; ++i) {
        if (!reference_logits(d, q, k, pos, bias, o, b, h, i, s)) continue;
        const int64_t row = (b * d.Hq + h) * d.Tq + i, hk = h / (d.Hq / d.Hk);
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (auto& x : s) sum += (x = std::exp(x - m));
        for (auto& x : s) x /= sum;  // probabilities p_j
        // dL/dlogit_j = p_j (dp_j - sum_l p_l dp_l), dp_j = dout_i . v_j (softmax Jacobian)
        dp.assign(static_cast<size_t>(d.Tk), 0.0);
        double mean = 0;
        const double* go = dout + row * d.D;
        for (int64_t j = 0; j < d.Tk; ++j) {
          const double* vj = v + ((b * d.Hk + hk) * d.Tk + j) * d.D;
          for (int64_t e = 0; e < d.D; ++e) dp[j] += go[e] * vj[e];
          mean += s[j] * dp[j];
        }
        const double pq = pos.query(b, i, d.Tq, d.Tk);
        if (bias.path_q) {
          // d e(i, l) = sum_{j<l} dS_ij, straight from the sums; then through logsigmoid and z
          const int64_t P = bias.path_dim, top = std::min(path_slot(d, i), d.Tk - 1);
          double below = 0;  // sum_{j<l} dS_ij
          for (int64_t l = 0; l <= top; ++l) {
            if (l >= 1) {
              const double z = path_z(d, bias, b, h, i, l), de = below;
              if (g.path_beta) g.path_beta[h] += de * log_sigmoid(z);
              const double dz = de * bias.path_beta[h] / (1.0 + std::exp(z)) * bias.path_scale;
              const double* a = bias.path_q + row * P;
              const double* c = bias.path_k + (bias.key_row(d, b, h) + l) * P;
              for (int64_t p = 0; p < P; ++p) {
                if (g.path_q) g.path_q[row * P + p] += dz * c[p];
                if (g.path_k) g.path_k[((b * d.Hq + h) * d.Tk + l) * P + p] += dz * a[p];
              }
            }
            below += s[l] * (dp[l] - mean);
          }
        }
        for (int64_t j = 0; j < d.Tk; ++j) {
          if (s[j] == 0) continue;
          const double ds = s[j] * (dp[j] - mean);
          const int64_t kr = ((b * d.Hk + hk) * d.Tk + j) * d.D;
          for (int64_t e = 0; e < d.D; ++e) {
            if (dq) dq[row * d.D + e] += scale * ds * k[kr + e];
            if (dk) dk[kr + e] += scale * ds * q[row * d.D + e];
            if (dv) dv[kr + e] += s[j] * go[e];
          }
          const double lag = pq - pos.key(b, j, d.Tk);
          if (g.lag_table)
            g.lag_table[h * bias.lag_len + attention_lag_index(lag, bias.lag_len)] += ds;
          if (g.slopes) g.slopes[h] -= ds * lag;
          if (g.cq) g.cq[row] += ds;
          if (g.ck) g.ck[(b * d.Hq + h) * d.Tk + j] -= ds;
          if (g.gq) g.gq[row] -= ds * lag;
          if (g.gk) g.gk[(b * d.Hq + h) * d.Tk + j] -= ds * lag;
        }
      }
}

}  // namespace relpos::kernels
