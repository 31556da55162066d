// kerple: KERPLE's conditionally positive definite kernels as a lag bias (Chi et al. 2022,
// "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation", NeurIPS, sec. 4):
//   log:   b_h(d) = -r1_h log(1 + r2_h d)
//   power: b_h(d) = -r1_h d^{r2_h},  0 < r2_h <= 2
// with r1_h, r2_h > 0 learned per head. Positivity by reparameterisation, not the reference's
// clamp: r1 = softplus(raw_r1); r2 = softplus(raw_r2) (log) or 2 sigmoid(raw_r2) (power).
#include <memory>
#include <random>

#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

namespace {

double softplus_of(double x) {
  return x > 20 ? x : std::log1p(std::exp(x));
}
double inverse_softplus_of(double v) {
  return v > 20 ? v : std::log(std::expm1(v));
}
double sigmoid_of(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

class KerpleKernel final : public LagKernel {
 public:
  explicit KerpleKernel(const Args& a)
      : LagKernel("kerple", a.values()),
        log_(a.choice("kernel", {"log", "power"}) == "log"),
        r1_max_(a.positive("r1_max")),
        r2_max_(a.positive("r2_max")),
        seed_(static_cast<uint64_t>(a.integer("seed", 0, 1 << 30))) {
    if (!log_ && !(r2_max_ < 2))
      throw InputError(fmt::format("{}: option r2_max={} must be < 2 for kernel=power (0 < r2 < 2)",
                                   a.term(), r2_max_));
  }

  std::vector<LagParam> params(int heads) const override {
    // r ~ U(kMin, max) per head, seeded: the reference's uniform draws with its 1e-2 floor
    std::mt19937_64 rng(seed_);
    const auto uniform = [&](double hi) {
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
      return kMin + (hi - kMin) * u;
    };
    LagParam r1{"kerple_raw_r1", {heads}, {}}, r2{"kerple_raw_r2", {heads}, {}};
    for (int h = 0; h < heads; ++h) {
      r1.init.push_back(inverse_softplus_of(uniform(r1_max_)));
      const double b = uniform(r2_max_);
      r2.init.push_back(log_ ? inverse_softplus_of(b) : std::log(b / (2.0 - b)));
    }
    return {r1, r2};
  }

  std::vector<double> table(const LagParamValues& v, int heads, int64_t len) const override {
    std::vector<double> out(static_cast<size_t>(heads * len));
    for (int h = 0; h < heads; ++h) {
      const double r1 = softplus_of(v[0][h]);
      const double r2 = log_ ? softplus_of(v[1][h]) : 2.0 * sigmoid_of(v[1][h]);
      for (int64_t i = 0; i < len; ++i) {
        const double d = static_cast<double>(i);
        out[static_cast<size_t>(h * len + i)] =
            log_ ? -r1 * std::log1p(r2 * d) : (i == 0 ? 0.0 : -r1 * std::pow(d, r2));
      }
    }
    return out;
  }

 private:
  static constexpr double kMin = 1e-2;
  bool log_;
  double r1_max_, r2_max_;
  uint64_t seed_;
};

}  // namespace

std::vector<TermDef> kerple_family() {
  std::vector<TermDef> d;
  d.push_back(
      {{"kerple",
        "bias",
        "KERPLE kernelized lag bias: log -r1_h log(1 + r2_h d) or power -r1_h d^r2_h (0 < r2 < 2), "
        "r1, r2 > 0 learned per head (softplus / 2 sigmoid, where the reference clamps)",
        "exact (a function of i - j)",
        "KERPLE (Chi et al. 2022, NeurIPS) 4",
        {{"kernel", "log", "log: -r1 log(1 + r2 d); power: -r1 d^r2"},
         {"r1_max", "2", "initial r1_h ~ U(0.01, r1_max), seeded", 0.02, 1e3},
         {"r2_max", "1", "initial r2_h ~ U(0.01, r2_max), seeded (power: r2_max < 2)", 0.02, 1e3},
         {"seed", "0", "seed of the initial r1, r2"}},
        {}},
       [](const Args& a, TermBuilder& b) {
         b.add_learned_lag_table(std::make_shared<KerpleKernel>(a));
       }});
  return d;
}

}  // namespace relpos::mechanisms
