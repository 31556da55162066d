// AVX-512 build of the transform kernels (compiled with -mavx512f -mavx512vl -mavx2 -mfma on
// x86-64 only; see CMakeLists.txt): the hand-vectorised float paths use 16-lane registers.
// kernels/isa.hpp selects it only when the CPU reports the features.
#if defined(__x86_64__)
#define RELPOS_ISA_NAMESPACE isa_avx512
#include "kernels/transform_isa.inc"
#endif
