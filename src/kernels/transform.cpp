#include "kernels/transform.hpp"

#include <string>

#include "kernels/isa.hpp"

namespace relpos::kernels {

TransformPlan TransformPlan::from(const Mechanism& m, Layout layout) {
  TransformPlan p;
  p.head_dim = m.head_dim;
  p.layout = layout;
  p.total_blocks = m.total_blocks();
  p.gate_rows = m.gate_rows();
  p.omega.assign(p.total_blocks, 0.0);
  for (const auto& s : m.segments()) {
    p.segments.push_back({s.first_pair, s.first_block, s.blocks, s.order, s.chart, s.L,
                          s.shear_scale, s.max_exponent, s.shear, s.damped});
    for (int b = 0; b < s.blocks; ++b) p.omega[s.first_block + b] = s.omega[b];
  }
  return p;
}

// Declarations of the per-ISA builds (transform_isa.inc).
#define RELPOS_DECLARE_ISA(NS)                                                                     \
  namespace NS {                                                                                   \
  template <class T>                                                                               \
  void fill_trig(const TransformPlan&, Dims, const Positions&, T*, T*);                            \
  template <class T>                                                                               \
  int forward(const TransformPlan&, Dims, const Positions&, const Params<T>&, TrigView<T>,         \
              const T*, const T*, T*, T*, bool);                                                   \
  template <class T>                                                                               \
  void backward(const TransformPlan&, Dims, const Positions&, const Params<T>&, TrigView<T>,       \
                const T*, const T*, const T*, const T*, T*, T*, const ParamGrads<T>&);             \
  template <class T>                                                                               \
  void apply(const TransformPlan&, Dims, const Positions&, const Params<T>&, TrigView<T>, MapRole, \
             const T*, T*);                                                                        \
  }
RELPOS_ISA_FOR_EACH(RELPOS_DECLARE_ISA)
#undef RELPOS_DECLARE_ISA

namespace {

void check_plan(const TransformPlan& plan) {
  for (const auto& s : plan.segments)
    if (s.order < 1 || s.order > 8)
      throw InputError("kernel supports Jordan orders 1..8, got " + std::to_string(s.order));
  if (plan.head_dim % 2) throw InputError("head dim must be even");
}

}  // namespace

int64_t trig_table_size(const TransformPlan& plan, Dims dims, const Positions& pos) {
  return (pos.per_batch ? dims.B : 1) * dims.T * plan.total_blocks;
}

template <class T>
void fill_trig_table(const TransformPlan& plan, Dims dims, const Positions& pos, T* cos, T* sin) {
  RELPOS_ISA_DISPATCH(fill_trig<T>, plan, dims, pos, cos, sin);
}

template <class T>
TrigTable<T> build_trig_table(const TransformPlan& plan, Dims dims, const Positions& pos) {
  TrigTable<T> tab;
  const auto n = static_cast<size_t>(trig_table_size(plan, dims, pos));
  tab.cos.resize(n);
  tab.sin.resize(n);
  fill_trig_table<T>(plan, dims, pos, tab.cos.data(), tab.sin.data());
  return tab;
}

template <class T>
int transform_forward(const TransformPlan& plan, Dims dims, const Positions& pos,
                      const Params<T>& params, TrigView<T> trig, const T* q, const T* k, T* q_out,
                      T* k_out, bool check_outputs) {
  check_plan(plan);
  RELPOS_ISA_DISPATCH(forward<T>, plan, dims, pos, params, trig, q, k, q_out, k_out, check_outputs);
}

template <class T>
void transform_backward(const TransformPlan& plan, Dims dims, const Positions& pos,
                        const Params<T>& params, TrigView<T> trig, const T* q, const T* k,
                        const T* gq_out, const T* gk_out, T* gq, T* gk,
                        const ParamGrads<T>& grads) {
  check_plan(plan);
  RELPOS_ISA_DISPATCH(backward<T>, plan, dims, pos, params, trig, q, k, gq_out, gk_out, gq, gk,
                      grads);
}

template <class T>
void transform_apply(const TransformPlan& plan, Dims dims, const Positions& pos,
                     const Params<T>& params, TrigView<T> trig, MapRole role, const T* x, T* y) {
  check_plan(plan);
  if (!x || !y) throw InputError("transform_apply needs an input and an output tensor");
  RELPOS_ISA_DISPATCH(apply<T>, plan, dims, pos, params, trig, role, x, y);
}

#define RELPOS_INSTANTIATE(T)                                                                      \
  template TrigTable<T> build_trig_table<T>(const TransformPlan&, Dims, const Positions&);         \
  template void fill_trig_table<T>(const TransformPlan&, Dims, const Positions&, T*, T*);          \
  template int transform_forward<T>(const TransformPlan&, Dims, const Positions&,                  \
                                    const Params<T>&, TrigView<T>, const T*, const T*, T*, T*,     \
                                    bool);                                                         \
  template void transform_backward<T>(const TransformPlan&, Dims, const Positions&,                \
                                      const Params<T>&, TrigView<T>, const T*, const T*, const T*, \
                                      const T*, T*, T*, const ParamGrads<T>&);                     \
  template void transform_apply<T>(const TransformPlan&, Dims, const Positions&, const Params<T>&, \
                                   TrigView<T>, MapRole, const T*, T*);
RELPOS_INSTANTIATE(float)
RELPOS_INSTANTIATE(double)
#undef RELPOS_INSTANTIATE

}  // namespace relpos::kernels
