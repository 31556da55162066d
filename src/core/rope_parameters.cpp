// A Hugging Face rope dictionary (4.x `rope_scaling`, 5.x `rope_parameters`) applied to a spec:
// the base rotary term's keys (rope_theta, partial_rotary_factor, the proportional type) change
// the spec's terms, the rule's keys become its context-extension term (rope_scaling.cpp).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/parse.hpp"
#include "core/registry.hpp"
#include "core/rope_scaling.hpp"
#include "core/spec.hpp"

namespace relpos {

namespace {

bool has_option(const std::string& family, const char* key) {
  for (const auto& info : mechanism_catalog())
    if (info.name == family)
      return std::any_of(info.options.begin(), info.options.end(),
                         [&](const OptionInfo& o) { return o.key == key; });
  return false;
}

// Sets term.args[key] = value; a different value written in the spec is an error.
void set_arg(SpecTerm& t, const std::string& key, const std::string& value, const char* from) {
  for (auto& [k, v] : t.args)
    if (k == key) {
      if (v != value)
        throw InputError(fmt::format(
            "rope dictionary: {} = {} disagrees with {}={} written in the spec's {} term", from,
            value, key, v, t.name));
      return;
    }
  t.args.emplace_back(key, value);
}

std::optional<double> take_number(nlohmann::json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) {
    if (j.contains(key)) j.erase(key);
    return std::nullopt;
  }
  const auto& v = j[key];
  if (!v.is_number() || v.is_boolean())
    throw InputError(
        fmt::format("rope dictionary: {} must be a number, got {}", key, brief(v.dump(), 80)));
  const double x = v.get<double>();
  j.erase(key);
  return x;
}

}  // namespace

std::string rope_parameters_spec(const std::string& spec, const std::string& json_text,
                                 std::optional<double> max_pos) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(
        fmt::format("rope dictionary: not valid JSON ({}): {}", e.what(), brief(json_text)));
  }
  if (j.is_null()) return spec;
  if (!j.is_object())
    throw InputError(
        fmt::format("rope dictionary: expected a JSON object, got {}", brief(j.dump(), 80)));
  const auto theta = take_number(j, "rope_theta");
  const auto fraction = take_number(j, "partial_rotary_factor");
  if (theta && !(*theta > 1.0 && std::isfinite(*theta)))
    throw InputError(fmt::format("rope dictionary: rope_theta must be > 1, got {}", *theta));
  if (fraction && !(*fraction > 0.0 && *fraction <= 1.0))
    throw InputError(
        fmt::format("rope dictionary: partial_rotary_factor must be in (0, 1], got {}", *fraction));
  std::string type;
  for (const char* key : {"rope_type", "type"})
    if (j.contains(key) && j[key].is_string()) type = j[key].get<std::string>();
  // HF's proportional rope: the head's grid theta^(-2k/D) on the first fraction of the pairs, the
  // others at frequency 0, all divided by factor (a linear rule)
  const bool proportional = type == "proportional";
  if (proportional) {
    const auto factor = take_number(j, "factor");
    for (auto& [k, v] : j.items())
      if (k != "rope_type" && k != "type")
        throw InputError(fmt::format(
            "rope dictionary: key '{}' is not read by rope_type proportional (valid: factor, "
            "rope_theta, partial_rotary_factor)",
            brief(k)));
    j = factor && *factor != 1.0 ? nlohmann::json{{"rope_type", "linear"}, {"factor", *factor}}
                                 : nlohmann::json{{"rope_type", "default"}};
  }
  // YaRN without factor: HF derives it from max_position_embeddings / original (DeepSeek-V3)
  if (type == "yarn" && (!j.contains("factor") || j["factor"].is_null()) && max_pos &&
      j.contains("original_max_position_embeddings") &&
      j["original_max_position_embeddings"].is_number())
    j["factor"] = *max_pos / j["original_max_position_embeddings"].get<double>();
  auto terms = parse_spec(spec);
  bool rotary = false;
  for (auto& t : terms) {
    if (!has_option(t.name, "theta")) continue;
    rotary = true;
    const bool partial = fraction && *fraction < 1.0;
    if ((partial || proportional) && t.name == "rope") t.name = "partial_rope";
    if (partial || proportional) {
      if (t.name != "partial_rope")
        throw InputError(fmt::format(
            "rope dictionary: partial_rotary_factor {} applies to rope; the spec's rotary term is "
            "{}",
            fraction.value_or(1.0), t.name));
      set_arg(t, "fraction", fmt::format("{}", fraction.value_or(1.0)), "partial_rotary_factor");
      if (proportional) set_arg(t, "grid", "head", "rope_type proportional");
    }
    if (theta) set_arg(t, "theta", fmt::format("{}", *theta), "rope_theta");
  }
  if ((theta || fraction || proportional) && !rotary)
    throw InputError(fmt::format(
        "rope dictionary: rope_theta / partial_rotary_factor / proportional need a rotary term "
        "with a frequency base; '{}' has none",
        brief(spec)));
  std::vector<std::string> parts;
  for (const auto& t : terms) {
    std::vector<std::string> kv;
    for (const auto& [k, v] : t.args) kv.push_back(k + "=" + v);
    parts.push_back(kv.empty() ? t.name : fmt::format("{}({})", t.name, fmt::join(kv, ", ")));
  }
  const std::string rule = rope_scaling_spec(j.dump(), max_pos);
  if (!rule.empty()) parts.push_back(rule);
  return fmt::format("{}", fmt::join(parts, " + "));
}

}  // namespace relpos
