// Context-extension rules as spec terms composed with a rotary term: `rope + yarn(factor=4,
// original=1024)`, `jordan(m=2) + pj_dynamic_ntk(L=1024)`. Each records the rule
// (core/rope_scaling.hpp) on the mechanism; the registry applies it to the position-driven term's
// frequencies once every term is built (apply_rope_scaling), so the order of the terms does not
// matter. Formulas and sources: docs/rope-scaling.md.
#include "core/mechanisms/family.hpp"
#include "core/rope_scaling.hpp"

namespace relpos::mechanisms {

namespace {

std::optional<double> optional_num(const Args& a, const std::string& k) {
  if (a.is_auto(k)) return std::nullopt;
  return a.num(k);
}

// '/'-separated positive numbers (one per frequency, or one for all); no 64-value cap.
std::vector<double> factor_list(const Args& a, const std::string& k) {
  std::vector<double> out;
  const std::string& s = a.str(k);
  size_t p = 0;
  while (p <= s.size()) {
    size_t e = s.find('/', p);
    if (e == std::string::npos) e = s.size();
    const auto x = parse_finite_double(std::string_view(s).substr(p, e - p));
    if (!x || !(*x > 0))
      throw InputError(fmt::format("{}: option {}='{}' must be positive numbers separated by '/'",
                                   a.term(), k, brief(s)));
    out.push_back(*x);
    if (out.size() > static_cast<size_t>(kMaxHeadDim / 2))
      throw InputError(
          fmt::format("{}: option {} has more than {} values", a.term(), k, kMaxHeadDim / 2));
    p = e + 1;
  }
  return out;
}

const OptionInfo kFactor{"factor", "4", "extension factor s >= 1 (HF factor)"};
const OptionInfo kOriginal{"original", "1024",
                           "original context length (HF original_max_position_embeddings)"};
const OptionInfo kPjL{"L", "1024", "training length: the rule acts only on calls with T > L"};

TermDef rule(RopeScalingType type, std::string summary, std::string exactness, std::string paper,
             std::vector<OptionInfo> opts) {
  MechanismInfo info{rope_scaling_name(type),
                     "scaling",
                     std::move(summary),
                     std::move(exactness),
                     std::move(paper),
                     std::move(opts),
                     {}};
  return {std::move(info), [type](const Args& a, TermBuilder& b) {
            auto& st = b.m.rope_scaling;
            if (st.active())
              throw InputError(fmt::format("{}: the spec already has the context-extension rule {}",
                                           a.term(), rope_scaling_name(st.rule.type)));
            RopeScaling r;
            r.type = type;
            const bool pj = type == RopeScalingType::PjPi ||
                            type == RopeScalingType::PjDynamicNtk ||
                            type == RopeScalingType::PjYarn;
            if (pj) {
              r.original = a.positive("L");
            } else {
              r.factor = a.num("factor");
              if (a.has("original")) r.original = a.num("original");
            }
            if (type == RopeScalingType::Yarn) {
              r.beta_fast = a.num("beta_fast");
              r.beta_slow = a.num("beta_slow");
              r.mscale = optional_num(a, "mscale");
              r.mscale_all_dim = optional_num(a, "mscale_all_dim");
              r.truncate = a.flag("truncate");
            }
            if (a.has("attention_factor")) r.attention_factor = optional_num(a, "attention_factor");
            if (type == RopeScalingType::Llama3) {
              r.low_freq_factor = a.num("low_freq_factor");
              r.high_freq_factor = a.num("high_freq_factor");
            }
            if (type == RopeScalingType::LongRope) {
              r.short_factor = factor_list(a, "short_factor");
              r.long_factor = factor_list(a, "long_factor");
            }
            try {
              r.validate();
            } catch (const InputError& e) {
              throw InputError(fmt::format("{} (spec term {})", e.what(), a.term()));
            }
            st.rule = std::move(r);
          }};
}

}  // namespace

std::vector<TermDef> context_extension_family() {
  const OptionInfo attention{"attention_factor", "auto",
                             "factor on q and k (logits scale by its square); auto: the rule's"};
  std::vector<TermDef> d;
  d.push_back(rule(RopeScalingType::Linear,
                   "position interpolation of the rotary term: omega / s (HF linear)", "exact",
                   "PI (Chen et al. 2023)", {kFactor}));
  d.push_back(rule(RopeScalingType::Ntk,
                   "static NTK-aware base: theta' = theta s^(d/(d-2)) on the rotary grid", "exact",
                   "NTK-aware (bloc97 2023)", {kFactor}));
  d.push_back(rule(RopeScalingType::DynamicNtk,
                   "dynamic NTK (HF dynamic): theta' = theta (s T/L0 - (s-1))^(d/(d-2)) when T > "
                   "L0, T = max position + 1 of the call",
                   "exact per call", "HF transformers; Peng et al. 2023 (YaRN) 3.3",
                   {kFactor, kOriginal}));
  d.push_back(rule(RopeScalingType::Yarn,
                   "YaRN: omega/s below beta_slow rotations over L0, unchanged above beta_fast, "
                   "index ramp between; attention factor 0.1 ln s + 1",
                   "exact", "YaRN (Peng et al. 2023); HF yarn",
                   {kFactor,
                    kOriginal,
                    {"beta_fast", "32", "rotations over L0 above which omega is kept"},
                    {"beta_slow", "1", "rotations over L0 below which omega is divided by s"},
                    {"mscale", "auto", "DeepSeek mscale (with mscale_all_dim)"},
                    {"mscale_all_dim", "auto", "DeepSeek mscale_all_dim"},
                    attention,
                    {"truncate", "true", "floor/ceil the correction range (HF truncate)"}}));
  d.push_back(
      rule(RopeScalingType::Llama3,
           "Llama 3.1: wavelengths above L0/low_freq_factor get omega/s, below "
           "L0/high_freq_factor are kept, smooth interpolation between",
           "exact", "Llama 3 (Meta 2024); HF llama3",
           {kFactor,
            kOriginal,
            {"low_freq_factor", "1", "L0 / low_freq_factor: longest kept-by-band wavelength"},
            {"high_freq_factor", "4", "L0 / high_freq_factor: shortest scaled wavelength"}}));
  d.push_back(rule(RopeScalingType::LongRope,
                   "LongRoPE: omega_k / short_factor_k for T <= L0, / long_factor_k beyond; "
                   "attention factor sqrt(1 + ln s / ln L0)",
                   "exact per call", "LongRoPE (Ding et al. 2024); HF longrope",
                   {kFactor,
                    kOriginal,
                    {"short_factor", "1", "per-frequency factors ('/'-separated, or one for all)"},
                    {"long_factor", "4", "per-frequency factors beyond L0"},
                    attention}));
  d.push_back(rule(RopeScalingType::PjPi,
                   "PJ rope_pi: positions times (L-1)/(T-1) when T > L (as omega scaling)",
                   "exact per call", "PJ-RoPE 3.4 (apply_rope)", {kPjL}));
  d.push_back(rule(RopeScalingType::PjDynamicNtk,
                   "PJ rope_ntk: theta' = theta (T/L)^(d/(d-2)) when T > L (plain ratio)",
                   "exact per call", "PJ-RoPE 3.4 (apply_rope)", {kPjL}));
  d.push_back(rule(RopeScalingType::PjYarn,
                   "PJ rope_yarn: ramp on rotations L omega/(2 pi) in [1, 32], mscale 1 + 0.1 "
                   "ln(T/L) on q and k, when T > L",
                   "exact per call", "PJ-RoPE 3.4 (apply_rope)", {kPjL}));
  return d;
}

}  // namespace relpos::mechanisms
