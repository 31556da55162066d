// The encoding operators of TORCH_LIBRARY(relpos) for the Python PositionEncoding, so that it
// holds no copy of the C++ module's construction or reparameterisation:
//   encoding_state(spec, head_dim, heads, bias_heads=0)
//                                                the C++ PositionEncoding's parameters and buffers
//       -> (json, Tensor[])                      as created (names, which are parameters, values:
//                                                the schema's raw tensors inverted from the
//                                                initial values, fixed maps, learned lag tables
//                                                drawn from torch's generator in the same order)
//   encoding_kernel_params(spec, head_dim, heads, Tensor[] schema) -> Tensor[4]
//       gamma, eta, gates, alpha0 from raw, fixed, bound, learn per schema entry
//       (schema_kernel_params; CompositeImplicitAutograd: autograd runs through its LibTorch ops)
#include <fmt/format.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "core/registry.hpp"
#include "torch/encoding.hpp"
#include "torch/op_util.hpp"

namespace relpos::nn {

namespace {

std::tuple<std::string, std::vector<torch::Tensor>> encoding_state_op(const std::string& spec,
                                                                      int64_t head_dim,
                                                                      int64_t heads,
                                                                      int64_t bias_heads) {
  return op_util::value_errors([&] {
    PositionEncoding enc(spec, head_dim, heads, EncodingOptions{.bias_heads = bias_heads});
    nlohmann::json names = nlohmann::json::array(), params = nlohmann::json::array();
    std::vector<torch::Tensor> values;
    for (const auto& p : enc->named_parameters(false)) {
      names.push_back(p.key());
      params.push_back(p.key());
      values.push_back(p.value().detach().clone());
    }
    for (const auto& b : enc->named_buffers(false)) {
      names.push_back(b.key());
      values.push_back(b.value().clone());
    }
    return std::tuple<std::string, std::vector<torch::Tensor>>{
        nlohmann::json{{"names", names}, {"parameters", params}}.dump(), values};
  });
}

std::vector<torch::Tensor> encoding_kernel_params_op(const std::string& spec, int64_t head_dim,
                                                     int64_t heads, at::TensorList schema) {
  return op_util::value_errors([&] {
    if (head_dim <= 0 || head_dim > kMaxHeadDim || heads <= 0 || heads > kMaxHeads)
      throw InputError(fmt::format("head dim {} / heads {} out of range", head_dim, heads));
    const Mechanism m = build_mechanism(spec, static_cast<int>(head_dim), static_cast<int>(heads));
    const KernelParams p = schema_kernel_params(m, schema.vec());
    return std::vector<torch::Tensor>{p.gamma, p.eta, p.gates, p.alpha0};
  });
}

}  // namespace

}  // namespace relpos::nn

TORCH_LIBRARY_FRAGMENT(relpos, m) {
  m.def("encoding_state(str spec, int head_dim, int heads, int bias_heads=0) -> (str, Tensor[])",
        relpos::nn::encoding_state_op);
  m.def("encoding_kernel_params(str spec, int head_dim, int heads, Tensor[] schema) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(relpos, CompositeImplicitAutograd, m) {
  m.impl("encoding_kernel_params", relpos::nn::encoding_kernel_params_op);
}
