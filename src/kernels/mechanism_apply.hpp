// One call path from (mechanism, parameters, positions) to the kernels: every transform term of a
// mechanism in order - the Jordan-block term through the transform kernels, fixed linear terms
// through a dense per-token map. Used by verify and the tests; the torch layer runs the same
// plan term by term under autograd.
#pragma once

#include <cstdint>
#include <vector>

#include "core/mechanism.hpp"
#include "kernels/transform.hpp"

namespace relpos::kernels {

// y_row = M x_row (or M^T x_row) for every row of D values; in place allowed. M is row-major
// D x D float64 (fixed maps are exact data: they are applied in the input's precision).
template <class T>
void fixed_linear_apply(int D, int64_t rows, const double* M, bool transpose, const T* x, T* y);

// A mechanism's transform terms as the kernels run them.
struct MechanismPlan {
  struct Step {
    const TransformTerm* term = nullptr;
    TransformPlan jordan;  // for the position-driven term
  };
  std::vector<Step> steps;
  TransformPlan position;  // the position-driven term's plan (empty when none): trig tables
  static MechanismPlan from(const Mechanism& m, Layout layout);
};

// Parameter values of a mechanism in the kernels' precision, with their kernel view.
template <class T>
struct ParamBuffers : BlockParamSet<std::vector<T>> {
  explicit ParamBuffers(const ParamValues& p) {
    this->gamma.assign(p.gamma.begin(), p.gamma.end());
    this->eta.assign(p.eta.begin(), p.eta.end());
    this->gates.assign(p.gates.begin(), p.gates.end());
    this->alpha0.assign(p.alpha0.begin(), p.alpha0.end());
  }
  Params<T> view() const {
    return {this->gamma.data(), this->eta.data(), this->gates.data(), this->alpha0.data()};
  }
};

// Every term in order: keys get A_n ... A_1 k, queries A_n^{-T} ... A_1^{-T} q. Either of q / k may
// be null. `trig` is the position term's table (build_trig_table(plan.position, ...)).
template <class T>
void mechanism_forward(const MechanismPlan& plan, Dims dims, const Positions& pos,
                       const Params<T>& params, TrigView<T> trig, const T* q, const T* k, T* q_out,
                       T* k_out);

}  // namespace relpos::kernels
