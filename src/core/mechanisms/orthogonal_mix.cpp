// orthogonal_mix: a fixed orthogonal map P of the head (Haar-random from a seed, or a random
// rotation of the coordinate pairs). Composed before a rotary term it gives P^T RoPE P, RoPE in a
// rotated basis (the structure of learned-basis rotations): the score stays a function of the lag,
// q^T P^T G(i - j) P k, and `verify` checks it like any other exact mechanism.
#include <Eigen/Dense>
#include <random>

#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> orthogonal_mix_family() {
  return {{{"orthogonal_mix",
            "transform",
            "fixed orthogonal map P (Haar-random from a seed); before a rotary term: P^T RoPE P",
            "exact",
            "structured rotations (Cayley / learned basis), fixed",
            {{"seed", "0", "random seed of P"}},
            {}},
           [](const Args& a, TermBuilder& b) {
             const int D = b.m.head_dim;
             const auto seed = parse_int64(a.str("seed"), 0, INT64_MAX);
             if (!seed)
               throw InputError(fmt::format("{}: option seed='{}' must be an integer >= 0",
                                            a.term(), brief(a.str("seed"))));
             // Haar measure: QR of a Gaussian matrix with the signs of R's diagonal moved to Q
             std::mt19937_64 rng(static_cast<uint64_t>(*seed));
             std::normal_distribution<double> n01;
             Eigen::MatrixXd g(D, D);
             for (int i = 0; i < D; ++i)
               for (int j = 0; j < D; ++j) g(i, j) = n01(rng);
             Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
             Eigen::MatrixXd Q = qr.householderQ();
             const Eigen::MatrixXd R = qr.matrixQR().triangularView<Eigen::Upper>();
             for (int j = 0; j < D; ++j)
               if (R(j, j) < 0) Q.col(j) = -Q.col(j);
             std::vector<double> M(static_cast<size_t>(D) * D);
             for (int i = 0; i < D; ++i)
               for (int j = 0; j < D; ++j) M[static_cast<size_t>(i) * D + j] = Q(i, j);
             b.add_fixed_linear(M, M);  // orthogonal: M^{-T} = M
           }}};
}

}  // namespace relpos::mechanisms
