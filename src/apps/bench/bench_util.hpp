// What every relpos-bench benchmark shares: medians, the thread count, LibTorch's version.
#pragma once

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <omp.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace relpos::bench {

inline double median(std::vector<double> x) {
  if (x.empty()) return std::nan("");
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

inline std::string torch_version() {
  return fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}

// The threads an OpenMP region gets (what our kernels and LibTorch use).
inline int used_omp_threads() {
  int n = 0;
#pragma omp parallel
  {
#pragma omp single
    n = omp_get_num_threads();
  }
  return n;
}

inline void set_threads(int n) {
  if (n > 0) at::set_num_threads(n);  // OpenMP (and MKL) threads of LibTorch and our kernels
}

}  // namespace relpos::bench
