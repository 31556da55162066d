// AVX-512 build of the rotation kernels (x86-64 only; CMakeLists.txt).
#if defined(__x86_64__)
#define RELPOS_ISA_NAMESPACE isa_avx512
#include "kernels/rotate_isa.inc"
#endif
