#include "kernels/scan.hpp"

#include <fmt/format.h>

#include <cmath>
#include <vector>

#include "core/types.hpp"

namespace relpos::kernels {

namespace {

void check(const ScanDims& d, const void* x, const void* y) {
  if (d.B < 0 || d.T < 0 || d.C < 0)
    throw InputError(
        fmt::format("causal scan: dimensions must be >= 0 (B {}, T {}, C {})", d.B, d.T, d.C));
  if (d.B * d.T * d.C > 0 && (!x || !y)) throw InputError("causal scan: null buffer");
  if (x == y && x) throw InputError("causal scan: input and output may not alias");
}

// Running compensated sums over C channels (Neumaier: the lost low part of each addition is
// kept in `comp` and added back when a value is written).
template <class T>
struct Accumulator {
  std::vector<T> sum, comp;
  explicit Accumulator(int64_t C) : sum(static_cast<size_t>(C), T(0)), comp(sum) {}
  void add(const T* x) {
    const size_t n = sum.size();
    for (size_t c = 0; c < n; ++c) {
      const T s = sum[c], v = x[c], t = s + v;
      comp[c] += std::abs(s) >= std::abs(v) ? (s - t) + v : (v - t) + s;
      sum[c] = t;
    }
  }
  void write(T* out) const {
    const size_t n = sum.size();
    for (size_t c = 0; c < n; ++c) out[c] = sum[c] + comp[c];
  }
};

// out row r(t) = running sum before (exclusive) or after (inclusive) adding in row t, walking
// t in the given direction; rows are C-strided.
template <class T>
void scan_rows(const T* in, T* out, int64_t T_, int64_t C, bool forward, bool inclusive,
               bool reverse_output) {
  Accumulator<T> acc(C);
  for (int64_t k = 0; k < T_; ++k) {
    const int64_t t = forward ? k : T_ - 1 - k;
    const int64_t o = reverse_output ? T_ - 1 - t : t;
    if (!inclusive) acc.write(out + o * C);
    acc.add(in + t * C);
    if (inclusive) acc.write(out + o * C);
  }
}

}  // namespace

template <class T>
void causal_scan_forward(ScanMode mode, const ScanDims& d, const T* a, T* phi) {
  check(d, a, phi);
  for (int64_t b = 0; b < d.B; ++b) {
    const T* x = a + b * d.T * d.C;
    T* y = phi + b * d.T * d.C;
    if (mode == ScanMode::Exclusive)
      scan_rows(x, y, d.T, d.C, /*forward=*/true, /*inclusive=*/false, /*reverse_output=*/false);
    else  // Phi_t = c_{T-1-t}: the inclusive prefix written time-reversed
      scan_rows(x, y, d.T, d.C, true, true, /*reverse_output=*/true);
  }
}

template <class T>
void causal_scan_backward(ScanMode mode, const ScanDims& d, const T* dphi, T* da) {
  check(d, dphi, da);
  for (int64_t b = 0; b < d.B; ++b) {
    const T* g = dphi + b * d.T * d.C;
    T* y = da + b * d.T * d.C;
    if (mode == ScanMode::Exclusive) {
      // da_s = sum_{t>s} dphi_t: an exclusive scan from the end
      scan_rows(g, y, d.T, d.C, /*forward=*/false, /*inclusive=*/false, false);
    } else {
      // Phi_t = sum_{s<=T-1-t} a_s, so da_s = sum_{t<=T-1-s} dphi_t: the inclusive prefix of
      // dphi, read time-reversed
      scan_rows(g, y, d.T, d.C, /*forward=*/true, /*inclusive=*/true, /*reverse_output=*/true);
    }
  }
}

template void causal_scan_forward<float>(ScanMode, const ScanDims&, const float*, float*);
template void causal_scan_forward<double>(ScanMode, const ScanDims&, const double*, double*);
template void causal_scan_backward<float>(ScanMode, const ScanDims&, const float*, float*);
template void causal_scan_backward<double>(ScanMode, const ScanDims&, const double*, double*);

}  // namespace relpos::kernels
