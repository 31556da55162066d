// nope: no position transform (the baseline).
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> nope_family() {
  std::vector<TermDef> d;
  d.push_back({{"nope", "transform", "no positional transform", "exact", "baseline", {}, {"nope"}},
               [](const Args&, TermBuilder&) {}});

  return d;
}

}  // namespace relpos::mechanisms
