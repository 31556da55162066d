// Structured rotations by vector positions (issue 15; core/structured.hpp has the math): every
// token's row turns by
//   R(r_t) = U [ (+)_u R_2(theta_u(r_t)) (+) I ] U^T,   theta_u(r) = sum_k lambda_{k,u} r_k,
// in O(D m) per row without forming R: z = U_act^T x, y = x + U_act (R_2(theta) z - z), with
// U_act the 2m active columns of U. No LibTorch.
//
// Layout (contiguous, row-major): x, y [B, H, T, D]; positions [B, T, dc] (or [1, T, dc] shared by
// the batch), float64; U [H, D, D] per head or [1, D, D] shared, column j = basis vector j (only
// the first 2M columns are read); lambda [H, dc, M] or [1, dc, M]. The angles are formed in
// float64 from the positions in the kernel. `inverse` applies R(-r) = R(r)^T; forward and
// backward share one template.
#pragma once

#include <cstdint>

#include "core/types.hpp"

namespace relpos::kernels {

struct StructuredDims {
  int64_t B = 1, H = 1, T = 1, D = 2, M = 1, DC = 1;
  bool positions_per_batch = false;  // positions [B, T, dc]; false: [1, T, dc]
  bool basis_per_head = false;       // U [H, D, D]; false: [1, D, D]
  bool freqs_per_head = false;       // lambda [H, dc, M]; false: [1, dc, M]
  // check that U's active columns are orthonormal (to 1e-4 in float, 1e-10 in double); off for
  // finite-difference tests that move U off the orthogonal group
  bool check_basis = true;
};

// y = R(+-r) x. x and y may alias.
template <class T>
void structured_forward(const StructuredDims& d, bool inverse, const T* x, const T* U,
                        const T* lambda, const double* positions, T* y);

// The adjoint: dx = R(+-r)^T dy (dx and dy may alias), and where dU / dlambda are not null the
// gradients of <dy, y> with respect to U (shape of U; the null columns get 0) and lambda (shape of
// lambda), summed over heads / the batch where shared: formed per tile of tokens (in T for dU),
// accumulated across tiles in float64 and reduced in a fixed order (the same bits for any thread
// count). dU and dlambda are overwritten.
template <class T>
void structured_backward(const StructuredDims& d, bool inverse, const T* x, const T* U,
                         const T* lambda, const double* positions, const T* dy, T* dx, double* dU,
                         double* dlambda);

}  // namespace relpos::kernels
