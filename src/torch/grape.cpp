#include "torch/grape.hpp"

#include <fmt/format.h>

#include <cmath>

#include "core/charts.hpp"
#include "core/registry.hpp"
#include "core/types.hpp"
#include "torch/grape_generators.hpp"
#include "torch/journey.hpp"
#include "torch/mechanisms/content_runtime.hpp"
#include "torch/scan.hpp"

namespace relpos::nn {

KvShift parse_kv_shift(const std::string& s) {
  if (s == "none") return KvShift::None;
  if (s == "k") return KvShift::K;
  if (s == "v") return KvShift::V;
  if (s == "kv") return KvShift::KV;
  throw InputError(fmt::format("kv_shift must be none, k, v or kv, got '{}'", s));
}

std::string to_string(KvShift s) {
  switch (s) {
    case KvShift::None:
      return "none";
    case KvShift::K:
      return "k";
    case KvShift::V:
      return "v";
    case KvShift::KV:
      return "kv";
  }
  return "?";
}

namespace {

// x / sqrt(mean(x^2) + eps) over the last axis, computed in float32 at least (the reference's
// RMSNorm casts to fp32)
torch::Tensor rms(const torch::Tensor& x, double eps) {
  const auto xf = x.scalar_type() == torch::kDouble ? x : x.to(torch::kFloat);
  return (xf * torch::rsqrt(xf.square().mean(-1, true) + eps)).to(x.scalar_type());
}

torch::Tensor cat_time(const torch::Tensor& cached, const torch::Tensor& fresh) {
  return cached.defined() && cached.size(2) > 0 ? torch::cat({cached, fresh}, 2) : fresh;
}

}  // namespace

GrapeAttentionImpl::GrapeAttentionImpl(const std::string& spec, int64_t d_model, int64_t heads,
                                       KvShift shift, std::string attention)
    : mech_(build_mechanism(spec, static_cast<int>(d_model / heads), static_cast<int>(heads))),
      heads_(heads),
      head_dim_(d_model / heads),
      shift_(shift),
      attention_(std::move(attention)) {
  if (attention_ != "fused" && attention_ != "composed")
    throw InputError(
        fmt::format("grape: attention must be fused or composed, got '{}'", attention_));
  for (const auto& t : mech_.transforms) {
    if (t.vector_positions()) {
      throw InputError(fmt::format(
          "grape: mechanism '{}' rotates by vector positions ('{}'); a GRAPE block has scalar "
          "token positions",
          mech_.spec, t.name));
    } else if (t.learned_frequencies) {
      learned_ = &t;
    } else if (t.roles.values || t.roles.outputs || t.time != TimeSource::Position) {
      throw InputError(fmt::format(
          "grape: mechanism '{}' has a journey or content-driven term '{}': not a GRAPE block "
          "rotation",
          mech_.spec, t.name));
    }
  }
  if (learned_ && mech_.transforms.size() != 1)
    throw InputError(fmt::format("grape: '{}': grape_m composes with bias terms only", mech_.spec));
  int content = 0;
  for (const auto& b : mech_.biases) {
    if (b.content_dependent()) ++content;
    if (b.learned)
      throw InputError(
          fmt::format("grape: '{}': a learned lag table ({}) is not part of the GRAPE block",
                      mech_.spec, b.name));
  }
  if (content > 1)
    throw InputError(fmt::format("grape: '{}' has {} content-dependent biases; a layer takes one",
                                 mech_.spec, content));
  content_ = mech_.content_bias();
  const int64_t D = head_dim_;
  enc_ = register_module(
      "enc", PositionEncoding(spec, D, heads, EncodingOptions{Layout::HalfSplit, false}));
  q_gain_ = register_parameter("q_gain", torch::ones({D}));
  k_gain_ = register_parameter("k_gain", torch::ones({D}));
  slopes_ = register_buffer(
      "slopes",
      torch::tensor(alibi_slopes(static_cast<int>(heads)), torch::kDouble).to(torch::kFloat));
  if (learned_) {  // the rotation's parameters (its runtime: learned frequencies, basis, phases)
    const RotationRuntime* r = rotation_runtime(*learned_);
    if (!r) throw std::logic_error(fmt::format("{}: no rotation runtime", learned_->name));
    rotation_params_ = r->create(*learned_, *this, d_model, heads, D);
  }
  if (content_)  // the term's parameters, in the reference's order (the runtime)
    content_params_ = content_runtime(*content_).create(*content_, *this, d_model, heads, D);
  const auto gate = [&](const char* name) {
    return register_module(name,
                           torch::nn::Linear(torch::nn::LinearOptions(d_model, heads).bias(false)));
  };
  if (shift_ == KvShift::K || shift_ == KvShift::KV) shift_k_ = gate("shift_k");
  if (shift_ == KvShift::V || shift_ == KvShift::KV) shift_v_ = gate("shift_v");
}

void GrapeAttentionImpl::reset_frequencies() {
  if (!learned_) return;
  // lambda_m = scale * ln theta_m at the initial spectrum (segments store -theta: frame angle
  // = -omega p, journey.hpp), rounded once to the parameter's dtype
  std::vector<double> lam;
  for (const auto& s : learned_->segments)
    for (double w : s.omega) lam.push_back(learned_->frequency_scale * std::log(-w));
  torch::NoGradGuard no_grad;
  rotation_params_[0].copy_(torch::tensor(lam, torch::kDouble));
}

torch::Tensor GrapeAttentionImpl::frequencies() const {
  return learned_ ? torch::exp(rotation_params_[0] / learned_->frequency_scale) : torch::Tensor();
}

double GrapeAttentionImpl::gain_pair_gap() const {
  const int64_t h = head_dim_ / 2;
  double gap = 0;
  for (const auto& g : {q_gain_, k_gain_})
    gap = std::max(gap, (g.narrow(0, 0, h) - g.narrow(0, h, h)).abs().max().item<double>());
  return gap;
}

GrapeAttentionImpl::Parts GrapeAttentionImpl::parts(const torch::Tensor& x, const torch::Tensor& q,
                                                    const torch::Tensor& k, const torch::Tensor& v,
                                                    const GrapeDecodeState* state) {
  const int64_t B = x.size(0), T = x.size(1), H = heads_, D = head_dim_;
  if (q.dim() != 4 || q.size(0) != B || q.size(1) != H || q.size(2) != T || q.size(3) != D ||
      k.sizes() != q.sizes() || v.sizes() != q.sizes())
    throw InputError(fmt::format("grape: q, k, v must be [{}, {}, {}, {}]", B, H, T, D));
  const auto dt = q.scalar_type();
  const int64_t offset = state ? state->length : 0;
  const auto pos = torch::arange(offset, offset + T, torch::kDouble);
  Parts P;
  P.last_k = k.narrow(2, T - 1, 1).detach();
  P.last_v = v.narrow(2, T - 1, 1).detach();
  // KV-shift: y_t <- a_t y_{t-1} + (1 - a_t) y_t on the raw projections, y_{-1} = 0
  const auto shift = [&](torch::nn::Linear& gate, const torch::Tensor& y,
                         const torch::Tensor& prev) {
    const auto a = torch::sigmoid(gate(x)).transpose(1, 2).unsqueeze(-1).to(dt);  // [B, H, T, 1]
    const auto first = prev.defined() ? prev : torch::zeros_like(y.narrow(2, 0, 1));
    const auto before = T > 1 ? torch::cat({first, y.narrow(2, 0, T - 1)}, 2) : first;
    return a * before + (1 - a) * y;
  };
  auto qq = q, kk = shift_k_ ? shift(shift_k_, k, state ? state->prev_k : torch::Tensor()) : k;
  P.v = shift_v_ ? shift(shift_v_, v, state ? state->prev_v : torch::Tensor()) : v;
  // rotation, then QK-RMSNorm (this order: the gains act on rotated coordinates)
  if (learned_) {
    const Rotated r = rotate_learned(
        *learned_, rotation_params_,
        {x, qq, kk, pos, state ? state->phase : torch::Tensor(), Layout::HalfSplit, {}});
    qq = r.q;
    kk = r.k;
    P.phase_end = r.phase_end;
  } else if (mech_.has_transform()) {
    const auto o = enc_->forward(qq, kk, pos);
    qq = o.q;
    kk = o.k;
  }
  P.q = rms(qq, 1e-5) * q_gain_.to(dt);
  P.k = rms(kk, 1e-5) * k_gain_.to(dt);
  AttentionArgs& a = P.args;
  a.causal = true;
  if (mech_.slope_bias()) a.slopes = slopes_.to(dt);
  if (!content_) return P;
  ContentCall call{x, P.q, P.k, pos, {}, {}};
  if (state && state->length > 0) {
    call.past = state->content;
    call.past_lengths = torch::full({B}, state->length, torch::kLong);
  }
  P.content = content_side(*content_, content_params_, call, a);
  content_runtime(*content_).attach(P.content, a);
  return P;
}

torch::Tensor GrapeAttentionImpl::attend(const Parts& p) {
  return attention_ == "fused" ? fused_attention(p.q, p.k, p.v, p.args)[0]
                               : composed_attention(p.q, p.k, p.v, p.args);
}

torch::Tensor GrapeAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& q,
                                          const torch::Tensor& k, const torch::Tensor& v) {
  return attend(parts(x, q, k, v));
}

torch::Tensor GrapeAttentionImpl::step(const torch::Tensor& x, const torch::Tensor& q,
                                       const torch::Tensor& k, const torch::Tensor& v,
                                       GrapeDecodeState& s) {
  Parts P = parts(x, q, k, v, &s);
  // the new tokens' keys and side state join the cache; the queries are the last T rows
  P.k = cat_time(s.k, P.k);
  P.v = cat_time(s.v, P.v);
  s.k = P.k.detach();
  s.v = P.v.detach();
  if (content_) {
    std::vector<torch::Tensor> keys(P.content.size());
    s.content.resize(P.content.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      keys[i] = cat_time(s.content[i], P.content[i]);
      s.content[i] = keys[i].detach();
    }
    content_runtime(*content_).attach(keys, P.args);
  }
  if (P.phase_end.defined()) s.phase = P.phase_end;
  s.prev_k = P.last_k;
  s.prev_v = P.last_v;
  s.length += x.size(1);
  return attend(P);
}

bool grape_keeps_init(const std::string& name) {
  for (const char* s : {"gate_u", "gate_v", "ctx_w", "ctx_b", "log_freq", "gate_rho", "probe_rho",
                        "q_gain", "k_gain", "basis_w"})
    if (name.ends_with(s)) return true;
  return false;
}

bool grape_no_decay(const std::string& name) {
  for (const char* s : {"q_gain", "k_gain", "rms1", "rms2", "rms_f"})
    if (name.ends_with(s)) return true;
  return false;
}

}  // namespace relpos::nn
