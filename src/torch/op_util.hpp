// Helpers shared by the operator implementations (torch/ops.cpp, torch/attention_ops.cpp).
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "core/types.hpp"
#include "kernels/half.hpp"

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
inline torch::Tensor output_of(torch::IntArrayRef sizes, const torch::TensorOptions& options) {
  auto out = torch::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const auto end = begin + static_cast<uintptr_t>(out.nbytes());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return out;
}
inline torch::Tensor output_like(const torch::Tensor& t) {
  return output_of(t.sizes(), t.options());
}

// Half-precision storage. bf16 and fp16 tensors are read into float32, computed there (angles,
// products and accumulation), and the results stored back in the caller's dtype: the kernels
// keep one float32 path, and a half tensor never carries an intermediate.
inline bool is_half(c10::ScalarType t) {
  return t == torch::kBFloat16 || t == torch::kHalf;
}
// The dtypes an operand may be stored in.
inline bool storable(c10::ScalarType t) {
  return t == torch::kFloat || t == torch::kDouble || is_half(t);
}
// The dtype the kernels compute a stored dtype in.
inline c10::ScalarType compute_type(c10::ScalarType t) {
  return is_half(t) ? torch::kFloat : t;
}
// Half storage: the 16-bit words the kernels' half entry points read and write (null for an
// empty tensor: a gradient not asked for), and their format.
inline const uint16_t* words(const torch::Tensor& t) {
  return t.numel() ? static_cast<const uint16_t*>(t.const_data_ptr()) : nullptr;
}
inline uint16_t* mwords(torch::Tensor& t) {
  return t.numel() ? static_cast<uint16_t*>(t.data_ptr()) : nullptr;
}
inline kernels::HalfType half_type(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 ? kernels::HalfType::BFloat16
                                             : kernels::HalfType::Float16;
}
// t in its compute dtype, contiguous (undefined stays undefined).
inline torch::Tensor computed(const torch::Tensor& t) {
  if (!t.defined()) return t;
  return (is_half(t.scalar_type()) ? t.to(torch::kFloat) : t).contiguous();
}
// Whether a parameter of dtype `t` may go with operands stored as `x`: the same dtype, or float32
// beside half operands (angles and bases kept in float32).
inline bool goes_with(c10::ScalarType t, c10::ScalarType x) {
  return t == x || t == compute_type(x);
}
// A computed result stored back in `dtype`.
inline torch::Tensor stored(const torch::Tensor& t, c10::ScalarType dtype) {
  return !t.defined() || t.scalar_type() == dtype ? t : t.to(dtype);
}

}  // namespace relpos::nn::op_util
