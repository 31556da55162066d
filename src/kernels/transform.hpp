// Fast CPU kernels for the position-wise transforms of every Jordan-block mechanism (RoPE and
// damped RoPE are order 1): keys get the primal map A(p) = G(-p), queries the contragredient
// A(p)^{-T} (Jordan-RoPE Prop. 1). Forward and backward (inputs and every parameter) on contiguous
// [B, H, T, D] buffers, float and double, interleaved and half-split layouts, arbitrary real
// position ids, OpenMP threads. No LibTorch: an inference engine can take this file alone.
#pragma once

#include <cstdint>
#include <vector>

#include "core/mechanism.hpp"

namespace relpos::kernels {

// Instruction set the kernels dispatch to on this CPU ("avx2+fma" or "baseline").
const char* kernel_isa();

struct SegmentDesc {
  int first_pair, first_block, blocks, order;
  Chart chart;
  double L, shear_scale, max_exponent;
  ShearMode shear;
  bool damped;
};

// Everything a kernel needs to know about a mechanism's transform, fixed at construction.
struct TransformPlan {
  int head_dim = 0;
  Layout layout = Layout::Interleaved;
  std::vector<SegmentDesc> segments;
  std::vector<double> omega;  // per global block
  int total_blocks = 0;
  int gate_rows = 0;
  static TransformPlan from(const Mechanism& m, Layout layout);
};

struct Dims {
  int64_t B = 1, H = 1, T = 1;
};

// Position ids, float64: [T] shared by the batch, or [B, T]. `center` is c0 (already resolved).
struct Positions {
  const double* data = nullptr;
  bool per_batch = false;
  double center = 0.0;
  double at(int64_t b, int64_t t, int64_t T) const {
    return data[per_batch ? b * T + t : t] - center;
  }
};

// Per-head, per-block parameters (the set and layout of core's BlockParamSet / ParamValues);
// unused ones may be null.
template <class T>
using Params = BlockParamSet<const T*>;
// Gradient outputs, accumulated (+=) in place; null entries are not computed.
template <class T>
using ParamGrads = BlockParamSet<T*>;
template <class T>
bool any(const ParamGrads<T>& g) {
  return g.gamma || g.eta || g.gates || g.alpha0;
}

// cos/sin of the angle -omega_b (p - c0) for every (row of positions, block): computed once per
// call in float64 with a compensated product (so long positions keep their phase), stored as T.
// Layout [P rows][T][NB], P = B if positions are per batch else 1.
template <class T>
struct TrigView {
  const T* cos = nullptr;
  const T* sin = nullptr;
};
int64_t trig_table_size(const TransformPlan& plan, Dims dims, const Positions& pos);
template <class T>
void fill_trig_table(const TransformPlan& plan, Dims dims, const Positions& pos, T* cos, T* sin);
// Owning convenience for callers without their own buffers.
template <class T>
struct TrigTable {
  std::vector<T> cos, sin;
  TrigView<T> view() const { return {cos.data(), sin.data()}; }
};
template <class T>
TrigTable<T> build_trig_table(const TransformPlan& plan, Dims dims, const Positions& pos);

// y = A x on keys and y = A^{-T} x on queries; either of q / k may be null. In-place allowed.
// With `check_outputs`: returns which outputs hold a NaN or Inf (bit 0 q_out, bit 1 k_out),
// each tile checked right after it is written, while it is in cache (no extra pass over memory);
// a non-finite input always gives a non-finite output, so this is the callers' finiteness check.
// Without: returns 0.
template <class T>
int transform_forward(const TransformPlan& plan, Dims dims, const Positions& pos,
                      const Params<T>& params, TrigView<T> trig, const T* q, const T* k, T* q_out,
                      T* k_out, bool check_outputs = false);

// Gradients: gq = A^{-1} gq_out (queries), gk = A^T gk_out (keys); parameter gradients need the
// forward inputs q, k. Any of q/k (with their gradients) may be null.
template <class T>
void transform_backward(const TransformPlan& plan, Dims dims, const Positions& pos,
                        const Params<T>& params, TrigView<T> trig, const T* q, const T* k,
                        const T* gq_out, const T* gk_out, T* gq, T* gk, const ParamGrads<T>& grads);

// The four roles one block map A = A(p - c0) plays (all from one kernel template):
//   Primal          A       keys (forward); journey values A(j)
//   Contragredient  A^{-T}  queries (forward)
//   PrimalTranspose A^T     key input gradients (backward); journey output gradients
//   Inverse         A^{-1}  query input gradients (backward); journey outputs A(i)^{-1}
// transform_forward is Primal on k and Contragredient on q; transform_backward is
// PrimalTranspose on gk_out and Inverse on gq_out, fused with the parameter gradients.
enum class MapRole { Primal, Contragredient, PrimalTranspose, Inverse };

// y = role(A) x for one tensor [B, H, T, D] (x and y non-null; in place allowed).
template <class T>
void transform_apply(const TransformPlan& plan, Dims dims, const Positions& pos,
                     const Params<T>& params, TrigView<T> trig, MapRole role, const T* x, T* y);

}  // namespace relpos::kernels
