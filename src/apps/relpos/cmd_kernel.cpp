// relpos kernel: the primitive lag features of a mechanism's relative kernel, per lag.
#include <cmath>
#include <iostream>
#include <optional>
#include <random>
#include <string_view>

#include "apps/relpos/commands.hpp"
#include "apps/relpos/table.hpp"
#include "core/parse.hpp"
#include "core/registry.hpp"

namespace relpos::app {

namespace {
struct KernelArgs {
  std::string spec, lags = "0:16", format = "csv", params = "default";
  int head_dim = 64, heads = 8, head = 0;
  uint64_t seed = 1;
};

struct LagRange {
  double a, b, step;
  int64_t count;
};
LagRange parse_lags(const std::string& s) {
  const auto bad = [&] {
    return InputError(
        fmt::format("--lags '{}' must be A:B or A:B:STEP with finite numbers", brief(s)));
  };
  std::vector<std::string_view> parts;
  for (size_t a = 0;;) {
    const auto c = s.find(':', a);
    parts.push_back(
        std::string_view(s).substr(a, c == std::string::npos ? std::string::npos : c - a));
    if (c == std::string::npos) break;
    a = c + 1;
  }
  if (parts.size() < 2 || parts.size() > 3) throw bad();
  const auto a = parse_finite_double(parts[0]), b = parse_finite_double(parts[1]);
  const auto step = parts.size() == 3 ? parse_finite_double(parts[2]) : std::optional<double>(1.0);
  if (!a || !b || !step) throw bad();
  if (!(*step > 0) || *b < *a || (*b - *a) / *step > 1e7)
    throw InputError(
        fmt::format("--lags '{}' needs A <= B, STEP > 0 and at most 1e7 lags", brief(s)));
  LagRange r{*a, *b, *step, static_cast<int64_t>(std::floor((*b - *a) / *step + 1e-9)) + 1};
  // every lag must be a distinct double: a step below the resolution at A would print repeats
  if (r.count > 1 && (r.a + r.step == r.a || r.b - r.step == r.b))
    throw InputError(fmt::format("--lags '{}': STEP {} is below the resolution of float64 at {}",
                                 brief(s), *step, std::max(std::abs(r.a), std::abs(r.b))));
  return r;
}
}  // namespace

void add_kernel_command(CLI::App& app) {
  auto a = std::make_shared<KernelArgs>();
  auto* cmd =
      app.add_subcommand("kernel", "Primitive lag features of a mechanism's relative kernel");
  cmd->add_option("--enc", a->spec, "mechanism spec")->required();
  cmd->add_option("--lags", a->lags, "A:B[:STEP], inclusive");
  cmd->add_option("--format", a->format, "csv, md or json")
      ->check(CLI::IsMember({"csv", "md", "json"}));
  cmd->add_option("--params", a->params, "default or random")
      ->check(CLI::IsMember({"default", "random"}));
  cmd->add_option("--head-dim", a->head_dim, "head dimension")->check(CLI::Range(2, 4096));
  cmd->add_option("--heads", a->heads, "heads")->check(CLI::Range(1, 256));
  cmd->add_option("--head", a->head, "which head's kernel")->check(CLI::NonNegativeNumber);
  add_seed_option(cmd, &a->seed, "seed for --params random");
  cmd->callback([a] {
    const Mechanism m = build_mechanism(a->spec, a->head_dim, a->heads);
    // a mechanism whose scores these features do not describe: refused by name, never a table
    // without its terms
    if (const std::string why = lag_features_refusal(m); !why.empty())
      throw InputError(fmt::format("--enc '{}' ({}) has no lag kernel to print: {}", brief(a->spec),
                                   m.name, why));
    if (a->head >= m.heads)
      throw InputError(fmt::format("--head {} >= heads {}", a->head, m.heads));
    std::mt19937_64 rng(a->seed);
    const ParamValues p = a->params == "random" ? random_params(m, rng) : default_params(m);
    const LagRange lr = parse_lags(a->lags);
    Table t;
    t.header.push_back("lag");
    for (const auto& f : lag_features(m, p, a->head, lr.a)) t.header.push_back(f.name);
    for (int64_t i = 0; i < lr.count; ++i) {
      const double d = lr.a + lr.step * static_cast<double>(i);
      // shortest text that reads back as d: distinct lags get distinct labels
      std::vector<std::string> row{fmt::format("{}", d)};
      for (const auto& f : lag_features(m, p, a->head, d)) {
        if (!std::isfinite(f.value))
          throw InputError(
              fmt::format("{} at lag {} is not finite in float64 ({})", f.name, d, m.spec));
        row.push_back(fmt::format("{:.17g}", f.value));
      }
      t.rows.push_back(std::move(row));
    }
    const double far = std::max(std::abs(lr.a), std::abs(lr.b));
    if (clamp_ratio(m, p, far, a->head) > 1)
      std::cerr << fmt::format(
          "relpos: note: |gamma d| exceeds max_exp for some lags in [{}, {}]; those values use the "
          "clamped exponent, as the kernels do\n",
          lr.a, lr.b);
    if (a->format == "csv") {
      t.write_csv(std::cout);
    } else if (a->format == "md") {
      std::cout << "kernel of " << m.spec << " (head " << a->head << ")\n\n";
      t.write_markdown(std::cout);
    } else {
      nlohmann::json j{
          {"spec", m.spec}, {"head", a->head}, {"columns", t.header}, {"rows", t.rows}};
      std::cout << j.dump(2) << "\n";
    }
  });
}

}  // namespace relpos::app
