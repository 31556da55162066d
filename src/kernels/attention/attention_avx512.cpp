// AVX-512 build of the attention kernels (compiled with -mavx512f -mavx512vl -mavx2 -mfma on
// x86-64 only; see CMakeLists.txt): the float GEMM blocks use 16-lane registers.
#if defined(__x86_64__)
#define RELPOS_ISA_NAMESPACE isa_avx512
#include "kernels/attention/attention_isa.inc"
#endif
