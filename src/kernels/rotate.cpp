#include "kernels/rotate.hpp"

#include <fmt/format.h>

#include "kernels/isa.hpp"

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

}  // namespace

#define RELPOS_DECLARE_ROTATE(NS)                                                               \
  namespace NS {                                                                                \
  template <class T>                                                                            \
  void rotate_forward(const RotateDims&, Layout, bool, const T*, const T*, const T*, T*);       \
  template <class T>                                                                            \
  void rotate_backward(const RotateDims&, Layout, bool, const T*, const T*, const T*, const T*, \
                       T*, T*, T*);                                                             \
  template <class T>                                                                            \
  void cos_sin(const T*, int64_t, T*, T*);                                                      \
  bool rotate_half(const RotateDims&, Layout, bool, HalfType, const uint16_t*, const float*,    \
                   const float*, uint16_t*, bool, int);                                         \
  }
RELPOS_ISA_FOR_EACH(RELPOS_DECLARE_ROTATE)
#undef RELPOS_DECLARE_ROTATE

template <class T>
void rotate_pairs_forward(const RotateDims& d, Layout layout, bool inverse, const T* x,
                          const T* cos, const T* sin, T* y) {
  check(d);
  RELPOS_ISA_DISPATCH(rotate_forward<T>, d, layout, inverse, x, cos, sin, y);
}

template <class T>
void rotate_pairs_backward(const RotateDims& d, Layout layout, bool inverse, const T* x,
                           const T* cos, const T* sin, const T* dy, T* dx, T* dcos, T* dsin) {
  check(d);
  RELPOS_ISA_DISPATCH(rotate_backward<T>, d, layout, inverse, x, cos, sin, dy, dx, dcos, dsin);
}

bool rotate_pairs_half(const RotateDims& d, Layout layout, bool inverse, HalfType type,
                       const uint16_t* x, const float* cos, const float* sin, uint16_t* y,
                       bool check_outputs, int tensors) {
  check(d);
  RELPOS_ISA_DISPATCH(rotate_half, d, layout, inverse, type, x, cos, sin, y, check_outputs,
                      tensors);
}

template <class T>
void cos_sin(const T* angles, int64_t n, T* cos, T* sin) {
  if (n < 0) throw InputError(fmt::format("cos_sin: {} angles", n));
  RELPOS_ISA_DISPATCH(cos_sin<T>, angles, n, cos, sin);
}

#define RELPOS_ROTATE_INSTANTIATE(T)                                                          \
  template void rotate_pairs_forward<T>(const RotateDims&, Layout, bool, const T*, const T*,  \
                                        const T*, T*);                                        \
  template void rotate_pairs_backward<T>(const RotateDims&, Layout, bool, const T*, const T*, \
                                         const T*, const T*, T*, T*, T*);                     \
  template void cos_sin<T>(const T*, int64_t, T*, T*);
RELPOS_ROTATE_INSTANTIATE(float)
RELPOS_ROTATE_INSTANTIATE(double)
#undef RELPOS_ROTATE_INSTANTIATE

}  // namespace relpos::kernels
