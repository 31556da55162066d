#include "core/types.hpp"

#include <fmt/format.h>

namespace relpos {

std::string to_string(Layout l) {
  return l == Layout::Interleaved ? "interleaved" : "half_split";
}

std::string to_string(Chart c) {
  switch (c) {
    case Chart::Raw:
      return "raw";
    case Chart::Bounded:
      return "bounded_tau";
    case Chart::LightconePhi:
      return "lightcone_phi";
    case Chart::LightconeBeta:
      return "lightcone_beta";
  }
  return "?";
}

Layout parse_layout(const std::string& s) {
  if (s == "interleaved") return Layout::Interleaved;
  if (s == "half_split" || s == "halfsplit" || s == "neox") return Layout::HalfSplit;
  throw InputError(fmt::format("unknown layout '{}' (valid: interleaved, half_split)", s));
}

}  // namespace relpos
