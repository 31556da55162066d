#include "torch/mechanisms/content_runtime.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/types.hpp"
#include "torch/scan.hpp"

namespace relpos::nn {

const ContentRuntime& content_runtime(const BiasTerm& t) {
  static const std::map<std::string, ContentRuntime> runtimes = {
#define RELPOS_LAG_RUNTIME(NAME)
#define RELPOS_ROTATION_RUNTIME(NAME)
#define RELPOS_CONTENT_RUNTIME(NAME) {#NAME, NAME##_content_runtime()},
#include "torch/mechanisms/list.inc"
#undef RELPOS_CONTENT_RUNTIME
#undef RELPOS_ROTATION_RUNTIME
#undef RELPOS_LAG_RUNTIME
  };
  const auto it = runtimes.find(t.name);
  if (it == runtimes.end() || !it->second.prepare)
    throw std::logic_error(fmt::format(
        "{}: a content-dependent bias without a torch runtime (torch/mechanisms/list.inc)",
        t.name));
  return it->second;
}

const RotationRuntime* rotation_runtime(const TransformTerm& t) {
  static const std::map<std::string, RotationRuntime> runtimes = {
#define RELPOS_LAG_RUNTIME(NAME)
#define RELPOS_CONTENT_RUNTIME(NAME)
#define RELPOS_ROTATION_RUNTIME(NAME) {#NAME, NAME##_rotation_runtime()},
#include "torch/mechanisms/list.inc"
#undef RELPOS_ROTATION_RUNTIME
#undef RELPOS_CONTENT_RUNTIME
#undef RELPOS_LAG_RUNTIME
  };
  const auto it = runtimes.find(t.name);
  return it == runtimes.end() ? nullptr : &it->second;
}

namespace {

// inputs [B, T, model_dim] with B and T of `like` [B, H, T, D] and its dtype
void check_inputs(const std::string& term, const torch::Tensor& x, const torch::Tensor& like) {
  if (!x.defined())
    throw InputError(fmt::format(
        "'{}' computes its terms from the tokens: pass inputs= (the layer's hidden states "
        "[B, T, model_dim])",
        term));
  if (x.dim() != 3 || x.size(0) != like.size(0) || x.size(1) != like.size(2))
    throw InputError(
        fmt::format("{}: inputs must be [B, T, model_dim] = [{}, {}, model_dim], got [{}]", term,
                    like.size(0), like.size(2), fmt::join(x.sizes(), ", ")));
  if (x.scalar_type() != like.scalar_type())
    throw InputError(fmt::format("{}: inputs must have q's dtype ({}), got {}", term,
                                 c10::toString(like.scalar_type()),
                                 c10::toString(x.scalar_type())));
}

void check_count(const std::string& term, size_t given, const std::vector<std::string>& names) {
  if (given != names.size())
    throw InputError(fmt::format("{}: {} parameter tensors given, the term has {} ({})", term,
                                 given, names.size(), fmt::join(names, ", ")));
}

// The call's small host-side tensors (positions, phases, cache lengths) on the device of q, so
// that each runtime computes on one device (a decode cache keeps its bookkeeping on the host).
ContentCall on_device(ContentCall c) {
  const auto dev = c.q.device();
  if (c.positions.defined()) c.positions = c.positions.to(dev);
  if (c.past_lengths.defined()) c.past_lengths = c.past_lengths.to(dev);
  return c;
}
RotationCall on_device(RotationCall c) {
  const auto dev = c.q.device();
  if (c.positions.defined()) c.positions = c.positions.to(dev);
  if (c.phase.defined()) c.phase = c.phase.to(dev);
  return c;
}

}  // namespace

Phases continued_phases(const torch::Tensor& increments, const torch::Tensor& phase0,
                        const torch::Tensor& starts) {
  const int64_t B = increments.size(0), T = increments.size(1);
  const auto p0 = phase0.defined() ? phase0.to(increments.device())
                                   : torch::zeros({B, increments.size(2)},
                                                  increments.options().dtype(torch::kDouble));
  torch::Tensor phi;
  if (!starts.defined()) {
    phi = causal_scan(increments, "exclusive");  // sum_{s<t} a_s
  } else {
    // each run of tokens with one start scanned on its own (a NaN in the padding or in another
    // document stays out; a run of one token, as each padding token is, has phase 0)
    phi = torch::zeros_like(increments);
    const auto st = starts.to(torch::kCPU).contiguous();
    const int64_t* sp = st.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0, e = 1; s < T; s = e++) {
        while (e < T && sp[b * T + e] == sp[b * T + s]) ++e;
        if (e - s > 1)
          phi.narrow(0, b, 1)
              .narrow(1, s, e - s)
              .copy_(causal_scan(increments.narrow(0, b, 1).narrow(1, s, e - s).contiguous(),
                                 "exclusive"));
      }
  }
  return {phi.to(torch::kDouble) + p0.unsqueeze(1),
          (p0 + (phi.select(1, T - 1) + increments.select(1, T - 1)).to(torch::kDouble)).detach()};
}

torch::Tensor scan_starts(const torch::Tensor& key_start, const torch::Tensor& segments,
                          const torch::Tensor& lengths, int64_t B, int64_t T) {
  if (!key_start.defined() && !segments.defined()) return {};
  // (checked as the kernel checks them: it runs after the phases)
  for (const auto& [t, name] : {std::pair{&key_start, "key_start"}, {&segments, "segments"}}) {
    const auto shape = t == &key_start ? std::vector<int64_t>{B} : std::vector<int64_t>{B, T};
    if (t->defined() && (t->sizes() != torch::IntArrayRef(shape) || t->is_floating_point() ||
                         t->is_complex() || t->scalar_type() == torch::kBool))
      throw InputError(fmt::format("attention: {} must be an integer tensor [{}], got [{}]", name,
                                   fmt::join(shape, ", "), fmt::join(t->sizes(), ", ")));
  }
  const auto idx = torch::arange(T, torch::kLong).view({1, T}).expand({B, T});
  auto start = torch::zeros({B, T}, torch::kLong);
  if (segments.defined() && T > 1) {  // a document begins where the id changes
    const auto s = segments.to(torch::kCPU).to(torch::kLong);
    const auto fresh = torch::cat(
        {torch::ones({B, 1}, torch::kBool), s.narrow(1, 1, T - 1) != s.narrow(1, 0, T - 1)}, 1);
    start = std::get<0>(torch::cummax(torch::where(fresh, idx, torch::zeros_like(idx)), 1));
  }
  if (key_start.defined()) {
    // the call's index of its row's first valid token (<= 0: before this call)
    auto first = key_start.to(torch::kCPU).to(torch::kLong).view({B, 1});
    if (lengths.defined()) first = first - lengths.to(torch::kCPU).to(torch::kLong).view({B, 1});
    start = torch::where(idx >= first, torch::maximum(start, first.clamp_min(0)), idx);
  }
  return start.contiguous();
}

Rotated rotate_learned(const TransformTerm& t, const std::vector<torch::Tensor>& params,
                       const RotationCall& c) {
  const RotationRuntime* r = rotation_runtime(t);
  if (!r) throw std::logic_error(fmt::format("{}: no rotation runtime", t.name));
  check_count(t.name, params.size(), r->names(t));
  if (t.time == TimeSource::ContentPhase) check_inputs(t.name, c.inputs, c.q);
  return r->rotate(t, params, on_device(c));
}

std::vector<torch::Tensor> content_side(const BiasTerm& t, const std::vector<torch::Tensor>& params,
                                        const ContentCall& c, AttentionArgs& a) {
  const ContentRuntime& r = content_runtime(t);
  check_count(t.name, params.size(), r.names(t));
  if (r.reads_inputs) check_inputs(t.name, c.inputs, c.q);
  return r.prepare(t, params, on_device(c), a);
}

}  // namespace relpos::nn
