// The content-dependent bias operators of TORCH_LIBRARY(relpos), for the Python Attention: the
// same runtime as nn::Attention (torch/mechanisms/content_runtime.hpp), so both languages create
// the same parameters (names, shapes, torch's generator draws in one order) and compute the same
// kernel arguments. Generic: the spec string picks the term and its runtime.
//   content_params   JSON {"names": [...], "reads_inputs": bool}, or "" without a content bias
//   content_initial  the parameters' initial tensors (the C++ module's, drawn in its order)
//   content_bias     [gq, cq, path_q, path_beta, path_scale (a 0-dim float64 tensor), new keys'
//                    side tensors...] for the call's tokens (absent entries: None);
//                    CompositeImplicitAutograd, so autograd runs through the runtime's ops
//   content_keys     [gk, ck, path_k] from the side tensors of every key the call scores
// and likewise for a rotation with learned frequencies (GRAPE-M): `rotation_params`,
// `rotation_initial`, `rotate_learned` (per-token phases scanned from each row's first valid token
// and each packed document's first: key_start, segments, a cache's lengths; returns [q, k, phase
// after the last token or None, frames of values and outputs or None]), and `attention_refusal`:
// why relpos.Attention cannot run a mechanism ("" when it can); `cpp_attention_module`: the C++
// nn::Attention on one call, for the parity tests.
#include <fmt/format.h>
#include <torch/library.h>
#include <torch/torch.h>

#include "core/registry.hpp"
#include "torch/attention_module.hpp"
#include "torch/mechanisms/content_runtime.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

Mechanism content_mechanism(const std::string& spec, int64_t head_dim, int64_t heads) {
  if (head_dim <= 0 || head_dim > kMaxHeadDim || heads <= 0 || heads > kMaxHeads)
    throw InputError(fmt::format("head dim {} / heads {} out of range", head_dim, heads));
  return build_mechanism(spec, static_cast<int>(head_dim), static_cast<int>(heads));
}

const BiasTerm& content_term(const Mechanism& m) {
  const BiasTerm* b = m.content_bias();
  if (!b) throw InputError(fmt::format("'{}' has no content-dependent bias", m.spec));
  return *b;
}

std::string content_params_op(const std::string& spec, int64_t head_dim, int64_t heads) {
  return op_util::value_errors([&] {
    const Mechanism m = content_mechanism(spec, head_dim, heads);
    const BiasTerm* b = m.content_bias();
    if (!b) return std::string();
    const ContentRuntime& r = content_runtime(*b);
    std::vector<std::string> quoted;
    for (const auto& n : r.names(*b)) quoted.push_back(fmt::format("\"{}\"", n));
    return fmt::format("{{\"names\": [{}], \"reads_inputs\": {}}}", fmt::join(quoted, ", "),
                       r.reads_inputs);
  });
}

std::vector<torch::Tensor> content_initial_op(const std::string& spec, int64_t head_dim,
                                              int64_t heads, int64_t model_dim) {
  return op_util::value_errors([&] {
    const Mechanism m = content_mechanism(spec, head_dim, heads);
    const BiasTerm& b = content_term(m);
    torch::nn::Module owner;
    std::vector<torch::Tensor> out;
    for (const auto& t : content_runtime(b).create(b, owner, model_dim, heads, head_dim))
      out.push_back(t.detach());
    return out;
  });
}

std::vector<torch::Tensor> content_bias_op(const std::string& spec, int64_t head_dim, int64_t heads,
                                           at::TensorList params,
                                           const std::optional<torch::Tensor>& inputs,
                                           const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& positions, at::TensorList past,
                                           const std::optional<torch::Tensor>& past_lengths) {
  return op_util::value_errors([&] {
    const Mechanism m = content_mechanism(spec, head_dim, heads);
    const BiasTerm& b = content_term(m);
    if (q.dim() != 4 || k.dim() != 4 || q.size(1) != heads || q.size(3) != head_dim ||
        k.size(0) != q.size(0) || k.size(2) != q.size(2) || k.size(3) != head_dim ||
        k.size(1) < 1 || heads % k.size(1))
      throw InputError(fmt::format(
          "content_bias: q must be [B, {}, T, {}] and k [B, Hk, T, {}] with Hk dividing {}", heads,
          head_dim, head_dim, heads));
    ContentCall c{inputs.value_or(torch::Tensor()),      q, k, positions, past.vec(),
                  past_lengths.value_or(torch::Tensor())};
    AttentionArgs a;
    const auto side = content_side(b, params.vec(), c, a);
    std::vector<torch::Tensor> out{a.gq, a.cq, a.path_q, a.path_beta,
                                   torch::tensor(a.path_scale, torch::kDouble)};
    out.insert(out.end(), side.begin(), side.end());
    return out;
  });
}

std::vector<torch::Tensor> content_keys_op(const std::string& spec, int64_t head_dim, int64_t heads,
                                           at::TensorList keys) {
  return op_util::value_errors([&] {
    const Mechanism m = content_mechanism(spec, head_dim, heads);
    const BiasTerm& b = content_term(m);
    AttentionArgs a;
    content_runtime(b).attach(keys.vec(), a);
    return std::vector<torch::Tensor>{a.gk, a.ck, a.path_k};
  });
}

const TransformTerm& rotation_term(const Mechanism& m) {
  for (const auto& t : m.transforms)
    if (rotation_runtime(t)) return t;
  throw InputError(fmt::format("'{}' has no transform with learned frequencies", m.spec));
}

std::string rotation_params_op(const std::string& spec, int64_t head_dim, int64_t heads) {
  return op_util::value_errors([&] {
    const Mechanism m = content_mechanism(spec, head_dim, heads);
    for (const auto& t : m.transforms)
      if (const RotationRuntime* r = rotation_runtime(t)) {
        std::vector<std::string> quoted;
        for (const auto& n : r->names(t)) quoted.push_back(fmt::format("\"{}\"", n));
        return fmt::format("{{\"names\": [{}], \"reads_inputs\": {}}}", fmt::join(quoted, ", "),
                           t.time == TimeSource::ContentPhase);
      }
    return std::string();
  });
}

std::vector<torch::Tensor> rotation_initial_op(const std::string& spec, int64_t head_dim,
                                               int64_t heads, int64_t model_dim) {
  return op_util::value_errors([&] {
    const Mechanism m = content_mechanism(spec, head_dim, heads);
    const TransformTerm& t = rotation_term(m);
    torch::nn::Module owner;
    std::vector<torch::Tensor> out;
    for (const auto& p : rotation_runtime(t)->create(t, owner, model_dim, heads, head_dim))
      out.push_back(p.detach());
    return out;
  });
}

std::vector<torch::Tensor> rotate_learned_op(
    const std::string& spec, int64_t head_dim, int64_t heads, at::TensorList params,
    const std::optional<torch::Tensor>& inputs, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& positions, const std::optional<torch::Tensor>& phase, int64_t layout,
    const std::optional<torch::Tensor>& key_start, const std::optional<torch::Tensor>& segments,
    const std::optional<torch::Tensor>& lengths) {
  return op_util::value_errors([&] {
    const Mechanism m = content_mechanism(spec, head_dim, heads);
    if (q.dim() != 4 || k.dim() != 4 || q.size(3) != head_dim || k.size(3) != head_dim)
      throw InputError(fmt::format("rotate_learned: q and k must be [B, H, T, {}]", head_dim));
    const auto opt = [](const std::optional<torch::Tensor>& t) {
      return t.value_or(torch::Tensor());
    };
    const Rotated r = rotate_learned(
        rotation_term(m), params.vec(),
        {opt(inputs), q, k, positions, opt(phase),
         layout == 1 ? Layout::HalfSplit : Layout::Interleaved,
         scan_starts(opt(key_start), opt(segments), opt(lengths), q.size(0), q.size(2))});
    return std::vector<torch::Tensor>{r.q, r.k, r.phase_end, r.frames};
  });
}

// The C++ module on one call (tests: the Python module must give the same outputs and parameter
// names): nn::Attention created after torch::manual_seed(seed), in q's dtype, run on q, k, v
// (inputs) without a cache (chunks empty) or through a DecodeCache in `chunks` tokens per call;
// returns the output, the parameter names (comma-separated) and their values.
std::tuple<torch::Tensor, std::string, std::vector<torch::Tensor>> cpp_attention_module_op(
    const std::string& spec, int64_t head_dim, int64_t num_heads, int64_t num_kv_heads,
    int64_t layout, int64_t model_dim, int64_t seed, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& v, const std::optional<torch::Tensor>& inputs, at::IntArrayRef chunks,
    const std::optional<torch::Tensor>& positions, const std::string& backend) {
  return op_util::value_errors([&] {
    torch::manual_seed(static_cast<uint64_t>(seed));
    Attention a(spec, head_dim, num_heads,
                AttentionOptions{.num_kv_heads = num_kv_heads,
                                 .layout = layout == 1 ? Layout::HalfSplit : Layout::Interleaved,
                                 .model_dim = model_dim,
                                 .backend = backend});
    a->to(q.scalar_type());
    std::vector<std::string> names;
    std::vector<torch::Tensor> values;
    for (const auto& p : a->named_parameters()) {
      names.push_back(p.key());
      values.push_back(p.value().detach().clone());
    }
    const torch::Tensor x = inputs.value_or(torch::Tensor()),
                        p = positions.value_or(torch::Tensor());
    torch::Tensor out;
    if (chunks.empty()) {
      out = a->forward(q, k, v, {.positions = p, .inputs = x});
    } else {
      const torch::NoGradGuard no_grad;  // (a cache is for inference)
      DecodeCache cache(q.size(0), k.size(1), k.size(3), q.scalar_type(), 1);
      std::vector<torch::Tensor> outs;
      int64_t t = 0;
      for (int64_t n : chunks) {
        outs.push_back(a->forward(q.narrow(2, t, n), k.narrow(2, t, n), v.narrow(2, t, n),
                                  {.positions = p.defined() ? p.narrow(1, t, n) : p,
                                   .inputs = x.defined() ? x.narrow(1, t, n) : x,
                                   .cache = &cache}));
        t += n;
      }
      out = torch::cat(outs, 2);
    }
    return std::tuple<torch::Tensor, std::string, std::vector<torch::Tensor>>{
        out.detach(), fmt::format("{}", fmt::join(names, ",")), values};
  });
}

std::string attention_refusal_op(const std::string& spec, int64_t head_dim, int64_t kv_heads) {
  return op_util::value_errors([&] {
    return attention_refusal(content_mechanism(spec, head_dim, kv_heads)).value_or(std::string());
  });
}

std::string favor_refusal_op(const std::string& spec, int64_t head_dim, int64_t heads) {
  return op_util::value_errors([&] {
    return favor_refusal(content_mechanism(spec, head_dim, heads)).value_or(std::string());
  });
}

}  // namespace

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def("content_params(str spec, int head_dim, int heads) -> str", relpos::nn::content_params_op);
  m.def("content_initial(str spec, int head_dim, int heads, int model_dim) -> Tensor[]",
        relpos::nn::content_initial_op);
  m.def(
      "content_bias(str spec, int head_dim, int heads, Tensor[] params, Tensor? inputs, Tensor q, "
      "Tensor k, Tensor positions, Tensor[] past, Tensor? past_lengths) -> Tensor[]");
  m.def("content_keys(str spec, int head_dim, int heads, Tensor[] keys) -> Tensor[]");
  m.def("rotation_params(str spec, int head_dim, int heads) -> str",
        relpos::nn::rotation_params_op);
  m.def("rotation_initial(str spec, int head_dim, int heads, int model_dim) -> Tensor[]",
        relpos::nn::rotation_initial_op);
  m.def(
      "rotate_learned(str spec, int head_dim, int heads, Tensor[] params, Tensor? inputs, "
      "Tensor q, Tensor k, Tensor positions, Tensor? phase, int layout, Tensor? key_start=None, "
      "Tensor? segments=None, Tensor? lengths=None) -> Tensor[]");
  m.def(
      "cpp_attention_module(str spec, int head_dim, int num_heads, int num_kv_heads, int layout, "
      "int model_dim, int seed, Tensor q, Tensor k, Tensor v, Tensor? inputs, int[] chunks, "
      "Tensor? positions=None, str backend=\"softmax\") -> (Tensor, str, Tensor[])",
      relpos::nn::cpp_attention_module_op);
  m.def("favor_refusal(str spec, int head_dim, int heads) -> str", relpos::nn::favor_refusal_op);
  m.def("attention_refusal(str spec, int head_dim, int kv_heads) -> str",
        relpos::nn::attention_refusal_op);
}

TORCH_LIBRARY_IMPL(relpos, CompositeImplicitAutograd, m) {
  m.impl("content_bias", relpos::nn::content_bias_op);
  m.impl("content_keys", relpos::nn::content_keys_op);
  m.impl("rotate_learned", relpos::nn::rotate_learned_op);
}
