// Decode for journey mechanisms (JoFormer, core/mechanisms/journey.cpp; no LibTorch). Keys and
// values are cached already rotated into their own frames (k'_j = R(theta_j) k_j, v'_j =
// R(theta_j) v_j); a step rotates its query by its frame, attends over the cache (KvCache without
// transforms, the mechanism's bias terms kept) and rotates the result back by R(theta_i)^{-1}.
// Frames: fixed angles theta = p f_m (reduced mod 2 pi in float64); per-token angles from the
// running phase the cache keeps, Phi_t = sum_{s<t} a_s in float64, so decoding token by token
// reproduces the full forward's exclusive scan. The reference code's reversed scan reads later
// tokens and cannot be decoded: the constructor refuses it.
//
// Layouts as KvCache: q and out [B, Hq, D], k and v [B, Hk, D], increments [B, D/2].
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/mechanism.hpp"
#include "kernels/attention/kv_cache.hpp"

namespace relpos::kernels {

template <class T>
class JourneyCache {
 public:
  JourneyCache(const Mechanism& m, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
               KvCacheOptions options = {});
  // One token at `position`: its key and value join the cache, then its query attends to
  // everything cached (itself included). increments: the token's angle vector a_t (per-token
  // angles only; empty for fixed angles), added to the running phase after the step.
  void step(std::span<const T> q, std::span<const T> k, std::span<const T> v,
            std::span<const T> increments, double position, std::span<T> out);
  // The running phase Phi of the next token, [B, D/2] (per-token angles).
  const std::vector<double>& phase() const { return phase_; }
  int64_t size() const { return cache_.size(); }

 private:
  std::vector<T> frame(double position) const;  // [B, P] angles of the current token
  const TransformTerm* term_;                   // into mech_
  Mechanism mech_;
  KvCache<T> cache_;
  int64_t B_, Hq_, Hk_, D_, P_;
  Layout layout_;
  std::vector<double> freq_;   // fixed angles: f_m
  std::vector<double> phase_;  // per-token angles: [B, P]
};

}  // namespace relpos::kernels
