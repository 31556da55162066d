// structured: equivariant structured rotations by vector positions r in R^{d_c} ("Equivariant
// Structured Positional Rotations", Sec. 2; core/structured.hpp has the math):
//   R(r) = U [ (+)_u R_2(theta_u(r)) ] U^T,   theta_u(r) = sum_k lambda_{k,u} r_k,
// every one of the D/2 planes of the head turning (d_null = 0). Keys and queries both get R(r),
// so q~_i . k~_j = q_i . R(r_j - r_i) k_j (Theorem 1: exact for a commuting family).
//   axial   U = I, the planes split into d_c contiguous groups, axis k turning group k at the RoPE
//           spectrum of its group, theta^(-j / m_k) (axial RoPE; fixed)
//   mixed   U = I, every plane turned by every axis, lambda learned (RoPE-Mixed), initialised at
//           the axial magnitudes along a seeded random direction per head and plane
//   cayley, exp   mixed's lambda and a learned basis U = E P, E = cayley / exp of W - W^T per head
//           (W = 0 at init: U = P), P the pair layout's planes; cayley (the paper's learned-basis
//           rotation) is the default
// Reference names: axial_rope = structured(basis=axial), mixed_rope = structured(basis=mixed)
// (the structured-2d experiment's method names; core/spec.cpp).
// A call gives positions [T, d_c] or [B, T, d_c]; the torch runtime
// (torch/mechanisms/structured.cpp) owns lambda and W and turns q and k with the fast kernel
// (kernels/structured.hpp).
#include <numbers>
#include <random>

#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> structured_family() {
  std::vector<TermDef> d;
  d.push_back({{"structured",
                "transform",
                "rotation by vector positions r in R^dims: U [(+)_u R_2(sum_k lambda_ku r_k)] U^T; "
                "basis cayley / exp (learned lambda and basis U), mixed (learned lambda, "
                "RoPE-Mixed), axial (fixed axial RoPE)",
                "exact (Theorem 1: relative in r_j - r_i for a commuting family)",
                "Structured rotations 2, Lemmas 1-3, Theorem 1",
                {{"dims", "2", "d_c: the components of a position (1, 2 or 3)"},
                 {"basis", "cayley", "cayley, exp, mixed or axial"},
                 {"theta", "100", "frequency base of the per-axis spectrum"},
                 {"seed", "0", "seed of the initial directions (mixed, cayley, exp)"}},
                {"axial_rope", "mixed_rope"}},
               [](const Args& a, TermBuilder& b) {
                 const int D = b.m.head_dim, H = b.m.heads, dc = a.integer("dims", 1, 3);
                 require_divisible(a, D, 2, "rotation planes");
                 const int M = D / 2;
                 if (M < dc)
                   throw InputError(
                       fmt::format("{}: dims={} needs at least {} rotation planes (head dim "
                                   "{}), one per axis",
                                   a.term(), dc, dc, D));
                 const double theta = a.positive("theta");
                 const int seed = a.integer("seed", 0, 1 << 30);
                 TransformTerm t;
                 t.name = b.term_name;
                 t.kind = TransformKind::Structured;
                 t.time = TimeSource::VectorPosition;
                 t.basis = a.choice("basis", {"axial", "mixed", "cayley", "exp"});
                 t.learned_frequencies = t.basis != "axial";
                 t.vector_dims = dc;
                 t.planes = M;
                 // axial groups: sizes differ by at most one, the first axes take the extra planes
                 std::vector<int> axis(static_cast<size_t>(M));
                 std::vector<double> magnitude(static_cast<size_t>(M));
                 for (int k = 0, u = 0; k < dc; ++k) {
                   const int mk = M / dc + (k < M % dc ? 1 : 0);
                   for (int j = 0; j < mk; ++j, ++u) {
                     axis[static_cast<size_t>(u)] = k;
                     magnitude[static_cast<size_t>(u)] =
                         std::pow(theta, -static_cast<double>(j) / mk);
                   }
                 }
                 std::mt19937_64 rng(static_cast<uint64_t>(seed));
                 std::normal_distribution<double> normal;
                 t.plane_freqs.assign(static_cast<size_t>(H) * dc * M, 0.0);
                 for (int h = 0; h < H; ++h)
                   for (int u = 0; u < M; ++u) {
                     std::vector<double> dir(static_cast<size_t>(dc), 0.0);
                     if (t.basis == "axial") {
                       dir[static_cast<size_t>(axis[static_cast<size_t>(u)])] = 1.0;
                     } else {  // a uniform direction on the unit sphere of R^dc
                       double n = 0;
                       while (n < 1e-12) {
                         n = 0;
                         for (auto& x : dir) {
                           x = normal(rng);
                           n += x * x;
                         }
                       }
                       for (auto& x : dir) x /= std::sqrt(n);
                     }
                     for (int k = 0; k < dc; ++k)
                       t.plane_freqs[(static_cast<size_t>(h) * dc + k) * M + u] =
                           magnitude[static_cast<size_t>(u)] * dir[static_cast<size_t>(k)];
                   }
                 b.m.transforms.push_back(std::move(t));
               }});
  return d;
}

}  // namespace relpos::mechanisms
