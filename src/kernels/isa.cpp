#include "kernels/isa.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/types.hpp"

namespace relpos::kernels {

Isa selected_isa() {
  static const Isa isa = [] {
    Isa best = Isa::Baseline;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::Avx2;
    if (best == Isa::Avx2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512vl"))
      best = Isa::Avx512;
#endif
    const char* cap = std::getenv("RELPOS_KERNEL_ISA");
    if (!cap || !*cap) return best;
    const std::string c = cap;
    const Isa want =
        c == "baseline" ? Isa::Baseline
        : c == "avx2"   ? Isa::Avx2
        : c == "avx512"
            ? Isa::Avx512
            : throw InputError("RELPOS_KERNEL_ISA must be baseline, avx2 or avx512, got '" + c +
                               "'");
    return std::min(want, best);
  }();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx2:
      return "avx2+fma";
    case Isa::Baseline:
      break;
  }
  return "baseline";
}

const char* kernel_isa() {
  return isa_name(selected_isa());
}

}  // namespace relpos::kernels
