// Spec strings: `name(key=value, ...)` terms joined by `+` (DESIGN.md section 3).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
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

// The option tokens of a reference method name (`jordan_exact_m3_c050_eta100_eta1`), after its
// `family_words` underscore-separated family words, parsed strictly: each token must be of a kind
// in `allowed`, each at most once (gates repeat); numbers are 1 to 9 digits. Anything else is an
// InputError naming the token. The one parser of these names: the registry's aliases and the
// probes' method dictionaries both use it.
enum NameToken : unsigned {
  kTokM = 1,        // mM: order
  kTokC = 2,        // cCCC: c = CCC / 100
  kTokEta = 4,      // etaEEE (3+ digits): eta0 = EEE / 1000
  kTokEta1 = 8,     // eta1: eta_max = 1
  kTokScaled = 16,  // scaled: the reference's name for the default c
  kTokGates = 32,   // gGGG: gates = GGG / 100
};
struct NameTokens {
  std::optional<int64_t> m;
  std::optional<double> c, eta;
  bool eta1 = false;
  std::vector<double> gates;
};
NameTokens parse_name_tokens(const std::string& name, size_t family_words, unsigned allowed);

// Reference repositories' method names (e.g. `jordan_exact_m3_c050_eta100_eta1`, `rope_alibi`)
// rewritten as spec strings; returns "" when `name` is not such an alias.
std::string expand_reference_alias(const std::string& name);

}  // namespace relpos
