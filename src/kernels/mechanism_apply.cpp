#include "kernels/mechanism_apply.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace relpos::kernels {

template <class T>
void fixed_linear_apply(int D, int64_t rows, const double* M, bool transpose, const T* x, T* y) {
  // (a decode step's few rows stay on this thread: waking the workers costs more than them)
#pragma omp parallel if (rows * D >= (int64_t{1} << 14))
  {
    std::vector<double> in(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * D;
      T* yr = y + r * D;
      for (int j = 0; j < D; ++j) in[j] = static_cast<double>(xr[j]);
      for (int i = 0; i < D; ++i) {
        double acc = 0;
        if (transpose)
          for (int j = 0; j < D; ++j) acc += M[static_cast<size_t>(j) * D + i] * in[j];
        else
          for (int j = 0; j < D; ++j) acc += M[static_cast<size_t>(i) * D + j] * in[j];
        yr[i] = static_cast<T>(acc);
      }
    }
  }
}

MechanismPlan MechanismPlan::from(const Mechanism& m, Layout layout) {
  MechanismPlan p;
  p.position = TransformPlan::from(m, layout);
  for (const auto& t : m.transforms) {
    if (t.vector_positions())
      throw InputError(fmt::format(
          "'{}' rotates by vector positions [T, {}]: kernels::structured_forward (the torch "
          "runtime, relpos.Attention) runs it, not this scalar-position path",
          t.name, t.vector_dims));
    p.steps.push_back({&t, t.position_driven() ? p.position : TransformPlan{}});
  }
  return p;
}

template <class T>
void mechanism_forward(const MechanismPlan& plan, Dims dims, const Positions& pos,
                       const Params<T>& params, TrigView<T> trig, const T* q, const T* k, T* q_out,
                       T* k_out) {
  const int D = plan.position.head_dim;
  const int64_t rows = dims.B * dims.H * dims.T, n = rows * D;
  // no transform: the identity
  if (q && q_out != q) std::copy(q, q + n, q_out);
  if (k && k_out != k) std::copy(k, k + n, k_out);
  for (const auto& s : plan.steps) {
    if (s.term->position_driven()) {
      transform_forward<T>(s.jordan, dims, pos, params, trig, q ? q_out : nullptr,
                           k ? k_out : nullptr, q ? q_out : nullptr, k ? k_out : nullptr);
    } else {
      if (q) fixed_linear_apply<T>(D, rows, s.term->matrix_inv_t.data(), false, q_out, q_out);
      if (k) fixed_linear_apply<T>(D, rows, s.term->matrix.data(), false, k_out, k_out);
    }
  }
}

#define RELPOS_INSTANTIATE(T)                                                           \
  template void fixed_linear_apply<T>(int, int64_t, const double*, bool, const T*, T*); \
  template void mechanism_forward<T>(const MechanismPlan&, Dims, const Positions&,      \
                                     const Params<T>&, TrigView<T>, const T*, const T*, T*, T*);
RELPOS_INSTANTIATE(float)
RELPOS_INSTANTIATE(double)
#undef RELPOS_INSTANTIATE

}  // namespace relpos::kernels
