// t5_bias: T5's relative position bucket bias (Raffel et al. 2020, "Exploring the Limits of
// Transfer Learning with a Unified Text-to-Text Transformer", JMLR 21, sec. 2.1; the
// unidirectional form of T5Attention._relative_position_bucket in Hugging Face transformers):
// lag n = max(i - j, 0) falls into bucket n when n < B/2 (exact buckets), else into
//   B/2 + floor(log(n / (B/2)) / log(max_distance / (B/2)) * (B - B/2)), at most B - 1
// (log-spaced up to max_distance, one bucket for everything beyond), and b_h(n) = w[h, bucket(n)]
// with one learned scalar per head and bucket. Causal only: the kernel's lags are >= 0.
// The bucket index is computed in float64 here (the reference computes the log in float32; the
// two agree wherever the float32 rounding does not cross an integer, which no lag does for
// B = 32, max_distance = 128).
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>

#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

namespace {

class T5BucketKernel final : public LagKernel {
 public:
  explicit T5BucketKernel(const Args& a)
      : LagKernel("t5_bias", a.values()),
        buckets_(a.integer("buckets", 2, 4096)),
        max_distance_(a.positive("max_distance")),
        init_std_(a.nonneg("init_std")),
        seed_(static_cast<uint64_t>(a.integer("seed", 0, 1 << 30))) {
    if (!(max_distance_ > buckets_ / 2))
      throw InputError(fmt::format("{}: option max_distance={} must exceed buckets/2 = {}",
                                   a.term(), max_distance_, buckets_ / 2));
  }

  std::vector<LagParam> params(int heads) const override {
    // seeded N(0, init_std^2), head-major [H, buckets]
    std::mt19937_64 rng(seed_);
    std::normal_distribution<double> normal(0.0, 1.0);
    LagParam p{"t5_bucket_bias", {heads, buckets_}, {}};
    for (int i = 0; i < heads * buckets_; ++i) p.init.push_back(init_std_ * normal(rng));
    return {p};
  }

  // the first lag in the last bucket (bucket() is non-decreasing): from the closed form
  // exact (max_distance / exact)^((B - 1 - exact) / (B - exact)), then the exact boundary of
  // bucket() itself found around it
  int64_t constant_from() const override {
    const double exact = buckets_ / 2;
    const double at =
        exact * std::pow(max_distance_ / exact,
                         (buckets_ - 1 - exact) / static_cast<double>(buckets_ - exact));
    if (!(at < 1e15)) return kUnbounded;
    int64_t n = std::max<int64_t>(static_cast<int64_t>(exact), static_cast<int64_t>(at) - 4);
    while (n > static_cast<int64_t>(exact) && bucket(n - 1) == buckets_ - 1) --n;
    while (bucket(n) < buckets_ - 1) ++n;
    return n;
  }

  std::vector<double> table(const LagParamValues& v, int heads, int64_t len) const override {
    std::vector<double> out(static_cast<size_t>(heads * len));
    for (int64_t d = 0; d < len; ++d) {
      const int64_t b = bucket(d);
      for (int h = 0; h < heads; ++h)
        out[static_cast<size_t>(h * len + d)] = v[0][static_cast<size_t>(h * buckets_ + b)];
    }
    return out;
  }

 private:
  int64_t bucket(int64_t n) const {
    const int64_t exact = buckets_ / 2;
    if (n < exact) return n;
    const double x = std::log(static_cast<double>(n) / static_cast<double>(exact)) /
                     std::log(max_distance_ / static_cast<double>(exact)) *
                     static_cast<double>(buckets_ - exact);
    return std::min<int64_t>(exact + static_cast<int64_t>(x), buckets_ - 1);
  }

  int buckets_;
  double max_distance_, init_std_;
  uint64_t seed_;
};

}  // namespace

std::vector<TermDef> t5_bias_family() {
  std::vector<TermDef> d;
  d.push_back(
      {{"t5_bias",
        "bias",
        "T5 relative position buckets: one learned scalar per head and bucket of the lag "
        "(buckets/2 exact, the rest log-spaced up to max_distance); causal form",
        "exact (a function of i - j)",
        "T5 (Raffel et al. 2020, JMLR) 2.1; HF T5Attention._relative_position_bucket",
        {{"buckets", "32", "number of buckets B (integer in [2, 4096])", 2, 4096},
         {"max_distance", "128", "lag where the log-spaced buckets end (> buckets/2)", 1e-3, 1e12},
         {"init_std", "0.02",
          "initial weights init_std N(0, 1), seeded (non-zero, so the spec alone differs "
          "from plain attention; T5 draws N(0, d_model^-1/2))",
          0, 1e3},
         {"seed", "0", "seed of the initial weights"}},
        {}},
       [](const Args& a, TermBuilder& b) {
         b.add_learned_lag_table(std::make_shared<T5BucketKernel>(a));
       }});
  return d;
}

}  // namespace relpos::mechanisms
