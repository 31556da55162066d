// relpos verify: does each mechanism do what it declares? (relative law, shift invariance,
// norm growth with and without centring, exponent clamp), fp64 and fp32.
#include <iostream>

#include "apps/relpos/commands.hpp"
#include "apps/relpos/table.hpp"
#include "core/registry.hpp"
#include "diag/verify.hpp"

namespace relpos::app {

namespace {
struct VerifyArgs {
  std::vector<std::string> specs;
  int64_t len = 32768;
  std::string dtype = "both";
  std::string format = "md";
  std::string layout = "interleaved";
  int head_dim = 64;
  int heads = 4;
  int positions = 80;
  uint64_t seed = 1;
};

nlohmann::json to_json(const diag::VerifyRow& r) {
  return {{"spec", r.spec},
          {"canonical", r.canonical},
          {"head_dim", r.head_dim},
          {"declared", r.declared},
          {"transform_exact", r.transform_exact},
          {"params", r.params},
          {"dtype", r.dtype},
          {"center", r.center},
          {"relative_residual", r.residual},
          {"relative_residual_qk_norm", r.residual_qk},
          {"shift_residual", r.shift_residual},
          {"key_growth_centered", r.key_growth},
          {"query_growth_centered", r.query_growth},
          {"key_growth_uncentered", r.key_growth_uncentered},
          {"query_growth_uncentered", r.query_growth_uncentered},
          {"clamp_bound_centered", r.clamp_bound},
          {"clamp_bound_uncentered", r.clamp_bound_uncentered},
          {"alibi_lift_residual", r.alibi_lift_residual < 0 ? nlohmann::json(nullptr)
                                                             : nlohmann::json(r.alibi_lift_residual)},
          {"status", r.status}};
}
}  // namespace

void add_verify_command(CLI::App& app) {
  auto a = std::make_shared<VerifyArgs>();
  auto* cmd = app.add_subcommand(
      "verify", "Check each mechanism's declared exactness against the papers' float64 formulas");
  cmd->add_option("--enc", a->specs, "mechanism spec (repeatable); default: every mechanism");
  cmd->add_option("--len", a->len, "largest lag / position N")->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--dtype", a->dtype, "f32, f64 or both")->check(CLI::IsMember({"f32", "f64", "both"}));
  cmd->add_option("--format", a->format, "md, csv or json")->check(CLI::IsMember({"md", "csv", "json"}));
  cmd->add_option("--layout", a->layout, "interleaved or half_split");
  cmd->add_option("--head-dim", a->head_dim, "head dimension (orders that do not divide it use the nearest that fits)")
      ->check(CLI::Range(2, 4096));
  cmd->add_option("--heads", a->heads, "heads")->check(CLI::Range(1, 256));
  cmd->add_option("--positions", a->positions, "sampled positions (all pairs are scored)")->check(CLI::Range(8, 2000));
  add_seed_option(cmd, &a->seed, "random seed");
  cmd->callback([a] {
    diag::VerifyOptions o;
    o.max_lag = a->len;
    o.head_dim = a->head_dim;
    o.heads = a->heads;
    o.positions = a->positions;
    o.seed = a->seed;
    o.layout = parse_layout(a->layout);
    std::vector<std::string> dtypes;
    if (a->dtype != "f32") dtypes.push_back("f64");
    if (a->dtype != "f64") dtypes.push_back("f32");
    const auto specs = a->specs.empty() ? verify_default_specs() : a->specs;
    std::vector<diag::VerifyRow> rows;
    for (const auto& s : specs)
      for (auto& r : diag::verify_spec(s, o, dtypes)) rows.push_back(std::move(r));
    int failed = 0;
    for (const auto& r : rows) failed += r.status == "FAIL" || r.status == "CLAMPED";
    if (a->format == "json") {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& r : rows) j.push_back(to_json(r));
      std::cout << nlohmann::json{{"max_lag", o.max_lag}, {"exact_tol_f64", o.exact_tol},
                                  {"failed", failed}, {"rows", j}}
                       .dump(2)
                << "\n";
    } else {
      Table t{{"spec", "D", "params", "dtype", "declared", "c0", "resid", "resid/|q||k|", "shift",
               "|k~|/|k| c/0", "|q~|/|q| c/0", "clamp c/0", "alibi lift", "status"},
              {}};
      for (const auto& r : rows)
        t.rows.push_back({r.spec, std::to_string(r.head_dim), r.params, r.dtype, r.declared,
                          fmt::format("{:g}", r.center), sci(r.residual), sci(r.residual_qk),
                          sci(r.shift_residual),
                          fmt::format("{:.3g} / {:.3g}", r.key_growth, r.key_growth_uncentered),
                          fmt::format("{:.3g} / {:.3g}", r.query_growth, r.query_growth_uncentered),
                          fmt::format("{} / {}", r.clamp_bound ? "yes" : "no",
                                      r.clamp_bound_uncentered ? "yes" : "no"),
                          r.alibi_lift_residual < 0 ? "-" : sci(r.alibi_lift_residual), r.status});
      if (a->format == "csv") {
        t.write_csv(std::cout);
      } else {
        std::cout << fmt::format(
            "relative law over positions in [0, {}] (lags up to {}), all pairs of {} sampled "
            "positions; exact mechanisms must stay below {:g} in fp64\n\n",
            o.max_lag, o.max_lag, o.positions, o.exact_tol);
        t.write_markdown(std::cout);
        std::cout << fmt::format("\n{} of {} rows failed\n", failed, rows.size());
      }
    }
    if (failed) throw ExitStatus{1};
  });
}

}  // namespace relpos::app
