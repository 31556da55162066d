// The torch side of a term a layer computes with its own parameters: a content-dependent bias
// (core BiasTerm with content_dependent(): per-token gates or probes computed from the tokens) or
// a rotation with learned frequencies (below): one runtime per family, in its own file in this
// folder and named in list.inc, owning the term's parameters (content projections such as FoX's
// forget gates, GRAPE-A's gate directions, GRAPE-AP's probes), their initialisation, and how a
// call's inputs become the kernel's bias arguments. nn::Attention, nn::GrapeAttention, the decode
// caches and the Python ops go through the functions below and never name a family
// (docs/architecture.md, "Content-dependent biases").
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "core/mechanism.hpp"
#include "torch/attention.hpp"

namespace relpos::nn {

// One call's tokens as a content bias sees them.
struct ContentCall {
  torch::Tensor inputs;     // the layer's hidden states [B, T, model_dim]
  torch::Tensor q, k;       // the queries and keys the kernel scores [B, H, T, D] (transformed)
  torch::Tensor positions;  // the new tokens' positions [T] or [B, T], float64
  // With a decode cache: the key-side tensors of the cached keys (as prepare() returned them,
  // [B, H, t, ...]) and each row's cached length (int64 [B]); empty without one.
  std::vector<torch::Tensor> past;
  torch::Tensor past_lengths;
};

struct ContentRuntime {
  // Whether prepare() reads ContentCall::inputs (GRAPE-A's gates read q and k only).
  bool reads_inputs = true;
  // The parameters' state-dict names, in creation order ("fox.weight" is a submodule's).
  std::vector<std::string> (*names)(const BiasTerm& t) = nullptr;
  // Registers the parameters on `owner` under those names (drawing from torch's generator where
  // the reference module does) and returns them in the same order.
  std::vector<torch::Tensor> (*create)(const BiasTerm& t, torch::nn::Module& owner,
                                       int64_t model_dim, int64_t heads,
                                       int64_t head_dim) = nullptr;
  // Sets a's query-side arguments for the call's tokens and returns the new keys' side tensors
  // ([B, H, T, ...], the order a cache stores them; float64 for prefix sums).
  std::vector<torch::Tensor> (*prepare)(const BiasTerm& t, const std::vector<torch::Tensor>& params,
                                        const ContentCall& c, AttentionArgs& a) = nullptr;
  // Sets a's key-side arguments from the side tensors of every key the call scores.
  void (*attach)(const std::vector<torch::Tensor>& keys, AttentionArgs& a) = nullptr;
};

// A rotation whose frequencies a layer learns (and, optionally, a learned basis E R E^T or
// per-token phases scanned from the layer's hidden states): GRAPE-M; or one driven by vector
// positions (structured rotations). The runtime owns the parameters and turns q and k; it is
// found by the transform term's name.
struct RotationCall {
  torch::Tensor inputs;  // [B, T, model_dim] (per-token phases)
  torch::Tensor q, k;    // [B, Hq, T, D], [B, Hk, T, D]
  // [T] or [B, T], float64; vector positions (TimeSource::VectorPosition) [T, dc] or [B, T, dc]
  torch::Tensor positions;
  torch::Tensor phase;  // float64 [B, 1] or [B, P]: the phase before the first token (decode)
  Layout layout = Layout::HalfSplit;
  // int64 [B, T]: the token where each token's scan of per-token phases begins (scan_starts:
  // its row's first valid token, its packed document's first); undefined: the call's first
  torch::Tensor starts;
};
struct Rotated {
  torch::Tensor q, k;
  // after the last token (per-token phases), float64 [B, 1] or [B, P]; the next call's `phase`
  torch::Tensor phase_end;
  // frames that turn values too (the term's roles.values) and outputs back (roles.outputs):
  // their angles [T, P] or [B, T, P] in q's dtype (journey transforms); undefined otherwise
  torch::Tensor frames;
};
struct RotationRuntime {  // it reads inputs when the term's time is TimeSource::ContentPhase
  std::vector<std::string> (*names)(const TransformTerm& t) = nullptr;
  // kv_heads: the key/value heads (per-head parameters are theirs; a query head uses its group's)
  std::vector<torch::Tensor> (*create)(const TransformTerm& t, torch::nn::Module& owner,
                                       int64_t model_dim, int64_t kv_heads,
                                       int64_t head_dim) = nullptr;
  Rotated (*rotate)(const TransformTerm& t, const std::vector<torch::Tensor>& params,
                    const RotationCall& c) = nullptr;
};

// Per-token phases of a call continuing a cached row's: Phi_t = phase0 + sum_{start_t<=s<t} a_s
// (exclusive) for increments a [B, T, P] (phase0 float64 [B, P], zeros when undefined; start_t
// from `starts` [B, T], 0 when undefined): the phases float64 [B, T, P] and the phase after the
// last token [B, P] (detached), what the cache keeps.
struct Phases {
  torch::Tensor phases, end;
};
Phases continued_phases(const torch::Tensor& increments, const torch::Tensor& phase0,
                        const torch::Tensor& starts = {});

// Where each of a call's T tokens starts its scan, int64 [B, T] (undefined when neither mask is
// given): the first token of its packed document (segments [B, T]) and not before its row's first
// valid slot (key_start [B], left padding; the call's tokens sit at slots lengths[b] + t with a
// cache, t without one). A padding token starts at itself (its phase stays the row's first), so
// the valid tokens' phases are those of the row alone, and each document's those of the
// document alone.
torch::Tensor scan_starts(const torch::Tensor& key_start, const torch::Tensor& segments,
                          const torch::Tensor& lengths, int64_t B, int64_t T);

// The runtime of a transform term, or null when it has none (a fixed transform).
const RotationRuntime* rotation_runtime(const TransformTerm& t);
// rotate() with the parameter count and, where read, the inputs checked (InputError).
Rotated rotate_learned(const TransformTerm& t, const std::vector<torch::Tensor>& params,
                       const RotationCall& c);

// The runtime of a content-dependent term (std::logic_error naming it when list.inc has none).
const ContentRuntime& content_runtime(const BiasTerm& t);

// prepare() with the checks every caller needs: the parameters' count, and inputs [B, T, model_dim]
// with q's batch, tokens and dtype where the runtime reads them; InputError naming what is wrong.
std::vector<torch::Tensor> content_side(const BiasTerm& t, const std::vector<torch::Tensor>& params,
                                        const ContentCall& c, AttentionArgs& a);

#define RELPOS_LAG_RUNTIME(NAME)
#define RELPOS_CONTENT_RUNTIME(NAME) ContentRuntime NAME##_content_runtime();
#define RELPOS_ROTATION_RUNTIME(NAME) RotationRuntime NAME##_rotation_runtime();
#include "torch/mechanisms/list.inc"
#undef RELPOS_ROTATION_RUNTIME
#undef RELPOS_CONTENT_RUNTIME
#undef RELPOS_LAG_RUNTIME

}  // namespace relpos::nn
