// Helpers shared by the operator implementations (torch/ops.cpp, torch/attention_ops.cpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "core/types.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace relpos::nn::op_util {

// Runs f; a relpos::InputError becomes c10::ValueError, which Python raises as ValueError with
// the same named message the CLI prints.
template <class F>
auto value_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const InputError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// Data pointers for the kernels: null for an undefined or empty tensor (an absent operand).
template <class T>
const T* ptr(const torch::Tensor& t) {
  return t.defined() && t.numel() ? t.data_ptr<T>() : nullptr;
}
template <class T>
T* mptr(torch::Tensor& t) {
  return t.defined() && t.numel() ? t.data_ptr<T>() : nullptr;
}

// An output buffer the kernel will fill. Large ones are advised as transparent huge pages before
// their first write: a fresh 16 MiB tensor otherwise costs 4096 page faults taken by the kernel's
// threads at once, which can cost more than the kernel itself (measurements in
// docs/performance.md). Harmless where THP is off or the memory reused.
inline torch::Tensor output_like(const torch::Tensor& t) {
  auto out = torch::empty_like(t, torch::MemoryFormat::Contiguous);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const auto end = begin + static_cast<uintptr_t>(out.nbytes());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return out;
}

}  // namespace relpos::nn::op_util
