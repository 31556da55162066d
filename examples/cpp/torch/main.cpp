// relpos's torch layer from an installed package (find_package(relpos COMPONENTS torch),
// relpos::torch): a relpos::nn::Attention module inside a tiny language model, trained for a few
// hundred steps on a task that only attention can solve (predict the token two places back).
//
// Checks, each able to fail (exit code 1):
//   - the module's fused attention equals a plain LibTorch computation (the module's own
//     encoding for the transforms, ALiBi's slopes 2^(-8 (h + 1) / H), causal mask, softmax),
//     forward and gradients (of q, k, v and the mechanism's parameters);
//   - the gradients of a training step are finite and reach the mechanism's parameters;
//   - training lowers the loss on held-out batches from about log(V) to well under half of it;
//   - decoding through a DecodeCache (prefill, then one token per call) equals the full forward;
//   - operators that nothing in this program calls are registered too (relpos::torch links the
//     torch layer whole; a plain static link drops them: docs/cpp.md).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "relpos/torch/attention_module.hpp"

namespace {

int failures = 0;

void check(const char* what, double err, double tol) {
  const bool ok = err <= tol;  // false for NaN too
  std::printf("%-58s %s  (error %.3g, tolerance %.3g)\n", what, ok ? "ok  " : "FAIL", err, tol);
  if (!ok) ++failures;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// Embedding -> q, k, v projections -> relpos attention -> residual -> logits.
struct TinyLMImpl : torch::nn::Module {
  TinyLMImpl(int64_t vocab, int64_t heads, int64_t head_dim, const std::string& spec)
      : H(heads),
        D(head_dim),
        emb(register_module("emb", torch::nn::Embedding(vocab, heads * head_dim))),
        qkv(register_module("qkv", torch::nn::Linear(heads * head_dim, 3 * heads * head_dim))),
        attn(register_module("attn", relpos::nn::Attention(spec, head_dim, heads))),
        head(register_module("head", torch::nn::Linear(heads * head_dim, vocab))) {}

  torch::Tensor forward(const torch::Tensor& tokens) {  // [B, T] -> logits [B, T, V]
    const int64_t B = tokens.size(0), T = tokens.size(1);
    const torch::Tensor x = emb(tokens);
    const torch::Tensor p = qkv(x).view({B, T, 3, H, D}).permute({2, 0, 3, 1, 4});  // [3,B,H,T,D]
    const torch::Tensor y =
        attn(p[0].contiguous(), p[1].contiguous(), p[2].contiguous()).permute({0, 2, 1, 3});
    return head(x + y.reshape({B, T, H * D}));
  }

  int64_t H, D;
  torch::nn::Embedding emb;
  torch::nn::Linear qkv;
  relpos::nn::Attention attn;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyLM);

// The attention a module should compute, from LibTorch ops: the encoding's transformed q and k,
// scores / sqrt(D) - slope_h (i - j) on j <= i, softmax, times v.
torch::Tensor plain_attention(relpos::nn::Attention& attn, const torch::Tensor& q,
                              const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t H = q.size(1), T = q.size(2), D = q.size(3);
  const auto enc = attn->encoding->forward(q, k);
  auto logits = torch::matmul(enc.q, enc.k.transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
  const auto i = torch::arange(T, torch::kDouble).view({T, 1});
  const auto lag = i - i.view({1, T});  // i - j
  std::vector<double> slopes;
  for (int64_t h = 0; h < H; ++h)
    slopes.push_back(std::pow(2.0, -8.0 * static_cast<double>(h + 1) / static_cast<double>(H)));
  const auto bias = -torch::tensor(slopes, torch::kDouble).view({H, 1, 1}) * lag;
  logits = logits + bias.to(q.scalar_type());
  logits = logits.masked_fill(lag.lt(0), -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(logits, -1), v);
}

// Random tokens; the target at t is the token at t - 2 (the first two targets are ignored).
std::pair<torch::Tensor, torch::Tensor> batch(int64_t B, int64_t T, int64_t V) {
  const auto x = torch::randint(V, {B, T}, torch::kLong);
  auto y = torch::full({B, T}, -100, torch::kLong);
  y.narrow(1, 2, T - 2).copy_(x.narrow(1, 0, T - 2));
  return {x, y};
}

torch::Tensor loss_of(TinyLM& model, const torch::Tensor& x, const torch::Tensor& y) {
  const auto logits = model->forward(x);
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), y.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
}

}  // namespace

int main() {
  torch::manual_seed(7);
  const std::string spec = "jordan(m=2, regime=raw, eta0=0.05) + alibi";
  constexpr int64_t V = 16, H = 2, D = 16, T = 16, B = 32;
  std::printf("relpos torch example: %s, LibTorch %s\n", spec.c_str(), TORCH_VERSION);
  TinyLM model(V, H, D, spec);

  // 1. The fused module against the plain computation, forward and backward.
  {
    auto& attn = model->attn;
    const auto q = torch::randn({2, H, 9, D}).requires_grad_(true);
    const auto k = torch::randn({2, H, 9, D}).requires_grad_(true);
    const auto v = torch::randn({2, H, 9, D}).requires_grad_(true);
    const auto w = torch::randn({2, H, 9, D});  // a random linear loss
    const auto enc_params = attn->encoding->parameters();
    std::vector<torch::Tensor> inputs = {q, k, v};
    inputs.insert(inputs.end(), enc_params.begin(), enc_params.end());
    const auto fused = attn->forward(q, k, v);
    const auto plain = plain_attention(attn, q, k, v);
    check("Attention forward = plain LibTorch attention", max_abs_diff(fused, plain), 1e-5);
    const auto grads = [&](const torch::Tensor& out) {
      auto g = torch::autograd::grad({(out * w).sum()}, inputs, {}, /*retain_graph=*/true,
                                     /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t i = 0; i < g.size(); ++i)
        if (!g[i].defined()) g[i] = torch::zeros_like(inputs[i]);
      return g;
    };
    const auto g_fused = grads(fused), g_plain = grads(plain);
    double g_err = 0;
    for (size_t i = 0; i < inputs.size(); ++i)
      g_err = std::max(g_err, max_abs_diff(g_fused[i], g_plain[i]) /
                                  std::max(1.0, g_plain[i].abs().max().item<double>()));
    std::printf("  %zu mechanism parameter tensors in attn.encoding\n", enc_params.size());
    check("Attention gradients = plain LibTorch gradients", g_err, 1e-4);
  }

  // 2. Training: AdamW on fresh batches; the loss is measured on held-out batches.
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  const auto [x_eval, y_eval] = batch(256, T, V);
  const auto eval_loss = [&] {
    torch::NoGradGuard no_grad;
    return loss_of(model, x_eval, y_eval).item<double>();
  };
  const double before = eval_loss();
  bool finite = true, reaches_mechanism = false;
  for (int step = 0; step < 300; ++step) {
    const auto [x, y] = batch(B, T, V);
    opt.zero_grad();
    loss_of(model, x, y).backward();
    for (const auto& p : model->parameters())
      finite = finite && p.grad().defined() && torch::isfinite(p.grad()).all().item<bool>();
    for (const auto& p : model->attn->encoding->parameters())
      reaches_mechanism = reaches_mechanism || p.grad().abs().sum().item<double>() > 0;
    opt.step();
  }
  const double after = eval_loss();
  std::printf("  held-out loss: %.4f before training (log V = %.4f), %.4f after 300 steps\n",
              before, std::log(static_cast<double>(V)), after);
  check("every gradient of every step is finite", finite ? 0 : 1, 0);
  check("the gradients reach the mechanism's parameters", reaches_mechanism ? 0 : 1, 0);
  check("trained loss / log V (attention must find token t - 2)",
        after / std::log(static_cast<double>(V)), 0.5);

  // 3. Decoding with a cache: a 5-token prefill, then one token per call, equals the full forward.
  {
    torch::NoGradGuard no_grad;
    auto& attn = model->attn;
    const auto q = torch::randn({3, H, 11, D}), k = torch::randn({3, H, 11, D}),
               v = torch::randn({3, H, 11, D});
    const auto full = attn->forward(q, k, v);
    relpos::nn::DecodeCache cache(/*batch=*/3, /*kv_heads=*/H, /*head_dim=*/D);
    std::vector<torch::Tensor> parts = {
        attn->forward(q.narrow(2, 0, 5), k.narrow(2, 0, 5), v.narrow(2, 0, 5), {.cache = &cache})};
    for (int64_t t = 5; t < 11; ++t)
      parts.push_back(attn->forward(q.narrow(2, t, 1), k.narrow(2, t, 1), v.narrow(2, t, 1),
                                    {.cache = &cache}));
    check("prefill + 6 decode steps = full forward", max_abs_diff(torch::cat(parts, 2), full),
          1e-5);
    check("the cache holds 11 tokens", static_cast<double>(std::abs(cache.length() - 11)), 0);
  }

  // 4. Registrations from object files this program references nothing of.
  int missing = 0;
  for (const char* op : {"relpos::lag_table", "relpos::cpp_attention_module", "relpos::mechanisms"})
    if (!c10::Dispatcher::singleton().findSchema({op, ""}).has_value()) {
      std::printf("  operator %s is not registered\n", op);
      ++missing;
    }
  check("operators of the whole torch layer are registered", missing, 0);

  std::printf(failures ? "FAILED: %d check(s)\n" : "all checks passed\n", failures);
  return failures ? 1 : 0;
}
