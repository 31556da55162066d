// One attention module and its decode cache (C++ side of python/relpos/engine.py): `Attention`
// owns a mechanism's parameters (its `encoding`, a PositionEncoding over the key/value heads, so
// state-dict names are "encoding.<name>" as in Python) and runs the fused kernel with the
// mechanism's transforms and biases (nn::attention); with a `DecodeCache` the new tokens' keys
// are transformed once at their positions, stored, and later queries score against them.
// A content-dependent bias (FoX, GRAPE-A, GRAPE-AP) is computed by its runtime
// (torch/mechanisms/content_runtime.hpp) from the call's `inputs` (the layer's hidden states) with
// parameters this module owns; the cache keeps its key-side tensors. Mechanisms the module cannot
// run (per-token phases, frequencies a model layer learns) are refused at construction; with a
// cache so are a per-call centre (center=mid) and a dynamic context-extension rule.
// docs/engine.md.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torch/attention.hpp"
#include "torch/encoding.hpp"

namespace relpos::nn {

// One decode step's bookkeeping on a cache's tensors, shared by DecodeCache and the Python
// KVCache (ops cache_step and cache_append): the new tokens' positions and counts, checked
// against each row's last cached position, and the append in place.
struct CacheStep {
  torch::Tensor positions;  // [B, T] float64: given ([T] or [B, T]) or each row's continuation
  torch::Tensor counts;     // int64 [B]: the valid new tokens per row (key_len, default T)
};
// `stored`: the cache's positions [B, capacity]; `positions` and `key_len` may be undefined.
CacheStep cache_step(const torch::Tensor& lengths, const torch::Tensor& stored,
                     const torch::Tensor& positions, const torch::Tensor& key_len, int64_t T);
// k, v [B, Hk, n, D] (and `content`'s new tensors [B, H, n, ...]) written after each row's
// length into storage with room for them, then lengths += counts.
void cache_append(const torch::Tensor& keys, const torch::Tensor& values,
                  const torch::Tensor& positions, const torch::Tensor& lengths,
                  const std::vector<torch::Tensor>& content_store, const torch::Tensor& k,
                  const torch::Tensor& v, const torch::Tensor& pos, const torch::Tensor& counts,
                  const std::vector<torch::Tensor>& content);

// A cache's storage as the step functions take it: keys, values [B, Hk, capacity, D], positions
// [B, capacity] float64 and lengths int64 [B], written in place.
struct CacheStorage {
  torch::Tensor keys, values, positions, lengths;
  // a content-dependent bias's side tensors [B, H, capacity, ...] (empty: none, or not made yet)
  std::vector<torch::Tensor> content = {};
};

// A content-dependent bias's share of a decode step: its term (of the mechanism built for the
// query heads), its parameters and the call's inputs [B, T, model_dim] (undefined where unread).
struct StepContent {
  const BiasTerm* term = nullptr;
  std::vector<torch::Tensor> params = {};
  torch::Tensor inputs = {};
};

// Why a cached step of this mechanism cannot run as one decode_step (empty: it can): it takes at
// most one transform, driven by positions alone (no runtime, frames, learned frequencies or
// basis), slope biases and a content-dependent bias (no learned lag table), a fixed centre and a
// static context-extension rule.
std::optional<std::string> one_call_decode_refusal(const Mechanism& m);
// The transform part of that: at most one transform, driven by positions alone, a fixed centre
// and a static context-extension rule (biases are not its concern).
std::optional<std::string> step_transform_refusal(const Mechanism& m);

// A step's new tokens transformed by the kernels directly, without autograd, for a mechanism
// step_transform_refusal accepts: q [B, Hq, T, D] (each query head through its key/value head's
// map) and k [B, Hk, T, D] at float64 positions pos [B, T] (contiguous), computed in q's compute
// dtype (kernel_params: gamma, eta, gates, alpha0 in it, contiguous), the context-extension
// rule's attention factor applied, stored once as `stored_as` (a float16 overflow is an
// InputError). Issues the clamp warning into `warned`, and the resolution one when
// `user_positions` (the caller's positions before their float64 conversion) are narrower.
// Contiguous results.
std::pair<torch::Tensor, torch::Tensor> step_transformed(
    const Mechanism& m, const std::vector<torch::Tensor>& kernel_params, const torch::Tensor& q,
    const torch::Tensor& k, const torch::Tensor& pos, Layout layout, torch::ScalarType stored_as,
    EncodingWarnings& warned, const torch::Tensor& user_positions = {});

struct DecodeStep {
  Layout layout = Layout::Interleaved;
  int64_t num_heads = 0;  // query heads (the mechanism is built for the key/value heads)
  bool causal = true;
  double window = 0.0;
  double scale = 0.0;
};

// One cached step without autograd, for a mechanism one_call_decode_refusal accepts: the new
// tokens' positions and counts (cache_step), their transform by the kernels directly
// (kernel_params: gamma, eta, gates, alpha0 in q's dtype, contiguous), the append into storage
// with room for them, and the fused kernel over the used prefix. q [B, Hq, T, D], k and v
// [B, Hk, T, D] in the storage's float32 or float64 (checked for finiteness by the caller).
// Issues the clamp warning into `warned`. A content-dependent bias (`content.term`) computes its
// new keys' side tensors into cache.content, which must exist (the general path's first append
// makes it), in a float32 or float64 cache; a path integral's rows are of one length (checked by
// the caller). Returns {out, lse}. The Python Attention's step (the decode method of StepPlan,
// torch/cache_ops.cpp) and AttentionImpl's both run it.
std::vector<torch::Tensor> decode_step(const Mechanism& m,
                                       const std::vector<torch::Tensor>& kernel_params,
                                       const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, const CacheStorage& cache,
                                       const torch::Tensor& positions, const torch::Tensor& key_len,
                                       const DecodeStep& step, EncodingWarnings& warned,
                                       const StepContent& content = {});

// Transformed keys, values (in their frames for journey mechanisms) and float64 positions per
// sequence; row b holds lengths()[b] tokens (rows may differ). Storage doubles as needed; stored
// tensors are detached (the cache is for inference).
class DecodeCache {
 public:
  // keys and values live on `device`; positions and lengths on the host (the step's bookkeeping)
  DecodeCache(int64_t batch, int64_t kv_heads, int64_t head_dim,
              torch::ScalarType dtype = torch::kFloat, int64_t capacity = 16,
              torch::Device device = torch::kCPU);

  int64_t batch() const { return keys_.size(0); }
  int64_t capacity() const { return keys_.size(2); }
  int64_t length() const;  // the longest row: the key columns a query scores against
  const torch::Tensor& lengths() const { return lengths_; }  // int64 [B]
  // One cache per layer: the module whose keys it holds (its identity, an object only that module
  // holds; reset() releases it). InputError when another module (or a destroyed one's successor)
  // calls with a cache holding its tokens.
  void claim(const std::shared_ptr<const void>& module);
  torch::Tensor keys() const;       // [B, Hk, length, D]
  torch::Tensor values() const;     // [B, Hk, length, D]
  torch::Tensor positions() const;  // [B, length] float64
  void reset();                     // empties every row

  // for Attention: shape/dtype of a call's k, the step's positions and counts, the append
  void check(const torch::Tensor& k) const;
  CacheStep step(const torch::Tensor& positions, const torch::Tensor& key_len, int64_t T) const;
  // `content`: the new tokens' content-bias side tensors [B, H, n, ...] (stored like the keys)
  void append(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& pos,
              const torch::Tensor& counts, const std::vector<torch::Tensor>& content = {});
  // room for n more tokens in every row (the storage doubles as needed); the storage itself
  CacheStorage reserve(int64_t n);
  std::vector<torch::Tensor> content() const;  // [B, H, length, ...] each
  // per-token phases (a rotation runtime's): each row's phase after its last token, [B, 1]
  // float64 (undefined before the first call)
  const torch::Tensor& phase() const { return phase_; }
  void set_phase(torch::Tensor phase) { phase_ = std::move(phase); }

 private:
  torch::Tensor keys_, values_, positions_, lengths_;
  std::vector<torch::Tensor> content_;
  torch::Tensor phase_;
  std::weak_ptr<const void> owner_;
  bool owned_ = false;
};

struct AttentionOptions {
  int64_t num_kv_heads = 0;  // 0: the query heads
  Layout layout = Layout::Interleaved;
  bool causal = true;
  double window = 0.0;
  double scale = 0.0;  // 0: 1 / sqrt(D)
  bool check_finite = true;
  int64_t model_dim = 0;  // the width of `inputs` for a content bias that projects them
  // "softmax" (the fused kernel) or "favor": FAVOR+ linear attention on positive orthogonal
  // random features of the transformed q and k (time linear in T; the softmax weights in
  // expectation), for mechanisms that act on q and k only (favor_refusal); no window, key_len
  // or cache
  std::string backend = "softmax";
  int64_t features = 0;      // favor: random features m (0: 4 D)
  int64_t feature_seed = 0;  // favor: the projection's seed (buffer "favor_projection" [m, D])
};

// One call's inputs besides q, k, v.
struct AttentionCall {
  // [T] or [B, T]; default 0..T-1 (or each cached row's continuation). A rotation by vector
  // positions (structured) takes [T, d_c] or [B, T, d_c] here, and the kernel the token order.
  torch::Tensor positions = {};
  torch::Tensor key_len = {};  // int64 [B]: valid keys (with a cache: valid new tokens) per row
  // int64 [B]: the first valid key per row (left padding; with a cache: the first valid slot)
  torch::Tensor key_start = {};
  // int64 [B, T]: packed sequences, a document id per token (each document one contiguous run
  // of its row); a key is visible only to the queries of its document. Not with a cache.
  torch::Tensor segments = {};
  torch::Tensor inputs = {};  // the layer's hidden states [B, T, model_dim] (content biases)
  DecodeCache* cache = nullptr;
};

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const std::string& spec, int64_t head_dim, int64_t num_heads,
                AttentionOptions options = {});
  // q [B, Hq, T, D], k and v [B, Hk, T, D] -> out [B, Hq, T, D]
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionCall& call = {});

  const Mechanism& mechanism() const { return encoding->mechanism(); }
  PositionEncoding encoding{nullptr};

 private:
  void check(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
             const AttentionCall& call) const;
  // forward after check(), in the compute dtype; storage: the half dtype of the caller's q, k, v,
  // for the kernel's operands (AttentionArgs::kernel_storage)
  torch::Tensor computed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const AttentionCall& call, std::optional<c10::ScalarType> storage);
  // the transforms and biases assembled here (not in nn::attention): with a cache, or with a
  // content bias
  torch::Tensor assembled(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const AttentionCall& call, std::optional<c10::ScalarType> storage);
  // whether autograd records this call (decode_step has no backward); `inputs` the layer's
  // hidden states, when given
  bool needs_grad(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const torch::Tensor& inputs = {}) const;
  // whether it records gradients of the module's parameters
  bool trains_parameters() const;
  int64_t num_heads_, num_kv_heads_;
  AttentionOptions options_;
  std::optional<std::string> cache_refusal_;
  // the content-dependent bias term, if any, of the mechanism built for the query heads (its
  // per-token terms and slopes are per query head; with grouped heads a query head's gates read
  // its key/value head's keys)
  std::shared_ptr<const Mechanism> content_mechanism_;
  const BiasTerm* content_ = nullptr;
  std::vector<torch::Tensor> content_params_;  // its parameters (registered on this module)
  const TransformTerm* rotation_ = nullptr;    // a transform with learned frequencies, if any
  std::vector<torch::Tensor> rotation_params_;
  torch::Tensor favor_projection_;  // backend favor: W [m, D]
  bool one_call_decode_ = false;    // a cached step without autograd runs as decode_step
  // what a DecodeCache it fills remembers of it (DecodeCache::claim)
  std::shared_ptr<const int> identity_ = std::make_shared<const int>(0);
};
TORCH_MODULE(Attention);

// Why Attention cannot run this mechanism (built for the key/value heads; any number of query
// heads they divide) (empty: it can).
std::optional<std::string> attention_refusal(const Mechanism& m);
// Why the favor backend cannot run this mechanism (empty: it can): it takes maps of q and k only,
// not logit biases nor frames of values and outputs.
std::optional<std::string> favor_refusal(const Mechanism& m);

}  // namespace relpos::nn
