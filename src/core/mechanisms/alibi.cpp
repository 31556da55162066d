// alibi: the additive recency bias -slope_h (i - j) (a slope-form lag table).
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> alibi_family() {
  std::vector<TermDef> d;
  d.push_back({{"alibi",
                "bias",
                "additive recency bias -slope_h (i-j), reference slopes",
                "augmented exact (unipotent lift)",
                "ALiBi; Jordan-RoPE Table 1",
                {},
                {"alibi", "rope_alibi", "<any>_alibi"}},
               [](const Args&, TermBuilder& b) {
                 BiasTerm t;
                 t.name = "alibi";
                 t.slopes = alibi_slopes(b.m.heads);
                 t.unipotent_lift = true;
                 b.add_bias(std::move(t));
               }});

  return d;
}

}  // namespace relpos::mechanisms
