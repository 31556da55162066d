#include "train/step_bench.hpp"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>

#include "core/types.hpp"

namespace relpos::train {

std::string step_benchmark(const models::ModelConfig& base, int64_t T, int64_t batch, int rounds,
                           const std::vector<StepBenchCase>& cases, int threads) {
  at::set_num_threads(threads);
  omp_set_num_threads(threads);
  at::globalContext().setFlushDenormal(true);  // as run_training
  struct Entry {
    models::TransformerLM model{nullptr};
    std::unique_ptr<torch::optim::AdamW> opt;
    std::vector<double> ms;
  };
  std::vector<Entry> entries;
  for (const auto& c : cases) {
    auto mc = base;
    mc.mechanism = c.mechanism;
    mc.attention = c.attention;
    torch::manual_seed(0);
    Entry e;
    e.model = models::TransformerLM(mc);
    e.opt = std::make_unique<torch::optim::AdamW>(e.model->parameters(),
                                                  torch::optim::AdamWOptions(5e-4));
    entries.push_back(std::move(e));
  }
  torch::manual_seed(1);
  const auto tokens = torch::randint(0, base.vocab, {batch, T}, torch::kLong);
  const auto step = [&](Entry& e) {
    const auto logits = e.model->forward(tokens);
    const auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, base.vocab}),
                                                           tokens.reshape({-1}));
    e.opt->zero_grad();
    loss.backward();
    e.opt->step();
  };
  for (auto& e : entries) step(e);  // warm-up: allocations, trig tables, thread pools
  // round robin, the order reversed every other round: no case always runs right after the same
  // other one (whose freed memory and cache state it inherits)
  for (int r = 0; r < rounds; ++r)
    for (size_t n = 0; n < entries.size(); ++n) {
      auto& e = entries[r % 2 ? entries.size() - 1 - n : n];
      const auto t0 = std::chrono::steady_clock::now();
      step(e);
      e.ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  std::string md = fmt::format(
      "model d {} / {} heads / {} layers / ratio {} / {} pairs, T {}, batch {}, {} threads, {} "
      "rounds (medians, round robin, order reversed every other round)\n\n"
      "| mechanism | attention | ms / step | tokens/s | step vs first | "
      "vs sdpa (per round) | vs sdpa_table (per round) | every round (ms) |\n"
      "|---|---|---:|---:|---:|---:|---:|---|\n",
      base.d_model, base.heads, base.layers, base.mlp_ratio, to_string(base.layout), T, batch,
      threads, rounds);
  const double first = median(entries.front().ms);
  for (size_t i = 0; i < entries.size(); ++i) {
    const double m = median(entries[i].ms);
    std::string all;
    for (double x : entries[i].ms) all += fmt::format("{}{:.0f}", all.empty() ? "" : " ", x);
    // against the same mechanism on each SDPA model, when it ran: ratio of the medians, and the
    // median of the per-round ratios (the two ran in the same round)
    const auto versus = [&](const std::string& attention) {
      for (size_t j = 0; j < entries.size(); ++j)
        if (cases[j].attention == attention && cases[j].mechanism == cases[i].mechanism) {
          std::vector<double> per;
          for (size_t r = 0; r < entries[i].ms.size(); ++r)
            per.push_back(entries[i].ms[r] / entries[j].ms[r]);
          return fmt::format("{:.3f} ({:.3f})", m / median(entries[j].ms), median(per));
        }
      return std::string("-");
    };
    md +=
        fmt::format("| {} | {} | {:.1f} | {:.0f} | {:.3f}x | {} | {} | {} |\n", cases[i].mechanism,
                    cases[i].attention, m, 1e3 * static_cast<double>(batch * T) / m, m / first,
                    versus("sdpa"), versus("sdpa_table"), all);
  }
  return md;
}

}  // namespace relpos::train
