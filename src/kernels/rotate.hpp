// Plane rotations by per-token angle vectors: the journey transform of JoFormer (queries, keys and
// values rotated into a common frame, outputs rotated back) and any rotary map whose angle is not
// position x frequency (content phases from kernels/scan). No LibTorch.
//
// Layout: x, y [B, H, T, D]; the angles' cosines and sines c, s [B, T, P] (or [1, T, P], shared
// by the batch) for the first P <= D/2 coordinate pairs; pairs past P are copied unchanged. Pair p
// is (2p, 2p+1) interleaved or (p, p + D/2) half-split. Each pair turns counter-clockwise by phi
// (clockwise when inverse):
//   y = R(+-phi) x,  R(a) = [[cos a, -sin a], [sin a, cos a]].
// One template serves forward and inverse (ggml style). The caller computes cos and sin once per
// frame (vectorised, and shared by q, k, v, the output and every layer): scalar libm calls per
// rotation cost more than the rotation itself.
#pragma once

#include <cstdint>

#include "core/types.hpp"
#include "kernels/half.hpp"

namespace relpos::kernels {

struct RotateDims {
  int64_t B = 1, H = 1, T = 1, D = 2, P = 1;
  bool angles_per_batch = true;  // angles [B, T, P]; false: [1, T, P] for every batch row
};

// y = R(+-phi) x. x and y may alias (in place).
template <class T>
void rotate_pairs_forward(const RotateDims& d, Layout layout, bool inverse, const T* x,
                          const T* cos, const T* sin, T* y);

// The adjoint: dx = R(+-phi)^T dy, and (when dcos, dsin are not null) the gradients of the
// cosines and sines, summed over heads (and over the batch when they are shared):
//   dcos = sum_h (g0 x0 + g1 x1),  dsin = +-sum_h (g1 x0 - g0 x1).
// dx and dy may alias; dcos and dsin are overwritten.
template <class T>
void rotate_pairs_backward(const RotateDims& d, Layout layout, bool inverse, const T* x,
                           const T* cos, const T* sin, const T* dy, T* dx, T* dcos, T* dsin);

// y = R(+-phi) x for half storage (bfloat16 or float16 words, x and y may alias) with float32
// cosines and sines: tiles of rows widened to float32, rotated there and rounded back to
// nearest-even (the bits of the float32 kernel's output stored by PyTorch), so x and y are read
// and written once, in half storage. The adjoint without angle gradients is the same call with
// !inverse. With `check`, returns whether y holds a NaN or an infinity (else false). `tensors`:
// how many rotations of this size the caller makes back to back (q and k: 2); their footprint
// together decides whether the outputs are streamed past the cache, as the transform kernels
// decide for q and k together.
bool rotate_pairs_half(const RotateDims& d, Layout layout, bool inverse, HalfType type,
                       const uint16_t* x, const float* cos, const float* sin, uint16_t* y,
                       bool check, int tensors = 1);

// cos[i] = cos(angles[i]), sin[i] = sin(angles[i]) for i < n, in one pass: a frame's table. float
// is within 2 ulp of the float64 values (the argument reduced in float64, then single-precision
// polynomials), where two libm-accurate calls cost 3-4x the time; double is libm's. NaN and
// +-inf give NaN.
template <class T>
void cos_sin(const T* angles, int64_t n, T* cos, T* sin);

}  // namespace relpos::kernels
