// jordan: complex Jordan blocks of order m (Jordan-RoPE 3.3-4.3, App. A).
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> jordan_family() {
  std::vector<TermDef> d;
  {
    auto opts = shear_options(jordan_common_options("stabilized"));
    opts.insert(opts.begin(), {"m", "2", "Jordan order (1..8); head dim must divide by 2m"});
    opts.push_back({"theta", "10000", "frequency base"});
    opts.push_back({"grid", "prefix",
                    "prefix: first D/(2m) of theta^(-2k/D) (reference); span: theta^(-2km/D)"});
    opts.push_back({"zero_omega", "false", "force omega = 0 (real Jordan block)"});
    opts.push_back(direction_option());
    d.push_back({{"jordan",
                  "transform",
                  "complex Jordan block of order m: e^{(-gamma+i omega)d} sum_r (eta s "
                  "sigma(d))^r/r! N^r",
                  "exact (raw, scaled); approximate (stabilized, the default)",
                  "Jordan-RoPE 3.3-4.3, App. A",
                  opts,
                  {"jordan_rope", "jordan_raw_tau", "jordan_no_gamma", "jordan_etaNNN", "jordan_mM",
                   "jordan_exact[_mM][_cCCC][_etaEEE][_eta1]"}},
                 [](const Args& a, TermBuilder& b) {
                   const int m = a.integer("m", 1, 8);
                   const int D = b.m.head_dim;
                   require_divisible(a, D, 2 * m,
                                     fmt::format("order {} blocks of {} coordinates", m, 2 * m));
                   JordanSegment s = jordan_base(a, m);
                   set_shear(a, s);
                   s.blocks = D / (2 * m);
                   const double theta = a.positive("theta");
                   const bool prefix = a.choice("grid", {"prefix", "span"}) == "prefix";
                   s.omega = prefix ? rope_frequencies(theta, D, s.blocks)
                                    : spanning_frequencies(theta, D, m);
                   s.grid = {theta, prefix ? D : D / m};
                   if (a.flag("zero_omega")) s.omega.assign(s.blocks, 0.0);
                   set_direction(a, s);
                   b.add(s);
                   set_center(a, b.m, s.exact());
                 }});
  }

  return d;
}

}  // namespace relpos::mechanisms
