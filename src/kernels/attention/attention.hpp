// Fused softmax attention on the CPU, forward and backward, with the additive logit biases of
// DESIGN.md section 1 (B) computed inside the kernel (never a T x T tensor). The FlashAttention-2
// scheme: the forward walks key tiles with an online softmax and keeps per-row log-sum-exp; the
// backward recomputes the probabilities from it. No LibTorch: an inference engine can take this
// file alone.
//
// Layout: q, out, dout, dq [B, Hq, Tq, D]; k, v, dk, dv [B, Hk, Tk, D] (contiguous, or v, out
// and dout strided rows: RowStrides); lse [B, Hq, Tq]. Grouped-query attention: Hk divides Hq,
// query head h reads key/value head h / (Hq / Hk). float (fp32 accumulation) and double (for tests)
// instantiations; AVX2 and AVX-512 builds chosen at run time (kernels/isa.hpp); OpenMP threads over
// batch x heads x tiles.
//
// Visibility, on the position ids (float64): key j is visible to query i iff
//   key_start[b] <= j < key_len[b]          (key padding, left and right; all keys when null)
//   and seg_k[b, j] == seg_q[b, i]          (packed sequences: segment ids, when given)
//   and p_k[j] <= p_q[i]                    (causal only; p_k[j] < p_q[i] with exclude_self)
//   and p_q[i] - p_k[j] < window            (window > 0 only; also applies when non-causal)
// logit(i, j) = scale * q_i . k_j + bias(i, j). A query row with no visible key gets a zero
// output, lse = -inf, and zero gradients (never NaN).
//
// Non-finite values (docs/errors.md): a NaN logit of a visible pair (NaN in q_i, k_j or a bias,
// 0 * Inf) makes row i's output and lse NaN; +Inf logits give NaN too (Inf - Inf), and a -Inf
// logit weighs 0 as in softmax. Non-finite values of v reach exactly the rows that see them.
// Masked pairs (causality, window, key_len) are selected out, never multiplied by 0: a
// non-finite value that no row sees changes no output bit, forward or backward.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/half.hpp"

namespace relpos::kernels {

// Where an operand's rows lie: row (b, h, t) (D values, contiguous) starts b * batch + h * head
// + t * token values from its pointer. All zero: the contiguous [B, H, T, D] layout. A
// token-major [B, T, H, D] tensor seen as [B, H, T, D] has batch T H D, head D, token H D: the
// layout in which a layer's fused projection hands over v and takes the output back and in
// which its backward stacks the gradients, read and written in place instead of copied.
struct RowStrides {
  int64_t batch = 0, head = 0, token = 0;
  bool contiguous() const { return batch == 0 && head == 0 && token == 0; }
};

struct AttentionDims {
  int64_t B = 1, Hq = 1, Hk = 1, Tq = 1, Tk = 1, D = 1;
  // Rows from one key/value head's first row to the next's in k and v (>= Tk): a decode cache's
  // capacity, so that its used prefix is read in place; 0 means Tk (contiguous). Forward only.
  int64_t k_rows = 0;
  int64_t key_rows() const { return k_rows > 0 ? k_rows : Tk; }
  // Layouts other than contiguous (k_rows) for v, for out (written by the forward, read by the
  // backward), the backward's dout and its dv; q, k, lse, dq and dk are contiguous.
  RowStrides v_strides = {}, out_strides = {}, dout_strides = {}, dv_strides = {};
};

// Position ids, float64 (integers, offsets, gaps or real values; not necessarily sorted).
// q: [Tq] (or [B, Tq] when per_batch); null means Tk - Tq + i (queries are the last Tq
// positions of the key range: the decode convention). k: [Tk] (or [B, Tk]); null means j.
struct AttentionPositions {
  const double* q = nullptr;
  const double* k = nullptr;
  bool per_batch = false;
  double query(int64_t b, int64_t i, int64_t Tq, int64_t Tk) const {
    return q ? q[per_batch ? b * Tq + i : i] : static_cast<double>(Tk - Tq + i);
  }
  double key(int64_t b, int64_t j, int64_t Tk) const {
    return k ? k[per_batch ? b * Tk + j : j] : static_cast<double>(j);
  }
};

// How attention_backward walks the tile pairs; every scheme gives the same gradients up to
// rounding (a choice for tests and benchmarks; Auto is right otherwise).
enum class AttentionBackwardScheme {
  Auto,     // PerHead unless its whole (batch, key/value head) tasks leave threads idle for
            // more than its 5 products against TwoPass's 7 save (e.g. 1 task on 2 threads)
  PerHead,  // one task per (batch, key/value head): every key tile against every query tile of
            // its query heads, dq accumulated in place: 5 tile products and one exp per pair
  TwoPass,  // a pass over query tiles (dq) and one over key tiles (dk, dv), parallel over
            // tiles: 7 tile products and two exps per pair, for few heads per thread
};

struct AttentionOptions {
  bool causal = true;
  double window = 0.0;               // > 0: sliding window (see above); 0: none
  const int64_t* key_len = nullptr;  // [B] valid keys per batch (clamped to [0, Tk]); null: Tk
  double scale = 0.0;                // softmax scale; 0 means 1 / sqrt(D)
  AttentionBackwardScheme backward = AttentionBackwardScheme::Auto;
  bool exclude_self = false;           // causal only: p_k < p_q (no query sees its own position)
  const int64_t* key_start = nullptr;  // [B] first valid key per batch (left padding); null: 0
  // packed sequences: segment (document) ids, q_segments [B, Tq] and k_segments [B, Tk], both
  // or neither; a key is visible only to the queries of its segment
  const int64_t* q_segments = nullptr;
  const int64_t* k_segments = nullptr;
};

// Additive logit biases; every part optional (null), all of them summed:
//   lag table   + lag_table[h][idx(p_q[i] - p_k[j])], table [Hq, lag_len] (ALiBi, learned lag
//               kernels). idx = attention_lag_index: the lag rounded to the nearest integer
//               and clamped to [0, lag_len - 1]: lags beyond the table use its last entry, and
//               negative lags (non-causal attention) its first.
//   slopes      - slopes[h] * (p_q[i] - p_k[j]), [Hq], on the real positions (ALiBi slope form).
//   per-token   + cq[b, h, i] - ck[b, h, j], [B, Hq, Tq] and [B, Hq, Tk] (FoX forget gates as
//               cumulative log-sums, GRAPE-A gates; FoX passes the same cumulative sums twice).
//               float64 in both instantiations, and the kernel subtracts in float64 before
//               rounding to T: a cumulative sum that grows to 1e5 keeps |c_i - c_j| exact to
//               float64 rounding, where fp32 inputs alone would already lose ~1e-2 of it.
//   gated slopes - (p_q[i] - p_k[j]) (gq[b, h, i] + gk[b, h, j]), [B, Hq, Tq] and [B, Hq, Tk],
//               either may be null (GRAPE-A: softplus gates times the head's slope, multiplied
//               in by the caller; ALiBi is gk = slope_h, gq null). The i * gk_j cross term is
//               why this is not a cq/ck pair.
//   path integral + sum_{l=j+1..slot(i)} beta[h] logsigmoid(path_scale pq[b,h,i] . pk[b,h,l])
//               (GRAPE-AP: endpoint-dependent edge potentials summed along the path from key j
//               to the query), probes pq [B, Hq, Tq, path_dim], pk [B, Hq, Tk, path_dim], beta
//               [Hq]. Edges live on key slots l = 0..Tk-1 and query i sits at slot
//               Tk - Tq + i (the decode convention), whatever the positions (the positions
//               still decide visibility and the other biases; key padding hides keys, not
//               edges). The empty sum (j >= slot(i)) is 0. The forward walks key
//               tiles from the diagonal toward the past carrying a per-row running suffix sum
//               (float64); the backward takes the edge gradients sum_{j<l} dS_ij from per-row
//               running sums of dS on the same walk (always the PerHead scheme: its per-row
//               carries are O(T) per task; memory stays linear in T).
// All per-head arrays are indexed by the query head.
template <class T>
struct AttentionBias {
  const T* lag_table = nullptr;
  int64_t lag_len = 0;
  const T* slopes = nullptr;
  const double* cq = nullptr;
  const double* ck = nullptr;
  const T* gq = nullptr;
  const T* gk = nullptr;
  const T* path_q = nullptr;
  const T* path_k = nullptr;
  const T* path_beta = nullptr;
  int64_t path_dim = 0;
  double path_scale = 1.0;
  // Rows from one (batch, query head)'s first key to the next's in ck, gk and path_k (>= Tk;
  // 0: Tk), so that a decode cache's per-token key sides are read in place, as k_rows for k, v.
  int64_t key_rows = 0;
  bool path() const { return path_q != nullptr; }
  // the row of key 0 of (b, h) in ck, gk and path_k (path_k: times path_dim)
  int64_t key_row(const AttentionDims& d, int64_t b, int64_t h) const {
    return (b * d.Hq + h) * (key_rows > 0 ? key_rows : d.Tk);
  }
  bool any() const { return lag_table || slopes || cq || ck || gq || gk || path_q; }
};

// Gradients of the bias parameters, accumulated (+=) in place, as the transform ParamGrads;
// null entries are not computed. lag_table[h][d] gets the sum of dL/dlogit over the pairs whose
// (clamped) lag index is d; slopes[h] gets -sum dL/dlogit (p_q - p_k); cq[b,h,i] the row sums
// and ck[b,h,j] minus the column sums of dL/dlogit; gq[b,h,i] gets -sum_j dL/dlogit (p_q - p_k),
// gk[b,h,j] -sum_i dL/dlogit (p_q - p_k); path_q, path_k, path_beta the probe and beta
// gradients of the path integral.
template <class T>
struct AttentionBiasGrads {
  T* lag_table = nullptr;
  T* slopes = nullptr;
  double* cq = nullptr;
  double* ck = nullptr;
  T* gq = nullptr;
  T* gk = nullptr;
  T* path_q = nullptr;
  T* path_k = nullptr;
  T* path_beta = nullptr;
  bool any() const {
    return lag_table || slopes || cq || ck || gq || gk || path_q || path_k || path_beta;
  }
};

// Lag table index of the lag d = p_q - p_k: floor(d + 1/2) clamped to [0, lag_len - 1] (the
// truncation is a floor once clamped to >= 0; a NaN lag gives 0). Branch-free, as the kernels'
// vectorised copy of it. lag_len < 2^31.
inline int64_t attention_lag_index(double d, int64_t lag_len) {
  return static_cast<int32_t>(std::min(std::max(0.0, d + 0.5), static_cast<double>(lag_len - 1)));
}

// out = softmax(logits) v per query row; lse [B, Hq, Tq] = log-sum-exp of the visible logits
// (-inf for a row without visible keys), kept for the backward. lse may be null.
template <class T>
void attention_forward(const AttentionDims& dims, const T* q, const T* k, const T* v,
                       const AttentionPositions& pos, const AttentionBias<T>& bias,
                       const AttentionOptions& options, T* out, T* lse);

// The same forward on half storage (float instantiation): q, k, v and out are bfloat16 or float16
// words, and lse float32. The kernel widens each tile to float32 as it reads it (no float32
// copies of the operands) and computes exactly as the float kernel does on the widened values;
// the output is rounded to nearest-even once. So out equals the float forward on q, k, v
// converted to float32, stored back in the half type, bit for bit. The biases stay float32.
void attention_forward_half(const AttentionDims& dims, HalfType type, const uint16_t* q,
                            const uint16_t* k, const uint16_t* v, const AttentionPositions& pos,
                            const AttentionBias<float>& bias, const AttentionOptions& options,
                            uint16_t* out, float* lse);

// Gradients from dout = dL/dout (and dlse = dL/dlse [B, Hq, Tq] when lse is used too; null: 0),
// given the forward's out and lse: dq, dk, dv are written (overwritten; any may be null), the bias
// gradients accumulated (see AttentionBiasGrads).
template <class T>
void attention_backward(const AttentionDims& dims, const T* q, const T* k, const T* v,
                        const AttentionPositions& pos, const AttentionBias<T>& bias,
                        const AttentionOptions& options, const T* dout, const T* out, const T* lse,
                        T* dq, T* dk, T* dv, const AttentionBiasGrads<T>& grads,
                        const T* dlse = nullptr);

// The same backward on half storage (float instantiation): q, k, v, dout, out and the gradients
// dq, dk, dv are bfloat16 or float16 words (any gradient may be null), lse, dlse and the bias
// gradients float32. Tiles are widened as they are read and every product and accumulation is
// the float kernel's; each gradient is rounded once at the end. So dq, dk, dv equal the float
// backward on the widened operands, stored back in the half type, bit for bit.
void attention_backward_half(const AttentionDims& dims, HalfType type, const uint16_t* q,
                             const uint16_t* k, const uint16_t* v, const AttentionPositions& pos,
                             const AttentionBias<float>& bias, const AttentionOptions& options,
                             const uint16_t* dout, const uint16_t* out, const float* lse,
                             uint16_t* dq, uint16_t* dk, uint16_t* dv,
                             const AttentionBiasGrads<float>& grads, const float* dlse = nullptr);

// Plain float64 references straight from the definition (materialised logits per row, one
// thread): for the tests. Same arguments and conventions as the kernels; lse may be null.
void attention_reference(const AttentionDims& dims, const double* q, const double* k,
                         const double* v, const AttentionPositions& pos,
                         const AttentionBias<double>& bias, const AttentionOptions& options,
                         double* out, double* lse);
void attention_reference_backward(const AttentionDims& dims, const double* q, const double* k,
                                  const double* v, const AttentionPositions& pos,
                                  const AttentionBias<double>& bias,
                                  const AttentionOptions& options, const double* dout, double* dq,
                                  double* dk, double* dv, const AttentionBiasGrads<double>& grads);

}  // namespace relpos::kernels
