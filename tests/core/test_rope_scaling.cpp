// Context-extension rules (core/rope_scaling.hpp): every rule's frequencies and attention factor
// against values computed here, independently, from the published formula (Hugging Face
// transformers' modeling_rope_utils.py transcribed in float64, the papers, PJ-RoPE 3.4), the
// identity below the original length where the rule says so, the JSON parser and its errors, the
// spec terms, verify, and the attention paths.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <span>

#include "core/registry.hpp"
#include "core/rope_scaling.hpp"
#include "diag/verify.hpp"
#include "kernels/attention/kv_cache.hpp"
#include "kernels/attention/mechanism_attention.hpp"

using namespace relpos;

namespace {

constexpr double kPi = 3.141592653589793238462643383279502884;

// ---- The published formulas, written from the sources (not from src/) ---------------------------

// HF _compute_default_rope_parameters: inv_freq_i = 1 / base^(2i / dim), i < dim/2
std::vector<double> hf_inv_freq(double base, int dim) {
  std::vector<double> f;
  for (int i = 0; i < dim; i += 2) f.push_back(1.0 / std::pow(base, static_cast<double>(i) / dim));
  return f;
}

// HF _compute_dynamic_ntk_parameters
std::vector<double> hf_dynamic(double base, int dim, double factor, double max_pos,
                               double seq_len) {
  const double sl = seq_len > max_pos ? seq_len : max_pos;
  const double b = base * std::pow((factor * sl / max_pos) - (factor - 1), dim / (dim - 2.0));
  return hf_inv_freq(b, dim);
}

// HF _compute_yarn_parameters (get_mscale, find_correction_dim, find_correction_range,
// linear_ramp_factor) in float64
struct Yarn {
  std::vector<double> inv_freq;
  double attention_factor, low, high;
};
double get_mscale(double scale, double mscale = 1) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}
Yarn hf_yarn(double base, int dim, double factor, double orig, double beta_fast = 32,
             double beta_slow = 1, bool truncate = true, double mscale = 0,
             double mscale_all_dim = 0) {
  Yarn y;
  y.attention_factor = (mscale != 0 && mscale_all_dim != 0)
                           ? get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                           : get_mscale(factor);
  const auto find_correction_dim = [&](double num_rotations) {
    return (dim * std::log(orig / (num_rotations * 2 * kPi))) / (2 * std::log(base));
  };
  double low = find_correction_dim(beta_fast), high = find_correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  y.low = low;
  y.high = high;
  if (low == high) high += 0.001;
  for (int i = 0; i < dim / 2; ++i) {
    const double pos_freq = std::pow(base, 2.0 * i / dim);
    const double extrap = 1.0 / pos_freq, interp = 1.0 / (factor * pos_freq);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double extrap_factor = 1 - ramp;
    y.inv_freq.push_back(interp * (1 - extrap_factor) + extrap * extrap_factor);
  }
  return y;
}

// HF _compute_llama3_parameters
std::vector<double> hf_llama3(double base, int dim, double factor, double low_ff, double high_ff,
                              double old_ctx) {
  std::vector<double> out;
  const double low_wl = old_ctx / low_ff, high_wl = old_ctx / high_ff;
  for (double f : hf_inv_freq(base, dim)) {
    const double wl = 2 * kPi / f;
    double g = wl > low_wl ? f / factor : f;
    const double smooth = (old_ctx / wl - low_ff) / (high_ff - low_ff);
    const double smoothed = (1 - smooth) * g / factor + smooth * g;
    const bool medium = !(wl < high_wl) && !(wl > low_wl);
    out.push_back(medium ? smoothed : g);
  }
  return out;
}

// HF _compute_longrope_parameters: 1 / (ext_factor * base^(arange(0, dim, 2) / dim))
std::vector<double> hf_longrope(double base, int dim, const std::vector<double>& ext) {
  std::vector<double> out;
  for (int i = 0; i < dim; i += 2)
    out.push_back(1.0 / (ext[i / 2] * std::pow(base, static_cast<double>(i) / dim)));
  return out;
}

// ---- helpers
// -------------------------------------------------------------------------------------

// |omega| of the position term's first segment (RoPE stores -omega)
std::vector<double> freqs(const Mechanism& m, size_t seg = 0) {
  std::vector<double> w = m.segments().at(seg).omega;
  for (auto& x : w) x = std::abs(x);
  return w;
}

void expect_rel(const std::vector<double>& got, const std::vector<double>& want, double tol,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * std::abs(want[i])) << what << " k=" << i;
}

template <class F>
void expect_input_error(F&& f, std::initializer_list<const char*> parts) {
  try {
    f();
    ADD_FAILURE() << "no InputError";
  } catch (const InputError& e) {
    for (const char* p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

constexpr double kTol = 1e-14;

}  // namespace

// ---- Frequencies and factors against the published formulas -----------------------------------

TEST(RopeScaling, LinearIsPositionInterpolation) {
  const auto m = build_mechanism("rope(theta=10000) + linear(factor=4)", 64, 2);
  auto want = hf_inv_freq(10000, 64);
  for (auto& w : want) w /= 4;  // HF linear: inv_freq /= factor (PI: positions m -> m / 4)
  expect_rel(freqs(m), want, kTol, "linear");
  EXPECT_EQ(attention_factor(m, 1e5), 1.0);
  EXPECT_FALSE(m.rope_scaling.dynamic());
}

TEST(RopeScaling, StaticNtkChangesTheBase) {
  const auto m = build_mechanism("rope(theta=10000) + ntk(factor=8)", 128, 1);
  expect_rel(freqs(m), hf_inv_freq(10000 * std::pow(8.0, 128.0 / 126.0), 128), kTol, "ntk");
  // the lowest frequency of the grid is interpolated by exactly 1/factor
  EXPECT_NEAR(freqs(m).back(), hf_inv_freq(10000, 128).back() / std::pow(8.0, 126.0 / 126.0),
              1e-15 * freqs(m).back() * 1e3);
}

TEST(RopeScaling, DynamicNtkFollowsHfAndIsIdentityUpToTheOriginalLength) {
  const auto m = build_mechanism("rope(theta=10000) + dynamic_ntk(factor=2, original=2048)", 64, 2);
  EXPECT_TRUE(m.rope_scaling.dynamic());
  const auto plain = freqs(build_mechanism("rope(theta=10000)", 64, 2));
  expect_rel(freqs(m), plain, 0, "as built");
  for (double T : {1.0, 100.0, 2047.0, 2048.0})
    expect_rel(freqs(scaled_for_length(m, T)), plain, 0, fmt::format("T={}", T));
  for (double T : {2049.0, 4096.0, 10000.0, 131072.0})
    expect_rel(freqs(scaled_for_length(m, T)), hf_dynamic(10000, 64, 2, 2048, T), kTol,
               fmt::format("T={}", T));
  EXPECT_EQ(attention_factor(m, 1e5), 1.0);
  // frozen: a second length does not move it
  const auto f = scaled_for_length(m, 8192);
  EXPECT_FALSE(f.rope_scaling.dynamic());
  expect_rel(freqs(scaled_for_length(f, 100)), hf_dynamic(10000, 64, 2, 2048, 8192), kTol,
             "frozen");
}

TEST(RopeScaling, YarnFollowsHf) {
  struct Case {
    double base;
    int dim;
    double factor, orig, beta_fast, beta_slow;
    bool truncate;
  };
  for (const Case c :
       {Case{10000, 128, 4, 4096, 32, 1, true}, Case{1e6, 128, 4, 32768, 32, 1, true},
        Case{10000, 64, 16, 2048, 32, 1, false}, Case{500000, 96, 8, 8192, 16, 2, true},
        Case{10000, 24, 32, 1024, 32, 1, true}}) {
    const std::string spec = fmt::format(
        "rope(theta={}) + yarn(factor={}, original={}, beta_fast={}, beta_slow={}, "
        "truncate={})",
        c.base, c.factor, c.orig, c.beta_fast, c.beta_slow, c.truncate);
    SCOPED_TRACE(spec);
    const auto m = build_mechanism(spec, c.dim, 1);
    const Yarn y = hf_yarn(c.base, c.dim, c.factor, c.orig, c.beta_fast, c.beta_slow, c.truncate);
    expect_rel(freqs(m), y.inv_freq, kTol, "yarn");
    EXPECT_NEAR(attention_factor(m, 1.0), y.attention_factor, 1e-15);
    EXPECT_NEAR(attention_factor(m, 1e6), 0.1 * std::log(c.factor) + 1, 1e-15);
    // below the range: kept; above: divided by the factor (exactly)
    const auto plain = freqs(build_mechanism(fmt::format("rope(theta={})", c.base), c.dim, 1));
    for (int k = 0; k < c.dim / 2; ++k) {
      if (k <= y.low) {
        EXPECT_EQ(freqs(m)[k], plain[k]) << k;
      }
      if (k >= y.high) {
        EXPECT_EQ(freqs(m)[k], plain[k] / c.factor) << k;
      }
    }
  }
  // the correction range of the common case, by hand: dim 128, base 1e4, L0 4096
  const Yarn y = hf_yarn(10000, 128, 4, 4096);
  EXPECT_EQ(y.low, 20);
  EXPECT_EQ(y.high, 46);
  // DeepSeek's mscale / mscale_all_dim, and an explicit attention factor
  const auto ds = build_mechanism(
      "rope + yarn(factor=40, original=4096, mscale=0.707, mscale_all_dim=1)", 64, 1);
  EXPECT_NEAR(attention_factor(ds, 1),
              hf_yarn(10000, 64, 40, 4096, 32, 1, true, 0.707, 1).attention_factor, 1e-15);
  const auto ds1 =
      build_mechanism("rope + yarn(factor=40, original=4096, mscale=1, mscale_all_dim=1)", 64, 1);
  EXPECT_EQ(attention_factor(ds1, 1), 1.0);
  const auto af = build_mechanism("rope + yarn(factor=4, attention_factor=0.9)", 64, 1);
  EXPECT_EQ(attention_factor(af, 1), 0.9);
}

TEST(RopeScaling, Llama3FollowsHf) {
  // Llama 3.1: factor 8, low 1, high 4, L0 8192, base 500000
  const auto m = build_mechanism(
      "rope(theta=500000) + llama3(factor=8, original=8192, low_freq_factor=1, "
      "high_freq_factor=4)",
      128, 1);
  const auto want = hf_llama3(500000, 128, 8, 1, 4, 8192);
  expect_rel(freqs(m), want, kTol, "llama3");
  const auto plain = freqs(build_mechanism("rope(theta=500000)", 128, 1));
  int kept = 0, scaled = 0, smooth = 0;
  for (size_t k = 0; k < plain.size(); ++k) {
    const double wl = 2 * kPi / plain[k];
    if (wl < 8192.0 / 4) {
      EXPECT_EQ(freqs(m)[k], plain[k]);  // high frequencies are the identity
      ++kept;
    } else if (wl > 8192.0) {
      EXPECT_EQ(freqs(m)[k], plain[k] / 8);
      ++scaled;
    } else {
      ++smooth;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(scaled, 0);
  EXPECT_GT(smooth, 0);
  EXPECT_EQ(attention_factor(m, 1e6), 1.0);
}

TEST(RopeScaling, LongRopeFollowsHf) {
  std::vector<double> sf, lf;
  for (int i = 0; i < 8; ++i) {
    sf.push_back(1.0 + 0.01 * i);
    lf.push_back(1.0 + 0.5 * i * i);
  }
  const std::string spec = fmt::format(
      "rope(theta=10000) + longrope(factor=32, original=4096, short_factor={}, "
      "long_factor={})",
      fmt::join(sf, "/"), fmt::join(lf, "/"));
  const auto m = build_mechanism(spec, 16, 1);
  EXPECT_TRUE(m.rope_scaling.dynamic());
  expect_rel(freqs(m), hf_longrope(10000, 16, sf), kTol, "as built");
  expect_rel(freqs(scaled_for_length(m, 4096)), hf_longrope(10000, 16, sf), kTol, "T = L0");
  expect_rel(freqs(scaled_for_length(m, 4097)), hf_longrope(10000, 16, lf), kTol, "T > L0");
  // HF: sqrt(1 + ln(factor) / ln(original)), at every length
  const double want = std::sqrt(1 + std::log(32.0) / std::log(4096.0));
  EXPECT_NEAR(attention_factor(m, 10), want, 1e-15);
  EXPECT_NEAR(attention_factor(m, 1e5), want, 1e-15);
  // short factors of 1: the identity up to the original length
  const auto one =
      build_mechanism("rope + longrope(factor=4, original=1024, short_factor=1)", 16, 1);
  expect_rel(freqs(scaled_for_length(one, 1024)), freqs(build_mechanism("rope", 16, 1)), 0,
             "identity");
  expect_input_error([] { build_mechanism("rope + longrope(short_factor=1/2/3)", 16, 1); },
                     {"longrope", "short_factor", "3 values", "8 frequencies"});
}

TEST(RopeScaling, PjVariantsFollowSpec34) {
  // hd = 24, L = 1024, base 1e4 (PJ-RoPE 3.4): effective NTK bases 21,301 / 96,647 / 438,512
  const auto ntk = build_mechanism("rope + pj_dynamic_ntk(L=1024)", 24, 1);
  const double bases[] = {21301, 96647, 438512};
  const double lengths[] = {2048, 8192, 32768};
  for (int i = 0; i < 3; ++i) {
    const auto w = freqs(scaled_for_length(ntk, lengths[i]));
    // w_1 = base'^(-1/half), half = 12
    EXPECT_NEAR(std::pow(w[1], -12.0), bases[i], 0.5) << lengths[i];
    const double b = 10000 * std::pow(lengths[i] / 1024, 24.0 / 22.0);
    std::vector<double> want;
    for (int k = 0; k < 12; ++k) want.push_back(std::pow(b, -k / 12.0));
    expect_rel(w, want, kTol, "pj_dynamic_ntk");
  }
  // pj_pi: positions (L-1)/(T-1) when T > L, i.e. omega times that ratio
  const auto pi = build_mechanism("rope + pj_pi(L=1024)", 24, 1);
  auto want = hf_inv_freq(10000, 24);
  for (auto& x : want) x *= 1023.0 / 4095.0;
  expect_rel(freqs(scaled_for_length(pi, 4096)), want, kTol, "pj_pi");
  // pj_yarn: ramp on rotations, linear in the rotation count, mscale 1 + 0.1 ln s
  const auto yarn = build_mechanism("rope + pj_yarn(L=1024)", 24, 1);
  const double T = 32768, s = T / 1024;
  std::vector<double> wy;
  for (double f : hf_inv_freq(10000, 24)) {
    const double rot = 1024 * f / (2 * kPi), w = std::clamp((rot - 1) / 31, 0.0, 1.0);
    wy.push_back((f / s) * (1 - w) + f * w);
  }
  expect_rel(freqs(scaled_for_length(yarn, T)), wy, kTol, "pj_yarn");
  EXPECT_NEAR(attention_factor(yarn, T), 1.347, 5e-4);
  EXPECT_NEAR(attention_factor(yarn, T), 1 + 0.1 * std::log(32.0), 1e-15);
  // every variant equals plain RoPE at T <= L
  for (const auto* m : {&ntk, &pi, &yarn})
    for (double t : {1.0, 512.0, 1024.0}) {
      expect_rel(freqs(scaled_for_length(*m, t)), freqs(build_mechanism("rope", 24, 1)), 0,
                 m->spec);
      EXPECT_EQ(attention_factor(*m, t), 1.0);
    }
}

// The rules act on every rotary family's grid: Jordan's prefix grid theta^(-2k/hd), the span
// grid theta^(-2km/hd), damped RoPE, partial RoPE's rotated dims, direct sums (the real Jordan
// half is untouched).
TEST(RopeScaling, EveryRotaryFamily) {
  {
    const auto m = build_mechanism("jordan(m=2, regime=raw) + ntk(factor=4)", 64, 1);
    auto want = hf_inv_freq(10000 * std::pow(4.0, 64.0 / 62.0), 64);
    want.resize(16);  // order-2 blocks take the first hd/4 entries of the grid
    expect_rel(freqs(m), want, kTol, "jordan prefix");
  }
  {
    const auto m = build_mechanism("jordan(m=2, grid=span) + ntk(factor=4)", 64, 1);
    expect_rel(freqs(m), hf_inv_freq(10000 * std::pow(4.0, 32.0 / 30.0), 32), kTol, "span");
  }
  {
    const auto m =
        build_mechanism("partial_rope(fraction=0.5) + yarn(factor=4, original=64)", 64, 1);
    expect_rel(freqs(m), hf_yarn(10000, 32, 4, 64).inv_freq, kTol, "partial (rotary_dim 32)");
  }
  {
    const auto m = build_mechanism("direct_sum + linear(factor=2)", 32, 1);
    auto want = hf_inv_freq(10000, 16);
    for (auto& x : want) x /= 2;
    expect_rel(freqs(m, 0), want, kTol, "direct sum, RoPE half");
    for (double w : m.segments().at(1).omega) EXPECT_EQ(w, 0.0);
  }
  {
    const auto m = build_mechanism("damped_rope + llama3(original=512)", 32, 1);
    const auto want = hf_llama3(10000, 32, 4, 1, 4, 512);
    expect_rel(freqs(m), std::vector<double>(want.begin(), want.begin() + 8), kTol, "damped");
  }
  // signs are kept: RoPE's sense stores -omega, the paper's sense (direction=paper) +omega
  const auto r = build_mechanism("rope + linear(factor=2)", 8, 1);
  const auto j = build_mechanism("jordan(m=1, direction=paper) + linear(factor=2)", 8, 1);
  EXPECT_LT(r.segments()[0].omega[0], 0);
  EXPECT_GT(j.segments()[0].omega[0], 0);
  // the order of the terms does not matter
  EXPECT_EQ(freqs(build_mechanism("yarn(factor=4) + rope", 64, 1)),
            freqs(build_mechanism("rope + yarn(factor=4)", 64, 1)));
  EXPECT_EQ(build_mechanism("yarn(factor=4) + rope", 64, 1).name, "rope");
}

TEST(RopeScaling, SpecErrors) {
  expect_input_error([] { build_mechanism("yarn(factor=4)", 64, 1); }, {"yarn", "no rotary term"});
  expect_input_error([] { build_mechanism("nope + linear", 64, 1); }, {"linear", "no rotary"});
  expect_input_error([] { build_mechanism("real_jordan + ntk", 64, 1); }, {"ntk", "no rotary"});
  expect_input_error([] { build_mechanism("rope + yarn + linear", 64, 1); },
                     {"linear", "already", "yarn"});
  expect_input_error([] { build_mechanism("rope + yarn(factor=0.5)", 64, 1); },
                     {"yarn", "factor", "0.5"});
  expect_input_error([] { build_mechanism("rope + yarn(beta_fast=1, beta_slow=32)", 64, 1); },
                     {"beta_fast", "beta_slow"});
  expect_input_error([] { build_mechanism("rope + llama3(low_freq_factor=4)", 64, 1); },
                     {"low_freq_factor", "high_freq_factor"});
  expect_input_error([] { build_mechanism("rope + yarn(factr=4)", 64, 1); },
                     {"unknown option", "factr", "beta_fast"});
  expect_input_error([] { build_mechanism("rope + pj_yarn(L=0)", 64, 1); }, {"pj_yarn", "L"});
  expect_input_error([] { build_mechanism("rope + longrope(long_factor=1/x)", 16, 1); },
                     {"long_factor", "1/x"});
  expect_input_error([] { build_mechanism("rope + yarn(truncate=maybe)", 64, 1); }, {"truncate"});
  expect_input_error([] { build_mechanism("rope + ntk", 2, 1); }, {"ntk", "grid"});
  // the canonical spec rebuilds the same mechanism
  const auto m = build_mechanism("rope + yarn(factor=4, original=2048)", 64, 1);
  EXPECT_EQ(freqs(build_mechanism(m.spec, 64, 1)), freqs(m));
}

// ---- JSON (HF rope_scaling dictionaries)
// ---------------------------------------------------------

TEST(RopeScalingJson, ModelConfigs) {
  // Llama 3.1
  auto r = parse_rope_scaling(std::string(
      R"({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_type": "llama3"})"));
  EXPECT_EQ(r.type, RopeScalingType::Llama3);
  EXPECT_EQ(r.factor, 8);
  EXPECT_EQ(r.original, 8192);
  const auto m =
      build_mechanism(fmt::format("rope(theta=500000) + {}", rope_scaling_spec(r)), 128, 1);
  expect_rel(freqs(m), hf_llama3(500000, 128, 8, 1, 4, 8192), kTol, "llama3 from JSON");
  // Qwen-style YaRN with the legacy key
  r = parse_rope_scaling(
      std::string(R"({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})"));
  EXPECT_EQ(r.type, RopeScalingType::Yarn);
  EXPECT_TRUE(r.truncate);
  EXPECT_EQ(rope_scaling_spec(r),
            "yarn(factor=4, original=32768, beta_fast=32, beta_slow=1, mscale=auto, "
            "mscale_all_dim=auto, attention_factor=auto, truncate=true)");
  // DeepSeek-V3-style YaRN
  r = parse_rope_scaling(std::string(
      R"({"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
          "original_max_position_embeddings": 4096, "type": "yarn", "truncate": false})"));
  EXPECT_EQ(*r.mscale, 1.0);
  EXPECT_FALSE(r.truncate);
  // dynamic NTK: HF takes the original length from max_position_embeddings
  r = parse_rope_scaling(std::string(R"({"type": "dynamic", "factor": 2.0})"), 4096.0);
  EXPECT_EQ(r.type, RopeScalingType::DynamicNtk);
  EXPECT_EQ(r.original, 4096);
  // Phi-3 longrope: factor = max_position_embeddings / original
  r = parse_rope_scaling(std::string(
                             R"({"type": "longrope", "short_factor": [1, 1], "long_factor": [2, 3],
              "original_max_position_embeddings": 4096})"),
                         131072.0);
  EXPECT_EQ(r.factor, 32);
  EXPECT_EQ(r.long_factor, (std::vector<double>{2, 3}));
  EXPECT_EQ(rope_scaling_spec(r),
            "longrope(factor=32, original=4096, short_factor=1/1, long_factor=2/3, "
            "attention_factor=auto)");
  // default / null: no rule
  EXPECT_EQ(parse_rope_scaling(std::string(R"({"rope_type": "default"})")).type,
            RopeScalingType::None);
  EXPECT_EQ(parse_rope_scaling(std::string("null")).type, RopeScalingType::None);
  EXPECT_EQ(rope_scaling_spec(std::string("null")), "");
  // our own names
  EXPECT_EQ(rope_scaling_spec(std::string(
                R"({"rope_type": "pj_yarn", "original_max_position_embeddings": 1024})")),
            "pj_yarn(L=1024)");
  EXPECT_EQ(rope_scaling_spec(std::string(R"({"rope_type": "linear", "factor": 2})")),
            "linear(factor=2)");
}

TEST(RopeScalingJson, Errors) {
  const auto bad = [](const char* text, std::initializer_list<const char*> parts,
                      std::optional<double> max_pos = {}) {
    SCOPED_TRACE(text);
    expect_input_error([&] { parse_rope_scaling(std::string(text), max_pos); }, parts);
  };
  bad(R"({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1024, "betafast": 3})",
      {"betafast", "yarn", "beta_fast"});
  bad(R"({"rope_type": "linear", "factor": 4, "beta_fast": 3})", {"beta_fast", "linear"});
  bad(R"({"rope_type": "superrope", "factor": 4})", {"unknown rope_type", "superrope", "yarn"});
  bad(R"({"factor": 4})", {"rope_type", "required"});
  bad(R"({"rope_type": "yarn", "type": "linear", "factor": 4})", {"disagree"});
  bad(R"({"rope_type": "linear"})", {"linear", "factor", "required"});
  bad(R"({"rope_type": "linear", "factor": "4"})", {"factor", "number"});
  bad(R"({"rope_type": "linear", "factor": true})", {"factor", "number"});
  bad(R"({"rope_type": "linear", "factor": 0.5})", {"linear", "factor", "0.5"});
  bad(R"({"rope_type": "dynamic", "factor": 2})", {"original_max_position_embeddings", "required"});
  bad(R"({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": -1})",
      {"original_max_position_embeddings"});
  bad(R"({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
          "truncate": "no"})",
      {"truncate"});
  bad(R"({"rope_type": "longrope", "factor": 4, "original_max_position_embeddings": 1024,
          "short_factor": [1, "a"], "long_factor": [1]})",
      {"short_factor", "not a number"});
  bad(R"({"rope_type": "longrope", "factor": 4, "original_max_position_embeddings": 1024,
          "short_factor": [1]})",
      {"long_factor", "required"});
  bad(R"({"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 8192,
          "low_freq_factor": 4, "high_freq_factor": 1})",
      {"low_freq_factor"});
  bad(R"({"rope_type": "yarn", "factor": 4)", {"not valid JSON"});
  bad(R"([1, 2])", {"JSON object"});
  bad(R"({"rope_type": 3})", {"rope_type", "string"});
}

// ---- verify and the attention paths -------------------------------------------------------------

TEST(RopeScaling, VerifyFindsTheRelativeLaw) {
  diag::VerifyOptions o;
  o.max_lag = 4096;
  o.positions = 24;
  o.heads = 2;
  o.head_dim = 32;
  for (const char* spec :
       {"rope + yarn(factor=8, original=512)", "rope + llama3(factor=8, original=512)",
        "rope + dynamic_ntk(factor=4, original=512)", "rope + pj_yarn(L=256)",
        "jordan(m=2, regime=raw) + pj_dynamic_ntk(L=256)",
        "jordan(m=2, regime=stabilized, L=256) + yarn(factor=4, original=256)"}) {
    SCOPED_TRACE(spec);
    for (const auto& r : diag::verify_spec(spec, o, {"f64", "f32"})) {
      const bool exact = std::string(spec).find("stabilized") == std::string::npos;
      if (r.dtype == "f64") {
        EXPECT_EQ(r.status, exact ? "PASS" : "APPROX") << r.reason;
      } else {
        EXPECT_NE(r.status, "FAIL") << r.reason;  // float32 rows report (INFO)
      }
    }
  }
}

namespace {

// attention of a mechanism against plain RoPE whose frequencies are set by hand, with the
// attention factor folded into the softmax scale
double attention_vs_plain(const std::string& spec, int64_t T, double want_factor) {
  const int64_t B = 1, H = 2, D = 16;
  const Mechanism m = build_mechanism(spec, D, H);
  const Mechanism at = scaled_for_length(m, static_cast<double>(T));
  Mechanism plain = build_mechanism("rope", D, H);
  plain.transforms[0].segments[0].omega = at.segments()[0].omega;
  const double af = attention_factor(m, static_cast<double>(T));
  EXPECT_NEAR(af, want_factor, 1e-12);
  std::mt19937_64 rng(5);
  std::normal_distribution<double> N01;
  std::vector<double> q(B * H * T * D), k(q.size()), v(q.size()), o1(q.size()), o2(q.size());
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = N01(rng);
  const kernels::AttentionDims dims{B, H, H, T, T, D};
  kernels::AttentionOptions opt;
  kernels::mechanism_attention_forward<double>(m, default_params(m), Layout::Interleaved, dims,
                                               q.data(), k.data(), v.data(), {}, opt, o1.data(),
                                               nullptr);
  opt.scale = af * af / std::sqrt(static_cast<double>(D));
  kernels::mechanism_attention_forward<double>(plain, default_params(plain), Layout::Interleaved,
                                               dims, q.data(), k.data(), v.data(), {}, opt,
                                               o2.data(), nullptr);
  double err = 0;
  for (size_t i = 0; i < o1.size(); ++i) err = std::max(err, std::abs(o1[i] - o2[i]));
  return err;
}

}  // namespace

TEST(RopeScaling, MechanismAttentionUsesTheCallLengthAndTheAttentionFactor) {
  EXPECT_LT(attention_vs_plain("rope + pj_yarn(L=16)", 64, 1 + 0.1 * std::log(4.0)), 1e-13);
  EXPECT_LT(attention_vs_plain("rope + pj_yarn(L=16)", 12, 1.0), 1e-13);
  EXPECT_LT(attention_vs_plain("rope + dynamic_ntk(factor=2, original=16)", 40, 1.0), 1e-13);
  EXPECT_LT(attention_vs_plain("rope + yarn(factor=4, original=16)", 40, 0.1 * std::log(4.0) + 1),
            1e-13);
  // and the dynamic rule does change the result with the length
  const Mechanism m = build_mechanism("rope + pj_dynamic_ntk(L=16)", 16, 1);
  EXPECT_NE(freqs(scaled_for_length(m, 64)), freqs(scaled_for_length(m, 32)));
}

TEST(RopeScaling, KvCacheTakesStaticAndFrozenRules) {
  using kernels::KvCache;
  const int64_t B = 1, H = 2, D = 16, T = 40;
  const Mechanism dyn = build_mechanism("rope + pj_yarn(L=16)", D, H);
  expect_input_error([&] { KvCache<double> c(dyn, default_params(dyn), B, H, H, D); },
                     {"dynamic", "pj_yarn", "scaled_for_length"});
  for (const Mechanism& m : {build_mechanism("rope + yarn(factor=4, original=16)", D, H),
                             scaled_for_length(dyn, static_cast<double>(T))}) {
    SCOPED_TRACE(m.spec);
    std::mt19937_64 rng(9);
    std::normal_distribution<double> N01;
    std::vector<double> q(B * H * T * D), k(q.size()), v(q.size()), full(q.size());
    for (auto* x : {&q, &k, &v})
      for (auto& e : *x) e = N01(rng);
    const ParamValues p = default_params(m);
    kernels::mechanism_attention_forward<double>(m, p, Layout::Interleaved, {B, H, H, T, T, D},
                                                 q.data(), k.data(), v.data(), {}, {}, full.data(),
                                                 nullptr);
    KvCache<double> cache(m, p, B, H, H, D);
    double err = 0;
    std::vector<double> kt(B * H * D), vt(kt.size()), qt(kt.size()), out(kt.size());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < D; ++e) {
          const size_t src = static_cast<size_t>((h * T + t) * D + e), dst = h * D + e;
          kt[dst] = k[src];
          vt[dst] = v[src];
          qt[dst] = q[src];
        }
      cache.append(kt, vt, static_cast<double>(t));
      cache.decode(qt, static_cast<double>(t), out);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < D; ++e)
          err = std::max(err, std::abs(out[h * D + e] - full[(h * T + t) * D + e]));
    }
    EXPECT_LT(err, 1e-12);
  }
}
