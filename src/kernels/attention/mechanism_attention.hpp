// Attention with a mechanism, at the kernel level (no LibTorch): the mechanism's transform terms
// applied to queries and keys (kernels/mechanism_apply.hpp), its bias terms handed to the fused
// kernel as descriptors (kernels/attention/attention.hpp). The full-sequence forward here and the
// KV cache (kv_cache.hpp) share the pieces below, so a new bias shape or head rule is one edit.
//
// Heads under grouped-query attention: the mechanism is built for the query heads (its biases are
// per query head). Transform parameters may be given per key/value head (ParamValues with Hk
// heads: query head h uses row h / (Hq / Hk)) or per query head (Hq heads, then equal within each
// group: a key is transformed once for its whole group, and q^T A_h(i)^{-1} A_g(j) k is a relative
// score only when query head h and its key head g share A).
#pragma once

#include <cstdint>
#include <vector>

#include "core/mechanism.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/mechanism_apply.hpp"

namespace relpos::kernels {

// Throws InputError when the mechanism has work the attention path cannot do yet (journey
// transforms of values and outputs, content-phase or vector times, separable and path-integral
// biases), naming the term: silently dropping it would give wrong attention.
void check_attention_support(const Mechanism& m);

// The mechanism's bias terms as the fused kernel's descriptors, in T, for Hq query heads. One case
// per BiasShape: ALiBi's slope form, and learned lag tables (core/lag_kernel.hpp, built from the
// kernel's initial parameters for lags 0..min(max_lag, kMaxLagTable); the torch modules pass their
// trained table instead). Lags beyond the table use its last entry (the kernel's clamp), so memory
// stays bounded whatever the positions span.
template <class T>
struct MechanismBias {
  std::vector<T> slopes;     // per query head; empty: none
  std::vector<T> lag_table;  // [Hq, lag_len]; empty: none
  int64_t lag_len = 0;
  bool complete = false;  // the table reaches lag_table_bound: it serves every lag
  AttentionBias<T> view() const {
    AttentionBias<T> b;
    b.slopes = slopes.empty() ? nullptr : slopes.data();
    b.lag_table = lag_table.empty() ? nullptr : lag_table.data();
    b.lag_len = lag_len;
    return b;
  }
};
inline constexpr int64_t kMaxLagTable = int64_t{1} << 20;
// The lag from which the mechanism's lag tables no longer change (its learned kernels'
// constant_from), at most kMaxLagTable: a table through it serves every lag.
int64_t lag_table_bound(const Mechanism& m);
// The length of the lag table a call needs whose lags reach `span` (a NaN or negative span:
// one entry), at most lag_table_bound + 1.
int64_t lag_table_length(const Mechanism& m, double span);
template <class T>
MechanismBias<T> attention_bias_of(const Mechanism& m, int64_t Hq, int64_t max_lag = 0);

// Transform parameters of the query heads (Hq rows) and of the key heads (Hk rows), from
// ParamValues with Hk or Hq heads (see the head rule above). Checks the parameter shapes against
// the mechanism; InputError names the mismatch.
struct HeadParams {
  ParamValues q, k;
};
HeadParams attention_head_params(const Mechanism& m, const ParamValues& p, int64_t Hq, int64_t Hk);

// Checks the mechanism against the attention shape (head dim, heads, GQA, support); shared by the
// forward and the KV cache.
void check_mechanism_attention(const Mechanism& m, const AttentionDims& dims);

// out = attention(A(i)^{-T} q, A(j) k, v) + the mechanism's biases, for q [B, Hq, Tq, D], k and v
// [B, Hk, Tk, D], out [B, Hq, Tq, D], lse [B, Hq, Tq] (may be null). Positions as
// AttentionPositions (null: the decode convention, queries at Tk - Tq + i, keys at j); the centre
// is the mechanism's, resolved over all of the call's positions (Mechanism::resolve_center).
// Position ids must be finite. The transformed q and k live in scratch buffers of the call.
template <class T>
void mechanism_attention_forward(const Mechanism& m, const ParamValues& p, Layout layout,
                                 const AttentionDims& dims, const T* q, const T* k, const T* v,
                                 const AttentionPositions& pos, const AttentionOptions& options,
                                 T* out, T* lse);

}  // namespace relpos::kernels
