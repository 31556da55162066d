// PJ-RoPE adaptive sector recovery (pj-rope.md 3.2; the adaptive part of Table 3 and Fig. 3), in
// float64 without LibTorch: the single-head scalar AdaptivePJKernel with its forward and analytic
// gradients, torch's Adam, the restart protocol, the evaluation diagnostics (gates, effective and
// normalised order mass, functional energy, leave-one-order-out, both "top order" definitions) and
// the 8-teacher x 3-seed sweep.
//
// The zetas are drawn from std::mt19937_64(seed + 7919 r) through our own Box-Muller transform
// (portable across standard libraries); the reference's torch RNG stream is not reproduced, so
// individual runs differ from the reference's while the protocol is the same.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace relpos::probes::pj {

// Flat parameter vector of the kernel (max order R, R1 = R + 1 orders):
//   [gate logits (FJ, A, LC) | FJ alpha logits R1 | LC alpha logits R1 | FJ zeta re R1 |
//    FJ zeta im R1 | LC zeta re R1 | LC zeta im R1 | FJ damping raw | affine a]
struct AdaptiveLayout {
  int orders = 4;  // R + 1
  int gates() const { return 0; }
  int fj_alpha() const { return 3; }
  int lc_alpha() const { return 3 + orders; }
  int fj_zre() const { return 3 + 2 * orders; }
  int fj_zim() const { return 3 + 3 * orders; }
  int lc_zre() const { return 3 + 4 * orders; }
  int lc_zim() const { return 3 + 5 * orders; }
  int damping_raw() const { return 3 + 6 * orders; }
  int affine() const { return 4 + 6 * orders; }
  int size() const { return 5 + 6 * orders; }
};

// The lag features that do not depend on parameters, over d = 0..n-1: x = d/L, cos/sin(omega d),
// beta_L(d), cos/sin(omega phi_L(d)).
struct LagBasis {
  std::vector<double> x, cos_w, sin_w, beta, cos_phi, sin_phi;
  size_t size() const { return x.size(); }
};
LagBasis make_lag_basis(int n, double omega, double L);

enum class Sector { FJ = 0, A = 1, LC = 2 };
const char* sector_name(Sector s);

// pred(d) = g_FJ sum_r FJ_r(d) + g_A (a x) + g_LC sum_r LC_r(d), g = softmax(gate logits),
//   FJ_r = x^r/r! e^{-c x} alpha^FJ_r (zre cos(omega d) - zim sin(omega d)), c = softplus(raw),
//   LC_r = beta^r alpha^LC_r (zre cos(omega phi) - zim sin(omega phi)),
// alpha = softmax over the orders of each branch; omega fixed.
class AdaptivePJKernel {
 public:
  // max_order >= 0, L > 0, else InputError.
  AdaptivePJKernel(int max_order, double omega, double L);

  const AdaptiveLayout& layout() const { return layout_; }
  int max_order() const { return layout_.orders - 1; }
  double omega() const { return omega_; }
  double L() const { return L_; }
  std::vector<double>& params() { return p_; }
  const std::vector<double>& params() const { return p_; }

  // The reference initialisation: gate logits [0, -0.2, -0.2], alpha logits 0 (or, with
  // order_init >= 0, +2 at that order and -2 elsewhere in both branches), zetas zeta_std N(0,1)
  // in the order FJ re, FJ im, LC re, LC im, damping raw -2, a = 0.
  void init(uint64_t seed, int order_init = -1, double zeta_std = 0.05);

  std::array<double, 3> gates() const;
  std::vector<double> fj_alpha() const;
  std::vector<double> lc_alpha() const;
  double damping() const;  // softplus(raw)

  // Ungated per-order components over the basis: fj[r][d], lc[r][d]; affine[d] = a x.
  struct Parts {
    std::vector<std::vector<double>> fj, lc;
    std::vector<double> affine, pred;
  };
  Parts parts(const LagBasis& b) const;
  std::vector<double> predict(const LagBasis& b) const;

  // Full-batch MSE against y (y.size() == basis size) and, when grad is given, its gradient with
  // respect to every entry of params() (resized to layout().size()).
  double loss(const LagBasis& b, const std::vector<double>& y, std::vector<double>* grad) const;

 private:
  AdaptiveLayout layout_;
  double omega_, L_;
  std::vector<double> p_;
};

// torch.optim.Adam (weight_decay 0, amsgrad off, maximize off): m = b1 m + (1 - b1) g,
// v = b2 v + (1 - b2) g^2, p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
class Adam {
 public:
  explicit Adam(size_t n, double lr = 3e-2, double beta1 = 0.9, double beta2 = 0.999,
                double eps = 1e-8);
  void step(std::vector<double>& p, const std::vector<double>& g);
  int steps() const { return t_; }

 private:
  double lr_, b1_, b2_, eps_;
  int t_ = 0;
  std::vector<double> m_, v_;
};

struct AdaptiveConfig {
  double L = 1024.0;
  double cycles = 17.0;  // omega = 2 pi cycles / L
  int max_order = 3;
  int train_len = 1024;  // fit on d = 0..train_len-1
  int eval_len = 4096;   // diagnostics on d = 0..eval_len-1
  int steps = 1000;      // the sweep's; the single diagnostic script runs 1500
  double lr = 3e-2;
  int restarts = 2;                  // restart r draws with seed + 7919 r
  std::string select = "train_mse";  // or "eval_mse"
  bool order_init_cycle = false;     // restart r: order r mod (R+1) at +2, others -2
  double omega() const;
  void check() const;  // InputError naming the bad field
};

// Evaluation-window diagnostics of one fitted kernel (pj-rope.md 3.2).
struct AdaptiveDiagnostics {
  double train_mse = 0.0, eval_mse = 0.0, eval_r2 = 0.0;
  std::array<double, 3> gates{};  // FJ, A, LC
  double damping = 0.0, affine = 0.0;
  std::vector<double> fj_mass, lc_mass, normalized_mass, energy, loo;  // per order
  int top_order_mass = 0;        // argmax normalised parameter mass (the exporter's top_order)
  int top_order_energy = 0;      // argmax functional energy (the paper caption's)
  Sector selected = Sector::FJ;  // argmax gate
};
AdaptiveDiagnostics diagnose(const AdaptivePJKernel& k, const LagBasis& train,
                             const std::vector<double>& y_train, const LagBasis& eval,
                             const std::vector<double>& y_eval);

// Index of the largest value, the first one on ties (torch.argmax).
int argmax_first(const std::vector<double>& v);
// Most frequent value, the smallest on ties.
int mode_smallest(const std::vector<int>& v);

struct AdaptiveRun {
  std::string target;
  uint64_t seed = 0;
  int restart = 0;  // the selected restart
  std::vector<double> restart_train_mse, restart_eval_mse;
  AdaptiveDiagnostics diag;
  std::vector<double> params;  // the selected restart's final parameters
};
// Trains restarts of one teacher (pj_target) and keeps the one with the smallest train (or eval)
// MSE after the last step.
AdaptiveRun fit_adaptive(const std::string& target, uint64_t seed, const AdaptiveConfig& cfg);

// The designed sector of each Table 3 teacher. recency_weak_jet is the paper's "mixed
// recency-plus-weak-jet" teacher: both A and FJ are designed sectors (A listed first).
std::vector<Sector> designed_sectors(const std::string& target);

struct AdaptiveSummary {
  std::string target;
  std::vector<Sector> designed;
  double eval_mse_mean = 0.0, eval_mse_std = 0.0, eval_r2_mean = 0.0;
  std::array<double, 3> gate_mean{}, gate_std{};
  std::vector<double> mass_mean, energy_mean, loo_mean;  // per order, over seeds
  int top_order_mass_mode = 0, top_order_energy_mode = 0;
  Sector selected_mode = Sector::FJ;
  std::vector<Sector> selected;  // per seed
  bool recovered = false;        // every seed selected a designed sector
};

struct AdaptiveSweep {
  AdaptiveConfig cfg;
  std::vector<uint64_t> seeds;
  std::vector<AdaptiveRun> runs;  // target-major, seeds inner
  std::vector<AdaptiveSummary> summaries;
};
// Means and sample standard deviations (n - 1) over seeds.
AdaptiveSweep run_adaptive_sweep(const AdaptiveConfig& cfg, const std::vector<std::string>& targets,
                                 const std::vector<uint64_t>& seeds);

}  // namespace relpos::probes::pj
