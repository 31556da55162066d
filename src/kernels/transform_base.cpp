// Baseline x86-64 (or any target) build of the transform kernels.
#define RELPOS_ISA_NAMESPACE isa_base
#include "kernels/transform_isa.inc"
