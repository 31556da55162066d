// AVX2 + FMA build of the rotation kernels (-mavx2 -mfma on x86-64 only; CMakeLists.txt).
#if defined(__x86_64__)
#define RELPOS_ISA_NAMESPACE isa_avx2
#include "kernels/rotate_isa.inc"
#endif
