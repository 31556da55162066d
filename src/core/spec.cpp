#include "core/spec.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <string_view>

#include "core/parse.hpp"
#include "core/types.hpp"

namespace relpos {

namespace {

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

bool is_ident(const std::string& s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}

[[noreturn]] void fail(const std::string& spec, const std::string& why) {
  throw InputError(fmt::format("malformed spec '{}': {}", brief(spec), why));
}

}  // namespace

std::vector<SpecTerm> parse_spec(const std::string& spec) {
  std::vector<SpecTerm> terms;
  // split on '+' outside parentheses
  std::vector<std::string> parts;
  int depth = 0;
  std::string cur;
  for (char ch : spec) {
    if (ch == '(') ++depth;
    if (ch == ')' && --depth < 0) fail(spec, "unbalanced ')'");
    if (ch == '+' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (depth != 0) fail(spec, "unbalanced '('");
  parts.push_back(cur);
  for (const auto& raw : parts) {
    const std::string part = trim(raw);
    if (part.empty()) fail(spec, "empty term (stray '+')");
    SpecTerm t;
    const auto open = part.find('(');
    if (open == std::string::npos) {
      t.name = part;
    } else {
      if (part.back() != ')') fail(spec, fmt::format("term '{}' must end with ')'", part));
      t.name = trim(part.substr(0, open));
      const std::string body = part.substr(open + 1, part.size() - open - 2);
      if (!trim(body).empty()) {
        size_t start = 0;
        while (start <= body.size()) {
          auto comma = body.find(',', start);
          if (comma == std::string::npos) comma = body.size();
          const std::string kv = trim(body.substr(start, comma - start));
          const auto eq = kv.find('=');
          if (eq == std::string::npos)
            fail(spec, fmt::format("argument '{}' of '{}' is not key=value", kv, t.name));
          const std::string key = trim(kv.substr(0, eq)), val = trim(kv.substr(eq + 1));
          if (!is_ident(key)) fail(spec, fmt::format("bad key '{}' in '{}'", key, t.name));
          if (val.empty()) fail(spec, fmt::format("empty value for '{}' in '{}'", key, t.name));
          for (const auto& [k, v] : t.args)
            if (k == key) fail(spec, fmt::format("key '{}' given twice in '{}'", key, t.name));
          t.args.emplace_back(key, val);
          start = comma + 1;
        }
      }
    }
    if (!is_ident(t.name)) fail(spec, fmt::format("bad mechanism name '{}'", t.name));
    terms.push_back(std::move(t));
  }
  return terms;
}

namespace {

std::string fixed(double v) {
  return fmt::format("{:g}", v);
}

// Digits of a name token, as a number: at most 9 digits (every reference name has 1-4), so that
// `jordan_m99999999999` is a named error rather than an overflow.
double token_number(const std::string& alias, const std::string& token, size_t skip) {
  const std::string digits = token.substr(skip);
  const auto v = parse_int64(digits, 0, 999999999);
  if (!v)
    throw InputError(
        fmt::format("reference method name '{}': number in token '{}' is not 1 to 9 "
                    "decimal digits",
                    brief(alias), brief(token)));
  return static_cast<double>(*v);
}

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) != 0;
  });
}

std::vector<std::string> split_underscores(const std::string& s) {
  std::vector<std::string> toks;
  size_t a = 0;
  while (a <= s.size()) {
    auto e = s.find('_', a);
    if (e == std::string::npos) e = s.size();
    toks.push_back(s.substr(a, e - a));
    a = e + 1;
  }
  return toks;
}

}  // namespace

NameTokens parse_name_tokens(const std::string& alias, size_t family_words, unsigned allowed) {
  const auto toks = split_underscores(alias);
  NameTokens t;
  const auto once = [&](bool seen, const std::string& tok) {
    if (seen)
      throw InputError(fmt::format("reference method name '{}': token '{}' repeats an option",
                                   brief(alias), tok));
  };
  const auto is = [&](const std::string& tok, const char* prefix, size_t min_digits,
                      unsigned kind) {
    const size_t n = std::char_traits<char>::length(prefix);
    return (allowed & kind) && tok.size() >= n + min_digits && tok.compare(0, n, prefix) == 0 &&
           all_digits(tok.substr(n));
  };
  for (size_t i = family_words; i < toks.size(); ++i) {
    const std::string& tok = toks[i];
    if ((allowed & kTokEta1) && tok == "eta1") {
      once(t.eta1, tok);
      t.eta1 = true;
    } else if ((allowed & kTokScaled) && tok == "scaled") {
      // `jordan_exact_scaled`: the default c = 1
    } else if (is(tok, "eta", 3, kTokEta)) {
      once(t.eta.has_value(), tok);
      t.eta = token_number(alias, tok, 3) / 1000.0;
    } else if (is(tok, "m", 1, kTokM)) {
      once(t.m.has_value(), tok);
      t.m = static_cast<int64_t>(token_number(alias, tok, 1));
    } else if (is(tok, "c", 1, kTokC)) {
      once(t.c.has_value(), tok);
      t.c = token_number(alias, tok, 1) / 100.0;
    } else if (is(tok, "g", 1, kTokGates)) {
      t.gates.push_back(token_number(alias, tok, 1) / 100.0);
    } else {
      std::vector<std::string> kinds;
      if (allowed & kTokM) kinds.push_back("mM");
      if (allowed & kTokC) kinds.push_back("cCCC");
      if (allowed & kTokEta) kinds.push_back("etaEEE (3+ digits)");
      if (allowed & kTokEta1) kinds.push_back("eta1");
      if (allowed & kTokScaled) kinds.push_back("scaled");
      if (allowed & kTokGates) kinds.push_back("gGGG");
      throw InputError(fmt::format("reference method name '{}': unknown token '{}' (expected {})",
                                   brief(alias), brief(tok), fmt::join(kinds, ", ")));
    }
  }
  return t;
}

// The reference's method names expand with the reference's rotation sense (direction=paper):
// they name its configurations.
std::string expand_reference_alias(const std::string& name_in) {
  // only a bare method name is an alias: "jordan_exact_c010 + alibi" is a composed spec whose
  // terms are expanded one by one
  if (!is_ident(name_in)) return "";
  std::string name = name_in;
  std::string suffix;
  if (name != "alibi" && name.size() > 6 && name.ends_with("_alibi")) {
    name = name.substr(0, name.size() - 6);
    suffix = " + alibi";
  }
  const auto toks = split_underscores(name);
  // the option tokens after a family prefix of `skip` underscore-separated words
  std::string out;
  if (name == "rope" && !suffix.empty()) {
    out = "rope";
  } else if (name == "jordan_rope") {
    out = "jordan(m=2, regime=stabilized, direction=paper)";
  } else if (name == "jordan_no_gamma") {
    out = "jordan(m=2, regime=stabilized, zero_gamma=true, direction=paper)";
  } else if (name == "jordan_raw_tau") {
    out = "jordan(m=2, regime=raw, direction=paper)";
  } else if (toks.size() == 2 && toks[0] == "jordan" && toks[1].size() > 1 && toks[1][0] == 'm' &&
             all_digits(toks[1].substr(1))) {
    out = fmt::format("jordan(m={}, regime=stabilized, direction=paper)",
                      static_cast<int64_t>(token_number(name_in, toks[1], 1)));
  } else if (toks.size() == 2 && toks[0] == "jordan" && toks[1].size() > 3 &&
             toks[1].starts_with("eta") && all_digits(toks[1].substr(3))) {
    out = fmt::format("jordan(m=2, regime=stabilized, eta0={}, direction=paper)",
                      fixed(token_number(name_in, toks[1], 3) / 1000.0));
  } else if (toks.size() >= 2 && toks[0] == "jordan" && toks[1] == "exact") {
    const NameTokens t =
        parse_name_tokens(name, 2, kTokM | kTokC | kTokEta | kTokEta1 | kTokScaled);
    out = fmt::format("jordan(m={}, regime=scaled, c={}, eta0={}, eta_max={}, direction=paper)",
                      t.m.value_or(2), fixed(t.c.value_or(1.0)), fixed(t.eta.value_or(0.0)),
                      t.eta1 ? "1" : "0.1");
  } else if (toks.size() >= 2 && toks[0] == "jordan" &&
             (toks[1] == "jetmix" || toks[1] == "jetmixfull")) {
    const bool full = toks[1] == "jetmixfull";
    const NameTokens t = parse_name_tokens(name, 2, kTokM | kTokC | kTokGates);
    std::vector<std::string> g;
    for (double x : t.gates) g.push_back(fixed(x));
    out = fmt::format("{}(m={}, c={}, {}={}, direction=paper)", full ? "jetmixfull" : "jetmix",
                      t.m.value_or(4), fixed(t.c.value_or(1.0)), full ? "alpha" : "gates",
                      fmt::join(g, "/"));
    if (g.empty())
      throw InputError(
          fmt::format("reference method name '{}' has no gate tokens gGGG", brief(name_in)));
  } else if (name == "axial_rope" || name == "mixed_rope") {  // (2-D RoPE-Mixed's names)
    out = fmt::format("structured(basis={})", name == "axial_rope" ? "axial" : "mixed");
  } else if (!suffix.empty() && (name == "damped_rope" || name == "real_jordan" ||
                                 name == "direct_sum" || name == "nope")) {
    out = name;
  } else {
    return "";
  }
  return out + suffix;
}

}  // namespace relpos
