// Context extension ("RoPE scaling") of the rotary frequencies of any position-driven Jordan-block
// term: position interpolation, NTK-aware and dynamic NTK, YaRN, Llama-3 and LongRoPE (the rules
// of Hugging Face transformers' modeling_rope_utils.py and their papers), and the PJ paper's own
// variants of its `apply_rope` (spec/pj-rope.md 3.4). Formulas and sources: docs/rope-scaling.md.
//
// A rule is a spec term composed with a rotary term (`rope + yarn(factor=4, original=1024)`) or a
// `rope_scaling` dictionary of a model config read from JSON (`rope_scaling_spec`). It rescales
// the per-block frequencies omega_b of the segments; YaRN and LongRoPE also give an attention
// factor that multiplies both q and k (HF convention: logits scale by its square). Static rules
// are applied once when the mechanism is built; dynamic ones depend on the context length of the
// call (max position + 1, HF convention) and are re-evaluated per call (`scaled_for_length`).
// Everything here is float64.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace relpos {

struct Mechanism;

enum class RopeScalingType {
  None,
  Linear,        // position interpolation (Chen et al. 2023; HF "linear"): omega / factor
  Ntk,           // static NTK-aware base change (bloc97): base' = base factor^(d/(d-2))
  DynamicNtk,    // HF "dynamic": base' = base (factor T/L - (factor - 1))^(d/(d-2)) when T > L
  Yarn,          // YaRN (Peng et al. 2023; HF "yarn"): index ramp between beta_fast and beta_slow
  Llama3,        // Llama 3.1 (HF "llama3"): wavelength bands with a smooth interpolation
  LongRope,      // LongRoPE (Ding et al. 2024; HF "longrope"): per-frequency short/long factors
  PjPi,          // PJ rope_pi: positions (L-1)/(T-1) when T > L
  PjDynamicNtk,  // PJ rope_ntk: base' = base (T/L)^(d/(d-2)) when T > L (plain ratio)
  PjYarn,        // PJ rope_yarn: ramp on rotations, mscale 1 + 0.1 ln(T/L) when T > L
};

// The spec term name of a rule ("linear", "dynamic_ntk", "yarn", "pj_dynamic_ntk", ...).
const char* rope_scaling_name(RopeScalingType t);

// A context-extension rule with Hugging Face's key names. Optional values left empty take the
// rule's documented default (docs/rope-scaling.md).
struct RopeScaling {
  RopeScalingType type = RopeScalingType::None;
  double factor = 1.0;    // s: the extension factor (not used by the PJ variants)
  double original = 0.0;  // original_max_position_embeddings (PJ: the training length L)
  double beta_fast = 32.0, beta_slow = 1.0;  // YaRN: rotation counts that bound the ramp
  std::optional<double> mscale, mscale_all_dim, attention_factor;
  bool truncate = true;  // YaRN: floor/ceil the correction range (HF's default)
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // Llama 3
  std::vector<double> short_factor, long_factor;         // LongRoPE: one per frequency (or one)

  // Depends on the context length of the call (dynamic NTK, LongRoPE's short/long switch, the PJ
  // variants); static rules are applied once.
  bool dynamic() const;
  // Throws InputError naming the rule and the bad value.
  void validate() const;
};

// Parses a `rope_scaling` dictionary (HF key names: rope_type or the legacy type, factor,
// original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim,
// attention_factor, low_freq_factor, high_freq_factor, short_factor, long_factor, truncate; our
// own types ntk, pj_pi, pj_dynamic_ntk, pj_yarn take factor / original_max_position_embeddings).
// Unknown keys, keys the type does not use and bad values are InputErrors naming them. HF reads
// max_position_embeddings from the model config outside the dictionary: pass it where the
// dictionary relies on it (dynamic without original_max_position_embeddings, longrope without
// factor). `{"rope_type": "default"}` and null give type None.
RopeScaling parse_rope_scaling(const nlohmann::json& j,
                               std::optional<double> max_position_embeddings = {});
RopeScaling parse_rope_scaling(const std::string& json_text,
                               std::optional<double> max_position_embeddings = {});

// The rule as a spec term ("yarn(factor=4, original=32768, ...)"); empty for None. Compose it with
// a rotary term: build_mechanism("rope(theta=1e6) + " + rope_scaling_spec(r), ...).
std::string rope_scaling_spec(const RopeScaling& r);
// JSON text of a rope_scaling dictionary -> spec term (parse_rope_scaling + rope_scaling_spec).
std::string rope_scaling_spec(const std::string& json_text,
                              std::optional<double> max_position_embeddings = {});

// A spec with a Hugging Face rope dictionary applied, 4.x `rope_scaling` or 5.x `rope_parameters`
// as they are (core/rope_parameters.cpp): rope_theta sets the rotary term's theta;
// partial_rotary_factor < 1 turns rope into partial_rope(fraction) (GPT-NeoX / Phi: half-split
// pairs over the rotary dims); rope_type proportional is partial_rope(grid=head) and a linear rule
// for its factor; YaRN without factor takes max_pos / original (HF); the other keys are the
// rule's term (rope_scaling_spec), appended with " + ". Conflicts with values written in the
// spec, and keys no term reads, are InputErrors naming them.
std::string rope_parameters_spec(const std::string& spec, const std::string& json_text,
                                 std::optional<double> max_pos = std::nullopt);

// A geometric frequency grid omega_k = theta^(-2k/dim), k = 0, 1, ...: what the RoPE-style rules
// (NTK base changes, YaRN's correction range) are defined on. dim = 0: not a grid.
struct FrequencyGrid {
  double theta = 0.0;
  int dim = 0;
  bool valid() const { return dim > 0; }
};

// The rule's frequencies for a call of context length `length` (max position + 1): omega holds
// the unscaled magnitudes of consecutive grid entries k = 0..n-1 (|omega| of one segment; signs
// are the caller's), grid is their grid (required by ntk, dynamic, yarn and pj_dynamic_ntk).
std::vector<double> scaled_frequencies(const RopeScaling& r, const std::vector<double>& omega,
                                       const FrequencyGrid& grid, double length);
// The factor applied to both q and k (logits scale by its square) at context length `length`.
double attention_factor(const RopeScaling& r, double length);

// YaRN's mscale (HF get_mscale): 1 for scale <= 1, else 0.1 mscale ln(scale) + 1.
double yarn_get_mscale(double scale, double mscale = 1.0);

// The rule of a mechanism as built, and what re-evaluating it needs (Mechanism::rope_scaling).
struct RopeScalingState {
  RopeScaling rule;  // type None: no context extension
  // |omega| before scaling, per segment of the position-driven term (filled at build)
  std::vector<std::vector<double>> base_omega;
  // set by scaled_for_length: the segments hold the rule at this length, for every call
  std::optional<double> frozen_length;
  bool active() const { return rule.type != RopeScalingType::None; }
  bool dynamic() const { return active() && rule.dynamic() && !frozen_length; }
};

// Called once by the registry after all terms are built: records the unscaled frequencies and
// sets the segments to the rule at the original length (static rules: the scaled frequencies;
// dynamic ones: their value for calls up to the original length). InputError when the mechanism
// has no rotary term or a grid rule meets a segment without a frequency grid.
void apply_rope_scaling(Mechanism& m);
// The mechanism with its segments' frequencies for a call of context length `length` (max
// position + 1), frozen there (`frozen_length`). A static or frozen rule returns m unchanged.
Mechanism scaled_for_length(const Mechanism& m, double length);
// The attention factor of a call of context length `length` (1 without a rule; a frozen rule
// uses its frozen length).
double attention_factor(const Mechanism& m, double length);
// max over positions + 1 (HF's seq_len = max(position_ids) + 1); 0 for no positions.
double context_length(const double* positions, size_t n);
// The softmax scale with the attention factor folded in: (scale or 1/sqrt(D)) * factor^2.
double scaled_softmax_scale(double scale, int head_dim, double factor);

}  // namespace relpos
