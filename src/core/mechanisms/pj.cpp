// pj_bias and pj_rotary: the PJ-RoPE mechanisms (PJ-RoPE paper; spec pj-rope.md 1.5, 1.6).
//   pj_bias:   the learned Fourier-jet / affine / light-cone lag kernel (core/pj_bias.hpp), a lag
//              table the fused attention kernel reads.
//   pj_rotary: the exact PJ-rotary map, complex Jordan blocks of order m without damping in the
//              4-real layout [z0re, z0im, z1re, z1im] (interleaved pairs), hd/(2m) frequencies
//              base^(-b/B), shear c_p = eta p / L, both channels rotated by e^{+i theta}.
#include <memory>
#include <numbers>

#include "core/mechanisms/family.hpp"
#include "core/pj_bias.hpp"

namespace relpos::mechanisms {

namespace {

PjBiasConfig config_of(const Args& a, int heads) {
  PjBiasConfig c;
  c.max_order = a.integer("R", 0, 8);
  c.fj = c.affine = c.lc = false;
  const std::string sectors = a.str("sectors");
  size_t s = 0;
  while (s <= sectors.size()) {
    size_t e = sectors.find('/', s);
    if (e == std::string::npos) e = sectors.size();
    const std::string w = sectors.substr(s, e - s);
    if (w == "fj")
      c.fj = true;
    else if (w == "affine")
      c.affine = true;
    else if (w == "lc")
      c.lc = true;
    else
      throw InputError(fmt::format(
          "{}: option sectors='{}': '{}' is not a sector (fj, affine, lc, separated by '/')",
          a.term(), sectors, w));
    s = e + 1;
  }
  c.rho = a.choice("rho", {"linear", "lightcone"}) == "linear" ? PjRho::Linear : PjRho::Lightcone;
  c.L = a.positive("L");
  c.init_cycles = a.positive("cycles");
  const std::string basis = a.choice("basis", {"factorial", "monomial", "binomial"});
  c.basis = basis == "factorial"  ? PjJetBasis::Factorial
            : basis == "monomial" ? PjJetBasis::Monomial
                                  : PjJetBasis::Binomial;
  c.lc_damped = a.flag("lc_damping");
  c.init_slope = a.positive("slope0");
  c.init_damping = a.positive("damping0");
  c.gate_init = a.choice("gates", {"uniform", "affine", "fj", "lc"});
  c.order_init = a.str("orders");
  if (c.order_init != "uniform") {
    const auto k =
        parse_finite_double(c.order_init.substr(std::min<size_t>(1, c.order_init.size())));
    if (c.order_init[0] != 'r' || !k || *k != std::floor(*k) || *k < 0 || *k > 8)
      throw InputError(fmt::format("{}: option orders='{}' must be uniform or rK (K = 0..8)",
                                   a.term(), c.order_init));
  }
  c.zeta_std = a.nonneg("zeta_std");
  c.seed = static_cast<uint64_t>(a.integer("seed", 0, 1 << 30));
  (void)heads;
  return c;
}

}  // namespace

std::vector<TermDef> pj_family() {
  std::vector<TermDef> d;
  d.push_back(
      {{"pj_bias",
        "bias",
        "PJ-RoPE lag kernel: softmax-gated Fourier-jet (x^r/r! e^{-c x} cos), affine (-s rho) and "
        "light-cone (beta^r cos(omega phi)) sectors; learned lag table in the fused kernel",
        "exact (a function of i - j)",
        "PJ-RoPE Def. 1; spec pj-rope.md 1.5-1.6",
        {{"R", "3", "maximum jet order (orders 0..R)"},
         {"sectors", "fj/affine", "enabled sectors, '/'-separated: fj, affine, lc"},
         {"rho", "linear", "affine coordinate: linear d/L or lightcone asinh(d/L)"},
         {"L", "1024", "chart scale / training length"},
         {"cycles", "17", "omega_h initialised at 2 pi linspace(1, cycles, H)_h / L"},
         {"basis", "factorial",
          "jets: factorial (x^r/r!, reference), monomial x^r, binomial C(d,r)/L^r"},
         {"lc_damping", "false", "light-cone term damped by e^{-c phi/L} (the paper's form)"},
         {"slope0", "0.6931471805599453", "initial affine slope softplus(raw) (reference raw 0)"},
         {"damping0", "0.12692801104297263", "initial FJ damping softplus(raw) (reference raw -2)"},
         {"gates", "uniform", "sector gate init: uniform, or +2 on affine / fj / lc and -2 else"},
         {"orders", "uniform", "order init: uniform, or rK: +2 on order K and -2 else"},
         {"zeta_std", "0.02", "initial complex amplitudes zeta_std N(0, 1)"},
         {"seed", "0", "seed of the zeta draw for spec-only use (torch modules use torch's RNG)"}},
        {"pj_bias"}},
       [](const Args& a, TermBuilder& b) {
         b.add_learned_lag_table(
             std::make_shared<PjLagKernel>(config_of(a, b.m.heads), a.values()));
       }});
  d.push_back({{"pj_rotary",
                "transform",
                "exact PJ-rotary: complex Jordan blocks of order m (2: the reference's 4-real "
                "[z0re, z0im, z1re, z1im] blocks), hd/(2m) frequencies base^(-b/B), shear eta p/L",
                "exact",
                "PJ-RoPE 4; spec pj-rope.md 1.5",
                {{"m", "2", "Jordan order (2: the reference); head dim must divide by 2m"},
                 {"base", "10000", "frequency base: omega_b = base^(-b/B), B = hd/(2m)"},
                 {"L", "1024", "training length: the shear coordinate is eta p / L"},
                 {"eta", "1", "shear amplitude (fixed)"},
                 {"channels", "reference",
                  "reference: the shear runs from the block's first complex channel to its second "
                  "(query z0 + c z1), as the reference's [z0re, z0im, z1re, z1im] (a fixed channel "
                  "swap before the Jordan term; interleaved layout); jordan: our order, no swap"}},
                {"pj_rotary"}},
               [](const Args& a, TermBuilder& b) {
                 const int m = a.integer("m", 1, 8);
                 const int D = b.m.head_dim;
                 require_divisible(a, D, 2 * m,
                                   fmt::format("order {} blocks of {} coordinates", m, 2 * m));
                 if (a.choice("channels", {"reference", "jordan"}) == "reference") {
                   // our Jordan blocks shear from channel r+1 into channel r; the reference's from
                   // z0 into z1: reverse the complex channels of every block (an orthogonal
                   // permutation, its own inverse transpose)
                   std::vector<double> P(static_cast<size_t>(D) * D, 0.0);
                   for (int blk = 0; blk < D / (2 * m); ++blk)
                     for (int r = 0; r < m; ++r)
                       for (int e = 0; e < 2; ++e) {
                         const int from = 2 * (blk * m + r) + e, to = 2 * (blk * m + m - 1 - r) + e;
                         P[static_cast<size_t>(to) * D + from] = 1.0;
                       }
                   b.add_fixed_linear(P, P);
                 }
                 JordanSegment s;
                 s.order = m;
                 s.blocks = D / (2 * m);
                 const double base = a.positive("base");
                 // e^{+i theta} on queries and keys, as RoPE: a negated segment frequency
                 for (int k = 0; k < s.blocks; ++k)
                   s.omega.push_back(-std::pow(base, -static_cast<double>(k) / s.blocks));
                 // base^(-b/B) = base^(-2b/(2B)): the grid the context-extension rules scale
                 s.grid = {base, 2 * s.blocks};
                 s.L = a.positive("L");
                 s.chart = Chart::Raw;
                 s.shear_scale = 1.0 / s.L;
                 s.shear = ShearMode::Exponential;
                 s.eta_init = a.num("eta");
                 s.eta_max = 2.0 * std::abs(s.eta_init) + 1.0;
                 s.learn_eta = false;
                 s.damped = false;
                 b.add(s);
                 b.m.center = CenterMode::None;
               }});
  return d;
}

}  // namespace relpos::mechanisms
