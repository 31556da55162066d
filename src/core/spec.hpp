// Spec strings: `name(key=value, ...)` terms joined by `+` (DESIGN.md section 3).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace relpos {

struct SpecTerm {
  std::string name;
  std::vector<std::pair<std::string, std::string>> args;  // in the order written
};

// Parses the grammar only (names and keys are checked by the registry). Throws InputError that
// quotes the spec and the position of the problem.
std::vector<SpecTerm> parse_spec(const std::string& spec);

// Reference repositories' method names (e.g. `jordan_exact_m3_c050_eta100_eta1`, `rope_alibi`)
// rewritten as spec strings; returns "" when `name` is not such an alias.
std::string expand_reference_alias(const std::string& name);

}  // namespace relpos
