#include "kernels/attention/mechanism_attention.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/types.hpp"

namespace relpos::kernels {

namespace {

const char* shape_name(BiasShape s) {
  switch (s) {
    case BiasShape::LagTable:
      return "lag table";
    case BiasShape::Separable:
      return "separable per-token";
    case BiasShape::PathIntegral:
      return "path-integral";
    case BiasShape::GatedSlope:
      return "gated-slope";
  }
  return "?";
}

// out row h = src row row_of(h), for every [H, NB] array and every gate row.
template <class F>
ParamValues pick_heads(const ParamValues& src, int heads, F row_of) {
  ParamValues out;
  out.heads = heads;
  out.blocks = src.blocks;
  out.gate_rows = src.gate_rows;
  const size_t NB = static_cast<size_t>(src.blocks);
  const auto copy = [&](const std::vector<double>& from, std::vector<double>& to, int rows) {
    to.assign(static_cast<size_t>(rows) * heads * NB, 0.0);
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < heads; ++h) {
        const auto s = from.begin() + static_cast<std::ptrdiff_t>(
                                          (static_cast<size_t>(r) * src.heads + row_of(h)) * NB);
        std::copy(
            s, s + static_cast<std::ptrdiff_t>(NB),
            to.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(r) * heads + h) * NB));
      }
  };
  copy(src.gamma, out.gamma, 1);
  copy(src.eta, out.eta, 1);
  copy(src.alpha0, out.alpha0, 1);
  copy(src.gates, out.gates, src.gate_rows);
  return out;
}

// Are rows a and b of p equal in every array (gates: every gate row)?
bool same_head(const ParamValues& p, int a, int b) {
  const size_t NB = static_cast<size_t>(p.blocks);
  const auto eq = [&](const std::vector<double>& v, int rows) {
    for (int r = 0; r < rows; ++r) {
      const auto x =
          v.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(r) * p.heads + a) * NB);
      const auto y =
          v.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(r) * p.heads + b) * NB);
      if (!std::equal(x, x + static_cast<std::ptrdiff_t>(NB), y)) return false;
    }
    return true;
  };
  return eq(p.gamma, 1) && eq(p.eta, 1) && eq(p.alpha0, 1) && eq(p.gates, p.gate_rows);
}

}  // namespace

void check_attention_support(const Mechanism& m) {
  for (const auto& t : m.transforms) {
    if (t.roles.values || t.roles.outputs || t.time == TimeSource::ContentPhase)
      throw InputError(fmt::format(
          "attention: term '{}' transforms {} (a journey transform): it runs through "
          "nn::attention (torch/journey.hpp) and decodes with kernels::JourneyCache, not through "
          "this path",
          t.name, t.roles.str()));
    if ((t.position_driven() || t.vector_positions()) && t.time != TimeSource::Position)
      throw InputError(fmt::format(
          "attention: term '{}' is driven by a {}: not yet supported by the attention path", t.name,
          t.time == TimeSource::ContentPhase ? "content phase" : "vector position"));
  }
  for (const auto& b : m.biases)
    if (b.shape != BiasShape::LagTable || (b.slopes.empty() && !b.learned))
      throw InputError(
          fmt::format("attention: bias '{}' ({} form) is computed from the tokens by a model: "
                      "use nn::GrapeAttention (torch/grape.hpp), not the kernel-level path",
                      b.name, shape_name(b.shape)));
}

int64_t lag_table_bound(const Mechanism& m) {
  int64_t bound = 0;
  for (const auto& b : m.biases)
    if (b.shape == BiasShape::LagTable && b.learned)
      bound = std::max(bound, b.learned->constant_from());
  return std::min(bound, kMaxLagTable);
}

int64_t lag_table_length(const Mechanism& m, double span) {
  const double bound = static_cast<double>(lag_table_bound(m));
  return static_cast<int64_t>(span > 0 ? std::min(std::ceil(span), bound) : 0.0) + 1;
}

template <class T>
MechanismBias<T> attention_bias_of(const Mechanism& m, int64_t Hq, int64_t max_lag) {
  std::vector<double> slopes, table;
  const int64_t len = lag_table_length(m, static_cast<double>(max_lag));
  for (const auto& b : m.biases) {
    switch (b.shape) {
      case BiasShape::LagTable:
        if (b.learned) {
          if (m.heads != Hq)
            throw InputError(fmt::format(
                "attention: bias '{}' is built for {} heads, the call has {} query heads", b.name,
                m.heads, Hq));
          // a spec string names the kernel's initial parameters
          const auto t = initial_lag_table(*b.learned, m.heads, len);
          table.resize(t.size(), 0.0);
          for (size_t i = 0; i < t.size(); ++i) table[i] += t[i];
          continue;
        }
        if (!b.slopes.empty()) {
          if (static_cast<int64_t>(b.slopes.size()) != Hq)
            throw InputError(fmt::format(
                "attention: bias '{}' has {} slopes for {} query heads (build the mechanism "
                "with heads = the query heads)",
                b.name, b.slopes.size(), Hq));
          slopes.resize(b.slopes.size(), 0.0);
          for (size_t h = 0; h < slopes.size(); ++h) slopes[h] += b.slopes[h];
          continue;
        }
        break;
      case BiasShape::Separable:
      case BiasShape::PathIntegral:
      case BiasShape::GatedSlope:
        break;
    }
    throw InputError(
        fmt::format("attention: bias '{}' ({} form) is computed from the tokens by a model: use "
                    "nn::GrapeAttention (torch/grape.hpp), not the kernel-level path",
                    b.name, shape_name(b.shape)));
  }
  MechanismBias<T> out;
  out.slopes.assign(slopes.begin(), slopes.end());
  out.lag_table.assign(table.begin(), table.end());
  out.lag_len = table.empty() ? 0 : len;
  out.complete = len > lag_table_bound(m);
  return out;
}

HeadParams attention_head_params(const Mechanism& m, const ParamValues& p, int64_t Hq, int64_t Hk) {
  const int NB = m.total_blocks(), G = m.gate_rows();
  if (p.blocks != NB || p.gate_rows != G)
    throw InputError(fmt::format(
        "attention: parameters have {} blocks and {} gate rows, mechanism '{}' has {} and {}",
        p.blocks, p.gate_rows, m.spec, NB, G));
  if (NB > 0 && p.heads != Hk && p.heads != Hq)
    throw InputError(fmt::format(
        "attention: parameters are for {} heads; give them per key head ({}) or per query head "
        "({})",
        p.heads, Hk, Hq));
  const size_t hb = static_cast<size_t>(std::max(p.heads, 0)) * static_cast<size_t>(NB);
  const auto sized = [&](const char* name, const std::vector<double>& v, size_t want) {
    if (v.size() != want)
      throw InputError(fmt::format("attention: parameter '{}' has {} values, expected {}", name,
                                   v.size(), want));
  };
  sized("gamma", p.gamma, hb);
  sized("eta", p.eta, hb);
  sized("alpha0", p.alpha0, hb);
  sized("gates", p.gates, static_cast<size_t>(G) * hb);
  const int group = static_cast<int>(Hq / Hk);
  HeadParams out;
  if (NB == 0 || p.heads == Hk) {
    out.k = pick_heads(p, static_cast<int>(Hk), [&](int g) { return NB == 0 ? 0 : g; });
  } else {
    for (int g = 0; g < Hk; ++g)
      for (int h = g * group + 1; h < (g + 1) * group; ++h)
        if (!same_head(p, g * group, h))
          throw InputError(fmt::format(
              "attention: transform parameters of query heads {} and {} differ, but they share "
              "key head {}: a key is transformed once for its group, so give the parameters per "
              "key head or equal within each group",
              g * group, h, g));
    out.k = pick_heads(p, static_cast<int>(Hk), [&](int g) { return g * group; });
  }
  out.q = pick_heads(out.k, static_cast<int>(Hq), [&](int h) { return h / group; });
  return out;
}

void check_mechanism_attention(const Mechanism& m, const AttentionDims& d) {
  if (d.B < 1 || d.Hq < 1 || d.Hk < 1 || d.Tq < 1 || d.Tk < 1 || d.D < 1)
    throw InputError("attention: every dimension must be positive");
  if (d.Hq % d.Hk)
    throw InputError(
        fmt::format("attention: key/value heads ({}) must divide query heads ({})", d.Hk, d.Hq));
  if (m.head_dim != d.D)
    throw InputError(fmt::format("attention: mechanism '{}' is built for head dim {}, got D = {}",
                                 m.spec, m.head_dim, d.D));
  check_attention_support(m);
}

template <class T>
void mechanism_attention_forward(const Mechanism& m, const ParamValues& p, Layout layout,
                                 const AttentionDims& dims, const T* q, const T* k, const T* v,
                                 const AttentionPositions& pos, const AttentionOptions& options,
                                 T* out, T* lse) {
  check_mechanism_attention(m, dims);
  if (!q || !k || !v || !out) throw InputError("attention: q, k, v and out must be given");
  const HeadParams hp = attention_head_params(m, p, dims.Hq, dims.Hk);
  // explicit position arrays: the transforms need them, and the centre spans queries and keys
  const int64_t rows = pos.per_batch ? dims.B : 1;
  std::vector<double> pq(static_cast<size_t>(rows * dims.Tq)),
      pk(static_cast<size_t>(rows * dims.Tk));
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t i = 0; i < dims.Tq; ++i) pq[b * dims.Tq + i] = pos.query(b, i, dims.Tq, dims.Tk);
    for (int64_t j = 0; j < dims.Tk; ++j) pk[b * dims.Tk + j] = pos.key(b, j, dims.Tk);
  }
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto* v_pos : {&pq, &pk})
    for (size_t i = 0; i < v_pos->size(); ++i) {
      const double x = (*v_pos)[i];
      if (!std::isfinite(x))
        throw InputError(fmt::format("attention: {} position {} (index {}) is not finite",
                                     v_pos == &pq ? "query" : "key", x, i));
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
  const double center = m.resolve_center(lo, hi);
  const MechanismBias<T> bias =
      attention_bias_of<T>(m, dims.Hq, static_cast<int64_t>(std::ceil(hi - lo)));
  // a dynamic context-extension rule at this call's length (max position + 1, HF convention)
  const double length = hi + 1.0;
  Mechanism scaled;
  if (m.rope_scaling.dynamic()) scaled = scaled_for_length(m, length);
  const MechanismPlan plan = MechanismPlan::from(m.rope_scaling.dynamic() ? scaled : m, layout);
  // its attention factor multiplies q and k: logits by its square
  const double af = attention_factor(m, length);
  AttentionOptions opts = options;
  if (af != 1.0) opts.scale = scaled_softmax_scale(options.scale, m.head_dim, af);
  std::vector<T> qt(static_cast<size_t>(dims.B * dims.Hq * dims.Tq * dims.D)),
      kt(static_cast<size_t>(dims.B * dims.Hk * dims.Tk * dims.D));
  {
    const Dims qd{dims.B, dims.Hq, dims.Tq};
    const Positions P{pq.data(), pos.per_batch, center};
    const ParamBuffers<T> par(hp.q);
    const auto trig = build_trig_table<T>(plan.position, qd, P);
    mechanism_forward<T>(plan, qd, P, par.view(), trig.view(), q, nullptr, qt.data(), nullptr);
  }
  {
    const Dims kd{dims.B, dims.Hk, dims.Tk};
    const Positions P{pk.data(), pos.per_batch, center};
    const ParamBuffers<T> par(hp.k);
    const auto trig = build_trig_table<T>(plan.position, kd, P);
    mechanism_forward<T>(plan, kd, P, par.view(), trig.view(), nullptr, k, nullptr, kt.data());
  }
  const AttentionPositions tp{pq.data(), pk.data(), pos.per_batch};
  attention_forward<T>(dims, qt.data(), kt.data(), v, tp, bias.view(), opts, out, lse);
}

#define RELPOS_INSTANTIATE(T)                                                                 \
  template MechanismBias<T> attention_bias_of<T>(const Mechanism&, int64_t, int64_t);         \
  template void mechanism_attention_forward<T>(                                               \
      const Mechanism&, const ParamValues&, Layout, const AttentionDims&, const T*, const T*, \
      const T*, const AttentionPositions&, const AttentionOptions&, T*, T*);
RELPOS_INSTANTIATE(float)
RELPOS_INSTANTIATE(double)
#undef RELPOS_INSTANTIATE

}  // namespace relpos::kernels
