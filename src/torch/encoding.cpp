#include "torch/encoding.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/registry.hpp"
#include "torch/finite.hpp"
#include "torch/mechanisms/lag_runtime.hpp"
#include "torch/op_util.hpp"
#include "torch/transform_function.hpp"

namespace relpos::nn {

namespace {

torch::Tensor from_vec(const std::vector<double>& v, std::vector<int64_t> shape) {
  return torch::tensor(v, torch::kDouble).reshape(shape).to(torch::kFloat);
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

namespace {
// head_dim and heads arrive as int64 (tensor sizes); check them before they narrow to int
int checked_int(int64_t v, int64_t hi, const char* what) {
  if (v <= 0 || v > hi) throw InputError(fmt::format("{} must be in [1, {}], got {}", what, hi, v));
  return static_cast<int>(v);
}
}  // namespace

double scaling_attention_factor(const Mechanism& m, const torch::Tensor& positions) {
  if (!m.rope_scaling.active()) return 1.0;
  const double length = positions.numel() ? positions.max().item<double>() + 1.0 : 0.0;
  return attention_factor(m, length);
}

PositionEncodingImpl::PositionEncodingImpl(const std::string& spec, int64_t head_dim, int64_t heads,
                                           EncodingOptions options)
    : mech_(build_mechanism(spec, checked_int(head_dim, kMaxHeadDim, "head dim"),
                            checked_int(heads, kMaxHeads, "head count"))),
      plan_(kernels::TransformPlan::from(mech_, options.layout)),
      options_(options),
      bias_heads_(options.bias_heads
                      ? checked_int(options.bias_heads, kMaxHeads, "lag table row count")
                      : mech_.heads) {
  if (bias_heads_ % mech_.heads)
    throw InputError(fmt::format("encoding: the heads ({}) must divide bias_heads ({})",
                                 mech_.heads, bias_heads_));
  // fixed linear terms: M and M^{-T} as buffers (they move with .to(dtype))
  for (size_t i = 0; i < mech_.transforms.size(); ++i) {
    const auto& t = mech_.transforms[i];
    if (t.kind != TransformKind::FixedLinear) continue;
    const int64_t D = head_dim;
    fixed_maps_.push_back(
        {register_buffer(fmt::format("fixed{}_m", i),
                         torch::tensor(t.matrix, torch::kDouble).view({D, D})),
         register_buffer(fmt::format("fixed{}_m_inv_t", i),
                         torch::tensor(t.matrix_inv_t, torch::kDouble).view({D, D}))});
  }
  // every parameter of the schema: raw tensor (learnable or buffer) from the inverse of its
  // reparameterisation at the initial value, the per-block bound and learn mask, the fixed value
  const ParamValues init = default_params(mech_);
  for (size_t pi = 0; pi < mech_.params.size(); ++pi) {
    const ParamSpec& ps = mech_.params[pi];
    const std::vector<double> v = slot_values(init, ps.slot);
    const int64_t NB = ps.shape.back();
    std::vector<double> learn(ps.learn.begin(), ps.learn.end());
    SchemaTensors st;
    st.index = pi;
    st.fixed = register_buffer(ps.name + "_fixed", from_vec(v, ps.shape));
    st.bound = register_buffer(ps.name + "_bound", from_vec(ps.bound, {1, NB}));
    st.learn = register_buffer(ps.name + "_learn", from_vec(learn, {1, NB}));
    torch::Tensor raw;
    const auto fixed64 = st.fixed.to(torch::kDouble);
    switch (ps.reparam) {
      case Reparam::SoftplusFloor:  // a = log(expm1(max(v - floor, 1e-8))) (reference init)
        raw = torch::log(torch::expm1((fixed64 - st.bound.to(torch::kDouble)).clamp_min(1e-8)));
        break;
      case Reparam::BoundedTanh:
        raw = torch::atanh((fixed64 / st.bound.to(torch::kDouble)).clamp(-0.999999, 0.999999));
        break;
      case Reparam::SoftmaxSimplex:
        raw = torch::log(fixed64);
        break;
    }
    raw = raw.to(torch::kFloat);
    st.raw = ps.any_learnable() ? register_parameter("raw_" + ps.name, raw)
                                : register_buffer("raw_" + ps.name, raw);
    schema_.push_back(st);
  }
  // a learned lag table: its parameters as its runtime initialises them, under the kernel's
  // names; learnable where the table reads them (LagParam::trained), else buffers
  if (const BiasTerm* b = mech_.learned_lag_bias()) {
    const auto params = b->learned->params(static_cast<int>(bias_heads_));
    auto init = initial_lag_tensors(*b->learned, static_cast<int>(bias_heads_));
    for (size_t i = 0; i < params.size(); ++i)
      lag_params_.push_back(params[i].trained ? register_parameter(params[i].name, init[i])
                                              : register_buffer(params[i].name, init[i]));
  }
}

// The key of a memo of values computed from `tensors` without autograd: their dtypes, shapes and
// bytes (every in-place change counts, also one the version counter misses), and `extra`; none
// with autograd or when a tensor is not a contiguous host tensor (computed every call).
std::optional<std::vector<uint8_t>> memo_key(const std::vector<torch::Tensor>& tensors,
                                             int64_t extra) {
  if (torch::GradMode::is_enabled()) return std::nullopt;
  std::vector<uint8_t> key;
  const auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    key.insert(key.end(), b, b + n);
  };
  put(&extra, sizeof extra);
  for (const auto& t : tensors) {
    if (!t.defined()) {
      key.push_back(0xff);
      continue;
    }
    if (!t.is_cpu() || !t.is_contiguous()) return std::nullopt;
    const auto dtype = static_cast<uint8_t>(t.scalar_type());
    const auto dims = static_cast<int64_t>(t.dim());
    put(&dtype, 1);
    put(&dims, sizeof dims);
    put(t.sizes().data(), t.dim() * sizeof(int64_t));
    put(t.data_ptr(), t.nbytes());
  }
  return key;
}

torch::Tensor PositionEncodingImpl::lag_table(int64_t len) const {
  const BiasTerm* b = mech_.learned_lag_bias();
  if (!b) return {};
  if (len < 1) throw InputError("encoding: a lag table needs at least one lag");
  auto key = memo_key(lag_params_, len);
  const int heads = static_cast<int>(bias_heads_);
  if (!key) return nn::lag_table(*b->learned, heads, lag_params_, len);
  if (*key != lag_memo_.key)
    lag_memo_ = {std::move(*key), nn::lag_table(*b->learned, heads, lag_params_, len)};
  return lag_memo_.value;
}

std::vector<std::pair<std::string, double>> PositionEncodingImpl::lag_stats() const {
  const BiasTerm* b = mech_.learned_lag_bias();
  return b ? nn::lag_stats(*b->learned, lag_params_)
           : std::vector<std::pair<std::string, double>>{};
}

LagParamValues PositionEncodingImpl::lag_values() const {
  if (!mech_.learned_lag_bias())
    throw InputError(fmt::format("encoding: mechanism '{}' has no learned lag table", mech_.spec));
  return nn::lag_values(lag_params_);
}

namespace {

// Whether a learn mask marks any entry learnable, read in place where it can be: this runs on
// every call, and a mechanism with nothing learned (RoPE) then skips its reparameterisation.
// Traced tensors (fake, functional, meta) have no values: there the full expression is kept, so
// that a compiled graph holds no branch taken on a buffer's values.
bool any_learned(const torch::Tensor& learn) {
  const auto traced =
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  if (learn.is_meta() || learn.key_set().has_any(traced)) return true;
  if (learn.device().is_cpu() && learn.is_contiguous() && learn.scalar_type() == torch::kFloat) {
    const float* x = learn.data_ptr<float>();
    return std::any_of(x, x + learn.numel(), [](float v) { return v > 0; });
  }
  return (learn > 0).any().item<bool>();
}

}  // namespace

KernelParams schema_kernel_params(const Mechanism& m, const std::vector<torch::Tensor>& schema) {
  if (schema.size() != 4 * m.params.size())
    throw InputError(
        fmt::format("'{}': {} schema tensors given, the mechanism has {} ({} x raw, "
                    "fixed, bound, learn)",
                    m.spec, schema.size(), 4 * m.params.size(), m.params.size()));
  KernelParams p;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const ParamSpec& ps = m.params[i];
    const auto &raw = schema[4 * i], &fixed = schema[4 * i + 1], &bound = schema[4 * i + 2],
               &learn = schema[4 * i + 3];
    // where(learn > 0, reparam(raw), fixed) is `fixed` itself when nothing is learned and no
    // gradient is asked of raw
    torch::Tensor v = fixed;
    if (raw.requires_grad() || any_learned(learn)) {
      switch (ps.reparam) {
        case Reparam::SoftplusFloor:
          v = torch::nn::functional::softplus(raw) + bound;
          break;
        case Reparam::BoundedTanh:
          v = bound * torch::tanh(raw);
          break;
        case Reparam::SoftmaxSimplex:
          v = torch::softmax(raw, 0);
          break;
      }
      v = torch::where(learn > 0, v, fixed);
    }
    switch (ps.slot) {
      case BlockParam::Gamma:
        p.gamma = v;
        break;
      case BlockParam::Eta:
        p.eta = v;
        break;
      case BlockParam::Gates:
        p.gates = v;
        break;
      case BlockParam::Alpha0:
        p.alpha0 = v;
        break;
      case BlockParam::Spectrum:
        p.alpha0 = v[0];
        p.gates = v.slice(0, 1);
        break;
    }
  }
  if (!p.gamma.defined()) p.gamma = torch::zeros({m.heads, 0});
  if (!p.eta.defined()) p.eta = torch::zeros_like(p.gamma);
  if (!p.gates.defined()) p.gates = torch::empty({0}, p.gamma.options());
  if (!p.alpha0.defined()) p.alpha0 = torch::ones_like(p.gamma);
  return p;
}

KernelParams PositionEncodingImpl::kernel_params() const {
  if (mech_.params.empty()) return {};
  std::vector<torch::Tensor> schema;
  for (const auto& st : schema_)
    for (const auto* t : {&st.raw, &st.fixed, &st.bound, &st.learn}) schema.push_back(*t);
  auto key = memo_key(schema);
  if (!key) return schema_kernel_params(mech_, schema);
  if (*key != params_memo_.key)
    params_memo_ = {std::move(*key), schema_kernel_params(mech_, schema)};
  return params_memo_.value;
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

void warn_about_positions(const Mechanism& m, const torch::Tensor& user_positions,
                          const torch::Tensor& pos, double center, const torch::Tensor& gamma,
                          std::optional<double>& last_center, EncodingWarnings& issued) {
  if (pos.numel() == 0) return;
  const bool narrow = !issued.resolution && user_positions.defined() &&
                      user_positions.is_floating_point() &&
                      user_positions.scalar_type() != torch::kDouble;
  // the clamp cannot bind without an exponent (RoPE's gamma is all zero): a decode step of an
  // undamped mechanism reads no position range
  // (read in place when it can be: this runs at every decode step of such a mechanism, where a
  // conversion op costs more than the look)
  const auto all_zero = [](const torch::Tensor& t) {
    return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "gamma", [&] {
      const scalar_t* v = t.data_ptr<scalar_t>();
      return std::all_of(v, v + t.numel(), [](scalar_t x) { return x == scalar_t(0); });
    });
  };
  torch::Tensor g;
  if (!issued.clamp && gamma.defined() && gamma.numel() > 0) {
    const bool in_place = gamma.is_cpu() && gamma.is_contiguous() && gamma.is_floating_point();
    if (!(in_place && all_zero(gamma))) {
      g = gamma.detach().to(torch::kCPU, torch::kDouble).contiguous();
      if (!in_place && all_zero(g)) g = torch::Tensor();
    }
  }
  double lo = 0, hi = 0;
  if (narrow || g.defined()) {
    if (pos.is_cpu() && pos.scalar_type() == torch::kDouble && pos.is_contiguous()) {
      const auto [a, b] =
          std::minmax_element(pos.data_ptr<double>(), pos.data_ptr<double>() + pos.numel());
      lo = *a;
      hi = *b;
    } else {
      lo = pos.min().item<double>();
      hi = pos.max().item<double>();
    }
  }
  // float32 (or narrower) positions: resolution ulp(|p|) >= 1/16 from |p| = 2^19 on, so
  // fractional positions have already collapsed before they reach us
  if (narrow) {
    const double far = std::max(std::abs(lo), std::abs(hi));
    const int mant = user_positions.scalar_type() == torch::kFloat      ? 24
                     : user_positions.scalar_type() == torch::kBFloat16 ? 8
                                                                        : 11;
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(far, 1.0)) - (mant - 1));
    if (ulp >= 1.0 / 16) {
      issued.resolution = true;
      TORCH_WARN(fmt::format(
          "relpos {}: positions reach {} in {}, where that type resolves only steps of {}; pass "
          "float64 (or int64) positions to keep fractional positions distinct",
          m.name, far, dtype_name(user_positions.scalar_type()), ulp));
    }
  }
  // the exponent clamp |gamma (p - c0)| <= max_exp changes the scores where it binds
  if (g.defined()) {
    ParamValues pv = default_params(m);
    pv.gamma.assign(g.data_ptr<double>(), g.data_ptr<double>() + g.numel());
    const double far = std::max(std::abs(lo - center), std::abs(hi - center));
    if (clamp_ratio(m, pv, far) > 1) {
      issued.clamp = true;
      TORCH_WARN(fmt::format(
          "relpos {}: the exponent clamp |gamma (p - c0)| <= max_exp binds for positions in [{}, "
          "{}] (centre c0 = {}); scores there are no longer a function of the lag. Set center= "
          "nearer the positions, or raise max_exp (float64 up to 709)",
          m.name, lo, hi, center));
    }
  }
  // center=mid resolves per call: transformed keys of one call and queries of another do not
  // compose (prefill + decode); say so the first time the centre moves
  if (m.center == CenterMode::Mid) {
    if (!issued.center && last_center && *last_center != center) {
      issued.center = true;
      TORCH_WARN(fmt::format(
          "relpos {}: center=mid moved from {} to {} between calls; keys and queries transformed "
          "in different calls must not be scored together. Use center=auto or a number for "
          "streaming",
          m.name, *last_center, center));
    }
    last_center = center;
  }
}

torch::Tensor checked_position_values(const torch::Tensor& given, int64_t B, int64_t T,
                                      const char* name) {
  if (!given.defined()) return torch::arange(T, torch::kDouble);
  if (given.device().is_meta())
    throw InputError(fmt::format("{} are meta tensors, which hold no values to check", name));
  // checked and kept on the host (O(T) values; a GPU kernel takes them to its device)
  const auto positions = given.device().is_cpu() ? given : given.to(torch::kCPU);
  const bool ok = (positions.dim() == 1 && positions.size(0) == T) ||
                  (positions.dim() == 2 && positions.size(0) == B && positions.size(1) == T);
  if (!ok)
    throw InputError(fmt::format("{} must be [T] or [B, T] = [{}, {}], got [{}]", name, B, T,
                                 shape_str(positions)));
  if (positions.is_complex() || positions.scalar_type() == torch::kBool)
    throw InputError(
        fmt::format("{} must be real numbers, got {}", name, dtype_name(positions.scalar_type())));
  const auto limit = static_cast<int64_t>(kMaxPosition);
  const auto beyond = [&](auto lo, auto hi) {
    return fmt::format(
        "{} span [{}, {}], beyond +-2^53 = {}, where float64 no longer holds every "
        "integer: shift them (only differences matter to an exact mechanism)",
        name, lo, hi, limit);
  };
  if (positions.scalar_type() == torch::kLong) {
    // (HF's position_ids) range-checked and widened in one host loop: min, max and a conversion
    // op cost more than the check at a decode step's few positions
    const auto src = positions.contiguous();
    auto p = torch::empty(src.sizes(), torch::kDouble);
    const int64_t* from = src.data_ptr<int64_t>();
    double* to = p.data_ptr<double>();
    const int64_t n = src.numel();
    int64_t lo = n ? from[0] : 0, hi = lo;
    for (int64_t i = 0; i < n; ++i) {
      lo = std::min(lo, from[i]);
      hi = std::max(hi, from[i]);
      to[i] = static_cast<double>(from[i]);
    }
    if (lo < -limit || hi > limit) throw InputError(beyond(lo, hi));
    return p;
  }
  if (!positions.is_floating_point() && positions.numel() > 0) {
    // integers are range-checked before the conversion, which would round them
    const int64_t lo = positions.min().item<int64_t>(), hi = positions.max().item<int64_t>();
    if (lo < -limit || hi > limit) throw InputError(beyond(lo, hi));
  }
  auto p = positions.to(torch::kDouble).contiguous();
  // one branch-free pass over O(T) values, which the compiler vectorises (a decode step checks
  // every cached key's position; tensor ops here would cost more than the check, each a dispatch
  // and an allocation): |v| <= 2^53 fails for NaN too. The details only for the error.
  const double* v = p.data_ptr<double>();
  const int64_t n = p.numel();
  bool within = true;
  for (int64_t i = 0; i < n; ++i) within &= std::abs(v[i]) <= kMaxPosition;
  if (within) return p;
  if (!std::all_of(v, v + n, [](double x) { return std::isfinite(x); }))
    throw InputError(fmt::format("{} contain NaN or Inf", name));
  const auto [lo, hi] = std::minmax_element(v, v + n);
  throw InputError(beyond(*lo, *hi));
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
    if (!op_util::storable(t->scalar_type()))
      throw InputError(fmt::format("{} must be float32, float64, bfloat16 or float16", name));
    if (t->size(3) != m.head_dim)
      throw InputError(fmt::format("{} has head dim {}, the encoding was built for {}", name,
                                   t->size(3), m.head_dim));
    if (t->size(1) != m.heads)
      throw InputError(
          fmt::format("{} has {} heads, the encoding was built for {}", name, t->size(1), m.heads));
    if (check_finite && !all_finite(*t))
      throw InputError(fmt::format("{} contains NaN or Inf", name));
  }
  if (q.sizes() != k.sizes())
    throw InputError(fmt::format("q [{}] and k [{}] differ in shape", shape_str(q), shape_str(k)));
  return checked_position_values(positions, q.size(0), q.size(2));
}

PositionEncodingImpl::Output PositionEncodingImpl::forward(const torch::Tensor& q,
                                                           const torch::Tensor& k,
                                                           const torch::Tensor& positions) {
  // with a position term the transform kernel checks finiteness on its outputs, which every
  // non-finite input reaches (fixed maps carry a NaN or Inf along its row): no extra pass
  const bool kernel_checks =
      std::any_of(mech_.transforms.begin(), mech_.transforms.end(),
                  [](const TransformTerm& t) { return t.position_driven(); });
  const auto pos =
      checked_positions(mech_, q, k, positions, options_.check_finite && !kernel_checks);
  if (!mech_.has_transform() || q.numel() == 0) return {q, k};
  for (const auto& t : mech_.transforms)
    if (t.vector_positions())
      throw InputError(fmt::format(
          "{}: term '{}' rotates by vector positions [T, {}]: run it through nn::Attention "
          "(relpos.Attention) with positions [T, {}], not through the encoding",
          mech_.spec, t.name, t.vector_dims, t.vector_dims));
    else if (t.time == TimeSource::ContentPhase)
      throw InputError(fmt::format(
          "{}: term '{}' is driven by per-token angles, not positions: call nn::attention with "
          "the content frames (AttentionArgs::k_frame) instead of the encoding",
          mech_.spec, t.name));
  // the terms in spec order: fixed maps as matrix products, the position term by the kernels;
  // half storage computes every term in float32 and rounds once at the end. A lone position
  // term without an attention factor reads and writes the half words itself (float32 math
  // inside: the same single rounding, no float32 copies; it checks the words it stores)
  const auto ct = op_util::compute_type(q.scalar_type());
  if (ct != q.scalar_type() && mech_.transforms.size() == 1 &&
      mech_.transforms[0].position_driven() && scaling_attention_factor(mech_, pos) == 1.0)
    return position_forward(q, k, positions, pos, options_.check_finite);
  torch::Tensor qq = q.to(ct), kk = k.to(ct);
  size_t fixed = 0;
  for (const auto& t : mech_.transforms) {
    if (t.position_driven()) {
      auto out = position_forward(qq, kk, positions, pos, options_.check_finite);
      qq = out.q;
      kk = out.k;
    } else {
      const auto& [M, Mit] = fixed_maps_[fixed++];
      qq = torch::matmul(qq, Mit.to(ct).t());
      kk = torch::matmul(kk, M.to(ct).t());
    }
  }
  // a context-extension rule's attention factor on q and k (logits scale by its square); its
  // frequencies at the call's length are applied by the transform op (torch/ops.cpp)
  if (const double af = scaling_attention_factor(mech_, pos); af != 1.0) {
    qq = qq * af;
    kk = kk * af;
  }
  Output out{qq.to(q.scalar_type()), kk.to(k.scalar_type())};
  // float16 tops out at 65504: a damped map's growth that float32 holds can overflow
  if (options_.check_finite && q.scalar_type() == torch::kHalf)
    for (const auto& [name, t] : {std::pair{"q", &out.q}, std::pair{"k", &out.k}})
      if (!all_finite(*t))
        throw InputError(fmt::format(
            "{} overflows float16 after the transform (above 65504): pass bfloat16 or float32",
            name));
  return out;
}

PositionEncodingImpl::Output PositionEncodingImpl::position_forward(const torch::Tensor& q,
                                                                    const torch::Tensor& k,
                                                                    const torch::Tensor& positions,
                                                                    const torch::Tensor& pos,
                                                                    bool check_finite) {
  auto kp = kernel_params();
  // the tables and parameters in the compute dtype (float32 beside half storage)
  const auto dt = op_util::compute_type(q.scalar_type());
  check_exponent_range(mech_, dt);
  const double center = center_for(pos);
  warn_about_positions(mech_, positions, pos, center, kp.gamma, last_center_, warned_);
  auto& c = trig_cache_;
  const bool hit = c.table.size() == 2 && c.dtype == dt && c.center == center &&
                   c.positions.sizes() == pos.sizes() && torch::equal(c.positions, pos) &&
                   (pos.dim() == 1 || c.positions.size(0) == q.size(0));
  // a trig table per batch row only when positions are per batch
  if (!hit)
    c = {pos.clone(), center, dt,
         trig_table(mech_, options_.layout, pos.dim() == 2 ? q.size(0) : 1, pos, center, dt)};
  try {
    const auto out =
        transform_qk(mech_, options_.layout, q, k,
                     {kp.gamma.to(dt), kp.eta.to(dt), kp.gates.to(dt), kp.alpha0.to(dt)}, pos,
                     center, c.table, check_finite);
    return {out[0], out[1]};
  } catch (const c10::ValueError& e) {  // the kernel's finiteness check, as the module's error
    throw InputError(e.what_without_backtrace());
  }
}

void check_exponent_range(const Mechanism& m, torch::ScalarType dt) {
  // e^x is finite for x <= 88.72 in float32 and 709.78 in float64
  const double limit = dt == torch::kFloat ? 88.0 : 709.0;
  for (const auto& s : m.segments())
    if (s.damped && s.max_exponent > limit)
      throw InputError(fmt::format(
          "{}: max_exp={} overflows {} (e^x is finite only up to x = {}); use float64 tensors or "
          "max_exp <= {}",
          m.name, s.max_exponent, dtype_name(dt), limit, limit));
}

torch::Tensor PositionEncodingImpl::alibi_slopes() const {
  if (!mech_.slope_bias()) return {};
  return torch::tensor(mech_.slope_bias()->slopes, torch::kDouble).to(torch::kFloat);
}

torch::Tensor PositionEncodingImpl::logit_bias(const torch::Tensor& qp,
                                               const torch::Tensor& kp) const {
  torch::Tensor out;
  if (mech_.slope_bias()) {
    const auto lag =
        (qp.to(torch::kFloat).unsqueeze(1) - kp.to(torch::kFloat).unsqueeze(0)).clamp_min(0);
    const auto slopes = torch::tensor(slopes_for_heads(mech_, bias_heads_), torch::kDouble);
    out = -slopes.to(torch::kFloat).view({-1, 1, 1}) * lag.unsqueeze(0);
  }
  if (has_lag_table()) {
    // the table gathered at the rounded, clamped lags (the kernel's rule)
    const auto lag = qp.to(torch::kDouble).unsqueeze(1) - kp.to(torch::kDouble).unsqueeze(0);
    const int64_t len =
        std::max<int64_t>(1, static_cast<int64_t>(std::ceil(lag.max().item<double>())) + 1);
    const auto idx = torch::floor(lag + 0.5).clamp(0, len - 1).to(torch::kLong);
    const auto t =
        lag_table(len).index_select(1, idx.flatten()).view({-1, lag.size(0), lag.size(1)});
    out = out.defined() ? out + t.to(torch::kFloat) : t.to(torch::kFloat);
  }
  return out;
}

}  // namespace relpos::nn
