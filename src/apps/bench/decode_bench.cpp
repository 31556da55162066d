// relpos-bench decode: one decode step (one new token per sequence, batch 1, float32 or, with
// --dtype, bfloat16 / float16 storage: the module, its cache and every baseline's tensors) of
// nn::Attention with a DecodeCache holding ctx - 1 tokens, against LibTorch's SDPA on a cached
// K/V, per mechanism, context length and head layout (MHA and GQA). Cases:
//   ours       Attention::forward(q, k, v, {cache}) as a user decodes: the new token's transform,
//              the finiteness checks (on by default), the append and the decode kernel; the
//              cache's storage holds the largest --ctx, so at smaller ones its used prefix is a
//              strided view, as in a real cache
//   sdpa       at::scaled_dot_product_attention(q, K, V, enable_gqa) on contiguous [1, Hk, ctx, D]
//              keys and values: the attention alone, nothing else of the step
//   sdpa_step  (mechanisms without a logit bias) the step a RoPE user writes: HF's rotate_half
//              RoPE from a cos/sin table computed once, applied to the new q and k, the new k and
//              v written into a static cache [1, Hk, max ctx, D], SDPA on its used prefix
//   sdpa_bias  (mechanisms with a logit bias) SDPA with the one query's bias row [1, Hq, 1, ctx]
//              materialised outside the timed call, on keys and values of its own (each case
//              streams its own, as a decoder does)
// The cache is filled once per mechanism and layout with random keys, values and (content
// biases) key-side tensors of the shapes the module stores; before every timed step its lengths
// are set back to ctx - 1. Every case of one (mechanism, layout, ctx) runs in one process,
// once per round in a fresh random order, after a warm-up; medians and the median of the
// per-round ratios.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "apps/bench/attention_bench.hpp"
#include "apps/bench/bench_util.hpp"
#include "core/files.hpp"
#include "core/parse.hpp"
#include "core/types.hpp"
#include "torch/attention_module.hpp"

namespace relpos::bench {

namespace {

using json = nlohmann::json;

struct Args {
  std::vector<int64_t> ctx = {1024, 4096, 16384, 32768, 65536};
  std::vector<std::string> heads = {"8:8", "8:2"};
  std::vector<std::string> specs = {"rope", "jordan(m=2)", "alibi", "t5_bias", "fox", "grape_ap"};
  int64_t D = 64;
  int rounds = 21, warmup = 3, threads = 2;
  std::string format = "md", json_out, dtype = "fp32";
};

at::ScalarType dtype_named(const std::string& s) {
  return s == "bf16" ? at::kBFloat16 : s == "fp16" ? at::kHalf : at::kFloat;
}

std::pair<int64_t, int64_t> parse_heads(const std::string& s) {
  const auto colon = s.find(':');
  const auto hq =
      colon == std::string::npos ? std::nullopt : parse_int64(s.substr(0, colon), 1, 1024);
  const auto hk =
      colon == std::string::npos ? std::nullopt : parse_int64(s.substr(colon + 1), 1, 1024);
  if (!hq || !hk || *hq % *hk)
    throw InputError(fmt::format(
        "--heads takes Hq:Hk pairs of integers in [1, 1024] with Hk dividing Hq (e.g. 8:8,8:2), "
        "got '{}'",
        brief(s)));
  return {*hq, *hk};
}

// The first bytes of the JSON report ("header" is its first key): an earlier report (--json-out).
constexpr const char* kJsonHeader = "{\n  \"header\": \"relpos bench decode:";

double time_ms(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// HF's rotate_half RoPE: x cos + rotate_half(x) sin with [D] rows of a table made once.
at::Tensor rope_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t h = x.size(-1) / 2;
  const auto rotated = at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
  return x * cos + rotated * sin;
}

struct Row {
  std::string spec, heads, note;
  int64_t ctx = 0;
  std::map<std::string, double> ms = {};     // case -> median
  std::map<std::string, double> ratio = {};  // case -> median over rounds of ours / case
};

// The module of one mechanism and head layout, in --dtype, and the key-side tensors it stores in a
// cache (content biases) in `scratch`, by a short cached call: a mechanism without a decode cache
// for this layout refuses it by name (InputError).
nn::Attention decode_module(const Args& a, const std::string& spec, int64_t Hq, int64_t Hk,
                            nn::DecodeCache& scratch) {
  const int64_t D = a.D, model_dim = Hq * D;
  nn::AttentionOptions opt;
  opt.num_kv_heads = Hk;
  opt.model_dim = model_dim;
  nn::Attention module(spec, D, Hq, opt);
  module->eval();
  const auto dtype = dtype_named(a.dtype);
  module->to(dtype);
  const torch::NoGradGuard no_grad;
  const auto opts = torch::TensorOptions().dtype(dtype);
  module->forward(torch::randn({1, Hq, 4, D}, opts), torch::randn({1, Hk, 4, D}, opts),
                  torch::randn({1, Hk, 4, D}, opts),
                  {.inputs = torch::randn({1, 4, model_dim}, opts), .cache = &scratch});
  return module;
}

// Every --specs entry must be a mechanism this benchmark can decode: one that is malformed,
// unknown, out of range or refused by the decode cache whatever the head layout (checked with
// the key/value heads of each --heads layout as plain multi-head attention) is bad input, refused
// before anything runs. A refusal that only grouped-query heads bring stays a table row.
void check_specs(const Args& a, const std::vector<std::pair<int64_t, int64_t>>& layouts) {
  if (a.specs.empty()) throw InputError("--specs names no mechanism");
  for (const auto& spec : a.specs)
    for (const auto& layout : layouts) {
      const int64_t hk = layout.second;
      nn::DecodeCache scratch(1, hk, a.D, dtype_named(a.dtype));
      try {
        decode_module(a, spec, hk, hk, scratch);
      } catch (const InputError& e) {
        throw InputError(fmt::format("--specs '{}': {}", brief(spec), e.what()));
      }
    }
}

// One mechanism and head layout at every --ctx (the cache filled once for the largest).
std::vector<Row> bench_mechanism(const Args& a, const std::string& spec, int64_t Hq, int64_t Hk) {
  const int64_t D = a.D, model_dim = Hq * D;
  const int64_t cap = *std::max_element(a.ctx.begin(), a.ctx.end());
  const std::string heads = fmt::format("{}:{}", Hq, Hk);
  nn::DecodeCache scratch(1, Hk, D, dtype_named(a.dtype));
  std::optional<nn::Attention> module;
  try {
    module.emplace(decode_module(a, spec, Hq, Hk, scratch));
  } catch (const InputError& e) {
    return {Row{spec, heads, fmt::format("refused: {}", e.what())}};
  }
  const auto dtype = dtype_named(a.dtype);
  const torch::NoGradGuard no_grad;
  const auto opts = torch::TensorOptions().dtype(dtype);
  const bool biased = !(*module)->mechanism().biases.empty();
  // the cache: cap - 1 random tokens at positions 0..cap-2 (and room for the step's token)
  nn::DecodeCache cache(1, Hk, D, dtype, cap);
  const int64_t n = cap - 1;
  std::vector<torch::Tensor> content;
  for (const auto& c : scratch.content()) {
    auto shape = c.sizes().vec();
    shape[2] = n;
    content.push_back(0.1 * torch::randn(shape, c.options()));
  }
  cache.append(torch::randn({1, Hk, n, D}, opts), torch::randn({1, Hk, n, D}, opts),
               torch::arange(n, torch::kDouble).unsqueeze(0), torch::full({1}, n, torch::kLong),
               content);
  const auto q = torch::randn({1, Hq, 1, D}, opts), k = torch::randn({1, Hk, 1, D}, opts),
             v = torch::randn({1, Hk, 1, D}, opts), x = torch::randn({1, 1, model_dim}, opts);
  // the user's static cache and RoPE table (sdpa_step)
  const auto Ks = torch::randn({1, Hk, cap, D}, opts), Vs = torch::randn({1, Hk, cap, D}, opts);
  // (computed in float32 and stored in the model's dtype, as HF's rotary embedding does)
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat);
  const auto inv = torch::pow(10000.0, -torch::arange(0, D, 2, f32) / static_cast<double>(D));
  const auto ang = torch::outer(torch::arange(cap, f32), inv);
  const auto cos_t = torch::cat({ang, ang}, -1).cos().to(dtype),
             sin_t = torch::cat({ang, ang}, -1).sin().to(dtype);
  const bool gqa = Hq != Hk;

  std::vector<Row> rows;
  for (const int64_t ctx : a.ctx) {
    // each case streams its own keys and values, as a decoder does: a case reading another's
    // would find them in the cache where that case left them
    const auto K = torch::randn({1, Hk, ctx, D}, opts), V = torch::randn({1, Hk, ctx, D}, opts);
    const auto Kb = biased ? torch::randn({1, Hk, ctx, D}, opts) : torch::Tensor(),
               Vb = biased ? torch::randn({1, Hk, ctx, D}, opts) : torch::Tensor();
    const auto bias_row = 0.1 * torch::randn({1, Hq, 1, ctx}, opts);
    std::vector<std::pair<std::string, std::function<void()>>> cases = {
        {"ours",
         [&] {
           cache.lengths().fill_(ctx - 1);
           (*module)->forward(q, k, v, {.inputs = x, .cache = &cache});
         }},
        {"sdpa", [&] { at::scaled_dot_product_attention(q, K, V, {}, 0.0, false, {}, gqa); }}};
    if (biased) {
      cases.emplace_back("sdpa_bias", [&] {
        at::scaled_dot_product_attention(q, Kb, Vb, bias_row, 0.0, false, {}, gqa);
      });
    } else {
      cases.emplace_back("sdpa_step", [&] {
        const auto c = cos_t.narrow(0, ctx - 1, 1), s = sin_t.narrow(0, ctx - 1, 1);
        const auto qr = rope_half(q, c, s), kr = rope_half(k, c, s);
        Ks.narrow(2, ctx - 1, 1).copy_(kr);
        Vs.narrow(2, ctx - 1, 1).copy_(v);
        at::scaled_dot_product_attention(qr, Ks.narrow(2, 0, ctx), Vs.narrow(2, 0, ctx), {}, 0.0,
                                         false, {}, gqa);
      });
    }
    std::map<std::string, std::vector<double>> t;
    for (int w = 0; w < a.warmup; ++w)
      for (auto& [name, f] : cases) f();
    RoundOrder order(cases.size());
    for (int r = 0; r < a.rounds; ++r)
      for (const size_t i : order.next()) t[cases[i].first].push_back(time_ms(cases[i].second));
    Row row{spec, heads, "", ctx};
    for (const auto& [name, ts] : t) {
      row.ms[name] = median(ts);
      std::vector<double> per;
      for (size_t i = 0; i < ts.size(); ++i) per.push_back(t["ours"][i] / ts[i]);
      row.ratio[name] = median(per);
    }
    rows.push_back(row);
  }
  return rows;
}

void run(const Args& a) {
  set_threads(a.threads);
  for (const int64_t c : a.ctx)
    if (c < 2) throw InputError(fmt::format("--ctx values must be >= 2, got {}", c));
  std::vector<std::pair<int64_t, int64_t>> layouts;
  for (const auto& h : a.heads) layouts.push_back(parse_heads(h));
  if (layouts.empty()) throw InputError("--heads names no layout");
  check_specs(a, layouts);
  check_json_out(a.json_out, kJsonHeader);  // before anything runs
  std::vector<Row> rows;
  for (const auto& spec : a.specs)
    for (const auto& [hq, hk] : layouts)
      for (auto& r : bench_mechanism(a, spec, hq, hk)) rows.push_back(std::move(r));
  const std::string head = fmt::format(
      "relpos bench decode: torch {}, {} threads, B 1, D {}, {}, {} rounds (medians; "
      "ratios: median over rounds of ours / case)",
      torch_version(), used_omp_threads(), a.D, c10::toString(dtype_named(a.dtype)), a.rounds);
  json out = json::array();
  for (const auto& r : rows) {
    json j{{"spec", r.spec}, {"heads", r.heads}, {"ctx", r.ctx}};
    if (!r.note.empty()) j["note"] = r.note;
    for (const auto& [name, ms] : r.ms) {
      j["ms"][name] = ms;
      j["tokens_per_s"][name] = 1e3 / ms;
    }
    for (const auto& [name, x] : r.ratio)
      if (name != "ours") j["ours_over"][name] = x;
    out.push_back(j);
  }
  if (a.format == "json") {
    std::cout << json{{"header", head}, {"rows", out}}.dump(2) << "\n";
  } else {
    std::cout << head << "\n\n"
              << "| mechanism | Hq:Hk | ctx | ours ms | ours tok/s | sdpa ms | ours / sdpa | "
                 "baseline | baseline ms | ours / baseline |\n"
              << "|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : rows) {
      if (!r.note.empty()) {
        std::cout << fmt::format("| {} | {} | | {} | | | | | | |\n", r.spec, r.heads, r.note);
        continue;
      }
      const std::string base = r.ms.count("sdpa_bias") ? "sdpa_bias" : "sdpa_step";
      std::cout << fmt::format(
          "| {} | {} | {} | {:.3f} | {:.0f} | {:.3f} | {:.2f} | {} | {:.3f} | {:.2f} |\n", r.spec,
          r.heads, r.ctx, r.ms.at("ours"), 1e3 / r.ms.at("ours"), r.ms.at("sdpa"),
          r.ratio.at("sdpa"), base, r.ms.at(base), r.ratio.at(base));
    }
  }
  write_json_out(a.json_out, kJsonHeader, json{{"header", head}, {"rows", out}}.dump(2) + "\n");
}

}  // namespace

void add_decode_command(CLI::App& app) {
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "decode",
      "One decode step of nn::Attention with a DecodeCache (per mechanism, ctx, MHA/GQA) vs "
      "at::scaled_dot_product_attention on a cached K/V: tokens/s and per-round ratios");
  cmd->add_option("--ctx", a->ctx, "context lengths, comma-separated (default 1k,4k,16k,32k,64k)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 22));
  cmd->add_option("--heads", a->heads, "Hq:Hk layouts, comma-separated (default 8:8,8:2)")
      ->delimiter(',');
  cmd->add_option("--specs", a->specs,
                  "mechanisms, ';'-separated (default rope;jordan(m=2);alibi;t5_bias;fox;"
                  "grape_ap)")
      ->delimiter(';');
  cmd->add_option("--D", a->D, "head dimension")->check(CLI::Range(2, 1024));
  cmd->add_option("--rounds", a->rounds, "timed rounds (every case once per round)")
      ->check(CLI::Range(1, 10000));
  cmd->add_option("--warmup", a->warmup, "untimed rounds first")->check(CLI::Range(0, 100));
  cmd->add_option("--threads", a->threads, "threads (at::set_num_threads); 0: LibTorch's default")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--dtype", a->dtype,
                  "storage of the module, its cache and the baselines' tensors: fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  cmd->add_option("--format", a->format, "md or json")->check(CLI::IsMember({"md", "json"}));
  cmd->add_option("--json-out", a->json_out, "also write the JSON report to this file");
  cmd->callback([a] { run(*a); });
}

}  // namespace relpos::bench
