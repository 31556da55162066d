// Whether a tensor holds no NaN or Inf: this is the modules' check_finite. Contiguous float
// tensors are read once, their exponent bits compared as integers, in parallel chunks.
// torch::isfinite(t).all() first writes a mask as large as t, about 5x the time on a
// 1x8x8192x64 float tensor. Any other tensor takes one min/max pass: NaN propagates through the
// reduction, and +-Inf are the extremes.
#pragma once

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>

#include "kernels/finite.hpp"

namespace relpos::nn {

inline bool all_finite(const torch::Tensor& t) {
  if (t.numel() == 0) return true;
  uint64_t exponent = 0;
  switch (t.scalar_type()) {
    case torch::kFloat:
      exponent = 0x7f800000u;
      break;
    case torch::kDouble:
      exponent = 0x7ff0000000000000u;
      break;
    case torch::kBFloat16:
      exponent = 0x7f80u;
      break;
    case torch::kHalf:
      exponent = 0x7c00u;
      break;
    default:
      break;
  }
  if (exponent == 0 || !t.is_contiguous() || !t.device().is_cpu()) {
    const auto [lo, hi] = torch::aminmax(t);
    return std::isfinite(lo.item<double>()) && std::isfinite(hi.item<double>());
  }
  const auto* x = static_cast<const unsigned char*>(t.data_ptr());
  const int bytes = static_cast<int>(t.element_size());
  std::atomic<bool> finite{true};
  at::parallel_for(0, t.numel(), int64_t{1} << 16, [&](int64_t lo, int64_t hi) {
    if (finite.load(std::memory_order_relaxed) &&
        !kernels::finite_values(x + lo * bytes, hi - lo, bytes, exponent))
      finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

}  // namespace relpos::nn
