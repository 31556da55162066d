// The decode cache's operators for the Python KVCache (python/relpos/engine.py), so that it runs
// the C++ DecodeCache's bookkeeping (torch/attention_module.hpp), and the modules' finiteness
// check:
//   cache_step(lengths, stored_positions, positions?, key_len?, T) -> (positions, counts)
//       the new tokens' float64 positions [B, T] (given, or each row's continuation) and valid
//       counts [B], checked against each row's last cached position
//   cache_append(keys!, values!, positions!, lengths!, content![], k, v, pos, counts, new[])
//       the new tokens written after each row's length (the caller grows the storage first)
//   nonfinite(Tensor[] tensors) -> int
//       the index of the first tensor holding NaN or Inf, -1 when none does (one pass each)
//   same_values(Tensor[] a, Tensor[] b) -> bool
//       whether a and b hold the same tensors by dtype, shape and bytes (one call for a list: the
//       module's per-step check that cached kernel parameters are still its parameters')
//   StepPlan(spec, head_dim, kv_heads), plan.set_params(schema_values[], kernel_params[4])
//       a Python module's state for its cached steps: its mechanism parsed once, and the kernel
//       parameters with the schema values they were computed from. Its methods run a step in one
//       call; each does nothing and says so when the parameters are not of the schema's present
//       values in q's compute dtype (the caller hands new ones with set_params and calls again):
//   plan.decode(q, k, v, keys!, values!, positions!, lengths!, new_positions?, key_len?,
//               schema[], num_heads, layout, causal, window, scale, check_finite, warned,
//               content_params[], inputs?, content_store![]) -> (out, lse, warned, status)
//       the Python Attention's cached step, for a mechanism of one position term (or none),
//       slope or no biases and a content bias or none, without autograd: the checks, the cache's
//       step, the new tokens' transform (and content side tensors), the append and the kernel
//       over the used prefix. The same steps as AttentionImpl::assembled with a cache (the
//       interpreter's share of a decode step was about as large as the kernel's at 1k keys).
//       status 0: the step ran; 1: stale parameters; 2: a row has no room for the step's tokens
//       (the caller grows the storage); 3: the caller runs the step on its general path
//   plan.transform(q, k, positions, schema[], layout, check_finite, warned)
//                  -> (q', k', warned, stale)
//       a step's few new tokens transformed without autograd (the switched Hugging Face layer's
//       decode step: q [B, Hq, T, D] grouped onto k's heads [B, Hk, T, D], at positions [T] or
//       [B, T]), for a mechanism of one position term; the same kernels and rounding as the
//       encoding's op (its module's checks and op calls cost more than the transform of a
//       one-token step, most of all on caches the layer's other work left cold)
//   transform_step_refusal(spec, head_dim, kv_heads) -> str
//       why StepPlan.transform cannot run the mechanism ("" when it can)
#include <fmt/format.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/registry.hpp"
#include "torch/attention_module.hpp"
#include "torch/finite.hpp"
#include "torch/op_util.hpp"
#include "torch/step_plan.hpp"

namespace relpos::nn {

namespace {

std::tuple<torch::Tensor, torch::Tensor> cache_step_op(
    const torch::Tensor& lengths, const torch::Tensor& stored,
    const c10::optional<torch::Tensor>& positions, const c10::optional<torch::Tensor>& key_len,
    int64_t T) {
  return op_util::value_errors([&] {
    auto s = cache_step(lengths, stored, positions.value_or(torch::Tensor()),
                        key_len.value_or(torch::Tensor()), T);
    return std::make_tuple(s.positions, s.counts);
  });
}

void cache_append_op(const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& positions, const torch::Tensor& lengths,
                     at::TensorList content_store, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& pos, const torch::Tensor& counts,
                     at::TensorList content) {
  op_util::value_errors([&] {
    cache_append(keys, values, positions, lengths, content_store.vec(), k, v, pos, counts,
                 content.vec());
    return 0;
  });
}

bool same_values_op(at::TensorList a, at::TensorList b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const torch::Tensor &x = a[i], &y = b[i];
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes() || x.device() != y.device())
      return false;
    if (x.numel() == 0) continue;  // (an empty tensor's data pointer may be null: no memcmp)
    if (x.is_cpu() && x.is_contiguous() && y.is_contiguous()) {
      if (std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) != 0) return false;
    } else if (!torch::equal(x.detach(), y.detach())) {
      return false;
    }
  }
  return true;
}

int64_t nonfinite_op(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!all_finite(tensors[i])) return static_cast<int64_t>(i);
  return -1;
}

Mechanism step_mechanism(const std::string& spec, int64_t head_dim, int64_t kv_heads) {
  if (head_dim <= 0 || head_dim > kMaxHeadDim || kv_heads <= 0 || kv_heads > kMaxHeads)
    throw InputError(fmt::format("head dim {} / kv heads {} out of range", head_dim, kv_heads));
  return build_mechanism(spec, static_cast<int>(head_dim), static_cast<int>(kv_heads));
}

}  // namespace

StepPlan::StepPlan(std::string spec_in, int64_t head_dim_in, int64_t kv_heads_in)
    : spec(std::move(spec_in)),
      head_dim(head_dim_in),
      kv_heads(kv_heads_in),
      mechanism(op_util::value_errors([&] { return step_mechanism(spec, head_dim, kv_heads); })) {}

bool StepPlan::current(const std::vector<torch::Tensor>& now, c10::ScalarType stored) const {
  if (params.size() != 4 || !same_values_op(now, schema)) return false;
  const auto ct = op_util::compute_type(stored);
  return std::all_of(params.begin(), params.end(),
                     [&](const torch::Tensor& t) { return !t.defined() || t.scalar_type() == ct; });
}

// decode's status: the step ran, or nothing was done (empty outputs: a method returns no
// undefined tensor) and the caller calls again after handing the plan new kernel parameters or
// growing the cache's storage, or runs the step on its general path (a content bias before its
// side tensors exist, in a half cache, or a path integral over rows of different lengths, whose
// refusal the general path words)
namespace {
enum DecodeStatus : int64_t { kDecoded = 0, kStaleParams = 1, kNoRoom = 2, kGeneralPath = 3 };
}  // namespace

std::tuple<torch::Tensor, torch::Tensor, int64_t, int64_t> decode_method(
    const c10::intrusive_ptr<StepPlan>& plan, const torch::Tensor& q_in, const torch::Tensor& k_in,
    const torch::Tensor& v, const torch::Tensor& keys, const torch::Tensor& values,
    const torch::Tensor& positions, const torch::Tensor& lengths,
    const c10::optional<torch::Tensor>& new_positions, const c10::optional<torch::Tensor>& key_len,
    const std::vector<torch::Tensor>& schema, int64_t num_heads, int64_t layout, bool causal,
    double window, double scale, bool check_finite, int64_t warned,
    const std::vector<torch::Tensor>& content_params, const c10::optional<torch::Tensor>& inputs,
    const std::vector<torch::Tensor>& content_store) {
  return op_util::value_errors([&] {
    const auto undone = [&](DecodeStatus why) {
      return std::make_tuple(torch::empty({0}), torch::empty({0}), warned, int64_t{why});
    };
    if (auto why = one_call_decode_refusal(plan->mechanism)) throw InputError(*why);
    if (!plan->current(schema, q_in.scalar_type())) return undone(kStaleParams);
    const torch::NoGradGuard no_grad;
    const int64_t head_dim = plan->head_dim, kv_heads = plan->kv_heads;
    if (num_heads <= 0 || num_heads % kv_heads)
      throw InputError(
          fmt::format("head dim {} / heads {}:{} out of range", head_dim, num_heads, kv_heads));
    for (auto [name, t] : {std::pair{"q", &q_in}, std::pair{"k", &k_in}, std::pair{"v", &v}})
      if (t->dim() != 4 || !t->is_cpu() || t->scalar_type() != keys.scalar_type())
        throw InputError(fmt::format(
            "StepPlan.decode: {} must be a [B, H, T, D] CPU tensor of the cache's dtype ({})", name,
            c10::toString(keys.scalar_type())));
    if (check_finite)
      for (auto [name, t] : {std::pair{"q", &q_in}, std::pair{"k", &k_in}, std::pair{"v", &v}})
        if (!all_finite(*t)) throw InputError(fmt::format("{} contains NaN or Inf", name));
    // room for the step's tokens in every row (the caller grows the storage, then calls again)
    if (lengths.dim() == 1 && lengths.scalar_type() == torch::kLong && lengths.is_contiguous() &&
        lengths.numel() > 0 && keys.dim() == 4) {
      const int64_t* L = lengths.data_ptr<int64_t>();
      if (*std::max_element(L, L + lengths.numel()) + q_in.size(2) > keys.size(2))
        return undone(kNoRoom);
    }
    StepContent content;
    if (plan->mechanism.content_bias()) {
      if (content_store.empty() || op_util::is_half(keys.scalar_type()))
        return undone(kGeneralPath);
      if (!plan->query_heads || plan->query_heads->heads != num_heads)
        plan->query_heads = step_mechanism(plan->spec, head_dim, num_heads);
      content = {plan->query_heads->content_bias(), content_params,
                 inputs.value_or(torch::Tensor())};
      if (content.term->shape == BiasShape::PathIntegral) {
        // the kernel's path runs over key slots: every row ends where the new tokens begin
        const int64_t* L = lengths.data_ptr<int64_t>();
        const int64_t n = lengths.numel(), T = q_in.size(2);
        if (std::any_of(L, L + n, [&](int64_t l) { return l != L[0]; }) ||
            (key_len && !(*key_len == T).all().item<bool>()))
          return undone(kGeneralPath);
      }
    }
    EncodingWarnings w{(warned & 1) != 0, (warned & 2) != 0, (warned & 4) != 0};
    const DecodeStep step{layout ? Layout::HalfSplit : Layout::Interleaved, num_heads, causal,
                          window, scale};
    const auto o = decode_step(plan->mechanism, plan->params, q_in, k_in, v,
                               {keys, values, positions, lengths, content_store},
                               new_positions.value_or(torch::Tensor()),
                               key_len.value_or(torch::Tensor()), step, w, content);
    warned = (w.clamp ? 1 : 0) | (w.resolution ? 2 : 0) | (w.center ? 4 : 0);
    return std::make_tuple(o[0], o[1], warned, int64_t{kDecoded});
  });
}

std::tuple<torch::Tensor, torch::Tensor, int64_t, bool> transform_method(
    const c10::intrusive_ptr<StepPlan>& plan, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& positions, const std::vector<torch::Tensor>& schema, int64_t layout,
    bool check_finite, int64_t warned) {
  return op_util::value_errors([&] {
    const torch::NoGradGuard no_grad;
    const Mechanism& m = plan->mechanism;
    const int64_t head_dim = plan->head_dim, kv_heads = plan->kv_heads;
    if (auto why = step_transform_refusal(m)) throw InputError(*why);
    for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}})
      if (t->dim() != 4 || !t->is_cpu() || !op_util::storable(t->scalar_type()) ||
          t->size(3) != head_dim)
        throw InputError(fmt::format(
            "transform step: {} must be a [B, H, T, {}] CPU tensor of float32, float64, bfloat16 "
            "or float16",
            name, head_dim));
    if (k.size(1) != kv_heads || q.size(1) % kv_heads || q.size(0) != k.size(0) ||
        q.size(2) != k.size(2) || q.scalar_type() != k.scalar_type())
      throw InputError(fmt::format(
          "transform step: q {} and k {} must share batch, tokens and dtype, k with {} heads and "
          "q a multiple of them",
          c10::str(q.sizes()), c10::str(k.sizes()), kv_heads));
    if (!plan->current(schema, q.scalar_type()))
      return std::make_tuple(torch::empty({0}), torch::empty({0}), warned, true);
    if (check_finite)
      for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}})
        if (!all_finite(*t)) throw InputError(fmt::format("{} contains NaN or Inf", name));
    const int64_t B = q.size(0), T = q.size(2);
    auto pos = checked_position_values(positions, B, T);
    if (pos.dim() == 1) pos = B == 1 ? pos.view({1, T}) : pos.expand({B, T}).contiguous();
    EncodingWarnings w{(warned & 1) != 0, (warned & 2) != 0, (warned & 4) != 0};
    auto [qt, kt] = step_transformed(m, plan->params, q, k, pos,
                                     layout ? Layout::HalfSplit : Layout::Interleaved,
                                     q.scalar_type(), w, positions);
    warned = (w.clamp ? 1 : 0) | (w.resolution ? 2 : 0) | (w.center ? 4 : 0);
    return std::make_tuple(qt.contiguous(), kt.contiguous(), warned, false);
  });
}

namespace {

std::string transform_step_refusal_op(const std::string& spec, int64_t head_dim, int64_t kv_heads) {
  return op_util::value_errors([&] {
    return step_transform_refusal(step_mechanism(spec, head_dim, kv_heads)).value_or(std::string());
  });
}

}  // namespace

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def(
      "cache_step(Tensor lengths, Tensor stored_positions, Tensor? positions, Tensor? key_len, "
      "int length) -> (Tensor, Tensor)",
      relpos::nn::cache_step_op);
  m.def(
      "cache_append(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) positions, Tensor(d!) lengths, "
      "Tensor(e!)[] content_store, Tensor k, Tensor v, Tensor pos, Tensor counts, "
      "Tensor[] content) -> ()",
      relpos::nn::cache_append_op);
  m.def("nonfinite(Tensor[] tensors) -> int", relpos::nn::nonfinite_op);
  m.def("same_values(Tensor[] a, Tensor[] b) -> bool", relpos::nn::same_values_op);
  m.class_<relpos::nn::StepPlan>("StepPlan")
      .def(torch::init<std::string, int64_t, int64_t>())
      .def("set_params", &relpos::nn::StepPlan::set_params)
      .def("decode", relpos::nn::decode_method)
      .def("transform", relpos::nn::transform_method)
      .def_pickle(
          [](const c10::intrusive_ptr<relpos::nn::StepPlan>& p) {
            return std::make_tuple(p->spec, p->head_dim, p->kv_heads);
          },
          [](std::tuple<std::string, int64_t, int64_t> state) {
            return c10::make_intrusive<relpos::nn::StepPlan>(std::get<0>(state), std::get<1>(state),
                                                             std::get<2>(state));
          });
  m.def("transform_step_refusal(str spec, int head_dim, int kv_heads) -> str",
        relpos::nn::transform_step_refusal_op);
}
