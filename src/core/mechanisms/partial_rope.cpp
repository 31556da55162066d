// partial_rope: RoPE on the first `fraction` of the head's coordinate pairs, the rest untouched
// (GPT-NeoX's rotary_pct, GPT-J's rotary_dim). The frequencies span the rotated part:
// theta^(-2k/R) for R = 2 * rotated pairs. The "add a mechanism" example of docs/architecture.md:
// this file and one line in list.inc are the whole change.
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> partial_rope_family() {
  return {{{"partial_rope",
            "transform",
            "RoPE on the first fraction of the coordinate pairs (rotary_pct), the rest untouched",
            "exact",
            "GPT-NeoX / GPT-J rotary_pct; RoFormer",
            {{"fraction", "0.25", "share of coordinate pairs that rotate, in (0, 1]"},
             {"theta", "10000", "frequency base"}},
            {}},
           [](const Args& a, TermBuilder& b) {
             const double f = a.positive("fraction");
             if (f > 1)
               throw InputError(fmt::format("{}: fraction must be in (0, 1], got {}", a.term(), f));
             const int pairs = static_cast<int>(std::floor(f * b.m.head_dim / 2));
             if (pairs < 1)
               throw InputError(fmt::format("{}: fraction {} of head dim {} rotates no pair",
                                            a.term(), f, b.m.head_dim));
             b.add(rope_segment(a.positive("theta"), 2 * pairs, pairs));
           }}};
}

}  // namespace relpos::mechanisms
