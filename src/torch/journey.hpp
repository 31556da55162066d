// The journey transform (JoFormer) in the torch layer: the `relpos::rotate_pairs` op (CPU kernel =
// kernels/rotate, Meta for torch.compile, Autograd through `relpos::rotate_pairs_backward`) and
// the frame angles of a journey mechanism (core/mechanisms/journey.cpp): fixed angles from
// positions, per-token angles from the causal scan (torch/scan.hpp) of an angle table's rows.
#pragma once

#include <torch/torch.h>

#include "core/mechanism.hpp"

namespace relpos::nn {

// A frame: the cosines and sines of its angles [B, T, P] or [T, P] (computed once, in one pass of
// the `relpos::cos_sin` op, and shared by every tensor and layer it rotates; differentiable back
// to the angles).
struct Frame {
  torch::Tensor cos, sin;
  static Frame of(const torch::Tensor& angles);
  bool defined() const { return cos.defined(); }
};

// x [B, H, T, D] (float32/float64, CPU) rotated by a frame of its dtype with P <= D/2 pairs: pair p
// turns by +angle (by -angle when inverse). The `relpos::rotate_pairs(x, cos, sin, inverse,
// layout)` op; differentiable in x, cos and sin.
torch::Tensor rotate_pairs(const torch::Tensor& x, const Frame& frame, bool inverse = false,
                           Layout layout = Layout::Interleaved);
torch::Tensor rotate_pairs(const torch::Tensor& x, const torch::Tensor& angles,
                           bool inverse = false, Layout layout = Layout::Interleaved);

// The mechanism's journey term: a transform that rotates values and outputs, or one driven by a
// content phase; null when it has none. Throws InputError when such a term is composed with other
// transform terms or is not a pure rotation (the frames must be orthogonal).
const TransformTerm* journey_term(const Mechanism& m);

// Frame angles theta_{t,m} = p_t f_m of a fixed-angle term for positions [T] or [B, T] (float64):
// [T, P] or [B, T, P] in `dtype`, reduced mod 2 pi in float64 first (exact for long positions).
torch::Tensor fixed_frame_angles(const TransformTerm& t, const torch::Tensor& positions,
                                 torch::ScalarType dtype);

// Per-token frames: the phases of angle increments [B, T, P] (rows of the model's angle table for
// each token) by the term's scan (exclusive: Phi_t = sum_{s<t} a_s; or the reference's reversed
// inclusive form). Differentiable in the increments.
torch::Tensor content_frame_angles(const TransformTerm& t, const torch::Tensor& increments);

// The frame angles of a journey term for one side of an attention call: fixed angles from the
// positions, or the given content frame (phases [B, T, P] from content_frame_angles; InputError
// naming `what` when it is missing).
torch::Tensor frame_angles(const TransformTerm& t, const torch::Tensor& positions,
                           const torch::Tensor& content_frame, torch::ScalarType dtype,
                           const char* what);

}  // namespace relpos::nn
