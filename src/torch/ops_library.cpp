// The operator library's own translation unit: relpos_ops is the torch layer linked whole
// (CMakeLists.txt), and `torch.ops.load_library` runs the TORCH_LIBRARY registrations of
// torch/ops.cpp. Built with Python's headers (RELPOS_PYTHON_MODULE), the library is also the
// Python module relpos._relpos_ops, whose functions call a StepPlan's steps directly:
//   step_decode(plan, <plan.decode's arguments>), step_transform(plan, <plan.transform's>)
// On caches a decoder's other layers left cold, TorchScript's method call (the method's lookup,
// each argument converted against its schema, the boxed call) cost 70-129 us a step against 13-26
// for these (bench/bench_step_parts.py, docs/performance.md); the package falls back to the
// methods without them.
#ifdef RELPOS_PYTHON_MODULE
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/utils/pybind.h>

#include "torch/step_plan.hpp"

namespace {

using relpos::nn::StepPlan;
using Tensors = std::vector<torch::Tensor>;
using OptionalTensor = std::optional<torch::Tensor>;

c10::intrusive_ptr<StepPlan> plan_of(const torch::jit::Object& plan) {
  return c10::IValue(plan._ivalue()).toCustomClass<StepPlan>();
}

}  // namespace

// Each call as TorchScript's: errors and warnings as Python's (ValueError for bad input, the
// package's InputError), the GIL released while the step runs (the plan converted with the
// arguments, under the GIL; neither its C++ object nor the step touches a Python object).
PYBIND11_MODULE(_relpos_ops, m) {
  namespace py = pybind11;
  m.doc() = "relpos's operator library: StepPlan's steps without TorchScript's method call";
  m.def("step_decode",
        torch::wrap_pybind_function_no_gil(
            [](const torch::jit::Object& plan, const torch::Tensor& q, const torch::Tensor& k,
               const torch::Tensor& v, const torch::Tensor& keys, const torch::Tensor& values,
               const torch::Tensor& positions, const torch::Tensor& lengths,
               const OptionalTensor& new_positions, const OptionalTensor& key_len,
               const Tensors& schema, int64_t num_heads, int64_t layout, bool causal, double window,
               double scale, bool check_finite, int64_t warned, const Tensors& content_params,
               const OptionalTensor& inputs, const Tensors& content_store) {
              return relpos::nn::decode_method(plan_of(plan), q, k, v, keys, values, positions,
                                               lengths, new_positions, key_len, schema, num_heads,
                                               layout, causal, window, scale, check_finite, warned,
                                               content_params, inputs, content_store);
            }),
        py::arg("plan"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keys"),
        py::arg("values"), py::arg("positions"), py::arg("lengths"), py::arg("new_positions"),
        py::arg("key_len"), py::arg("schema"), py::arg("num_heads"), py::arg("layout"),
        py::arg("causal"), py::arg("window"), py::arg("scale"), py::arg("check_finite"),
        py::arg("warned"), py::arg("content_params"), py::arg("inputs"), py::arg("content_store"));
  m.def("step_transform",
        torch::wrap_pybind_function_no_gil([](const torch::jit::Object& plan,
                                              const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& positions, const Tensors& schema,
                                              int64_t layout, bool check_finite, int64_t warned) {
          return relpos::nn::transform_method(plan_of(plan), q, k, positions, schema, layout,
                                              check_finite, warned);
        }),
        py::arg("plan"), py::arg("q"), py::arg("k"), py::arg("positions"), py::arg("schema"),
        py::arg("layout"), py::arg("check_finite"), py::arg("warned"));
}
#endif
