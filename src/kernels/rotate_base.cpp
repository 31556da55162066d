// Baseline x86-64 (or any target) build of the rotation kernels.
#define RELPOS_ISA_NAMESPACE isa_base
#include "kernels/rotate_isa.inc"
