// damped_rope: e^{-gamma d} RoPE (Jordan-RoPE 3.2; the reference uses order 2 with eta = 0).
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> damped_rope_family() {
  std::vector<TermDef> d;
  {
    auto opts = std::vector<OptionInfo>{
        {"m", "2", "1: full-frequency damped RoPE; 2: reference (Jordan block with eta = 0)"},
        {"theta", "10000", "frequency base"}};
    for (auto& o : jordan_common_options("raw"))
      if (o.key != "regime" && o.key != "c") opts.push_back(o);
    opts.push_back(direction_option());
    d.push_back({{"damped_rope",
                  "transform",
                  "e^{-gamma d} RoPE; m=2 (reference) uses D/4 frequencies, each on two pairs",
                  "exact",
                  "Jordan-RoPE 3.2, 5; spec 1.5",
                  opts,
                  {"damped_rope"}},
                 [](const Args& a, TermBuilder& b) {
                   const int m = a.integer("m", 1, 2);
                   require_divisible(a, b.m.head_dim, 2 * m, "2m real coordinates per block");
                   JordanSegment s = jordan_base(a, m);
                   s.shear = ShearMode::None;
                   s.blocks = b.m.head_dim / (2 * m);
                   s.omega = rope_frequencies(a.positive("theta"), b.m.head_dim, s.blocks);
                   s.grid = {a.positive("theta"), b.m.head_dim};
                   set_direction(a, s);
                   b.add(s);
                   set_center(a, b.m, true);
                 }});
  }

  return d;
}

}  // namespace relpos::mechanisms
