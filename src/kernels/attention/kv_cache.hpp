// Decode with a KV cache (no LibTorch): keys are stored already transformed, so a decode step
// transforms one query and runs the fused kernel against everything cached.
//
// Non-orthogonal transforms (damped RoPE, Jordan blocks) grow keys like e^{gamma p} and
// polynomially in p, so one global centre cannot serve an unbounded context. The cache stores
// keys in chunks and re-centres per chunk: the keys of chunk w are transformed with centre c_w
// (the chunk's first position), and a decode transforms the query once per chunk with the same
// c_w. For an exact map A(i - c)^{-T} . A(j - c) depends only on i - j (Jordan-RoPE App. A), so
// each chunk's scores are the true ones; the per-chunk results (out_w, lse_w) are merged exactly
// by their log-sum-exp weights (split-KV, flash-decoding). Approximate maps (bounded charts, jet
// gates) score differently under another centre: they keep the mechanism's own fixed centre for
// every chunk, as a full forward would use.
//
// Layouts: k, v [B, Hk, D] per token ([B, Hk, n, D] for a block), q and out [B, Hq, D], lse
// [B, Hq]; positions are float64, shared by the batch, non-decreasing across appends.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "core/mechanism.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/attention/mechanism_attention.hpp"
#include "kernels/mechanism_apply.hpp"

namespace relpos::kernels {

// Exact merge of attention results over disjoint key sets: with m = max_w lse_w,
//   out = sum_w e^{lse_w - m} out_w / sum_w e^{lse_w - m},   lse = m + log sum_w e^{lse_w - m}.
// Partials with lse = -inf (no visible key) contribute nothing; a row that no partial saw ends
// with out = 0, lse = -inf, as the kernel gives. Accumulates in float64.
template <class T>
class LseMerge {
 public:
  LseMerge(int64_t rows, int64_t D);
  // One partial result: out [rows, D], lse [rows].
  void add(const T* out, const T* lse);
  // Writes the merged result; lse may be null.
  void finish(T* out, T* lse) const;

 private:
  int64_t rows_, D_;
  std::vector<double> acc_, max_, sum_;
};

struct KvCacheOptions {
  Layout layout = Layout::Interleaved;
  double window = 0.0;  // > 0: a query at p sees keys with p - window < p_k <= p
  double scale = 0.0;   // softmax scale; 0 means 1 / sqrt(D)
  // Tokens per chunk: the unit of re-centring, in [1, kMaxChunk]. A chunk also closes when a
  // position is `chunk` or more past its centre (gappy positions), so keys within a chunk grow at
  // most like e^{gamma chunk}. A chunk's storage grows with its tokens (doubling), so memory
  // follows the tokens cached, never the chunk size.
  int64_t chunk = 256;
  static constexpr int64_t kMaxChunk = int64_t{1} << 20;
};

template <class T>
class KvCache {
 public:
  // The mechanism is built for the query heads; parameters per key or query head (the head rule of
  // mechanism_attention.hpp). Throws InputError for bad shapes or options, unsupported mechanism
  // work, and approximate maps with center=mid (no fixed centre to keep).
  KvCache(Mechanism m, const ParamValues& p, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
          KvCacheOptions options = {});
  // The plan points into the owned mechanism: moves keep it valid, copies would not.
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  KvCache(KvCache&&) noexcept = default;
  KvCache& operator=(KvCache&&) noexcept = default;
  ~KvCache() = default;

  // One token: k, v [B, Hk, D] at `position`.
  void append(std::span<const T> k, std::span<const T> v, double position);
  // n tokens: k, v [B, Hk, n, D] at positions[0..n) (n = positions.size()).
  void append(std::span<const T> k, std::span<const T> v, std::span<const double> positions);

  // One query q [B, Hq, D] at `position` against every cached key with p_k <= position (and
  // inside the window): out [B, Hq, D], lse [B, Hq] (may be empty). Thread-safe with other
  // decodes (the scratch is per call).
  void decode(std::span<const T> q, double position, std::span<T> out, std::span<T> lse = {}) const;

  int64_t size() const { return tokens_; }
  int64_t chunks() const { return static_cast<int64_t>(chunks_.size()); }
  // The centre chunk w's keys were transformed with.
  double chunk_center(int64_t w) const { return chunks_.at(static_cast<size_t>(w)).center; }
  void clear();

 private:
  struct Chunk {
    double center = 0.0;
    int64_t len = 0;
    int64_t cap = 0;          // token slots allocated (<= chunk)
    std::vector<T> k, v;      // [B, Hk, cap, D], zero past len
    std::vector<double> pos;  // [cap]
  };

  KvCache(HeadParams hp, Mechanism&& m, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
          const KvCacheOptions& options);
  // Checks everything the public constructor is given; returns the per-role parameters.
  static HeadParams checked(const Mechanism& m, const ParamValues& p, int64_t B, int64_t Hq,
                            int64_t Hk, int64_t D, const KvCacheOptions& options);
  // May a query at p see a key of chunk c (positions are sorted within a chunk)?
  bool visible(const Chunk& c, double p) const;
  // The chunk the token at `position` goes into (a new one when the last is full or spans too far).
  Chunk& chunk_for(double position);
  // Grows c's storage to hold at least `need` tokens (at most the chunk size).
  void reserve(Chunk& c, int64_t need) const;

  Mechanism mech_;
  MechanismPlan plan_;
  ParamBuffers<T> qpar_, kpar_;
  MechanismBias<T> bias_;
  int64_t B_, Hq_, Hk_, D_;
  KvCacheOptions opt_;
  bool recenter_;        // exact transform: per-chunk centres
  double fixed_center_;  // approximate transform: the mechanism's centre for every chunk
  std::vector<Chunk> chunks_;
  int64_t tokens_ = 0;
  double last_position_ = -std::numeric_limits<double>::infinity();
  double first_position_ = std::numeric_limits<double>::infinity();  // smallest cached position
};

}  // namespace relpos::kernels
