// xpos: RoPE with a per-pair exponential scale (Sun et al. 2023, "A Length-Extrapolatable
// Transformer", ACL; torchscale's XPOS). Pair b of D/2 has zeta_b = (2b/D + zeta0)/(1 + zeta0);
// a query at n is scaled by zeta_b^{n/S}, a key at m by zeta_b^{-m/S} (S = scale_base), so the
// score carries zeta_b^{(n-m)/S}, a decay in the lag. In the Jordan model that is damped RoPE of
// order 1 with the fixed damping gamma_b = -ln(zeta_b)/S: G(d) = e^{(-gamma_b + i omega_b) d},
// keys e^{+gamma_b m}, queries e^{-gamma_b n}. The paper centres positions (torchscale: the middle
// of the call's window); here the centre is damped_rope's (auto: floor(L/2), fixed for every call,
// so prefill and decode calls compose).
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> xpos_family() {
  return {
      {{"xpos",
        "transform",
        "RoPE with the per-pair scale zeta_b^{(n-m)/scale_base} (fixed damping), "
        "zeta_b = (2b/D + zeta0)/(1 + zeta0)",
        "exact",
        "Sun et al. 2023 (xPos, ACL) 3.2; torchscale XPOS",
        {{"theta", "10000", "frequency base"},
         {"zeta0", "0.4", "the paper's gamma: zeta_b = (2b/D + zeta0)/(1 + zeta0), in (0, 1e3]"},
         {"scale_base", "512", "the paper's scale base: the decay is zeta_b^{lag/scale_base}"},
         {"L", "1024", "training context: center=auto puts the centre at floor(L/2)"},
         {"max_exp", "30",
          "clamp |gamma p| before exp (as damped_rope); verify reports when it binds"},
         {"center", "auto",
          "factorization centre c0: auto (floor(L/2)), none (the uncentred form), mid (per "
          "call: keys and queries of different calls do not compose), or a number"}},
        {}},
       [](const Args& a, TermBuilder& b) {
         const int D = b.m.head_dim;
         require_divisible(a, D, 2, "rotary pairs");
         const double theta = a.positive("theta"), zeta0 = a.positive("zeta0"),
                      scale_base = a.positive("scale_base");
         if (zeta0 > 1e3)
           throw InputError(
               fmt::format("{}: option zeta0 must be in (0, 1e3], got {}", a.term(), zeta0));
         const int pairs = D / 2;
         const JordanSegment rope = rope_segment(theta, D, pairs);
         // One segment per pair: the damping is fixed per segment. The segments have no
         // frequency grid, so the context-extension rules defined on one (ntk, yarn, ...)
         // refuse xpos instead of rescaling every pair as grid entry 0.
         for (int k = 0; k < pairs; ++k) {
           JordanSegment s;
           s.order = 1;
           s.blocks = 1;
           s.omega = {rope.omega[k]};
           s.L = a.positive("L");
           s.damped = true;
           s.learn_gamma = false;
           const double zeta = (2.0 * k / D + zeta0) / (1.0 + zeta0);
           s.gamma_init = -std::log(zeta) / scale_base;  // zeta_b < 1: a decay
           s.gamma_min = 0.0;
           s.gamma_random_max = std::max(0.0, s.gamma_init);
           s.max_exponent = a.positive("max_exp");
           b.add(s);
         }
         set_center(a, b.m, true);
       }}};
}

}  // namespace relpos::mechanisms
