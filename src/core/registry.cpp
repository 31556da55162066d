#include "core/registry.hpp"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "core/charts.hpp"
#include "core/mechanisms/family.hpp"
#include "core/parse.hpp"
#include "core/rope_scaling.hpp"
#include "core/spec.hpp"

namespace relpos {

namespace {

using mechanisms::Args;
using mechanisms::TermBuilder;
using mechanisms::TermDef;

// Every family's terms, in list.inc's order, with the option ranges filled in.
const std::vector<TermDef>& term_defs() {
  static const std::vector<TermDef> defs = [] {
    std::vector<TermDef> d;
#define RELPOS_FAMILY(NAME) \
  for (auto& t : mechanisms::NAME##_family()) d.push_back(std::move(t));
#include "core/mechanisms/list.inc"
#undef RELPOS_FAMILY
    for (auto& x : d) x.info.options = mechanisms::with_ranges(std::move(x.info.options));
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

std::vector<double> slopes_for_heads(const Mechanism& m, int64_t heads) {
  const BiasTerm* sb = m.slope_bias();
  if (!sb) return {};
  if (heads == m.heads) return sb->slopes;
  return build_mechanism(m.spec, m.head_dim, static_cast<int>(heads)).slope_bias()->slopes;
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
  TermBuilder b{m, {}, -1, 0, 0};
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
    if (def->info.kind == "bias" && std::any_of(m.biases.begin(), m.biases.end(),
                                                [&](const auto& x) { return x.name == t.name; }))
      throw InputError(fmt::format("spec '{}' names {} twice", brief(spec_in), t.name));
    if (m.name.empty() && def->info.kind == "transform") m.name = t.name;
    b.term_name = t.name;
    b.current = -1;
    def->build(Args(t.name, vals, def->info.options), b);
    const auto driven = std::count_if(m.transforms.begin(), m.transforms.end(),
                                      [](const auto& x) { return x.position_driven(); });
    if (driven > 1)
      throw InputError(fmt::format(
          "spec '{}' has two position-driven transforms: they do not compose into a relative "
          "map in general; use one (direct_sum splits the head), and fixed maps around it "
          "(orthogonal_mix + rope)",
          brief(spec_in)));
    std::vector<std::string> kv;
    for (const auto& o : def->info.options) kv.push_back(o.key + "=" + vals[o.key]);
    canon.push_back(kv.empty() ? t.name : fmt::format("{}({})", t.name, fmt::join(kv, ", ")));
  }
  if (m.name.empty()) m.name = expanded.front().name;
  // vector positions [T, d_c] drive the rotation; a scalar lag (for a bias or a Jordan term) is
  // not defined on them
  if (const TransformTerm* s = m.structured_term();
      s && (m.transforms.size() > 1 || !m.biases.empty() || m.rope_scaling.active()))
    throw InputError(fmt::format(
        "spec '{}': '{}' rotates by vector positions; it composes with no other term (the other "
        "terms read scalar positions)",
        brief(spec_in), s->name));
  apply_rope_scaling(m);  // a context-extension term rescales the rotary frequencies
  m.params = jordan_param_schema(m);
  if (b.next_pair * 2 > head_dim)
    throw InputError(fmt::format("spec '{}' needs {} dims, head has {}", brief(spec_in),
                                 b.next_pair * 2, head_dim));
  m.spec = fmt::format("{}", fmt::join(canon, " + "));
  return m;
}

std::vector<std::string> verify_default_specs() {
  return {"nope", "rope", "damped_rope", "damped_rope(m=1)", "alibi", "rope + alibi", "direct_sum",
          "direct_sum(regime=raw)", "real_jordan", "real_jordan(regime=raw)",
          "jordan(m=2, regime=stabilized)", "jordan(m=2, regime=raw)", "jordan(m=2, regime=scaled)",
          "jordan(m=3, regime=scaled, c=0.5, eta0=0.1, eta_max=1)", "jordan(m=3, regime=raw)",
          "jordan(m=4, regime=scaled)", "jordan(m=5, regime=scaled)",
          "jordan(m=3, regime=stabilized)", "jordan(m=2, regime=raw) + alibi",
          // jet gates are uncentred by default (the reference convention; their scores depend on
          // c0) and their damping 1.5/L binds the clamp beyond |p| = 20L: verify them centred
          "jetmix(m=3, gates=0.1/0.05, center=mid)",
          "jetmixfull(m=4, alpha=1/0.5/0.3/0.2, center=mid)",
          "jetspec(m=3, alpha=0.7/0.2/0.1, center=mid)",
          "jetspec(m=3, alpha=0.69/0.21/0.1, learn=true, center=mid)"};
}

nlohmann::json catalog_json() {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& m : mechanism_catalog()) {
    nlohmann::json opts = nlohmann::json::array();
    for (const auto& o : m.options) {
      nlohmann::json oj{{"key", o.key}, {"default", o.default_value}, {"doc", o.doc}};
      if (o.has_range()) {
        oj["min"] = o.min;
        oj["max"] = o.max;
      }
      opts.push_back(std::move(oj));
    }
    j.push_back({{"name", m.name},
                 {"kind", m.kind},
                 {"summary", m.summary},
                 {"exactness", m.exactness},
                 {"paper", m.paper},
                 {"options", opts},
                 {"aliases", m.aliases}});
  }
  return j;
}

namespace {

// A Jordan term's segments, field for field as in JordanSegment (core/mechanism.hpp): what the
// transform kernels read to build the per-position maps (kernels::TransformPlan), so that other
// backends build the same maps from this data. omega is the rule as built: a dynamic
// context-extension rule rescales it per call (scaled_for_length; the frequencies op gives it at a
// length). The parameterisation (initial values, ranges) is in "params".
nlohmann::json segments_json(const std::vector<JordanSegment>& segments) {
  const auto shear = [](ShearMode s) {
    return s == ShearMode::None ? "none" : s == ShearMode::Exponential ? "exponential" : "gates";
  };
  nlohmann::json out = nlohmann::json::array();
  for (const auto& s : segments)
    out.push_back({{"first_pair", s.first_pair},
                   {"first_block", s.first_block},
                   {"blocks", s.blocks},
                   {"order", s.order},
                   {"omega", s.omega},
                   {"grid", {{"theta", s.grid.theta}, {"dim", s.grid.dim}}},
                   {"chart", to_string(s.chart)},  // sigma: raw, bounded_tau, lightcone_*
                   {"L", s.L},
                   {"shear_scale", s.shear_scale},
                   {"shear", shear(s.shear)},
                   {"damped", s.damped},
                   {"max_exponent", s.max_exponent}});
  return out;
}

}  // namespace

nlohmann::json mechanism_json(const Mechanism& m) {
  const auto kind = [](TransformKind k) {
    return k == TransformKind::JordanBlocks  ? "jordan_blocks"
           : k == TransformKind::FixedLinear ? "fixed_linear"
                                             : "vector_rotation";
  };
  const auto reparam = [](Reparam r) {
    switch (r) {
      case Reparam::SoftplusFloor:
        return "softplus_floor";
      case Reparam::BoundedTanh:
        return "bounded_tanh";
      case Reparam::SoftmaxSimplex:
        return "softmax_simplex";
    }
    return "?";
  };
  const auto slot = [](BlockParam b) {
    switch (b) {
      case BlockParam::Gamma:
        return "gamma";
      case BlockParam::Eta:
        return "eta";
      case BlockParam::Gates:
        return "gates";
      case BlockParam::Alpha0:
        return "alpha0";
      case BlockParam::Spectrum:
        return "spectrum";
    }
    return "?";
  };
  nlohmann::json terms = nlohmann::json::array();
  for (const auto& t : m.transforms) {
    nlohmann::json tj{{"name", t.name},
                      {"kind", kind(t.kind)},
                      {"time", t.time == TimeSource::Position       ? "position"
                               : t.time == TimeSource::ContentPhase ? "content_phase"
                                                                    : "vector_position"},
                      {"roles", t.roles.str()},
                      {"values", t.roles.values},
                      {"outputs", t.roles.outputs},
                      {"exact", t.exact()},
                      // parameters a model owns beside the encoding (GRAPE-M's frequencies, basis)
                      {"learned_frequencies", t.learned_frequencies},
                      {"frequency_scale", t.frequency_scale},
                      {"basis", t.basis}};
    if (t.roles.values || t.roles.outputs || t.time == TimeSource::ContentPhase) {
      // a journey term (core/mechanisms/journey.cpp): frame angle of pair m = time * f_m
      std::vector<double> f;
      for (const auto& sg : t.segments)
        for (double w : sg.omega) f.push_back(-w);
      tj["frame_frequencies"] = f;
      tj["scan"] = t.scan == PhaseScan::Exclusive ? "exclusive" : "reversed_inclusive";
    }
    if (t.vector_positions()) {
      tj["vector_dims"] = t.vector_dims;
      tj["planes"] = t.planes;
      tj["plane_freqs"] = t.plane_freqs;  // initial lambda [H, d_c, M], row-major
    }
    if (t.kind == TransformKind::JordanBlocks) tj["segments"] = segments_json(t.segments);
    if (t.kind == TransformKind::FixedLinear) {
      tj["matrix"] = t.matrix;
      tj["matrix_inv_t"] = t.matrix_inv_t;
    }
    terms.push_back(std::move(tj));
  }
  nlohmann::json biases = nlohmann::json::array();
  for (const auto& b : m.biases) {
    // a learned lag table's parameters (state-dict names, shapes, initial values): what the
    // Python module registers
    nlohmann::json lag_params = nlohmann::json::array();
    if (b.learned)
      for (const auto& p : b.learned->params(m.heads))
        lag_params.push_back(
            {{"name", p.name}, {"shape", p.shape}, {"init", p.init}, {"trained", p.trained}});
    biases.push_back(
        {{"name", b.name},
         {"shape", b.shape == BiasShape::LagTable       ? "lag_table"
                   : b.shape == BiasShape::Separable    ? "separable"
                   : b.shape == BiasShape::PathIntegral ? "path_integral"
                                                        : "gated_slope"},
         {"slopes", b.slopes},
         {"gate", b.gate},
         {"paper_form", b.paper_form},
         {"probe_dim", b.probe_dim},
         {"learned", b.learned != nullptr},
         {"lag_params", std::move(lag_params)},
         // the lag from which a learned table stops changing (null: never)
         {"constant_from", b.learned && b.learned->constant_from() != LagKernel::kUnbounded
                               ? nlohmann::json(b.learned->constant_from())
                               : nlohmann::json(nullptr)}});
  }
  const ParamValues init = default_params(m);
  nlohmann::json params = nlohmann::json::array();
  for (const auto& p : m.params) {
    const std::vector<double> v = slot_values(init, p.slot);
    std::vector<int> learn(p.learn.begin(), p.learn.end());
    params.push_back({{"name", p.name},
                      {"slot", slot(p.slot)},
                      {"shape", p.shape},
                      {"reparam", reparam(p.reparam)},
                      {"bound", p.bound},
                      {"learn", learn},
                      {"init", v}});
  }
  std::string center = "none";
  if (m.center == CenterMode::Mid) center = "mid";
  if (m.center == CenterMode::Fixed) center = "fixed";
  double max_exp = 0;
  for (const auto& s : m.segments())
    if (s.damped) max_exp = std::max(max_exp, s.max_exponent);
  return {{"spec", m.spec},
          {"name", m.name},
          {"head_dim", m.head_dim},
          {"heads", m.heads},
          {"exactness", m.exactness()},
          {"total_blocks", m.total_blocks()},
          {"gate_rows", m.gate_rows()},
          {"transforms", terms},
          {"biases", biases},
          {"params", params},
          {"center", center},
          {"center_value", m.center_value},
          {"max_exp", max_exp},
          {"rope_scaling", rope_scaling_spec(m.rope_scaling.rule)},
          // a dynamic rule changes the frequencies with the context: cached keys would go stale
          {"rope_scaling_dynamic", m.rope_scaling.dynamic()}};
}

}  // namespace relpos
