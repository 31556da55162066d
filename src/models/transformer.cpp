#include "models/transformer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/registry.hpp"
#include "core/types.hpp"
#include "torch/attention.hpp"
#include "torch/journey.hpp"

namespace relpos::models {

Preset parse_preset(const std::string& name) {
  if (name == "jordan") return Preset::Jordan;
  if (name == "pj") return Preset::PJ;
  if (name == "joformer") return Preset::JoFormer;
  if (name == "grape") return Preset::Grape;
  throw InputError(
      fmt::format("unknown model preset '{}' (valid: jordan, pj, joformer, grape)", name));
}

std::string to_string(Preset p) {
  switch (p) {
    case Preset::Jordan:
      return "jordan";
    case Preset::PJ:
      return "pj";
    case Preset::JoFormer:
      return "joformer";
    case Preset::Grape:
      return "grape";
  }
  return "?";
}

void ModelConfig::validate() const {
  const auto range = [](int64_t v, int64_t lo, int64_t hi, const char* what) {
    if (v < lo || v > hi)
      throw InputError(fmt::format("model: {} must be in [{}, {}], got {}", what, lo, hi, v));
  };
  range(vocab, 2, int64_t{1} << 24, "vocab");
  range(d_model, 2, 65536, "d_model");
  range(heads, 1, 1024, "heads");
  range(layers, 0, 1024, "layers");
  range(mlp_ratio, 1, 64, "mlp_ratio");
  if (attention != "fused" && attention != "composed" && attention != "sdpa" &&
      attention != "sdpa_table")
    throw InputError(fmt::format(
        "model: attention must be fused, composed, sdpa or sdpa_table, got '{}'", attention));
  if (d_model % heads)
    throw InputError(fmt::format("model: d_model {} is not divisible by heads {}", d_model, heads));
  if (weights != "softmax" && weights != "softplus")
    throw InputError(fmt::format("model: weights must be softmax or softplus, got '{}'", weights));
  if (!(dropout >= 0 && dropout < 1))
    throw InputError(fmt::format("model: dropout must be in [0, 1), got {}", dropout));
  range(embed_dim, 0, 65536, "embed_dim");
  if (embed_dim > 0 && preset == Preset::Jordan)
    throw InputError(
        "model: embed_dim (an embedding with an expander) needs an untied head: "
        "preset pj or joformer");
  nn::parse_kv_shift(kv_shift);
  if (kv_shift != "none" && preset != Preset::Grape)
    throw InputError("model: kv_shift is an option of the grape preset");
  if (preset == Preset::Grape && (weights != "softmax" || embed_dim > 0))
    throw InputError("model: the grape preset takes softmax weights and no embed_dim");
  // the mechanism must fit this head shape (raises a named InputError otherwise), and a journey
  // term must be usable by the attention path
  const auto m = build_mechanism(mechanism, static_cast<int>(head_dim()), static_cast<int>(heads));
  if (const TransformTerm* v = m.structured_term())
    throw InputError(fmt::format(
        "model: mechanism '{}' rotates by vector positions ('{}', [T, {}]); the language models "
        "give tokens scalar positions",
        mechanism, v->name, v->vector_dims));
  if (preset == Preset::Grape) {
    if (m.has_transform() && head_dim() % 2)
      throw InputError("model: the grape preset's rotations need an even head dim");
    return;  // GrapeAttention checks the terms when it is built
  }
  const bool learned = std::any_of(m.transforms.begin(), m.transforms.end(),
                                   [](const auto& t) { return t.learned_frequencies; });
  if (m.content_bias() || learned)
    throw InputError(fmt::format(
        "model: mechanism '{}' is a GRAPE form with learned or content-gated parts: use "
        "preset = \"grape\"",
        mechanism));
  nn::journey_term(m);
}

// SwiGLU width of the grape preset (the reference: floor(8/3 d))
static int64_t swiglu_hidden(int64_t d) {
  return 8 * d / 3;
}

BlockImpl::BlockImpl(const ModelConfig& c, int64_t index) : c_(c) {
  const int64_t d = c.d_model;
  if (c.preset == Preset::Grape) {
    const auto linear = [&](int64_t in, int64_t out) {
      return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
    };
    qkv_ = register_module("qkv", linear(d, 3 * d));
    proj_ = register_module("proj", linear(d, d));
    up_ = register_module("up", linear(d, 2 * swiglu_hidden(d)));  // W1 and W2 side by side
    down_ = register_module("down", linear(swiglu_hidden(d), d));
    rms1_ = register_parameter("rms1", torch::ones({d}));
    rms2_ = register_parameter("rms2", torch::ones({d}));
    grape_ = register_module(
        fmt::format("grape{}", index),
        nn::GrapeAttention(c.mechanism, d, c.heads, nn::parse_kv_shift(c.kv_shift), c.attention));
    return;
  }
  const bool bias = c.preset != Preset::Jordan;
  qkv_ = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(d, 3 * d).bias(bias)));
  proj_ = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(bias)));
  up_ = register_module("up",
                        torch::nn::Linear(torch::nn::LinearOptions(d, c.mlp_ratio * d).bias(bias)));
  down_ = register_module(
      "down", torch::nn::Linear(torch::nn::LinearOptions(c.mlp_ratio * d, d).bias(bias)));
  if (c.preset == Preset::Jordan) {
    rms1_ = register_parameter("rms1", torch::ones({d}));
    rms2_ = register_parameter("rms2", torch::ones({d}));
  } else {
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  if (c.freeze_qk) {  // the reference zeroes the q and k rows of the fused projection
    torch::NoGradGuard no_grad;
    qkv_->weight.narrow(0, 0, 2 * d).zero_();
    if (bias) qkv_->bias.narrow(0, 0, 2 * d).zero_();
  }
  enc_ = register_module(fmt::format("pos{}", index),
                         nn::PositionEncoding(c.mechanism, c.head_dim(), c.heads,
                                              nn::EncodingOptions{c.layout, false}));
}

namespace {
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps = 1e-6) {
  return w * x * torch::rsqrt(x.square().mean(-1, true) + eps);
}
// the GRAPE reference's RMSNorm: eps 1e-5, computed in float32 at least
torch::Tensor rms_norm_f32(const torch::Tensor& x, const torch::Tensor& w) {
  const auto xf = x.scalar_type() == torch::kDouble ? x : x.to(torch::kFloat);
  return (rms_norm(xf, w.to(xf.scalar_type()), 1e-5)).to(x.scalar_type());
}
}  // namespace

torch::Tensor BlockImpl::norm(int which, const torch::Tensor& x) {
  if (c_.preset == Preset::Grape) return rms_norm_f32(x, which == 1 ? rms1_ : rms2_);
  if (c_.preset == Preset::Jordan) return rms_norm(x, which == 1 ? rms1_ : rms2_);
  return which == 1 ? ln1_(x) : ln2_(x);
}

std::vector<std::pair<std::string, double>> BlockImpl::attention_stats() {
  std::vector<std::pair<std::string, double>> stats = encoding()->lag_stats();
  if (!grape_) return stats;
  stats.emplace_back("gain_pair_gap", grape_->gain_pair_gap());
  if (const auto f = grape_->frequencies(); f.defined())
    stats.emplace_back("mean_log_frequency", f.detach().log().mean().item<double>());
  return stats;
}

nn::PositionEncoding& BlockImpl::encoding() {
  return grape_ ? grape_->encoding() : enc_;
}

torch::Tensor BlockImpl::grape_mlp(const torch::Tensor& h) {
  const auto u = up_(norm(2, h)).chunk(2, -1);
  return h + down_(torch::silu(u[0]) * u[1]);
}

torch::Tensor BlockImpl::step(const torch::Tensor& x, nn::GrapeDecodeState& state) {
  if (!grape_) throw InputError("model: step() is the grape preset's streaming path");
  const int64_t B = x.size(0), T = x.size(1), H = c_.heads, hd = c_.head_dim();
  const auto xn = norm(1, x);
  const auto qkv = split_qkv(qkv_(xn), H, hd);
  const auto y = grape_->step(xn, qkv[0], qkv[1], qkv[2], state);
  return grape_mlp(x + proj_(y.transpose(1, 2).reshape({B, T, c_.d_model})));
}

namespace {
// member m (0 or 1) of x's pairs (2p, 2p + 1) (interleaved) or (p, p + D/2) (half split), a view
torch::Tensor pair_member(const torch::Tensor& x, Layout layout, int m) {
  const int64_t D = x.size(-1);
  return layout == Layout::HalfSplit ? x.narrow(-1, m * D / 2, D / 2)
                                     : x.unflatten(-1, {D / 2, 2}).select(-1, m);
}
// the tensor whose pairs are (a, b): pair_member's inverse
torch::Tensor from_pairs(const torch::Tensor& a, const torch::Tensor& b, Layout layout) {
  return layout == Layout::HalfSplit ? torch::cat({a, b}, -1)
                                     : torch::stack({a, b}, -1).flatten(-2);
}
// x's pairs turned a quarter: (x0, x1) -> (-x1, x0), the rotate_half of HF's RoPE
torch::Tensor quarter_turn(const torch::Tensor& x, Layout layout) {
  return from_pairs(-pair_member(x, layout, 1), pair_member(x, layout, 0), layout);
}
}  // namespace

std::pair<torch::Tensor, torch::Tensor> BlockImpl::table_rotated(const torch::Tensor& q,
                                                                 const torch::Tensor& k) {
  const int64_t T = q.size(2), D = q.size(3);
  if (!table_.defined() || table_.size(3) != T || table_.scalar_type() != q.scalar_type()) {
    const torch::NoGradGuard no_grad;
    const Mechanism& m = enc_->mechanism();
    for (const auto& p : enc_->parameters())
      if (p.requires_grad())
        throw InputError(fmt::format(
            "model: attention = sdpa_table precomputes the transform as a table; '{}' learns "
            "parameters of it: use sdpa or fused",
            m.spec));
    // the first member of every pair set to 1: the transform turns it into (a, b), the pair's
    // factors of x0 and of the quarter-turned pair, if it acts on pairs as [[a, -b], [b, a]]
    auto unit = torch::zeros({1, q.size(1), T, D}, q.options().requires_grad(false));
    pair_member(unit, c_.layout, 0).fill_(1);
    const auto o = enc_->forward(unit, unit, {});
    std::vector<torch::Tensor> rows;
    for (const auto& t : {o.q, o.k})
      for (const int m : {0, 1}) {  // one factor for both members of a pair
        const auto f = pair_member(t, c_.layout, m);
        rows.push_back(from_pairs(f, f, c_.layout));
      }
    table_ = torch::stack(rows);  // [4 (q cos, q sin, k cos, k sin), 1, H, T, D]
    // a transform that is not a rotation (and scaling) of pairs has no such table: refused
    // (from a generator of its own: the model's draws stay those of the other attentions)
    const auto x = torch::randn({1, q.size(1), T, D}, at::detail::createCPUGenerator(0),
                                q.options().requires_grad(false));
    const auto want = enc_->forward(x, x, {});
    const auto xt = quarter_turn(x, c_.layout);
    const auto gq = x * table_[0] + xt * table_[1], gk = x * table_[2] + xt * table_[3];
    const double tol = 1e-4 * (want.q.abs().max().item<double>() + 1);
    if ((gq - want.q).abs().max().item<double>() > tol ||
        (gk - want.k).abs().max().item<double>() > tol) {
      table_ = torch::Tensor();
      throw InputError(fmt::format(
          "model: attention = sdpa_table applies the transform as a cos/sin table of pair "
          "rotations; '{}' is not one: use sdpa or fused",
          m.spec));
    }
  }
  return {q * table_[0] + quarter_turn(q, c_.layout) * table_[1],
          k * table_[2] + quarter_turn(k, c_.layout) * table_[3]};
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& positions,
                                 const torch::Tensor& frame) {
  const int64_t B = x.size(0), T = x.size(1), H = c_.heads, hd = c_.head_dim();
  // one Linear(d, 3d) split into q, k, v in that order (split_qkv)
  if (grape_) {
    if (positions.defined())
      throw InputError("model: the grape preset runs at positions 0..T-1 (no positions argument)");
    const auto xn = norm(1, x);
    const auto qkv = split_qkv(qkv_(xn), H, hd);
    const auto y = grape_->forward(xn, qkv[0], qkv[1], qkv[2]);
    return grape_mlp(x + proj_(y.transpose(1, 2).reshape({B, T, c_.d_model})));
  }
  const auto qkv = split_qkv(qkv_(norm(1, x)), H, hd);
  nn::AttentionArgs args;
  args.q_positions = args.k_positions = positions;  // one tensor: one transform call
  args.exclude_self = !c_.include_self;
  args.k_frame = frame;
  torch::Tensor y;
  const auto q = c_.freeze_qk ? torch::zeros_like(qkv[0]) : qkv[0];
  const auto k = c_.freeze_qk ? torch::zeros_like(qkv[1]) : qkv[1];
  if (c_.weights == "softplus") {
    y = softplus_attention(q, k, qkv[2], positions, frame);
  } else if (c_.attention == "fused") {
    y = nn::attention(q, k, qkv[2], *enc_, args);
  } else if (c_.attention == "sdpa" || c_.attention == "sdpa_table") {
    const Mechanism& m = enc_->mechanism();
    if (!m.biases.empty() || nn::journey_term(m) || positions.defined() || !c_.include_self)
      throw InputError(fmt::format(
          "model: attention = {} takes mechanisms without biases or frames at the default "
          "positions, include_self; '{}' needs fused or composed",
          c_.attention, m.spec));
    std::pair<torch::Tensor, torch::Tensor> qk;
    if (c_.attention == "sdpa") {
      const auto t = enc_->forward(q, k, positions);
      qk = {t.q, t.k};
    } else {
      qk = table_rotated(q, k);
    }
    y = at::scaled_dot_product_attention(qk.first, qk.second, qkv[2], {}, 0.0, /*is_causal=*/true);
  } else {
    if (nn::journey_term(enc_->mechanism()))
      throw InputError(
          "model: journey mechanisms run with attention = fused (or softplus weights)");
    const auto t = enc_->forward(q, k, positions);
    nn::AttentionArgs a = args;
    a.slopes = enc_->alibi_slopes();
    if (a.slopes.defined()) a.slopes = a.slopes.to(x.scalar_type());
    if (enc_->has_lag_table()) {
      const int64_t span =
          positions.defined()
              ? static_cast<int64_t>(std::ceil((positions.max() - positions.min()).item<double>()))
              : T - 1;
      a.lag_table = enc_->lag_table(span + 1).to(x.scalar_type());
    }
    y = nn::composed_attention(t.q, t.k, qkv[2], a);
  }
  const double p = is_training() ? c_.dropout : 0.0;
  auto h = x + torch::dropout(proj_(y.transpose(1, 2).reshape({B, T, c_.d_model})), p, p > 0);
  const auto u = up_(norm(2, h));
  // JoFormer: ReLU; the others: exact (erf) GELU
  return h + torch::dropout(down_(c_.preset == Preset::JoFormer ? torch::relu(u) : torch::gelu(u)),
                            p, p > 0);
}

torch::Tensor BlockImpl::softplus_attention(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, const torch::Tensor& positions,
                                            const torch::Tensor& frame) {
  // the reference: w_ij = softplus(q_i . k_j / sqrt(hd)) for visible j, exactly 0 otherwise, no
  // normalisation over j; dropout on w; journey frames around it as in the fused path
  const int64_t T = q.size(2);
  const auto pos =
      positions.defined() ? positions.to(torch::kDouble) : torch::arange(T, torch::kDouble);
  torch::Tensor qt = q, kt = k, vt = v;
  nn::Frame f;
  const Layout layout = enc_->plan().layout;
  if (const TransformTerm* j = nn::journey_term(enc_->mechanism())) {
    f = nn::Frame::of(nn::frame_angles(*j, pos, frame, q.scalar_type(), "frame"));
    qt = nn::rotate_pairs(q, f, false, layout);
    kt = nn::rotate_pairs(k, f, false, layout);
    if (j->roles.values) vt = nn::rotate_pairs(v, f, false, layout);
    if (!j->roles.outputs) f = {};
  } else if (enc_->mechanism().has_transform()) {
    const auto t = enc_->forward(q, k, positions);
    qt = t.q;
    kt = t.k;
  }
  if (!enc_->mechanism().biases.empty())
    throw InputError("model: softplus weights take transform mechanisms only (no bias terms)");
  const auto lag = pos.view({-1, 1}) - pos.view({1, -1});
  const auto visible = c_.include_self ? lag >= 0 : lag > 0;
  const auto s = torch::matmul(qt, kt.transpose(-1, -2)) / std::sqrt(double(q.size(3)));
  auto w = torch::softplus(s) * visible.to(s.scalar_type());
  const double p = is_training() ? c_.dropout : 0.0;
  w = torch::dropout(w, p, p > 0);
  auto o = torch::matmul(w, vt);
  if (f.defined()) o = nn::rotate_pairs(o, f, true, layout);
  return o;
}

std::pair<torch::Tensor, torch::Tensor> BlockImpl::qk_norms(const torch::Tensor& x,
                                                            const torch::Tensor& positions) {
  const auto qkv = split_qkv(qkv_(norm(1, x)), c_.heads, c_.head_dim());
  if (grape_) {
    const auto p = grape_->parts(norm(1, x), qkv[0], qkv[1], qkv[2]);
    return {p.q.norm(2, -1).mean({0, 1}), p.k.norm(2, -1).mean({0, 1})};
  }
  if (nn::journey_term(enc_->mechanism()))  // rotations keep every norm
    return {qkv[0].norm(2, -1).mean({0, 1}), qkv[1].norm(2, -1).mean({0, 1})};
  const auto t = enc_->forward(qkv[0], qkv[1], positions);
  return {t.q.norm(2, -1).mean({0, 1}), t.k.norm(2, -1).mean({0, 1})};
}

TransformerLMImpl::TransformerLMImpl(const ModelConfig& c) : c_(c) {
  c_.validate();
  // Embedding's default initialisation is N(0, 1), as the reference
  const auto m =
      build_mechanism(c.mechanism, static_cast<int>(c.head_dim()), static_cast<int>(c.heads));
  const TransformTerm* j = c.preset == Preset::Grape ? nullptr : nn::journey_term(m);
  const bool per_token = j && j->time == TimeSource::ContentPhase;
  // embed_dim 0: d_model, except the JoFormer per-token model, which the reference embeds in d/2
  // and expands with a Linear
  const int64_t e = c.embed_dim > 0                             ? c.embed_dim
                    : c.preset == Preset::JoFormer && per_token ? c.d_model / 2
                                                                : c.d_model;
  embed_ = register_module("embed", torch::nn::Embedding(c.vocab, e));
  if (e != c.d_model) expand_ = register_module("expand", torch::nn::Linear(e, c.d_model));
  for (int64_t i = 0; i < c.layers; ++i)
    blocks_.push_back(register_module(fmt::format("block{}", i), Block(c, i)));
  if (per_token) {
    // per-token angle vectors, N(0, 1) radians (the reference); one table for every layer (the
    // paper: layer-independent) or one per layer
    const int64_t tables = c.angles_per_layer ? std::max<int64_t>(c.layers, 1) : 1;
    for (int64_t i = 0; i < tables; ++i)
      angle_tables_.push_back(register_parameter(fmt::format("angles{}", i),
                                                 torch::randn({c.vocab, c.head_dim() / 2})));
  }
  if (c.preset == Preset::Jordan || c.preset == Preset::Grape) {
    rms_f_ = register_parameter("rms_f", torch::ones({c.d_model}));
  } else {
    if (c.preset == Preset::PJ)  // the JoFormer reference has no final norm
      ln_f_ =
          register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    head_ = register_module("head", torch::nn::Linear(c.d_model, c.vocab));
  }
  if (c.preset == Preset::Grape) {
    // the reference's init: tied embedding N(0, 0.02); every other parameter of >= 2 dims
    // N(0, 0.5/sqrt(d)), the attention and MLP output projections / sqrt(layers); 1-D parameters
    // and the gate directions, phase weights and log-frequencies keep their own
    torch::NoGradGuard no_grad;
    const double std0 = 0.5 / std::sqrt(static_cast<double>(c.d_model));
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      if (name == "embed.weight") {
        p.value().normal_(0.0, 0.02);
      } else if (p.value().dim() >= 2 && !nn::grape_keeps_init(name)) {
        const bool out_proj = name.ends_with("proj.weight") || name.ends_with("down.weight");
        const double layers = static_cast<double>(std::max<int64_t>(c.layers, 1));
        p.value().normal_(0.0, out_proj ? std0 / std::sqrt(layers) : std0);
      }
    }
  }
}

std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>>
TransformerLMImpl::decay_groups() {
  std::vector<torch::Tensor> decay, keep;
  for (auto& p : named_parameters())
    (c_.preset == Preset::Grape && nn::grape_no_decay(p.key()) ? keep : decay).push_back(p.value());
  return {decay, keep};
}

torch::Tensor TransformerLMImpl::step(const torch::Tensor& tokens,
                                      std::vector<nn::GrapeDecodeState>& states) {
  if (c_.preset != Preset::Grape) throw InputError("model: step() needs the grape preset");
  if (tokens.dim() != 2 || tokens.scalar_type() != torch::kLong)
    throw InputError("model: tokens must be an int64 tensor [B, T]");
  states.resize(blocks_.size());
  auto x = embed_(tokens);
  for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_[i]->step(x, states[i]);
  return torch::matmul(rms_norm_f32(x, rms_f_), embed_->weight.t());
}

torch::Tensor TransformerLMImpl::journey_frames(const torch::Tensor& tokens, int64_t layer) {
  if (angle_tables_.empty()) return {};
  const auto& table =
      angle_tables_[std::min<size_t>(static_cast<size_t>(layer), angle_tables_.size() - 1)];
  const auto m =
      build_mechanism(c_.mechanism, static_cast<int>(c_.head_dim()), static_cast<int>(c_.heads));
  return nn::content_frame_angles(*nn::journey_term(m), torch::embedding(table, tokens));
}

torch::Tensor TransformerLMImpl::forward(const torch::Tensor& tokens,
                                         const torch::Tensor& positions) {
  if (tokens.dim() != 2 || tokens.scalar_type() != torch::kLong)
    throw InputError("model: tokens must be an int64 tensor [B, T]");
  if (tokens.numel() &&
      (tokens.min().item<int64_t>() < 0 || tokens.max().item<int64_t>() >= c_.vocab))
    throw InputError(fmt::format("model: token ids must be in [0, {})", c_.vocab));
  auto x = embed_(tokens);
  if (expand_) x = expand_(x);
  // layer-independent frames are scanned once and shared
  torch::Tensor frame = journey_frames(tokens, 0);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    if (i > 0 && angle_tables_.size() > 1) frame = journey_frames(tokens, static_cast<int64_t>(i));
    x = blocks_[i]->forward(x, positions, frame);
  }
  if (c_.preset == Preset::Jordan) return torch::matmul(rms_norm(x, rms_f_), embed_->weight.t());
  if (c_.preset == Preset::Grape) return torch::matmul(rms_norm_f32(x, rms_f_), embed_->weight.t());
  return head_(ln_f_ ? ln_f_(x) : x);
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> TransformerLMImpl::qk_norm_profile(
    const torch::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  auto x = embed_(tokens);
  if (expand_) x = expand_(x);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    out.push_back(blocks_[i]->qk_norms(x, {}));
    x = blocks_[i]->forward(x, {}, journey_frames(tokens, static_cast<int64_t>(i)));
  }
  return out;
}

int64_t TransformerLMImpl::parameter_count() {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace relpos::models
