// rope: rotary embedding (RoFormer), an order-1 Jordan term without damping.
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> rope_family() {
  std::vector<TermDef> d;
  d.push_back({{"rope",
                "transform",
                "rotary embedding, D/2 frequencies theta^(-2k/D)",
                "exact",
                "RoFormer; Jordan-RoPE 3.2",
                {{"theta", "10000", "frequency base"}},
                {"rope"}},
               [](const Args& a, TermBuilder& b) {
                 const int D = b.m.head_dim;
                 require_divisible(a, D, 2, "rotary pairs");
                 b.add(rope_segment(a.positive("theta"), D, D / 2));
               }});

  return d;
}

}  // namespace relpos::mechanisms
