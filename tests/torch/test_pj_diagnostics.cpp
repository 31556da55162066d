// PJ-RoPE bias diagnostics (train/pj_diagnostics.hpp, probes/pj_diagnostics.hpp): on a tiny model
// with a known parameter setting the gates, masses, energies, LOO deltas and both top orders equal
// values worked out by hand (and an independent evaluation of the kernel's formula); disabled
// sectors have zero mass; a tiny trained run gives the table, and bad runs give named errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/types.hpp"
#include "models/transformer.hpp"
#include "train/pj_diagnostics.hpp"
#include "train/trainer.hpp"

using namespace relpos;
namespace fs = std::filesystem;

namespace {

models::TransformerLM tiny_model(const std::string& mechanism) {
  torch::manual_seed(0);
  models::ModelConfig c;
  c.preset = models::Preset::PJ;
  c.vocab = 11;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 1;
  c.mechanism = mechanism;
  return models::TransformerLM(c);
}

// Sets the PJ parameter NAME (state-dict "pj_" + NAME) of layer 0 to `values` (row-major).
void set_pj(models::TransformerLM& m, const std::string& name, const std::vector<double>& values) {
  torch::NoGradGuard g;
  for (auto& p : m->named_parameters())
    if (p.key().ends_with("pj_" + name)) {
      auto t = torch::tensor(values, torch::kDouble).reshape(p.value().sizes());
      p.value().copy_(t);
      return;
    }
  FAIL() << "no parameter pj_" << name;
}

// The known setting (L = 8, R = 2, two heads; head 1 equals head 0 but for its gates):
//   gate logits (ln 2, 0, 0) -> gates (1/2, 1/4, 1/4)
//   FJ alpha logits (0, ln 2, 0) -> (1/4, 1/2, 1/4); |zeta_FJ| = (0.5, 0.2, 1.0)
//   LC alpha logits 0 -> 1/3 each; |zeta_LC| = (0.3, 0, 0)
//   omega = pi/2, damping softplus(0) = ln 2, slope softplus(0) = ln 2
void set_known(models::TransformerLM& m) {
  const double ln2 = std::log(2.0);
  set_pj(m, "gate_logits", {ln2, 0, 0, 0, 0, ln2});  // head 1: gates (1/4, 1/4, 1/2)
  set_pj(m, "fj_alpha_logits", {0, ln2, 0, 0, ln2, 0});
  set_pj(m, "lc_alpha_logits", {0, 0, 0, 0, 0, 0});
  set_pj(m, "fj_zeta_re", {0.4, 0.0, 0.6, 0.4, 0.0, 0.6});
  set_pj(m, "fj_zeta_im", {0.3, 0.2, 0.8, 0.3, 0.2, 0.8});
  set_pj(m, "lc_zeta_re", {0.3, 0, 0, 0.3, 0, 0});
  set_pj(m, "lc_zeta_im", {0, 0, 0, 0, 0, 0});
  set_pj(m, "omega", {M_PI / 2, M_PI / 2});
  set_pj(m, "raw_damping", {0, 0});
  set_pj(m, "raw_slope", {0, 0});
}

// C_r(d) of the known setting, written out from the formula (independent of the library).
double component(int r, double d, double g_fj, double g_lc) {
  const double L = 8, w = M_PI / 2, c = std::log(2.0);
  const double fj_alpha[3] = {0.25, 0.5, 0.25}, zre[3] = {0.4, 0.0, 0.6}, zim[3] = {0.3, 0.2, 0.8};
  const double jet = std::pow(d / L, r) / std::tgamma(r + 1.0);
  const double fj = g_fj * jet * std::exp(-c * d / L) * fj_alpha[r] *
                    (zre[r] * std::cos(w * d) - zim[r] * std::sin(w * d));
  // LC: only order 0 has an amplitude (beta_L^0 = 1), zeta 0.3, undamped, phase omega phi_L(d)
  const double phi = L * std::asinh(d / L);
  const double lc = r == 0 ? g_lc * (1.0 / 3) * 0.3 * std::cos(w * phi) : 0.0;
  return fj + lc;
}

fs::path temp_dir(const std::string& name) {
  const auto d =
      fs::temp_directory_path() / ("relpos-test-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

train::TrainConfig tiny_run(const std::string& mechanism) {
  train::TrainConfig c;
  c.name = "tiny";
  c.threads = 1;
  c.model.preset = models::Preset::PJ;
  c.model.d_model = 16;
  c.model.heads = 2;
  c.model.layers = 2;
  c.model.mechanism = mechanism;
  c.task.train_length = 16;
  c.optim.steps = 2;
  c.optim.batch = 2;
  c.eval.every = 0;
  c.eval.lengths = {16};
  c.eval.batches = 1;
  c.eval.batch_size = 2;
  c.checkpoint_every = 0;
  c.log_every = 1;
  return c;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(PjDiagnostics, KnownSettingMatchesHandValues) {
  auto m = tiny_model("pj_bias(sectors=fj/affine/lc, R=2, L=8)");
  set_known(m);
  train::PjDiagnoseOptions o;
  o.length = 6;
  const auto d = train::pj_model_diagnostics(*m, o);
  ASSERT_EQ(d.layers.size(), 1u);
  ASSERT_EQ(d.layers[0].heads.size(), 2u);
  EXPECT_EQ(d.window, 6);
  const auto& h = d.layers[0].heads[0];
  const double tol = 1e-6;  // the parameters are float32 tensors
  EXPECT_NEAR(h.gates[0], 0.5, tol);
  EXPECT_NEAR(h.gates[1], 0.25, tol);
  EXPECT_NEAR(h.gates[2], 0.25, tol);
  EXPECT_NEAR(h.slope, std::log(2.0), tol);
  EXPECT_NEAR(h.damping, std::log(2.0), tol);
  EXPECT_NEAR(h.omega_cycles, 2.0, tol);  // (pi/2) 8 / (2 pi)
  // mass = g alpha |zeta|: FJ 0.5 (1/4 0.5, 1/2 0.2, 1/4 1.0), LC 0.25 (1/3 0.3, 0, 0)
  const std::vector<double> fj = {0.0625, 0.05, 0.125}, lc = {0.025, 0.0, 0.0};
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_NEAR(h.fj_mass[r], fj[r], tol) << r;
    EXPECT_NEAR(h.lc_mass[r], lc[r], tol) << r;
  }
  // normalised over both branches: (0.0875, 0.05, 0.125) / 0.2625
  EXPECT_NEAR(h.normalized_mass[0], 1.0 / 3, tol);
  EXPECT_NEAR(h.normalized_mass[1], 0.05 / 0.2625, tol);
  EXPECT_NEAR(h.normalized_mass[2], 0.125 / 0.2625, tol);
  EXPECT_NEAR(h.high_order_mass, 0.125, tol);  // r >= 2: FJ 0.125 + LC 0
  EXPECT_EQ(h.top_order_mass, 2);
  // at d = 0 only order 0 is non-zero: 0.5 1/4 0.4 + 0.25 1/3 0.3 = 0.075
  EXPECT_NEAR(component(0, 0, 0.5, 0.25), 0.075, 1e-15);
  // energy and LOO over d = 0..5 from the written-out formula
  std::vector<std::vector<double>> C(3);
  std::vector<double> sum(6, 0.0);
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 6; ++i) {
      C[r].push_back(component(r, i, 0.5, 0.25));
      sum[i] += C[r].back();
    }
  double sn = 0;
  for (double x : sum) sn += x * x;
  for (int r = 0; r < 3; ++r) {
    double n = 0;
    for (double x : C[r]) n += x * x;
    EXPECT_NEAR(h.energy[r], std::sqrt(n) / (std::sqrt(sn) + 1e-12), tol) << r;
    EXPECT_NEAR(h.loo[r], n / 6, tol) << r;  // self-relative: mean_d C_r(d)^2
  }
  EXPECT_EQ(h.loo_reference, probes::pj::LooReference::Self);
  // the jets are small on a window of 6 lags at L = 8: order 0 carries the kernel
  EXPECT_EQ(h.top_order_energy, 0);

  // head 1: gates (1/4, 1/4, 1/2), same order weights
  const auto& h1 = d.layers[0].heads[1];
  EXPECT_NEAR(h1.fj_mass[2], 0.25 * 0.25 * 1.0, tol);
  EXPECT_NEAR(h1.lc_mass[0], 0.5 / 3 * 0.3, tol);
  // summary: head means, and with one layer the model summary is the layer's
  const auto& s = d.summary;
  EXPECT_NEAR(s.gates[0], (0.5 + 0.25) / 2, tol);
  EXPECT_NEAR(s.gates[2], (0.25 + 0.5) / 2, tol);
  EXPECT_NEAR(s.high_order_mass, (0.125 + 0.0625) / 2, tol);
  EXPECT_NEAR(s.fj_mass[1], (0.05 + 0.025) / 2, tol);
  EXPECT_NEAR(d.layers[0].summary.lc_mass[0], s.lc_mass[0], 1e-15);

  // target-relative LOO: Delta_r = mean((b - C_r - y)^2) - mean((b - y)^2), b with the affine
  const auto cfg = d.layers[0].config;
  const auto p = pj_params_from(cfg, m->blocks()[0]->encoding()->lag_values());
  std::vector<double> y = {1.0, -0.5, 0.25, 0.0, 0.5, -1.0};
  const auto t = probes::pj::diagnose_pj_head(cfg, p, 0, 6, &y);
  EXPECT_EQ(t.loo_reference, probes::pj::LooReference::Target);
  for (int r = 0; r < 3; ++r) {
    double with = 0, without = 0;
    for (int i = 0; i < 6; ++i) {
      const double b = sum[i] - 0.25 * std::log(2.0) * i / 8.0;  // - g_A s d/L
      with += (b - y[i]) * (b - y[i]);
      without += (b - C[r][i] - y[i]) * (b - C[r][i] - y[i]);
    }
    EXPECT_NEAR(t.loo[r], (without - with) / 6, tol) << r;
  }
}

TEST(PjDiagnostics, DisabledSectorsHaveZeroMass) {
  {
    auto m = tiny_model("pj_bias(sectors=fj/affine, R=2, L=8)");
    const auto d = train::pj_model_diagnostics(*m, {});
    EXPECT_EQ(d.window, 32);  // 4 L
    for (const auto& h : d.layers[0].heads) {
      EXPECT_EQ(h.gates[2], 0.0);
      for (double x : h.lc_mass) EXPECT_EQ(x, 0.0);
      for (double x : h.fj_mass) EXPECT_GT(x, 0.0);
      EXPECT_GE(h.top_order_mass, 0);
    }
  }
  {
    auto m = tiny_model("pj_bias(sectors=affine, R=2, L=8)");
    const auto d = train::pj_model_diagnostics(*m, {});
    for (const auto& h : d.layers[0].heads) {
      EXPECT_EQ(h.gates[1], 1.0);
      for (size_t r = 0; r < 3; ++r) {
        EXPECT_EQ(h.fj_mass[r], 0.0);
        EXPECT_EQ(h.lc_mass[r], 0.0);
        EXPECT_EQ(h.normalized_mass[r], 0.0);
        EXPECT_EQ(h.energy[r], 0.0);
      }
      EXPECT_EQ(h.high_order_mass, 0.0);
      EXPECT_EQ(h.top_order_mass, -1);  // no jet sector: no top order
      EXPECT_EQ(h.top_order_energy, -1);
    }
  }
}

TEST(PjDiagnostics, NamedErrors) {
  auto rope = tiny_model("rope");
  EXPECT_NE(error_of([&] { train::pj_model_diagnostics(*rope, {}); }).find("has no PJ bias"),
            std::string::npos);
  auto m = tiny_model("pj_bias(sectors=fj/affine/lc, R=2, L=8)");
  train::PjDiagnoseOptions o;
  o.target = "no_such_teacher";
  EXPECT_NE(error_of([&] { train::pj_model_diagnostics(*m, o); }).find("unknown target"),
            std::string::npos);
  const auto cfg = *pj_config(*m->blocks()[0]->encoding()->mechanism().learned_lag_bias());
  const auto p = pj_params_from(cfg, m->blocks()[0]->encoding()->lag_values());
  EXPECT_NE(error_of([&] { probes::pj::diagnose_pj_head(cfg, p, 5, 4); }).find("head 5"),
            std::string::npos);
  std::vector<double> short_target(3, 0.0);
  EXPECT_NE(error_of([&] {
              probes::pj::diagnose_pj_head(cfg, p, 0, 4, &short_target);
            }).find("target has 3 values"),
            std::string::npos);
}

TEST(PjDiagnostics, TrainedRunGivesTablesAndKernels) {
  const auto dir = temp_dir("pj-diag");
  train::RunOptions ro;
  ro.out = dir / "run";
  ro.progress = false;
  train::run_training(tiny_run("pj_bias(sectors=fj/affine/lc, R=2, L=16)"), ro);
  train::PjDiagnoseOptions o;
  o.length = 40;
  o.target = "phase";
  const auto d = train::pj_run_diagnostics(ro.out, o);
  EXPECT_EQ(d.step, 2);
  ASSERT_EQ(d.layers.size(), 2u);
  const auto md = train::pj_diagnostics_markdown(d);
  EXPECT_NE(md.find("## Layer 0 (L = 16, R = 2, sectors fj+affine+lc)"), std::string::npos) << md;
  EXPECT_NE(md.find("## Layer 1"), std::string::npos);
  EXPECT_NE(md.find("| top order (mass) | top order (energy) |"), std::string::npos);
  EXPECT_NE(md.find("## Model summary (head mean, then layer mean)"), std::string::npos);
  EXPECT_NE(md.find("| **model** |"), std::string::npos);
  const auto j = nlohmann::json::parse(train::pj_diagnostics_json(d));
  EXPECT_EQ(j["window"], 40);
  EXPECT_EQ(j["loo_reference"], "target");
  EXPECT_EQ(j["layers"].size(), 2u);
  EXPECT_EQ(j["layers"][1]["heads"].size(), 2u);
  EXPECT_EQ(j["layers"][0]["heads"][0]["energy"].size(), 3u);
  // lag kernels: header plus layers x heads x T rows; the plot script is ours
  auto run = train::load_trained_model(ro.out);
  train::write_pj_lag_kernel_plot(*run.model, 40, dir / "plots");
  EXPECT_TRUE(fs::exists(dir / "plots" / "pj_lag_kernels.csv"));
  EXPECT_TRUE(fs::exists(dir / "plots" / "pj_lag_kernels.gp"));
  const auto csv = train::pj_lag_kernels_csv(*run.model, 40);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 1 + 2 * 2 * 40);
  EXPECT_EQ(csv.substr(0, 18), "layer,head,d,bias\n");

  // missing run folder and missing checkpoint are named errors
  EXPECT_NE(error_of([&] { train::pj_run_diagnostics(dir / "nope", {}); }).find("no run folder"),
            std::string::npos);
  fs::remove(ro.out / "checkpoints" / "last.pt");
  EXPECT_NE(error_of([&] { train::pj_run_diagnostics(ro.out, {}); }).find("no checkpoint at"),
            std::string::npos);
  fs::remove_all(dir);
}
