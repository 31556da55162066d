#include "core/spec.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <optional>

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
  throw InputError(fmt::format("malformed spec '{}': {}", spec, why));
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

std::string fixed(double v) { return fmt::format("{:g}", v); }

// name == prefix followed by one or more digits
bool prefixed_digits(const std::string& name, const std::string& prefix) {
  return name.size() > prefix.size() && name.starts_with(prefix) &&
         std::all_of(name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(),
                     [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

// First "<prefix><digits>" token (exact match of the whole token) or nullopt.
std::optional<std::string> token_digits(const std::vector<std::string>& toks,
                                        const std::string& prefix, size_t min_digits = 1) {
  for (const auto& t : toks) {
    if (t.size() < prefix.size() + min_digits || t.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = t.substr(prefix.size());
    if (std::all_of(rest.begin(), rest.end(), [](char c) { return std::isdigit(c); })) return rest;
  }
  return std::nullopt;
}

}  // namespace

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
  std::vector<std::string> toks;
  {
    size_t s = 0;
    while (s <= name.size()) {
      auto e = name.find('_', s);
      if (e == std::string::npos) e = name.size();
      toks.push_back(name.substr(s, e - s));
      s = e + 1;
    }
  }
  const auto order = [&](int dflt) {
    const auto m = token_digits(toks, "m");
    return m ? std::stoi(*m) : dflt;
  };
  const auto c_value = [&]() {
    const auto c = token_digits(toks, "c");
    return c ? std::stod(*c) / 100.0 : 1.0;
  };
  std::string out;
  if (name == "rope" && !suffix.empty()) {
    out = "rope";
  } else if (name == "jordan_rope") {
    out = "jordan(m=2, regime=stabilized)";
  } else if (name == "jordan_no_gamma") {
    out = "jordan(m=2, regime=stabilized, zero_gamma=true)";
  } else if (name == "jordan_raw_tau") {
    out = "jordan(m=2, regime=raw)";
  } else if (prefixed_digits(name, "jordan_m")) {
    out = fmt::format("jordan(m={}, regime=stabilized)", order(2));
  } else if (prefixed_digits(name, "jordan_eta")) {
    out = fmt::format("jordan(m=2, regime=stabilized, eta0={})",
                      fixed(std::stod(name.substr(10)) / 1000.0));
  } else if (name.starts_with("jordan_exact")) {
    const auto eta = token_digits(toks, "eta", 3);
    const bool eta1 = name.ends_with("_eta1") || name.find("_eta1_") != std::string::npos;
    out = fmt::format("jordan(m={}, regime=scaled, c={}, eta0={}, eta_max={})", order(2),
                      fixed(c_value()), fixed(eta ? std::stod(*eta) / 1000.0 : 0.0),
                      eta1 ? "1" : "0.1");
  } else if (name.starts_with("jordan_jetmixfull") || name.starts_with("jordan_jetmix")) {
    const bool full = name.starts_with("jordan_jetmixfull");
    std::vector<std::string> g;
    for (const auto& t : toks)
      if (t.size() > 1 && t[0] == 'g' &&
          std::all_of(t.begin() + 1, t.end(), [](char c) { return std::isdigit(c); }))
        g.push_back(fixed(std::stod(t.substr(1)) / 100.0));
    std::string list;
    for (size_t i = 0; i < g.size(); ++i) list += (i ? "/" : "") + g[i];
    out = fmt::format("{}(m={}, c={}, {}={})", full ? "jetmixfull" : "jetmix", order(4),
                      fixed(c_value()), full ? "alpha" : "gates", list);
  } else if (!suffix.empty() && (name == "damped_rope" || name == "real_jordan" ||
                                 name == "direct_sum" || name == "nope")) {
    out = name;
  } else {
    return "";
  }
  return out + suffix;
}

}  // namespace relpos
