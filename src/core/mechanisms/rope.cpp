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
                 JordanSegment s;
                 s.order = 1;
                 s.blocks = D / 2;
                 // RoFormer / reference convention: q and k rotate by +omega p, i.e. G(d) =
                 // R(-omega d); as a segment (maps rotate by -omega p) that is a negated
                 // frequency
                 s.omega = rope_frequencies(a.positive("theta"), D, s.blocks);
                 for (auto& w : s.omega) w = -w;
                 b.add(s);
               }});

  return d;
}

}  // namespace relpos::mechanisms
