#include "core/rope_scaling.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "core/mechanism.hpp"
#include "core/parse.hpp"
#include "core/types.hpp"

namespace relpos {

namespace {

constexpr double kPi = 3.141592653589793238462643383279502884;
constexpr double kMaxFactor = 1e6;
constexpr double kMaxLength = 1e15;  // lengths stay exactly representable in float64

struct TypeName {
  RopeScalingType type;
  const char* name;
};
constexpr TypeName kTypes[] = {
    {RopeScalingType::None, "none"},
    {RopeScalingType::Linear, "linear"},
    {RopeScalingType::Ntk, "ntk"},
    {RopeScalingType::DynamicNtk, "dynamic_ntk"},
    {RopeScalingType::Yarn, "yarn"},
    {RopeScalingType::Llama3, "llama3"},
    {RopeScalingType::LongRope, "longrope"},
    {RopeScalingType::PjPi, "pj_pi"},
    {RopeScalingType::PjDynamicNtk, "pj_dynamic_ntk"},
    {RopeScalingType::PjYarn, "pj_yarn"},
};

bool pj(RopeScalingType t) {
  return t == RopeScalingType::PjPi || t == RopeScalingType::PjDynamicNtk ||
         t == RopeScalingType::PjYarn;
}

// The JSON keys each type reads (besides rope_type / type).
std::vector<std::string> keys_of(RopeScalingType t) {
  const std::string orig = "original_max_position_embeddings";
  switch (t) {
    case RopeScalingType::None:
      return {};
    case RopeScalingType::Linear:
    case RopeScalingType::Ntk:
      return {"factor"};
    case RopeScalingType::DynamicNtk:
      return {"factor", orig};
    case RopeScalingType::Yarn:
      return {"factor",           orig,      "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate"};
    case RopeScalingType::Llama3:
      return {"factor", orig, "low_freq_factor", "high_freq_factor"};
    case RopeScalingType::LongRope:
      return {"factor", orig, "short_factor", "long_factor", "attention_factor"};
    case RopeScalingType::PjPi:
    case RopeScalingType::PjDynamicNtk:
    case RopeScalingType::PjYarn:
      return {orig};
  }
  return {};
}

void check_finite(const char* rule, const char* key, double x, double lo, double hi,
                  bool open_lo = false) {
  const bool ok = std::isfinite(x) && (open_lo ? x > lo : x >= lo) && x <= hi;
  if (!ok)
    throw InputError(fmt::format("{}: {} must be in {}{:g}, {:g}], got {}", rule, key,
                                 open_lo ? "(" : "[", lo, hi, x));
}

std::string list_str(const std::vector<double>& v) {
  return fmt::format("{}", fmt::join(v, "/"));
}

// omega_k * ratio^(-2k/d): the grid entry k after the base change theta -> theta * ratio.
std::vector<double> rebase(const std::vector<double>& omega, const FrequencyGrid& g, double ratio) {
  std::vector<double> out(omega.size());
  for (size_t k = 0; k < omega.size(); ++k)
    out[k] = omega[k] * std::pow(ratio, -2.0 * static_cast<double>(k) / g.dim);
  return out;
}

const std::vector<double>& per_frequency(const char* rule, const char* key,
                                         const std::vector<double>& f, size_t n,
                                         std::vector<double>& scratch) {
  if (f.size() == n) return f;
  if (f.size() == 1) {
    scratch.assign(n, f[0]);
    return scratch;
  }
  throw InputError(fmt::format(
      "{}: {} has {} values, the rotary term has {} frequencies (give one per frequency, or one "
      "for all)",
      rule, key, f.size(), n));
}

}  // namespace

const char* rope_scaling_name(RopeScalingType t) {
  for (const auto& x : kTypes)
    if (x.type == t) return x.name;
  return "?";
}

bool RopeScaling::dynamic() const {
  return type == RopeScalingType::DynamicNtk || type == RopeScalingType::LongRope || pj(type);
}

void RopeScaling::validate() const {
  if (type == RopeScalingType::None) return;
  const char* n = rope_scaling_name(type);
  if (!pj(type)) check_finite(n, "factor", factor, 1.0, kMaxFactor);
  if (type != RopeScalingType::Linear && type != RopeScalingType::Ntk) {
    check_finite(n, pj(type) ? "L (original length)" : "original_max_position_embeddings", original,
                 1.0, kMaxLength);
    if (type == RopeScalingType::LongRope && !(original > 1.0))
      throw InputError(
          fmt::format("{}: original_max_position_embeddings must be > 1 (its log divides), got {}",
                      n, original));
  }
  if (type == RopeScalingType::Yarn) {
    check_finite(n, "beta_fast", beta_fast, 0.0, 1e12, true);
    check_finite(n, "beta_slow", beta_slow, 0.0, 1e12, true);
    if (beta_fast < beta_slow)
      throw InputError(fmt::format(
          "{}: beta_fast ({}) must be >= beta_slow ({}): beta_fast bounds the high frequencies", n,
          beta_fast, beta_slow));
    if (mscale) check_finite(n, "mscale", *mscale, 0.0, 1e3);
    if (mscale_all_dim) check_finite(n, "mscale_all_dim", *mscale_all_dim, 0.0, 1e3);
  }
  if (attention_factor) check_finite(n, "attention_factor", *attention_factor, 0.0, 1e3, true);
  if (type == RopeScalingType::Llama3) {
    check_finite(n, "low_freq_factor", low_freq_factor, 0.0, 1e6, true);
    check_finite(n, "high_freq_factor", high_freq_factor, 0.0, 1e6, true);
    if (!(low_freq_factor < high_freq_factor))
      throw InputError(fmt::format("{}: low_freq_factor ({}) must be below high_freq_factor ({})",
                                   n, low_freq_factor, high_freq_factor));
  }
  if (type == RopeScalingType::LongRope) {
    for (const auto* f : {&short_factor, &long_factor}) {
      const char* key = f == &short_factor ? "short_factor" : "long_factor";
      if (f->empty()) throw InputError(fmt::format("{}: {} is required", n, key));
      if (f->size() > (1u << 16))
        throw InputError(fmt::format("{}: {} has {} values", n, key, f->size()));
      for (double x : *f) check_finite(n, key, x, 0.0, kMaxFactor, true);
    }
  }
}

// ---- JSON
// ----------------------------------------------------------------------------------------

RopeScaling parse_rope_scaling(const nlohmann::json& j, std::optional<double> max_pos) {
  RopeScaling r;
  if (j.is_null()) return r;
  if (!j.is_object())
    throw InputError(
        fmt::format("rope_scaling: expected a JSON object, got {}", brief(j.dump(), 80)));
  std::string type;
  for (const char* key : {"rope_type", "type"})
    if (j.contains(key)) {
      if (!j[key].is_string())
        throw InputError(fmt::format("rope_scaling: {} must be a string, got {}", key,
                                     brief(j[key].dump(), 80)));
      const std::string t = j[key].get<std::string>();
      if (!type.empty() && t != type)
        throw InputError(
            fmt::format("rope_scaling: rope_type '{}' and type '{}' disagree", brief(type), t));
      type = t;
    }
  if (type.empty()) throw InputError("rope_scaling: rope_type (or the legacy type) is required");
  if (type == "dynamic") type = "dynamic_ntk";  // HF's name of dynamic NTK
  bool found = false;
  for (const auto& x : kTypes)
    if (type == x.name && x.type != RopeScalingType::None) {
      r.type = x.type;
      found = true;
    }
  if (type == "default" || type == "none") return r;
  if (!found) {
    std::vector<std::string> names{"default", "dynamic"};
    for (const auto& x : kTypes)
      if (x.type != RopeScalingType::None) names.push_back(x.name);
    throw InputError(fmt::format("rope_scaling: unknown rope_type '{}' (valid: {})", brief(type),
                                 fmt::join(names, ", ")));
  }
  const char* n = rope_scaling_name(r.type);
  const auto keys = keys_of(r.type);
  for (const auto& [k, v] : j.items()) {
    if (k == "rope_type" || k == "type") continue;
    if (std::find(keys.begin(), keys.end(), k) == keys.end())
      throw InputError(fmt::format("rope_scaling: key '{}' is not read by rope_type {} (valid: {})",
                                   brief(k), n, fmt::join(keys, ", ")));
  }
  const auto number = [&](const char* key) -> std::optional<double> {
    if (!j.contains(key) || j[key].is_null()) return std::nullopt;
    const auto& v = j[key];
    if (!v.is_number() || v.is_boolean())
      throw InputError(fmt::format("rope_scaling ({}): {} must be a number, got {}", n, key,
                                   brief(v.dump(), 80)));
    return v.get<double>();
  };
  const auto list = [&](const char* key) {
    std::vector<double> out;
    if (!j.contains(key) || j[key].is_null()) return out;
    const auto& v = j[key];
    if (!v.is_array())
      throw InputError(fmt::format("rope_scaling ({}): {} must be a list of numbers, got {}", n,
                                   key, brief(v.dump(), 80)));
    for (const auto& x : v) {
      if (!x.is_number() || x.is_boolean())
        throw InputError(fmt::format("rope_scaling ({}): {} holds {}, not a number", n, key,
                                     brief(x.dump(), 80)));
      out.push_back(x.get<double>());
    }
    return out;
  };
  const auto factor = number("factor");
  const auto original = number("original_max_position_embeddings");
  if (max_pos) check_finite(n, "max_position_embeddings", *max_pos, 1.0, kMaxLength);
  if (!pj(r.type)) {
    if (factor) {
      r.factor = *factor;
    } else if (r.type == RopeScalingType::LongRope && original && max_pos) {
      r.factor = *max_pos / *original;  // HF: max_position_embeddings / original
    } else {
      throw InputError(fmt::format("rope_scaling ({}): factor is required", n));
    }
  }
  if (r.type != RopeScalingType::Linear && r.type != RopeScalingType::Ntk) {
    if (original) {
      r.original = *original;
    } else if (max_pos && r.type != RopeScalingType::Llama3) {
      r.original = *max_pos;  // HF falls back to the config's max_position_embeddings
    } else {
      throw InputError(fmt::format(
          "rope_scaling ({}): original_max_position_embeddings is required (HF falls back to the "
          "model config's max_position_embeddings: pass it)",
          n));
    }
  }
  if (const auto x = number("beta_fast")) r.beta_fast = *x;
  if (const auto x = number("beta_slow")) r.beta_slow = *x;
  r.mscale = number("mscale");
  r.mscale_all_dim = number("mscale_all_dim");
  r.attention_factor = number("attention_factor");
  if (const auto x = number("low_freq_factor")) r.low_freq_factor = *x;
  if (const auto x = number("high_freq_factor")) r.high_freq_factor = *x;
  r.short_factor = list("short_factor");
  r.long_factor = list("long_factor");
  if (j.contains("truncate") && !j["truncate"].is_null()) {
    if (!j["truncate"].is_boolean())
      throw InputError(fmt::format("rope_scaling ({}): truncate must be true or false, got {}", n,
                                   brief(j["truncate"].dump(), 80)));
    r.truncate = j["truncate"].get<bool>();
  }
  r.validate();
  return r;
}

RopeScaling parse_rope_scaling(const std::string& text, std::optional<double> max_pos) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("rope_scaling: not valid JSON ({}): {}", e.what(), brief(text)));
  }
  return parse_rope_scaling(j, max_pos);
}

std::string rope_scaling_spec(const RopeScaling& r) {
  if (r.type == RopeScalingType::None) return "";
  std::vector<std::string> kv;
  const auto opt = [](const std::optional<double>& x) {
    return x ? fmt::format("{}", *x) : std::string("auto");
  };
  if (pj(r.type)) {
    kv.push_back(fmt::format("L={}", r.original));
  } else {
    kv.push_back(fmt::format("factor={}", r.factor));
    if (r.type != RopeScalingType::Linear && r.type != RopeScalingType::Ntk)
      kv.push_back(fmt::format("original={}", r.original));
  }
  switch (r.type) {
    case RopeScalingType::Yarn:
      kv.push_back(fmt::format("beta_fast={}", r.beta_fast));
      kv.push_back(fmt::format("beta_slow={}", r.beta_slow));
      kv.push_back(fmt::format("mscale={}", opt(r.mscale)));
      kv.push_back(fmt::format("mscale_all_dim={}", opt(r.mscale_all_dim)));
      kv.push_back(fmt::format("attention_factor={}", opt(r.attention_factor)));
      kv.push_back(fmt::format("truncate={}", r.truncate));
      break;
    case RopeScalingType::Llama3:
      kv.push_back(fmt::format("low_freq_factor={}", r.low_freq_factor));
      kv.push_back(fmt::format("high_freq_factor={}", r.high_freq_factor));
      break;
    case RopeScalingType::LongRope:
      kv.push_back(fmt::format("short_factor={}", list_str(r.short_factor)));
      kv.push_back(fmt::format("long_factor={}", list_str(r.long_factor)));
      kv.push_back(fmt::format("attention_factor={}", opt(r.attention_factor)));
      break;
    default:
      break;
  }
  return fmt::format("{}({})", rope_scaling_name(r.type), fmt::join(kv, ", "));
}

std::string rope_scaling_spec(const std::string& json_text, std::optional<double> max_pos) {
  return rope_scaling_spec(parse_rope_scaling(json_text, max_pos));
}

// ---- The rules
// -----------------------------------------------------------------------------------

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

std::vector<double> scaled_frequencies(const RopeScaling& r, const std::vector<double>& omega,
                                       const FrequencyGrid& g, double length) {
  const char* n = rope_scaling_name(r.type);
  const size_t N = omega.size();
  const double s = r.factor, L = r.original;
  const bool needs_grid = r.type == RopeScalingType::Ntk || r.type == RopeScalingType::DynamicNtk ||
                          r.type == RopeScalingType::Yarn ||
                          r.type == RopeScalingType::PjDynamicNtk;
  if (needs_grid && !(g.valid() && g.dim > 2 && g.theta > 1.0))
    throw InputError(fmt::format(
        "{}: the rule is defined on a frequency grid theta^(-2k/d) with d > 2, which this rotary "
        "segment does not have",
        n));
  if (needs_grid && N > static_cast<size_t>(g.dim / 2))
    throw InputError(fmt::format("{}: {} frequencies on a grid of dim {}", n, N, g.dim));
  std::vector<double> out = omega;
  switch (r.type) {
    case RopeScalingType::None:
      break;
    case RopeScalingType::Linear:  // HF: inv_freq /= factor (positions m -> m / factor)
      for (auto& w : out) w /= s;
      break;
    case RopeScalingType::Ntk:  // base' = base * factor^(d/(d-2))
      out = rebase(omega, g, std::pow(s, g.dim / (g.dim - 2.0)));
      break;
    case RopeScalingType::DynamicNtk:  // HF: identity up to the original length
      if (length > L)
        out = rebase(omega, g, std::pow(s * length / L - (s - 1.0), g.dim / (g.dim - 2.0)));
      break;
    case RopeScalingType::PjDynamicNtk:
      if (length > L) out = rebase(omega, g, std::pow(length / L, g.dim / (g.dim - 2.0)));
      break;
    case RopeScalingType::PjPi:
      if (length > L)
        for (auto& w : out) w *= (L - 1.0) / (length - 1.0);
      break;
    case RopeScalingType::Yarn: {
      // HF find_correction_dim / find_correction_range: the (real) grid index where the
      // original context holds `rot` rotations, floored / ceiled when truncating
      const double d = g.dim;
      const auto dim_of = [&](double rot) {
        return d * std::log(L / (rot * 2.0 * kPi)) / (2.0 * std::log(g.theta));
      };
      double low = dim_of(r.beta_fast), high = dim_of(r.beta_slow);
      if (r.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, d - 1.0);
      if (low == high) high += 0.001;  // HF: prevent the singularity
      for (size_t k = 0; k < N; ++k) {
        const double ramp = std::clamp((static_cast<double>(k) - low) / (high - low), 0.0, 1.0);
        // ramp 0: extrapolation (unchanged), ramp 1: interpolation (omega / s)
        out[k] = omega[k] / s * ramp + omega[k] * (1.0 - ramp);
      }
      break;
    }
    case RopeScalingType::PjYarn:
      if (length > L) {
        const double sT = length / L;
        for (size_t k = 0; k < N; ++k) {
          const double rot = L * omega[k] / (2.0 * kPi);
          const double w = std::clamp((rot - 1.0) / (32.0 - 1.0), 0.0, 1.0);
          out[k] = omega[k] / sT * (1.0 - w) + omega[k] * w;
        }
      }
      break;
    case RopeScalingType::Llama3: {
      const double low_wavelen = L / r.low_freq_factor, high_wavelen = L / r.high_freq_factor;
      for (size_t k = 0; k < N; ++k) {
        if (omega[k] == 0.0) continue;  // infinite wavelength: 0 / factor
        const double wavelen = 2.0 * kPi / omega[k];
        if (wavelen < high_wavelen) continue;
        if (wavelen > low_wavelen) {
          out[k] = omega[k] / s;
        } else {
          const double smooth =
              (L / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
          out[k] = (1.0 - smooth) * omega[k] / s + smooth * omega[k];
        }
      }
      break;
    }
    case RopeScalingType::LongRope: {
      std::vector<double> scratch;
      const bool long_ctx = length > L;
      const auto& f = per_frequency(n, long_ctx ? "long_factor" : "short_factor",
                                    long_ctx ? r.long_factor : r.short_factor, N, scratch);
      for (size_t k = 0; k < N; ++k) out[k] = omega[k] / f[k];
      break;
    }
  }
  return out;
}

double attention_factor(const RopeScaling& r, double length) {
  switch (r.type) {
    case RopeScalingType::Yarn:
      if (r.attention_factor) return *r.attention_factor;
      // HF: `if mscale and mscale_all_dim` (both given and non-zero)
      if (r.mscale && r.mscale_all_dim && *r.mscale != 0.0 && *r.mscale_all_dim != 0.0)
        return yarn_get_mscale(r.factor, *r.mscale) / yarn_get_mscale(r.factor, *r.mscale_all_dim);
      return yarn_get_mscale(r.factor);
    case RopeScalingType::LongRope:
      if (r.attention_factor) return *r.attention_factor;
      if (r.factor <= 1.0) return 1.0;
      return std::sqrt(1.0 + std::log(r.factor) / std::log(r.original));
    case RopeScalingType::PjYarn:
      return length > r.original ? 1.0 + 0.1 * std::log(length / r.original) : 1.0;
    default:
      return 1.0;
  }
}

// ---- Mechanisms
// ----------------------------------------------------------------------------------

namespace {

TransformTerm* position_term_of(Mechanism& m) {
  for (auto& t : m.transforms)
    if (t.position_driven()) return &t;
  return nullptr;
}

void set_segments(Mechanism& m, double length) {
  auto& st = m.rope_scaling;
  TransformTerm* t = position_term_of(m);
  for (size_t i = 0; i < t->segments.size(); ++i) {
    auto& seg = t->segments[i];
    const auto& base = st.base_omega[i];
    // segments without rotation (real Jordan blocks) have nothing to scale
    if (std::all_of(base.begin(), base.end(), [](double w) { return w == 0.0; })) continue;
    const auto w = scaled_frequencies(st.rule, st.base_omega[i], seg.grid, length);
    for (size_t b = 0; b < w.size(); ++b) seg.omega[b] = std::copysign(w[b], seg.omega[b]);
  }
}

}  // namespace

void apply_rope_scaling(Mechanism& m) {
  auto& st = m.rope_scaling;
  if (!st.active()) return;
  const char* n = rope_scaling_name(st.rule.type);
  st.rule.validate();
  TransformTerm* t = position_term_of(m);
  bool rotary = false;
  if (t)
    for (const auto& s : t->segments)
      for (double w : s.omega) rotary = rotary || w != 0.0;
  if (!rotary)
    throw InputError(fmt::format(
        "{}: the spec has no rotary term to extend (compose it with one: rope + {}(...))", n, n));
  st.base_omega.clear();
  for (auto& s : t->segments) {
    std::vector<double> mag(s.omega.size());
    for (size_t b = 0; b < mag.size(); ++b) mag[b] = std::abs(s.omega[b]);
    st.base_omega.push_back(std::move(mag));
  }
  set_segments(m, st.rule.original);
}

Mechanism scaled_for_length(const Mechanism& m, double length) {
  if (!std::isfinite(length))
    throw InputError(fmt::format("context length must be finite, got {}", length));
  if (!m.rope_scaling.dynamic()) return m;
  Mechanism out = m;
  set_segments(out, length);
  out.rope_scaling.frozen_length = length;
  return out;
}

double attention_factor(const Mechanism& m, double length) {
  const auto& st = m.rope_scaling;
  if (!st.active()) return 1.0;
  return attention_factor(st.rule, st.frozen_length ? *st.frozen_length : length);
}

double context_length(const double* positions, size_t n) {
  if (n == 0) return 0.0;
  double hi = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < n; ++i) hi = std::max(hi, positions[i]);
  return hi + 1.0;
}

double scaled_softmax_scale(double scale, int head_dim, double factor) {
  const double base = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  return base * factor * factor;
}

}  // namespace relpos
