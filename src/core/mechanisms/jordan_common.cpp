// Helpers shared by the Jordan-block families, and the term builder.
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

void TermBuilder::add(JordanSegment s) {
  if (current < 0) {
    current = static_cast<int>(m.transforms.size());
    m.transforms.push_back({});
    m.transforms.back().name = term_name;
  }
  s.first_pair = next_pair;
  s.first_block = next_block;
  next_pair += s.pairs();
  next_block += s.blocks;
  m.transforms[current].segments.push_back(std::move(s));
}

void TermBuilder::add_fixed_linear(std::vector<double> M, std::vector<double> M_inv_t) {
  TransformTerm t;
  t.name = term_name;
  t.kind = TransformKind::FixedLinear;
  t.matrix = std::move(M);
  t.matrix_inv_t = std::move(M_inv_t);
  m.transforms.push_back(std::move(t));
  current = -1;
}

void TermBuilder::add_bias(BiasTerm b) {
  if (b.name.empty()) b.name = term_name;
  // the attention path takes one lag table, and each kernel's parameter names are its own
  if (b.learned && m.learned_lag_bias())
    throw InputError(fmt::format("spec has two learned lag tables ({} and {}); add one",
                                 m.learned_lag_bias()->name, b.name));
  m.biases.push_back(std::move(b));
}

void TermBuilder::add_learned_lag_table(std::shared_ptr<const LagKernel> kernel) {
  BiasTerm t;
  t.shape = BiasShape::LagTable;
  t.learned = std::move(kernel);
  add_bias(std::move(t));
}

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
JordanSegment jordan_base(const Args& a, int order, bool scaled_damping) {
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

JordanSegment rope_segment(double theta, int dim, int pairs) {
  JordanSegment s;
  s.order = 1;
  s.blocks = pairs;
  s.omega = rope_frequencies(theta, dim, pairs);
  s.grid = {theta, dim};
  for (auto& w : s.omega) w = -w;
  return s;
}

OptionInfo direction_option() {
  return {"direction", "rope",
          "rotation sense: rope (as rope: zero damping and shear give rope exactly) or paper "
          "(the Jordan-RoPE paper's and reference's e^{+i omega d}: rope at negated positions)"};
}

void set_direction(const Args& a, JordanSegment& s) {
  // rope_segment's convention (negative omega) is rope's
  if (a.choice("direction", {"rope", "paper"}) == "rope")
    for (auto& w : s.omega) w = -w;
}

std::vector<OptionInfo> shear_options(std::vector<OptionInfo> o) {
  o.push_back({"eta0", "0", "initial nilpotent amplitude eta (eta = eta_max tanh(b))"});
  o.push_back({"eta_max", "0.1", "bound of |eta|"});
  o.push_back({"learn_eta", "true", "eta is learnable per head and block"});
  return o;
}

void set_shear(const Args& a, JordanSegment& s) {
  s.shear = ShearMode::Exponential;
  s.eta_max = a.positive("eta_max");
  s.eta_init = a.num("eta0");
  if (std::abs(s.eta_init) >= s.eta_max)
    throw InputError(fmt::format("{}: |eta0| = {} must be below eta_max = {}", a.term(),
                                 std::abs(s.eta_init), s.eta_max));
  s.learn_eta = a.flag("learn_eta");
}

}  // namespace relpos::mechanisms
