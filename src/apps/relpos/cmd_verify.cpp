// relpos verify: does each mechanism do what it declares? (relative law, shift invariance,
// norm growth with and without centring, exponent clamp), fp64 and fp32.
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "apps/cli_checks.hpp"
#include "apps/relpos/commands.hpp"
#include "apps/relpos/structured_report.hpp"
#include "apps/relpos/table.hpp"
#include "core/registry.hpp"
#include "core/rope_scaling.hpp"
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
  std::string rope_scaling;  // a JSON file holding a rope_scaling dictionary
  double max_position_embeddings = 0;
  bool structured = false;        // Theorem 1 of the structured rotations instead of the specs
  bool structured_sweep = false;  // their Theorem 2 sweep
  std::string dims = "1,2,3";
  std::string out;
};

// The --enc specs with the rule of a rope_scaling JSON file composed onto each.
std::vector<std::string> with_rope_scaling(const VerifyArgs& a) {
  if (a.rope_scaling.empty()) return a.specs;
  if (a.specs.empty())
    throw InputError("verify: --rope-scaling needs --enc (the rotary mechanisms to extend)");
  std::ifstream in(a.rope_scaling);
  if (!in) throw InputError(fmt::format("verify: cannot read --rope-scaling {}", a.rope_scaling));
  std::ostringstream text;
  text << in.rdbuf();
  std::optional<double> max_pos;
  if (a.max_position_embeddings > 0) max_pos = a.max_position_embeddings;
  // the dictionary as HF writes it (rope_theta, partial_rotary_factor and the rule's keys)
  std::vector<std::string> out;
  for (const auto& s : a.specs) out.push_back(rope_parameters_spec(s, text.str(), max_pos));
  return out;
}

// reasons quote |gamma p| and |q||k|: keep the markdown cells intact
std::string md_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}
}  // namespace

void add_verify_command(CLI::App& app) {
  auto a = std::make_shared<VerifyArgs>();
  auto* cmd = app.add_subcommand(
      "verify",
      fmt::format("Check each mechanism's declared exactness against the papers' float64 formulas. "
                  "Every pair of sampled positions is scored per spec, parameter set, dtype and "
                  "head (cost ~ specs x 2 x dtypes x heads x positions^2/2 x head_dim); runs "
                  "estimated above {:g} s on one core or {:g} GiB of buffers are refused (exit 2), "
                  "runs above a few seconds report progress on stderr",
                  diag::kVerifyBudgetSeconds, diag::kVerifyBudgetBytes / (1u << 30)));
  cmd->add_option("--enc", a->specs, "mechanism spec (repeatable); default: every mechanism");
  cmd->add_option("--len", a->len, "largest lag / position N")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--dtype", a->dtype, "f32, f64 or both")
      ->check(CLI::IsMember({"f32", "f64", "both"}));
  cmd->add_option("--format", a->format, "md, csv or json")
      ->check(CLI::IsMember({"md", "csv", "json"}));
  cmd->add_option("--layout", a->layout, "interleaved or half_split");
  cmd->add_option("--head-dim", a->head_dim,
                  "head dimension (orders that do not divide it use the nearest that fits); "
                  "bounded by the work limit")
      ->check(CLI::Range(2, 4096));
  cmd->add_option("--heads", a->heads, "heads; bounded by the work limit")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--positions", a->positions,
                  fmt::format("sampled positions (all pairs are scored); the whole run must fit "
                              "the work limit of about {:g} s on one core: one spec at 2000 "
                              "positions with the default heads and head dim takes ~35 s, every "
                              "default spec at 2000 positions is refused",
                              diag::kVerifyBudgetSeconds))
      ->check(CLI::Range(8, 2000));
  add_seed_option(cmd, &a->seed, "random seed");
  cmd->add_option("--rope-scaling", a->rope_scaling,
                  "JSON file with a model config's rope_scaling dictionary (HF keys): its rule is "
                  "added to every --enc spec (docs/rope-scaling.md)");
  cmd->add_option("--max-position-embeddings", a->max_position_embeddings,
                  "the model config's max_position_embeddings, where the rope_scaling dictionary "
                  "relies on it (dynamic without original_max_position_embeddings, longrope "
                  "without factor); read only with --rope-scaling")
      ->check(FiniteRange(1, 1e15));  // as rope_scaling.cpp bounds it
  cmd->add_flag("--structured", a->structured,
                "check Theorem 1 of the equivariant structured rotations instead of the specs: "
                "learned-basis (cayley, exp), axial, mixed and matrices-only (Lemma 1) families, "
                "fp64, PASS at <= 1e-12");
  cmd->add_flag("--structured-sweep", a->structured_sweep,
                "run the structured rotations' Theorem 2 sweep (commutator size x leakage) and fit "
                "its constant C; with --out DIR also DIR/theorem2.csv and DIR/theorem2.png");
  cmd->add_option("--dims", a->dims,
                  "--structured / --structured-sweep: position dimensions d_c, comma-separated "
                  "(default 1,2,3)");
  cmd->add_option("--out", a->out, "--structured-sweep: output directory");
  cmd->callback([a, cmd] {
    // nothing else reads it: given alone it would be ignored without a word
    if (cmd->count("--max-position-embeddings") > 0 && cmd->count("--rope-scaling") == 0)
      throw InputError(
          "verify: --max-position-embeddings is read only with --rope-scaling (the dictionary "
          "that may rely on it); give both, or leave it out");
    if (a->structured || a->structured_sweep) {
      for (const char* name : {"--enc", "--rope-scaling", "--len", "--dtype", "--layout",
                               "--head-dim", "--heads", "--positions"})
        if (cmd->count(name) > 0)
          throw InputError(fmt::format("verify: {} does not apply to --structured", name));
      const auto dims = parse_structured_dims(a->dims);
      bool ok = true;
      if (a->structured) ok = report_structured_theorem1(dims, a->seed, a->format) && ok;
      if (a->structured_sweep) ok = report_structured_sweep(dims, a->seed, a->format, a->out) && ok;
      if (!ok) throw ExitStatus{1};
      return;
    }
    for (const char* name : {"--dims", "--out"})
      if (cmd->count(name) > 0)
        throw InputError(
            fmt::format("verify: {} applies to --structured / --structured-sweep only", name));
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
    const auto specs = a->specs.empty() && a->rope_scaling.empty() ? verify_default_specs()
                                                                   : with_rope_scaling(*a);
    // refuses (InputError, exit 2) runs above the work limit before doing any; progress on stderr
    const std::vector<diag::VerifyRow> rows = diag::verify_specs(specs, o, dtypes, &std::cerr);
    int failed = 0;
    for (const auto& r : rows) failed += r.status == "FAIL" || r.status == "CLAMPED";
    if (a->format == "json") {
      nlohmann::json j = nlohmann::json::array();
      for (const auto& r : rows) j.push_back(diag::to_json(r));
      std::cout << nlohmann::json{{"max_lag", o.max_lag},
                                  {"exact_tol_f64", o.exact_tol},
                                  {"failed", failed},
                                  {"rows", j}}
                       .dump(2)
                << "\n";
    } else {
      Table t{{"spec", "D", "params", "dtype", "declared", "c0", "resid", "resid/|q||k|", "shift",
               "|k~|/|k| c/0", "|q~|/|q| c/0", "clamp c/0", "alibi lift", "status", "reason"},
              {}};
      for (const auto& r : rows)
        t.rows.push_back({r.spec, std::to_string(r.head_dim), r.params, r.dtype, r.declared,
                          fmt::format("{:g}", r.center), sci(r.residual), sci(r.residual_qk),
                          sci(r.shift_residual),
                          fmt::format("{:.3g} / {:.3g}", r.key_growth, r.key_growth_uncentered),
                          fmt::format("{:.3g} / {:.3g}", r.query_growth, r.query_growth_uncentered),
                          fmt::format("{} / {}", r.clamp_bound ? "yes" : "no",
                                      r.clamp_bound_uncentered ? "yes" : "no"),
                          r.alibi_lift_residual < 0 ? "-" : sci(r.alibi_lift_residual), r.status,
                          a->format == "md" ? md_escape(r.reason) : r.reason});
      if (a->format == "csv") {
        t.write_csv(std::cout);
      } else {
        std::cout << fmt::format(
            "relative law over positions in [0, {}] (lags up to {}), all pairs of {} sampled "
            "positions (rotations by vector positions: the cells of those raster indices on a "
            "grid of side ceil((max_lag + 1)^(1/d_c)), every pair); exact mechanisms must keep "
            "relative and shift residuals below {:g} in fp64; a non-finite number or a bound "
            "exponent clamp fails any row (see reason)\n\n",
            o.max_lag, o.max_lag, o.positions, o.exact_tol);
        t.write_markdown(std::cout);
        std::cout << fmt::format("\n{} of {} rows failed\n", failed, rows.size());
      }
    }
    if (failed) throw ExitStatus{1};
  });
}

}  // namespace relpos::app
