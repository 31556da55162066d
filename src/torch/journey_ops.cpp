// The rotation operators of TORCH_LIBRARY(relpos): `rotate_pairs` and its backward, and the frame
// angles of journey mechanisms (torch/journey.hpp).
#include <fmt/format.h>

#include <numbers>

#include "kernels/rotate.hpp"
#include "torch/journey.hpp"
#include "torch/op_util.hpp"
#include "torch/scan.hpp"

namespace relpos::nn {

namespace {

using op_util::value_errors;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Checked {
  torch::Tensor x, cos, sin;  // contiguous, x as stored; cos, sin [Ba, T, P] in compute dtype
  kernels::RotateDims dims;
  // half storage with float32 cos/sin: the kernel that reads and writes the half words
  bool half() const { return op_util::is_half(x.scalar_type()); }
};

Checked check(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (!x.defined() || x.dim() != 4) throw InputError("rotate_pairs: x must be [B, H, T, D]");
  for (const auto* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    if (!t->defined() || (t->dim() != 2 && t->dim() != 3))
      throw InputError(fmt::format("rotate_pairs: {} must be [B, T, P] or [T, P]", name));
    if (!t->device().is_cpu())
      throw InputError(fmt::format("rotate_pairs: {} must be on the CPU", name));
    if (t->scalar_type() != x.scalar_type() &&
        t->scalar_type() != op_util::compute_type(x.scalar_type()))
      throw InputError(
          fmt::format("rotate_pairs: {} must have x's dtype (or float32 for a "
                      "bfloat16/float16 x)",
                      name));
  }
  if (cos.sizes() != sin.sizes()) throw InputError("rotate_pairs: cos and sin differ in shape");
  if (!x.device().is_cpu()) throw InputError("rotate_pairs: x must be on the CPU");
  if (!op_util::storable(x.scalar_type()))
    throw InputError("rotate_pairs: x must be float32, float64, bfloat16 or float16");
  const auto c = cos.dim() == 2 ? cos.unsqueeze(0) : cos;
  const auto s = sin.dim() == 2 ? sin.unsqueeze(0) : sin;
  const int64_t B = x.size(0), T = x.size(2), D = x.size(3);
  if (c.size(1) != T || (c.size(0) != B && c.size(0) != 1) || 2 * c.size(2) > D)
    throw InputError(
        fmt::format("rotate_pairs: angles {} do not fit x {} (need [B or 1, T, P] with 2 P <= D)",
                    c10::str(cos.sizes()), c10::str(x.sizes())));
  if (D % 2) throw InputError(fmt::format("rotate_pairs: head dim {} is odd", D));
  return {x.contiguous(), op_util::computed(c), op_util::computed(s),
          kernels::RotateDims{B, x.size(1), T, D, c.size(2), c.size(0) == B && B != 1}};
}

Layout layout_of(int64_t code) {
  return code ? Layout::HalfSplit : Layout::Interleaved;
}

torch::Tensor rotate_cpu(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         bool inverse, int64_t layout) {
  return value_errors([&] {
    auto c = check(x, cos, sin);
    auto y = op_util::output_like(c.x);
    if (c.half()) {
      kernels::rotate_pairs_half(c.dims, layout_of(layout), inverse, op_util::half_type(c.x),
                                 op_util::words(c.x), c.cos.data_ptr<float>(),
                                 c.sin.data_ptr<float>(), op_util::mwords(y), false);
      return y;
    }
    AT_DISPATCH_FLOATING_TYPES(c.x.scalar_type(), "relpos_rotate_pairs", [&] {
      kernels::rotate_pairs_forward<scalar_t>(c.dims, layout_of(layout), inverse,
                                              c.x.data_ptr<scalar_t>(), c.cos.data_ptr<scalar_t>(),
                                              c.sin.data_ptr<scalar_t>(), y.data_ptr<scalar_t>());
    });
    return y;
  });
}

// angle_grads: whether dcos and dsin are wanted (else they are empty and not computed: a frame
// of fixed angles needs none, and their sums over heads cost more than the rotation).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rotate_backward_cpu(
    const torch::Tensor& grad, const torch::Tensor& x, const torch::Tensor& cos,
    const torch::Tensor& sin, bool inverse, int64_t layout, bool angle_grads) {
  return value_errors([&] {
    auto c = check(x, cos, sin);
    if (grad.sizes() != c.x.sizes() ||
        op_util::compute_type(grad.scalar_type()) != op_util::compute_type(c.x.scalar_type()))
      throw InputError("rotate_pairs_backward: grad must have x's shape and dtype");
    // dx = R^T dy: the forward kernel, turned the other way
    if (c.half() && !angle_grads && grad.scalar_type() == c.x.scalar_type()) {
      auto dx = op_util::output_like(c.x);
      const auto g = grad.contiguous();
      kernels::rotate_pairs_half(c.dims, layout_of(layout), !inverse, op_util::half_type(c.x),
                                 op_util::words(g), c.cos.data_ptr<float>(),
                                 c.sin.data_ptr<float>(), op_util::mwords(dx), false);
      return std::make_tuple(dx, torch::empty({0}, cos.options()),
                             torch::empty({0}, sin.options()));
    }
    c.x = op_util::computed(c.x);
    const auto g = op_util::computed(grad);
    auto dx = op_util::output_like(c.x);
    auto dc = angle_grads ? torch::empty_like(c.cos) : torch::empty({0}, c.cos.options()),
         ds = angle_grads ? torch::empty_like(c.sin) : torch::empty({0}, c.sin.options());
    AT_DISPATCH_FLOATING_TYPES(c.x.scalar_type(), "relpos_rotate_pairs_backward", [&] {
      kernels::rotate_pairs_backward<scalar_t>(
          c.dims, layout_of(layout), inverse, c.x.data_ptr<scalar_t>(), c.cos.data_ptr<scalar_t>(),
          c.sin.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(),
          op_util::mptr<scalar_t>(dc), op_util::mptr<scalar_t>(ds));
    });
    if (angle_grads && cos.dim() == 2) {
      dc = dc.squeeze(0);
      ds = ds.squeeze(0);
    }
    return std::make_tuple(op_util::stored(dx, x.scalar_type()),
                           op_util::stored(dc, cos.scalar_type()),
                           op_util::stored(ds, sin.scalar_type()));
  });
}

torch::Tensor rotate_meta(const torch::Tensor& x, const torch::Tensor&, const torch::Tensor&, bool,
                          int64_t) {
  return torch::empty_like(x, torch::MemoryFormat::Contiguous);
}
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rotate_backward_meta(
    const torch::Tensor&, const torch::Tensor& x, const torch::Tensor& cos,
    const torch::Tensor& sin, bool, int64_t, bool angle_grads) {
  const auto like = [&](const torch::Tensor& t) {
    return angle_grads ? torch::empty_like(t, torch::MemoryFormat::Contiguous)
                       : torch::empty({0}, t.options());
  };
  return {torch::empty_like(x, torch::MemoryFormat::Contiguous), like(cos), like(sin)};
}

torch::Tensor call_rotate(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin, bool inverse, int64_t layout) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("relpos::rotate_pairs", "")
                             .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                                  const torch::Tensor&, bool, int64_t)>();
  return op.call(x, cos, sin, inverse, layout);
}

class RotatePairsFunction : public torch::autograd::Function<RotatePairsFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin, bool inverse,
                               int64_t layout) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, cos, sin});
    ctx->saved_data["inverse"] = inverse;
    ctx->saved_data["layout"] = layout;
    return call_rotate(x, cos, sin, inverse, layout);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("relpos::rotate_pairs_backward", "")
                               .typed<std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>(
                                   const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                   const torch::Tensor&, bool, int64_t, bool)>();
    const bool angles = ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
    auto [dx, dc, ds] =
        op.call(grad[0], saved[0], saved[1], saved[2], ctx->saved_data["inverse"].toBool(),
                ctx->saved_data["layout"].toInt(), angles);
    if (!angles) return {dx, {}, {}, {}, {}};
    return {dx, dc, ds, {}, {}};
  }
};

torch::Tensor rotate_autograd(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin, bool inverse, int64_t layout) {
  return RotatePairsFunction::apply(x, cos, sin, inverse, layout);
}

// relpos::cos_sin: a frame's table in one pass of kernels::cos_sin (float32 and float64 on the
// CPU; other dtypes and devices take at::cos and at::sin).
// Complex angles are refused: a frame turns real planes.
void check_real(const torch::Tensor& angles) {
  if (!angles.defined() || angles.is_complex())
    throw InputError("cos_sin: angles must be a real tensor");
}

std::tuple<torch::Tensor, torch::Tensor> cos_sin_cpu(const torch::Tensor& angles) {
  value_errors([&] { check_real(angles); });
  const auto st = angles.scalar_type();
  if (st != torch::kFloat && st != torch::kDouble) return {torch::cos(angles), torch::sin(angles)};
  const auto a = angles.contiguous();
  auto c = torch::empty_like(a), s = torch::empty_like(a);
  AT_DISPATCH_FLOATING_TYPES(st, "relpos_cos_sin", [&] {
    kernels::cos_sin<scalar_t>(a.data_ptr<scalar_t>(), a.numel(), c.data_ptr<scalar_t>(),
                               s.data_ptr<scalar_t>());
  });
  return {c, s};
}

std::tuple<torch::Tensor, torch::Tensor> cos_sin_meta(const torch::Tensor& angles) {
  value_errors([&] { check_real(angles); });
  const auto like = [&] {
    return angles.is_floating_point()
               ? torch::empty_like(angles)
               : torch::empty_like(angles, angles.options().dtype(torch::kFloat));
  };
  return {like(), like()};
}

std::tuple<torch::Tensor, torch::Tensor> call_cos_sin(const torch::Tensor& angles) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("relpos::cos_sin", "")
          .typed<std::tuple<torch::Tensor, torch::Tensor>(const torch::Tensor&)>();
  return op.call(angles);
}

// d angle = -sin dcos + cos dsin
class CosSinFunction : public torch::autograd::Function<CosSinFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& angles) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [c, s] = call_cos_sin(angles);
    ctx->save_for_backward({c, s});
    return {c, s};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    torch::Tensor d;
    if (grad[0].defined()) d = -saved[1] * grad[0];
    if (grad[1].defined()) d = d.defined() ? d + saved[0] * grad[1] : saved[0] * grad[1];
    return {d};
  }
};

std::tuple<torch::Tensor, torch::Tensor> cos_sin_autograd(const torch::Tensor& angles) {
  value_errors([&] { check_real(angles); });
  // the kernel covers CPU tensors only; elsewhere ATen's own (differentiable) ops
  if (!angles.device().is_cpu() && !angles.is_meta())
    return {torch::cos(angles), torch::sin(angles)};
  auto out = CosSinFunction::apply(angles);
  return {out[0], out[1]};
}

}  // namespace

Frame Frame::of(const torch::Tensor& angles) {
  auto [c, s] = call_cos_sin(angles);
  return {c, s};
}

torch::Tensor rotate_pairs(const torch::Tensor& x, const Frame& f, bool inverse, Layout layout) {
  return call_rotate(x, f.cos, f.sin, inverse, layout == Layout::HalfSplit ? 1 : 0);
}

torch::Tensor rotate_pairs(const torch::Tensor& x, const torch::Tensor& angles, bool inverse,
                           Layout layout) {
  return rotate_pairs(x, Frame::of(angles), inverse, layout);
}

const TransformTerm* journey_term(const Mechanism& m) {
  const TransformTerm* found = nullptr;
  for (const auto& t : m.transforms)
    if (t.roles.values || t.roles.outputs || t.time == TimeSource::ContentPhase) found = &t;
  if (!found) return nullptr;
  if (m.transforms.size() != 1)
    throw InputError(fmt::format(
        "{}: a journey term composes with bias terms only (not with other transforms)", m.spec));
  for (const auto& s : found->segments)
    if (s.order != 1 || s.damped || s.shear != ShearMode::None)
      throw InputError(fmt::format("{}: journey frames must be plain rotations", m.spec));
  if (m.rope_scaling.active())
    throw InputError(fmt::format(
        "{}: context-extension rules are not implemented for journey frames yet", m.spec));
  return found;
}

namespace {
// f_m of every rotated pair, in pair order (segments rotate keys by -omega p)
torch::Tensor pair_frequencies(const TransformTerm& t) {
  std::vector<double> f;
  for (const auto& s : t.segments)
    for (double w : s.omega) f.push_back(-w);
  return torch::tensor(f, torch::kDouble);
}
}  // namespace

torch::Tensor fixed_frame_angles(const TransformTerm& t, const torch::Tensor& positions,
                                 torch::ScalarType dtype) {
  const auto f = pair_frequencies(t).to(positions.device());
  const auto a = positions.to(torch::kDouble).unsqueeze(-1) * f;
  return torch::remainder(a, 2 * std::numbers::pi).to(dtype);
}

torch::Tensor content_frame_angles(const TransformTerm& t, const torch::Tensor& increments) {
  const int64_t P = pair_frequencies(t).size(0);
  if (increments.dim() != 3 || increments.size(2) != P)
    throw InputError(fmt::format("journey: angle increments must be [B, T, {}], got {}", P,
                                 c10::str(increments.sizes())));
  return causal_scan(increments,
                     t.scan == PhaseScan::Exclusive ? "exclusive" : "reversed_inclusive");
}

torch::Tensor frame_angles(const TransformTerm& t, const torch::Tensor& positions,
                           const torch::Tensor& content_frame, torch::ScalarType dtype,
                           const char* what) {
  if (t.time != TimeSource::ContentPhase) return fixed_frame_angles(t, positions, dtype);
  if (!content_frame.defined())
    throw InputError(fmt::format(
        "journey: term '{}' has per-token angles: pass the {} (content phases [B, T, P] from "
        "the model's angle table)",
        t.name, what));
  return content_frame.to(dtype);
}

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def(
      "rotate_pairs(Tensor x, Tensor cos, Tensor sin, bool inverse=False, int layout=0) -> "
      "Tensor");
  m.def(
      "rotate_pairs_backward(Tensor grad, Tensor x, Tensor cos, Tensor sin, bool inverse, "
      "int layout, bool angle_grads=True) -> (Tensor, Tensor, Tensor)");
  m.def("cos_sin(Tensor angles) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(relpos, CPU, m) {
  m.impl("rotate_pairs", relpos::nn::rotate_cpu);
  m.impl("rotate_pairs_backward", relpos::nn::rotate_backward_cpu);
  m.impl("cos_sin", relpos::nn::cos_sin_cpu);
}

TORCH_LIBRARY_IMPL(relpos, Meta, m) {
  m.impl("rotate_pairs", relpos::nn::rotate_meta);
  m.impl("rotate_pairs_backward", relpos::nn::rotate_backward_meta);
  m.impl("cos_sin", relpos::nn::cos_sin_meta);
}

TORCH_LIBRARY_IMPL(relpos, Autograd, m) {
  m.impl("rotate_pairs", relpos::nn::rotate_autograd);
  m.impl("cos_sin", relpos::nn::cos_sin_autograd);
}
