#include "kernels/rotate.hpp"

#include <fmt/format.h>

#include <vector>

namespace relpos::kernels {

namespace {

void check(const RotateDims& d) {
  if (d.B < 0 || d.H < 0 || d.T < 0 || d.D < 0 || d.P < 0)
    throw InputError(
        fmt::format("rotate_pairs: dimensions must be >= 0 (B {}, H {}, T {}, D {}, P {})", d.B,
                    d.H, d.T, d.D, d.P));
  if (d.D % 2) throw InputError(fmt::format("rotate_pairs: head dim {} is odd", d.D));
  if (2 * d.P > d.D)
    throw InputError(fmt::format("rotate_pairs: {} angle pairs do not fit head dim {}", d.P, d.D));
}

// Coordinates of pair p: first = p * step, second = first + offset.
struct PairIndex {
  int64_t step, offset;
};
PairIndex pair_index(Layout layout, int64_t D) {
  return layout == Layout::Interleaved ? PairIndex{2, 1} : PairIndex{1, D / 2};
}

// Offsets of the frame of token (b, t) in cos/sin and of the row (b, h, t) in x.
int64_t frame_offset(const RotateDims& d, int64_t b, int64_t t) {
  return ((d.angles_per_batch ? b : 0) * d.T + t) * d.P;
}
int64_t row_offset(const RotateDims& d, int64_t b, int64_t h, int64_t t) {
  return ((b * d.H + h) * d.T + t) * d.D;
}

bool parallel(const RotateDims& d) {
  return d.B * d.T * d.H * d.D > (1 << 16);
}

}  // namespace

template <class T>
void rotate_pairs_forward(const RotateDims& d, Layout layout, bool inverse, const T* x,
                          const T* cos, const T* sin, T* y) {
  check(d);
  const auto [step, offset] = pair_index(layout, d.D);
  const T sign = inverse ? T(-1) : T(1);
#pragma omp parallel for collapse(3) schedule(static) if (parallel(d))
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t t = 0; t < d.T; ++t) {
        const T* c = cos + frame_offset(d, b, t);
        const T* s = sin + frame_offset(d, b, t);
        const int64_t row = row_offset(d, b, h, t);
        const T* xr = x + row;
        T* yr = y + row;
        if (yr != xr)
          for (int64_t i = 0; i < d.D; ++i) yr[i] = xr[i];
        for (int64_t p = 0; p < d.P; ++p) {
          const int64_t i = p * step, j = i + offset;
          const T x0 = xr[i], x1 = xr[j], sn = sign * s[p];
          yr[i] = c[p] * x0 - sn * x1;
          yr[j] = sn * x0 + c[p] * x1;
        }
      }
}

template <class T>
void rotate_pairs_backward(const RotateDims& d, Layout layout, bool inverse, const T* x,
                           const T* cos, const T* sin, const T* dy, T* dx, T* dcos, T* dsin) {
  check(d);
  const auto [step, offset] = pair_index(layout, d.D);
  const T sign = inverse ? T(-1) : T(1);
  const bool grads = dcos && dsin;
  // per (b, t) partial sums over heads in float64; shared angles are summed over b afterwards
  std::vector<double> gc(grads ? static_cast<size_t>(d.B * d.T * d.P) : 0, 0.0), gs(gc);
#pragma omp parallel for collapse(2) schedule(static) if (parallel(d))
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t) {
      const T* c = cos + frame_offset(d, b, t);
      const T* s = sin + frame_offset(d, b, t);
      double* pc = grads ? gc.data() + (b * d.T + t) * d.P : nullptr;
      double* ps = grads ? gs.data() + (b * d.T + t) * d.P : nullptr;
      for (int64_t h = 0; h < d.H; ++h) {
        const int64_t row = row_offset(d, b, h, t);
        const T* xr = x + row;
        const T* gr = dy + row;
        T* dr = dx + row;
        if (dr != gr)
          for (int64_t i = 0; i < d.D; ++i) dr[i] = gr[i];
        for (int64_t p = 0; p < d.P; ++p) {
          const int64_t i = p * step, j = i + offset;
          const T g0 = gr[i], g1 = gr[j], sn = sign * s[p];
          if (grads) {
            const T x0 = xr[i], x1 = xr[j];
            pc[p] += static_cast<double>(g0) * x0 + static_cast<double>(g1) * x1;
            ps[p] += static_cast<double>(sign) *
                     (static_cast<double>(g1) * x0 - static_cast<double>(g0) * x1);
          }
          dr[i] = c[p] * g0 + sn * g1;  // R^T g
          dr[j] = c[p] * g1 - sn * g0;
        }
      }
    }
  if (!grads) return;
  const int64_t AB = d.angles_per_batch ? d.B : 1, n = d.T * d.P;
  for (int64_t ab = 0; ab < AB; ++ab)
    for (int64_t i = 0; i < n; ++i) {
      double sc = 0, ss = 0;
      for (int64_t b = ab; b < (d.angles_per_batch ? ab + 1 : d.B); ++b) {
        sc += gc[b * n + i];
        ss += gs[b * n + i];
      }
      dcos[ab * n + i] = static_cast<T>(sc);
      dsin[ab * n + i] = static_cast<T>(ss);
    }
}

#define RELPOS_ROTATE_INSTANTIATE(T)                                                          \
  template void rotate_pairs_forward<T>(const RotateDims&, Layout, bool, const T*, const T*,  \
                                        const T*, T*);                                        \
  template void rotate_pairs_backward<T>(const RotateDims&, Layout, bool, const T*, const T*, \
                                         const T*, const T*, T*, T*, T*);
RELPOS_ROTATE_INSTANTIATE(float)
RELPOS_ROTATE_INSTANTIATE(double)
#undef RELPOS_ROTATE_INSTANTIATE

}  // namespace relpos::kernels
