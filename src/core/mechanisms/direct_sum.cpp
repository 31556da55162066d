// direct_sum: RoPE on the first half (+) real Jordan on the rest (Jordan-RoPE 3.2, spec 1.7).
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> direct_sum_family() {
  std::vector<TermDef> d;
  {
    auto opts = shear_options(jordan_common_options("stabilized"));
    opts.insert(opts.begin(), {"theta", "10000", "RoPE half frequency base"});
    d.push_back({{"direct_sum",
                  "transform",
                  "RoPE on the first D/2 (grid theta^(-2k/(D/2))) (+) real Jordan on the rest",
                  "exact (raw, scaled); approximate (stabilized, the default)",
                  "Jordan-RoPE 3.2; spec 1.7",
                  opts,
                  {"direct_sum"}},
                 [](const Args& a, TermBuilder& b) {
                   const int D = b.m.head_dim;
                   require_divisible(a, D, 8, "half RoPE, half order-2 real blocks");
                   b.add(rope_segment(a.positive("theta"), D / 2, D / 4));  // RoPE half
                   JordanSegment s = jordan_base(a, 2);
                   set_shear(a, s);
                   s.blocks = D / 8;
                   s.omega.assign(s.blocks, 0.0);
                   b.add(s);
                   set_center(a, b.m, s.exact());
                 }});
  }

  return d;
}

}  // namespace relpos::mechanisms
