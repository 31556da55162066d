#include "core/mechanism.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/charts.hpp"
#include "core/jet_features.hpp"

namespace relpos {

bool JordanSegment::exact() const {
  if (shear == ShearMode::None || order == 1) return true;
  if (shear == ShearMode::Gates) return false;  // g_k != g_1^k in general: no group law
  return chart_is_linear(chart);
}

std::string Roles::str() const {
  std::string r = "queries, keys";
  if (values) r += ", values";
  if (outputs) r += ", outputs";
  return r;
}

bool TransformTerm::exact() const {
  return std::all_of(segments.begin(), segments.end(), [](const auto& s) { return s.exact(); });
}

bool TransformTerm::orthogonal_fixed() const {
  return kind == TransformKind::FixedLinear && matrix == matrix_inv_t;
}

bool ParamSpec::any_learnable() const {
  return std::any_of(learn.begin(), learn.end(), [](bool b) { return b; });
}

const TransformTerm* Mechanism::position_term() const {
  for (const auto& t : transforms)
    if (t.position_driven()) return &t;
  return nullptr;
}

const TransformTerm* Mechanism::structured_term() const {
  for (const auto& t : transforms)
    if (t.vector_positions()) return &t;
  return nullptr;
}

const std::vector<JordanSegment>& Mechanism::segments() const {
  static const std::vector<JordanSegment> none;
  const TransformTerm* t = position_term();
  return t ? t->segments : none;
}

const BiasTerm* Mechanism::slope_bias() const {
  for (const auto& b : biases)
    if (b.shape == BiasShape::LagTable && !b.slopes.empty()) return &b;
  return nullptr;
}

const BiasTerm* Mechanism::learned_lag_bias() const {
  for (const auto& b : biases)
    if (b.learned) return &b;
  return nullptr;
}

int Mechanism::total_blocks() const {
  int n = 0;
  for (const auto& s : segments()) n = std::max(n, s.first_block + s.blocks);
  return n;
}

int Mechanism::gate_rows() const {
  int r = 0;
  for (const auto& s : segments())
    if (s.shear == ShearMode::Gates) r = std::max(r, s.order - 1);
  return r;
}

bool Mechanism::transform_exact() const {
  return std::all_of(transforms.begin(), transforms.end(), [](const auto& t) { return t.exact(); });
}

const BiasTerm* Mechanism::content_bias() const {
  for (const auto& b : biases)
    if (b.content_dependent()) return &b;
  return nullptr;
}

std::string Mechanism::exactness() const {
  const bool tex = transform_exact();
  if (const BiasTerm* c = content_bias()) {
    // GRAPE's additive forms: relative in the positions for fixed gates, not a function of i - j
    const char* form = c->shape == BiasShape::PathIntegral ? "path-additive" : "content-gated";
    if (!has_transform()) return form;
    return fmt::format("{} + {}", tex ? "exact" : "approximate", form);
  }
  if (!has_transform()) return slope_bias() ? "augmented exact" : "exact";
  if (slope_bias()) return tex ? "exact + augmented bias" : "approximate + augmented bias";
  return tex ? "exact" : "approximate";
}

std::vector<ParamSpec> jordan_param_schema(const Mechanism& m) {
  std::vector<ParamSpec> out;
  const auto& segs = m.segments();
  if (segs.empty()) return out;
  const int NB = m.total_blocks(), H = m.heads, G = m.gate_rows();
  const auto per_block = [&](auto&& value) {
    std::vector<double> v(static_cast<size_t>(NB), 0.0);
    for (const auto& s : segs)
      for (int b = 0; b < s.blocks; ++b) v[s.first_block + b] = value(s);
    return v;
  };
  const auto learn_mask = [&](auto&& pred) {
    std::vector<bool> v(static_cast<size_t>(NB), false);
    for (const auto& s : segs)
      for (int b = 0; b < s.blocks; ++b) v[s.first_block + b] = pred(s);
    return v;
  };
  // gamma = softplus(a) + gamma_min where learnable (reference parameterisation), 0 where undamped
  out.push_back({"gamma",
                 BlockParam::Gamma,
                 {H, NB},
                 Reparam::SoftplusFloor,
                 per_block([](const auto& s) { return s.gamma_min; }),
                 learn_mask([](const auto& s) { return s.damped && s.learn_gamma; })});
  out.push_back({"eta",
                 BlockParam::Eta,
                 {H, NB},
                 Reparam::BoundedTanh,
                 per_block([](const auto& s) { return s.eta_max; }),
                 // order-1 blocks have no nilpotent part: nothing reads their eta (a buffer, no
                 // parameter that never gets a gradient)
                 learn_mask([](const auto& s) {
                   return s.order >= 2 && s.shear == ShearMode::Exponential && s.learn_eta;
                 })});
  if (G > 0) {
    const JordanSegment* gs = nullptr;
    for (const auto& s : segs)
      if (s.shear == ShearMode::Gates) gs = &s;
    const auto gate_bound = per_block([](const auto& s) { return s.gate_max; });
    if (gs->spectrum_softmax) {
      out.push_back({"spectrum",
                     BlockParam::Spectrum,
                     {G + 1, H, NB},
                     Reparam::SoftmaxSimplex,
                     gate_bound,
                     learn_mask([](const auto& s) { return s.shear == ShearMode::Gates; })});
    } else {
      out.push_back(
          {"gates",
           BlockParam::Gates,
           {G, H, NB},
           Reparam::BoundedTanh,
           gate_bound,
           learn_mask([](const auto& s) { return s.shear == ShearMode::Gates && s.learn_gates; })});
      out.push_back({"alpha0",
                     BlockParam::Alpha0,
                     {H, NB},
                     Reparam::BoundedTanh,
                     gate_bound,
                     learn_mask([](const auto& s) {
                       return s.shear == ShearMode::Gates && s.learn_alpha0;
                     })});
    }
  }
  return out;
}

double Mechanism::resolve_center(double pmin, double pmax) const {
  switch (center) {
    case CenterMode::None:
      return 0.0;
    case CenterMode::Mid:
      return std::floor(0.5 * (pmin + pmax));  // an integer centre keeps integer lags exact
    case CenterMode::Fixed:
      return center_value;
  }
  return 0.0;
}

double Mechanism::window_center(double pmin, double pmax) const {
  if (center_auto && center == CenterMode::Fixed) return std::floor(0.5 * (pmin + pmax));
  return resolve_center(pmin, pmax);
}

std::vector<double> slot_values(const ParamValues& p, BlockParam slot) {
  switch (slot) {
    case BlockParam::Gamma:
      return p.gamma;
    case BlockParam::Eta:
      return p.eta;
    case BlockParam::Gates:
      return p.gates;
    case BlockParam::Alpha0:
      return p.alpha0;
    case BlockParam::Spectrum: {
      std::vector<double> v = p.alpha0;
      v.insert(v.end(), p.gates.begin(), p.gates.end());
      return v;
    }
  }
  return {};
}

ParamValues default_params(const Mechanism& m) {
  ParamValues p;
  p.heads = m.heads;
  p.blocks = m.total_blocks();
  p.gate_rows = m.gate_rows();
  const size_t hb = static_cast<size_t>(p.heads) * p.blocks;
  p.gamma.assign(hb, 0.0);
  p.eta.assign(hb, 0.0);
  p.alpha0.assign(hb, 1.0);
  p.gates.assign(static_cast<size_t>(p.gate_rows) * hb, 0.0);
  for (const auto& s : m.segments())
    for (int h = 0; h < p.heads; ++h)
      for (int b = 0; b < s.blocks; ++b) {
        const size_t i = static_cast<size_t>(h) * p.blocks + s.first_block + b;
        p.gamma[i] = s.damped ? s.gamma_init : 0.0;
        p.eta[i] = s.shear == ShearMode::Exponential ? s.eta_init : 0.0;
        p.alpha0[i] = s.shear == ShearMode::Gates ? s.alpha0_init : 1.0;
        if (s.shear == ShearMode::Gates)
          for (int k = 1; k < s.order; ++k) p.gates[(k - 1) * hb + i] = s.gate_init[k - 1];
      }
  return p;
}

ParamValues random_params(const Mechanism& m, std::mt19937_64& rng) {
  ParamValues p = default_params(m);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  const size_t hb = static_cast<size_t>(p.heads) * p.blocks;
  for (const auto& s : m.segments())
    for (int h = 0; h < p.heads; ++h)
      for (int b = 0; b < s.blocks; ++b) {
        const size_t i = static_cast<size_t>(h) * p.blocks + s.first_block + b;
        if (s.damped && s.learn_gamma)
          p.gamma[i] = s.gamma_min + (s.gamma_random_max - s.gamma_min) * u01(rng);
        if (s.shear == ShearMode::Exponential && s.learn_eta)
          p.eta[i] = s.eta_max * (2.0 * u01(rng) - 1.0);
        if (s.shear != ShearMode::Gates) continue;
        if (s.spectrum_softmax || !s.learn_gates) {
          // a point of the simplex (the learned spectrum's range); fixed spectra keep their value
          if (!s.spectrum_softmax) continue;
          std::vector<double> a(s.order);
          double sum = 0;
          for (auto& v : a) sum += (v = -std::log(1.0 - u01(rng)));
          p.alpha0[i] = a[0] / sum;
          for (int k = 1; k < s.order; ++k) p.gates[(k - 1) * hb + i] = a[k] / sum;
        } else {
          for (int k = 1; k < s.order; ++k)
            p.gates[(k - 1) * hb + i] = s.gate_max * (2.0 * u01(rng) - 1.0);
          if (s.learn_alpha0) p.alpha0[i] = 0.25 + (s.gate_max - 0.25) * u01(rng);
        }
      }
  return p;
}

void shear_coefficients(ShearMode mode, int order, double eta, const double* gates,
                        size_t gate_stride, double alpha0, double u, double* c) {
  if (mode == ShearMode::Gates) {
    c[0] = alpha0;
    double pw = 1.0;
    for (int k = 1; k < order; ++k) {
      pw *= u / k;
      c[k] = gates[(k - 1) * gate_stride] * pw;
    }
    return;
  }
  c[0] = 1.0;
  const double x = mode == ShearMode::Exponential ? eta * u : 0.0;
  for (int k = 1; k < order; ++k) c[k] = c[k - 1] * x / k;
}

void inverse_series(int order, const double* c, double* ic) {
  ic[0] = 1.0 / c[0];
  for (int k = 1; k < order; ++k) {
    double acc = 0.0;
    for (int j = 1; j <= k; ++j) acc += c[j] * ic[k - j];
    ic[k] = -acc / c[0];
  }
}

double clamp_ratio(const Mechanism& m, const ParamValues& p, double t, int head) {
  double r = 0;
  for (const auto& s : m.segments()) {
    if (!s.damped) continue;
    for (int h = head < 0 ? 0 : head; h < (head < 0 ? p.heads : head + 1); ++h)
      for (int b = 0; b < s.blocks; ++b)
        r = std::max(r, std::abs(p.gamma[static_cast<size_t>(h) * p.blocks + s.first_block + b]) *
                            std::abs(t) / s.max_exponent);
  }
  return r;
}

std::vector<LagFeature> lag_features(const Mechanism& m, const ParamValues& p, int head, double d) {
  std::vector<LagFeature> out;
  const size_t hb = static_cast<size_t>(p.heads) * p.blocks;
  for (size_t si = 0; si < m.segments().size(); ++si) {
    const auto& s = m.segments()[si];
    for (int b = 0; b < s.blocks; ++b) {
      const size_t i = static_cast<size_t>(head) * p.blocks + s.first_block + b;
      const JetChart chart{s.chart,    s.L,  s.shear_scale, p.gamma[i],
                           Chart::Raw, true, s.max_exponent};
      for (int r = 0; r < s.order; ++r) {
        // coefficient of the unit jet J_r in U(d): eta^r (exponential shear) or g_r / alpha_0
        double coef = 1.0;
        if (r > 0 && s.shear == ShearMode::Exponential) coef = std::pow(p.eta[i], r);
        if (r > 0 && s.shear == ShearMode::Gates) coef = p.gates[(r - 1) * hb + i] / p.alpha0[i];
        if (r > 0 && s.shear == ShearMode::None) coef = 0.0;
        const JetValue j = jet_feature(chart, s.omega[b], r, d);
        const std::string base = fmt::format("s{}_b{}_r{}", si, b, r);
        out.push_back({base + "_cos", coef * j.re});
        out.push_back({base + "_sin", coef * j.im});
      }
    }
  }
  for (const auto& b : m.biases)
    if (b.shape == BiasShape::LagTable && !b.slopes.empty())
      out.push_back({b.name, -b.slopes[head] * d});
  return out;
}

std::string lag_features_refusal(const Mechanism& m) {
  for (const auto& t : m.transforms) {
    if (t.time == TimeSource::ContentPhase)
      return fmt::format(
          "its transform '{}' is driven by a phase scanned from per-token inputs, so its scores "
          "depend on the tokens between i and j, not on the lag alone",
          t.name);
    if (t.time == TimeSource::VectorPosition)
      return fmt::format(
          "its transform '{}' turns by vector positions [T, d_c], so its scores depend on the "
          "difference of two vectors, not on a scalar lag",
          t.name);
  }
  for (const auto& b : m.biases) {
    if (b.content_dependent())
      return fmt::format(
          "its bias '{}' is computed from per-token inputs (content-gated), so its scores are "
          "not a function of the lag alone",
          b.name);
    if (b.learned)
      return fmt::format(
          "its bias '{}' is a learned lag table, whose values are not among the primitive lag "
          "features this command prints",
          b.name);
  }
  return {};
}

}  // namespace relpos
