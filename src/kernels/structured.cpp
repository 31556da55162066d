#include "kernels/structured.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace relpos::kernels {

namespace {

constexpr int64_t kTile = 64;    // tokens per forward task
constexpr int64_t kChunks = 16;  // backward tasks per head: fixed, so the reduction order is too

template <class T>
void check(const StructuredDims& d, const T* U, const T* lambda, const double* pos) {
  if (d.B < 0 || d.H < 0 || d.T < 0 || d.D < 0 || d.M < 0 || d.DC < 0)
    throw InputError(
        fmt::format("structured: dimensions must be >= 0 (B {}, H {}, T {}, D {}, M {}, dc {})",
                    d.B, d.H, d.T, d.D, d.M, d.DC));
  if (d.D % 2) throw InputError(fmt::format("structured: head dim {} is odd", d.D));
  if (d.M < 1 || 2 * d.M > d.D)
    throw InputError(
        fmt::format("structured: {} planes do not fit head dim {} (need 1 <= 2m <= D)", d.M, d.D));
  if (d.DC < 1 || d.DC > 3)
    throw InputError(fmt::format("structured: {} position axes (d_c must be 1..3)", d.DC));
  const int64_t PB = d.positions_per_batch ? d.B : 1;
  for (int64_t i = 0; i < PB * d.T * d.DC; ++i)
    if (!std::isfinite(pos[i]))
      throw InputError(fmt::format("structured: position {} (token {}, axis {}) is not finite",
                                   pos[i], (i / d.DC) % std::max<int64_t>(d.T, 1), i % d.DC));
  const int64_t HL = d.freqs_per_head ? d.H : 1;
  for (int64_t i = 0; i < HL * d.DC * d.M; ++i)
    if (!std::isfinite(static_cast<double>(lambda[i])))
      throw InputError(fmt::format("structured: frequency lambda[{}] is not finite", i));
  const int64_t HU = d.basis_per_head ? d.H : 1;
  for (int64_t i = 0; i < HU * d.D * d.D; ++i)
    if (!std::isfinite(static_cast<double>(U[i])))
      throw InputError(fmt::format("structured: basis entry U[{}] is not finite", i));
  if (!d.check_basis) return;
  const double tol = sizeof(T) == 4 ? 1e-4 : 1e-10;
  const int64_t A = 2 * d.M;
  for (int64_t h = 0; h < HU; ++h) {
    const T* u = U + h * d.D * d.D;
    for (int64_t a = 0; a < A; ++a)
      for (int64_t b = a; b < A; ++b) {
        double s = 0;
        for (int64_t i = 0; i < d.D; ++i)
          s += static_cast<double>(u[i * d.D + a]) * static_cast<double>(u[i * d.D + b]);
        if (std::abs(s - (a == b ? 1.0 : 0.0)) > tol)
          throw InputError(fmt::format(
              "structured: basis U{} is not orthogonal: columns {} and {} have inner product "
              "{:.6g}",
              d.basis_per_head ? fmt::format(" of head {}", h) : std::string(), a, b, s));
      }
  }
}

bool parallel(const StructuredDims& d) {
  return d.B * d.H * d.T * d.D * d.M > (1 << 15);
}

// The per-row pointers and angles of token (b, h, t).
template <class T>
struct RowView {
  const T* U;
  const T* lambda;
  const double* r;
};

template <class T>
RowView<T> row_view(const StructuredDims& d, const T* U, const T* lambda, const double* pos,
                    int64_t b, int64_t h, int64_t t) {
  return {U + (d.basis_per_head ? h : 0) * d.D * d.D,
          lambda + (d.freqs_per_head ? h : 0) * d.DC * d.M,
          pos + ((d.positions_per_batch ? b : 0) * d.T + t) * d.DC};
}

// theta_u (times -1 when inverse) into cs[2u] = cos, cs[2u+1] = sin, in float64.
template <class T>
void angles(const StructuredDims& d, const RowView<T>& v, bool inverse, double* cs) {
  for (int64_t u = 0; u < d.M; ++u) {
    double th = 0;
    for (int64_t k = 0; k < d.DC; ++k) th += static_cast<double>(v.lambda[k * d.M + u]) * v.r[k];
    if (inverse) th = -th;
    cs[2 * u] = std::cos(th);
    cs[2 * u + 1] = std::sin(th);
  }
}

// z = U_act^T x (float64)
template <class T>
void project(const StructuredDims& d, const T* U, const T* x, double* z) {
  const int64_t A = 2 * d.M;
  std::fill(z, z + A, 0.0);
  for (int64_t i = 0; i < d.D; ++i) {
    const double xi = static_cast<double>(x[i]);
    const T* ui = U + i * d.D;
    for (int64_t a = 0; a < A; ++a) z[a] += static_cast<double>(ui[a]) * xi;
  }
}

// y = x + U_act delta
template <class T>
void lift(const StructuredDims& d, const T* U, const T* x, const double* delta, T* y) {
  const int64_t A = 2 * d.M;
  for (int64_t i = 0; i < d.D; ++i) {
    const T* ui = U + i * d.D;
    double s = 0;
    for (int64_t a = 0; a < A; ++a) s += static_cast<double>(ui[a]) * delta[a];
    y[i] = static_cast<T>(static_cast<double>(x[i]) + s);
  }
}

// w = R(+-theta) z per plane (transpose: R^T)
void turn(int64_t M, const double* cs, bool transpose, const double* z, double* w) {
  for (int64_t u = 0; u < M; ++u) {
    const double c = cs[2 * u], s = transpose ? -cs[2 * u + 1] : cs[2 * u + 1];
    const double z0 = z[2 * u], z1 = z[2 * u + 1];
    w[2 * u] = c * z0 - s * z1;
    w[2 * u + 1] = s * z0 + c * z1;
  }
}

}  // namespace

template <class T>
void structured_forward(const StructuredDims& d, bool inverse, const T* x, const T* U,
                        const T* lambda, const double* positions, T* y) {
  check(d, U, lambda, positions);
  const int64_t tiles = (d.T + kTile - 1) / kTile;
  const int64_t A = 2 * d.M;
#pragma omp parallel if (parallel(d))
  {
    std::vector<double> cs(A), z(A), w(A);
#pragma omp for collapse(3) schedule(static)
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.H; ++h)
        for (int64_t tile = 0; tile < tiles; ++tile)
          for (int64_t t = tile * kTile; t < std::min(d.T, (tile + 1) * kTile); ++t) {
            const auto v = row_view(d, U, lambda, positions, b, h, t);
            const int64_t row = ((b * d.H + h) * d.T + t) * d.D;
            angles(d, v, inverse, cs.data());
            project(d, v.U, x + row, z.data());
            turn(d.M, cs.data(), false, z.data(), w.data());
            for (int64_t a = 0; a < A; ++a) w[a] -= z[a];
            lift(d, v.U, x + row, w.data(), y + row);
          }
  }
}

template <class T>
void structured_backward(const StructuredDims& d, bool inverse, const T* x, const T* U,
                         const T* lambda, const double* positions, const T* dy, T* dx, double* dU,
                         double* dlambda) {
  check(d, U, lambda, positions);
  const int64_t A = 2 * d.M, n = d.B * d.T;
  const bool gU = dU != nullptr, gL = dlambda != nullptr;
  const int64_t chunks = std::min<int64_t>(kChunks, std::max<int64_t>(n, 1));
  // per (head, chunk) partial sums in float64: dU_act [D, 2M] and dlambda [dc, M]
  const int64_t su = gU ? d.D * A : 0, sl = gL ? d.DC * d.M : 0;
  std::vector<double> pu(static_cast<size_t>(d.H * chunks * su), 0.0);
  std::vector<double> pl(static_cast<size_t>(d.H * chunks * sl), 0.0);
#pragma omp parallel if (parallel(d))
  {
    std::vector<double> cs(A), z(A), w(A), g(A), rg(A), delta(A);
    std::vector<T> out(static_cast<size_t>(d.D));
#pragma omp for collapse(2) schedule(static)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t c = 0; c < chunks; ++c) {
        double* du = pu.data() + (h * chunks + c) * su;
        double* dl = pl.data() + (h * chunks + c) * sl;
        for (int64_t bt = c * n / chunks; bt < (c + 1) * n / chunks; ++bt) {
          const int64_t b = bt / d.T, t = bt % d.T;
          const auto v = row_view(d, U, lambda, positions, b, h, t);
          const int64_t row = ((b * d.H + h) * d.T + t) * d.D;
          const T* gr = dy + row;
          angles(d, v, inverse, cs.data());
          project(d, v.U, gr, g.data());  // g' = U_act^T dy
          turn(d.M, cs.data(), true, g.data(), rg.data());
          for (int64_t a = 0; a < A; ++a) delta[a] = rg[a] - g[a];
          lift(d, v.U, gr, delta.data(), out.data());  // dx = dy + U_act (R^T g' - g')
          if (gU || gL) {
            const T* xr = x + row;
            project(d, v.U, xr, z.data());
            turn(d.M, cs.data(), false, z.data(), w.data());
            if (gU)  // d<dy, y>/dU_act = dy (w - z)^T + x (R^T g' - g')^T
              for (int64_t i = 0; i < d.D; ++i) {
                const double gi = static_cast<double>(gr[i]), xi = static_cast<double>(xr[i]);
                double* di = du + i * A;
                for (int64_t a = 0; a < A; ++a) di[a] += gi * (w[a] - z[a]) + xi * delta[a];
              }
            if (gL) {
              const double* r = v.r;
              for (int64_t u = 0; u < d.M; ++u) {
                // d/dtheta of g'^T R(theta) z = g'^T J w
                double dth = g[2 * u + 1] * w[2 * u] - g[2 * u] * w[2 * u + 1];
                if (inverse) dth = -dth;
                for (int64_t k = 0; k < d.DC; ++k) dl[k * d.M + u] += dth * r[k];
              }
            }
          }
          std::copy(out.begin(), out.end(), dx + row);
        }
      }
  }
  if (gU) {
    const int64_t HU = d.basis_per_head ? d.H : 1;
    std::fill(dU, dU + HU * d.D * d.D, 0.0);
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t c = 0; c < chunks; ++c) {
        const double* p = pu.data() + (h * chunks + c) * su;
        double* o = dU + (d.basis_per_head ? h : 0) * d.D * d.D;
        for (int64_t i = 0; i < d.D; ++i)
          for (int64_t a = 0; a < A; ++a) o[i * d.D + a] += p[i * A + a];
      }
  }
  if (gL) {
    const int64_t HL = d.freqs_per_head ? d.H : 1;
    std::fill(dlambda, dlambda + HL * sl, 0.0);
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t c = 0; c < chunks; ++c) {
        const double* p = pl.data() + (h * chunks + c) * sl;
        double* o = dlambda + (d.freqs_per_head ? h : 0) * sl;
        for (int64_t i = 0; i < sl; ++i) o[i] += p[i];
      }
  }
}

#define RELPOS_STRUCTURED_INSTANTIATE(T)                                                          \
  template void structured_forward<T>(const StructuredDims&, bool, const T*, const T*, const T*,  \
                                      const double*, T*);                                         \
  template void structured_backward<T>(const StructuredDims&, bool, const T*, const T*, const T*, \
                                       const double*, const T*, T*, double*, double*);
RELPOS_STRUCTURED_INSTANTIATE(float)
RELPOS_STRUCTURED_INSTANTIATE(double)
#undef RELPOS_STRUCTURED_INSTANTIATE

}  // namespace relpos::kernels
