// The causal scan of per-token increments into per-position phases, shared by every mechanism
// whose "time" is accumulated content (JoFormer's per-token journey angles, GRAPE-M's contextual
// phase): Phi_t = sum_{s<t} a_s along T for each of C channels, with its backward (the reverse
// scan of the phase gradients into the increments). The sums run in the storage type with
// Neumaier compensation, so fp32 phases over 10^5 tokens keep float64-level accuracy (angles are
// unbounded, and an uncompensated fp32 cumsum loses ~1e-3 rad there). No LibTorch.
//
// Layout: a, phi [B, T, C] contiguous. Modes:
//   Exclusive        Phi_t = sum_{s<t} a_s                   (the papers' journey: causal)
//   ReversedInclusive Phi_t = c_{T-1-t}, c_u = sum_{s<=u} a_s (the JoFormer reference code's form,
//                    which reads tokens after t: kept to reproduce it, and documented as a leak)
#pragma once

#include <cstdint>

namespace relpos::kernels {

enum class ScanMode { Exclusive, ReversedInclusive };

struct ScanDims {
  int64_t B = 1, T = 1, C = 1;
};

// phi = scan(a). a and phi may not alias.
template <class T>
void causal_scan_forward(ScanMode mode, const ScanDims& d, const T* a, T* phi);

// da = scan^T(dphi) (overwritten): the adjoint of the forward, a reverse scan
// (Exclusive: da_s = sum_{t>s} dphi_t). dphi and da may not alias.
template <class T>
void causal_scan_backward(ScanMode mode, const ScanDims& d, const T* dphi, T* da);

}  // namespace relpos::kernels
