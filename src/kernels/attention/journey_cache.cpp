#include "kernels/attention/journey_cache.hpp"

#include <fmt/format.h>

#include <cmath>
#include <numbers>

#include "kernels/rotate.hpp"

namespace relpos::kernels {

namespace {

const TransformTerm& journey_of(const Mechanism& m) {
  for (const auto& t : m.transforms)
    if (t.roles.values || t.time == TimeSource::ContentPhase) {
      if (m.transforms.size() != 1)
        throw InputError(
            fmt::format("journey cache: '{}' composes a journey with other "
                        "transforms",
                        m.spec));
      if (t.time == TimeSource::ContentPhase && t.scan != PhaseScan::Exclusive)
        throw InputError(fmt::format(
            "journey cache: '{}' scans the angles in reverse (the reference code's form): the "
            "frame of a token depends on later tokens, so it cannot be decoded",
            m.spec));
      return t;
    }
  throw InputError(fmt::format("journey cache: '{}' has no journey term", m.spec));
}

Mechanism without_transforms(Mechanism m) {
  m.transforms.clear();
  m.params.clear();
  m.rope_scaling = {};
  return m;
}

}  // namespace

template <class T>
JourneyCache<T>::JourneyCache(const Mechanism& m, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                              KvCacheOptions options)
    : term_(&journey_of(m)),
      mech_(m),
      cache_(without_transforms(m), default_params(without_transforms(m)), B, Hq, Hk, D, options),
      B_(B),
      Hq_(Hq),
      Hk_(Hk),
      D_(D),
      P_(D / 2),
      layout_(options.layout) {
  term_ = &journey_of(mech_);
  for (const auto& s : term_->segments)
    for (double w : s.omega) freq_.push_back(-w);  // segments rotate keys by -omega p
  if (static_cast<int64_t>(freq_.size()) != P_)
    throw InputError(fmt::format("journey cache: '{}' rotates {} pairs, head dim {} has {}", m.spec,
                                 freq_.size(), D, P_));
  phase_.assign(static_cast<size_t>(B * P_), 0.0);
}

template <class T>
std::vector<T> JourneyCache<T>::frame(double position) const {
  std::vector<T> a(static_cast<size_t>(B_ * P_));
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t p = 0; p < P_; ++p)
      a[b * P_ + p] =
          static_cast<T>(term_->time == TimeSource::ContentPhase
                             ? phase_[b * P_ + p]
                             : std::remainder(position * freq_[p], 2 * std::numbers::pi));
  return a;
}

template <class T>
void JourneyCache<T>::step(std::span<const T> q, std::span<const T> k, std::span<const T> v,
                           std::span<const T> increments, double position, std::span<T> out) {
  const bool token = term_->time == TimeSource::ContentPhase;
  if (static_cast<int64_t>(q.size()) != B_ * Hq_ * D_ ||
      static_cast<int64_t>(out.size()) != B_ * Hq_ * D_ ||
      static_cast<int64_t>(k.size()) != B_ * Hk_ * D_ || v.size() != k.size())
    throw InputError("journey cache: q/out must be [B, Hq, D] and k, v [B, Hk, D]");
  if (token ? static_cast<int64_t>(increments.size()) != B_ * P_ : !increments.empty())
    throw InputError(
        fmt::format("journey cache: increments must be [B, {}] for per-token angles "
                    "and empty for fixed ones, got {} values",
                    P_, increments.size()));
  const auto a = frame(position);
  std::vector<T> c(a.size()), s(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    c[i] = std::cos(a[i]);
    s[i] = std::sin(a[i]);
  }
  const RotateDims kd{B_, Hk_, 1, D_, P_, true}, qd{B_, Hq_, 1, D_, P_, true};
  std::vector<T> kr(k.size()), vr(v.size()), qr(q.size());
  rotate_pairs_forward<T>(kd, layout_, false, k.data(), c.data(), s.data(), kr.data());
  if (term_->roles.values) {
    rotate_pairs_forward<T>(kd, layout_, false, v.data(), c.data(), s.data(), vr.data());
  } else {
    vr.assign(v.begin(), v.end());
  }
  rotate_pairs_forward<T>(qd, layout_, false, q.data(), c.data(), s.data(), qr.data());
  cache_.append(kr, vr, position);
  cache_.decode(qr, position, out);
  if (term_->roles.outputs)
    rotate_pairs_forward<T>(qd, layout_, true, out.data(), c.data(), s.data(), out.data());
  if (token)
    for (size_t i = 0; i < phase_.size(); ++i) phase_[i] += static_cast<double>(increments[i]);
}

template class JourneyCache<float>;
template class JourneyCache<double>;

}  // namespace relpos::kernels
