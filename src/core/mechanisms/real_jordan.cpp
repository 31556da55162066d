// real_jordan: the real unipotent/Jordan distance block (omega = 0), order 2.
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> real_jordan_family() {
  std::vector<TermDef> d;
  d.push_back({{"real_jordan",
                "transform",
                "real unipotent/Jordan distance block (omega = 0), order 2",
                "exact (raw, scaled); approximate (stabilized, the default)",
                "Jordan-RoPE 3.2",
                shear_options(jordan_common_options("stabilized")),
                {"real_jordan"}},
               [](const Args& a, TermBuilder& b) {
                 require_divisible(a, b.m.head_dim, 4, "order-2 real blocks");
                 JordanSegment s = jordan_base(a, 2);
                 set_shear(a, s);
                 s.blocks = b.m.head_dim / 4;
                 s.omega.assign(s.blocks, 0.0);
                 b.add(s);
                 set_center(a, b.m, s.exact());
               }});

  return d;
}

}  // namespace relpos::mechanisms
