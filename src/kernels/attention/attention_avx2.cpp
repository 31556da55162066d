// AVX2 + FMA build of the attention kernels (compiled with -mavx2 -mfma on x86-64 only; see
// CMakeLists.txt). kernels/isa.hpp selects it only when the CPU reports both features.
#if defined(__x86_64__)
#define RELPOS_ISA_NAMESPACE isa_avx2
#include "kernels/attention/attention_isa.inc"
#endif
