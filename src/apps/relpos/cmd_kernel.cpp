// relpos kernel: the primitive lag features of a mechanism's relative kernel, per lag.
#include <iostream>
#include <random>

#include "apps/relpos/commands.hpp"
#include "apps/relpos/table.hpp"
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
};
LagRange parse_lags(const std::string& s) {
  LagRange r{0, 0, 1};
  const auto c1 = s.find(':');
  try {
    if (c1 == std::string::npos) throw std::invalid_argument("no ':'");
    r.a = std::stod(s.substr(0, c1));
    const auto c2 = s.find(':', c1 + 1);
    r.b = std::stod(s.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1));
    if (c2 != std::string::npos) r.step = std::stod(s.substr(c2 + 1));
  } catch (const std::exception&) {
    throw InputError(fmt::format("--lags '{}' must be A:B or A:B:STEP", s));
  }
  if (!(r.step > 0) || r.b < r.a || (r.b - r.a) / r.step > 1e7)
    throw InputError(fmt::format("--lags '{}' needs A <= B, STEP > 0 and at most 1e7 lags", s));
  return r;
}
}  // namespace

void add_kernel_command(CLI::App& app) {
  auto a = std::make_shared<KernelArgs>();
  auto* cmd = app.add_subcommand("kernel", "Primitive lag features of a mechanism's relative kernel");
  cmd->add_option("--enc", a->spec, "mechanism spec")->required();
  cmd->add_option("--lags", a->lags, "A:B[:STEP], inclusive");
  cmd->add_option("--format", a->format, "csv, md or json")->check(CLI::IsMember({"csv", "md", "json"}));
  cmd->add_option("--params", a->params, "default or random")->check(CLI::IsMember({"default", "random"}));
  cmd->add_option("--head-dim", a->head_dim, "head dimension")->check(CLI::Range(2, 4096));
  cmd->add_option("--heads", a->heads, "heads")->check(CLI::Range(1, 256));
  cmd->add_option("--head", a->head, "which head's kernel")->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", a->seed, "seed for --params random");
  cmd->callback([a] {
    const Mechanism m = build_mechanism(a->spec, a->head_dim, a->heads);
    if (a->head >= m.heads) throw InputError(fmt::format("--head {} >= heads {}", a->head, m.heads));
    std::mt19937_64 rng(a->seed);
    const ParamValues p = a->params == "random" ? random_params(m, rng) : default_params(m);
    const LagRange lr = parse_lags(a->lags);
    Table t;
    t.header.push_back("lag");
    for (const auto& f : lag_features(m, p, a->head, lr.a)) t.header.push_back(f.name);
    const auto n = static_cast<int64_t>(std::floor((lr.b - lr.a) / lr.step + 1e-9)) + 1;
    for (int64_t i = 0; i < n; ++i) {
      const double d = lr.a + lr.step * i;
      std::vector<std::string> row{fmt::format("{:g}", d)};
      for (const auto& f : lag_features(m, p, a->head, d)) row.push_back(fmt::format("{:.17g}", f.value));
      t.rows.push_back(std::move(row));
    }
    if (a->format == "csv") {
      t.write_csv(std::cout);
    } else if (a->format == "md") {
      std::cout << "kernel of " << m.spec << " (head " << a->head << ")\n\n";
      t.write_markdown(std::cout);
    } else {
      nlohmann::json j{{"spec", m.spec}, {"head", a->head}, {"columns", t.header}, {"rows", t.rows}};
      std::cout << j.dump(2) << "\n";
    }
  });
}

}  // namespace relpos::app
