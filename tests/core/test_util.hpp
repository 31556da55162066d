// Shared helpers of the core tests (test-only): random fills, norms, head dims that fit a spec,
// and a kernel runner that owns its buffers.
#pragma once

#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/mechanism.hpp"
#include "core/registry.hpp"
#include "kernels/mechanism_apply.hpp"
#include "kernels/transform.hpp"

namespace relpos::test {

inline std::vector<double> normal_vec(size_t n, std::mt19937_64& rng, double sd = 1.0) {
  std::normal_distribution<double> N(0.0, sd);
  std::vector<double> v(n);
  for (auto& x : v) x = N(rng);
  return v;
}

inline double uniform(std::mt19937_64& rng, double lo, double hi) {
  return std::uniform_real_distribution<double>(lo, hi)(rng);
}

template <class T>
double norm(const T* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return std::sqrt(s);
}

// ||A - B||_F / ||B||_F (B == 0: absolute).
inline double rel_err(const Eigen::MatrixXd& A, const Eigen::MatrixXd& B) {
  const double n = B.norm();
  return (A - B).norm() / (n > 0 ? n : 1.0);
}

inline const char* layout_name(Layout l) { return l == Layout::Interleaved ? "interleaved" : "half_split"; }

// Head dims (small first) for which `spec` builds; at most `count` of them.
inline std::vector<int> fitting_head_dims(const std::string& spec, int heads, size_t count,
                                          int max_dim = 48) {
  std::vector<int> out;
  for (int D = 4; D <= max_dim && out.size() < count; D += 2) {
    try {
      build_mechanism(spec, D, heads);
      out.push_back(D);
    } catch (const InputError&) {
    }
  }
  return out;
}

// Parameter arrays of one dtype, owning (the kernels' own helper).
template <class T>
using TypedParams = kernels::ParamBuffers<T>;

// One kernel problem: mechanism, parameters, shape, positions ([T] or [B, T]) and centre.
struct Problem {
  Mechanism mech;
  ParamValues params;
  Layout layout = Layout::Interleaved;
  kernels::Dims dims;
  std::vector<double> pos;
  bool per_batch = false;
  double center = 0.0;

  int D() const { return mech.head_dim; }
  int64_t rows() const { return dims.B * dims.H * dims.T; }
  size_t size() const { return static_cast<size_t>(rows()) * D(); }
  kernels::Positions positions() const { return {pos.data(), per_batch, center}; }
  kernels::TransformPlan plan() const { return kernels::TransformPlan::from(mech, layout); }
  // Centred position of row `row` of a [B, H, T] buffer, and its head.
  double row_pos(int64_t row) const {
    const int64_t t = row % dims.T, b = row / (dims.T * dims.H);
    return positions().at(b, t, dims.T);
  }
  int row_head(int64_t row) const { return static_cast<int>((row / dims.T) % dims.H); }
};

template <class T>
struct Outputs {
  std::vector<T> q, k;
};

template <class T>
Outputs<T> run_forward(const Problem& pr, const ParamValues& pv, const std::vector<T>& q,
                       const std::vector<T>& k) {
  const auto plan = pr.plan();
  const auto P = pr.positions();
  const TypedParams<T> tp(pv);
  const auto trig = kernels::build_trig_table<T>(plan, pr.dims, P);
  Outputs<T> o;
  o.q.assign(q.size(), T(0));
  o.k.assign(k.size(), T(0));
  kernels::transform_forward<T>(plan, pr.dims, P, tp.view(), trig.view(), q.data(), k.data(),
                                o.q.data(), o.k.data());
  return o;
}

template <class T>
std::vector<T> cast_vec(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

}  // namespace relpos::test
