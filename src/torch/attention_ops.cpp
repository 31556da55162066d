// The attention operators of TORCH_LIBRARY(relpos): `fused_attention` (CPU kernel = the fused
// FlashAttention-2-style kernel of kernels/attention, a Meta kernel for torch.compile, an Autograd
// kernel whose backward is the `fused_attention_backward` op) and `attention` (a mechanism spec:
// its transforms, then fused_attention with its biases). The C++ entry points of
// torch/attention.hpp call the same ops through the dispatcher.
#include <fmt/format.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/registry.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/attention/mechanism_attention.hpp"
#include "torch/attention.hpp"
#include "torch/journey.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

using op_util::mptr;
using op_util::output_like;
using op_util::ptr;
using op_util::value_errors;
using OptTensor = c10::optional<torch::Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor get(const OptTensor& t) {
  return t && t->defined() ? *t : torch::Tensor();
}
OptTensor opt(const torch::Tensor& t) {
  return t.defined() ? OptTensor(t) : c10::nullopt;
}

std::string shape_of(const torch::Tensor& t) {
  return fmt::format("[{}]", fmt::join(t.sizes(), ", "));
}

// The operands as the kernel takes them: contiguous, positions and per-token biases float64,
// key lengths int64; every problem named.
struct Operands {
  torch::Tensor q, k, v, q_pos, k_pos, lag_table, slopes, cq, ck, key_len;
  torch::Tensor gq, gk, path_q, path_k, path_beta;  // gated slopes, path integral
  double path_scale = 1.0;
  kernels::AttentionDims dims;
  bool per_batch = false;

  template <class T>
  kernels::AttentionBias<T> bias() const {
    kernels::AttentionBias<T> b{ptr<T>(lag_table), lag_table.defined() ? lag_table.size(1) : 0,
                                ptr<T>(slopes), ptr<double>(cq), ptr<double>(ck)};
    b.gq = ptr<T>(gq);
    b.gk = ptr<T>(gk);
    b.path_q = ptr<T>(path_q);
    b.path_k = ptr<T>(path_k);
    b.path_beta = ptr<T>(path_beta);
    b.path_dim = path_q.defined() ? path_q.size(3) : 0;
    b.path_scale = path_scale;
    return b;
  }
  kernels::AttentionPositions positions() const {
    return {ptr<double>(q_pos), ptr<double>(k_pos), per_batch};
  }
  kernels::AttentionOptions options(bool causal, double window, double scale,
                                    bool exclude_self) const {
    kernels::AttentionOptions o{causal, window, ptr<int64_t>(key_len), scale};
    o.exclude_self = exclude_self;
    return o;
  }
};

torch::Tensor attention_positions(const torch::Tensor& p, int64_t B, int64_t T, const char* name) {
  if (!p.defined()) return p;
  if (!((p.dim() == 1 && p.size(0) == T) || (p.dim() == 2 && p.size(0) == B && p.size(1) == T)))
    throw InputError(
        fmt::format("attention: {} must be [{}] or [{}, {}], got {}", name, T, B, T, shape_of(p)));
  if (p.is_complex() || p.scalar_type() == torch::kBool)
    throw InputError(fmt::format("attention: {} must be real numbers", name));
  auto d = p.to(torch::kDouble).contiguous();
  if (!torch::isfinite(d).all().item<bool>())
    throw InputError(fmt::format("attention: {} contain NaN or Inf", name));
  return d;
}

Operands prepare(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const OptTensor& q_pos, const OptTensor& k_pos, const OptTensor& lag_table,
                 const OptTensor& slopes, const OptTensor& cq, const OptTensor& ck,
                 const OptTensor& key_len, double window, double scale, const OptTensor& gq,
                 const OptTensor& gk, const OptTensor& path_q, const OptTensor& path_k,
                 const OptTensor& path_beta, double path_scale) {
  for (const auto* t : {&q, &k, &v}) {
    const char* name = t == &q ? "q" : t == &k ? "k" : "v";
    if (!t->defined()) throw InputError(fmt::format("attention: {} is undefined", name));
    if (t->dim() != 4)
      throw InputError(
          fmt::format("attention: {} must be [B, H, T, D], got {}", name, shape_of(*t)));
    if (t->scalar_type() != torch::kFloat && t->scalar_type() != torch::kDouble)
      throw InputError(fmt::format("attention: {} must be float32 or float64", name));
    if (!t->device().is_cpu())
      throw InputError(fmt::format("attention: {} must be on the CPU", name));
  }
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    throw InputError("attention: q, k and v must have one dtype");
  if (k.sizes() != v.sizes())
    throw InputError(
        fmt::format("attention: k {} and v {} differ in shape", shape_of(k), shape_of(v)));
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3), Hk = k.size(1),
                Tk = k.size(2);
  if (k.size(0) != B || k.size(3) != D)
    throw InputError(fmt::format("attention: q {} and k {} differ in batch or head dim",
                                 shape_of(q), shape_of(k)));
  if (Hk < 1 || Hq % Hk)
    throw InputError(
        fmt::format("attention: key/value heads ({}) must divide query heads ({})", Hk, Hq));
  if (!(window >= 0) || std::isinf(window))
    throw InputError("attention: window must be >= 0 and finite");
  if (!(scale >= 0) || std::isinf(scale))
    throw InputError("attention: scale must be >= 0 (0: 1/sqrt(D))");
  Operands o;
  o.q = q.contiguous();
  o.k = k.contiguous();
  o.v = v.contiguous();
  o.dims = {B, Hq, Hk, Tq, Tk, D};
  o.q_pos = attention_positions(get(q_pos), B, Tq, "q_positions");
  o.k_pos = attention_positions(get(k_pos), B, Tk, "k_positions");
  // one indexing rule for both: a shared [T] row next to a per-batch one is expanded to [B, T]
  o.per_batch =
      (o.q_pos.defined() && o.q_pos.dim() == 2) || (o.k_pos.defined() && o.k_pos.dim() == 2);
  if (o.per_batch) {
    if (o.q_pos.defined() && o.q_pos.dim() == 1) o.q_pos = o.q_pos.expand({B, Tq}).contiguous();
    if (o.k_pos.defined() && o.k_pos.dim() == 1) o.k_pos = o.k_pos.expand({B, Tk}).contiguous();
  }
  if (auto t = get(lag_table); t.defined()) {
    if (t.dim() != 2 || t.size(0) != Hq || t.size(1) < 1)
      throw InputError(
          fmt::format("attention: lag_table must be [{}, L] with L >= 1, got {}", Hq, shape_of(t)));
    if (t.scalar_type() != q.scalar_type())
      throw InputError("attention: lag_table must have q's dtype");
    o.lag_table = t.contiguous();
  }
  if (auto t = get(slopes); t.defined()) {
    if (t.dim() != 1 || t.size(0) != Hq)
      throw InputError(fmt::format("attention: slopes must be [{}], got {}", Hq, shape_of(t)));
    if (t.scalar_type() != q.scalar_type())
      throw InputError("attention: slopes must have q's dtype");
    o.slopes = t.contiguous();
  }
  const auto tcq = get(cq), tck = get(ck);
  if (tcq.defined() != tck.defined())
    throw InputError("attention: the per-token bias needs both cq and ck");
  if (tcq.defined()) {
    if (tcq.dim() != 3 || tcq.size(0) != B || tcq.size(1) != Hq || tcq.size(2) != Tq)
      throw InputError(
          fmt::format("attention: cq must be [{}, {}, {}], got {}", B, Hq, Tq, shape_of(tcq)));
    if (tck.dim() != 3 || tck.size(0) != B || tck.size(1) != Hq || tck.size(2) != Tk)
      throw InputError(
          fmt::format("attention: ck must be [{}, {}, {}], got {}", B, Hq, Tk, shape_of(tck)));
    if (!tcq.is_floating_point() || !tck.is_floating_point())
      throw InputError("attention: cq and ck must be floating point");
    o.cq = tcq.to(torch::kDouble).contiguous();
    o.ck = tck.to(torch::kDouble).contiguous();
  }
  if (auto t = get(key_len); t.defined()) {
    if (t.dim() != 1 || t.size(0) != B || t.is_floating_point() || t.scalar_type() == torch::kBool)
      throw InputError(
          fmt::format("attention: key_len must be an integer tensor [{}], got {}", B, shape_of(t)));
    o.key_len = t.to(torch::kLong).contiguous();
  }
  // per-token tensors of q's dtype with an exact shape
  const auto per_token = [&](const OptTensor& x, std::vector<int64_t> shape, const char* name) {
    auto t = get(x);
    if (!t.defined()) return t;
    if (t.sizes() != torch::IntArrayRef(shape))
      throw InputError(fmt::format("attention: {} must be [{}], got {}", name,
                                   fmt::join(shape, ", "), shape_of(t)));
    if (t.scalar_type() != q.scalar_type())
      throw InputError(fmt::format("attention: {} must have q's dtype", name));
    return t.contiguous();
  };
  o.gq = per_token(gq, {B, Hq, Tq}, "gq");
  o.gk = per_token(gk, {B, Hq, Tk}, "gk");
  const auto tpq = get(path_q), tpk = get(path_k), tpb = get(path_beta);
  if (tpq.defined() != tpk.defined() || tpq.defined() != tpb.defined())
    throw InputError("attention: the path integral needs path_q, path_k and path_beta together");
  if (tpq.defined()) {
    const int64_t P = tpq.dim() == 4 ? tpq.size(3) : 0;
    if (P < 1)
      throw InputError(fmt::format("attention: path_q must be [{}, {}, {}, P], got {}", B, Hq, Tq,
                                   shape_of(tpq)));
    o.path_q = per_token(path_q, {B, Hq, Tq, P}, "path_q");
    o.path_k = per_token(path_k, {B, Hq, Tk, P}, "path_k");
    o.path_beta = per_token(path_beta, {Hq}, "path_beta");
    if (!std::isfinite(path_scale)) throw InputError("attention: path_scale must be finite");
    o.path_scale = path_scale;
  }
  return o;
}

// ---- CPU ---------------------------------------------------------------------------------------

// The op's arguments after exclude_self (gated slopes and path integral), spelled once for the
// signatures below.
#define RELPOS_EXTRA_PARAMS                                                                   \
  const OptTensor &gq, const OptTensor &gk, const OptTensor &path_q, const OptTensor &path_k, \
      const OptTensor &path_beta, double path_scale
#define RELPOS_EXTRA_ARGS gq, gk, path_q, path_k, path_beta, path_scale

std::tuple<torch::Tensor, torch::Tensor> fused_attention_cpu(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const OptTensor& q_pos,
    const OptTensor& k_pos, const OptTensor& lag_table, const OptTensor& slopes,
    const OptTensor& cq, const OptTensor& ck, bool causal, double window, const OptTensor& key_len,
    double scale, bool exclude_self, RELPOS_EXTRA_PARAMS) {
  return value_errors([&] {
    const auto o = prepare(q, k, v, q_pos, k_pos, lag_table, slopes, cq, ck, key_len, window, scale,
                           RELPOS_EXTRA_ARGS);
    const auto& d = o.dims;
    auto out = output_like(o.q);
    auto lse = torch::empty({d.B, d.Hq, d.Tq}, o.q.options());
    if (out.numel() == 0) return std::make_tuple(out, lse);
    if (d.Tk == 0) {  // no key at all: every row is empty
      out.zero_();
      lse.fill_(-std::numeric_limits<double>::infinity());
      return std::make_tuple(out, lse);
    }
    AT_DISPATCH_FLOATING_TYPES(o.q.scalar_type(), "relpos_fused_attention", [&] {
      kernels::attention_forward<scalar_t>(
          d, o.q.data_ptr<scalar_t>(), o.k.data_ptr<scalar_t>(), o.v.data_ptr<scalar_t>(),
          o.positions(), o.bias<scalar_t>(), o.options(causal, window, scale, exclude_self),
          out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
    });
    return std::make_tuple(out, lse);
  });
}

// gradients: q, k, v, lag_table, slopes, cq, ck, gq, gk, path_q, path_k, path_beta
constexpr int kGrads = 12;
using Grads = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                         torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                         torch::Tensor, torch::Tensor>;

Grads fused_attention_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& q,
                                   const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& out_in, const torch::Tensor& lse_in,
                                   const OptTensor& q_pos, const OptTensor& k_pos,
                                   const OptTensor& lag_table, const OptTensor& slopes,
                                   const OptTensor& cq, const OptTensor& ck, bool causal,
                                   double window, const OptTensor& key_len, double scale,
                                   bool exclude_self, RELPOS_EXTRA_PARAMS,
                                   std::array<bool, kGrads> mask, const OptTensor& grad_lse) {
  return value_errors([&] {
    const auto o = prepare(q, k, v, q_pos, k_pos, lag_table, slopes, cq, ck, key_len, window, scale,
                           RELPOS_EXTRA_ARGS);
    const auto& d = o.dims;
    const auto out = out_in.contiguous(), lse = lse_in.contiguous();
    const auto dout = grad_out.defined() ? grad_out.contiguous() : torch::zeros_like(out);
    // lse is differentiable: its gradient (when lse was used) enters the kernel's Delta
    const auto dlse = grad_lse && grad_lse->defined() ? grad_lse->contiguous() : torch::Tensor();
    if (dout.sizes() != out.sizes() || lse.sizes() != torch::IntArrayRef({d.B, d.Hq, d.Tq}) ||
        (dlse.defined() &&
         (dlse.sizes() != lse.sizes() || dlse.scalar_type() != lse.scalar_type())))
      throw InputError("attention backward: grad_out, out, lse or grad_lse does not match q");
    // every output is a tensor (the schema has no optional outputs): absent or unrequested ones
    // are empty; the bias gradients are accumulated by the kernel, so they start at zero
    const auto grad_for = [&](int i, const torch::Tensor& like) {
      if (!mask[i] || !like.defined()) return torch::empty({0}, o.q.options());
      return i < 3 ? output_like(like) : torch::zeros_like(like);
    };
    auto dq = grad_for(0, o.q), dk = grad_for(1, o.k), dv = grad_for(2, o.v),
         dlag = grad_for(3, o.lag_table), dslopes = grad_for(4, o.slopes), dcq = grad_for(5, o.cq),
         dck = grad_for(6, o.ck), dgq = grad_for(7, o.gq), dgk = grad_for(8, o.gk),
         dpq = grad_for(9, o.path_q), dpk = grad_for(10, o.path_k),
         dbeta = grad_for(11, o.path_beta);
    if (d.Tk == 0 || o.q.numel() == 0) {  // no visible key: every gradient is zero
      for (auto* t : {&dq, &dk, &dv}) t->zero_();
    } else {
      AT_DISPATCH_FLOATING_TYPES(o.q.scalar_type(), "relpos_fused_attention_backward", [&] {
        kernels::AttentionBiasGrads<scalar_t> g{mptr<scalar_t>(dlag), mptr<scalar_t>(dslopes),
                                                mptr<double>(dcq), mptr<double>(dck)};
        g.gq = mptr<scalar_t>(dgq);
        g.gk = mptr<scalar_t>(dgk);
        g.path_q = mptr<scalar_t>(dpq);
        g.path_k = mptr<scalar_t>(dpk);
        g.path_beta = mptr<scalar_t>(dbeta);
        kernels::attention_backward<scalar_t>(
            d, o.q.data_ptr<scalar_t>(), o.k.data_ptr<scalar_t>(), o.v.data_ptr<scalar_t>(),
            o.positions(), o.bias<scalar_t>(), o.options(causal, window, scale, exclude_self),
            dout.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
            mptr<scalar_t>(dq), mptr<scalar_t>(dk), mptr<scalar_t>(dv), g,
            dlse.defined() ? dlse.data_ptr<scalar_t>() : nullptr);
      });
    }
    // per-token gradients back in the caller's dtype
    if (dcq.numel()) dcq = dcq.to(get(cq).scalar_type());
    if (dck.numel()) dck = dck.to(get(ck).scalar_type());
    return std::make_tuple(dq, dk, dv, dlag, dslopes, dcq, dck, dgq, dgk, dpq, dpk, dbeta);
  });
}

// ---- Meta (fake): shapes and dtypes only -------------------------------------------------------

std::tuple<torch::Tensor, torch::Tensor> fused_attention_meta(
    const torch::Tensor& q, const torch::Tensor&, const torch::Tensor&, const OptTensor&,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool,
    double, const OptTensor&, double, bool, const OptTensor&, const OptTensor&, const OptTensor&,
    const OptTensor&, const OptTensor&, double) {
  return {torch::empty_like(q, torch::MemoryFormat::Contiguous),
          torch::empty({q.size(0), q.size(1), q.size(2)}, q.options())};
}

Grads fused_attention_backward_meta(const torch::Tensor&, const torch::Tensor& q,
                                    const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor&, const torch::Tensor&, const OptTensor&,
                                    const OptTensor&, const OptTensor& lag_table,
                                    const OptTensor& slopes, const OptTensor& cq,
                                    const OptTensor& ck, bool, double, const OptTensor&, double,
                                    bool, RELPOS_EXTRA_PARAMS, std::array<bool, kGrads> mask,
                                    const OptTensor&) {
  (void)path_scale;
  const auto like = [&](int i, const torch::Tensor& t) {
    return mask[i] && t.defined() ? torch::empty_like(t, torch::MemoryFormat::Contiguous)
                                  : torch::empty({0}, q.options());
  };
  return {like(0, q),
          like(1, k),
          like(2, v),
          like(3, get(lag_table)),
          like(4, get(slopes)),
          like(5, get(cq)),
          like(6, get(ck)),
          like(7, get(gq)),
          like(8, get(gk)),
          like(9, get(path_q)),
          like(10, get(path_k)),
          like(11, get(path_beta))};
}

// ---- Autograd: the backward is the fused_attention_backward op ---------------------------------

std::tuple<torch::Tensor, torch::Tensor> call_fused_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const OptTensor& q_pos,
    const OptTensor& k_pos, const OptTensor& lag_table, const OptTensor& slopes,
    const OptTensor& cq, const OptTensor& ck, bool causal, double window, const OptTensor& key_len,
    double scale, bool exclude_self, RELPOS_EXTRA_PARAMS) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("relpos::fused_attention", "")
                             .typed<decltype(fused_attention_cpu)>();
  return op.call(q, k, v, q_pos, k_pos, lag_table, slopes, cq, ck, causal, window, key_len, scale,
                 exclude_self, RELPOS_EXTRA_ARGS);
}

Grads call_fused_attention_backward(const torch::Tensor& grad_out, const torch::Tensor& q,
                                    const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& out, const torch::Tensor& lse,
                                    const OptTensor& q_pos, const OptTensor& k_pos,
                                    const OptTensor& lag_table, const OptTensor& slopes,
                                    const OptTensor& cq, const OptTensor& ck, bool causal,
                                    double window, const OptTensor& key_len, double scale,
                                    bool exclude_self, RELPOS_EXTRA_PARAMS,
                                    std::array<bool, kGrads> mask, const OptTensor& grad_lse) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("relpos::fused_attention_backward", "")
                             .typed<decltype(fused_attention_backward_cpu)>();
  return op.call(grad_out, q, k, v, out, lse, q_pos, k_pos, lag_table, slopes, cq, ck, causal,
                 window, key_len, scale, exclude_self, RELPOS_EXTRA_ARGS, mask, grad_lse);
}

class FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
 public:
  // inputs in schema order: q k v q_pos k_pos lag_table slopes cq ck causal window key_len scale
  // exclude_self gq gk path_q path_k path_beta path_scale
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const OptTensor& q_pos,
                               const OptTensor& k_pos, const OptTensor& lag_table,
                               const OptTensor& slopes, const OptTensor& cq, const OptTensor& ck,
                               bool causal, double window, const OptTensor& key_len, double scale,
                               bool exclude_self, RELPOS_EXTRA_PARAMS) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = call_fused_attention(q, k, v, q_pos, k_pos, lag_table, slopes, cq, ck, causal,
                                           window, key_len, scale, exclude_self, RELPOS_EXTRA_ARGS);
    ctx->save_for_backward({q, k, v, out, lse, get(q_pos), get(k_pos), get(lag_table), get(slopes),
                            get(cq), get(ck), get(key_len), get(gq), get(gk), get(path_q),
                            get(path_k), get(path_beta)});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window"] = window;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["exclude_self"] = exclude_self;
    ctx->saved_data["path_scale"] = path_scale;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    // the tensor inputs in order with the saved slot of each and its gradient index (-1: none);
    // needs_input_grad counts only the tensor inputs that were present (an absent optional is
    // no edge)
    constexpr std::array<std::pair<int, int>, 15> inputs{{{0, 0},
                                                          {1, 1},
                                                          {2, 2},
                                                          {5, -1},
                                                          {6, -1},
                                                          {7, 3},
                                                          {8, 4},
                                                          {9, 5},
                                                          {10, 6},
                                                          {11, -1},
                                                          {12, 7},
                                                          {13, 8},
                                                          {14, 9},
                                                          {15, 10},
                                                          {16, 11}}};
    std::array<bool, kGrads> mask{};
    int edge = 0;
    for (const auto& [slot, grad] : inputs) {
      if (!s[slot].defined()) continue;
      if (grad >= 0) mask[grad] = ctx->needs_input_grad(edge);
      ++edge;
    }
    auto g = call_fused_attention_backward(
        grad_out[0], s[0], s[1], s[2], s[3], s[4], opt(s[5]), opt(s[6]), opt(s[7]), opt(s[8]),
        opt(s[9]), opt(s[10]), ctx->saved_data["causal"].toBool(),
        ctx->saved_data["window"].toDouble(), opt(s[11]), ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["exclude_self"].toBool(), opt(s[12]), opt(s[13]), opt(s[14]), opt(s[15]),
        opt(s[16]), ctx->saved_data["path_scale"].toDouble(), mask,
        grad_out.size() > 1 && grad_out[1].defined() ? OptTensor(grad_out[1]) : OptTensor());
    const auto keep = [&](int i, torch::Tensor t) { return mask[i] ? t : torch::Tensor(); };
    return {keep(0, std::get<0>(g)),
            keep(1, std::get<1>(g)),
            keep(2, std::get<2>(g)),
            {},
            {},
            keep(3, std::get<3>(g)),
            keep(4, std::get<4>(g)),
            keep(5, std::get<5>(g)),
            keep(6, std::get<6>(g)),
            {},
            {},
            {},
            {},
            {},
            keep(7, std::get<7>(g)),
            keep(8, std::get<8>(g)),
            keep(9, std::get<9>(g)),
            keep(10, std::get<10>(g)),
            keep(11, std::get<11>(g)),
            {}};
  }
};

std::tuple<torch::Tensor, torch::Tensor> fused_attention_autograd(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const OptTensor& q_pos,
    const OptTensor& k_pos, const OptTensor& lag_table, const OptTensor& slopes,
    const OptTensor& cq, const OptTensor& ck, bool causal, double window, const OptTensor& key_len,
    double scale, bool exclude_self, RELPOS_EXTRA_PARAMS) {
  auto r = FusedAttentionFunction::apply(q, k, v, q_pos, k_pos, lag_table, slopes, cq, ck, causal,
                                         window, key_len, scale, exclude_self, RELPOS_EXTRA_ARGS);
  return {r[0], r[1]};
}
#undef RELPOS_EXTRA_PARAMS
#undef RELPOS_EXTRA_ARGS

// `relpos::attention`: composite (its autograd comes from the transform and fused ops it calls).
torch::Tensor attention_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const std::string& spec, const OptTensor& q_pos, const OptTensor& k_pos,
                           bool causal, double window, const OptTensor& key_len, double scale,
                           const OptTensor& lag_table, const OptTensor& slopes, const OptTensor& cq,
                           const OptTensor& ck, int64_t layout) {
  return value_errors([&] {
    AttentionArgs a;
    a.q_positions = get(q_pos);
    a.k_positions = get(k_pos);
    a.causal = causal;
    a.window = window;
    a.key_len = get(key_len);
    a.scale = scale;
    a.lag_table = get(lag_table);
    a.slopes = get(slopes);
    a.cq = get(cq);
    a.ck = get(ck);
    return attention(q, k, v, spec, a, layout ? Layout::HalfSplit : Layout::Interleaved);
  });
}

}  // namespace

// ---- the C++ entry points (torch/attention.hpp) ------------------------------------------------

std::vector<torch::Tensor> fused_attention(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, const AttentionArgs& a) {
  auto [out, lse] = call_fused_attention(
      q, k, v, opt(a.q_positions), opt(a.k_positions), opt(a.lag_table), opt(a.slopes), opt(a.cq),
      opt(a.ck), a.causal, a.window, opt(a.key_len), a.scale, a.exclude_self, opt(a.gq), opt(a.gk),
      opt(a.path_q), opt(a.path_k), opt(a.path_beta), a.path_scale);
  return {out, lse};
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        PositionEncodingImpl& enc, const AttentionArgs& args) {
  const Mechanism& m = enc.mechanism();
  if (q.dim() != 4 || k.dim() != 4 || q.size(0) != k.size(0) || q.size(3) != k.size(3))
    throw InputError(fmt::format("attention: q {} and k {} must be [B, H, T, D] with one B and D",
                                 shape_of(q), shape_of(k)));
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3), Hk = k.size(1),
                Tk = k.size(2);
  if (const BiasTerm* c = m.content_bias())
    throw InputError(fmt::format(
        "attention: '{}' has a content-gated bias ({}): its gates come from the tokens; use "
        "nn::GrapeAttention (torch/grape.hpp) or pass gq/gk, cq/ck or path_* to fused_attention",
        m.spec, c->name));
  if (Hk != m.heads || Hq % Hk)
    throw InputError(fmt::format(
        "attention: the encoding has {} heads; it must have the key/value heads ({}), which "
        "divide the query heads ({})",
        m.heads, Hk, Hq));
  // the kernel's default positions, made explicit: the transforms and the visibility rule must
  // see the same numbers
  const auto qpos = args.q_positions.defined()
                        ? attention_positions(args.q_positions, B, Tq, "q_positions")
                        : torch::arange(Tk - Tq, Tk, torch::kDouble);
  const auto kpos = args.k_positions.defined()
                        ? attention_positions(args.k_positions, B, Tk, "k_positions")
                        : torch::arange(Tk, torch::kDouble);
  torch::Tensor qt = q, kt = k, vt = v;
  Frame q_frame;
  const TransformTerm* journey = journey_term(m);
  if (journey && q.numel() && k.numel()) {
    // frames per token: q and k (and v) rotated by their own frames, the output back below
    const auto dt = q.scalar_type();
    const auto k_angles = frame_angles(*journey, kpos, args.k_frame, dt, "k_frame");
    const bool same = !args.q_frame.defined() &&
                      (journey->time == TimeSource::ContentPhase || qpos.is_same(kpos));
    const auto q_angles =
        same ? k_angles : frame_angles(*journey, qpos, args.q_frame, dt, "q_frame");
    if (q_angles.size(-2) != Tq)
      throw InputError(fmt::format("attention: the query frame has {} positions, q has {}",
                                   q_angles.size(-2), Tq));
    const Frame k_frame = Frame::of(k_angles);
    q_frame = same ? k_frame : Frame::of(q_angles);
    const Layout layout = enc.plan().layout;
    qt = rotate_pairs(q, q_frame, false, layout);
    kt = rotate_pairs(k, k_frame, false, layout);
    if (journey->roles.values) vt = rotate_pairs(v, k_frame, false, layout);
  } else if (m.has_transform() && q.numel() && k.numel()) {
    const int64_t g = Hq / Hk;
    // one call when queries and keys share heads and positions (decided from the arguments, as
    // the Python function does, which must not read values under torch.compile)
    const bool shared = g == 1 && Tq == Tk &&
                        ((!args.q_positions.defined() && !args.k_positions.defined()) ||
                         args.q_positions.is_same(args.k_positions));
    if (shared) {
      const auto o = enc.forward(q, k, qpos);
      qt = o.q;
      kt = o.k;
    } else {
      // queries grouped onto their key/value head ([B, Hk, g Tq, D]) and keys, in one call so that
      // both get the same centre; the transform runs both maps over both halves (2x its work,
      // still small next to attention)
      const bool per_batch = qpos.dim() == 2 || kpos.dim() == 2;
      const auto rows = [&](const torch::Tensor& p, int64_t T) {
        return per_batch && p.dim() == 1 ? p.expand({B, T}) : p;
      };
      const auto qg = q.reshape({B, Hk, g * Tq, D});
      const auto both = torch::cat({qg, k}, 2);
      const auto pos = torch::cat(
          {rows(qpos, Tq).repeat(per_batch ? std::vector<int64_t>{1, g} : std::vector<int64_t>{g}),
           rows(kpos, Tk)},
          -1);
      const auto o = enc.forward(both, both, pos);
      qt = o.q.narrow(2, 0, g * Tq).reshape({B, Hq, Tq, D});
      kt = o.k.narrow(2, g * Tq, Tk);
    }
  }
  AttentionArgs a = args;
  a.q_positions = qpos;
  a.k_positions = kpos;
  if (const BiasTerm* alibi = m.alibi()) {
    // slopes per query head (ALiBi's geometric sequence depends on the head count)
    const std::vector<double> s =
        Hq == m.heads ? alibi->slopes
                      : build_mechanism(m.spec, m.head_dim, static_cast<int>(Hq)).alibi()->slopes;
    const auto t = torch::tensor(s, torch::kDouble).to(q.scalar_type());
    a.slopes = a.slopes.defined() ? a.slopes + t : t;
  }
  if (enc.has_lag_table() && q.numel() && k.numel()) {
    // the learned table over every lag of the call (its gradient flows to its parameters)
    if (Hq != m.heads)
      throw InputError(fmt::format(
          "attention: mechanism '{}' has a learned lag table per head; grouped-query attention "
          "({} query heads, {} key heads) is not supported with it",
          m.spec, Hq, Hk));
    if (args.lag_table.defined())
      throw InputError(
          "attention: an explicit lag_table together with the mechanism's own "
          "learned table is not supported; add them into one table");
    // bounded as kernels::attention_bias_of: longer lags use the last entry (the kernel's clamp)
    const double span = (qpos.max() - kpos.min()).item<double>();
    const int64_t len = static_cast<int64_t>(
        std::clamp(std::ceil(span), 0.0, static_cast<double>(kernels::kMaxLagTable)) + 1);
    a.lag_table = enc.lag_table(len).to(q.scalar_type());
  }
  auto out = fused_attention(qt, kt, vt, a)[0];
  if (journey && journey->roles.outputs && q_frame.defined())
    out = rotate_pairs(out, q_frame, true, enc.plan().layout);
  return out;
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::string& spec, const AttentionArgs& args, Layout layout) {
  if (!k.defined() || k.dim() != 4 || !q.defined() || q.dim() != 4)
    throw InputError("attention: q and k must be [B, H, T, D]");
  PositionEncoding enc(spec, k.size(3), k.size(1), EncodingOptions{layout, true});
  if (const BiasTerm* b = enc->mechanism().learned_lag_bias()) {
    // a spec string names fixed parameters: the learned table's initial values of the core
    // kernel (seeded), not a runtime's fresh torch draw per call (which made two calls differ)
    const auto init = initial_lag_values(*b->learned, enc->mechanism().heads);
    const torch::NoGradGuard no_grad;
    const auto& params = enc->lag_parameters();
    for (size_t i = 0; i < params.size(); ++i)
      params[i].copy_(torch::tensor(init[i], torch::kDouble).view_as(params[i]));
  }
  return attention(q, k, v, *enc, args);
}

torch::Tensor composed_attention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const AttentionArgs& a) {
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3), Hk = k.size(1),
                Tk = k.size(2);
  const auto dt = q.scalar_type();
  const int64_t g = Hq / Hk;
  const auto ke = k.repeat_interleave(g, 1), ve = v.repeat_interleave(g, 1);
  const double scale = a.scale > 0 ? a.scale : 1.0 / std::sqrt(static_cast<double>(D));
  // positions [B or 1, T] in float64
  const auto rows = [&](const torch::Tensor& p, int64_t T, int64_t first) {
    const auto d =
        p.defined() ? p.to(torch::kDouble) : torch::arange(first, first + T, torch::kDouble);
    return d.dim() == 1 ? d.unsqueeze(0) : d;
  };
  const auto qp = rows(a.q_positions, Tq, Tk - Tq), kp = rows(a.k_positions, Tk, 0);
  const auto lag = qp.unsqueeze(-1) - kp.unsqueeze(-2);  // [Bp, Tq, Tk]
  auto scores = torch::matmul(q, ke.transpose(-1, -2)) * scale;
  if (a.lag_table.defined()) {
    const int64_t L = a.lag_table.size(1);
    const auto idx = torch::floor(lag + 0.5).clamp(0, L - 1).to(torch::kLong);
    scores =
        scores +
        a.lag_table.index_select(1, idx.flatten()).view({Hq, idx.size(0), Tq, Tk}).transpose(0, 1);
  }
  if (a.slopes.defined()) scores = scores - a.slopes.view({1, Hq, 1, 1}) * lag.unsqueeze(1).to(dt);
  if (a.cq.defined())
    scores = scores +
             (a.cq.unsqueeze(-1).to(torch::kDouble) - a.ck.unsqueeze(-2).to(torch::kDouble)).to(dt);
  if (a.gq.defined() || a.gk.defined()) {
    const auto gate = (a.gq.defined() ? a.gq.unsqueeze(-1) : torch::zeros({1}, q.options())) +
                      (a.gk.defined() ? a.gk.unsqueeze(-2) : torch::zeros({1}, q.options()));
    scores = scores - lag.unsqueeze(1).to(dt) * gate;
  }
  if (a.path_q.defined()) {
    // edges e(i, l) = beta logsigmoid(s p_i . p_l) for l <= slot(i) = Tk - Tq + i; the bias
    // sum_{l=j+1..slot(i)} e(i, l) = (row total) - (cumulative sum up to j)
    const auto z = torch::matmul(a.path_q, a.path_k.transpose(-1, -2)) * a.path_scale;
    const auto on = (torch::arange(Tk).view({1, Tk}) <= torch::arange(Tk - Tq, Tk).view({Tq, 1}));
    const auto e = torch::where(on, torch::log_sigmoid(z) * a.path_beta.view({1, Hq, 1, 1}),
                                torch::zeros({1}, q.options()));
    const auto c = torch::cumsum(e, -1);
    scores = scores + (c.narrow(-1, Tk - 1, 1) - c);
  }
  auto visible = torch::ones({1, 1, Tq, Tk}, torch::kBool);
  if (a.causal) visible = visible & (a.exclude_self ? lag > 0 : lag >= 0).unsqueeze(1);
  if (a.window > 0) visible = visible & (lag < a.window).unsqueeze(1);
  if (a.key_len.defined())
    visible = visible & (torch::arange(Tk).view({1, Tk}) < a.key_len.view({B, 1}).to(torch::kLong))
                            .view({B, 1, 1, Tk});
  visible = visible.expand({B, Hq, Tq, Tk});
  // rows without a visible key give zeros (and zero gradients), as the kernel does
  const auto any = visible.any(-1, true);
  const auto masked = scores.masked_fill(~visible, -std::numeric_limits<double>::infinity());
  const auto p = torch::softmax(torch::where(any, masked, torch::zeros_like(masked)), -1) * any;
  return torch::matmul(p, ve);
}

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def(
      "fused_attention(Tensor q, Tensor k, Tensor v, Tensor? q_positions=None, "
      "Tensor? k_positions=None, Tensor? lag_table=None, Tensor? slopes=None, Tensor? cq=None, "
      "Tensor? ck=None, bool causal=True, float window=0., Tensor? key_len=None, "
      "float scale=0., bool exclude_self=False, Tensor? gq=None, Tensor? gk=None, "
      "Tensor? path_q=None, Tensor? path_k=None, Tensor? path_beta=None, float path_scale=1.) "
      "-> (Tensor, Tensor)");
  m.def(
      "fused_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor? q_positions, Tensor? k_positions, Tensor? lag_table, Tensor? slopes, "
      "Tensor? cq, Tensor? ck, bool causal, float window, Tensor? key_len, float scale, "
      "bool exclude_self, Tensor? gq, Tensor? gk, Tensor? path_q, Tensor? path_k, "
      "Tensor? path_beta, float path_scale, bool[12] output_mask, Tensor? grad_lse=None) -> "
      "(Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, str mechanism, Tensor? q_positions=None, "
      "Tensor? k_positions=None, bool causal=True, float window=0., Tensor? key_len=None, "
      "float scale=0., Tensor? lag_table=None, Tensor? slopes=None, Tensor? cq=None, "
      "Tensor? ck=None, int layout=0) -> Tensor",
      relpos::nn::attention_op);
}

TORCH_LIBRARY_IMPL(relpos, CPU, m) {
  m.impl("fused_attention", relpos::nn::fused_attention_cpu);
  m.impl("fused_attention_backward", relpos::nn::fused_attention_backward_cpu);
}

TORCH_LIBRARY_IMPL(relpos, Meta, m) {
  m.impl("fused_attention", relpos::nn::fused_attention_meta);
  m.impl("fused_attention_backward", relpos::nn::fused_attention_backward_meta);
}

TORCH_LIBRARY_IMPL(relpos, Autograd, m) {
  m.impl("fused_attention", relpos::nn::fused_attention_autograd);
}
