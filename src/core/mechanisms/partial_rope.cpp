// partial_rope: RoPE on the first `fraction` of the head's coordinate pairs, the rest untouched
// (GPT-NeoX's rotary_pct, GPT-J's rotary_dim). The frequencies span the rotated part:
// theta^(-2k/R) for R = 2 * rotated pairs. The "add a mechanism" example of docs/architecture.md:
// this file and one line in list.inc are the whole change.
#include <algorithm>

#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> partial_rope_family() {
  return {{{"partial_rope",
            "transform",
            "RoPE on the first fraction of the coordinate pairs (rotary_pct), the rest untouched",
            "exact",
            "GPT-NeoX / GPT-J rotary_pct; RoFormer",
            {{"fraction", "0.25", "share of coordinate pairs that rotate, in (0, 1]"},
             {"theta", "10000", "frequency base"},
             {"grid", "rotary",
              "frequencies: rotary (theta^(-2k/R) over the R rotated dims: GPT-NeoX, Phi; "
              "half-split pairs (j, j + R/2)) or head (theta^(-2k/D) on the rotated pairs and "
              "frequency 0 on the rest, half-split pairs (j, j + D/2): HF's proportional rope)"}},
            {}},
           [](const Args& a, TermBuilder& b) {
             const double f = a.positive("fraction");
             if (f > 1)
               throw InputError(fmt::format("{}: fraction must be in (0, 1], got {}", a.term(), f));
             // the rotated dims as HF counts them (int(head_dim * fraction)): an odd count has
             // a grid relpos's pairs cannot take
             const int dims = static_cast<int>(std::floor(f * b.m.head_dim));
             if (dims % 2)
               throw InputError(fmt::format(
                   "{}: fraction {} of head dim {} rotates an odd number of dims ({})", a.term(), f,
                   b.m.head_dim, dims));
             const int pairs = dims / 2;
             if (pairs < 1)
               throw InputError(fmt::format("{}: fraction {} of head dim {} rotates no pair",
                                            a.term(), f, b.m.head_dim));
             if (a.choice("grid", {"rotary", "head"}) == "rotary") {
               b.add(rope_segment(a.positive("theta"), 2 * pairs, pairs));
             } else {
               // every pair covered (the half-split pairs span the head), the rest standing still
               JordanSegment s = rope_segment(a.positive("theta"), b.m.head_dim, b.m.head_dim / 2);
               std::fill(s.omega.begin() + pairs, s.omega.end(), 0.0);
               b.add(s);
             }
           }}};
}

}  // namespace relpos::mechanisms
