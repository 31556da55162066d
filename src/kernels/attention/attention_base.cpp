// Baseline x86-64 (or any target) build of the attention kernels.
#define RELPOS_ISA_NAMESPACE isa_base
#include "kernels/attention/attention_isa.inc"
