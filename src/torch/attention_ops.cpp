// The attention operators of TORCH_LIBRARY(relpos): `fused_attention` (CPU kernel = the fused
// FlashAttention-2-style kernel of kernels/attention, a Meta kernel for torch.compile, an Autograd
// kernel whose backward is the `fused_attention_backward` op) and `attention` (a mechanism spec:
// its transforms, then fused_attention with its biases). The C++ entry points of
// torch/attention.hpp call the same ops through the dispatcher.
#include <fmt/format.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_set>

#include "core/registry.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/attention/mechanism_attention.hpp"
#include "kernels/isa.hpp"
#include "torch/attention.hpp"
#include "torch/encoding.hpp"
#include "torch/finite.hpp"
#include "torch/journey.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

using op_util::compute_type;
using op_util::computed;
using op_util::half_type;
using op_util::mptr;
using op_util::mwords;
using op_util::output_like;
using op_util::ptr;
using op_util::stored;
using op_util::value_errors;
using op_util::words;
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

// The kernel's additive biases (kernels::AttentionBias) as the ops take them: one packed list
// `biases`, its slots named here once (`attention_bias_slots` gives the names to Python).
enum BiasSlot : int { kLagTable, kSlopes, kCq, kCk, kGq, kGk, kPathQ, kPathK, kPathBeta, kSlots };
constexpr std::array<const char*, kSlots> kSlotNames{
    "lag_table", "slopes", "cq", "ck", "gq", "gk", "path_q", "path_k", "path_beta"};
using Biases = std::array<torch::Tensor, kSlots>;  // undefined: absent
using BiasList = c10::List<OptTensor>;

Biases unpack(const BiasList& list) {
  if (list.size() > kSlots)
    throw InputError(fmt::format("attention: biases has {} entries; the kernel has {} slots ({})",
                                 list.size(), kSlots, fmt::join(kSlotNames, ", ")));
  Biases b;
  for (size_t i = 0; i < list.size(); ++i) b[i] = get(list.get(i));
  return b;
}
BiasList pack(const Biases& b) {
  BiasList list;
  for (const auto& t : b) list.push_back(opt(t));
  return list;
}

// The options of a call besides its tensors.
struct CallOptions {
  bool causal = true;
  double window = 0.0, scale = 0.0;
  bool exclude_self = false;
  double path_scale = 1.0;
};

// The visibility masks besides causality and the window, as the op takes them: key_len and
// key_start [B] (right and left padding), q_segments [B, Tq] and k_segments [B, Tk] (packed
// sequences).
struct Masks {
  OptTensor key_len, key_start, q_segments, k_segments;
};

// The operands as the kernel takes them: contiguous, positions and per-token biases float64,
// key lengths int64; every problem named.
struct Operands {
  torch::Tensor q, k, v, q_pos, k_pos, key_len, key_start, q_seg, k_seg;
  Biases bias;
  double path_scale = 1.0;
  kernels::AttentionDims dims;
  int64_t key_rows = 0;  // AttentionBias::key_rows: ck, gk, path_k read in place (0: contiguous)
  bool per_batch = false;

  // The slot pointers of a kernel bias struct (AttentionBias, AttentionBiasGrads: one field per
  // slot) from at<U>(slot); the per-token sums are float64 in both precisions.
  template <class T, class S, class At>
  static void fill_slots(S& s, At&& at) {
    s.lag_table = at.template operator()<T>(kLagTable);
    s.slopes = at.template operator()<T>(kSlopes);
    s.cq = at.template operator()<double>(kCq);
    s.ck = at.template operator()<double>(kCk);
    s.gq = at.template operator()<T>(kGq);
    s.gk = at.template operator()<T>(kGk);
    s.path_q = at.template operator()<T>(kPathQ);
    s.path_k = at.template operator()<T>(kPathK);
    s.path_beta = at.template operator()<T>(kPathBeta);
  }
  template <class T>
  kernels::AttentionBias<T> kernel_bias() const {
    kernels::AttentionBias<T> b;
    fill_slots<T>(b, [&]<class U>(int slot) { return ptr<U>(bias[slot]); });
    b.lag_len = bias[kLagTable].defined() ? bias[kLagTable].size(1) : 0;
    b.path_dim = bias[kPathQ].defined() ? bias[kPathQ].size(3) : 0;
    b.path_scale = path_scale;
    b.key_rows = key_rows;
    return b;
  }
  // the gradient pointers of the slots (undefined or empty tensors: not computed)
  template <class T>
  static kernels::AttentionBiasGrads<T> kernel_grads(Biases& g) {
    kernels::AttentionBiasGrads<T> r;
    fill_slots<T>(r, [&]<class U>(int slot) { return mptr<U>(g[slot]); });
    return r;
  }
  kernels::AttentionPositions positions() const {
    return {ptr<double>(q_pos), ptr<double>(k_pos), per_batch};
  }
  kernels::AttentionOptions options(const CallOptions& c) const {
    kernels::AttentionOptions o{c.causal, c.window, ptr<int64_t>(key_len), c.scale};
    o.exclude_self = c.exclude_self;
    o.key_start = ptr<int64_t>(key_start);
    o.q_segments = ptr<int64_t>(q_seg);
    o.k_segments = ptr<int64_t>(k_seg);
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
  // finite and within +-2^53, int64 checked before its conversion to float64 (which would round
  // 2^60 + i to one value and break causality): the encoding's check (docs/errors.md, "Positions")
  return checked_position_values(p, B, T, name);
}

// R when t, [B, H, T] or [B, H, T, w], is the used prefix of a decode cache's storage ([B, H, R]
// or [B, H, R, w], R > T, rows contiguous); 0 for any other layout.
int64_t prefix_rows(const torch::Tensor& t) {
  if (t.is_contiguous() || t.dim() < 3 || t.dim() > 4) return 0;
  const int64_t B = t.size(0), H = t.size(1), T = t.size(2), w = t.dim() == 4 ? t.size(3) : 1;
  if (w < 1 || (t.dim() == 4 && t.stride(3) != 1) || (T > 1 && t.stride(2) != w)) return 0;
  const int64_t head = H > 1 ? t.stride(1) : t.stride(0);  // B > 1 when H == 1
  if (head % w || head / w < T) return 0;
  if (B > 1 && t.stride(0) != H * head) return 0;
  return head / w;
}

// t's rows as the kernels read them in place (RowStrides): t itself with its strides when its
// last dimension is contiguous and its rows distinct (all zero: contiguous), else a contiguous
// copy. A layer's v (a view into its fused projection) and the output's gradient (the output
// taken back token-major) are then read where they lie.
bool strided_rows(const torch::Tensor& t) {
  if (t.is_contiguous() || t.dim() != 4 || t.stride(3) != 1) return false;
  for (int i = 0; i < 3; ++i)
    if (t.size(i) > 1 && t.stride(i) <= 0) return false;
  return true;
}
std::pair<torch::Tensor, kernels::RowStrides> rows_in_place(const torch::Tensor& t) {
  if (!strided_rows(t)) return {t.contiguous(), {}};
  return {t, {t.stride(0), t.stride(1), t.stride(2)}};
}

// The forward's output (and dv beside a strided v): token-major storage ([B, T, H, D]) seen as
// [B, H, T, D], so that a layer's transpose back to [B, T, H D] is a view (and the split's
// backward, which stacks the q, k, v gradients in that order, reads dv in order, as SDPA's).
torch::Tensor token_major_output(int64_t B, int64_t H, int64_t T, int64_t D,
                                 const torch::TensorOptions& options) {
  return op_util::output_of({B, T, H, D}, options).transpose(1, 2);
}

// The rows per key/value head when k and v are the used prefix of a decode cache's storage: the
// forward reads them in place instead of copying the whole cache every step. 0 for any other
// layout.
int64_t cache_rows(const torch::Tensor& k, const torch::Tensor& v) {
  if (k.strides() != v.strides()) return 0;
  return prefix_rows(k);
}

Operands prepare(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const OptTensor& q_pos, const OptTensor& k_pos, const Masks& masks,
                 const BiasList& biases, const CallOptions& c, bool in_place = false) {
  const double window = c.window, scale = c.scale, path_scale = c.path_scale;
  const Biases in = unpack(biases);
  for (const auto* t : {&q, &k, &v}) {
    const char* name = t == &q ? "q" : t == &k ? "k" : "v";
    if (!t->defined()) throw InputError(fmt::format("attention: {} is undefined", name));
    if (t->dim() != 4)
      throw InputError(
          fmt::format("attention: {} must be [B, H, T, D], got {}", name, shape_of(*t)));
    if (!op_util::storable(t->scalar_type()))
      throw InputError(
          fmt::format("attention: {} must be float32, float64, bfloat16 or float16", name));
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
  // half storage stays as stored (the kernels widen each tile as they read it); the forward
  // (in_place) reads a decode cache's used prefix in place
  Operands o;
  o.q = q.contiguous();
  const int64_t rows = in_place ? cache_rows(k, v) : 0;
  o.k = rows ? k : k.contiguous();
  o.v = v;
  o.dims = {B, Hq, Hk, Tq, Tk, D, rows};
  if (!rows) std::tie(o.v, o.dims.v_strides) = rows_in_place(v);
  o.q_pos = attention_positions(get(q_pos), B, Tq, "q_positions");
  o.k_pos = attention_positions(get(k_pos), B, Tk, "k_positions");
  // one indexing rule for both: a shared [T] row next to a per-batch one is expanded to [B, T]
  o.per_batch =
      (o.q_pos.defined() && o.q_pos.dim() == 2) || (o.k_pos.defined() && o.k_pos.dim() == 2);
  if (o.per_batch) {
    if (o.q_pos.defined() && o.q_pos.dim() == 1) o.q_pos = o.q_pos.expand({B, Tq}).contiguous();
    if (o.k_pos.defined() && o.k_pos.dim() == 1) o.k_pos = o.k_pos.expand({B, Tk}).contiguous();
  }
  if (auto t = in[kLagTable]; t.defined()) {
    if (t.dim() != 2 || t.size(0) != Hq || t.size(1) < 1)
      throw InputError(
          fmt::format("attention: lag_table must be [{}, L] with L >= 1, got {}", Hq, shape_of(t)));
    if (!op_util::goes_with(t.scalar_type(), q.scalar_type()))
      throw InputError("attention: lag_table must have q's dtype (or float32 beside half q)");
    o.bias[kLagTable] = computed(t);
  }
  if (auto t = in[kSlopes]; t.defined()) {
    if (t.dim() != 1 || t.size(0) != Hq)
      throw InputError(fmt::format("attention: slopes must be [{}], got {}", Hq, shape_of(t)));
    if (!op_util::goes_with(t.scalar_type(), q.scalar_type()))
      throw InputError("attention: slopes must have q's dtype (or float32 beside half q)");
    o.bias[kSlopes] = computed(t);
  }
  const auto tcq = in[kCq], tck = in[kCk];
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
    o.bias[kCq] = tcq.to(torch::kDouble).contiguous();
    o.bias[kCk] = tck.to(torch::kDouble);
  }
  // integer tensors of an exact shape, as int64
  const auto ids = [&](const OptTensor& x, std::vector<int64_t> shape, const char* name) {
    auto t = get(x);
    if (!t.defined()) return t;
    if (t.sizes() != torch::IntArrayRef(shape) || t.is_floating_point() || t.is_complex() ||
        t.scalar_type() == torch::kBool)
      throw InputError(fmt::format("attention: {} must be an integer tensor [{}], got {}", name,
                                   fmt::join(shape, ", "), shape_of(t)));
    return t.to(torch::kLong).contiguous();
  };
  o.key_len = ids(masks.key_len, {B}, "key_len");
  o.key_start = ids(masks.key_start, {B}, "key_start");
  o.q_seg = ids(masks.q_segments, {B, Tq}, "q_segments");
  o.k_seg = ids(masks.k_segments, {B, Tk}, "k_segments");
  if (o.q_seg.defined() != o.k_seg.defined())
    throw InputError("attention: packed sequences need both q_segments and k_segments");
  // each document one contiguous run of its row: the biases summed along a row (FoX gates,
  // GRAPE-AP paths) then never cross a document boundary
  for (const auto& [t, name] : {std::pair{&o.q_seg, "q_segments"}, {&o.k_seg, "k_segments"}}) {
    if (!t->defined()) continue;
    const int64_t rows = t->size(0), n = t->size(1);
    const int64_t* p = t->data_ptr<int64_t>();
    for (int64_t b = 0; b < rows; ++b) {
      std::unordered_set<int64_t> seen;
      for (int64_t j = 0; j < n; ++j)
        if ((j == 0 || p[b * n + j] != p[b * n + j - 1]) && !seen.insert(p[b * n + j]).second)
          throw InputError(fmt::format(
              "attention: {} row {}: segment {} appears in two runs; each packed document must be "
              "one contiguous run of its row",
              name, b, p[b * n + j]));
    }
  }
  // per-token tensors of q's dtype with an exact shape
  // (key sides: contiguous below, unless read in place)
  const auto per_token = [&](const torch::Tensor& t, std::vector<int64_t> shape, const char* name,
                             bool key_side = false) {
    if (!t.defined()) return t;
    if (t.sizes() != torch::IntArrayRef(shape))
      throw InputError(fmt::format("attention: {} must be [{}], got {}", name,
                                   fmt::join(shape, ", "), shape_of(t)));
    if (!op_util::goes_with(t.scalar_type(), q.scalar_type()))
      throw InputError(
          fmt::format("attention: {} must have q's dtype (or float32 beside half q)", name));
    return key_side && !op_util::is_half(t.scalar_type()) ? t : computed(t);
  };
  o.bias[kGq] = per_token(in[kGq], {B, Hq, Tq}, "gq");
  o.bias[kGk] = per_token(in[kGk], {B, Hq, Tk}, "gk", true);
  const auto tpq = in[kPathQ], tpk = in[kPathK], tpb = in[kPathBeta];
  if (tpq.defined() != tpk.defined() || tpq.defined() != tpb.defined())
    throw InputError("attention: the path integral needs path_q, path_k and path_beta together");
  if (tpq.defined()) {
    const int64_t P = tpq.dim() == 4 ? tpq.size(3) : 0;
    if (P < 1)
      throw InputError(fmt::format("attention: path_q must be [{}, {}, {}, P], got {}", B, Hq, Tq,
                                   shape_of(tpq)));
    o.bias[kPathQ] = per_token(tpq, {B, Hq, Tq, P}, "path_q");
    o.bias[kPathK] = per_token(tpk, {B, Hq, Tk, P}, "path_k", true);
    o.bias[kPathBeta] = per_token(tpb, {Hq}, "path_beta");
    if (!std::isfinite(path_scale)) throw InputError("attention: path_scale must be finite");
    o.path_scale = path_scale;
  }
  // the key sides of per-token biases (ck, gk, path_k): in place when they all are the used
  // prefix of one decode cache layout (the forward), as the keys; else contiguous
  int64_t key_rows = -1;
  for (int slot : {kCk, kGk, kPathK})
    if (const torch::Tensor& t = o.bias[slot]; t.defined()) {
      const int64_t r = in_place ? prefix_rows(t) : 0;
      key_rows = key_rows < 0 || key_rows == r ? r : 0;
    }
  o.key_rows = std::max<int64_t>(key_rows, 0);
  if (o.key_rows == 0)
    for (int slot : {kCk, kGk, kPathK})
      if (o.bias[slot].defined()) o.bias[slot] = o.bias[slot].contiguous();
  return o;
}

// ---- CPU ---------------------------------------------------------------------------------------

std::tuple<torch::Tensor, torch::Tensor> fused_attention_cpu(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const BiasList& biases,
    const OptTensor& q_pos, const OptTensor& k_pos, bool causal, double window,
    const OptTensor& key_len, double scale, bool exclude_self, double path_scale,
    const OptTensor& key_start, const OptTensor& q_segments, const OptTensor& k_segments) {
  return value_errors([&] {
    const CallOptions c{causal, window, scale, exclude_self, path_scale};
    const auto o = prepare(q, k, v, q_pos, k_pos, {key_len, key_start, q_segments, k_segments},
                           biases, c, /*in_place=*/true);
    kernels::AttentionDims d = o.dims;
    // lse stays in the compute dtype: the backward and merges of partial results need it exact
    auto out = token_major_output(d.B, d.Hq, d.Tq, d.D, o.q.options());
    d.out_strides = rows_in_place(out).second;
    auto lse = torch::empty({d.B, d.Hq, d.Tq}, o.q.options().dtype(compute_type(q.scalar_type())));
    if (out.numel() == 0) return std::make_tuple(stored(out, q.scalar_type()), lse);
    if (d.Tk == 0) {  // no key at all: every row is empty
      out.zero_();
      lse.fill_(-std::numeric_limits<double>::infinity());
      return std::make_tuple(stored(out, q.scalar_type()), lse);
    }
    if (op_util::is_half(q.scalar_type())) {
      kernels::attention_forward_half(d, half_type(q), words(o.q), words(o.k), words(o.v),
                                      o.positions(), o.kernel_bias<float>(), o.options(c),
                                      mwords(out), lse.data_ptr<float>());
      return std::make_tuple(out, lse);
    }
    AT_DISPATCH_FLOATING_TYPES(o.q.scalar_type(), "relpos_fused_attention", [&] {
      kernels::attention_forward<scalar_t>(d, o.q.data_ptr<scalar_t>(), o.k.data_ptr<scalar_t>(),
                                           o.v.data_ptr<scalar_t>(), o.positions(),
                                           o.kernel_bias<scalar_t>(), o.options(c),
                                           out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
    });
    return std::make_tuple(stored(out, q.scalar_type()), lse);
  });
}

// output_mask: q, k, v, then the bias slots
constexpr size_t kGrads = 3 + kSlots;
static_assert(kGrads == 12, "the output_mask of the fused_attention_backward schema");
using Grads = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>>;

Grads fused_attention_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& q,
                                   const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& out_in, const torch::Tensor& lse_in,
                                   const BiasList& biases, const OptTensor& q_pos,
                                   const OptTensor& k_pos, bool causal, double window,
                                   const OptTensor& key_len, double scale, bool exclude_self,
                                   double path_scale, const OptTensor& key_start,
                                   const OptTensor& q_segments, const OptTensor& k_segments,
                                   std::array<bool, kGrads> mask, const OptTensor& grad_lse) {
  return value_errors([&] {
    const CallOptions c{causal, window, scale, exclude_self, path_scale};
    const auto o =
        prepare(q, k, v, q_pos, k_pos, {key_len, key_start, q_segments, k_segments}, biases, c);
    kernels::AttentionDims d = o.dims;
    const bool half = op_util::is_half(q.scalar_type());
    // out and dout in q's storage (half: as stored, read by the kernel tile by tile), their rows
    // read where they lie
    const auto stored_as_q = [&](const torch::Tensor& t, kernels::RowStrides& strides) {
      torch::Tensor x;
      std::tie(x, strides) = rows_in_place(half ? t.to(q.scalar_type())
                                           : op_util::is_half(t.scalar_type()) ? t.to(torch::kFloat)
                                                                               : t);
      return x;
    };
    const auto out = stored_as_q(out_in, d.out_strides), lse = lse_in.contiguous();
    const auto dout =
        stored_as_q(grad_out.defined() ? grad_out : torch::zeros_like(out_in), d.dout_strides);
    // lse is differentiable: its gradient (when lse was used) enters the kernel's Delta
    const auto dlse = grad_lse && grad_lse->defined() ? computed(*grad_lse) : torch::Tensor();
    if (dout.sizes() != out.sizes() || lse.sizes() != torch::IntArrayRef({d.B, d.Hq, d.Tq}) ||
        lse.scalar_type() != compute_type(q.scalar_type()) ||
        out.scalar_type() != o.q.scalar_type() || dout.scalar_type() != o.q.scalar_type() ||
        (dlse.defined() &&
         (dlse.sizes() != lse.sizes() || dlse.scalar_type() != lse.scalar_type())))
      throw InputError("attention backward: grad_out, out, lse or grad_lse does not match q");
    // every output is a tensor (the schema has no optional outputs): absent or unrequested ones
    // are empty; the bias gradients are accumulated by the kernel, so they start at zero
    // (in the compute dtype, as the bias gradients are computed)
    const auto empty = [&] {
      return torch::empty({0}, o.q.options().dtype(compute_type(q.scalar_type())));
    };
    auto dq = mask[0] ? output_like(o.q) : empty(), dk = mask[1] ? output_like(o.k) : empty(),
         dv = !mask[2] ? empty()
              : o.dims.v_strides.contiguous()
                  ? output_like(o.v)
                  : token_major_output(d.B, d.Hk, d.Tk, d.D, o.v.options());
    d.dv_strides = dv.numel() ? rows_in_place(dv).second : kernels::RowStrides{};
    Biases db;
    for (int i = 0; i < kSlots; ++i)
      db[i] = mask[3 + i] && o.bias[i].defined() ? torch::zeros_like(o.bias[i]) : empty();
    if (d.Tk == 0 || o.q.numel() == 0) {  // no visible key: every gradient is zero
      for (auto* t : {&dq, &dk, &dv}) t->zero_();
    } else if (half) {
      kernels::attention_backward_half(d, half_type(q), words(o.q), words(o.k), words(o.v),
                                       o.positions(), o.kernel_bias<float>(), o.options(c),
                                       words(dout), words(out), lse.data_ptr<float>(), mwords(dq),
                                       mwords(dk), mwords(dv), Operands::kernel_grads<float>(db),
                                       dlse.defined() ? dlse.data_ptr<float>() : nullptr);
    } else {
      AT_DISPATCH_FLOATING_TYPES(o.q.scalar_type(), "relpos_fused_attention_backward", [&] {
        kernels::attention_backward<scalar_t>(
            d, o.q.data_ptr<scalar_t>(), o.k.data_ptr<scalar_t>(), o.v.data_ptr<scalar_t>(),
            o.positions(), o.kernel_bias<scalar_t>(), o.options(c), dout.data_ptr<scalar_t>(),
            out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), mptr<scalar_t>(dq),
            mptr<scalar_t>(dk), mptr<scalar_t>(dv), Operands::kernel_grads<scalar_t>(db),
            dlse.defined() ? dlse.data_ptr<scalar_t>() : nullptr);
      });
    }
    // every gradient back in its operand's dtype (the kernel takes the per-token sums in float64
    // and half storage in float32)
    const Biases in = unpack(biases);
    for (int i = 0; i < kSlots; ++i)
      if (db[i].numel()) db[i] = stored(db[i], in[i].scalar_type());
    return Grads{stored(dq, q.scalar_type()), stored(dk, k.scalar_type()),
                 stored(dv, v.scalar_type()), std::vector<torch::Tensor>(db.begin(), db.end())};
  });
}

// ---- Meta (fake): shapes and dtypes only -------------------------------------------------------

std::tuple<torch::Tensor, torch::Tensor> fused_attention_meta(
    const torch::Tensor& q, const torch::Tensor&, const torch::Tensor&, const BiasList&,
    const OptTensor&, const OptTensor&, bool, double, const OptTensor&, double, bool, double,
    const OptTensor&, const OptTensor&, const OptTensor&) {
  return {torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).transpose(1, 2),
          torch::empty({q.size(0), q.size(1), q.size(2)},
                       q.options().dtype(compute_type(q.scalar_type())))};
}

Grads fused_attention_backward_meta(const torch::Tensor&, const torch::Tensor& q,
                                    const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor&, const torch::Tensor&,
                                    const BiasList& biases, const OptTensor&, const OptTensor&,
                                    bool, double, const OptTensor&, double, bool, double,
                                    const OptTensor&, const OptTensor&, const OptTensor&,
                                    std::array<bool, kGrads> mask, const OptTensor&) {
  const auto like = [&](size_t i, const torch::Tensor& t) {
    return mask[i] && t.defined() ? torch::empty_like(t, torch::MemoryFormat::Contiguous)
                                  : torch::empty({0}, q.options());
  };
  const Biases in = unpack(biases);
  std::vector<torch::Tensor> db;
  for (int i = 0; i < kSlots; ++i) db.push_back(like(3 + i, in[i]));
  auto dv = like(2, v);
  if (mask[2] && strided_rows(v))  // as the CPU op: token-major beside a strided v
    dv = torch::empty({v.size(0), v.size(2), v.size(1), v.size(3)}, v.options()).transpose(1, 2);
  return Grads{like(0, q), like(1, k), dv, db};
}

// ---- Autograd: the backward is the fused_attention_backward op ---------------------------------

std::tuple<torch::Tensor, torch::Tensor> call_fused_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const BiasList& biases,
    const OptTensor& q_pos, const OptTensor& k_pos, const Masks& m, const CallOptions& c) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("relpos::fused_attention", "")
                             .typed<decltype(fused_attention_cpu)>();
  return op.call(q, k, v, biases, q_pos, k_pos, c.causal, c.window, m.key_len, c.scale,
                 c.exclude_self, c.path_scale, m.key_start, m.q_segments, m.k_segments);
}

// The call's arguments that are not differentiable: which slot each present bias fills, the
// positions, masks and options.
struct NonDifferentiable {
  std::vector<int> slots;
  torch::Tensor q_pos, k_pos;
  Masks masks;
  CallOptions options;
};

class FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
 public:
  // inputs: q, k, v, the present biases (variables, in slot order), then the rest
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, at::TensorList present,
                               const NonDifferentiable& n) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Biases b;
    for (size_t i = 0; i < present.size(); ++i) b[n.slots[i]] = present[i];
    auto [out, lse] =
        call_fused_attention(q, k, v, pack(b), opt(n.q_pos), opt(n.k_pos), n.masks, n.options);
    std::vector<torch::Tensor> saved{q, k, v, out, lse};
    saved.insert(saved.end(), present.begin(), present.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["slots"] = std::vector<int64_t>(n.slots.begin(), n.slots.end());
    ctx->saved_data["q_pos"] = n.q_pos;
    ctx->saved_data["k_pos"] = n.k_pos;
    ctx->saved_data["key_len"] = n.masks.key_len;
    ctx->saved_data["key_start"] = n.masks.key_start;
    ctx->saved_data["q_segments"] = n.masks.q_segments;
    ctx->saved_data["k_segments"] = n.masks.k_segments;
    ctx->saved_data["causal"] = n.options.causal;
    ctx->saved_data["window"] = n.options.window;
    ctx->saved_data["scale"] = n.options.scale;
    ctx->saved_data["exclude_self"] = n.options.exclude_self;
    ctx->saved_data["path_scale"] = n.options.path_scale;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    const auto slots = ctx->saved_data["slots"].toIntVector();
    const auto& sd = ctx->saved_data;
    const CallOptions c{sd.at("causal").toBool(), sd.at("window").toDouble(),
                        sd.at("scale").toDouble(), sd.at("exclude_self").toBool(),
                        sd.at("path_scale").toDouble()};
    const auto tensor = [&](const char* key) { return sd.at(key).toOptional<torch::Tensor>(); };
    // edges: q, k, v, then the present biases
    std::array<bool, kGrads> mask{};
    for (int i = 0; i < 3; ++i) mask[i] = ctx->needs_input_grad(i);
    Biases b;
    for (size_t i = 0; i < slots.size(); ++i) {
      b[slots[i]] = s[5 + i];
      mask[3 + slots[i]] = ctx->needs_input_grad(3 + i);
    }
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("relpos::fused_attention_backward", "")
                               .typed<decltype(fused_attention_backward_cpu)>();
    auto [dq, dk, dv, db] = op.call(
        grad_out[0], s[0], s[1], s[2], s[3], s[4], pack(b), tensor("q_pos"), tensor("k_pos"),
        c.causal, c.window, tensor("key_len"), c.scale, c.exclude_self, c.path_scale,
        tensor("key_start"), tensor("q_segments"), tensor("k_segments"), mask,
        grad_out.size() > 1 && grad_out[1].defined() ? OptTensor(grad_out[1]) : OptTensor());
    const auto keep = [&](size_t i, torch::Tensor t) { return mask[i] ? t : torch::Tensor(); };
    variable_list grads{keep(0, dq), keep(1, dk), keep(2, dv)};
    for (int64_t slot : slots) grads.push_back(keep(3 + slot, db[slot]));
    grads.emplace_back();  // the non-differentiable arguments
    return grads;
  }
};

std::tuple<torch::Tensor, torch::Tensor> fused_attention_autograd(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const BiasList& biases,
    const OptTensor& q_pos, const OptTensor& k_pos, bool causal, double window,
    const OptTensor& key_len, double scale, bool exclude_self, double path_scale,
    const OptTensor& key_start, const OptTensor& q_segments, const OptTensor& k_segments) {
  // without a gradient to record (inference, a decode step) the kernel is called directly: the
  // autograd node's saved arguments cost a few microseconds a call
  bool grad = false;
  if (torch::GradMode::is_enabled()) {
    grad = q.requires_grad() || k.requires_grad() || v.requires_grad();
    for (const OptTensor t : biases)
      if (t && t->defined() && t->requires_grad()) grad = true;
  }
  if (!grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_fused_attention(q, k, v, biases, q_pos, k_pos,
                                {key_len, key_start, q_segments, k_segments},
                                {causal, window, scale, exclude_self, path_scale});
  }
  const Biases b = value_errors([&] { return unpack(biases); });
  NonDifferentiable n{{},
                      get(q_pos),
                      get(k_pos),
                      {key_len, key_start, q_segments, k_segments},
                      {causal, window, scale, exclude_self, path_scale}};
  std::vector<torch::Tensor> present;
  for (int i = 0; i < kSlots; ++i)
    if (b[i].defined()) {
      n.slots.push_back(i);
      present.push_back(b[i]);
    }
  auto r = FusedAttentionFunction::apply(q, k, v, at::TensorList(present), n);
  return {r[0], r[1]};
}

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

namespace {
Biases biases_of(const AttentionArgs& a) {
  Biases b;
  b[kLagTable] = a.lag_table;
  b[kSlopes] = a.slopes;
  b[kCq] = a.cq;
  b[kCk] = a.ck;
  b[kGq] = a.gq;
  b[kGk] = a.gk;
  b[kPathQ] = a.path_q;
  b[kPathK] = a.path_k;
  b[kPathBeta] = a.path_beta;
  return b;
}
}  // namespace

std::vector<torch::Tensor> fused_attention(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, const AttentionArgs& a) {
  const Biases b = biases_of(a);
  const auto st = a.kernel_storage;
  const bool rounded = st && op_util::is_half(*st) && q.scalar_type() == torch::kFloat;
  const auto operand = [&](const torch::Tensor& t) { return rounded ? t.to(*st) : t; };
  auto [out, lse] = call_fused_attention(
      operand(q), operand(k), operand(v), pack(b), opt(a.q_positions), opt(a.k_positions),
      {opt(a.key_len), opt(a.key_start), opt(a.q_segments), opt(a.k_segments)},
      {a.causal, a.window, a.scale, a.exclude_self, a.path_scale});
  return {rounded ? out.to(torch::kFloat) : out, lse};
}

std::vector<torch::Tensor> fused_attention_cpu_forward(const torch::Tensor& q,
                                                       const torch::Tensor& k,
                                                       const torch::Tensor& v,
                                                       const AttentionArgs& a) {
  if (!q.is_cpu() || a.kernel_storage)
    throw InputError("fused_attention_cpu_forward: CPU operands as they are (no kernel_storage)");
  auto [out, lse] =
      fused_attention_cpu(q, k, v, pack(biases_of(a)), opt(a.q_positions), opt(a.k_positions),
                          a.causal, a.window, opt(a.key_len), a.scale, a.exclude_self, a.path_scale,
                          opt(a.key_start), opt(a.q_segments), opt(a.k_segments));
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
  const TransformTerm* frames = journey_term(m);
  if (frames && q.numel() && k.numel()) {
    // frames per token: q and k (and v) rotated by their own frames, the output back below
    const auto dt = q.scalar_type();
    const auto k_angles = frame_angles(*frames, kpos, args.k_frame, dt, "k_frame");
    const bool same =
        !args.q_frame.defined() && (frames->time == TimeSource::ContentPhase || qpos.is_same(kpos));
    const auto q_angles =
        same ? k_angles : frame_angles(*frames, qpos, args.q_frame, dt, "q_frame");
    if (q_angles.size(-2) != Tq)
      throw InputError(fmt::format("attention: the query frame has {} positions, q has {}",
                                   q_angles.size(-2), Tq));
    const Frame k_frame = Frame::of(k_angles);
    q_frame = same ? k_frame : Frame::of(q_angles);
    const Layout layout = enc.plan().layout;
    qt = rotate_pairs(q, q_frame, false, layout);
    kt = rotate_pairs(k, k_frame, false, layout);
    if (frames->roles.values) vt = rotate_pairs(v, k_frame, false, layout);
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
  if (m.slope_bias()) {  // slopes per query head
    const auto t = torch::tensor(slopes_for_heads(m, Hq), torch::kDouble)
                       .to(op_util::compute_type(q.scalar_type()));
    a.slopes = a.slopes.defined() ? a.slopes + t : t;
  }
  if (enc.has_lag_table() && q.numel() && k.numel()) {
    // the learned table over every lag of the call (its gradient flows to its parameters)
    if (Hq != enc.bias_heads())
      throw InputError(fmt::format(
          "attention: mechanism '{}' has a learned lag table of {} rows, one per query head; q "
          "has {} heads (an encoding for {} key/value heads takes bias_heads = its query heads)",
          m.spec, enc.bias_heads(), Hq, Hk));
    if (args.lag_table.defined())
      throw InputError(
          "attention: an explicit lag_table together with the mechanism's own "
          "learned table is not supported; add them into one table");
    // bounded as kernels::attention_bias_of: longer lags use the last entry (the kernel's clamp)
    const double span = (qpos.max() - kpos.min()).item<double>();
    a.lag_table = enc.lag_table(kernels::lag_table_length(m, span))
                      .to(op_util::compute_type(q.scalar_type()));
  }
  auto out = fused_attention(qt, kt, vt, a)[0];
  if (frames && frames->roles.outputs && q_frame.defined())
    out = rotate_pairs(out, q_frame, true, enc.plan().layout);
  return out;
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::string& spec, const AttentionArgs& args, Layout layout) {
  if (!k.defined() || k.dim() != 4 || !q.defined() || q.dim() != 4)
    throw InputError("attention: q and k must be [B, H, T, D]");
  // a learned lag table: one row per query head
  PositionEncoding enc(spec, k.size(3), k.size(1), EncodingOptions{layout, true, q.size(1)});
  if (const BiasTerm* b = enc->mechanism().learned_lag_bias()) {
    // a spec string names fixed parameters: the learned table's initial values of the core
    // kernel (seeded), not a runtime's fresh torch draw per call (which made two calls differ)
    const auto init = initial_lag_values(*b->learned, static_cast<int>(enc->bias_heads()));
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
  if (a.key_start.defined())
    visible =
        visible & (torch::arange(Tk).view({1, Tk}) >= a.key_start.view({B, 1}).to(torch::kLong))
                      .view({B, 1, 1, Tk});
  if (a.q_segments.defined())
    visible = visible & (a.q_segments.view({B, 1, Tq, 1}) == a.k_segments.view({B, 1, 1, Tk}));
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
      "fused_attention(Tensor q, Tensor k, Tensor v, Tensor?[] biases, "
      "Tensor? q_positions=None, Tensor? k_positions=None, bool causal=True, float window=0., "
      "Tensor? key_len=None, float scale=0., bool exclude_self=False, float path_scale=1., "
      "Tensor? key_start=None, Tensor? q_segments=None, Tensor? k_segments=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "fused_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor?[] biases, Tensor? q_positions, Tensor? k_positions, bool causal, "
      "float window, Tensor? key_len, float scale, bool exclude_self, float path_scale, "
      "Tensor? key_start, Tensor? q_segments, Tensor? k_segments, bool[12] output_mask, Tensor? "
      "grad_lse=None) -> (Tensor, Tensor, Tensor, Tensor[])");
  m.def("kernel_isa() -> str", [] { return std::string(relpos::kernels::kernel_isa()); });
  m.def("attention_bias_slots() -> str[]", [] {
    return std::vector<std::string>(relpos::nn::kSlotNames.begin(), relpos::nn::kSlotNames.end());
  });
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
