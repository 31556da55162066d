// relpos linear-attention: times causal FAVOR+ linear attention (kernels/random_features.hpp:
// positive orthogonal random features, chunked causal kernel, keys stabilised by a running max so
// the output at i reads tokens <= i only, bit for bit) against the fused causal softmax
// attention kernel (kernels/attention) on the same fp32 inputs and thread count, and measures how
// far the linear output is from exact softmax attention with orthogonal and iid features.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>

#include "apps/cli_checks.hpp"
#include "apps/relpos/commands.hpp"
#include "apps/relpos/table.hpp"
#include "core/files.hpp"
#include "core/parse.hpp"
#include "core/plot.hpp"
#include "core/types.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/random_features.hpp"

namespace relpos::app {

namespace {

struct LinearArgs {
  std::string T_list = "1024,2048,4096,8192,16384", format = "md", out;
  int64_t m = 256, D = 64, H = 4, B = 1, repeats = 5, chunk = 64, softmax_max_T = 8192;
  double qk_std = 0.35;
  uint64_t seed = 1;
};

std::vector<int64_t> parse_T_list(const std::string& s) {
  std::vector<int64_t> out;
  size_t a = 0;
  while (true) {
    const auto c = s.find(',', a);
    const std::string part = s.substr(a, c == std::string::npos ? std::string::npos : c - a);
    const auto v = parse_int64(part, 1, int64_t{1} << 22);
    if (!v)
      throw InputError(
          fmt::format("--T '{}': '{}' is not an integer in [1, 2^22]", brief(s), brief(part)));
    out.push_back(*v);
    if (c == std::string::npos) break;
    a = c + 1;
  }
  return out;
}

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
}

template <class F>
double median_seconds(int64_t repeats, F&& f) {
  f();  // warm-up (first touch of the buffers, thread pool start)
  std::vector<double> t;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(std::move(t));
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    e += d * d, n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(e / (n > 0 ? n : 1.0));
}

struct Row {
  int64_t T = 0;
  double lin_fwd = 0, lin_fb = 0;
  std::optional<double> sm_fwd, sm_fb, err_orth, err_iid, err_uniform;
};

std::string ms(double s) {
  return fmt::format("{:.2f}", 1e3 * s);
}
std::string opt_ms(const std::optional<double>& s) {
  return s ? ms(*s) : "-";
}
std::string opt_sci(const std::optional<double>& x) {
  return x ? sci(*x) : "-";
}

// The inputs of one length and the linear kernel's two timed calls on them.
struct LinearProblem {
  kernels::FavorDims fd;
  kernels::FavorOptions fo;
  std::vector<float> q, k, v, dout, out, dq, dk, dv;
  kernels::FavorCache<float> cache;

  LinearProblem(const LinearArgs& a, int64_t T)
      : fd{a.B, a.H, T, a.D, a.D}, fo{kernels::FeatureSign::Minus, 0.0, true, a.chunk} {
    const auto n = static_cast<size_t>(a.B * a.H * T * a.D);
    std::mt19937_64 rng(a.seed ^ static_cast<uint64_t>(T));
    std::normal_distribution<float> N(0.f, 1.f);
    for (auto* buf : {&q, &k, &v, &dout, &out, &dq, &dk, &dv}) buf->resize(n);
    for (auto* buf : {&q, &k, &v, &dout})
      for (auto& x : *buf) x = N(rng);
    for (auto* buf : {&q, &k})
      for (auto& x : *buf) x *= static_cast<float>(a.qk_std);
  }
  void forward(const kernels::Projection& W) {
    kernels::favor_attention_forward<float>(fd, q.data(), k.data(), v.data(), W, fo, out.data(),
                                            cache);
  }
  void forward_backward(const kernels::Projection& W) {
    forward(W);
    kernels::favor_attention_backward<float>(fd, q.data(), k.data(), v.data(), W, fo, dout.data(),
                                             out.data(), cache, dq.data(), dk.data(), dv.data());
  }
};

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// time(T_hi) / time(T_lo) of the linear kernel, forward and forward+backward: the two lengths
// timed back to back in each round and the median of the rounds' ratios taken, so that the drift
// of a shared machine's speed over the run (2-3x between minutes here) cancels.
std::pair<double, double> interleaved_ratio(const LinearArgs& a, int64_t T_lo, int64_t T_hi,
                                            const kernels::Projection& W) {
  LinearProblem lo(a, T_lo), hi(a, T_hi);
  lo.forward_backward(W), hi.forward_backward(W);  // warm-up
  std::vector<double> rf, rb;
  for (int64_t r = 0; r < std::max<int64_t>(a.repeats, 5); ++r) {
    rf.push_back(seconds_of([&] { hi.forward(W); }) / seconds_of([&] { lo.forward(W); }));
    rb.push_back(seconds_of([&] { hi.forward_backward(W); }) /
                 seconds_of([&] { lo.forward_backward(W); }));
  }
  return {median(rf), median(rb)};
}

Row measure(const LinearArgs& a, int64_t T, const kernels::Projection& Wo,
            const kernels::Projection& Wi) {
  LinearProblem p(a, T);
  auto &q = p.q, &k = p.k, &v = p.v, &dout = p.dout, &out = p.out, &dq = p.dq, &dk = p.dk,
       &dv = p.dv;
  auto& cache = p.cache;
  const auto& fd = p.fd;
  const auto& fo = p.fo;
  const int64_t n = a.B * a.H * T * a.D;
  Row r;
  r.T = T;
  r.lin_fwd = median_seconds(a.repeats, [&] { p.forward(Wo); });
  r.lin_fb = median_seconds(a.repeats, [&] { p.forward_backward(Wo); });
  if (T > a.softmax_max_T) return r;
  const kernels::AttentionDims ad{a.B, a.H, a.H, T, T, a.D};
  kernels::AttentionOptions ao;
  ao.causal = true;
  std::vector<float> sm(n), lse(static_cast<size_t>(a.B * a.H * T));
  const auto fwd = [&] {
    kernels::attention_forward<float>(ad, q.data(), k.data(), v.data(), {}, {}, ao, sm.data(),
                                      lse.data());
  };
  r.sm_fwd = median_seconds(a.repeats, fwd);
  r.sm_fb = median_seconds(a.repeats, [&] {
    fwd();
    kernels::attention_backward<float>(ad, q.data(), k.data(), v.data(), {}, {}, ao, dout.data(),
                                       sm.data(), lse.data(), dq.data(), dk.data(), dv.data(), {});
  });
  kernels::favor_attention_forward<float>(fd, q.data(), k.data(), v.data(), Wo, fo, out.data(),
                                          cache);
  r.err_orth = rel_err(out, sm);
  kernels::favor_attention_forward<float>(fd, q.data(), k.data(), v.data(), Wi, fo, out.data(),
                                          cache);
  r.err_iid = rel_err(out, sm);
  // the trivial baseline: uniform causal weights (the mean of v over the visible keys)
  for (int64_t bh = 0; bh < a.B * a.H; ++bh) {
    std::vector<double> acc(static_cast<size_t>(a.D), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < a.D; ++c) {
        const int64_t i = (bh * T + t) * a.D + c;
        acc[c] += v[i];
        out[i] = static_cast<float>(acc[c] / static_cast<double>(t + 1));
      }
  }
  r.err_uniform = rel_err(out, sm);
  return r;
}

}  // namespace

void add_linear_attention_command(CLI::App& app) {
  auto a = std::make_shared<LinearArgs>();
  auto* cmd = app.add_subcommand(
      "linear-attention",
      "Time causal FAVOR+ linear attention (positive orthogonal random features) against the "
      "fused causal softmax kernel, fp32, and its error against exact softmax attention");
  cmd->add_option("--T", a->T_list, "sequence lengths, comma-separated");
  cmd->add_option("--m", a->m, "random features")->check(CLI::Range(1, 65536));
  cmd->add_option("--D", a->D, "head dimension (queries, keys and values)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--H", a->H, "heads")->check(CLI::Range(1, 1024));
  cmd->add_option("--B", a->B, "batch")->check(CLI::Range(1, 1024));
  cmd->add_option("--repeats", a->repeats, "timed repeats (median; one warm-up run before)")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--chunk", a->chunk, "tokens per chunk of the causal linear kernel")
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--softmax-max-T", a->softmax_max_T,
                  "skip the (quadratic) softmax kernel, and the error, above this T")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--format", a->format, "md, csv or json")
      ->check(CLI::IsMember({"md", "csv", "json"}));
  cmd->add_option("--out", a->out, "directory for CSV, JSON, Markdown and a PNG (gnuplot)");
  cmd->add_option("--qk-std", a->qk_std,
                  "standard deviation of the entries of q and k (v, dout: 1); FAVOR+'s variance "
                  "grows like exp(|q + k|^2 / sqrt(D))")
      ->check(FiniteRange(0.0, 100.0));
  add_seed_option(cmd, &a->seed, "seed of the inputs and the feature draws");
  cmd->callback([a] {
    const auto Ts = parse_T_list(a->T_list);
    std::optional<OutputDir> outdir;
    if (!a->out.empty()) outdir.emplace(a->out, "relpos linear-attention");
    const int threads = omp_get_max_threads();
    const auto Wo = kernels::draw_projection(kernels::ProjectionKind::Orthogonal, a->m, a->D,
                                             kernels::derive_seed(a->seed, 0));
    const auto Wi = kernels::draw_projection(kernels::ProjectionKind::Iid, a->m, a->D,
                                             kernels::derive_seed(a->seed, 1));
    std::vector<Row> rows;
    for (int64_t T : Ts) rows.push_back(measure(*a, T, Wo, Wi));

    Table t;
    t.header = {"T",
                "linear fwd ms",
                "linear fwd+bwd ms",
                "softmax fwd ms",
                "softmax fwd+bwd ms",
                "linear fwd+bwd / previous T",
                "rel err orth",
                "rel err iid",
                "rel err uniform"};
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      t.rows.push_back({fmt::format("{}", r.T), ms(r.lin_fwd), ms(r.lin_fb), opt_ms(r.sm_fwd),
                        opt_ms(r.sm_fb),
                        i > 0 ? fmt::format("{:.2f} (x{:.2f} T)", r.lin_fb / rows[i - 1].lin_fb,
                                            double(r.T) / rows[i - 1].T)
                              : "-",
                        opt_sci(r.err_orth), opt_sci(r.err_iid), opt_sci(r.err_uniform)});
    }
    // acceptance: time(16k) / time(8k) < 2.3 for the linear kernel (or the largest doubling)
    std::optional<std::pair<size_t, size_t>> pair;
    for (size_t i = 0; i < rows.size(); ++i)
      for (size_t j = 0; j < rows.size(); ++j)
        if (rows[j].T == 2 * rows[i].T && (!pair || rows[j].T > rows[pair->second].T))
          pair = {i, j};
    nlohmann::json j{{"command", "linear-attention"},
                     {"m", a->m},
                     {"D", a->D},
                     {"H", a->H},
                     {"B", a->B},
                     {"chunk", a->chunk},
                     {"repeats", a->repeats},
                     {"threads", threads},
                     {"dtype", "f32"},
                     {"seed", a->seed},
                     {"qk_std", a->qk_std},
                     {"columns", t.header},
                     {"rows", t.rows}};
    const auto num = [](const std::optional<double>& x) {
      return x ? nlohmann::json(*x) : nlohmann::json(nullptr);
    };
    for (const Row& r : rows)  // the same numbers unrounded (seconds; null where skipped)
      j["data"].push_back({{"T", r.T},
                           {"linear_fwd_s", r.lin_fwd},
                           {"linear_fwd_bwd_s", r.lin_fb},
                           {"softmax_fwd_s", num(r.sm_fwd)},
                           {"softmax_fwd_bwd_s", num(r.sm_fb)},
                           {"rel_err_orth", num(r.err_orth)},
                           {"rel_err_iid", num(r.err_iid)},
                           {"rel_err_uniform", num(r.err_uniform)}});
    std::string verdict;
    if (pair) {
      const auto [rf, rb] = interleaved_ratio(*a, rows[pair->first].T, rows[pair->second].T, Wo);
      verdict = fmt::format(
          "linear attention time({}) / time({}), timed back to back (median of the rounds' "
          "ratios): forward {:.2f}, forward+backward {:.2f} (acceptance < 2.3: {})",
          rows[pair->second].T, rows[pair->first].T, rf, rb,
          rf < 2.3 && rb < 2.3 ? "pass" : "FAIL");
      j["ratio"] = {{"T_hi", rows[pair->second].T},
                    {"T_lo", rows[pair->first].T},
                    {"forward", rf},
                    {"forward_backward", rb},
                    {"pass", rf < 2.3 && rb < 2.3}};
    }
    std::ostringstream md;
    md << fmt::format(
        "causal attention, fp32, B {} H {} D {}, FAVOR+ m {} (chunk {}), {} OpenMP threads "
        "(omp_get_max_threads), median of {} repeats; q, k ~ N(0, {}^2), v ~ N(0, 1); errors: "
        "relative Frobenius error of the output against the softmax kernel's (uniform: the "
        "causal mean of v, the trivial baseline)\n\n",
        a->B, a->H, a->D, a->m, a->chunk, threads, a->repeats, a->qk_std);
    t.write_markdown(md);
    if (!verdict.empty()) md << "\n" << verdict << "\n";
    std::ostringstream csv;
    t.write_csv(csv);
    const std::string text = a->format == "json"  ? j.dump(2) + "\n"
                             : a->format == "csv" ? csv.str()
                                                  : md.str();
    std::cout << text;
    if (outdir) {
      outdir->write("linear-attention.md", md.str());
      outdir->write("linear-attention.csv", csv.str());
      outdir->write("linear-attention.json", j.dump(2) + "\n");
      std::ostringstream data;  // numeric columns for gnuplot (NaN where skipped)
      data << "T,linear_fwd_s,linear_fb_s,softmax_fwd_s,softmax_fb_s\n";
      for (const Row& r : rows)
        data << fmt::format("{},{:.6g},{:.6g},{},{}\n", r.T, r.lin_fwd, r.lin_fb,
                            r.sm_fwd ? fmt::format("{:.6g}", *r.sm_fwd) : "NaN",
                            r.sm_fb ? fmt::format("{:.6g}", *r.sm_fb) : "NaN");
      outdir->write("linear-attention-times.csv", data.str());
      const std::string d = quote_gp("linear-attention-times.csv");
      std::ostringstream gp;
      gp << "set datafile separator ','\nset datafile missing 'NaN'\nset logscale xy 2\n"
         << "set xlabel 'T (tokens)'\nset ylabel 'seconds (median)'\nset grid\n"
         << "set key left top\nset title "
         << quote_gp(fmt::format("causal attention, fp32, H {} D {}, m {}, {} threads", a->H, a->D,
                                 a->m, threads))
         << "\nplot " << d << " using 1:2 skip 1 with linespoints title 'linear fwd', " << d
         << " using 1:3 skip 1 with linespoints title 'linear fwd+bwd', " << d
         << " using 1:4 skip 1 with linespoints title 'softmax fwd', " << d
         << " using 1:5 skip 1 with linespoints title 'softmax fwd+bwd'\n";
      const auto st = gnuplot_png(outdir->path(), "linear-attention", gp.str());
      if (st == PlotStatus::NoGnuplot)
        std::cerr << "relpos: gnuplot not found; wrote CSV and the .gp script only\n";
      else if (st == PlotStatus::Failed)
        std::cerr << "relpos: gnuplot failed on linear-attention.gp; CSV and script kept\n";
      outdir->finish();
    }
  });
}

}  // namespace relpos::app
