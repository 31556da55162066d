// The decode cache's operators for the Python KVCache (python/relpos/engine.py), so that it runs
// the C++ DecodeCache's bookkeeping (torch/attention_module.hpp), and the modules' finiteness
// check:
//   cache_step(lengths, stored_positions, positions?, key_len?, T) -> (positions, counts)
//       the new tokens' float64 positions [B, T] (given, or each row's continuation) and valid
//       counts [B], checked against each row's last cached position
//   cache_append(keys!, values!, positions!, lengths!, content![], k, v, pos, counts, new[])
//       the new tokens written after each row's length (the caller grows the storage first)
//   nonfinite(Tensor[] tensors) -> int
//       the index of the first tensor holding NaN or Inf, -1 when none does (one pass each)
#include <torch/library.h>
#include <torch/torch.h>

#include "torch/attention_module.hpp"
#include "torch/finite.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

std::tuple<torch::Tensor, torch::Tensor> cache_step_op(
    const torch::Tensor& lengths, const torch::Tensor& stored,
    const c10::optional<torch::Tensor>& positions, const c10::optional<torch::Tensor>& key_len,
    int64_t T) {
  return op_util::value_errors([&] {
    auto s = cache_step(lengths, stored, positions.value_or(torch::Tensor()),
                        key_len.value_or(torch::Tensor()), T);
    return std::make_tuple(s.positions, s.counts);
  });
}

void cache_append_op(const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& positions, const torch::Tensor& lengths,
                     at::TensorList content_store, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& pos, const torch::Tensor& counts,
                     at::TensorList content) {
  op_util::value_errors([&] {
    cache_append(keys, values, positions, lengths, content_store.vec(), k, v, pos, counts,
                 content.vec());
    return 0;
  });
}

int64_t nonfinite_op(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!all_finite(tensors[i])) return static_cast<int64_t>(i);
  return -1;
}

}  // namespace

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def(
      "cache_step(Tensor lengths, Tensor stored_positions, Tensor? positions, Tensor? key_len, "
      "int length) -> (Tensor, Tensor)",
      relpos::nn::cache_step_op);
  m.def(
      "cache_append(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) positions, Tensor(d!) lengths, "
      "Tensor(e!)[] content_store, Tensor k, Tensor v, Tensor pos, Tensor counts, "
      "Tensor[] content) -> ()",
      relpos::nn::cache_append_op);
  m.def("nonfinite(Tensor[] tensors) -> int", relpos::nn::nonfinite_op);
}
