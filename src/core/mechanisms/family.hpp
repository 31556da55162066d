// What every mechanism family file needs: resolved options with typed, range-checked getters
// (Args), the builder that adds transform and bias terms to a Mechanism (TermBuilder), the
// registry entry type (TermDef) and the helpers shared by the Jordan-block families.
//
// Adding a mechanism: a new file in this folder defining `std::vector<TermDef> NAME_family()`,
// and one line `RELPOS_FAMILY(NAME)` in list.inc. See docs/architecture.md.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/charts.hpp"
#include "core/mechanism.hpp"
#include "core/parse.hpp"
#include "core/registry.hpp"

namespace relpos::mechanisms {

// Allowed ranges of the numeric options, by key (the same key means the same quantity in every
// mechanism). Bounds keep every accepted value representable: e^{max_exp} in float64, positions
// and centres exactly representable, frequency bases that give decreasing frequencies.
struct KeyRange {
  const char* key;
  double min, max;
};
inline constexpr KeyRange kRanges[] = {
    {"theta", 1.0, 1e12},
    {"L", 1e-3, 1e12},
    {"c", 0.0, 1e3},
    {"gamma0", 0.0, 100.0},
    {"gamma_min", 0.0, 100.0},
    {"max_exp", 1e-3, 709.0},
    {"eta0", -1e3, 1e3},
    {"eta_max", 1e-12, 1e3},
    {"gate_max", 1e-12, 1e3},
    {"center", -1e15, 1e15},
    {"m", 1, 8},
};

inline std::vector<OptionInfo> with_ranges(std::vector<OptionInfo> opts) {
  for (auto& o : opts)
    for (const auto& r : kRanges)
      if (o.key == r.key) {
        o.min = r.min;
        o.max = r.max;
      }
  return opts;
}

// Resolved options of one term, with typed getters whose errors name the term and key.
class Args {
 public:
  Args(std::string term, std::map<std::string, std::string> v, const std::vector<OptionInfo>& info)
      : term_(std::move(term)), v_(std::move(v)), info_(info) {}
  bool has(const std::string& k) const { return v_.count(k) > 0; }
  const std::string& str(const std::string& k) const { return at(k); }
  bool is_auto(const std::string& k) const { return at(k) == "auto"; }
  double num(const std::string& k) const {
    const std::string& s = at(k);
    const auto x = parse_finite_double(s);
    if (!x)
      throw InputError(
          fmt::format("{}: option {}='{}' is not a finite number", term_, k, brief(s)));
    for (const auto& o : info_)
      if (o.key == k && o.has_range() && !(*x >= o.min && *x <= o.max))
        throw InputError(fmt::format("{}: option {}={} is outside its range [{:g}, {:g}]", term_, k,
                                     brief(s), o.min, o.max));
    return *x;
  }
  double positive(const std::string& k) const {
    const double x = num(k);
    if (!(x > 0)) throw InputError(fmt::format("{}: option {} must be > 0, got {}", term_, k, x));
    return x;
  }
  double nonneg(const std::string& k) const {
    const double x = num(k);
    if (x < 0) throw InputError(fmt::format("{}: option {} must be >= 0, got {}", term_, k, x));
    return x;
  }
  int integer(const std::string& k, int lo, int hi) const {
    const std::string& s = at(k);
    const auto x = parse_finite_double(s);
    if (!x || *x != std::floor(*x) || *x < lo || *x > hi)
      throw InputError(fmt::format("{}: option {} must be an integer in [{}, {}], got '{}'", term_,
                                   k, lo, hi, brief(s)));
    return static_cast<int>(*x);
  }
  bool flag(const std::string& k) const {
    const std::string& s = at(k);
    if (s == "true" || s == "1" || s == "yes") return true;
    if (s == "false" || s == "0" || s == "no") return false;
    throw InputError(
        fmt::format("{}: option {} must be true or false, got '{}'", term_, k, brief(s)));
  }
  std::string choice(const std::string& k, const std::vector<std::string>& allowed) const {
    const std::string& s = at(k);
    for (const auto& a : allowed)
      if (s == a) return s;
    throw InputError(fmt::format("{}: option {}='{}' is not one of: {}", term_, k, brief(s),
                                 fmt::join(allowed, ", ")));
  }
  // Numbers separated by '/', each finite and inside [-bound, bound].
  std::vector<double> list(const std::string& k, double bound = 1e3) const {
    std::vector<double> out;
    const std::string& s = at(k);
    size_t a = 0;
    while (a <= s.size()) {
      auto b = s.find('/', a);
      if (b == std::string::npos) b = s.size();
      const auto x = parse_finite_double(std::string_view(s).substr(a, b - a));
      if (!x || std::abs(*x) > bound)
        throw InputError(
            fmt::format("{}: option {}='{}' must be numbers in [-{:g}, {:g}] separated by '/'",
                        term_, k, brief(s), bound, bound));
      out.push_back(*x);
      if (out.size() > 64)
        throw InputError(fmt::format("{}: option {} has more than 64 values", term_, k));
      a = b + 1;
    }
    return out;
  }
  const std::string& term() const { return term_; }
  // every resolved option as canonical text (what a learned lag kernel keeps for its runtime)
  const std::map<std::string, std::string>& values() const { return v_; }

 private:
  const std::string& at(const std::string& k) const {
    const auto it = v_.find(k);
    if (it == v_.end()) throw std::logic_error(term_ + ": builder reads undeclared option " + k);
    return it->second;
  }
  std::string term_;
  std::map<std::string, std::string> v_;
  const std::vector<OptionInfo>& info_;
};

// Adds the terms of one spec term to the mechanism being built.
struct TermBuilder {
  Mechanism& m;
  std::string term_name;              // the spec term being built
  int current = -1;                   // index of this spec term's Jordan-block term, once created
  int next_pair = 0, next_block = 0;  // Jordan blocks are numbered across the mechanism

  // Appends a segment of Jordan blocks to this spec term's transform (created on first use).
  void add(JordanSegment s);
  // Appends a fixed linear map M (keys get M, queries M^{-T}).
  void add_fixed_linear(std::vector<double> M, std::vector<double> M_inv_t);
  void add_bias(BiasTerm b);
  // Appends a learned lag table (a LagTable bias named after the term, computed by `kernel`).
  void add_learned_lag_table(std::shared_ptr<const LagKernel> kernel);
};

struct TermDef {
  MechanismInfo info;
  std::function<void(const Args&, TermBuilder&)> build;
};

// Shared by the Jordan-block families (jordan_common.cpp).
void require_divisible(const Args& a, int head_dim, int by, const std::string& why);
void set_center(const Args& a, Mechanism& m, bool exact);
std::vector<OptionInfo> jordan_common_options(const std::string& regime_default);
JordanSegment jordan_base(const Args& a, int order, bool scaled_damping = false);
std::vector<OptionInfo> shear_options(std::vector<OptionInfo> o);  // + eta0, eta_max, learn_eta
void set_shear(const Args& a, JordanSegment& s);                   // exponential shear from them
// A RoPE segment of `pairs` rotating pairs with the grid theta^(-2k/dim). RoFormer / reference
// convention: q and k rotate by +omega p, i.e. G(d) = R(-omega d); as a segment (maps rotate by
// -omega p) that is a negated frequency.
JordanSegment rope_segment(double theta, int dim, int pairs);
// The rotation sense of a damped or sheared rotary term: "rope" (default) turns keys as rope
// does, so that zero damping and shear give rope exactly; "paper" keeps the Jordan-RoPE paper's
// (and its reference's) e^{+i omega d}, which is rope at negated positions.
OptionInfo direction_option();
void set_direction(const Args& a, JordanSegment& s);

// One function per family file; list.inc names them all.
#define RELPOS_FAMILY(NAME) std::vector<TermDef> NAME##_family();
#include "core/mechanisms/list.inc"
#undef RELPOS_FAMILY

}  // namespace relpos::mechanisms
