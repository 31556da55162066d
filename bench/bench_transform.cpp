// Forward + backward of the position-wise transforms: our kernel (through the autograd function
// and module, as a user calls it) against the same math composed from plain LibTorch ops, and the
// achieved bandwidth against a memcpy of the same number of bytes - all in this one binary.
//
//   build/bench_transform [--retain-memory] [--benchmark_repetitions=N]
//
// --retain-memory asks glibc to keep freed memory (mallopt: no mmap for tensors up to 32 MiB, no
// trimming), as tcmalloc/jemalloc or a caching allocator would: every fresh 16 MiB tensor is
// otherwise returned to the OS and page-faulted in again on the next call, which on this VM costs
// more than the arithmetic and hits the composed baseline (many temporaries) hardest.
//
// Prints Google Benchmark's table, then a summary of medians: speedup over composed and the
// fraction of memcpy bandwidth.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <malloc.h>
#include <omp.h>

#include <cstring>
#include <map>

#include "core/registry.hpp"
#include "kernels/transform.hpp"
#include "torch/composed.hpp"
#include "torch/encoding.hpp"

namespace {

using namespace relpos;

constexpr int64_t B = 1, H = 8, T = 8192, D = 64;
const int64_t kTensorBytes = B * H * T * D * static_cast<int64_t>(sizeof(float));

struct Case {
  std::string name, spec;
  int64_t tensors_moved;  // fwd: read q,k write q~,k~; bwd: read 2 grads, write 2 (+ read q,k for
                          // params)
};
const Case kCases[] = {{"rope", "rope", 8},
                       {"jordan_m2", "jordan(m=2, regime=raw, eta0=0.05)", 10}};

struct Inputs {
  nn::PositionEncoding enc;
  torch::Tensor q, k, gq, gk, pos;
  explicit Inputs(const std::string& spec)
      : enc(spec, D, H, nn::EncodingOptions{Layout::Interleaved, /*check_finite=*/false}) {
    torch::manual_seed(0);
    q = torch::randn({B, H, T, D}).requires_grad_(true);
    k = torch::randn({B, H, T, D}).requires_grad_(true);
    gq = torch::randn({B, H, T, D});
    gk = torch::randn({B, H, T, D});
    pos = torch::arange(T, torch::kDouble);
  }
};

void run_fwd_bwd(benchmark::State& state, const Case& c, bool composed) {
  Inputs in(c.spec);
  const double center = in.enc->center_for(in.pos);
  for (auto _ : state) {
    std::vector<torch::Tensor> out;
    if (composed) {
      out = nn::composed_transform_qk(in.enc->mechanism(), Layout::Interleaved,
                                      in.enc->kernel_params(), in.q, in.k, in.pos, center);
    } else {
      auto o = in.enc->forward(in.q, in.k, in.pos);
      out = {o.q, o.k};
    }
    torch::autograd::backward(out, {in.gq, in.gk});
    in.q.mutable_grad().reset();
    in.k.mutable_grad().reset();
    for (auto& p : in.enc->parameters()) p.mutable_grad().reset();
  }
  state.SetBytesProcessed(state.iterations() * c.tensors_moved * kTensorBytes);
}

// memcpy of the same bytes (a copy reads and writes, so bytes/2 are copied), on all threads.
void run_memcpy(benchmark::State& state, const Case& c) {
  const int64_t n = c.tensors_moved * kTensorBytes / 2;
  std::vector<char> src(static_cast<size_t>(n), 1), dst(static_cast<size_t>(n), 0);
  for (auto _ : state) {
#pragma omp parallel
    {
      const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t chunk = (n + nt - 1) / nt, a = t * chunk, b = std::min(n, a + chunk);
      if (a < b) std::memcpy(dst.data() + a, src.data() + a, static_cast<size_t>(b - a));
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * n);
}

// The kernels alone on pre-allocated, pre-faulted buffers (no autograd, no allocation): where the
// time goes. pass 0: trig table, 1: forward, 2: backward with every gradient.
void run_raw(benchmark::State& state, const Case& c, int pass) {
  const Mechanism m = build_mechanism(c.spec, D, H);
  const auto plan = kernels::TransformPlan::from(m, Layout::Interleaved);
  const ParamValues pv = default_params(m);
  std::vector<float> g(pv.gamma.begin(), pv.gamma.end()), e(pv.eta.begin(), pv.eta.end()),
      gt(pv.gates.begin(), pv.gates.end()), a0(pv.alpha0.begin(), pv.alpha0.end());
  std::vector<double> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<double>(t);
  const kernels::Dims dims{B, H, T};
  const kernels::Positions P{pos.data(), false, m.resolve_center(0, T - 1)};
  // torch's buffers, 64-byte aligned as the op's are (so the kernels take the same paths: a
  // rotation whose outputs outgrow the cache streams them only to aligned rows)
  const auto buffer = [](float fill) { return torch::full({B * H * T * D}, fill); };
  auto q = buffer(0.5f), k = buffer(0.25f), qo = buffer(0), ko = buffer(0), gq = buffer(0),
       gk = buffer(0);
  std::vector<float> dg(g.size()), de(e.size());
  auto trig = kernels::build_trig_table<float>(plan, dims, P);
  const kernels::Params<float> par{g.data(), e.data(), gt.data(), a0.data()};
  const auto f = [](torch::Tensor& t) { return t.data_ptr<float>(); };
  for (auto _ : state) {
    if (pass == 0) {
      kernels::fill_trig_table<float>(plan, dims, P, trig.cos.data(), trig.sin.data());
    } else if (pass == 1) {
      kernels::transform_forward<float>(plan, dims, P, par, trig.view(), f(q), f(k), f(qo), f(ko));
    } else {
      kernels::transform_backward<float>(plan, dims, P, par, trig.view(), f(q), f(k), f(qo), f(ko),
                                         f(gq), f(gk), {dg.data(), de.data(), nullptr, nullptr});
    }
    benchmark::ClobberMemory();
  }
}

// Collects the median real time of every benchmark for the summary.
class MedianCollector : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> median_ms;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      const std::string name = r.benchmark_name();
      const bool is_median = r.run_type == Run::RT_Aggregate && r.aggregate_name == "median";
      const bool single = r.run_type == Run::RT_Iteration && r.repetitions <= 1;
      if (is_median || single) {
        std::string base = name.substr(0, name.find("/real_time"));
        median_ms[base] = r.GetAdjustedRealTime();  // in the run's time unit (ms below)
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

}  // namespace

int main(int argc, char** argv) {
  bool retain = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--retain-memory") == 0) {
      retain = true;
      continue;
    }
    args.push_back(argv[i]);
  }
  if (retain) {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  at::set_num_threads(omp_get_max_threads());
  for (const auto& c : kCases) {
    benchmark::RegisterBenchmark(("kernel/" + c.name).c_str(),
                                 [c](benchmark::State& s) { run_fwd_bwd(s, c, false); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("composed/" + c.name).c_str(),
                                 [c](benchmark::State& s) { run_fwd_bwd(s, c, true); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("memcpy/" + c.name).c_str(),
                                 [c](benchmark::State& s) { run_memcpy(s, c); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    const char* passes[] = {"trig", "fwd", "bwd"};
    for (int pass = 0; pass < 3; ++pass)
      benchmark::RegisterBenchmark(("raw_" + std::string(passes[pass]) + "/" + c.name).c_str(),
                                   [c, pass](benchmark::State& s) { run_raw(s, c, pass); })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  }
  std::string reps = "--benchmark_repetitions=9";
  bool has_reps = false;
  for (size_t i = 1; i < args.size(); ++i)
    has_reps |= std::strncmp(args[i], "--benchmark_repetitions", 23) == 0;
  if (!has_reps) args.push_back(reps.data());
  std::string agg = "--benchmark_report_aggregates_only=true";
  args.push_back(agg.data());
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  MedianCollector rep;
  benchmark::RunSpecifiedBenchmarks(&rep);
  fmt::print(
      "\nforward+backward, B={} H={} T={} D={} fp32, {} threads, kernels: {}, allocator: {}, "
      "medians\n\n",
      B, H, T, D, omp_get_max_threads(), kernels::kernel_isa(),
      retain ? "glibc retaining freed memory" : "glibc default");
  fmt::print(
      "| transform | kernel ms | composed ms | speedup | memcpy ms (same bytes) | kernel GB/s | "
      "memcpy GB/s | fraction of memcpy |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (const auto& c : kCases) {
    const double tk = rep.median_ms["kernel/" + c.name], tc = rep.median_ms["composed/" + c.name],
                 tm = rep.median_ms["memcpy/" + c.name];
    if (tk <= 0 || tc <= 0 || tm <= 0) continue;
    const double gb = c.tensors_moved * kTensorBytes / 1e9;
    fmt::print("| {} | {:.2f} | {:.2f} | {:.1f}x | {:.2f} | {:.1f} | {:.1f} | {:.0f}% |\n", c.name,
               tk, tc, tc / tk, tm, gb / (tk / 1e3), gb / (tm / 1e3), 100.0 * tm / tk);
  }
  fmt::print(
      "\nkernels alone on pre-faulted buffers (medians, ms): trig table / forward / backward\n\n");
  fmt::print("| transform | trig | forward | backward (all gradients) |\n|---|---|---|---|\n");
  for (const auto& c : kCases)
    fmt::print("| {} | {:.2f} | {:.2f} | {:.2f} |\n", c.name, rep.median_ms["raw_trig/" + c.name],
               rep.median_ms["raw_fwd/" + c.name], rep.median_ms["raw_bwd/" + c.name]);
  benchmark::Shutdown();
  return 0;
}
