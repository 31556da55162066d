#include "torch/attention_module.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/parse.hpp"
#include "core/registry.hpp"
#include "kernels/attention/mechanism_attention.hpp"
#include "torch/finite.hpp"
#include "torch/journey.hpp"
#include "torch/linear_attention.hpp"
#include "torch/mechanisms/content_runtime.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

std::string shape_of(const torch::Tensor& t) {
  return fmt::format("[{}]", fmt::join(t.sizes(), ", "));
}

}  // namespace

std::optional<std::string> attention_refusal(const Mechanism& m) {
  if (const BiasTerm* b = m.content_bias()) {
    for (const auto& c : m.biases)
      if (&c != b && c.content_dependent())
        return fmt::format("'{}' has two content-dependent biases ({}, {}); a layer takes one",
                           m.spec, b->name, c.name);
    for (const auto& t : m.transforms)
      if (t.roles.values || t.roles.outputs)
        return fmt::format(
            "'{}': bias '{}' composed with frames that turn values and outputs is not supported "
            "by Attention",
            m.spec, b->name);
  }
  for (const auto& t : m.transforms) {
    if (rotation_runtime(t)) {  // frames, learned frequencies, phases: the module's runtime
      if (m.transforms.size() != 1)
        return fmt::format(
            "'{}': transform '{}' runs in its own runtime; it composes with bias "
            "terms only, not with other transforms",
            m.spec, t.name);
      if (t.scan != PhaseScan::Exclusive)
        return fmt::format(
            "'{}': the reversed inclusive scan reads later tokens (the reference code's leak); "
            "Attention runs the causal exclusive scan",
            m.spec);
      continue;
    }
    if (t.learned_frequencies || t.basis != "none")
      return fmt::format(
          "'{}': transform '{}' has frequencies or a basis learned by the model's layer, "
          "without a runtime; not yet in Attention",
          m.spec, t.name);
    if (t.time != TimeSource::Position)
      return fmt::format(
          "'{}': transform '{}' is driven by per-token phases or vector positions, which need "
          "inputs= projections, not yet in Attention",
          m.spec, t.name);
  }
  journey_term(m);  // a journey term composed with other transforms: InputError
  return std::nullopt;
}

std::optional<std::string> step_transform_refusal(const Mechanism& m) {
  const bool plain_term =
      m.transforms.empty() ||
      (m.transforms.size() == 1 && m.transforms[0].position_driven() &&
       !rotation_runtime(m.transforms[0]) && !m.transforms[0].roles.values &&
       !m.transforms[0].roles.outputs && m.transforms[0].time == TimeSource::Position &&
       !m.transforms[0].learned_frequencies && m.transforms[0].basis == "none");
  if (!plain_term || m.center == CenterMode::Mid || m.rope_scaling.dynamic())
    return fmt::format(
        "'{}': a one-call step transform takes one position term, no per-call centre or dynamic "
        "rule",
        m.spec);
  return std::nullopt;
}

std::optional<std::string> one_call_decode_refusal(const Mechanism& m) {
  if (step_transform_refusal(m) || m.learned_lag_bias())
    return fmt::format(
        "'{}': a one-call decode step takes one position term, slope and content biases, no "
        "learned lag table, per-call centre or dynamic rule",
        m.spec);
  return std::nullopt;
}

namespace {

// q [B, Hq, T, D] and k [B, Hk, T, D] (Hq = g Hk, contiguous, the compute dtype) transformed at
// positions [B, T] by the kernels directly: one plan, a trig table of the few new rows, no op
// dispatch per tensor. Each query head uses its key/value head's map: q viewed as
// [B, Hk, g T, D] with the positions repeated g times.
std::pair<torch::Tensor, torch::Tensor> transformed_step(const Mechanism& m, Layout layout,
                                                         const torch::Tensor& q,
                                                         const torch::Tensor& k,
                                                         const torch::Tensor& pos, double center,
                                                         const std::vector<torch::Tensor>& kp) {
  const auto plan = kernels::TransformPlan::from(m, layout);
  const int64_t B = k.size(0), Hk = k.size(1), T = k.size(2), g = q.size(1) / Hk;
  auto qo = torch::empty_like(q), ko = torch::empty_like(k);
  // the query rows' positions: each row's T positions g times (a host loop: aten::repeat costs
  // several times the step's transform at these sizes)
  std::vector<double> qpos(g == 1 ? 0 : static_cast<size_t>(B * g * T));
  const double* at = pos.data_ptr<double>();
  for (int64_t b = 0; b < B && g > 1; ++b)
    for (int64_t j = 0; j < g; ++j)
      std::copy(at + b * T, at + (b + 1) * T, qpos.begin() + (b * g + j) * T);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_attention_decode_transform", [&] {
    using op_util::ptr;
    const kernels::Params<scalar_t> p{ptr<scalar_t>(kp[0]), ptr<scalar_t>(kp[1]),
                                      ptr<scalar_t>(kp[2]), ptr<scalar_t>(kp[3])};
    // one kernel pass over queries and keys when they share rows and positions (g = 1), else
    // the grouped queries and the keys apart
    const auto apply = [&](const torch::Tensor* x, torch::Tensor* y, const double* at, int64_t rows,
                           const torch::Tensor* xk, torch::Tensor* yk) {
      const kernels::Dims dims{B, Hk, rows};
      const kernels::Positions P{at, true, center};
      const auto trig = kernels::build_trig_table<scalar_t>(plan, dims, P);
      const auto in = [](const torch::Tensor* t) { return t ? t->data_ptr<scalar_t>() : nullptr; };
      const auto out = [](torch::Tensor* t) { return t ? t->data_ptr<scalar_t>() : nullptr; };
      kernels::transform_forward<scalar_t>(plan, dims, P, p, trig.view(), in(x), in(xk), out(y),
                                           out(yk));
    };
    if (g == 1) {
      apply(&q, &qo, at, T, &k, &ko);
    } else {
      apply(&q, &qo, qpos.data(), g * T, nullptr, nullptr);
      apply(nullptr, nullptr, at, T, &k, &ko);
    }
  });
  return {qo, ko};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> step_transformed(
    const Mechanism& m, const std::vector<torch::Tensor>& kernel_params, const torch::Tensor& q,
    const torch::Tensor& k, const torch::Tensor& pos, Layout layout, torch::ScalarType stored_as,
    EncodingWarnings& warned, const torch::Tensor& user_positions) {
  const auto ct = op_util::compute_type(q.scalar_type());
  if (kernel_params.size() != 4)
    throw InputError("step transform: kernel_params must be gamma, eta, gates, alpha0");
  for (const auto& t : kernel_params)
    if (t.defined() && (t.scalar_type() != ct || !t.is_contiguous() || !t.is_cpu()))
      throw InputError(
          "step transform: kernel_params must be contiguous CPU tensors of q's compute dtype (or "
          "undefined: none)");
  // (stored: Tensor::to goes through the dispatcher even when the dtype is already right)
  torch::Tensor qt = op_util::stored(q, ct), kt = op_util::stored(k, ct);
  if (m.has_transform() && q.size(2) > 0) {
    check_exponent_range(m, ct);
    const double center = m.resolve_center(0, 0);  // (center=mid is refused)
    // the clamp warning, and the resolution one for narrow positions the caller gave
    const auto& user = user_positions.defined() ? user_positions : pos;
    if (!warned.clamp ||
        (!warned.resolution && user.is_floating_point() && user.scalar_type() != torch::kDouble)) {
      std::optional<double> last_center;
      warn_about_positions(m, user, pos, center, kernel_params[0], last_center, warned);
    }
    std::tie(qt, kt) =
        transformed_step(m, layout, qt.contiguous(), kt.contiguous(), pos, center, kernel_params);
    if (const double af = scaling_attention_factor(m, pos); af != 1.0) {
      qt = qt * af;
      kt = kt * af;
    }
  }
  qt = op_util::stored(qt, stored_as);
  kt = op_util::stored(kt, stored_as);
  if (stored_as == torch::kHalf)
    for (const auto* t : {&qt, &kt})
      if (!all_finite(*t) && all_finite(t == &qt ? q : k))
        throw InputError(fmt::format(
            "{} overflows float16 after the transform (above 65504): pass bfloat16 or float32",
            t == &qt ? "q" : "k"));
  return {qt, kt};
}

std::vector<torch::Tensor> decode_step(const Mechanism& m,
                                       const std::vector<torch::Tensor>& kernel_params,
                                       const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, const CacheStorage& cache,
                                       const torch::Tensor& positions, const torch::Tensor& key_len,
                                       const DecodeStep& step, EncodingWarnings& warned,
                                       const StepContent& content) {
  const torch::NoGradGuard no_grad;
  // the new tokens are transformed in q's compute dtype (half: float32); a half cache is read in
  // place, with the queries rounded to its dtype as its keys are
  const auto dt = q.scalar_type(), st = cache.keys.scalar_type();
  const int64_t T = q.size(2);
  const auto s = cache_step(cache.lengths, cache.positions, positions, key_len, T);
  const auto& pos = s.positions;  // [B, T], contiguous
  const auto [qt, kt] =
      step_transformed(m, kernel_params, q, k, pos, step.layout, st, warned, positions);
  const int64_t* L = cache.lengths.data_ptr<int64_t>();
  const auto used = [&] { return *std::max_element(L, L + cache.lengths.numel()); };
  const auto prefix = [&](int64_t n) {
    std::vector<torch::Tensor> out;
    for (const auto& c : cache.content) out.push_back(c.narrow(2, 0, n));
    return out;
  };
  AttentionArgs a;
  std::vector<torch::Tensor> side;  // the new keys' side tensors of a content bias
  if (content.term) {
    if (cache.content.empty())
      throw std::logic_error("decode_step: a content bias needs the cache's side tensors");
    side = content_side(*content.term, content.params,
                        {content.inputs, qt, kt, pos, prefix(used()), cache.lengths}, a);
  }
  cache_append(cache.keys, cache.values, cache.positions, cache.lengths, cache.content, kt,
               op_util::stored(v, st), pos, s.counts, side);
  const int64_t len = used();
  if (content.term) content_runtime(*content.term).attach(prefix(len), a);
  a.q_positions = pos;
  a.k_positions = cache.positions.narrow(1, 0, len);
  a.key_len = cache.lengths;  // (read by this call only: no gradient is recorded)
  a.causal = step.causal;
  a.window = step.window;
  a.scale = step.scale;
  if (m.slope_bias()) {
    const auto slopes = slopes_for_heads(m, step.num_heads);
    a.slopes = torch::empty({static_cast<int64_t>(slopes.size())},
                            torch::dtype(op_util::compute_type(st)));
    AT_DISPATCH_FLOATING_TYPES(a.slopes.scalar_type(), "relpos_decode_slopes", [&] {
      std::copy(slopes.begin(), slopes.end(), a.slopes.data_ptr<scalar_t>());
    });
  }
  // the kernel called directly: a step's dispatch through the autograd layer (which records
  // nothing here) cost about a tenth of the step at a hundred keys (docs/performance.md)
  auto r = fused_attention_cpu_forward(qt, cache.keys.narrow(2, 0, len),
                                       cache.values.narrow(2, 0, len), a);
  r[0] = op_util::stored(r[0], dt);
  return r;
}

std::optional<std::string> favor_refusal(const Mechanism& m) {
  for (const auto& b : m.biases)
    return fmt::format(
        "'{}': backend favor approximates exp(q.k) by random features of q and k; bias '{}' adds "
        "to the logits and has no such form: use backend softmax",
        m.spec, b.name);
  for (const auto& t : m.transforms)
    if (t.roles.values || t.roles.outputs)
      return fmt::format(
          "'{}': term '{}' rotates values and outputs by frames; backend favor takes maps of q and "
          "k only: use backend softmax",
          m.spec, t.name);
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// DecodeCache

DecodeCache::DecodeCache(int64_t batch, int64_t kv_heads, int64_t head_dim, torch::ScalarType dtype,
                         int64_t capacity, torch::Device device) {
  for (auto [name, v] : {std::pair{"batch", batch}, std::pair{"kv_heads", kv_heads},
                         std::pair{"head_dim", head_dim}})
    if (v < 1) throw InputError(fmt::format("DecodeCache: {} must be >= 1, got {}", name, v));
  if (capacity < 0)
    throw InputError(fmt::format("DecodeCache: capacity must be >= 0, got {}", capacity));
  if (!op_util::storable(dtype))
    throw InputError("DecodeCache: the dtype must be float32, float64, bfloat16 or float16");
  keys_ = torch::zeros({batch, kv_heads, capacity, head_dim},
                       torch::TensorOptions().dtype(dtype).device(device));
  values_ = torch::zeros_like(keys_);
  positions_ = torch::zeros({batch, capacity}, torch::kDouble);
  lengths_ = torch::zeros({batch}, torch::kLong);
}

int64_t DecodeCache::length() const {
  const int64_t* L = lengths_.data_ptr<int64_t>();  // (read in place: called several times a step)
  return *std::max_element(L, L + lengths_.numel());
}
torch::Tensor DecodeCache::keys() const {
  return keys_.narrow(2, 0, length());
}
torch::Tensor DecodeCache::values() const {
  return values_.narrow(2, 0, length());
}
torch::Tensor DecodeCache::positions() const {
  return positions_.narrow(1, 0, length());
}
std::vector<torch::Tensor> DecodeCache::content() const {
  std::vector<torch::Tensor> out;
  for (const auto& c : content_) out.push_back(c.narrow(2, 0, length()));
  return out;
}
void DecodeCache::reset() {
  lengths_.zero_();
  phase_ = torch::Tensor();
  content_.clear();  // (rebuilt by the next append, for the mechanism that fills it)
  owner_.reset();
  owned_ = false;
}

void DecodeCache::claim(const std::shared_ptr<const void>& module) {
  if (owned_ && owner_.lock() == module) return;
  // another module's keys would be scored as this one's (a cache filled by append() alone has no
  // module yet)
  if (owned_ && length() > 0)
    throw InputError(
        "this DecodeCache holds the keys of another Attention module: give each module (layer) "
        "its own cache, or reset() it");
  owner_ = module;
  owned_ = true;
}

void DecodeCache::check(const torch::Tensor& k) const {
  if (k.size(0) != keys_.size(0) || k.size(1) != keys_.size(1) || k.size(3) != keys_.size(3))
    throw InputError(fmt::format(
        "the cache holds batch {}, {} key/value heads of dim {}; this call has batch {}, {} heads "
        "of dim {}",
        keys_.size(0), keys_.size(1), keys_.size(3), k.size(0), k.size(1), k.size(3)));
  if (k.device() != keys_.device())
    throw InputError(fmt::format("the cache is on {}; this call's keys are on {}",
                                 keys_.device().str(), k.device().str()));
  // (half keys also arrive in float32 from the module, which computes in float32)
  if (!op_util::goes_with(k.scalar_type(), keys_.scalar_type()))
    throw InputError(fmt::format("the cache holds {}; this call is {}",
                                 c10::toString(keys_.scalar_type()),
                                 c10::toString(k.scalar_type())));
}

CacheStep DecodeCache::step(const torch::Tensor& positions, const torch::Tensor& key_len,
                            int64_t T) const {
  return cache_step(lengths_, positions_, positions, key_len, T);
}

void DecodeCache::append(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& pos,
                         const torch::Tensor& counts, const std::vector<torch::Tensor>& content) {
  const int64_t n = k.size(2);
  if (content_.empty())
    for (const auto& c : content) {
      auto shape = c.sizes().vec();
      shape[2] = capacity();
      content_.push_back(torch::zeros(shape, c.options().requires_grad(false)));
    }
  reserve(n);
  cache_append(keys_, values_, positions_, lengths_, content_, k, v, pos, counts, content);
}

CacheStorage DecodeCache::reserve(int64_t n) {
  // zeros appended along the time axis (2 for [B, H, T, ...], 1 for positions)
  const auto grown = [](const torch::Tensor& t, int64_t dim, int64_t extra) {
    auto shape = t.sizes().vec();
    shape[static_cast<size_t>(dim)] = extra;
    return torch::cat({t, torch::zeros(shape, t.options())}, dim);
  };
  const int64_t need = length() + n;
  if (need > capacity()) {
    int64_t cap = std::max<int64_t>(capacity(), 1);
    while (cap < need) cap *= 2;
    const int64_t grow = cap - capacity();
    keys_ = grown(keys_, 2, grow);
    values_ = grown(values_, 2, grow);
    positions_ = grown(positions_, 1, grow);
    for (auto& c : content_) c = grown(c, 2, grow);
  }
  return {keys_, values_, positions_, lengths_, content_};
}

// ---------------------------------------------------------------------------------------------
// One decode step's bookkeeping (the Python KVCache runs the same through the cache_* ops). Rows
// are checked and written through raw pointers: a decode step appends one token, and an op per
// row and tensor would cost more than the step's attention at short contexts.

CacheStep cache_step(const torch::Tensor& lengths, const torch::Tensor& stored,
                     const torch::Tensor& positions, const torch::Tensor& key_len, int64_t T) {
  const int64_t B = lengths.size(0);
  CacheStep s;
  if (key_len.defined()) {
    if (key_len.dim() != 1 || key_len.size(0) != B ||
        (key_len.scalar_type() != torch::kLong && key_len.scalar_type() != torch::kInt))
      throw InputError(fmt::format("key_len must be an integer tensor [B] = [{}], got {}", B,
                                   shape_of(key_len)));
    s.counts = key_len.to(torch::kCPU, torch::kLong).contiguous();
    const auto c = s.counts.accessor<int64_t, 1>();
    for (int64_t b = 0; b < B; ++b)
      if (c[b] < 0 || c[b] > T)
        throw InputError(fmt::format(
            "key_len values must be in [0, {}] (the new tokens of each row), got {} in row {}", T,
            c[b], b));
  } else {
    s.counts = torch::full({B}, T, torch::kLong);
  }
  const auto L = lengths.accessor<int64_t, 1>();
  if (positions.defined()) {
    s.positions = checked_position_values(positions, B, T);
    if (s.positions.dim() == 1) s.positions = s.positions.expand({B, T});
    s.positions = s.positions.contiguous();
  } else {
    s.positions = torch::empty({B, T}, torch::kDouble);
    auto p = s.positions.accessor<double, 2>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T; ++i) p[b][i] = static_cast<double>(L[b] + i);
  }
  // a decoded token never sees a later one; equal positions would in the full forward
  const auto p = s.positions.accessor<double, 2>();
  const auto c = s.counts.accessor<int64_t, 1>();
  const auto last = stored.accessor<double, 2>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 1; i < T; ++i)
      if (!(p[b][i] > p[b][i - 1]))
        throw InputError("positions must increase along each sequence of a cache");
  for (int64_t b = 0; b < B; ++b) {
    if (L[b] == 0 || c[b] == 0 || T == 0) continue;
    if (p[b][0] <= last[b][L[b] - 1])
      throw InputError(fmt::format(
          "positions go backwards in the cache: row {} holds position {} and this call starts "
          "at {}",
          b, last[b][L[b] - 1], p[b][0]));
  }
  return s;
}

void cache_append(const torch::Tensor& keys, const torch::Tensor& values,
                  const torch::Tensor& positions, const torch::Tensor& lengths,
                  const std::vector<torch::Tensor>& content_store, const torch::Tensor& k,
                  const torch::Tensor& v, const torch::Tensor& pos, const torch::Tensor& counts,
                  const std::vector<torch::Tensor>& content) {
  if (content.size() != content_store.size())
    throw InputError(fmt::format("the cache holds {} content tensors per key; this call gives {}",
                                 content_store.size(), content.size()));
  const int64_t B = keys.size(0), cap = keys.size(2), n = k.size(2);
  auto L = lengths.accessor<int64_t, 1>();
  for (int64_t b = 0; b < B; ++b)
    if (L[b] < 0 || L[b] + n > cap)
      throw InputError(fmt::format("the cache row {} holds {} of {} slots: no room for {} more", b,
                                   L[b], cap, n));
  const torch::NoGradGuard no_grad;
  // [B, H, t, ...] rows of one dtype into contiguous storage: one copy per (row, head); else
  // through copy_ (the content tensors have H heads and their own trailing sizes)
  const auto rows = [&](const torch::Tensor& store, const torch::Tensor& x) {
    const int64_t heads = store.size(1);
    const int64_t inner = store.numel() / std::max<int64_t>(1, B * heads * cap);  // per token
    if (store.is_cpu() && x.is_cpu() && store.is_contiguous() &&
        store.scalar_type() == x.scalar_type() && x.dim() == store.dim() && x.size(1) == heads &&
        x.size(2) == n && store.size(2) == cap && x.numel() == B * heads * n * inner) {
      const auto src = x.contiguous();
      const auto bytes = static_cast<size_t>(n * inner * src.element_size());
      auto* dst = static_cast<char*>(store.data_ptr());
      const auto* from = static_cast<const char*>(src.data_ptr());
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(dst + ((b * heads + h) * cap + L[b]) * inner * src.element_size(),
                      from + (b * heads + h) * bytes, bytes);
    } else {
      for (int64_t b = 0; b < B; ++b) store[b].narrow(1, L[b], n).copy_(x[b].detach());
    }
  };
  rows(keys, k);
  rows(values, v);
  const auto p = pos.to(torch::kCPU, torch::kDouble).contiguous();
  const auto src = p.accessor<double, 2>();
  auto dst = positions.accessor<double, 2>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) dst[b][L[b] + i] = src[b][i];
  for (size_t i = 0; i < content.size(); ++i) rows(content_store[i], content[i]);
  const auto c = counts.to(torch::kCPU, torch::kLong).contiguous();
  const auto* add = c.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) L[b] += add[b];
}

// ---------------------------------------------------------------------------------------------
// Attention

AttentionImpl::AttentionImpl(const std::string& spec, int64_t head_dim, int64_t num_heads,
                             AttentionOptions options)
    : num_heads_(num_heads),
      num_kv_heads_(options.num_kv_heads ? options.num_kv_heads : num_heads),
      options_(options) {
  if (num_heads_ < 1 || num_kv_heads_ < 1 || num_heads_ % num_kv_heads_)
    throw InputError(fmt::format("num_kv_heads ({}) must be >= 1 and divide num_heads ({})",
                                 num_kv_heads_, num_heads_));
  encoding = register_module(
      "encoding",
      PositionEncoding(spec, head_dim, num_kv_heads_,
                       EncodingOptions{options.layout, options.check_finite, num_heads_}));
  const Mechanism& m = encoding->mechanism();
  if (auto why = attention_refusal(m)) throw InputError(*why);
  if (m.content_bias()) {
    content_mechanism_ = std::make_shared<const Mechanism>(
        build_mechanism(spec, static_cast<int>(head_dim), static_cast<int>(num_heads_)));
    content_ = content_mechanism_->content_bias();
    const ContentRuntime& r = content_runtime(*content_);
    if (r.reads_inputs && options.model_dim < 1)
      throw InputError(fmt::format(
          "'{}': bias '{}' projects the layer's hidden states: give model_dim (the width of "
          "inputs)",
          m.spec, content_->name));
    content_params_ = r.create(*content_, *this, options.model_dim, num_heads_, head_dim);
  }
  for (const auto& t : m.transforms)
    if (const RotationRuntime* r = rotation_runtime(t)) {
      rotation_ = &t;
      if (t.time == TimeSource::ContentPhase && options.model_dim < 1)
        throw InputError(fmt::format(
            "'{}': transform '{}' scans phases from the layer's hidden states: give model_dim (the "
            "width of inputs)",
            m.spec, t.name));
      rotation_params_ = r->create(t, *this, options.model_dim, num_kv_heads_, head_dim);
    }
  if (options.backend == "favor") {
    if (auto why = favor_refusal(m)) throw InputError(*why);
    if (options.window > 0)
      throw InputError(fmt::format("'{}': backend favor has no sliding window", m.spec));
    if (options.features < 0)
      throw InputError(
          fmt::format("features must be >= 0 (0: 4 x head dim), got {}", options.features));
    favor_projection_ = register_buffer(
        "favor_projection", random_projection(options.features ? options.features : 4 * head_dim,
                                              head_dim, true, options.feature_seed)
                                .to(torch::kFloat));
  } else if (options.backend != "softmax") {
    throw InputError(
        fmt::format("backend must be softmax or favor, got '{}'", brief(options.backend)));
  } else if (options.features != 0 || options.feature_seed != 0) {
    throw InputError(
        "features and feature_seed are options of backend favor; this module is backend softmax");
  }
  one_call_decode_ = options.backend == "softmax" && !one_call_decode_refusal(m);
  if (favor_projection_.defined())  // the features' prefix sums are not kept between calls
    cache_refusal_ =
        fmt::format("'{}': backend favor has no decode cache; decode with backend softmax", m.spec);
  else if (!options.causal)  // a cached token would never see the later keys its full forward sees
    cache_refusal_ = fmt::format(
        "'{}': a cache decodes causal attention; this module is non-causal (causal = false)",
        m.spec);
  else if (m.center == CenterMode::Mid)
    cache_refusal_ = fmt::format(
        "'{}': center=mid puts the centre in the middle of each call, so keys cached in earlier "
        "calls would be off by the change; use a fixed centre (center=auto or a number) to decode",
        m.spec);
  else if (m.rope_scaling.dynamic())
    cache_refusal_ = fmt::format(
        "'{}': the context-extension rule is dynamic (its frequencies follow the context length), "
        "so cached keys' frequencies would change; freeze it with a static rule to decode",
        m.spec);
}

void AttentionImpl::check(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const AttentionCall& call) const {
  for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}})
    if (!t->defined() || t->dim() != 4)
      throw InputError(fmt::format("{} must be a [B, H, T, D] tensor", name));
  if (q.size(1) != num_heads_)
    throw InputError(
        fmt::format("q has {} heads; the module was built for {}", q.size(1), num_heads_));
  for (auto [name, t] : {std::pair{"k", &k}, std::pair{"v", &v}}) {
    if (t->size(1) != num_kv_heads_)
      throw InputError(fmt::format("{} has {} heads; the module was built for {} key/value heads",
                                   name, t->size(1), num_kv_heads_));
    if (t->size(0) != q.size(0) || t->size(2) != q.size(2) || t->size(3) != q.size(3))
      throw InputError(fmt::format("q {} and {} {} differ in batch, tokens or head dim",
                                   shape_of(q), name, shape_of(*t)));
  }
  if (q.size(3) != mechanism().head_dim)
    throw InputError(fmt::format("q has head dim {}; the module was built for {}", q.size(3),
                                 mechanism().head_dim));
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    throw InputError("q, k, v must share one dtype");
  if (options_.check_finite)
    for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}})
      if (!all_finite(*t)) throw InputError(fmt::format("{} contains NaN or Inf", name));
  // unread by most mechanisms (a model passes them to every layer), but never mismatched
  if (call.inputs.defined() && (call.inputs.dim() != 3 || call.inputs.size(0) != q.size(0) ||
                                call.inputs.size(1) != q.size(2)))
    throw InputError(
        fmt::format("inputs must be [B, T, model_dim] with q's B and T ({}, {}), got {}", q.size(0),
                    q.size(2), shape_of(call.inputs)));
  if (rotation_ && rotation_->vector_positions() && !call.positions.defined())
    throw InputError(fmt::format(
        "'{}' rotates by vector positions: pass positions [T, {}] or [B, T, {}] (the kernel's "
        "causality and window follow the token order)",
        mechanism().spec, rotation_->vector_dims, rotation_->vector_dims));
  if (favor_projection_.defined() &&
      (call.key_len.defined() || call.key_start.defined() || call.segments.defined()))
    throw InputError(
        fmt::format("'{}': backend favor takes no key_len, key_start or segments (no padding mask)",
                    mechanism().spec));
  if (call.segments.defined() && call.cache)
    throw InputError(
        "segments (packed sequences) are a mask of full sequences; a cache decodes one sequence "
        "per row");
  if (call.cache) {
    if (cache_refusal_) throw InputError(*cache_refusal_);
    call.cache->check(k);
    call.cache->claim(identity_);
    if (rotation_ && rotation_->time == TimeSource::ContentPhase && call.key_len.defined() &&
        !(call.key_len == q.size(2)).all().item<bool>())
      throw InputError(fmt::format(
          "'{}': per-token phases continue from each row's last token; key_len must count every "
          "new token",
          mechanism().spec));
    if (content_ && content_->shape == BiasShape::PathIntegral) {
      // the kernel's path runs over key slots: every row must end where the new tokens begin
      const auto& L = call.cache->lengths();
      if (L.numel() > 1 && !(L == L[0]).all().item<bool>())
        throw InputError(fmt::format(
            "'{}': a path-integral bias decodes rows of one length; the cache rows differ",
            mechanism().spec));
      if (call.key_len.defined() && !(call.key_len == q.size(2)).all().item<bool>())
        throw InputError(fmt::format(
            "'{}': a path-integral bias decodes rows of one length; key_len must count every "
            "new token",
            mechanism().spec));
    }
    // the cache keeps its keys and values detached: this call's gradients of k, v, inputs and
    // the parameters would miss their paths through the stored keys
    const bool reads_inputs = (content_ && content_runtime(*content_).reads_inputs) ||
                              (rotation_ && rotation_->time == TimeSource::ContentPhase);
    if (torch::GradMode::is_enabled() &&
        (k.requires_grad() || v.requires_grad() ||
         (reads_inputs && call.inputs.defined() && call.inputs.requires_grad()) ||
         trains_parameters()))
      throw InputError(
          "a cached call with autograd on would give partial gradients (the cache stores keys "
          "and values detached): run it under torch::NoGradGuard or c10::InferenceMode, or with "
          "k, v, inputs and the module's parameters not requiring grad; train without a cache");
  }
}

bool AttentionImpl::needs_grad(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& inputs) const {
  if (!torch::GradMode::is_enabled()) return false;
  if (q.requires_grad() || k.requires_grad() || v.requires_grad()) return true;
  if (inputs.defined() && inputs.requires_grad()) return true;
  return trains_parameters();
}

bool AttentionImpl::trains_parameters() const {
  if (!torch::GradMode::is_enabled()) return false;
  for (const auto& p : parameters())
    if (p.requires_grad()) return true;
  return false;
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const AttentionCall& call) {
  check(q, k, v, call);
  // bfloat16 with no parameter to train and no runtime reading q and k: the encoding reads the
  // words as stored (float32 math, one rounding: the same bits as rounding a float32 transform)
  // and the kernel takes them and v as they come, with no float32 copies
  if (q.scalar_type() == torch::kBFloat16 && !trains_parameters() && !call.cache && !content_ &&
      !rotation_ && !favor_projection_.defined() && !journey_term(mechanism()))
    return computed(q, k, v, call, q.scalar_type());
  if (op_util::is_half(q.scalar_type())) {
    // half storage: the mechanism and the kernel compute in float32, the output is stored back
    // (a cache keeps its half keys and values). The kernel reads its operands rounded to the
    // half dtype, unless this call trains the mechanism's parameters: their gradients sum the
    // kernel's q and k gradients, which would be rounded to half too (a damping rate's came out
    // 30% off in bfloat16 that way)
    AttentionCall c = call;
    if (c.inputs.defined() && op_util::is_half(c.inputs.scalar_type()))
      c.inputs = c.inputs.to(torch::kFloat);
    const auto up = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
    // (bfloat16 only: a transformed float16 q or k may leave its range where float32 holds it)
    const auto storage = q.scalar_type() == torch::kBFloat16 && !trains_parameters()
                             ? std::optional(q.scalar_type())
                             : std::nullopt;
    return computed(up(q), up(k), up(v), c, storage).to(q.scalar_type());
  }
  return computed(q, k, v, call, std::nullopt);
}

torch::Tensor AttentionImpl::computed(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const AttentionCall& call,
                                      std::optional<c10::ScalarType> storage) {
  if (call.cache || content_ || rotation_ || favor_projection_.defined())
    return assembled(q, k, v, call, storage);
  AttentionArgs a;
  a.kernel_storage = storage;
  // one positions tensor for queries and keys (the same object: one transform call)
  a.q_positions =
      call.positions.defined() ? call.positions : torch::arange(q.size(2), torch::kDouble);
  a.k_positions = a.q_positions;
  a.causal = options_.causal;
  a.window = options_.window;
  a.scale = options_.scale;
  a.key_len = call.key_len;
  a.key_start = call.key_start;
  a.q_segments = a.k_segments = call.segments;
  return attention(q, k, v, *encoding, a);
}

torch::Tensor AttentionImpl::assembled(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, const AttentionCall& call,
                                       std::optional<c10::ScalarType> storage) {
  DecodeCache* cache = call.cache;
  const bool records = needs_grad(q, k, v, call.inputs);
  if (cache && one_call_decode_ && !call.key_start.defined() && q.is_cpu() && !records) {
    // a cached step without autograd: the one decode_step the Python module runs too (a content
    // bias's side tensors made by the general path's first append, in a float32 or float64 cache)
    const CacheStorage storage = cache->reserve(q.size(2));
    if (!content_ || (!storage.content.empty() && !op_util::is_half(storage.keys.scalar_type()))) {
      const auto dt = q.scalar_type();
      const KernelParams kp = encoding->kernel_params();
      std::vector<torch::Tensor> params;
      for (const auto* t : {&kp.gamma, &kp.eta, &kp.gates, &kp.alpha0})
        params.push_back(t->defined() ? t->to(dt).contiguous() : torch::Tensor());
      return decode_step(
          mechanism(), params, q, k, v, storage, call.positions, call.key_len,
          {options_.layout, num_heads_, options_.causal, options_.window, options_.scale},
          encoding->warnings_issued(), {content_, content_params_, call.inputs})[0];
    }
  }
  const Mechanism& m = mechanism();
  const int64_t B = q.size(0), T = q.size(2), D = q.size(3), g = num_heads_ / num_kv_heads_;
  // vector positions drive the rotation only; the kernel's positions are then the token order
  const bool vector = rotation_ && rotation_->vector_positions();
  torch::Tensor pos, counts;
  if (cache) {
    auto step = cache->step(vector ? torch::Tensor() : call.positions, call.key_len, T);
    pos = std::move(step.positions);
    counts = std::move(step.counts);
  } else {
    pos = call.positions.defined() && !vector ? checked_position_values(call.positions, B, T)
                                              : torch::arange(T, torch::kDouble);
    if (pos.dim() == 1) pos = pos.expand({B, T}).contiguous();  // [B, T] from here on
    counts = torch::full({B}, T, torch::kLong);
  }

  torch::Tensor qt = q, kt = k, vt = v, frames;
  torch::Tensor phase_end;
  if (rotation_) {
    // per-token phases scanned from each row's first valid token and each document's first
    const auto starts = scan_starts(call.key_start, call.segments,
                                    cache ? cache->lengths() : torch::Tensor(), B, T);
    const Rotated r =
        rotate_learned(*rotation_, rotation_params_,
                       {call.inputs, q, k, vector ? call.positions : pos,
                        cache ? cache->phase() : torch::Tensor(), options_.layout, starts});
    qt = r.q;
    kt = r.k;
    phase_end = r.phase_end;
    // frames that turn values into the key's frame here, and the output back below
    if (r.frames.defined()) frames = r.frames;
    if (frames.defined() && rotation_->roles.values)
      vt = rotate_pairs(v, frames, false, options_.layout);
  } else if (m.has_transform()) {
    // queries grouped onto their key/value head and keys in one call at the same positions (one
    // centre for both), as nn::attention
    const auto both = torch::cat({q.reshape({B, num_kv_heads_, g * T, D}), k}, 2);
    const auto o = encoding->forward(both, both, torch::cat({pos.repeat({1, g}), pos}, 1));
    qt = o.q.narrow(2, 0, g * T).reshape({B, num_heads_, T, D});
    kt = o.k.narrow(2, g * T, T);
  }
  if (favor_projection_.defined()) {  // the random-feature kernel on the transformed q and k
    // its causality is the token order, the softmax kernel's the positions: they must agree
    if (options_.causal && T > 1 && !(pos.slice(1, 1) > pos.slice(1, 0, -1)).all().item<bool>())
      throw InputError(fmt::format(
          "'{}': backend favor is causal in the token order; positions must increase along each "
          "sequence",
          m.spec));
    const auto kf = g == 1 ? kt : kt.repeat_interleave(g, 1),
               vf = g == 1 ? vt : vt.repeat_interleave(g, 1);
    // its scale multiplies q and k: the square root of the logits' scale
    return favor_attention(qt, kf, vf, favor_projection_, options_.causal,
                           options_.scale > 0 ? std::sqrt(options_.scale) : 0.0);
  }
  AttentionArgs a;
  a.kernel_storage = storage;
  std::vector<torch::Tensor> content;
  if (content_) {
    ContentCall c{call.inputs, qt, kt, pos, {}, {}};
    if (cache) {
      c.past = cache->content();
      c.past_lengths = cache->lengths();
    }
    content = content_side(*content_, content_params_, c, a);
  }
  a.q_positions = pos;
  // a cached step that records no gradient calls the kernel directly, as decode_step does (the
  // dispatcher's autograd layer would record nothing; its cost shows at a decode step)
  const bool direct = cache && q.is_cpu() && !storage && !records;
  if (cache) {
    cache->append(kt, vt, pos, counts, content);
    if (phase_end.defined()) cache->set_phase(phase_end);
    a.k_positions = cache->positions();
    // (a copy where autograd saves it: the cache's lengths move on with the next step)
    a.key_len = direct ? cache->lengths() : cache->lengths().clone();
    // a half cache is read in place: the queries rounded to its dtype, as its keys were
    kt = cache->keys();
    vt = cache->values();
    qt = qt.to(kt.scalar_type());
    if (content_) content = cache->content();
  } else {
    a.k_positions = pos;
    a.key_len = call.key_len;
    a.q_segments = a.k_segments = call.segments;
  }
  a.key_start = call.key_start;
  if (content_) content_runtime(*content_).attach(content, a);
  a.causal = options_.causal;
  a.window = options_.window;
  a.scale = options_.scale;
  if (m.slope_bias())
    a.slopes = torch::tensor(slopes_for_heads(m, num_heads_), torch::kDouble)
                   .to(op_util::compute_type(q.scalar_type()));
  if (encoding->has_lag_table()) {  // (one row per query head: EncodingOptions::bias_heads)
    const double span = (pos.max() - a.k_positions.min()).item<double>();
    a.lag_table = encoding->lag_table(kernels::lag_table_length(m, span))
                      .to(op_util::compute_type(q.scalar_type()));
  }
  auto out =
      (direct ? fused_attention_cpu_forward(qt, kt, vt, a) : fused_attention(qt, kt, vt, a))[0].to(
          q.scalar_type());
  if (frames.defined() && rotation_->roles.outputs)
    out = rotate_pairs(out, frames, true, options_.layout);
  return out;
}

}  // namespace relpos::nn
