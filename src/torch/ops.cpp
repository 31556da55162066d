// The relpos operator library: TORCH_LIBRARY(relpos) with CPU kernels (the transform kernels),
// Meta kernels (shapes only, the fake kernels torch.compile traces with) and an Autograd kernel
// whose backward is itself an op. The C++ PositionEncoding module and the Python package call
// these same ops through the dispatcher. A mechanism reaches an op as its canonical spec string
// plus head dim, heads and layout: the op rebuilds the plan from the model (microseconds), so no
// parameter list is flattened into numbers by position.
#include <fmt/format.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cstdint>
#include <optional>

#include "core/registry.hpp"
#include "diag/verify.hpp"
#include "kernels/rotate.hpp"
#include "kernels/transform.hpp"
#include "torch/encoding.hpp"
#include "torch/finite.hpp"
#include "torch/op_util.hpp"
#include "torch/transform_function.hpp"

namespace relpos::nn {

namespace {

using op_util::compute_type;
using op_util::computed;
using op_util::mptr;
using op_util::output_like;
using op_util::ptr;
using op_util::stored;
using op_util::value_errors;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Mechanism mechanism_for(const std::string& spec, int64_t head_dim, int64_t heads) {
  return value_errors([&] {
    if (head_dim <= 0 || head_dim > kMaxHeadDim || heads <= 0 || heads > kMaxHeads)
      throw InputError(fmt::format("head dim {} / heads {} out of range", head_dim, heads));
    return build_mechanism(spec, static_cast<int>(head_dim), static_cast<int>(heads));
  });
}

// With `positions` (float64, contiguous): a dynamic context-extension rule at the call's length,
// max position + 1 (core/rope_scaling.hpp; HF convention).
kernels::TransformPlan plan_for(const std::string& spec, int64_t head_dim, int64_t heads,
                                int64_t layout, const torch::Tensor* positions = nullptr) {
  Mechanism m = mechanism_for(spec, head_dim, heads);
  if (positions && m.rope_scaling.dynamic())
    m = scaled_for_length(
        m, context_length(positions->data_ptr<double>(), static_cast<size_t>(positions->numel())));
  return kernels::TransformPlan::from(m, layout ? Layout::HalfSplit : Layout::Interleaved);
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes(),
              "relpos: q and k must be [B, H, T, D] of one shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "relpos: q and k must have one dtype");
  TORCH_CHECK(op_util::storable(q.scalar_type()),
              "relpos: q and k must be float32, float64, bfloat16 or float16");
  TORCH_CHECK(positions.scalar_type() == torch::kDouble, "relpos: positions must be float64");
  TORCH_CHECK((positions.dim() == 1 && positions.size(0) == q.size(2)) ||
                  (positions.dim() == 2 && positions.size(0) == q.size(0) &&
                   positions.size(1) == q.size(2)),
              "relpos: positions must be [T] or [B, T]");
}

kernels::Positions positions_of(const torch::Tensor& positions, double center) {
  return {positions.data_ptr<double>(), positions.dim() == 2, center};
}

// ---- CPU ---------------------------------------------------------------------------------------

std::tuple<torch::Tensor, torch::Tensor> trig_table_cpu(const torch::Tensor& positions_in,
                                                        double center, int64_t batch,
                                                        const std::string& spec, int64_t head_dim,
                                                        int64_t heads, int64_t layout,
                                                        c10::ScalarType stored_as) {
  const auto dtype = compute_type(stored_as);  // half storage: float32 angles
  // the angles are exact only within +-2^53 (and NaN has none): refused by name
  const auto pos = value_errors([&] {
    const bool rows = positions_in.dim() == 2;
    return checked_position_values(positions_in, rows ? positions_in.size(0) : 1,
                                   positions_in.dim() ? positions_in.size(-1) : -1);
  });
  const auto plan = plan_for(spec, head_dim, heads, layout, &pos);
  const int64_t T = pos.size(-1);
  const kernels::Dims dims{batch, 1, T};
  const auto P = positions_of(pos, center);
  const int64_t n = kernels::trig_table_size(plan, dims, P);
  auto cos = torch::empty({n}, torch::TensorOptions().dtype(dtype));
  auto sin = torch::empty({n}, torch::TensorOptions().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES(dtype, "relpos_trig_table", [&] {
    kernels::fill_trig_table<scalar_t>(plan, dims, P, cos.data_ptr<scalar_t>(),
                                       sin.data_ptr<scalar_t>());
  });
  return {cos, sin};
}

// The caller's trig table (checked against the inputs), or a fresh one.
std::tuple<torch::Tensor, torch::Tensor> trig_for(
    const c10::optional<torch::Tensor>& cos_in, const c10::optional<torch::Tensor>& sin_in,
    const kernels::TransformPlan& plan, const kernels::Dims& dims, const torch::Tensor& pos,
    double center, const std::string& spec, int64_t head_dim, int64_t heads, int64_t layout,
    c10::ScalarType dtype) {
  if (!(cos_in && sin_in && cos_in->defined()))
    return trig_table_cpu(pos, center, dims.B, spec, head_dim, heads, layout, dtype);
  const auto cos = cos_in->contiguous(), sin = sin_in->contiguous();
  TORCH_CHECK(cos.numel() == kernels::trig_table_size(plan, dims, positions_of(pos, center)) &&
                  cos.scalar_type() == dtype && sin.sizes() == cos.sizes(),
              "relpos: trig table does not match the inputs' positions, length or dtype");
  return {cos, sin};
}

// A plan that is one plain rotation from the first pair (RoPE; partial RoPE in the interleaved
// layout): its trig rows are rotate_pairs' angles, so half tensors take
// kernels::rotate_pairs_half, one pass over their words, with the float32 table. Else nullopt.
std::optional<kernels::RotateDims> half_rotation(const kernels::TransformPlan& plan,
                                                 const kernels::Dims& dims,
                                                 const kernels::Positions& P,
                                                 const torch::Tensor& q) {
  if (!op_util::is_half(q.scalar_type()) || plan.segments.size() != 1 || plan.gate_rows) return {};
  const auto& s = plan.segments.front();
  if (s.order != 1 || s.damped || s.first_pair != 0 ||
      (plan.layout == Layout::HalfSplit && 2 * s.blocks != plan.head_dim))
    return {};
  return kernels::RotateDims{dims.B, dims.H, dims.T, plan.head_dim, s.blocks, P.per_batch};
}

std::tuple<torch::Tensor, torch::Tensor> transform_cpu(
    const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& gamma,
    const torch::Tensor& eta, const torch::Tensor& gates, const torch::Tensor& alpha0,
    const torch::Tensor& positions, const c10::optional<torch::Tensor>& cos_in,
    const c10::optional<torch::Tensor>& sin_in, double center, const std::string& spec,
    int64_t head_dim, int64_t heads, int64_t layout, bool check_finite) {
  check_inputs(q_in, k_in, positions);
  const auto pos = positions.contiguous();
  const auto plan = plan_for(spec, head_dim, heads, layout, &pos);
  const kernels::Dims dims{q_in.size(0), q_in.size(1), q_in.size(2)};
  const auto P = positions_of(pos, center);
  if (const auto rd = half_rotation(plan, dims, P, q_in)) {
    const auto [cos, sin] = trig_for(cos_in, sin_in, plan, dims, pos, center, spec, head_dim, heads,
                                     layout, torch::kFloat);
    const auto rotated = [&](const torch::Tensor& x, const char* name) {
      const auto xc = x.contiguous();
      auto y = output_like(xc);
      if (kernels::rotate_pairs_half(*rd, plan.layout, false, op_util::half_type(xc),
                                     op_util::words(xc), cos.data_ptr<float>(),
                                     sin.data_ptr<float>(), op_util::mwords(y), check_finite, 2)) {
        // the kernel checked the rounded words: a non-finite input, or else an overflow
        TORCH_CHECK_VALUE(all_finite(xc), name, " contains NaN or Inf");
        TORCH_CHECK_VALUE(x.scalar_type() != torch::kHalf, name,
                          " overflows float16 after the transform (above 65504): pass bfloat16 "
                          "or float32");
        TORCH_CHECK_VALUE(false, name, " overflows bfloat16 after the transform");
      }
      return y;
    };
    return {rotated(q_in, "q"), rotated(k_in, "k")};
  }
  const auto q = computed(q_in), k = computed(k_in);
  const auto [cos, sin] = trig_for(cos_in, sin_in, plan, dims, pos, center, spec, head_dim, heads,
                                   layout, q.scalar_type());
  auto qo = output_like(q), ko = output_like(k);
  const auto gm = computed(gamma), et = computed(eta), gt = computed(gates), a0 = computed(alpha0);
  int nonfinite = 0;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_transform_forward", [&] {
    nonfinite = kernels::transform_forward<scalar_t>(
        plan, dims, P, {ptr<scalar_t>(gm), ptr<scalar_t>(et), ptr<scalar_t>(gt), ptr<scalar_t>(a0)},
        {cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>()}, q.data_ptr<scalar_t>(),
        k.data_ptr<scalar_t>(), qo.data_ptr<scalar_t>(), ko.data_ptr<scalar_t>(), check_finite);
  });
  // the kernel checked its outputs tile by tile: a non-finite input always reaches one
  TORCH_CHECK_VALUE(!nonfinite, nonfinite & 1 ? "q contains NaN or Inf" : "k contains NaN or Inf");
  auto qs = stored(qo, q_in.scalar_type()), ks = stored(ko, k_in.scalar_type());
  // float16 tops out at 65504: a damped map's growth that float32 holds can overflow
  if (check_finite && q_in.scalar_type() == torch::kHalf)
    for (const auto& [name, t] : {std::pair{"q", &qs}, std::pair{"k", &ks}})
      TORCH_CHECK_VALUE(all_finite(*t), name,
                        " overflows float16 after the transform (above 65504): pass bfloat16 "
                        "or float32");
  return {qs, ks};
}

using Grads6 = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor>;

Grads6 transform_backward_cpu(const torch::Tensor& gq_out_in, const torch::Tensor& gk_out_in,
                              const torch::Tensor& q_in, const torch::Tensor& k_in,
                              const torch::Tensor& gamma, const torch::Tensor& eta,
                              const torch::Tensor& gates, const torch::Tensor& alpha0,
                              const torch::Tensor& positions,
                              const c10::optional<torch::Tensor>& cos_in,
                              const c10::optional<torch::Tensor>& sin_in, double center,
                              const std::string& spec, int64_t head_dim, int64_t heads,
                              int64_t layout, std::array<bool, 6> mask) {
  check_inputs(q_in, k_in, positions);
  const auto pos = positions.contiguous();
  const auto plan = plan_for(spec, head_dim, heads, layout, &pos);
  const kernels::Dims dims{q_in.size(0), q_in.size(1), q_in.size(2)};
  const auto P = positions_of(pos, center);
  const auto rd = half_rotation(plan, dims, P, q_in);
  if (rd && !mask[2] && !mask[3] && !mask[4] && !mask[5] &&
      (!gq_out_in.defined() || gq_out_in.scalar_type() == q_in.scalar_type()) &&
      (!gk_out_in.defined() || gk_out_in.scalar_type() == k_in.scalar_type())) {
    const auto [cos, sin] = trig_for(cos_in, sin_in, plan, dims, pos, center, spec, head_dim, heads,
                                     layout, torch::kFloat);
    // R^T: the forward turned the other way; unrequested or absent gradients are zeros
    const int tensors = (mask[0] && gq_out_in.defined()) + (mask[1] && gk_out_in.defined());
    const auto grad = [&](const torch::Tensor& gy, const torch::Tensor& x, bool wanted) {
      if (!wanted || !gy.defined()) return torch::zeros_like(x);
      const auto gc = gy.contiguous();
      auto gx = output_like(gc);
      kernels::rotate_pairs_half(*rd, plan.layout, true, op_util::half_type(gc), op_util::words(gc),
                                 cos.data_ptr<float>(), sin.data_ptr<float>(), op_util::mwords(gx),
                                 false, tensors);
      return gx;
    };
    return {grad(gq_out_in, q_in, mask[0]), grad(gk_out_in, k_in, mask[1]),
            torch::zeros_like(gamma),       torch::zeros_like(eta),
            torch::zeros_like(gates),       torch::zeros_like(alpha0)};
  }
  const auto q = computed(q_in), k = computed(k_in);
  const auto gqo = gq_out_in.defined() ? computed(gq_out_in) : torch::zeros_like(q);
  const auto gko = gk_out_in.defined() ? computed(gk_out_in) : torch::zeros_like(k);
  const auto [cos, sin] = trig_for(cos_in, sin_in, plan, dims, pos, center, spec, head_dim, heads,
                                   layout, q.scalar_type());
  const auto gm = computed(gamma), et = computed(eta), gt = computed(gates), a0 = computed(alpha0);
  // every output is a tensor (the op schema has no optional outputs); unrequested ones are
  // zeros and not computed
  torch::Tensor gq = mask[0] ? output_like(q) : torch::zeros_like(q);
  torch::Tensor gk = mask[1] ? output_like(k) : torch::zeros_like(k);
  torch::Tensor ggamma = torch::zeros_like(gm), geta = torch::zeros_like(et),
                ggates = torch::zeros_like(gt), galpha0 = torch::zeros_like(a0);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_transform_backward", [&] {
    kernels::transform_backward<scalar_t>(
        plan, dims, P, {ptr<scalar_t>(gm), ptr<scalar_t>(et), ptr<scalar_t>(gt), ptr<scalar_t>(a0)},
        {cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>()}, q.data_ptr<scalar_t>(),
        k.data_ptr<scalar_t>(), gqo.data_ptr<scalar_t>(), gko.data_ptr<scalar_t>(),
        mask[0] ? mptr<scalar_t>(gq) : nullptr, mask[1] ? mptr<scalar_t>(gk) : nullptr,
        {mask[2] ? mptr<scalar_t>(ggamma) : nullptr, mask[3] ? mptr<scalar_t>(geta) : nullptr,
         mask[4] ? mptr<scalar_t>(ggates) : nullptr, mask[5] ? mptr<scalar_t>(galpha0) : nullptr});
  });
  return {stored(gq, q_in.scalar_type()),      stored(gk, k_in.scalar_type()),
          stored(ggamma, gamma.scalar_type()), stored(geta, eta.scalar_type()),
          stored(ggates, gates.scalar_type()), stored(galpha0, alpha0.scalar_type())};
}

// ---- Model and diagnostics as JSON (the Python package's relpos.mechanisms / verify) ------------

std::string mechanisms_op() {
  return catalog_json().dump();
}

std::string mechanism_op(const std::string& spec, int64_t head_dim, int64_t heads) {
  return mechanism_json(mechanism_for(spec, head_dim, heads)).dump();
}

// The attention factor of a spec's context-extension rule at context length `length` (1 without a
// rule), and a rope_scaling dictionary (JSON text) as its spec term: the Python package's
// PositionEncoding and relpos.rope_scaling_spec (docs/rope-scaling.md).
double attention_factor_op(const std::string& spec, int64_t head_dim, int64_t heads,
                           double length) {
  return value_errors(
      [&] { return attention_factor(mechanism_for(spec, head_dim, heads), length); });
}

std::string rope_scaling_spec_op(const std::string& json, double max_position_embeddings) {
  return value_errors([&] {
    std::optional<double> max_pos;
    if (max_position_embeddings > 0) max_pos = max_position_embeddings;
    return rope_scaling_spec(json, max_pos);
  });
}

std::string rope_parameters_spec_op(const std::string& spec, const std::string& json,
                                    double max_position_embeddings) {
  return value_errors([&] {
    std::optional<double> max_pos;
    if (max_position_embeddings > 0) max_pos = max_position_embeddings;
    return rope_parameters_spec(spec, json, max_pos);
  });
}

// The rotary frequencies of a spec per complex coordinate pair [head_dim / 2] (float64), for a
// call of context length `length` (its context-extension rule evaluated there; <= 0: the rule as
// built), in rope's sense: pair j of a key at position p turns by +frequency_j p. Pairs no
// rotary term covers are 0. Differs by head only through learned parameters, which it leaves out.
torch::Tensor frequencies_op(const std::string& spec, int64_t head_dim, int64_t heads,
                             double length) {
  return value_errors([&] {
    const Mechanism built = mechanism_for(spec, head_dim, heads);
    const Mechanism m = length > 0 ? scaled_for_length(built, length) : built;
    if (m.segments().empty())
      throw InputError(fmt::format("frequencies: '{}' has no rotary term", m.spec));
    auto out = torch::zeros({head_dim / 2}, torch::kDouble);
    auto a = out.accessor<double, 1>();
    for (const auto& s : m.segments())
      for (int b = 0; b < s.blocks; ++b)
        for (int r = 0; r < s.order; ++r)
          a[s.first_pair + b * s.order + r] = -s.omega[static_cast<size_t>(b)];
    return out;
  });
}

std::string verify_op(const std::vector<std::string>& specs, int64_t max_lag,
                      const std::string& dtype, int64_t head_dim, int64_t heads, int64_t positions,
                      int64_t seed, int64_t layout) {
  return value_errors([&] {
    diag::VerifyOptions o;
    if (max_lag < 1 || head_dim < 2 || head_dim > 4096 || heads < 1 || heads > 256 ||
        positions < 8 || positions > 2000 || seed < 0)
      throw InputError(
          "verify: max_lag >= 1, head_dim in [2, 4096], heads in [1, 256], "
          "positions in [8, 2000], seed >= 0");
    if (dtype != "f32" && dtype != "f64" && dtype != "both")
      throw InputError(fmt::format("verify: dtype must be f32, f64 or both, got '{}'", dtype));
    o.max_lag = max_lag;
    o.head_dim = static_cast<int>(head_dim);
    o.heads = static_cast<int>(heads);
    o.positions = static_cast<int>(positions);
    o.seed = static_cast<uint64_t>(seed);
    o.layout = layout ? Layout::HalfSplit : Layout::Interleaved;
    std::vector<std::string> dtypes;
    if (dtype != "f32") dtypes.push_back("f64");
    if (dtype != "f64") dtypes.push_back("f32");
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& r :
         diag::verify_specs(specs.empty() ? verify_default_specs() : specs, o, dtypes))
      rows.push_back(diag::to_json(r));
    return rows.dump();
  });
}

// The position checks and the warnings of the PositionEncoding module (torch/encoding.hpp), for
// the Python module: one implementation, so both languages refuse and warn alike. The warnings
// op returns the updated record of issued warnings (bits: 1 clamp, 2 resolution, 4 centre).
torch::Tensor encoding_positions_op(const c10::optional<torch::Tensor>& positions, int64_t batch,
                                    int64_t length) {
  return value_errors([&] {
    return checked_position_values(positions ? *positions : torch::Tensor(), batch, length);
  });
}

int64_t encoding_warnings_op(const c10::optional<torch::Tensor>& user_positions,
                             const torch::Tensor& positions, double center,
                             const torch::Tensor& gamma, const std::string& spec, int64_t head_dim,
                             int64_t heads, c10::optional<double> last_center, int64_t issued) {
  const Mechanism m = mechanism_for(spec, head_dim, heads);
  EncodingWarnings w{(issued & 1) != 0, (issued & 2) != 0, (issued & 4) != 0};
  std::optional<double> last;
  if (last_center) last = *last_center;
  // the checks read values on the host (a GPU call's positions and parameters are copied)
  const auto host = [](const torch::Tensor& t) {
    return t.defined() && !t.is_cpu() ? t.to(torch::kCPU) : t;
  };
  warn_about_positions(m, host(user_positions ? *user_positions : torch::Tensor()), host(positions),
                       center, host(gamma), last, w);
  return (w.clamp ? 1 : 0) | (w.resolution ? 2 : 0) | (w.center ? 4 : 0);
}

// ---- Meta (fake): shapes and dtypes only -------------------------------------------------------

std::tuple<torch::Tensor, torch::Tensor> trig_table_meta(const torch::Tensor& positions, double,
                                                         int64_t batch, const std::string& spec,
                                                         int64_t head_dim, int64_t heads,
                                                         int64_t layout,
                                                         c10::ScalarType stored_as) {
  const auto dtype = compute_type(stored_as);
  const auto plan = plan_for(spec, head_dim, heads, layout);
  const int64_t rows = positions.dim() == 2 ? batch : 1;
  const int64_t n = rows * positions.size(-1) * plan.total_blocks;
  const auto o = torch::TensorOptions().dtype(dtype).device(torch::kMeta);
  return {torch::empty({n}, o), torch::empty({n}, o)};
}

std::tuple<torch::Tensor, torch::Tensor> transform_meta(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor&, const torch::Tensor&,
    const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
    const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&, double,
    const std::string&, int64_t, int64_t, int64_t, bool) {
  return {torch::empty_like(q, torch::MemoryFormat::Contiguous),
          torch::empty_like(k, torch::MemoryFormat::Contiguous)};
}

Grads6 transform_backward_meta(const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& gamma,
                               const torch::Tensor& eta, const torch::Tensor& gates,
                               const torch::Tensor& alpha0, const torch::Tensor&,
                               const c10::optional<torch::Tensor>&,
                               const c10::optional<torch::Tensor>&, double, const std::string&,
                               int64_t, int64_t, int64_t, std::array<bool, 6>) {
  return {torch::empty_like(q, torch::MemoryFormat::Contiguous),
          torch::empty_like(k, torch::MemoryFormat::Contiguous),
          torch::empty_like(gamma),
          torch::empty_like(eta),
          torch::empty_like(gates),
          torch::empty_like(alpha0)};
}

// ---- Autograd: the backward is the transform_backward op ---------------------------------------

std::tuple<torch::Tensor, torch::Tensor> call_transform(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& gamma,
    const torch::Tensor& eta, const torch::Tensor& gates, const torch::Tensor& alpha0,
    const torch::Tensor& positions, const c10::optional<torch::Tensor>& cos,
    const c10::optional<torch::Tensor>& sin, double center, const std::string& spec,
    int64_t head_dim, int64_t heads, int64_t layout, bool check_finite) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("relpos::transform", "")
                             .typed<decltype(transform_cpu)>();
  return op.call(q, k, gamma, eta, gates, alpha0, positions, cos, sin, center, spec, head_dim,
                 heads, layout, check_finite);
}

Grads6 call_transform_backward(const torch::Tensor& gq, const torch::Tensor& gk,
                               const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& gamma, const torch::Tensor& eta,
                               const torch::Tensor& gates, const torch::Tensor& alpha0,
                               const torch::Tensor& positions,
                               const c10::optional<torch::Tensor>& cos,
                               const c10::optional<torch::Tensor>& sin, double center,
                               const std::string& spec, int64_t head_dim, int64_t heads,
                               int64_t layout, std::array<bool, 6> mask) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("relpos::transform_backward", "")
                             .typed<decltype(transform_backward_cpu)>();
  return op.call(gq, gk, q, k, gamma, eta, gates, alpha0, positions, cos, sin, center, spec,
                 head_dim, heads, layout, mask);
}

class TransformFunction : public torch::autograd::Function<TransformFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& gamma, const torch::Tensor& eta,
                               const torch::Tensor& gates, const torch::Tensor& alpha0,
                               const torch::Tensor& positions,
                               const c10::optional<torch::Tensor>& cos,
                               const c10::optional<torch::Tensor>& sin, double center,
                               const std::string& spec, int64_t head_dim, int64_t heads,
                               int64_t layout, bool check_finite) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [qo, ko] = call_transform(q, k, gamma, eta, gates, alpha0, positions, cos, sin, center,
                                   spec, head_dim, heads, layout, check_finite);
    const torch::Tensor none;
    ctx->save_for_backward({q, k, gamma, eta, gates, alpha0, positions,
                            cos && cos->defined() ? *cos : none,
                            sin && sin->defined() ? *sin : none});
    ctx->saved_data["center"] = center;
    ctx->saved_data["spec"] = spec;
    ctx->saved_data["head_dim"] = head_dim;
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["layout"] = layout;
    return {qo, ko};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    std::array<bool, 6> mask{};
    for (size_t i = 0; i < 6; ++i) mask[i] = ctx->needs_input_grad(i);
    const auto opt = [](const torch::Tensor& t) {
      return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
    };
    auto [gq, gk, ggamma, geta, ggates, galpha0] = call_transform_backward(
        grad_out[0], grad_out[1], s[0], s[1], s[2], s[3], s[4], s[5], s[6], opt(s[7]), opt(s[8]),
        ctx->saved_data["center"].toDouble(), ctx->saved_data["spec"].toStringRef(),
        ctx->saved_data["head_dim"].toInt(), ctx->saved_data["heads"].toInt(),
        ctx->saved_data["layout"].toInt(), mask);
    const auto keep = [&](size_t i, torch::Tensor t) { return mask[i] ? t : torch::Tensor(); };
    return {keep(0, gq),
            keep(1, gk),
            keep(2, ggamma),
            keep(3, geta),
            keep(4, ggates),
            keep(5, galpha0),
            {},
            {},
            {},
            {},
            {},
            {},
            {},
            {},
            {}};
  }
};

std::tuple<torch::Tensor, torch::Tensor> transform_autograd(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& gamma,
    const torch::Tensor& eta, const torch::Tensor& gates, const torch::Tensor& alpha0,
    const torch::Tensor& positions, const c10::optional<torch::Tensor>& cos,
    const c10::optional<torch::Tensor>& sin, double center, const std::string& spec,
    int64_t head_dim, int64_t heads, int64_t layout, bool check_finite) {
  auto out = TransformFunction::apply(q, k, gamma, eta, gates, alpha0, positions, cos, sin, center,
                                      spec, head_dim, heads, layout, check_finite);
  return {out[0], out[1]};
}

}  // namespace

// ---- the C++ entry points (torch/transform_function.hpp) ---------------------------------------

std::vector<torch::Tensor> trig_table(const Mechanism& m, Layout layout, int64_t B,
                                      const torch::Tensor& positions, double center,
                                      torch::ScalarType dtype) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("relpos::trig_table", "")
                             .typed<decltype(trig_table_cpu)>();
  auto [c, s] = op.call(positions.to(torch::kDouble), center, B, m.spec, m.head_dim, m.heads,
                        layout == Layout::HalfSplit, dtype);
  return {c, s};
}

std::vector<torch::Tensor> transform_qk(const Mechanism& m, Layout layout, const torch::Tensor& q,
                                        const torch::Tensor& k,
                                        const BlockParamSet<torch::Tensor>& p,
                                        const torch::Tensor& positions, double center,
                                        const std::vector<torch::Tensor>& trig, bool check_finite) {
  const auto pos = positions.to(torch::kDouble).contiguous();
  const auto cos = trig.size() == 2 ? c10::optional<torch::Tensor>(trig[0].detach()) : c10::nullopt;
  const auto sin = trig.size() == 2 ? c10::optional<torch::Tensor>(trig[1].detach()) : c10::nullopt;
  auto [qo, ko] =
      call_transform(q, k, p.gamma, p.eta, p.gates, p.alpha0, pos, cos, sin, center, m.spec,
                     m.head_dim, m.heads, layout == Layout::HalfSplit, check_finite);
  return {qo, ko};
}

}  // namespace relpos::nn

TORCH_LIBRARY(relpos, m) {
  m.def("mechanisms() -> str", relpos::nn::mechanisms_op);
  m.def("mechanism(str spec, int head_dim, int heads) -> str", relpos::nn::mechanism_op);
  m.def("attention_factor(str spec, int head_dim, int heads, float length) -> float",
        relpos::nn::attention_factor_op);
  m.def("rope_scaling_spec(str json, float max_position_embeddings=0.) -> str",
        relpos::nn::rope_scaling_spec_op);
  m.def("rope_parameters_spec(str spec, str json, float max_position_embeddings=0.) -> str",
        relpos::nn::rope_parameters_spec_op);
  m.def("frequencies(str spec, int head_dim, int heads=1, float length=0.) -> Tensor",
        relpos::nn::frequencies_op);
  m.def(
      "verify(str[] specs, int max_lag, str dtype, int head_dim, int heads, int positions, "
      "int seed, int layout) -> str",
      relpos::nn::verify_op);
  m.def("encoding_positions(Tensor? positions, int batch, int length) -> Tensor",
        relpos::nn::encoding_positions_op);
  m.def(
      "encoding_warnings(Tensor? user_positions, Tensor positions, float center, Tensor gamma, "
      "str spec, int head_dim, int heads, float? last_center, int issued) -> int",
      relpos::nn::encoding_warnings_op);
  m.def(
      "trig_table(Tensor positions, float center, int batch, str spec, int head_dim, int heads, "
      "int layout, ScalarType dtype) -> (Tensor, Tensor)");
  m.def(
      "transform(Tensor q, Tensor k, Tensor gamma, Tensor eta, Tensor gates, Tensor alpha0, "
      "Tensor positions, Tensor? cos, Tensor? sin, float center, str spec, int head_dim, "
      "int heads, int layout, bool check_finite=False) -> (Tensor, Tensor)");
  m.def(
      "transform_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor gamma, "
      "Tensor eta, Tensor gates, Tensor alpha0, Tensor positions, Tensor? cos, Tensor? sin, "
      "float center, str spec, int head_dim, int heads, int layout, bool[6] output_mask) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(relpos, CPU, m) {
  m.impl("trig_table", relpos::nn::trig_table_cpu);
  m.impl("transform", relpos::nn::transform_cpu);
  m.impl("transform_backward", relpos::nn::transform_backward_cpu);
}

TORCH_LIBRARY_IMPL(relpos, Meta, m) {
  m.impl("trig_table", relpos::nn::trig_table_meta);
  m.impl("transform", relpos::nn::transform_meta);
  m.impl("transform_backward", relpos::nn::transform_backward_meta);
}

TORCH_LIBRARY_IMPL(relpos, Autograd, m) {
  m.impl("transform", relpos::nn::transform_autograd);
}
