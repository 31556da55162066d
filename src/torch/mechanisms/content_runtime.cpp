#include "torch/mechanisms/content_runtime.hpp"

#include <fmt/format.h>

#include <map>
#include <stdexcept>
#include <string>

#include "core/types.hpp"

namespace relpos::nn {

const ContentRuntime& content_runtime(const BiasTerm& t) {
  static const std::map<std::string, ContentRuntime> runtimes = {
#define RELPOS_LAG_RUNTIME(NAME)
#define RELPOS_CONTENT_RUNTIME(NAME) {#NAME, NAME##_content_runtime()},
#include "torch/mechanisms/list.inc"
#undef RELPOS_CONTENT_RUNTIME
#undef RELPOS_LAG_RUNTIME
  };
  const auto it = runtimes.find(t.name);
  if (it == runtimes.end() || !it->second.prepare)
    throw std::logic_error(fmt::format(
        "{}: a content-dependent bias without a torch runtime (torch/mechanisms/list.inc)",
        t.name));
  return it->second;
}

std::vector<torch::Tensor> content_side(const BiasTerm& t, const std::vector<torch::Tensor>& params,
                                        const ContentCall& c, AttentionArgs& a) {
  const ContentRuntime& r = content_runtime(t);
  const auto names = r.names(t);
  if (params.size() != names.size())
    throw InputError(fmt::format("{}: {} parameter tensors given, the term has {} ({})", t.name,
                                 params.size(), names.size(), fmt::join(names, ", ")));
  const auto& x = c.inputs;
  if (!r.reads_inputs) return r.prepare(t, params, c, a);
  if (!x.defined())
    throw InputError(fmt::format(
        "'{}' computes its bias from the tokens: pass inputs= (the layer's hidden states "
        "[B, T, model_dim])",
        t.name));
  if (x.dim() != 3 || x.size(0) != c.q.size(0) || x.size(1) != c.q.size(2))
    throw InputError(fmt::format("{}: inputs must be [B, T, model_dim] = [{}, {}, model_dim], got [{}]",
                                 t.name, c.q.size(0), c.q.size(2), fmt::join(x.sizes(), ", ")));
  if (x.scalar_type() != c.q.scalar_type())
    throw InputError(fmt::format("{}: inputs must have q's dtype ({}), got {}", t.name,
                                 c10::toString(c.q.scalar_type()),
                                 c10::toString(x.scalar_type())));
  return r.prepare(t, params, c, a);
}

}  // namespace relpos::nn
