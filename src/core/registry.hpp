// The mechanism registry: every named mechanism, its options with defaults, its exactness and its
// paper section, and the builder that turns a spec string into a Mechanism. Adding a mechanism
// means one entry in registry.cpp's table.
#pragma once

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/mechanism.hpp"

namespace relpos {

struct OptionInfo {
  std::string key;
  std::string default_value;
  std::string doc;
  // Allowed range of a numeric option (checked when a spec is built; shown by `relpos list`).
  // Keeps every accepted value inside what the float64 references and kernels can represent.
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool has_range() const { return std::isfinite(min) || std::isfinite(max); }
};

// Largest head dimension and head count a mechanism may be built for.
inline constexpr int kMaxHeadDim = 1 << 16;
inline constexpr int kMaxHeads = 1 << 16;
// Longest spec string accepted (no meaningful composition comes near it).
inline constexpr size_t kMaxSpecLength = 16384;

struct MechanismInfo {
  std::string name;
  std::string kind;  // "transform" or "bias"
  std::string summary;
  std::string exactness;
  std::string paper;
  std::vector<OptionInfo> options;
  std::vector<std::string> aliases;  // reference-repository method names that map here
};

const std::vector<MechanismInfo>& mechanism_catalog();
// The catalog as JSON (`relpos list --format json`, `relpos.mechanisms()` in Python).
nlohmann::json catalog_json();
// A built mechanism as JSON: canonical spec, transform terms (kind, time, roles, fixed matrices),
// bias terms, the parameter schema with its initial values, the centre rule. What the Python
// module builds its parameters from.
nlohmann::json mechanism_json(const Mechanism& m);

// Builds a mechanism for heads of dimension head_dim and `heads` heads. Accepts spec strings and
// reference method names. Throws InputError naming the problem (unknown name or key, with the
// valid ones; bad value; head dim not divisible by 2m; L <= 0; ...).
Mechanism build_mechanism(const std::string& spec, int head_dim, int heads);

// The slope bias's slopes (Mechanism::slope_bias) for `heads` query heads: a slope sequence
// depends on the head count, so a call with other heads than m's rebuilds m's spec for them.
// Empty when m has no slope bias.
std::vector<double> slopes_for_heads(const Mechanism& m, int64_t heads);

// One spec per catalogued mechanism and notable configuration: what `relpos verify` checks when
// no --enc is given.
std::vector<std::string> verify_default_specs();

}  // namespace relpos
