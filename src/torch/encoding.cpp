#include "torch/encoding.hpp"

#include <fmt/format.h>

#include <cmath>

#include "core/registry.hpp"
#include "torch/transform_function.hpp"

namespace relpos::nn {

namespace {

torch::Tensor from_vec(const std::vector<double>& v, std::vector<int64_t> shape) {
  return torch::tensor(v, torch::kDouble).reshape(shape).to(torch::kFloat);
}

// Per-block columns of a [H, NB] mask built from a segment predicate.
template <class F>
torch::Tensor block_mask(const Mechanism& m, F&& pred) {
  std::vector<double> v(static_cast<size_t>(m.total_blocks()), 0.0);
  for (const auto& s : m.segments)
    for (int b = 0; b < s.blocks; ++b) v[s.first_block + b] = pred(s) ? 1.0 : 0.0;
  return from_vec(v, {1, m.total_blocks()});
}
template <class F>
torch::Tensor block_value(const Mechanism& m, F&& value) {
  std::vector<double> v(static_cast<size_t>(m.total_blocks()), 0.0);
  for (const auto& s : m.segments)
    for (int b = 0; b < s.blocks; ++b) v[s.first_block + b] = value(s);
  return from_vec(v, {1, m.total_blocks()});
}

std::string dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat:
      return "float32";
    case torch::kDouble:
      return "float64";
    case torch::kHalf:
      return "float16";
    case torch::kBFloat16:
      return "bfloat16";
    default:
      return c10::toString(t);
  }
}

std::string shape_str(const torch::Tensor& t) {
  return fmt::format("{}", fmt::join(t.sizes(), ", "));
}

}  // namespace

torch::Tensor PositionEncodingImpl::make(const std::string& name, torch::Tensor value,
                                         bool learnable) {
  return learnable ? register_parameter(name, value) : register_buffer(name, value);
}

namespace {
// head_dim and heads arrive as int64 (tensor sizes); check them before they narrow to int
int checked_int(int64_t v, int64_t hi, const char* what) {
  if (v <= 0 || v > hi) throw InputError(fmt::format("{} must be in [1, {}], got {}", what, hi, v));
  return static_cast<int>(v);
}
}  // namespace

PositionEncodingImpl::PositionEncodingImpl(const std::string& spec, int64_t head_dim, int64_t heads,
                                           EncodingOptions options)
    : mech_(build_mechanism(spec, checked_int(head_dim, kMaxHeadDim, "head dim"),
                            checked_int(heads, kMaxHeads, "head count"))),
      plan_(kernels::TransformPlan::from(mech_, options.layout)),
      options_(options) {
  if (!mech_.has_transform()) return;
  const ParamValues init = default_params(mech_);
  const int64_t H = heads, NB = mech_.total_blocks(), G = mech_.gate_rows();
  const auto any = [&](auto pred) {
    return std::any_of(mech_.segments.begin(), mech_.segments.end(), pred);
  };
  // gamma = softplus(a) + gamma_min where learnable, the fixed initial value elsewhere
  damped_ = make("damped", block_mask(mech_, [](const auto& s) { return s.damped; }), false);
  gamma_min_ =
      make("gamma_min", block_value(mech_, [](const auto& s) { return s.gamma_min; }), false);
  gamma_learn_ =
      make("gamma_learn", block_mask(mech_, [](const auto& s) { return s.learn_gamma; }), false);
  gamma_fixed_ = make("gamma_fixed", from_vec(init.gamma, {H, NB}), false);
  {
    // a = log(expm1(max(gamma0 - gamma_min, 1e-8))) (reference initialisation)
    auto v = (gamma_fixed_ - gamma_min_).clamp_min(1e-8).to(torch::kDouble);
    raw_gamma_ = make("raw_gamma", torch::log(torch::expm1(v)).to(torch::kFloat),
                      any([](const auto& s) { return s.learn_gamma; }));
  }
  eta_max_ = make("eta_max", block_value(mech_, [](const auto& s) { return s.eta_max; }), false);
  eta_learn_ = make(
      "eta_learn",
      block_mask(mech_,
                 [](const auto& s) { return s.shear == ShearMode::Exponential && s.learn_eta; }),
      false);
  eta_fixed_ = make("eta_fixed", from_vec(init.eta, {H, NB}), false);
  raw_eta_ =
      make("raw_eta", torch::atanh((eta_fixed_ / eta_max_).clamp(-0.999999, 0.999999)),
           any([](const auto& s) { return s.shear == ShearMode::Exponential && s.learn_eta; }));
  if (G > 0) {
    const JordanSegment* gs = nullptr;
    for (const auto& s : mech_.segments)
      if (s.shear == ShearMode::Gates) gs = &s;
    spectrum_ = gs->spectrum_softmax;
    gates_learn_ = gs->learn_gates && !spectrum_;
    alpha0_learn_ = gs->learn_alpha0 && !spectrum_;
    gate_max_ =
        make("gate_max", block_value(mech_, [](const auto& s) { return s.gate_max; }), false);
    gates_fixed_ = make("gates_fixed", from_vec(init.gates, {G, H, NB}), false);
    alpha0_fixed_ = make("alpha0_fixed", from_vec(init.alpha0, {H, NB}), false);
    if (spectrum_) {
      spectrum_logits_ = register_parameter(
          "spectrum_logits", torch::log(torch::cat({alpha0_fixed_.unsqueeze(0), gates_fixed_}, 0)));
    }
    if (gates_learn_)
      raw_gates_ = register_parameter(
          "raw_gates", torch::atanh((gates_fixed_ / gate_max_).clamp(-0.999999, 0.999999)));
    if (alpha0_learn_)
      raw_alpha0_ = register_parameter(
          "raw_alpha0", torch::atanh((alpha0_fixed_ / gate_max_).clamp(-0.999999, 0.999999)));
  }
}

KernelParams PositionEncodingImpl::kernel_params() const {
  KernelParams p;
  if (!mech_.has_transform()) return p;
  const auto learned_gamma = torch::nn::functional::softplus(raw_gamma_) + gamma_min_;
  p.gamma = torch::where(gamma_learn_ > 0, learned_gamma, gamma_fixed_) * damped_;
  p.eta = torch::where(eta_learn_ > 0, eta_max_ * torch::tanh(raw_eta_), eta_fixed_);
  if (mech_.gate_rows() > 0) {
    if (spectrum_) {
      const auto a = torch::softmax(spectrum_logits_, 0);
      p.alpha0 = a[0];
      p.gates = a.slice(0, 1);
    } else {
      p.gates = gates_learn_ ? gate_max_ * torch::tanh(raw_gates_) : gates_fixed_;
      p.alpha0 = alpha0_learn_ ? gate_max_ * torch::tanh(raw_alpha0_) : alpha0_fixed_;
    }
  } else {
    p.gates = torch::empty({0}, p.gamma.options());
    p.alpha0 = torch::ones_like(p.gamma);
  }
  return p;
}

ParamValues PositionEncodingImpl::param_values() const {
  ParamValues v = default_params(mech_);
  if (!mech_.has_transform()) return v;
  torch::NoGradGuard ng;
  const auto kp = kernel_params();
  const auto copy = [](const torch::Tensor& t, std::vector<double>& out) {
    if (!t.defined() || t.numel() == 0) return;
    const auto d = t.to(torch::kDouble).contiguous();
    out.assign(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  };
  copy(kp.gamma, v.gamma);
  copy(kp.eta, v.eta);
  copy(kp.gates, v.gates);
  copy(kp.alpha0, v.alpha0);
  return v;
}

double PositionEncodingImpl::center_for(const torch::Tensor& positions) const {
  if (mech_.center != CenterMode::Mid || positions.numel() == 0) return mech_.resolve_center(0, 0);
  return mech_.resolve_center(positions.min().item<double>(), positions.max().item<double>());
}

void PositionEncodingImpl::warn_once(const torch::Tensor& user_positions, const torch::Tensor& pos,
                                     double center, const KernelParams& kp) {
  if (pos.numel() == 0) return;
  const double lo = pos.min().item<double>(), hi = pos.max().item<double>();
  // float32 (or narrower) positions: resolution ulp(|p|) >= 1/16 from |p| = 2^19 on, so
  // fractional positions have already collapsed before they reach us
  if (!warned_.resolution && user_positions.defined() && user_positions.is_floating_point() &&
      user_positions.scalar_type() != torch::kDouble) {
    const double far = std::max(std::abs(lo), std::abs(hi));
    const int mant = user_positions.scalar_type() == torch::kFloat      ? 24
                     : user_positions.scalar_type() == torch::kBFloat16 ? 8
                                                                        : 11;
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(far, 1.0)) - (mant - 1));
    if (ulp >= 1.0 / 16) {
      warned_.resolution = true;
      TORCH_WARN(fmt::format(
          "relpos {}: positions reach {} in {}, where that type resolves only steps of {}; pass "
          "float64 (or int64) positions to keep fractional positions distinct",
          mech_.name, far, dtype_name(user_positions.scalar_type()), ulp));
    }
  }
  // the exponent clamp |gamma (p - c0)| <= max_exp changes the scores where it binds
  if (!warned_.clamp && kp.gamma.defined() && kp.gamma.numel() > 0) {
    ParamValues pv = default_params(mech_);
    const auto g = kp.gamma.detach().to(torch::kDouble).contiguous();
    pv.gamma.assign(g.data_ptr<double>(), g.data_ptr<double>() + g.numel());
    const double far = std::max(std::abs(lo - center), std::abs(hi - center));
    if (clamp_ratio(mech_, pv, far) > 1) {
      warned_.clamp = true;
      TORCH_WARN(fmt::format(
          "relpos {}: the exponent clamp |gamma (p - c0)| <= max_exp binds for positions in [{}, "
          "{}] (centre c0 = {}); scores there are no longer a function of the lag. Set center= "
          "nearer the positions, or raise max_exp (float64 up to 709)",
          mech_.name, lo, hi, center));
    }
  }
  // center=mid resolves per call: transformed keys of one call and queries of another do not
  // compose (prefill + decode); say so the first time the centre moves
  if (!warned_.center && mech_.center == CenterMode::Mid) {
    if (last_center_ && *last_center_ != center) {
      warned_.center = true;
      TORCH_WARN(fmt::format(
          "relpos {}: center=mid moved from {} to {} between calls; keys and queries transformed "
          "in different calls must not be scored together. Use center=auto or a number for "
          "streaming",
          mech_.name, *last_center_, center));
    }
    last_center_ = center;
  }
}

torch::Tensor checked_positions(const Mechanism& m, const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& positions, bool check_finite) {
  if (q.defined() && k.defined() && q.scalar_type() != k.scalar_type())
    throw InputError(fmt::format("q is {} but k is {}: pass both in one dtype",
                                 dtype_name(q.scalar_type()), dtype_name(k.scalar_type())));
  for (const auto* t : {&q, &k}) {
    const char* name = t == &q ? "q" : "k";
    if (!t->defined()) throw InputError(fmt::format("{} is undefined", name));
    if (t->dim() != 4)
      throw InputError(fmt::format("{} must be [B, H, T, D], got [{}]", name, shape_str(*t)));
    if (t->scalar_type() != torch::kFloat && t->scalar_type() != torch::kDouble)
      throw InputError(fmt::format("{} must be float32 or float64", name));
    if (!t->device().is_cpu()) throw InputError(fmt::format("{} must be on the CPU", name));
    if (t->size(3) != m.head_dim)
      throw InputError(fmt::format("{} has head dim {}, the encoding was built for {}", name,
                                   t->size(3), m.head_dim));
    if (t->size(1) != m.heads)
      throw InputError(
          fmt::format("{} has {} heads, the encoding was built for {}", name, t->size(1), m.heads));
    if (check_finite && !torch::isfinite(*t).all().item<bool>())
      throw InputError(fmt::format("{} contains NaN or Inf", name));
  }
  if (q.sizes() != k.sizes())
    throw InputError(fmt::format("q [{}] and k [{}] differ in shape", shape_str(q), shape_str(k)));
  const int64_t B = q.size(0), T = q.size(2);
  if (!positions.defined()) return torch::arange(T, torch::kDouble);
  const bool ok = (positions.dim() == 1 && positions.size(0) == T) ||
                  (positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T);
  if (!ok)
    throw InputError(fmt::format("positions must be [T] or [B, T] = [{}, {}], got [{}]", B, T,
                                 shape_str(positions)));
  auto p = positions.to(torch::kDouble).contiguous();
  if (!torch::isfinite(p).all().item<bool>()) throw InputError("positions contain NaN or Inf");
  return p;
}

PositionEncodingImpl::Output PositionEncodingImpl::forward(const torch::Tensor& q,
                                                           const torch::Tensor& k,
                                                           const torch::Tensor& positions) {
  const auto pos = checked_positions(mech_, q, k, positions, options_.check_finite);
  if (!mech_.has_transform() || q.numel() == 0) return {q, k};
  auto kp = kernel_params();
  const auto dt = q.scalar_type();
  check_exponent_range(dt);
  const double center = center_for(pos);
  warn_once(positions, pos, center, kp);
  auto& c = trig_cache_;
  const bool hit = c.table.size() == 2 && c.dtype == dt && c.center == center &&
                   c.positions.sizes() == pos.sizes() && torch::equal(c.positions, pos) &&
                   (pos.dim() == 1 || c.positions.size(0) == q.size(0));
  if (!hit) c = {pos.clone(), center, dt, trig_table(plan_, q.size(0), q.size(2), pos, center, dt)};
  const auto out = transform_qk(plan_, q, k, kp.gamma.to(dt), kp.eta.to(dt), kp.gates.to(dt),
                                kp.alpha0.to(dt), pos, center, c.table);
  return {out[0], out[1]};
}

void PositionEncodingImpl::check_exponent_range(torch::ScalarType dt) const {
  // e^x is finite for x <= 88.72 in float32 and 709.78 in float64
  const double limit = dt == torch::kFloat ? 88.0 : 709.0;
  for (const auto& s : mech_.segments)
    if (s.damped && s.max_exponent > limit)
      throw InputError(fmt::format(
          "{}: max_exp={} overflows {} (e^x is finite only up to x = {}); use float64 tensors or "
          "max_exp <= {}",
          mech_.name, s.max_exponent, dtype_name(dt), limit, limit));
}

torch::Tensor PositionEncodingImpl::alibi_slopes() const {
  if (!mech_.alibi) return {};
  return torch::tensor(mech_.alibi->slopes, torch::kDouble).to(torch::kFloat);
}

torch::Tensor PositionEncodingImpl::logit_bias(const torch::Tensor& qp,
                                               const torch::Tensor& kp) const {
  if (!mech_.alibi) return {};
  const auto lag =
      (qp.to(torch::kFloat).unsqueeze(1) - kp.to(torch::kFloat).unsqueeze(0)).clamp_min(0);
  return -alibi_slopes().view({-1, 1, 1}) * lag.unsqueeze(0);
}

}  // namespace relpos::nn
