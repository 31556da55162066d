// The mechanism registry: every named mechanism, its options with defaults, its exactness and its
// paper section, and the builder that turns a spec string into a Mechanism. Adding a mechanism
// means one entry in registry.cpp's table.
#pragma once

#include <string>
#include <vector>

#include "core/mechanism.hpp"

namespace relpos {

struct OptionInfo {
  std::string key;
  std::string default_value;
  std::string doc;
};

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

// Builds a mechanism for heads of dimension head_dim and `heads` heads. Accepts spec strings and
// reference method names. Throws InputError naming the problem (unknown name or key, with the
// valid ones; bad value; head dim not divisible by 2m; L <= 0; ...).
Mechanism build_mechanism(const std::string& spec, int head_dim, int heads);

// One spec per catalogued mechanism and notable configuration: what `relpos verify` checks when
// no --enc is given.
std::vector<std::string> verify_default_specs();

}  // namespace relpos
