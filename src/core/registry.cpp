#include "core/registry.hpp"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "core/charts.hpp"
#include "core/parse.hpp"
#include "core/spec.hpp"

namespace relpos {

namespace {

// Allowed ranges of the numeric options, by key (the same key means the same quantity in every
// mechanism). Bounds keep every accepted value representable: e^{max_exp} in float64, positions
// and centres exactly representable, frequency bases that give decreasing frequencies.
struct KeyRange {
  const char* key;
  double min, max;
};
constexpr KeyRange kRanges[] = {
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

std::vector<OptionInfo> with_ranges(std::vector<OptionInfo> opts) {
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

struct Builder {
  Mechanism& m;
  int next_pair = 0;
  int next_block = 0;
  void add(JordanSegment s) {
    s.first_pair = next_pair;
    s.first_block = next_block;
    next_pair += s.pairs();
    next_block += s.blocks;
    m.segments.push_back(std::move(s));
  }
};

struct TermDef {
  MechanismInfo info;
  std::function<void(const Args&, Builder&)> build;  // empty for pure biases handled specially
};

void require_divisible(const Args& a, int head_dim, int by, const std::string& why) {
  if (head_dim <= 0 || head_dim % by != 0)
    throw InputError(
        fmt::format("{}: head dim {} is not divisible by {} ({})", a.term(), head_dim, by, why));
}

// center=auto: exact damped maps get a fixed centre in the middle of the training context [0, L]
// (keys and queries of every call share it, so prefill and decode calls compose); approximate
// maps keep the reference convention c0 = 0, where the centre changes the scores.
void set_center(const Args& a, Mechanism& m, bool exact) {
  const std::string c = a.str("center");
  if (c == "auto") {
    m.center_auto = true;
    if (exact) {
      m.center = CenterMode::Fixed;
      m.center_value = std::floor(0.5 * a.positive("L"));
    } else {
      m.center = CenterMode::None;
    }
  } else if (c == "none") {
    m.center = CenterMode::None;
  } else if (c == "mid") {
    m.center = CenterMode::Mid;
  } else {
    m.center = CenterMode::Fixed;
    m.center_value = a.num("center");
  }
}

// Options shared by every Jordan-block term.
std::vector<OptionInfo> jordan_common_options(const std::string& regime_default) {
  return {
      {"regime", regime_default,
       "raw: sigma(d)=d, s=1 (exact); scaled: s=1/L, gamma=c/L (exact); stabilized: bounded "
       "tau(d)=d/(1+d/L), s=1 (approximate)"},
      {"L", "1024", "chart scale / training context (> 0)"},
      {"c", "1", "scaled regime: damping gamma0 = c/L"},
      {"gamma0", "auto", "initial damping (auto: 1e-4, or c/L when scaled and for jet gates)"},
      {"gamma_min", "auto", "gamma = softplus(a) + gamma_min (auto: 1e-4, or 0 when gamma0 = c/L)"},
      {"learn_gamma", "true", "gamma is a learnable parameter per head and block"},
      {"zero_gamma", "false", "force gamma = 0 (no damping)"},
      {"max_exp", "30", "clamp |gamma p| before exp (reference: 30); verify reports when it binds"},
      {"center", "auto",
       "factorization centre c0: auto (floor(L/2) for exact maps, none otherwise), none, mid (per "
       "call: keys and queries of different calls do not compose), or a number"},
  };
}

// Damping, chart and clamp common to every Jordan-block term.
JordanSegment jordan_base(const Args& a, int order, bool scaled_damping = false) {
  JordanSegment s;
  s.order = order;
  // damped_rope has no regime / c: it is always the raw exponential damping
  const std::string regime =
      a.has("regime") ? a.choice("regime", {"raw", "scaled", "stabilized"}) : "raw";
  s.L = a.positive("L");
  const double c = a.has("c") ? a.nonneg("c") : 1.0;
  s.chart = regime == "stabilized" ? Chart::Bounded : Chart::Raw;
  s.shear_scale = regime == "scaled" ? 1.0 / s.L : 1.0;
  s.damped = !a.flag("zero_gamma");
  s.learn_gamma = s.damped && a.flag("learn_gamma");
  // scaled regime and jet gates (which are always 1/L-scaled): gamma0 = c/L, gamma_min = 0
  const bool per_L = regime == "scaled" || scaled_damping;
  s.gamma_min = a.is_auto("gamma_min") ? (per_L ? 0.0 : 1e-4) : a.nonneg("gamma_min");
  s.gamma_init = a.is_auto("gamma0") ? (per_L ? c / s.L : 1e-4) : a.nonneg("gamma0");
  if (s.gamma_init < s.gamma_min)
    throw InputError(
        fmt::format("{}: gamma0 {} is below gamma_min {}", a.term(), s.gamma_init, s.gamma_min));
  // verify's random range; kept so that |gamma p| < 30 over centred windows of 32768
  s.gamma_random_max = per_L ? std::max(1.5, c) / s.L : std::max(5e-4, s.gamma_init);
  s.max_exponent = a.positive("max_exp");
  return s;
}

const std::vector<TermDef>& term_defs() {
  static const std::vector<TermDef> defs = [] {
    std::vector<TermDef> d;
    d.push_back(
        {{"nope", "transform", "no positional transform", "exact", "baseline", {}, {"nope"}},
         [](const Args&, Builder&) {}});
    d.push_back({{"rope",
                  "transform",
                  "rotary embedding, D/2 frequencies theta^(-2k/D)",
                  "exact",
                  "RoFormer; Jordan-RoPE 3.2",
                  {{"theta", "10000", "frequency base"}},
                  {"rope"}},
                 [](const Args& a, Builder& b) {
                   const int D = b.m.head_dim;
                   require_divisible(a, D, 2, "rotary pairs");
                   JordanSegment s;
                   s.order = 1;
                   s.blocks = D / 2;
                   // RoFormer / reference convention: q and k rotate by +omega p, i.e. G(d) =
                   // R(-omega d); as a segment (maps rotate by -omega p) that is a negated
                   // frequency
                   s.omega = rope_frequencies(a.positive("theta"), D, s.blocks);
                   for (auto& w : s.omega) w = -w;
                   b.add(s);
                 }});
    d.push_back({{"alibi",
                  "bias",
                  "additive recency bias -slope_h (i-j), reference slopes",
                  "augmented exact (unipotent lift)",
                  "ALiBi; Jordan-RoPE Table 1",
                  {},
                  {"alibi", "rope_alibi", "<any>_alibi"}},
                 {}});
    {
      auto opts = std::vector<OptionInfo>{
          {"m", "2", "1: full-frequency damped RoPE; 2: reference (Jordan block with eta = 0)"},
          {"theta", "10000", "frequency base"}};
      for (auto& o : jordan_common_options("raw"))
        if (o.key != "regime" && o.key != "c") opts.push_back(o);
      d.push_back({{"damped_rope",
                    "transform",
                    "e^{-gamma d} RoPE; m=2 (reference) uses D/4 frequencies, each on two pairs",
                    "exact",
                    "Jordan-RoPE 3.2, 5; spec 1.5",
                    opts,
                    {"damped_rope"}},
                   [](const Args& a, Builder& b) {
                     const int m = a.integer("m", 1, 2);
                     require_divisible(a, b.m.head_dim, 2 * m, "2m real coordinates per block");
                     JordanSegment s = jordan_base(a, m);
                     s.shear = ShearMode::None;
                     s.blocks = b.m.head_dim / (2 * m);
                     s.omega = rope_frequencies(a.positive("theta"), b.m.head_dim, s.blocks);
                     b.add(s);
                     set_center(a, b.m, true);
                   }});
    }
    const auto shear_options = [](std::vector<OptionInfo> o) {
      o.push_back({"eta0", "0", "initial nilpotent amplitude eta (eta = eta_max tanh(b))"});
      o.push_back({"eta_max", "0.1", "bound of |eta|"});
      o.push_back({"learn_eta", "true", "eta is learnable per head and block"});
      return o;
    };
    const auto set_shear = [](const Args& a, JordanSegment& s) {
      s.shear = ShearMode::Exponential;
      s.eta_max = a.positive("eta_max");
      s.eta_init = a.num("eta0");
      if (std::abs(s.eta_init) >= s.eta_max)
        throw InputError(fmt::format("{}: |eta0| = {} must be below eta_max = {}", a.term(),
                                     std::abs(s.eta_init), s.eta_max));
      s.learn_eta = a.flag("learn_eta");
    };
    d.push_back({{"real_jordan",
                  "transform",
                  "real unipotent/Jordan distance block (omega = 0), order 2",
                  "exact (raw, scaled); approximate (stabilized, the default)",
                  "Jordan-RoPE 3.2",
                  shear_options(jordan_common_options("stabilized")),
                  {"real_jordan"}},
                 [set_shear](const Args& a, Builder& b) {
                   require_divisible(a, b.m.head_dim, 4, "order-2 real blocks");
                   JordanSegment s = jordan_base(a, 2);
                   set_shear(a, s);
                   s.blocks = b.m.head_dim / 4;
                   s.omega.assign(s.blocks, 0.0);
                   b.add(s);
                   set_center(a, b.m, s.exact());
                 }});
    {
      auto opts = shear_options(jordan_common_options("stabilized"));
      opts.insert(opts.begin(), {"theta", "10000", "RoPE half frequency base"});
      d.push_back({{"direct_sum",
                    "transform",
                    "RoPE on the first D/2 (grid theta^(-2k/(D/2))) (+) real Jordan on the rest",
                    "exact (raw, scaled); approximate (stabilized, the default)",
                    "Jordan-RoPE 3.2; spec 1.7",
                    opts,
                    {"direct_sum"}},
                   [set_shear](const Args& a, Builder& b) {
                     const int D = b.m.head_dim;
                     require_divisible(a, D, 8, "half RoPE, half order-2 real blocks");
                     JordanSegment r;
                     r.order = 1;
                     r.blocks = D / 4;
                     r.omega = rope_frequencies(a.positive("theta"), D / 2, r.blocks);
                     for (auto& w : r.omega) w = -w;  // RoPE half: +omega p, as `rope`
                     b.add(r);
                     JordanSegment s = jordan_base(a, 2);
                     set_shear(a, s);
                     s.blocks = D / 8;
                     s.omega.assign(s.blocks, 0.0);
                     b.add(s);
                     set_center(a, b.m, s.exact());
                   }});
    }
    {
      auto opts = shear_options(jordan_common_options("stabilized"));
      opts.insert(opts.begin(), {"m", "2", "Jordan order (1..8); head dim must divide by 2m"});
      opts.push_back({"theta", "10000", "frequency base"});
      opts.push_back({"grid", "prefix",
                      "prefix: first D/(2m) of theta^(-2k/D) (reference); span: theta^(-2km/D)"});
      opts.push_back({"zero_omega", "false", "force omega = 0 (real Jordan block)"});
      d.push_back({{"jordan",
                    "transform",
                    "complex Jordan block of order m: e^{(-gamma+i omega)d} sum_r (eta s "
                    "sigma(d))^r/r! N^r",
                    "exact (raw, scaled); approximate (stabilized, the default)",
                    "Jordan-RoPE 3.3-4.3, App. A",
                    opts,
                    {"jordan_rope", "jordan_raw_tau", "jordan_no_gamma", "jordan_etaNNN",
                     "jordan_mM", "jordan_exact[_mM][_cCCC][_etaEEE][_eta1]"}},
                   [set_shear](const Args& a, Builder& b) {
                     const int m = a.integer("m", 1, 8);
                     const int D = b.m.head_dim;
                     require_divisible(a, D, 2 * m,
                                       fmt::format("order {} blocks of {} coordinates", m, 2 * m));
                     JordanSegment s = jordan_base(a, m);
                     set_shear(a, s);
                     s.blocks = D / (2 * m);
                     const double theta = a.positive("theta");
                     s.omega = a.choice("grid", {"prefix", "span"}) == "prefix"
                                   ? rope_frequencies(theta, D, s.blocks)
                                   : spanning_frequencies(theta, D, m);
                     if (a.flag("zero_omega")) s.omega.assign(s.blocks, 0.0);
                     b.add(s);
                     set_center(a, b.m, s.exact());
                   }});
    }
    // Jet gates and spectra: U(t) = alpha_0 I + sum_k g_k (s sigma(t))^k/k! N^k, s = 1/L.
    const auto gate_options = [](const std::string& m, const std::string& list_key,
                                 const std::string& list_default, const std::string& gmax) {
      auto o = jordan_common_options("stabilized");
      o.insert(o.begin(), {"m", m, "Jordan order (2..8)"});
      for (auto& x : o) {
        if (x.key == "c") x.default_value = "1.5";
        if (x.key == "regime") x.doc = "stabilized: bounded tau (reference); scaled: sigma(d)=d";
      }
      o.push_back({list_key, list_default, "jet coefficients separated by '/'"});
      if (!gmax.empty()) o.push_back({"gate_max", gmax, "tanh bound of learnable gates"});
      o.push_back({"theta", "10000", "frequency base"});
      return o;
    };
    const auto gate_segment = [](const Args& a, Builder& b, int m) {
      const int D = b.m.head_dim;
      require_divisible(a, D, 2 * m, fmt::format("order {} blocks of {} coordinates", m, 2 * m));
      if (a.str("regime") == "raw")
        throw InputError(fmt::format("{}: regime must be stabilized or scaled", a.term()));
      JordanSegment s = jordan_base(a, m, /*scaled_damping=*/true);
      s.shear = ShearMode::Gates;
      s.shear_scale = 1.0 / s.L;
      s.blocks = D / (2 * m);
      s.omega = rope_frequencies(a.positive("theta"), D, s.blocks);
      return s;
    };
    d.push_back({{"jetmix",
                  "transform",
                  "jet gates: alpha_0 = 1, learnable g_k (tanh-bounded), bounded tau / L",
                  "approximate",
                  "Jordan-RoPE 4.5, 5.6; spec 1.8",
                  gate_options("3", "gates", "0.1/0.05", "1"),
                  {"jordan_jetmix_mM_cCCC_gG1_..."}},
                 [gate_segment](const Args& a, Builder& b) {
                   const int m = a.integer("m", 2, 8);
                   JordanSegment s = gate_segment(a, b, m);
                   s.gate_init = a.list("gates");
                   s.gate_max = a.positive("gate_max");
                   if (static_cast<int>(s.gate_init.size()) != m - 1)
                     throw InputError(fmt::format("jetmix: gates needs m-1 = {} values, got {}",
                                                  m - 1, s.gate_init.size()));
                   for (double g : s.gate_init)
                     if (std::abs(g) >= s.gate_max)
                       throw InputError(fmt::format("jetmix: |gate| {} must be below gate_max {}",
                                                    g, s.gate_max));
                   s.learn_gates = true;
                   s.alpha0_init = 1.0;
                   b.add(s);
                   set_center(a, b.m, false);
                 }});
    d.push_back(
        {{"jetmixfull",
          "transform",
          "jet gates with a learnable alpha_0 too (only ratios g_k/alpha_0 reach the score)",
          "approximate",
          "Jordan-RoPE 4.5; spec 1.8",
          gate_options("4", "alpha", "1/0.5/0.3/0.2", "2"),
          {"jordan_jetmixfull_mM_cCCC_gG0_..."}},
         [gate_segment](const Args& a, Builder& b) {
           const int m = a.integer("m", 2, 8);
           JordanSegment s = gate_segment(a, b, m);
           const auto al = a.list("alpha");
           s.gate_max = a.positive("gate_max");
           if (static_cast<int>(al.size()) != m)
             throw InputError(
                 fmt::format("jetmixfull: alpha needs m = {} values, got {}", m, al.size()));
           for (double g : al)
             if (std::abs(g) >= s.gate_max)
               throw InputError(
                   fmt::format("jetmixfull: |alpha| {} must be below gate_max {}", g, s.gate_max));
           if (al[0] <= 0) throw InputError("jetmixfull: alpha_0 must be > 0");
           s.alpha0_init = al[0];
           s.gate_init.assign(al.begin() + 1, al.end());
           s.learn_gates = s.learn_alpha0 = true;
           b.add(s);
           set_center(a, b.m, false);
         }});
    {
      auto o = gate_options("3", "alpha", "0.7/0.2/0.1", "");
      o.push_back({"learn", "false", "false: fixed spectrum; true: alpha = softmax(logits)"});
      d.push_back({{"jetspec",
                    "transform",
                    "normalized jet spectrum: alpha_r >= 0, sum 1, on (base phase, jets 1..m-1)",
                    "approximate",
                    "Jordan-RoPE 4.5, Tables 9/14/15 (Norm-jet)",
                    o,
                    {}},
                   [gate_segment](const Args& a, Builder& b) {
                     const int m = a.integer("m", 2, 8);
                     JordanSegment s = gate_segment(a, b, m);
                     const auto al = a.list("alpha");
                     if (static_cast<int>(al.size()) != m)
                       throw InputError(
                           fmt::format("jetspec: alpha needs m = {} values, got {}", m, al.size()));
                     double sum = 0;
                     for (double x : al) {
                       if (x < 0) throw InputError("jetspec: alpha must be non-negative");
                       sum += x;
                     }
                     if (std::abs(sum - 1.0) > 1e-6)
                       throw InputError(
                           fmt::format("jetspec: alpha must sum to 1, sums to {}", sum));
                     if (al[0] <= 0) throw InputError("jetspec: alpha_0 must be > 0");
                     s.alpha0_init = al[0];
                     s.gate_init.assign(al.begin() + 1, al.end());
                     s.spectrum_softmax = a.flag("learn");
                     s.learn_gates = s.learn_alpha0 = s.spectrum_softmax;
                     s.gate_max = 1.0;
                     b.add(s);
                     set_center(a, b.m, false);
                   }});
    }
    for (auto& x : d) x.info.options = with_ranges(std::move(x.info.options));
    return d;
  }();
  return defs;
}

const TermDef* find_term(const std::string& name) {
  for (const auto& d : term_defs())
    if (d.info.name == name) return &d;
  return nullptr;
}

std::string valid_names() {
  std::vector<std::string> n;
  for (const auto& d : term_defs()) n.push_back(d.info.name);
  return fmt::format("{}", fmt::join(n, ", "));
}

}  // namespace

const std::vector<MechanismInfo>& mechanism_catalog() {
  static const std::vector<MechanismInfo> cat = [] {
    std::vector<MechanismInfo> c;
    for (const auto& d : term_defs()) c.push_back(d.info);
    return c;
  }();
  return cat;
}

Mechanism build_mechanism(const std::string& spec_in, int head_dim, int heads) {
  if (head_dim <= 0 || head_dim > kMaxHeadDim)
    throw InputError(fmt::format("head dim must be in [1, {}], got {}", kMaxHeadDim, head_dim));
  if (heads <= 0 || heads > kMaxHeads)
    throw InputError(fmt::format("head count must be in [1, {}], got {}", kMaxHeads, heads));
  if (spec_in.size() > kMaxSpecLength)
    throw InputError(
        fmt::format("spec '{}' is longer than {} characters", brief(spec_in), kMaxSpecLength));
  std::string spec = spec_in;
  if (const std::string alias = expand_reference_alias(spec); !alias.empty()) spec = alias;
  const auto terms = parse_spec(spec);
  // Terms that are reference names (e.g. `jordan_exact_c010 + alibi`) expand in place.
  std::vector<SpecTerm> expanded;
  for (const auto& t : terms) {
    const std::string alias = t.args.empty() ? expand_reference_alias(t.name) : "";
    if (!find_term(t.name) && !alias.empty()) {
      for (auto& e : parse_spec(alias)) expanded.push_back(e);
    } else {
      expanded.push_back(t);
    }
  }
  Mechanism m;
  m.head_dim = head_dim;
  m.heads = heads;
  Builder b{m};
  bool have_transform = false;
  std::vector<std::string> canon;
  for (const auto& t : expanded) {
    const TermDef* def = find_term(t.name);
    if (!def)
      throw InputError(
          fmt::format("unknown mechanism '{}' in spec '{}' (valid: {}; reference "
                      "method names such as jordan_exact_c010 are accepted too)",
                      brief(t.name), brief(spec_in), valid_names()));
    std::map<std::string, std::string> vals;
    for (const auto& o : def->info.options) vals[o.key] = o.default_value;
    for (const auto& [k, v] : t.args) {
      if (!vals.count(k)) {
        std::vector<std::string> keys;
        for (const auto& o : def->info.options) keys.push_back(o.key);
        throw InputError(
            fmt::format("unknown option '{}' for '{}' (valid: {})", brief(k), t.name,
                        keys.empty() ? "none" : fmt::format("{}", fmt::join(keys, ", "))));
      }
      vals[k] = v;
    }
    if (def->info.kind == "bias") {
      if (m.alibi) throw InputError(fmt::format("spec '{}' names alibi twice", brief(spec_in)));
      m.alibi = AlibiBias{alibi_slopes(heads)};
    } else {
      if (have_transform)
        throw InputError(
            fmt::format("spec '{}' has two position transforms; combine one transform with biases "
                        "(use direct_sum for a RoPE (+) distance split)",
                        brief(spec_in)));
      have_transform = true;
      if (m.name.empty()) m.name = t.name;
      def->build(Args(t.name, vals, def->info.options), b);
    }
    std::vector<std::string> kv;
    for (const auto& o : def->info.options) kv.push_back(o.key + "=" + vals[o.key]);
    canon.push_back(kv.empty() ? t.name : fmt::format("{}({})", t.name, fmt::join(kv, ", ")));
  }
  if (m.name.empty()) m.name = expanded.front().name;
  if (b.next_pair * 2 > head_dim)
    throw InputError(fmt::format("spec '{}' needs {} dims, head has {}", brief(spec_in),
                                 b.next_pair * 2, head_dim));
  m.spec = fmt::format("{}", fmt::join(canon, " + "));
  return m;
}

std::vector<std::string> verify_default_specs() {
  return {"nope",
          "rope",
          "damped_rope",
          "damped_rope(m=1)",
          "alibi",
          "rope + alibi",
          "direct_sum",
          "direct_sum(regime=raw)",
          "real_jordan",
          "real_jordan(regime=raw)",
          "jordan(m=2, regime=stabilized)",
          "jordan(m=2, regime=raw)",
          "jordan(m=2, regime=scaled)",
          "jordan(m=3, regime=scaled, c=0.5, eta0=0.1, eta_max=1)",
          "jordan(m=3, regime=raw)",
          "jordan(m=4, regime=scaled)",
          "jordan(m=5, regime=scaled)",
          "jordan(m=3, regime=stabilized)",
          "jordan(m=2, regime=raw) + alibi",
          // jet gates are uncentred by default (the reference convention; their scores depend on
          // c0) and their damping 1.5/L binds the clamp beyond |p| = 20L: verify them centred
          "jetmix(m=3, gates=0.1/0.05, center=mid)",
          "jetmixfull(m=4, alpha=1/0.5/0.3/0.2, center=mid)",
          "jetspec(m=3, alpha=0.7/0.2/0.1, center=mid)",
          "jetspec(m=3, alpha=0.69/0.21/0.1, learn=true, center=mid)"};
}

}  // namespace relpos
