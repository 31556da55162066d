// nn::Attention and nn::DecodeCache over the whole catalog, with no per-mechanism code: decoding
// token by token (and after a prefill) equals the full forward, causality, the refusals, and the
// state-dict names shared with Python's relpos.Attention.
#include <gtest/gtest.h>

#include "core/registry.hpp"
#include "torch/attention_module.hpp"
#include "torch/linear_attention.hpp"
#include "torch/mechanisms/content_runtime.hpp"

using namespace relpos;

namespace {

constexpr int64_t kHq = 4, kHk = 2;

// every mechanism; a context-extension rule on RoPE
std::vector<std::string> catalog_specs() {
  std::vector<std::string> out;
  for (const auto& info : mechanism_catalog())
    out.push_back(info.kind == "scaling" ? "rope + " + info.name : info.name);
  return out;
}

int head_dim_for(const std::string& spec, int64_t heads = kHq) {
  for (int d = 8; d <= 48; d += 2) try {
      build_mechanism(spec, d, heads);
      return d;
    } catch (const InputError&) {
    }
  return 0;
}

// the module in float64 with its learnable parameters moved off their initial values (the
// same values for every module of the spec: the runtimes draw their initial values from torch's
// generator)
nn::Attention module(const std::string& spec, int D) {
  torch::manual_seed(5);
  nn::Attention a(spec, D, kHq, nn::AttentionOptions{.num_kv_heads = kHk});
  a->to(torch::kDouble);
  const torch::NoGradGuard no_grad;
  for (auto& p : a->parameters()) p.add_(0.2 * torch::randn_like(p));
  return a;
}

struct Inputs {
  torch::Tensor q, k, v;
};
Inputs inputs(int64_t B, int64_t T, int D) {
  torch::manual_seed(7);
  return {torch::randn({B, kHq, T, D}, torch::kDouble),
          torch::randn({B, kHk, T, D}, torch::kDouble),
          torch::randn({B, kHk, T, D}, torch::kDouble)};
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// A call's positions for the mechanism's kind of time: real vector positions [B, T, d_c] for a
// rotation by vector positions, else none (0..T-1, or each cached row's continuation).
torch::Tensor call_positions(const Mechanism& m, int64_t B, int64_t T) {
  const TransformTerm* s = m.structured_term();
  if (!s) return {};
  const auto g = at::detail::createCPUGenerator(13);
  return 3.0 * torch::randn({B, T, s->vector_dims}, g, torch::kDouble);
}
// Whether the mechanism reads the layer's hidden states (a content bias projecting them,
// phases scanned from them): ContentBiasesRunFromInputs and LearnedRotationsRunWithTheirParameters
// run those; the catalog-wide tests without inputs skip them.
bool reads_inputs(const std::string& spec, int D) {
  const Mechanism m = build_mechanism(spec, D, kHk);
  if (const BiasTerm* b = m.content_bias(); b && nn::content_runtime(*b).reads_inputs) return true;
  for (const auto& t : m.transforms)
    if (t.time == TimeSource::ContentPhase) return true;
  return false;
}
torch::Tensor tokens(const torch::Tensor& positions, int64_t t, int64_t n) {
  return positions.defined() ? positions.narrow(1, t, n) : positions;
}

// q, k, v (inputs x, 7 tokens, positions p or none) through a fresh cache in chunks of 3, 1, 2,
// 1 tokens
torch::Tensor decode_in_chunks(nn::Attention& a, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& x,
                               const torch::Tensor& p = {}) {
  const torch::NoGradGuard no_grad;
  nn::DecodeCache cache(q.size(0), k.size(1), k.size(3), q.scalar_type(), 2);
  std::vector<torch::Tensor> outs;
  int64_t t = 0;
  for (int64_t n : {3, 1, 2, 1}) {
    outs.push_back(
        a->forward(q.narrow(2, t, n), k.narrow(2, t, n), v.narrow(2, t, n),
                   {.positions = tokens(p, t, n), .inputs = x.narrow(1, t, n), .cache = &cache}));
    t += n;
  }
  return torch::cat(outs, 2);
}

}  // namespace

TEST(AttentionModule, DecodeThroughTheCacheEqualsTheFullForward) {
  int accepted = 0, decoded = 0;
  for (const auto& spec : catalog_specs()) {
    SCOPED_TRACE(spec);
    const int D = head_dim_for(spec);
    ASSERT_GT(D, 0);
    std::optional<nn::Attention> made;
    try {
      made = module(spec, D);
    } catch (const InputError& e) {
      // refused exactly when the module cannot run the mechanism, or it needs model_dim
      EXPECT_TRUE(nn::attention_refusal(build_mechanism(spec, D, kHk)).has_value() ||
                  reads_inputs(spec, D))
          << e.what();
      continue;
    }
    ++accepted;
    nn::Attention& a = *made;
    const int64_t B = 2, T = 6;
    const auto x = inputs(B, T, D);
    const auto P = call_positions(a->mechanism(), B, T);
    const auto full = a->forward(x.q, x.k, x.v, {.positions = P});
    // causality: a later token leaves the earlier outputs unchanged
    auto k2 = x.k.clone();
    k2.narrow(2, T - 1, 1).add_(1.0);
    const auto changed = a->forward(x.q, k2, x.v, {.positions = P});
    EXPECT_LT(max_diff(changed.narrow(2, 0, T - 1), full.narrow(2, 0, T - 1)), 1e-12);
    const Mechanism& m = a->mechanism();
    if (m.center == CenterMode::Mid || m.rope_scaling.dynamic()) {
      nn::DecodeCache cache(B, kHk, D, torch::kDouble);
      EXPECT_THROW(a->forward(x.q, x.k, x.v, {.positions = P, .cache = &cache}), InputError);
      continue;
    }
    ++decoded;
    // with autograd (q recording gradients, the parameters frozen:
    // CachedCallsRefuseTheGradientsTheyWouldLose) the general path; without it (and a mechanism
    // one_call_decode_refusal accepts) each cached step is one decode_step: both against the
    // same full forward
    for (const bool grad : {true, false}) {
      SCOPED_TRACE(grad ? "grad" : "no grad");
      const torch::AutoGradMode mode(grad);
      for (auto& p : a->parameters()) p.requires_grad_(!grad);
      const auto q = grad ? x.q.clone().requires_grad_() : x.q;
      // a prefill of 3 tokens, then one token at a time
      nn::DecodeCache cache(B, kHk, D, torch::kDouble, 2);
      std::vector<torch::Tensor> outs = {
          a->forward(q.narrow(2, 0, 3), x.k.narrow(2, 0, 3), x.v.narrow(2, 0, 3),
                     {.positions = tokens(P, 0, 3), .cache = &cache})};
      for (int64_t t = 3; t < T; ++t)
        outs.push_back(a->forward(q.narrow(2, t, 1), x.k.narrow(2, t, 1), x.v.narrow(2, t, 1),
                                  {.positions = tokens(P, t, 1), .cache = &cache}));
      EXPECT_LT(max_diff(torch::cat(outs, 2).detach(), full.detach()), 1e-12);
      EXPECT_EQ(cache.length(), T);
      EXPECT_GE(cache.capacity(), T);  // grown from 2
    }
  }
  EXPECT_GT(accepted, 10);
  EXPECT_GT(decoded, 10);
}

// A bfloat16 call with no parameter to train reads q, k and v as stored (the encoding's transform
// rounds once, the kernel takes the words as they come): the same bits as transforming float32
// copies and rounding them for the kernel, with grouped-query heads, ALiBi slopes that bf16 would
// round (12 query heads) and a learned lag table.
// The cache keeps its keys and values detached. A cached call with autograd on is refused when
// k, v, inputs or a parameter would record gradients (they would miss their paths through the
// stored keys), and appends nothing; when only q records them, its output and q's gradient are
// the full forward's. Every mechanism a cache decodes, with a key/value head per query head and
// grouped (2:1), and inputs for the runtimes that read them.
TEST(AttentionModule, CachedCallsRefuseTheGradientsTheyWouldLose) {
  int checked = 0;
  for (const auto& spec : catalog_specs())
    for (const int64_t Hk : {2, 1}) {  // and grouped heads
      SCOPED_TRACE(spec + " 2:" + std::to_string(Hk));
      const int64_t H = 2, B = 2, T = 5, P = 3, W = 8;  // a prompt of P tokens, then the rest
      const int D = head_dim_for(spec, H);
      ASSERT_GT(D, 0);
      nn::Attention a(spec, D, H, nn::AttentionOptions{.num_kv_heads = Hk, .model_dim = W});
      a->to(torch::kDouble);
      if (a->mechanism().center == CenterMode::Mid || a->mechanism().rope_scaling.dynamic())
        continue;  // refused with a cache (DecodeThroughTheCacheEqualsTheFullForward)
      ++checked;
      torch::manual_seed(9);
      {
        const torch::NoGradGuard no_grad;
        for (auto& p : a->parameters()) p.add_(0.2 * torch::randn_like(p));
      }
      const auto q = torch::randn({B, H, T, D}, torch::kDouble);
      const auto k = torch::randn({B, Hk, T, D}, torch::kDouble);
      const auto v = torch::randn({B, Hk, T, D}, torch::kDouble);
      const auto x = torch::randn({B, T, W}, torch::kDouble);
      const auto pos = call_positions(a->mechanism(), B, T);
      const auto call = [&](const torch::Tensor& qq, const torch::Tensor& kk,
                            const torch::Tensor& vv, const torch::Tensor& xx, int64_t t, int64_t n,
                            nn::DecodeCache* c) {
        return a->forward(
            qq.narrow(2, t, n), kk.narrow(2, t, n), vv.narrow(2, t, n),
            {.positions = tokens(pos, t, n), .inputs = xx.narrow(1, t, n), .cache = c});
      };
      nn::DecodeCache cache(B, Hk, D, torch::kDouble);
      {
        const torch::NoGradGuard no_grad;
        call(q, k, v, x, 0, P, &cache);
      }
      const auto rec = [](const torch::Tensor& t) { return t.clone().requires_grad_(); };
      EXPECT_THROW(call(q, rec(k), v, x, P, T - P, &cache), InputError);
      EXPECT_THROW(call(q, k, rec(v), x, P, T - P, &cache), InputError);
      // (hidden states the mechanism does not read record nothing it would lose)
      if (reads_inputs(spec, D)) {
        EXPECT_THROW(call(q, k, v, rec(x), P, T - P, &cache), InputError);
      }
      for (auto& p : a->parameters()) {  // each parameter alone
        for (auto& other : a->parameters()) other.requires_grad_(false);
        p.requires_grad_(true);
        EXPECT_THROW(call(q, k, v, x, P, T - P, &cache), InputError);
      }
      EXPECT_EQ(cache.length(), P);
      for (auto& p : a->parameters()) p.requires_grad_(false);
      auto qg = rec(q);
      const auto full = call(qg, k, v, x, 0, T, nullptr).narrow(2, P, T - P);
      const auto w = torch::randn(full.sizes(), torch::kDouble);
      const auto want = torch::autograd::grad({(full * w).sum()}, {qg})[0];
      qg = rec(q);
      const auto out = call(qg, k, v, x, P, T - P, &cache);
      EXPECT_LT(max_diff(out.detach(), full.detach()), 1e-12);
      const auto got = torch::autograd::grad({(out * w).sum()}, {qg})[0];
      EXPECT_LT(max_diff(got, want), 1e-12);
    }
  EXPECT_GT(checked, 40);
}

TEST(AttentionModule, Bf16CallTransformsAsStored) {
  for (const std::string spec : {"rope", "rope + alibi", "jordan(m=2)", "rope + t5_bias"}) {
    SCOPED_TRACE(spec);
    const bool lag = spec.find("t5") != std::string::npos;  // (a learned table: per query head)
    nn::Attention attn(spec, 64, 12, nn::AttentionOptions{.num_kv_heads = lag ? 12 : 4});
    torch::manual_seed(11);
    const auto q = torch::randn({1, 12, 80, 64}).to(torch::kBFloat16);
    const auto k =
        torch::randn({1, attn->encoding->mechanism().heads, 80, 64}).to(torch::kBFloat16);
    const auto v = torch::randn_like(k);
    const torch::NoGradGuard no_grad;
    const auto got = attn->forward(q, k, v);
    nn::AttentionArgs a;
    a.kernel_storage = torch::kBFloat16;
    a.q_positions = a.k_positions = torch::arange(80, torch::kDouble);
    const auto f = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
    const auto want = nn::attention(f(q), f(k), f(v), *attn->encoding, a).to(torch::kBFloat16);
    ASSERT_EQ(got.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(got, want));
  }
}

// Half storage: bf16 and fp16 q, k, v (inputs too) give an output of their dtype within a few
// units of its last place of the float64 module's (float32 parameters, float32 compute), and a
// cache of that dtype decodes to the same outputs as the full forward, to its rounding.
TEST(AttentionModule, HalfStorageIsWithinRoundingOfFloat64) {
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const double tol = dtype == torch::kBFloat16 ? 2e-2 : 4e-3;
    for (const auto& spec : catalog_specs()) {
      SCOPED_TRACE(spec + " " + c10::toString(dtype));
      const int D = head_dim_for(spec);
      if (nn::attention_refusal(build_mechanism(spec, D, kHk)) || reads_inputs(spec, D)) continue;
      nn::Attention ref = module(spec, D), half = module(spec, D);
      half->to(torch::kFloat);
      const int64_t B = 2, T = 7;
      const auto x = inputs(B, T, D);
      const auto P = call_positions(ref->mechanism(), B, T);
      const auto want = ref->forward(x.q, x.k, x.v, {.positions = P});
      const auto got = half->forward(x.q.to(dtype), x.k.to(dtype), x.v.to(dtype), {.positions = P});
      ASSERT_EQ(got.scalar_type(), dtype);
      EXPECT_LT(max_diff(got.to(torch::kDouble), want), tol * want.abs().max().item<double>());
      const Mechanism& m = half->mechanism();
      if (P.defined() || m.center == CenterMode::Mid || m.rope_scaling.dynamic()) continue;
      const torch::NoGradGuard no_grad;
      nn::DecodeCache cache(B, kHk, D, dtype, 2);
      std::vector<torch::Tensor> outs;
      for (int64_t t = 0; t < T; ++t)
        outs.push_back(half->forward(x.q.narrow(2, t, 1).to(dtype), x.k.narrow(2, t, 1).to(dtype),
                                     x.v.narrow(2, t, 1).to(dtype), {.cache = &cache}));
      EXPECT_EQ(cache.keys().scalar_type(), dtype);
      EXPECT_LT(max_diff(torch::cat(outs, 2).to(torch::kDouble), got.to(torch::kDouble)),
                tol * want.abs().max().item<double>());
    }
  }
}

// Packed documents (segments, positions restarting per document) equal separate calls; a
// left-padded row (key_start) equals its unpadded call.
TEST(AttentionModule, PackedDocumentsAndLeftPaddingEqualSeparateCalls) {
  int checked = 0;
  auto specs = catalog_specs();  // and the phases scanned from the hidden states
  specs.insert(specs.end(), {"grape_m(context=true)", "journey(angles=token)"});
  for (const auto& spec : specs) {
    SCOPED_TRACE(spec);
    const int D = head_dim_for(spec);
    const int64_t W = 8;  // the hidden states' width, for the runtimes that read them
    torch::manual_seed(5);
    nn::Attention a(spec, D, kHq, nn::AttentionOptions{.num_kv_heads = kHk, .model_dim = W});
    a->to(torch::kDouble);
    {
      const torch::NoGradGuard no_grad;
      for (auto& p : a->parameters()) p.add_(0.2 * torch::randn_like(p));
    }
    if (a->mechanism().structured_term()) continue;  // vector positions: the Python test
    ++checked;
    const std::vector<int64_t> docs = {5, 7, 4};
    const int64_t T = 16;
    const auto x = inputs(1, T, D);
    const auto h = torch::randn({1, T, W}, torch::kDouble);
    std::vector<torch::Tensor> seg, pos, outs;
    for (size_t i = 0; i < docs.size(); ++i) {
      seg.push_back(torch::full({docs[i]}, static_cast<int64_t>(i), torch::kLong));
      pos.push_back(torch::arange(docs[i], torch::kDouble));
    }
    const auto packed = a->forward(
        x.q, x.k, x.v,
        {.positions = torch::cat(pos), .segments = torch::cat(seg).view({1, T}), .inputs = h});
    int64_t t = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
      outs.push_back(a->forward(x.q.narrow(2, t, docs[i]), x.k.narrow(2, t, docs[i]),
                                x.v.narrow(2, t, docs[i]),
                                {.positions = pos[i], .inputs = h.narrow(1, t, docs[i])}));
      t += docs[i];
    }
    EXPECT_LT(max_diff(packed, torch::cat(outs, 2)), 1e-10);
    // row 0 padded by 4 tokens on the left, row 1 not
    const auto y = inputs(2, 9, D);
    const auto hy = torch::randn({2, 9, W}, torch::kDouble);
    const auto start = torch::tensor({4, 0}, torch::kLong);
    const auto p = torch::arange(9, torch::kDouble).view({1, 9}) - start.view({2, 1});
    const auto out = a->forward(y.q, y.k, y.v, {.positions = p, .key_start = start, .inputs = hy});
    for (int64_t b = 0; b < 2; ++b) {
      const int64_t s = start[b].item<int64_t>(), n = 9 - s;
      const auto row = [&](const torch::Tensor& z) { return z.narrow(0, b, 1).narrow(2, s, n); };
      const auto ref = a->forward(row(y.q), row(y.k), row(y.v),
                                  {.positions = p.narrow(0, b, 1).narrow(1, s, n),
                                   .inputs = hy.narrow(0, b, 1).narrow(1, s, n)});
      EXPECT_LT(max_diff(row(out), ref), 1e-10);
    }
  }
  EXPECT_GT(checked, 30);
}

// reset() empties the key-side tensors too: a cache FoX filled, once reset, decodes GRAPE-A (other
// side tensors), then GRAPE-M (none), each equal to its full forward.
TEST(AttentionModule, AResetCacheTakesAnotherMechanism) {
  const int64_t H = 2, B = 2, T = 5, W = 8;
  const int D = 8;
  torch::manual_seed(4);
  const auto q = torch::randn({B, H, T, D}, torch::kDouble),
             k = torch::randn({B, H, T, D}, torch::kDouble),
             v = torch::randn({B, H, T, D}, torch::kDouble),
             x = torch::randn({B, T, W}, torch::kDouble);
  nn::DecodeCache cache(B, H, D, torch::kDouble);
  for (const char* spec : {"fox", "grape_a", "grape_m"}) {
    SCOPED_TRACE(spec);
    nn::Attention a(spec, D, H, nn::AttentionOptions{.model_dim = W});
    a->to(torch::kDouble);
    const torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> outs;
    for (int64_t t = 0; t < T; ++t)
      outs.push_back(a->forward(q.narrow(2, t, 1), k.narrow(2, t, 1), v.narrow(2, t, 1),
                                {.inputs = x.narrow(1, t, 1), .cache = &cache}));
    EXPECT_LT(max_diff(torch::cat(outs, 2), a->forward(q, k, v, {.inputs = x})), 1e-12);
    cache.reset();
  }
}

TEST(AttentionModule, RowsOfDifferentLengthsDecodeAsTheirOwnForward) {
  const int D = 16;
  auto a = module("rope + alibi", D);
  const int64_t T = 5;
  const auto x = inputs(2, T, D);
  nn::DecodeCache cache(2, kHk, D, torch::kDouble);
  // row 1 holds 2 valid tokens of the prefill, row 0 all 3
  a->forward(x.q.narrow(2, 0, 3), x.k.narrow(2, 0, 3), x.v.narrow(2, 0, 3),
             {.key_len = torch::tensor({3, 2}), .cache = &cache});
  EXPECT_EQ(cache.lengths()[1].item<int64_t>(), 2);
  const auto step =
      a->forward(x.q.narrow(2, 3, 1), x.k.narrow(2, 3, 1), x.v.narrow(2, 3, 1), {.cache = &cache});
  // row 1's new token sits at position 2, after its two tokens
  const auto row1 = torch::cat({x.k.narrow(2, 0, 2), x.k.narrow(2, 3, 1)}, 2).narrow(0, 1, 1);
  const auto v1 = torch::cat({x.v.narrow(2, 0, 2), x.v.narrow(2, 3, 1)}, 2).narrow(0, 1, 1);
  const auto q1 = torch::cat({x.q.narrow(2, 0, 2), x.q.narrow(2, 3, 1)}, 2).narrow(0, 1, 1);
  const auto ref1 = a->forward(q1, row1, v1);
  EXPECT_LT(max_diff(step.narrow(0, 1, 1), ref1.narrow(2, 2, 1)), 1e-12);
  const auto ref0 =
      a->forward(x.q.narrow(2, 0, 4).narrow(0, 0, 1), x.k.narrow(2, 0, 4).narrow(0, 0, 1),
                 x.v.narrow(2, 0, 4).narrow(0, 0, 1));
  EXPECT_LT(max_diff(step.narrow(0, 0, 1), ref0.narrow(2, 3, 1)), 1e-12);
}

TEST(AttentionModule, StateDictNamesAreTheEncodings) {
  nn::Attention a("jordan(m=2, regime=raw)", 16, kHq, nn::AttentionOptions{.num_kv_heads = kHk});
  bool any = false;
  for (const auto& p : a->named_parameters()) {
    EXPECT_EQ(p.key().rfind("encoding.", 0), 0u) << p.key();
    any = true;
  }
  EXPECT_TRUE(any);
}

TEST(AttentionModule, BadCallsAreInputErrors) {
  const int D = 16;
  auto a = module("rope", D);
  const auto x = inputs(1, 3, D);
  EXPECT_THROW(a->forward(x.k, x.k, x.v), InputError);  // 2 query heads, built for 4
  EXPECT_THROW(a->forward(x.q, x.q, x.v), InputError);  // 4 key heads, built for 2
  // hidden states go to every mechanism (a model passes them uniformly): unread, but checked
  EXPECT_TRUE(torch::equal(a->forward(x.q, x.k, x.v, {.inputs = torch::zeros({1, 3, 8})}),
                           a->forward(x.q, x.k, x.v)));
  EXPECT_THROW(a->forward(x.q, x.k, x.v, {.inputs = torch::zeros({1, 4, 8})}), InputError);
  nn::DecodeCache other(1, kHk, D, torch::kFloat);
  EXPECT_THROW(a->forward(x.q, x.k, x.v, {.cache = &other}), InputError);  // float32 cache
  nn::DecodeCache cache(1, kHk, D, torch::kDouble);
  a->forward(x.q, x.k, x.v, {.cache = &cache});
  EXPECT_THROW(a->forward(x.q.narrow(2, 0, 1), x.k.narrow(2, 0, 1), x.v.narrow(2, 0, 1),
                          {.positions = torch::tensor({1.0}), .cache = &cache}),
               InputError);      // backwards
  EXPECT_EQ(cache.length(), 3);  // refused calls append nothing
  EXPECT_THROW(nn::Attention("rope", D, 4, nn::AttentionOptions{.num_kv_heads = 3}), InputError);
  EXPECT_THROW(nn::DecodeCache(0, 2, 16), InputError);
  // a cache decodes causal attention only
  nn::Attention bidirectional("rope", D, kHq,
                              nn::AttentionOptions{.num_kv_heads = kHk, .causal = false});
  bidirectional->to(torch::kDouble);
  nn::DecodeCache c2(1, kHk, D, torch::kDouble);
  EXPECT_THROW(bidirectional->forward(x.q, x.k, x.v, {.cache = &c2}), InputError);
  EXPECT_EQ(c2.length(), 0);
  // one cache per layer: another module's call on a cache holding this one's keys is refused
  auto other_layer = module("rope", D);
  EXPECT_THROW(other_layer->forward(x.q, x.k, x.v, {.cache = &cache}), InputError);
  EXPECT_EQ(cache.length(), 3);
  cache.reset();  // then any module may fill it
  other_layer->forward(x.q, x.k, x.v, {.cache = &cache});
  EXPECT_THROW(a->forward(x.q, x.k, x.v, {.cache = &cache}), InputError);
  EXPECT_EQ(cache.length(), 3);
}

// A learned lag table has one row per query head (EncodingOptions::bias_heads), with grouped
// heads too (4:2): the table's parameters get a gradient, decoding equals the full forward, and
// the grouped module is the one with every query head's own key/value head and the same table.
TEST(AttentionModule, LearnedLagTablesHaveARowPerQueryHead) {
  int seen = 0;
  for (const auto& spec : catalog_specs()) {
    const int D = head_dim_for(spec);
    if (!D || !build_mechanism(spec, D, 2).learned_lag_bias()) continue;
    for (const int64_t Hk : {4, 2}) {
      SCOPED_TRACE(spec + " 4:" + std::to_string(Hk));
      ++seen;
      const auto made = [&](int64_t kv) {
        torch::manual_seed(3);
        nn::Attention a(spec, D, 4, nn::AttentionOptions{.num_kv_heads = kv});
        a->to(torch::kDouble);
        const torch::NoGradGuard no_grad;
        for (auto& p : a->parameters()) p.add_(0.2 * torch::randn_like(p));
        return a;
      };
      nn::Attention a = made(Hk);
      EXPECT_EQ(a->encoding->bias_heads(), 4);
      EXPECT_EQ(a->encoding->lag_table(5).size(0), 4);
      torch::manual_seed(7);
      const auto q = torch::randn({2, 4, 6, D}, torch::kDouble);
      const auto k = torch::randn({2, Hk, 6, D}, torch::kDouble);
      const auto v = torch::randn({2, Hk, 6, D}, torch::kDouble);
      const auto full = a->forward(q, k, v);
      full.square().sum().backward();
      bool any_grad = false;
      for (const auto& p : a->encoding->lag_parameters())
        any_grad = any_grad || (p.grad().defined() && p.grad().abs().sum().item<double>() > 0);
      EXPECT_TRUE(any_grad);
      nn::DecodeCache cache(2, Hk, D, torch::kDouble);
      const torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> outs;
      for (int64_t t = 0; t < 6; ++t)
        outs.push_back(
            a->forward(q.narrow(2, t, 1), k.narrow(2, t, 1), v.narrow(2, t, 1), {.cache = &cache}));
      EXPECT_LT(max_diff(torch::cat(outs, 2), full.detach()), 1e-12);
      if (Hk == 4) continue;
      nn::Attention own = made(4);
      const auto params = a->named_parameters();
      for (auto& p : own->named_parameters()) {
        ASSERT_EQ(params[p.key()].sizes(), p.value().sizes()) << p.key();
        p.value().copy_(params[p.key()]);
      }
      const auto want = own->forward(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1));
      EXPECT_LT(max_diff(full.detach(), want), 1e-12);
    }
  }
  EXPECT_GE(seen, 6);  // pj_bias, t5_bias, kerple; MHA and GQA
}

// Content-dependent biases (every catalog mechanism with one), with as many key/value heads as
// query heads and grouped (4:2): the parameters are the runtime's (names shared with Python), the
// gradient reaches each, decoding in chunks equals the full forward, and a later token leaves
// earlier outputs unchanged. Grouped heads are the module with every query head's own copy of its
// key/value head (the same parameters; the per-token terms are per query head).
TEST(AttentionModule, ContentBiasesRunFromInputs) {
  const int64_t model_dim = 12, B = 2, T = 7;
  const int D = 8;
  int content = 0, grouped = 0;
  auto specs = catalog_specs();
  for (const char* composed : {"rope + fox", "alibi + grape_a", "rope + grape_ap(form=paper)",
                               "grape_m(context=true) + fox", "grape_m + grape_a(gate=k)"})
    specs.emplace_back(composed);
  for (const auto& spec : specs)
    for (const auto& [H, Hk] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}}) {
      std::optional<Mechanism> m;
      try {
        m = build_mechanism(spec, D, static_cast<int>(Hk));
      } catch (const InputError&) {
        continue;  // needs another head dim: not a content bias (those take any even D)
      }
      const BiasTerm* term = m->content_bias();
      if (!term) continue;
      SCOPED_TRACE(spec + " " + std::to_string(H) + ":" + std::to_string(Hk));
      ++content;
      const auto made = [&](int64_t kv) {
        torch::manual_seed(5);
        nn::Attention a(spec, D, H,
                        nn::AttentionOptions{.num_kv_heads = kv, .model_dim = model_dim});
        a->to(torch::kDouble);
        const torch::NoGradGuard no_grad;
        for (auto& p : a->parameters()) p.add_(0.3 * torch::randn_like(p));
        return a;
      };
      nn::Attention a = made(Hk);
      for (const auto& name : nn::content_runtime(*term).names(*term))
        EXPECT_TRUE(a->named_parameters().contains(name)) << name;
      torch::manual_seed(9);
      const auto q = torch::randn({B, H, T, D}, torch::kDouble),
                 k = torch::randn({B, Hk, T, D}, torch::kDouble),
                 v = torch::randn({B, Hk, T, D}, torch::kDouble),
                 x = torch::randn({B, T, model_dim}, torch::kDouble);
      const auto full = a->forward(q, k, v, {.inputs = x});
      (full * torch::randn_like(full)).sum().backward();
      for (const auto& p : a->named_parameters())
        EXPECT_GT(p.value().grad().abs().max().item<double>(), 0.0) << p.key();
      EXPECT_LT(max_diff(decode_in_chunks(a, q, k, v, x), full), 1e-12);
      auto x2 = x.clone();
      x2.select(1, T - 1).add_(3.0);
      EXPECT_EQ(max_diff(a->forward(q, k, v, {.inputs = x2}).narrow(2, 0, T - 1),
                         full.narrow(2, 0, T - 1)),
                0.0);
      if (nn::content_runtime(*term).reads_inputs) {
        EXPECT_THROW(a->forward(q, k, v), InputError);
      }
      if (H == Hk) continue;
      // the module with every query head's own key/value head, where the parameters have the
      // same shapes (per-key/value-head rotations do not)
      nn::Attention own = made(H);
      const auto params = a->named_parameters();
      bool same = true;
      for (const auto& p : own->named_parameters())
        same = same && params.contains(p.key()) && params[p.key()].sizes() == p.value().sizes();
      if (!same) continue;
      ++grouped;
      {
        const torch::NoGradGuard no_grad;
        for (auto& p : own->named_parameters()) p.value().copy_(params[p.key()]);
      }
      const auto want = own->forward(q, k.repeat_interleave(H / Hk, 1),
                                     v.repeat_interleave(H / Hk, 1), {.inputs = x});
      EXPECT_LT(max_diff(full.detach(), want.detach()), 1e-12);
    }
  EXPECT_GE(content, 6);
  EXPECT_GE(grouped, 3);
}

// Rotations with learned frequencies (every catalog transform with a rotation runtime, also with
// content phases and a learned basis), grouped heads: the runtime's parameters, a gradient for
// each, chunked decoding equal to the full forward.
TEST(AttentionModule, LearnedRotationsRunWithTheirParameters) {
  const int64_t model_dim = 12, B = 2, T = 7;
  const int D = 8;
  int found = 0;
  for (const auto& base : catalog_specs()) {
    std::optional<Mechanism> m;
    try {
      m = build_mechanism(base, D, kHk);
    } catch (const InputError&) {
      continue;
    }
    if (m->transforms.empty() || !nn::rotation_runtime(m->transforms[0])) continue;
    for (const auto& spec : {base, base + "(context=true)", base + "(basis=cayley, context=true)",
                             base + "(basis=cayley)", base + "(dims=3, basis=exp)",
                             base + "(angles=token)", base + "(angles=token, values=false)"}) {
      try {  // the options the family has
        build_mechanism(spec, D, kHk);
      } catch (const InputError&) {
        continue;
      }
      SCOPED_TRACE(spec);
      ++found;
      torch::manual_seed(5);
      nn::Attention a(
          spec, D, kHq,
          nn::AttentionOptions{
              .num_kv_heads = kHk, .layout = Layout::HalfSplit, .model_dim = model_dim});
      a->to(torch::kDouble);
      {
        const torch::NoGradGuard no_grad;
        for (auto& p : a->parameters()) p.add_(0.3 * torch::randn_like(p));
      }
      const auto& t = a->mechanism().transforms[0];
      for (const auto& name : nn::rotation_runtime(t)->names(t))
        EXPECT_TRUE(a->named_parameters().contains(name)) << name;
      torch::manual_seed(9);
      const auto q = torch::randn({B, kHq, T, D}, torch::kDouble),
                 k = torch::randn({B, kHk, T, D}, torch::kDouble),
                 v = torch::randn({B, kHk, T, D}, torch::kDouble),
                 x = torch::randn({B, T, model_dim}, torch::kDouble);
      const auto P = call_positions(a->mechanism(), B, T);
      const auto full = a->forward(q, k, v, {.positions = P, .inputs = x});
      if (!a->parameters().empty()) (full * torch::randn_like(full)).sum().backward();
      for (const auto& p : a->named_parameters())
        if (!p.key().starts_with("encoding.")) {
          EXPECT_GT(p.value().grad().abs().max().item<double>(), 0.0) << p.key();
        }
      EXPECT_LT(max_diff(decode_in_chunks(a, q, k, v, x, P), full), 1e-12);
    }
  }
  EXPECT_GE(found, 9);
}

// A rotation by vector positions: non-causal scores depend on r_j - r_i only (every position
// moved by one vector leaves the output unchanged), with grouped heads and a learned basis, and
// a call without positions, or with scalar ones, is an InputError naming what it needs.
TEST(AttentionModule, VectorPositionRotationsAreTranslationInvariant) {
  int found = 0;
  for (const auto& base : catalog_specs()) {
    const int D = head_dim_for(base);
    if (!D || !build_mechanism(base, D, kHk).structured_term()) continue;
    for (const auto& spec : {base, base + "(basis=axial)", base + "(dims=3, basis=mixed)"}) {
      SCOPED_TRACE(spec);
      ++found;
      torch::manual_seed(5);
      nn::Attention a(spec, D, kHq, nn::AttentionOptions{.num_kv_heads = kHk, .causal = false});
      a->to(torch::kDouble);
      {
        const torch::NoGradGuard no_grad;
        for (auto& p : a->parameters()) p.add_(0.3 * torch::randn_like(p));
      }
      const auto x = inputs(2, 9, D);
      const auto P = call_positions(a->mechanism(), 2, 9);
      const auto shift = torch::randn({P.size(-1)}, torch::kDouble) * 50;
      const auto out = a->forward(x.q, x.k, x.v, {.positions = P});
      EXPECT_LT(max_diff(a->forward(x.q, x.k, x.v, {.positions = P + shift}), out), 1e-11);
      // the positions matter (not a silent no-op)
      EXPECT_GT(max_diff(a->forward(x.q, x.k, x.v, {.positions = 2 * P}), out), 1e-3);
      EXPECT_THROW(a->forward(x.q, x.k, x.v), InputError);
      EXPECT_THROW(a->forward(x.q, x.k, x.v, {.positions = torch::arange(9.0)}), InputError);
    }
  }
  EXPECT_GE(found, 3);
}

// backend favor: FAVOR+ on the encoding's q~ and k~ (grouped heads: each query head with its
// key/value head's keys), the projection a buffer drawn from the seed, and the refusals.
TEST(AttentionModule, FavorBackendIsTheRandomFeatureKernelOnTheTransformedQueriesAndKeys) {
  const int D = 8;
  nn::Attention a("rope", D, kHq,
                  nn::AttentionOptions{.num_kv_heads = kHk, .backend = "favor", .features = 24});
  a->to(torch::kDouble);
  const auto x = inputs(2, 6, D);
  const auto out = a->forward(x.q, x.k, x.v);
  const auto W = a->named_buffers()["favor_projection"];
  EXPECT_EQ(W.sizes(), (std::vector<int64_t>{24, D}));
  EXPECT_TRUE(
      torch::equal(W, nn::random_projection(24, D, true, 0).to(torch::kFloat).to(W.dtype())));
  // q~ per query group and k~ through the encoding (RoPE is orthogonal: one centre or another)
  const auto pos = torch::arange(6, torch::kDouble);
  const auto qt =
      a->encoding
          ->forward(x.q.reshape({2, kHk, 2 * 6, D}), x.q.reshape({2, kHk, 12, D}), pos.repeat({2}))
          .q.reshape({2, kHq, 6, D});
  const auto kt = a->encoding->forward(x.k, x.k, pos).k;
  const auto want = nn::favor_attention(qt, kt.repeat_interleave(2, 1), x.v.repeat_interleave(2, 1),
                                        W, true, 0.0);
  EXPECT_LT(max_diff(out, want), 1e-12);
  // refused: logit biases, frames of values, windows, key_len, a cache, unknown backends
  for (const char* spec : {"alibi", "rope + kerple", "journey"})
    EXPECT_THROW(nn::Attention(spec, D, 2, nn::AttentionOptions{.backend = "favor"}), InputError)
        << spec;
  EXPECT_THROW(nn::Attention("rope", D, 2, nn::AttentionOptions{.window = 3, .backend = "favor"}),
               InputError);
  EXPECT_THROW(nn::Attention("rope", D, 2, nn::AttentionOptions{.backend = "linear"}), InputError);
  EXPECT_THROW(nn::Attention("rope", D, 2, nn::AttentionOptions{.features = 64}), InputError);
  EXPECT_THROW(a->forward(x.q, x.k, x.v, {.key_len = torch::full({2}, 3, torch::kLong)}),
               InputError);
  nn::DecodeCache cache(2, kHk, D, torch::kDouble);
  EXPECT_THROW(a->forward(x.q, x.k, x.v, {.cache = &cache}), InputError);
  EXPECT_EQ(cache.length(), 0);
}
