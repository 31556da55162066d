// Positive (orthogonal) random features and linear attention (FAVOR+; structured-rotations paper,
// section 3; Choromanski et al., "Rethinking attention with Performers"), LibTorch-free, float and
// double, OpenMP over (batch, head).
//
// Projections. W [m, d] (float64, row-major): rows iid N(0, I_d), or orthogonal blocks: each
// block of d rows is the Q factor of a d x d Gaussian matrix (Haar: QR with the signs of R's
// diagonal moved into Q), stacked for m > d (the last block truncated), every row then rescaled
// to a norm drawn from the chi distribution with d degrees of freedom (the norm of a fresh
// N(0, I_d) vector), so each row is marginally N(0, I_d) while rows of a block stay orthogonal.
// Draws come from std::mt19937_64; a RedrawPolicy (fixed, or a new draw every N calls) derives
// the seed of draw k from (seed, k) with splitmix64, so a run is reproducible whatever the order
// in which draws are asked for.
//
// Feature map (the sign matters; see FeatureSign):
//   phi(x)_r = exp(w_r . x' - |x'|^2 / 2 - c) / sqrt(m),   x' = scale * x
// E_w[exp(w.x - |x|^2/2) exp(w.y - |y|^2/2)] = exp(|x+y|^2/2 - |x|^2/2 - |y|^2/2) = exp(x.y), so
// with scale = d^(-1/4), phi(q) . phi(k) estimates exp(q.k / sqrt(d)), the softmax kernel.
// The paper's text writes exp(+|x|^2/2): that estimates exp(x.y + |x|^2 + |y|^2), biased by
// exp(|x|^2 + |y|^2) (kept as FeatureSign::Plus so a test can show it).
//
// Stabilisation (c above). exp(w.x') overflows or underflows for long vectors, so a constant is
// subtracted from the exponents before exp:
//   queries: c_i = max_r u_ir, per token (row). Attention is out_i = sum_j (phi(q_i).phi(k_j)) v_j
//            / sum_j (phi(q_i).phi(k_j)): a factor exp(-c_i) common to numerator and
//            denominator of row i cancels.
//   keys, non-causal: c = max_{t, r} u_tr, one constant over all tokens of a (batch, head). A
//            per-key constant alone would NOT cancel (it reweights keys against each other); one
//            shared by every key scales every numerator and denominator term by the same exp(-c).
//   keys, causal: each key is stabilised by its own max c_j = max_r u_jr (PerToken), and c_j is
//            handed to the linear attention kernel (the key stabilisers, kstab), which undoes the
//            reweighting with a running max m_i = max_{j <= i} c_j, as online softmax does: row i
//            weighs key j <= i by phi(q_i) . phi(k_j) exp(c_j - m_i) (<= 1: no overflow), i.e. by
//            the unstabilised features times exp(-m_i), a factor common to the numerator and the
//            denominator of row i. The carried state S, z (float64) is kept relative to the
//            running max of the keys seen so far and rescaled by exp(old max - new max) when it
//            grows. m_i reads keys <= i only, so an output never depends on later tokens, not
//            even by rounding, at a given T and chunk (summation orders follow the shapes, never
//            the values); a global key max would make earlier outputs move, in the last bits,
//            with later keys, and a streaming decoder could not know it.
// So the attention output is exactly (up to rounding) that of the unstabilised features. Every
// constant (c_i, c, c_j, m_i) is a stop-gradient, and that is exact, not an approximation: write
// out = F(x, c); F(x, c) = F(x, c') for EVERY c, c' (the constants cancel identically), so
// dF/dc = 0 and d out/dx = dF/dx + dF/dc dc/dx = dF/dx at c held fixed, even though c (a max)
// depends on x. The backward differentiates the same stabilised expression the forward
// evaluated, with the same factors exp(c_j - m_i), so forward and backward stay consistent.
//
// Linear attention on features a = phi(q) [B, H, T, m], b = phi(k) [B, H, T, m], v [B, H, T, Dv]:
//   non-causal: out_i = a_i^T S / (a_i . z),      S = sum_j b_j v_j^T [m, Dv], z = sum_j b_j
//   causal:     out_i = a_i^T S_i / (a_i . z_i),  S_i, z_i the same sums over j <= i
// The causal kernel is chunked (chunk tokens at a time): inside a chunk a small masked product
// (a b^T, lower triangle) times v; across chunks the state S, z is carried in float64 (for float
// too: the fp32 chunk increments are added to a float64 state, which is rounded to fp32 only to
// be multiplied). Time O(T m Dv), memory O(m Dv) per (batch, head) besides the buffers.
// With key stabilisers c_j (kstab), b_j stands for b_j exp(c_j - m_i) in row i (above): the
// state is kept relative to the running max at the end of the previous chunk, rows of a chunk
// scale its contribution by exp(max_prev - m_i), the masked chunk product gets the factors
// exp(c_j - m_i) elementwise (O(chunk) per token more), and the chunk's keys enter the state
// scaled by exp(c_j - max_end). Without kstab, c_j = 0 for every key.
// A row whose denominator is 0 (all its features underflowed) gets a zero output and zero
// gradients, never NaN.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace relpos::kernels {

enum class ProjectionKind { Iid, Orthogonal };

// Minus: exp(w.x - |x|^2/2), FAVOR+, unbiased for exp(x.y). Plus: exp(w.x + |x|^2/2), as the
// paper's section 3 writes it, biased by exp(|x|^2 + |y|^2).
enum class FeatureSign { Minus, Plus };

// Which constant is subtracted from the exponents (see the file comment).
enum class FeatureStabilizer {
  None,      // none (tests; overflows for long vectors)
  PerToken,  // max over the features of each token: queries; keys of the causal attention
             // (with the constants handed to the kernel as key stabilisers)
  Global,    // one max over all tokens and features of a (batch, head): keys, non-causal
};

// W [m, d], float64, row-major.
struct Projection {
  int64_t m = 0, d = 0;
  std::vector<double> w;
  const double* row(int64_t r) const { return w.data() + r * d; }
};

// Draws W from `rng`. m >= 1, d >= 1, else InputError.
Projection draw_projection(ProjectionKind kind, int64_t m, int64_t d, std::mt19937_64& rng);
// The same from a fresh std::mt19937_64(seed).
Projection draw_projection(ProjectionKind kind, int64_t m, int64_t d, uint64_t seed);

// The seed of draw `index` of a run seeded `seed` (splitmix64 of both; distinct indices give
// unrelated streams).
uint64_t derive_seed(uint64_t seed, uint64_t index);

// When the features are redrawn: never (draw 0 always), or every `n` calls (calls 0..n-1 use
// draw 0, calls n..2n-1 draw 1, ...).
class RedrawPolicy {
 public:
  static RedrawPolicy fixed() { return RedrawPolicy(0); }
  static RedrawPolicy every(int64_t n);  // n >= 1, else InputError
  uint64_t draw_index(uint64_t call) const { return every_ == 0 ? 0 : call / every_; }
  uint64_t period() const { return every_; }  // 0: fixed

 private:
  explicit RedrawPolicy(uint64_t every) : every_(every) {}
  uint64_t every_;
};

// A stream of projections under a redraw policy: next() is the projection of the next call
// (training step), redrawn from derive_seed(seed, draw index) when the index changes.
class FeatureSampler {
 public:
  FeatureSampler(ProjectionKind kind, int64_t m, int64_t d, uint64_t seed, RedrawPolicy policy);
  const Projection& next();
  const Projection& current() const { return proj_; }  // the last next()'s (draw 0 before any)
  uint64_t calls() const { return calls_; }
  uint64_t draw_index() const { return index_; }

 private:
  ProjectionKind kind_;
  int64_t m_, d_;
  uint64_t seed_;
  RedrawPolicy policy_;
  uint64_t calls_ = 0, index_ = 0;
  Projection proj_;
};

// x [B, H, T, D] -> phi [B, H, T, m] with m = W.m (W.d must equal D).
struct FeatureDims {
  int64_t B = 1, H = 1, T = 1, D = 1;
};

struct FeatureOptions {
  FeatureSign sign = FeatureSign::Minus;
  FeatureStabilizer stabilizer = FeatureStabilizer::PerToken;
  double scale = 0.0;  // x' = scale * x; 0 means D^(-1/4) (the softmax temperature 1/sqrt(D))
};

// stab [B, H, T] (may be null): the constant subtracted from the exponents of each token (0 for
// None; the shared max, repeated, for Global).
template <class T>
void feature_map_forward(const FeatureDims& dims, const T* x, const Projection& W,
                         const FeatureOptions& options, T* phi, T* stab = nullptr);

// dx = dL/dx from dphi = dL/dphi and the forward's phi (the stabiliser a constant):
//   dx = scale (G W) -/+ scale^2 x' rowsum(G),  G = dphi * phi (elementwise)  (- for Minus).
// dx is overwritten.
template <class T>
void feature_map_backward(const FeatureDims& dims, const T* x, const Projection& W,
                          const FeatureOptions& options, const T* phi, const T* dphi, T* dx);

struct LinearAttentionDims {
  int64_t B = 1, H = 1, T = 1, M = 1, Dv = 1;
};

struct LinearAttentionOptions {
  bool causal = true;
  int64_t chunk = 64;  // tokens per chunk of the causal kernel (>= 1)
};

// out [B, H, T, Dv]; den [B, H, T] (the denominators a_i . z_i in the frame of row i, kept for
// the backward; may be null). kstab [B, H, T] (may be null: all 0): the key stabilisers c_j, the
// constant each key's features were divided by exp() of (the feature map's stab with
// PerToken); key j then counts as fk_j exp(c_j) (see the file comment: causal, relative to the
// running max of the c_j seen so far; non-causal, relative to their max). Finite, else
// InputError.
template <class T>
void linear_attention_forward(const LinearAttentionDims& dims, const T* fq, const T* fk, const T* v,
                              const LinearAttentionOptions& options, T* out, T* den,
                              const T* kstab = nullptr);

// Gradients from dout, given the forward's out and den (and its kstab, the stabilisers held
// constant): dfq, dfk, dv overwritten (any may be null); dfk is the gradient to the stored
// features fk. Two O(T) passes per (batch, head): forward in time for dfq, backward in time for
// dfk and dv (the backward state kept relative to the running max at the first row of the chunk
// after, which is <= that of every later row: its factors are <= 1 too).
template <class T>
void linear_attention_backward(const LinearAttentionDims& dims, const T* fq, const T* fk,
                               const T* v, const LinearAttentionOptions& options, const T* dout,
                               const T* out, const T* den, T* dfq, T* dfk, T* dv,
                               const T* kstab = nullptr);

// The whole FAVOR+ attention: q, k [B, H, T, D], v [B, H, T, Dv] -> out [B, H, T, Dv], features
// of queries stabilised per token, of keys per token with the kernel's running max (causal: the
// output at i depends on q_i and k_j, v_j for j <= i only, bit for bit) or globally
// (non-causal), temperature scale (0: D^(-1/4)).
struct FavorDims {
  int64_t B = 1, H = 1, T = 1, D = 1, Dv = 1;
};

struct FavorOptions {
  FeatureSign sign = FeatureSign::Minus;
  double scale = 0.0;
  bool causal = true;
  int64_t chunk = 64;
};

// What the forward keeps for the backward.
template <class T>
struct FavorCache {
  std::vector<T> fq, fk, kstab, den;  // kstab: causal only (empty otherwise)
};

template <class T>
void favor_attention_forward(const FavorDims& dims, const T* q, const T* k, const T* v,
                             const Projection& W, const FavorOptions& options, T* out,
                             FavorCache<T>& cache);

// dq, dk, dv overwritten (any may be null).
template <class T>
void favor_attention_backward(const FavorDims& dims, const T* q, const T* k, const T* v,
                              const Projection& W, const FavorOptions& options, const T* dout,
                              const T* out, const FavorCache<T>& cache, T* dq, T* dk, T* dv);

}  // namespace relpos::kernels
