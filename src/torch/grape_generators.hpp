// GRAPE-M generators beyond the canonical RoPE planes (spec grape-joformer.md 2.4; GRAPE paper
// Sec. 3, Alg. 1, App. D), as plain LibTorch compositions (autograd through torch ops), float32
// and float64, any device the ops run on:
//   rank-2 plane     G(n) = exp(n w L), L = a b^T - b a^T, applied in O(D) per token with the
//                    Rodrigues form (smooth in value and gradient at s = 0, a parallel to b)
//   learned basis    E = Cayley(W - W^T) (or matrix_exp), x -> E R(n) E^T x with R the canonical
//                    half-split rotation: commuting generators E (+-theta J) E^T
//   thin form        G(n) = I + E_r (exp(n L_r) - I) E_r^T, E_r [D, r] orthonormal columns,
//                    L_r = M - M^T in so(r): non-commuting generators in a learned r-dim subspace
// Shapes: x [B, H, T, D]; positions [T] or [B, T] (any real dtype). Per-head parameters carry a
// leading H; without it they are shared by the heads.
//
// Sign conventions (the caller must match them):
//   * rodrigues_rotate and thin_rotate use G(n) = exp(+n L) with the skew L as given. For the plane
//     a = e_p, b = e_q (p < q) this maps (x_p, x_q) -> (x_p cos phi + x_q sin phi,
//     -x_p sin phi + x_q cos phi), phi = n omega: a rotation by -phi, the direction of the
//     spec's RoPE (2.1), which rotates by -t theta_m. thin_generator_init builds the M whose
//     L_r = M - M^T reproduces exactly that RoPE in the r-dim subspace.
//   * basis_rotate's R takes the tables as given: pair (y_m, y_{m+D/2}), m < D/2, goes to
//     (y_m c - y_{m+D/2} s, y_m s + y_{m+D/2} c), a rotation by +theta for c = cos theta,
//     s = sin theta. For the spec's RoPE direction pass sin = -sin(t theta_m) (or inverse = true).
//   * Relative law for every form: (G(i) q) . (G(j) k) = q . G(j - i) k (G orthogonal), so the
//     same transform goes on queries and keys; inverse = true applies G(-n) = G(n)^T.
#pragma once

#include <torch/torch.h>

#include <vector>

namespace relpos::nn {

// {S1(w), S2(w)} with S1(w) = sin(sqrt w) / sqrt w and S2(w) = (1 - cos sqrt w) / w, extended to
// the entire functions they are (w < 0: sinh / cosh, w = 0: 1 and 1/2). One custom autograd
// function: values use the Taylor series 1 - w/6 + w^2/120 and 1/2 - w/24 + w^2/720 for
// |w| < 1e-4 (float32) / 1e-8 (float64) and the cancellation-free closed forms sin(r)/r and
// (1/2) (sin(r/2) / (r/2))^2 elsewhere. Derivatives S1' = (cos sqrt w - S1) / (2w) and
// S2' = (S1 - 2 S2) / (2w) lose ~eps/w to cancellation near 0, so for |w| < 1 they come from
// their Taylor series to w^9 (error < 1e-21), giving -1/6 + w/60 ... and -1/24 + w/360 ...
// The backward is written with torch ops, so it is itself differentiable.
std::vector<torch::Tensor> rodrigues_s(const torch::Tensor& w);

// G(n_t) x_t for the rank-2 generator L = a b^T - b a^T per head, G(n) = exp(n omega L):
//   G x = x + f1 (a v - b u) + f2 (a (gamma v - beta u) + b (gamma u - alpha v)),
//   u = a.x, v = b.x, alpha = |a|^2, beta = |b|^2, gamma = a.b, s^2 = alpha beta - gamma^2,
//   phi = n omega, w = phi^2 s^2, f1 = phi S1(w) = sin(phi s)/s, f2 = phi^2 S2(w).
// x [B, H, T, D]; a, b [H, D] or [D]; omega [H] or a scalar; positions [T] or [B, T].
// inverse: G(-n) = G(n)^T. The per-(head, position) coefficients are computed in the promoted
// dtype of a, b, omega and positions (float64 positions give float64 angles for float32 x) and
// cast to x's dtype; the O(D) mixing runs in x's dtype. Differentiable in x, a, b, omega.
torch::Tensor rodrigues_rotate(const torch::Tensor& x, const torch::Tensor& a,
                               const torch::Tensor& b, const torch::Tensor& omega,
                               const torch::Tensor& positions, bool inverse = false);

// E = Cayley(A) = (I - A)^{-1} (I + A), or matrix_exp(A) with use_exp, A = W - W^T (transpose of
// the last two dims). W [D, D] or [H, D, D]; E has W's shape and is orthogonal (det +1).
// W = 0 gives E = I exactly.
torch::Tensor orthogonal_basis(const torch::Tensor& W, bool use_exp = false);

// E R(theta) E^T x per token: y = E^T x, half-split rotation of y by the tables (see the sign
// convention above), back with E. x [B, H, T, D]; E [D, D] or [H, D, D] orthogonal; cos, sin
// [T, D/2] (or anything broadcasting to [B, H, T, D/2]). inverse: rotate by -theta. O(D^2) per
// token for a dense E. With E = I it is the plain half-split rotation, bit for bit.
torch::Tensor basis_rotate(const torch::Tensor& x, const torch::Tensor& E, const torch::Tensor& cos,
                           const torch::Tensor& sin, bool inverse = false);

// The first r columns of orthogonal_basis(W, use_exp): [D, r] or [H, D, r], orthonormal columns.
torch::Tensor thin_basis(const torch::Tensor& W, int64_t r, bool use_exp = false);

// x + E_r (exp(n L_r) - I) E_r^T x per token, L_r = M - M^T. x [B, H, T, D]; E_r [D, r] or
// [H, D, r] with orthonormal columns (thin_basis); M [r, r] or [H, r, r]; positions [T] or [B, T].
// exp(n_t L_r) for all positions with one batched torch::linalg_matrix_exp ([T, r, r], or with
// H / B leading dims), in the promoted dtype of M and positions, then cast to x's dtype.
// O(r D) per token besides the r x r exponentials. inverse: G(-n). Differentiable in x, E_r, M.
torch::Tensor thin_rotate(const torch::Tensor& x, const torch::Tensor& E_r, const torch::Tensor& M,
                          const torch::Tensor& positions, bool inverse = false);

// M [r, r] (r even, 2 <= r <= D) with M[m, m + r/2] = theta_m = base^(-2m/D), m < r/2, zero
// elsewhere, so L_r = M - M^T = block-diag(theta_m J) over the half-split planes (m, m + r/2) of
// the subspace, J = [[0, 1], [-1, 0]]: exp(n L_r) rotates plane m by -n theta_m, the first r/2
// planes of the spec's width-D RoPE. With E_r = the columns e_0..e_{r/2-1}, e_{D/2}..
// e_{D/2+r/2-1}, thin_rotate is that RoPE on those planes and leaves the other coordinates alone.
torch::Tensor thin_generator_init(int64_t r, double base, int64_t D,
                                  torch::ScalarType dtype = torch::kFloat);

}  // namespace relpos::nn
