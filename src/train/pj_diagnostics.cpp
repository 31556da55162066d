#include "train/pj_diagnostics.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/files.hpp"
#include "core/plot.hpp"
#include "core/types.hpp"
#include "probes/targets.hpp"
#include "train/trainer.hpp"

namespace relpos::train {

namespace fs = std::filesystem;
namespace pj = probes::pj;

namespace {

// The PJ config of a layer's learned lag table (nullptr: none, or another family's): the
// documented exception to "no family names above the runtime", since these diagnostics report
// the PJ sectors themselves.
const PjBiasConfig* pj_config_of(models::TransformerLMImpl& model, size_t layer) {
  const auto* b = model.blocks()[layer]->encoding()->mechanism().learned_lag_bias();
  return b ? pj_config(*b) : nullptr;
}

// A layer's PJ parameters, float64 (the layer has a PJ bias: pj_configs checked it).
PjBiasParams pj_values_of(models::TransformerLMImpl& model, size_t layer) {
  const auto& enc = model.blocks()[layer]->encoding();
  return pj_params_from(*pj_config_of(model, layer), enc->lag_values());
}

// Every block's PJ config (InputError naming the mechanism when a block has none).
std::vector<PjBiasConfig> pj_configs(models::TransformerLMImpl& model) {
  auto& blocks = model.blocks();
  if (blocks.empty()) throw InputError("diagnose: the model has no blocks");
  std::vector<PjBiasConfig> out;
  for (size_t l = 0; l < blocks.size(); ++l) {
    const auto* c = pj_config_of(model, l);
    if (!c)
      throw InputError(fmt::format(
          "diagnose: the mechanism '{}' of layer {} has no PJ bias (pj_bias(...)); the PJ "
          "diagnostics need one. Its mechanism statistics per layer (mean gamma, |eta|, "
          "|gates|): {}",
          blocks[l]->encoding()->mechanism().spec, l, mechanism_stats_json(model)));
    out.push_back(*c);
  }
  return out;
}

std::string sectors_of(const PjBiasConfig& c) {
  std::vector<std::string> s;
  if (c.fj) s.emplace_back("fj");
  if (c.affine) s.emplace_back("affine");
  if (c.lc) s.emplace_back("lc");
  return fmt::format("{}", fmt::join(s, "+"));
}

std::string num(double x) {
  return fmt::format("{:.4g}", x);
}
std::string nums(const std::vector<double>& v) {
  std::vector<std::string> s;
  for (double x : v) s.push_back(num(x));
  return fmt::format("{}", fmt::join(s, " / "));
}
std::string order(int r) {
  return r < 0 ? std::string("-") : fmt::format("r{}", r);
}

nlohmann::json summary_json(const pj::PjSummary& s) {
  return {{"gates", {{"fj", s.gates[0]}, {"affine", s.gates[1]}, {"lc", s.gates[2]}}},
          {"slope", s.slope},
          {"damping", s.damping},
          {"fj_mass", s.fj_mass},
          {"lc_mass", s.lc_mass},
          {"high_order_mass", s.high_order_mass}};
}

std::string summary_row(const std::string& label, const pj::PjSummary& s) {
  return fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", label, num(s.gates[0]),
                     num(s.gates[1]), num(s.gates[2]), num(s.slope), num(s.damping),
                     nums(s.fj_mass), nums(s.lc_mass), num(s.high_order_mass));
}

}  // namespace

PjModelDiagnostics pj_model_diagnostics(models::TransformerLMImpl& model,
                                        const PjDiagnoseOptions& o) {
  const auto configs = pj_configs(model);
  if (o.length < 0)
    throw InputError(fmt::format("diagnose: --length must be >= 1, got {}", o.length));
  if (!o.target.empty()) {
    const auto names = probes::pj_target_names();
    if (std::find(names.begin(), names.end(), o.target) == names.end())
      throw InputError(fmt::format("diagnose: unknown target '{}' (valid: {})", o.target,
                                   fmt::join(names, ", ")));
  }
  PjModelDiagnostics d;
  d.mechanism = model.blocks().front()->encoding()->mechanism().spec;
  d.target = o.target;
  d.window = o.length > 0 ? o.length : static_cast<int64_t>(std::llround(4.0 * configs.front().L));
  if (d.window < 1) throw InputError("diagnose: the window (4 L) is empty; pass --length");
  std::vector<pj::PjSummary> layer_summaries;
  for (size_t l = 0; l < configs.size(); ++l) {
    const auto& c = configs[l];
    const auto params = pj_values_of(model, l);
    PjLayerDiagnostics ld;
    ld.layer = static_cast<int>(l);
    ld.config = c;
    std::vector<std::vector<double>> targets;
    if (!o.target.empty())
      for (int h = 0; h < params.heads; ++h) {
        auto& y = targets.emplace_back();
        for (int64_t i = 0; i < d.window; ++i)
          y.push_back(probes::pj_target(o.target, static_cast<double>(i),
                                        params.omega[static_cast<size_t>(h)], c.L));
      }
    ld.heads = pj::diagnose_pj_heads(c, params, d.window, o.target.empty() ? nullptr : &targets);
    ld.summary = pj::summarize_heads(ld.heads);
    layer_summaries.push_back(ld.summary);
    d.layers.push_back(std::move(ld));
  }
  d.summary = pj::summarize_layers(layer_summaries);
  return d;
}

PjModelDiagnostics pj_run_diagnostics(const fs::path& run_dir, const PjDiagnoseOptions& o) {
  auto run = load_trained_model(run_dir);
  auto d = pj_model_diagnostics(*run.model, o);
  d.step = run.step;
  return d;
}

std::string pj_diagnostics_markdown(const PjModelDiagnostics& d) {
  std::string s = "# PJ-RoPE bias diagnostics\n\n";
  s += fmt::format("mechanism `{}`", d.mechanism);
  if (d.step >= 0) s += fmt::format(", checkpoint step {}", d.step);
  s += fmt::format(
      "; window d = 0..{} (uniform weights); leave-one-order-out deltas against {}.\n"
      "Per-order columns list r = 0 / 1 / ... / R. Mass = gate alpha_r |zeta_r| (FJ, LC), "
      "normalised mass over both branches, energy = ||C_r|| / ||sum_r C_r|| over the window, "
      "high-order mass = sum over r >= 2 of the FJ + LC mass (unnormalised).\n",
      d.window - 1,
      d.target.empty() ? std::string("each head's own kernel (self: Delta_r = mean_d C_r(d)^2)")
                       : fmt::format("the target '{}'", d.target));
  for (const auto& l : d.layers) {
    s += fmt::format("\n## Layer {} (L = {}, R = {}, sectors {})\n\n", l.layer, num(l.config.L),
                     l.config.max_order, sectors_of(l.config));
    s += "| head | g_FJ | g_A | g_LC | slope | damping | omega (cycles/L) | FJ mass | LC mass | "
         "normalised mass | energy | LOO delta | high-order mass | top order (mass) | top order "
         "(energy) |\n"
         "|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|---:|---:|---:|\n";
    for (const auto& h : l.heads)
      s += fmt::format(
          "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", h.head,
          num(h.gates[0]), num(h.gates[1]), num(h.gates[2]), num(h.slope), num(h.damping),
          num(h.omega_cycles), nums(h.fj_mass), nums(h.lc_mass), nums(h.normalized_mass),
          nums(h.energy), nums(h.loo), num(h.high_order_mass), order(h.top_order_mass),
          order(h.top_order_energy));
  }
  s += "\n## Model summary (head mean, then layer mean)\n\n"
       "| layer | g_FJ | g_A | g_LC | slope | damping | FJ mass | LC mass | high-order mass |\n"
       "|---|---:|---:|---:|---:|---:|---|---|---:|\n";
  for (const auto& l : d.layers) s += summary_row(std::to_string(l.layer), l.summary);
  s += summary_row("**model**", d.summary);
  return s;
}

std::string pj_diagnostics_json(const PjModelDiagnostics& d) {
  nlohmann::json j;
  j["mechanism"] = d.mechanism;
  j["step"] = d.step >= 0 ? nlohmann::json(d.step) : nlohmann::json();
  j["window"] = d.window;
  j["loo_reference"] = d.target.empty() ? "self" : "target";
  j["target"] = d.target.empty() ? nlohmann::json() : nlohmann::json(d.target);
  j["layers"] = nlohmann::json::array();
  for (const auto& l : d.layers) {
    nlohmann::json heads = nlohmann::json::array();
    for (const auto& h : l.heads)
      heads.push_back({{"head", h.head},
                       {"gates", {{"fj", h.gates[0]}, {"affine", h.gates[1]}, {"lc", h.gates[2]}}},
                       {"slope", h.slope},
                       {"damping", h.damping},
                       {"omega", h.omega},
                       {"omega_cycles", h.omega_cycles},
                       {"fj_mass", h.fj_mass},
                       {"lc_mass", h.lc_mass},
                       {"normalized_mass", h.normalized_mass},
                       {"energy", h.energy},
                       {"loo", h.loo},
                       {"loo_reference", pj::loo_reference_name(h.loo_reference)},
                       {"high_order_mass", h.high_order_mass},
                       {"top_order_mass", h.top_order_mass},
                       {"top_order_energy", h.top_order_energy}});
    j["layers"].push_back({{"layer", l.layer},
                           {"L", l.config.L},
                           {"max_order", l.config.max_order},
                           {"sectors", sectors_of(l.config)},
                           {"heads", heads},
                           {"summary", summary_json(l.summary)}});
  }
  j["summary"] = summary_json(d.summary);
  return j.dump(2) + "\n";
}

std::string pj_lag_kernels_csv(models::TransformerLMImpl& model, int64_t len) {
  const auto configs = pj_configs(model);
  if (len < 1) throw InputError(fmt::format("diagnose: --length must be >= 1, got {}", len));
  std::string csv = "layer,head,d,bias\n";
  for (size_t l = 0; l < configs.size(); ++l) {
    const auto p = pj_values_of(model, l);
    const auto table = pj_lag_table(configs[l], p, len);
    for (int h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < len; ++i)
        csv += fmt::format("{},{},{},{:.9g}\n", l, h, i, table[static_cast<size_t>(h * len + i)]);
  }
  return csv;
}

bool write_pj_lag_kernel_plot(models::TransformerLMImpl& model, int64_t len, const fs::path& dir) {
  const std::string csv = pj_lag_kernels_csv(model, len);
  OutputDir out(dir, "relpos diagnose --out");  // the run-folder discipline (core/files.hpp)
  out.write("pj_lag_kernels.csv", csv);
  const size_t layers = model.blocks().size();
  const std::string data = quote_gp("pj_lag_kernels.csv");
  std::string gp = fmt::format(
      "set datafile separator ','\nset grid\nset key outside right top\nset xrange [0:{}]\n"
      "set multiplot layout {},1 title 'learned PJ lag kernels b_h(d)'\n",
      std::max<int64_t>(len - 1, 1), layers);
  for (size_t l = 0; l < layers; ++l) {
    const int heads = pj_values_of(model, l).heads;
    gp += fmt::format("set title 'layer {}'\nset xlabel 'lag d'\nset ylabel 'b_h(d)'\nplot ", l);
    for (int h = 0; h < heads; ++h)
      gp += fmt::format(
          "{}{} skip 1 using 3:(($1 == {} && $2 == {}) ? $4 : 1/0) with lines "
          "title 'head {}'",
          h ? ", " : "", data, l, h, h);
    gp += "\n";
  }
  gp += "unset multiplot\n";
  const int height = static_cast<int>(std::min<size_t>(400 * layers, 4000));
  const bool drawn =
      gnuplot_png(dir, "pj_lag_kernels", gp, 1400, std::max(height, 500)) == PlotStatus::Drawn;
  out.finish();
  return drawn;
}

}  // namespace relpos::train
