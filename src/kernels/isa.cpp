#include "kernels/isa.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "core/types.hpp"

namespace relpos::kernels {

namespace {

// AMX-TILE, AMX-BF16, AVX512-BW and AVX512-BF16 on the CPU, the tile state enabled by the OS (XCR0
// bits 17 and 18), and this process granted it (Linux asks for arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA) before a first tile instruction; the grant holds for every thread).
// AVX512-BF16 (vdpbf16ps, vcvtne2ps2bf16) beside AVX512-BW.
bool avx512_bf16() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((b >> 30) & 1u)) return false;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1u);
#else
  return false;
#endif
}

bool amx_usable() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u, bw = (b >> 30) & 1u;
  if (!tile || !bf16 || !bw || !__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  if (!((a >> 5) & 1u)) return false;  // AVX512-BF16 (vcvtne2ps2bf16)
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

Isa selected_isa() {
  static const Isa isa = [] {
    Isa best = Isa::Baseline;
#if defined(__x86_64__)
    // F16C (float16 conversions) came with every AVX2 processor; the AVX2 build uses it
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      best = Isa::Avx2;
    if (best == Isa::Avx2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512vl"))
      best = Isa::Avx512;
    if (best == Isa::Avx512 && avx512_bf16()) best = Isa::Avx512Bf16;
    const char* cap = std::getenv("RELPOS_KERNEL_ISA");
    const bool capped = cap && *cap && std::string(cap) != "amx";
    // (a cap below amx asks the kernel for no tile state at all)
    if (best == Isa::Avx512Bf16 && !capped && amx_usable()) best = Isa::Amx;
#else
    const char* cap = std::getenv("RELPOS_KERNEL_ISA");
#endif
    if (!cap || !*cap) return best;
    const std::string c = cap;
    const Isa want =
        c == "baseline"     ? Isa::Baseline
        : c == "avx2"       ? Isa::Avx2
        : c == "avx512"     ? Isa::Avx512
        : c == "avx512bf16" ? Isa::Avx512Bf16
        : c == "amx"        ? Isa::Amx
                            : throw InputError(
                                  "RELPOS_KERNEL_ISA must be baseline, avx2, avx512, avx512bf16 or amx, "
                                         "got '" +
                                  c + "'");
    return std::min(want, best);
  }();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Amx:
      return "avx512+amx";
    case Isa::Avx512Bf16:
      return "avx512+bf16";
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

bool attention_prefetch() {
  // (read at every kernel call, a getenv beside milliseconds of work: so a benchmark can compare
  // both settings in one process, bench/bench_attention_prefetch.py)
  const char* set = std::getenv("RELPOS_ATTENTION_PREFETCH");
  if (set && *set) {
    const std::string v = set;
    if (v != "0" && v != "1")
      throw InputError("RELPOS_ATTENTION_PREFETCH must be 0 or 1, got '" + v + "'");
    return v == "1";
  }
#if defined(__x86_64__)
  static const bool intel = __builtin_cpu_is("intel");
  return !intel;
#else
  return true;
#endif
}

}  // namespace relpos::kernels
