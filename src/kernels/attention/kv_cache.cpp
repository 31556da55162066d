#include "kernels/attention/kv_cache.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "core/types.hpp"
#include "kernels/transform.hpp"

namespace relpos::kernels {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// A lag table length request, as an integer: lags of 10^12 (or more) saturate at the table bound
// instead of overflowing the conversion.
int64_t lag_request(double lag) {
  return static_cast<int64_t>(std::min(lag, static_cast<double>(kMaxLagTable)));
}

template <class T>
void check_size(const char* what, std::span<const T> x, int64_t want, const char* shape) {
  if (static_cast<int64_t>(x.size()) != want)
    throw InputError(
        fmt::format("kv cache: {} has {} values, expected {} = {}", what, x.size(), shape, want));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
template <class T>
LseMerge<T>::LseMerge(int64_t rows, int64_t D)
    : rows_(rows),
      D_(D),
      acc_(static_cast<size_t>(rows * D), 0.0),
      max_(static_cast<size_t>(rows), kNegInf),
      sum_(static_cast<size_t>(rows), 0.0) {}

template <class T>
void LseMerge<T>::add(const T* out, const T* lse) {
  for (int64_t r = 0; r < rows_; ++r) {
    const double l = static_cast<double>(lse[r]);
    if (l == kNegInf) continue;  // no visible key in this partial (NaN still propagates)
    double* acc = acc_.data() + r * D_;
    if (l > max_[r]) {  // rescale what was accumulated to the new maximum
      const double s = std::exp(max_[r] - l);
      for (int64_t e = 0; e < D_; ++e) acc[e] *= s;
      sum_[r] *= s;
      max_[r] = l;
    }
    const double w = std::exp(l - max_[r]);
    const T* o = out + r * D_;
    for (int64_t e = 0; e < D_; ++e) acc[e] += w * static_cast<double>(o[e]);
    sum_[r] += w;
  }
}

template <class T>
void LseMerge<T>::finish(T* out, T* lse) const {
  for (int64_t r = 0; r < rows_; ++r) {
    const double s = sum_[r];
    const double* acc = acc_.data() + r * D_;
    // s is 0 (no partial saw the row), > 0, or NaN (a NaN partial), which out and lse keep
    for (int64_t e = 0; e < D_; ++e) out[r * D_ + e] = s != 0 ? static_cast<T>(acc[e] / s) : T(0);
    if (lse) lse[r] = static_cast<T>(s != 0 ? max_[r] + std::log(s) : kNegInf);
  }
}

// ---------------------------------------------------------------------------------------------
template <class T>
HeadParams KvCache<T>::checked(const Mechanism& m, const ParamValues& p, int64_t B, int64_t Hq,
                               int64_t Hk, int64_t D, const KvCacheOptions& o) {
  check_mechanism_attention(m, {B, Hq, Hk, 1, 1, D});
  if (o.chunk < 1 || o.chunk > KvCacheOptions::kMaxChunk)
    throw InputError(fmt::format("kv cache: chunk must be in [1, 2^20], got {}", o.chunk));
  if (!(o.window >= 0)) throw InputError("kv cache: window must be >= 0 (0: none)");
  if (!(o.scale >= 0) || std::isinf(o.scale))
    throw InputError("kv cache: scale must be finite and >= 0 (0: 1/sqrt(D))");
  if (m.rope_scaling.dynamic())
    throw InputError(fmt::format(
        "kv cache: mechanism '{}' has a dynamic context-extension rule ({}), whose frequencies "
        "change with the context length: freeze it at the length you will decode to with "
        "scaled_for_length(m, length) (core/rope_scaling.hpp)",
        m.spec, rope_scaling_name(m.rope_scaling.rule.type)));
  if (!m.transform_exact() && m.center == CenterMode::Mid)
    throw InputError(fmt::format(
        "kv cache: mechanism '{}' is approximate (its scores depend on the centre) and has "
        "center=mid, which moves with every call: give center=none or a number",
        m.spec));
  return attention_head_params(m, p, Hq, Hk);
}

template <class T>
KvCache<T>::KvCache(Mechanism m, const ParamValues& p, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                    KvCacheOptions options)
    : KvCache(checked(m, p, B, Hq, Hk, D, options), std::move(m), B, Hq, Hk, D, options) {}

template <class T>
KvCache<T>::KvCache(HeadParams hp, Mechanism&& m, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                    const KvCacheOptions& options)
    : mech_(std::move(m)),
      plan_(MechanismPlan::from(mech_, options.layout)),
      qpar_(hp.q),
      kpar_(hp.k),
      bias_(attention_bias_of<T>(mech_, Hq, std::min<int64_t>(options.chunk, 1024))),
      B_(B),
      Hq_(Hq),
      Hk_(Hk),
      D_(D),
      opt_(options),
      // without a position term there is nothing to re-centre: one query transform per decode
      recenter_(mech_.position_term() && mech_.transform_exact()),
      fixed_center_(recenter_ ? 0.0 : mech_.resolve_center(0.0, 0.0)) {}

template <class T>
bool KvCache<T>::visible(const Chunk& c, double p) const {
  if (c.len == 0 || !(c.pos.front() <= p)) return false;
  return !(opt_.window > 0) || p - c.pos[static_cast<size_t>(c.len - 1)] < opt_.window;
}

template <class T>
typename KvCache<T>::Chunk& KvCache<T>::chunk_for(double position) {
  const int64_t C = opt_.chunk;
  if (chunks_.empty() || chunks_.back().len == C ||
      (recenter_ && position - chunks_.back().center >= static_cast<double>(C))) {
    Chunk c;
    c.center = recenter_ ? position : fixed_center_;
    chunks_.push_back(std::move(c));
  }
  return chunks_.back();
}

template <class T>
void KvCache<T>::reserve(Chunk& c, int64_t need) const {
  if (need <= c.cap) return;
  const int64_t cap = std::min(opt_.chunk, std::max({need, 2 * c.cap, int64_t{16}}));
  const auto grow = [&](std::vector<T>& x) {
    std::vector<T> y(static_cast<size_t>(B_ * Hk_ * cap * D_), T(0));
    for (int64_t bh = 0; bh < B_ * Hk_; ++bh)
      std::copy_n(x.data() + bh * c.cap * D_, c.len * D_, y.data() + bh * cap * D_);
    x = std::move(y);
  };
  grow(c.k);
  grow(c.v);
  c.pos.resize(static_cast<size_t>(cap), 0.0);
  c.cap = cap;
}

template <class T>
void KvCache<T>::append(std::span<const T> k, std::span<const T> v, double position) {
  append(k, v, std::span<const double>(&position, 1));
}

template <class T>
void KvCache<T>::append(std::span<const T> k, std::span<const T> v,
                        std::span<const double> positions) {
  const auto n = static_cast<int64_t>(positions.size());
  check_size("k", k, B_ * Hk_ * n * D_, "B*Hk*n*D");
  check_size("v", v, B_ * Hk_ * n * D_, "B*Hk*n*D");
  // everything is checked before the cache changes
  double last = last_position_;
  for (int64_t i = 0; i < n; ++i) {
    const double p = positions[i];
    if (!std::isfinite(p))
      throw InputError(
          fmt::format("kv cache: position {} (token {} of the append) is not finite", p, i));
    if (p < last)
      throw InputError(fmt::format(
          "kv cache: position {} comes after position {}: appended positions must not decrease", p,
          last));
    last = p;
  }
  const int64_t C = opt_.chunk;
  std::vector<T> buf;
  for (int64_t s = 0; s < n;) {
    Chunk& c = chunk_for(positions[s]);
    int64_t m = 1;  // tokens of this append that go into c
    while (s + m < n && c.len + m < C &&
           !(recenter_ && positions[s + m] - c.center >= static_cast<double>(C)))
      ++m;
    // gather the span's keys into [B, Hk, m, D], transform them at the chunk's centre
    buf.resize(static_cast<size_t>(B_ * Hk_ * m * D_));
    for (int64_t bh = 0; bh < B_ * Hk_; ++bh)
      std::copy_n(k.data() + (bh * n + s) * D_, m * D_, buf.data() + bh * m * D_);
    const Dims dims{B_, Hk_, m};
    const Positions P{positions.data() + s, false, c.center};
    const auto trig = build_trig_table<T>(plan_.position, dims, P);
    mechanism_forward<T>(plan_, dims, P, kpar_.view(), trig.view(), nullptr, buf.data(), nullptr,
                         buf.data());
    reserve(c, c.len + m);
    for (int64_t bh = 0; bh < B_ * Hk_; ++bh) {
      std::copy_n(buf.data() + bh * m * D_, m * D_, c.k.data() + (bh * c.cap + c.len) * D_);
      std::copy_n(v.data() + (bh * n + s) * D_, m * D_, c.v.data() + (bh * c.cap + c.len) * D_);
    }
    std::copy_n(positions.data() + s, m, c.pos.data() + c.len);
    c.len += m;
    tokens_ += m;
    s += m;
  }
  last_position_ = last;
  if (n > 0) first_position_ = std::min(first_position_, positions[0]);
  // grow a learned lag table (doubling) to the cache's span plus the next token
  if (bias_.lag_len > 0 && n > 0) {
    // (until complete: attention_bias_of stops at lag_table_bound, longer lags use the last entry)
    const double span = std::ceil(last - first_position_) + 1;
    if (span >= static_cast<double>(bias_.lag_len) && !bias_.complete)
      bias_ = attention_bias_of<T>(mech_, Hq_, lag_request(2 * span));
  }
}

template <class T>
void KvCache<T>::decode(std::span<const T> q, double position, std::span<T> out,
                        std::span<T> lse) const {
  const int64_t rows = B_ * Hq_;
  check_size("q", q, rows * D_, "B*Hq*D");
  check_size("out", std::span<const T>(out), rows * D_, "B*Hq*D");
  if (!lse.empty()) check_size("lse", std::span<const T>(lse), rows, "B*Hq");
  if (!std::isfinite(position))
    throw InputError(fmt::format("kv cache: decode position {} is not finite", position));
  LseMerge<T> merge(rows, D_);
  std::vector<T> qt(static_cast<size_t>(rows * D_)), ow(qt.size()), lw(static_cast<size_t>(rows));
  std::vector<int64_t> key_len(static_cast<size_t>(B_));

  // a context-extension rule's attention factor multiplies q and k: logits by its square
  const double af = attention_factor(mech_, 0.0);
  const AttentionOptions ao{true, opt_.window, key_len.data(),
                            af == 1.0 ? opt_.scale : scaled_softmax_scale(opt_.scale, D_, af)};
  const Dims qd{B_, Hq_, 1};
  // a learned lag table (PJ bias) must reach the longest lag of this query: built for it when the
  // cache's own table is too short (tables grow with the context; slopes need nothing)
  std::optional<MechanismBias<T>> longer;
  if (bias_.lag_len > 0 && !chunks_.empty()) {
    const double need = std::ceil(position - first_position_);
    if (need >= static_cast<double>(bias_.lag_len) && !bias_.complete)
      longer = attention_bias_of<T>(mech_, Hq_, lag_request(2 * need));
  }
  const AttentionBias<T> bias = longer ? longer->view() : bias_.view();
  double q_center = std::numeric_limits<double>::quiet_NaN();  // centre qt was made with
  for (const Chunk& c : chunks_) {
    if (!visible(c, position)) continue;  // before the query, or out of the window
    if (!(c.center == q_center)) {
      // the query at the chunk's centre: A(p - c_w)^{-T}, which only shrinks for p >= c_w
      const Positions P{&position, false, c.center};
      const auto trig = build_trig_table<T>(plan_.position, qd, P);
      mechanism_forward<T>(plan_, qd, P, qpar_.view(), trig.view(), q.data(), nullptr, qt.data(),
                           nullptr);
      q_center = c.center;
    }
    std::fill(key_len.begin(), key_len.end(), c.len);
    const AttentionDims dims{B_, Hq_, Hk_, 1, c.cap, D_};
    const AttentionPositions ap{&position, c.pos.data(), false};
    attention_forward<T>(dims, qt.data(), c.k.data(), c.v.data(), ap, bias, ao, ow.data(),
                         lw.data());
    merge.add(ow.data(), lw.data());
  }
  merge.finish(out.data(), lse.empty() ? nullptr : lse.data());
}

template <class T>
void KvCache<T>::clear() {
  chunks_.clear();
  tokens_ = 0;
  last_position_ = kNegInf;
  first_position_ = std::numeric_limits<double>::infinity();
}

template class LseMerge<float>;
template class LseMerge<double>;
template class KvCache<float>;
template class KvCache<double>;

}  // namespace relpos::kernels
