// Instruction-set selection and dispatch of the CPU kernels, shared by every kernel family (the
// transforms now, attention next). A family writes its code once in a `<family>_isa.inc` that
// defines its entry points inside `namespace relpos::kernels::RELPOS_ISA_NAMESPACE`, and builds
// it three times from `<family>_base.cpp`, `<family>_avx2.cpp` and `<family>_avx512.cpp` (CMake
// gives every `src/kernels/*_avx2.cpp` / `*_avx512.cpp` the matching -m flags); its public
// wrapper declares the per-ISA entry points with RELPOS_ISA_FOR_EACH and calls the selected one
// with RELPOS_ISA_DISPATCH:
//
//   #define DECLARE(NS) namespace relpos::kernels::NS { void scores(const float*, float*); }
//   RELPOS_ISA_FOR_EACH(DECLARE)
//   void scores(const float* x, float* y) { RELPOS_ISA_DISPATCH(scores, x, y); }
#pragma once

namespace relpos::kernels {

// The builds, narrowest first (the order matters: a cap keeps the narrower of two). Avx512Bf16 is
// the AVX-512 build whose bfloat16 attention multiplies bf16 pairs by AVX512-BF16 dot products
// (vdpbf16ps), chosen when the CPU has AVX512-BF16; Amx multiplies them on AMX tiles
// (tdpbf16ps), chosen when the CPU also has AMX-BF16 and the kernel grants this process the tile
// state.
enum class Isa { Baseline, Avx2, Avx512, Avx512Bf16, Amx };

// The best build this CPU runs, capped by the environment variable RELPOS_KERNEL_ISA
// (baseline | avx2 | avx512 | avx512bf16 | amx) when it is set: the tests run every build this way,
// and so can a comparison. Read once per process; an unknown value throws relpos::InputError.
Isa selected_isa();

// "baseline", "avx2+fma", "avx512", "avx512+bf16" or "avx512+amx".
const char* isa_name(Isa isa);

// isa_name(selected_isa()) (also declared in kernels/transform.hpp).
const char* kernel_isa();

// Whether the float32 attention kernels ask for their next key tiles (forward) and query rows
// (backward) with software prefetches. They were added for an AMD EPYC, whose prefetchers did
// not follow the forward's walk toward lower addresses (T 32k: every tile missed); on an Intel
// Xeon the L2 streamer follows it and the prefetches cost 1-8% of the forward and backward at T
// 1k-32k (docs/performance.md). So on by default except on Intel CPUs;
// RELPOS_ATTENTION_PREFETCH=1 or 0 sets it (read at each kernel call); another value throws
// relpos::InputError.
bool attention_prefetch();

}  // namespace relpos::kernels

// X(NS) once per build's namespace inside relpos::kernels (isa_base, isa_avx2, isa_avx512): for
// declaring a family's per-ISA entry points.
#if defined(__x86_64__)
#define RELPOS_ISA_FOR_EACH(X) X(isa_base) X(isa_avx2) X(isa_avx512)
#else
#define RELPOS_ISA_FOR_EACH(X) X(isa_base)
#endif

// `return relpos::kernels::<selected build>::FN(args...);` - FN is the per-ISA function's name
// inside its build's namespace, template arguments included (e.g. forward<T>).
#if defined(__x86_64__)
#define RELPOS_ISA_DISPATCH(FN, ...)                         \
  switch (::relpos::kernels::selected_isa()) {               \
    case ::relpos::kernels::Isa::Amx:                        \
    case ::relpos::kernels::Isa::Avx512Bf16:                 \
    case ::relpos::kernels::Isa::Avx512:                     \
      return ::relpos::kernels::isa_avx512::FN(__VA_ARGS__); \
    case ::relpos::kernels::Isa::Avx2:                       \
      return ::relpos::kernels::isa_avx2::FN(__VA_ARGS__);   \
    case ::relpos::kernels::Isa::Baseline:                   \
      break;                                                 \
  }                                                          \
  return ::relpos::kernels::isa_base::FN(__VA_ARGS__)
#else
#define RELPOS_ISA_DISPATCH(FN, ...) return ::relpos::kernels::isa_base::FN(__VA_ARGS__)
#endif
