// The fast transform kernels (kernels/transform.hpp) against the float64 references, row by row,
// on random shapes, layouts, positions and centres; backward against central finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/reference.hpp"
#include "core/registry.hpp"
#include "kernels/transform.hpp"
#include "test_util.hpp"

using namespace relpos;
using test::Problem;

namespace {

std::vector<std::string> kernel_specs() {
  auto s = verify_default_specs();
  s.push_back("jordan(m=6, regime=raw)");
  s.push_back("jordan(m=7, regime=scaled, L=64, eta0=0.5, eta_max=1)");
  s.push_back("jordan(m=8, regime=stabilized, L=64)");
  s.push_back("jetmix(m=6, L=64, gates=0.5/0.4/0.3/0.2/0.1)");
  s.push_back("jordan(m=2, regime=raw, zero_gamma=true)");
  return s;
}

// Positions [rows][T]: an offset, then positive gaps (integer and fractional).
std::vector<double> make_positions(std::mt19937_64& rng, int64_t rows, int64_t T) {
  const double gaps[] = {1.0, 1.0, 2.0, 0.5, 1.75, 3.0};
  std::vector<double> p;
  for (int64_t r = 0; r < rows; ++r) {
    double x = std::round(test::uniform(rng, -10.0, 25.0));
    for (int64_t t = 0; t < T; ++t) {
      p.push_back(x);
      x += gaps[std::uniform_int_distribution<int>(0, 5)(rng)];
    }
  }
  return p;
}

Problem make_problem(const std::string& spec, int D, int64_t B, int64_t H, int64_t T, Layout layout,
                     bool per_batch, std::mt19937_64& rng) {
  Problem pr{
      build_mechanism(spec, D, static_cast<int>(H)), {}, layout, {B, H, T}, {}, per_batch, 0.0};
  pr.params = random_params(pr.mech, rng);
  pr.pos = make_positions(rng, per_batch ? B : 1, T);
  pr.center = std::round(test::uniform(rng, 0.0, 20.0)) + 0.5;
  return pr;
}

// Parameters as the float kernel sees them.
ParamValues rounded_to_float(ParamValues p) {
  for (auto* v : {&p.gamma, &p.eta, &p.gates, &p.alpha0})
    for (auto& x : *v) x = static_cast<double>(static_cast<float>(x));
  return p;
}

struct RowErrors {
  double q = 0, k = 0;
};

// max over rows of ||kernel - reference|| / ||reference|| for queries and keys.
template <class T>
RowErrors compare_with_reference(const Problem& pr, const std::vector<T>& q,
                                 const std::vector<T>& k, const test::Outputs<T>& out) {
  const ParamValues pv = sizeof(T) == 4 ? rounded_to_float(pr.params) : pr.params;
  const int D = pr.D();
  RowErrors e;
  for (int64_t row = 0; row < pr.rows(); ++row) {
    const double p = pr.row_pos(row);
    const int h = pr.row_head(row);
    Eigen::VectorXd qx(D), kx(D), qy(D), ky(D);
    for (int i = 0; i < D; ++i) {
      qx[i] = q[row * D + i], kx[i] = k[row * D + i];
      qy[i] = out.q[row * D + i], ky[i] = out.k[row * D + i];
    }
    const Eigen::VectorXd kr = reference::key_map(pr.mech, pv, h, p, pr.layout) * kx;
    const Eigen::VectorXd qr = reference::query_map(pr.mech, pv, h, p, pr.layout) * qx;
    e.k = std::max(e.k, (ky - kr).norm() / kr.norm());
    e.q = std::max(e.q, (qy - qr).norm() / qr.norm());
  }
  return e;
}

template <class T>
void check_forward(const std::string& spec, double tol, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t Bs[] = {1, 2, 3}, Hs[] = {1, 3}, Ts[] = {1, 7, 33};
  const auto dims = test::fitting_head_dims(spec, 3, 3);
  ASSERT_FALSE(dims.empty()) << spec;
  int n = 0;
  for (const Layout layout : {Layout::Interleaved, Layout::HalfSplit})
    for (const bool per_batch : {false, true}) {
      const int D = dims[n % dims.size()];
      const int64_t B = Bs[n % 3], H = Hs[(n / 2) % 2], Tn = Ts[(n + seed) % 3];
      ++n;
      SCOPED_TRACE(spec + " " + test::layout_name(layout) + " D=" + std::to_string(D) +
                   " B=" + std::to_string(B) + " H=" + std::to_string(H) +
                   " T=" + std::to_string(Tn) + (per_batch ? " per-batch" : " shared"));
      const Problem pr = make_problem(spec, D, B, H, Tn, layout, per_batch, rng);
      const auto q = test::cast_vec<T>(test::normal_vec(pr.size(), rng));
      const auto k = test::cast_vec<T>(test::normal_vec(pr.size(), rng));
      const auto out = test::run_forward<T>(pr, pr.params, q, k);
      const auto err = compare_with_reference<T>(pr, q, k, out);
      EXPECT_LT(err.q, tol);
      EXPECT_LT(err.k, tol);

      // in place (q_out == q, k_out == k) gives the same bits; so do q-only and k-only calls
      const auto plan = pr.plan();
      const auto P = pr.positions();
      const test::TypedParams<T> tp(pr.params);
      const auto trig = kernels::build_trig_table<T>(plan, pr.dims, P);
      std::vector<T> qi = q, ki = k;
      kernels::transform_forward<T>(plan, pr.dims, P, tp.view(), trig.view(), qi.data(), ki.data(),
                                    qi.data(), ki.data());
      EXPECT_EQ(qi, out.q);
      EXPECT_EQ(ki, out.k);
      std::vector<T> qo(q.size()), ko(k.size());
      kernels::transform_forward<T>(plan, pr.dims, P, tp.view(), trig.view(), q.data(), nullptr,
                                    qo.data(), nullptr);
      kernels::transform_forward<T>(plan, pr.dims, P, tp.view(), trig.view(), nullptr, k.data(),
                                    nullptr, ko.data());
      EXPECT_EQ(qo, out.q);
      EXPECT_EQ(ko, out.k);
    }
}

}  // namespace

TEST(KernelForward, Float64MatchesReferenceMaps) {
  uint64_t seed = 100;
  for (const auto& spec : kernel_specs()) check_forward<double>(spec, 1e-12, ++seed);
}

TEST(KernelForward, Float32MatchesReferenceMaps) {
  uint64_t seed = 200;
  for (const auto& spec : kernel_specs()) check_forward<float>(spec, 1e-5, ++seed);
}

namespace {

// max |table - long double sin/cos of -omega (p - c0)| over a table.
double trig_table_error(const kernels::TransformPlan& plan, kernels::Dims dims,
                        const kernels::Positions& P) {
  const auto tab = kernels::build_trig_table<double>(plan, dims, P);
  const int64_t NB = plan.total_blocks, rows = P.per_batch ? dims.B : 1;
  EXPECT_EQ(kernels::trig_table_size(plan, dims, P), rows * dims.T * NB);
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < dims.T; ++t)
      for (int64_t b = 0; b < NB; ++b) {
        // omega * (p - c0) in a 64-bit mantissa: off by < 2e-15 rad for |p - c0| < 4e4
        const long double a =
            static_cast<long double>(plan.omega[b]) * static_cast<long double>(P.at(r, t, dims.T));
        const int64_t i = (r * dims.T + t) * NB + b;
        worst = std::max(worst, std::abs(tab.cos[i] - static_cast<double>(std::cos(a))));
        worst = std::max(worst, std::abs(tab.sin[i] + static_cast<double>(std::sin(a))));
      }
  return worst;
}

}  // namespace

TEST(KernelForward, TrigTableRotatesByMinusOmegaP) {
  const Mechanism m = build_mechanism("rope", 16, 1);
  const auto plan = kernels::TransformPlan::from(m, Layout::Interleaved);
  {  // short irregular window
    const std::vector<double> pos = {0.0, 3.0, 1e3 + 0.5};
    EXPECT_LT(trig_table_error(plan, {1, 1, 3}, {pos.data(), false, 2.0}), 1e-15);
  }
  // long windows far from the centre, where a plain omega*p product is off by ~1e-12:
  // arithmetic progressions (shared and per batch, integer and fractional steps) and irregular ones
  std::mt19937_64 rng(21);
  for (const int64_t T : {64, 65, 100, 257})
    for (const double step : {1.0, 0.5, 0.75})
      for (const bool per_batch : {false, true}) {
        const int64_t B = per_batch ? 3 : 1;
        std::vector<double> pos;
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < T; ++t)
            pos.push_back(30000.0 + 7.0 * b + step * static_cast<double>(t));
        SCOPED_TRACE("T=" + std::to_string(T) + " step=" + std::to_string(step) +
                     (per_batch ? " per-batch" : ""));
        EXPECT_LT(trig_table_error(plan, {B, 2, T}, {pos.data(), per_batch, -200.0}), 5e-14);
        // same positions with one row perturbed (not arithmetic any more)
        pos[pos.size() / 2] += 0.25;
        EXPECT_LT(trig_table_error(plan, {B, 2, T}, {pos.data(), per_batch, -200.0}), 5e-14);
      }
  // per-batch rows with different steps
  std::vector<double> pos;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 80; ++t) pos.push_back(100.0 + (b + 1) * 0.5 * static_cast<double>(t));
  EXPECT_LT(trig_table_error(plan, {2, 1, 80}, {pos.data(), true, 0.0}), 5e-14);
}

// Issue 23 item 10: at huge positions the table stays a rotation and keeps the relative law: the
// entry at p0 + d is the entry at p0 turned by the entry at d, for every block (the first-order
// correction of the product's rounding error grew |(cos, sin)| x1000 at p = 1e20 and by ~1e-3 at
// 1e15). Irregular positions (direct sincos) and long arithmetic windows (anchors + recurrences).
TEST(KernelForward, TrigTableStaysARotationAtHugePositions) {
  const Mechanism m = build_mechanism("rope", 64, 1);
  const auto plan = kernels::TransformPlan::from(m, Layout::Interleaved);
  const int64_t NB = plan.total_blocks;
  for (const double p0 : {1e15, 0x1p53 - 300, 1e20, 1e300}) {
    SCOPED_TRACE("p0=" + std::to_string(p0));
    for (const int64_t T : {3, 300}) {
      std::vector<double> pos(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) pos[t] = p0 + static_cast<double>(t);
      if (T == 3) pos[2] = p0 + 7;  // not arithmetic
      const auto tab = kernels::build_trig_table<double>(plan, {1, 1, T}, {pos.data(), false, 0.0});
      std::vector<double> lags(static_cast<size_t>(T));
      for (int64_t t = 0; t < T; ++t) lags[t] = pos[t] - pos[0];
      const auto rel =
          kernels::build_trig_table<double>(plan, {1, 1, T}, {lags.data(), false, 0.0});
      double norm_err = 0, law_err = 0;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 0; b < NB; ++b) {
          const size_t i = static_cast<size_t>(t * NB + b), i0 = static_cast<size_t>(b);
          norm_err = std::max(norm_err, std::abs(std::hypot(tab.cos[i], tab.sin[i]) - 1));
          if (p0 > 0x1p53) continue;  // beyond 2^53, p0 + t is not exact: no law to keep
          const double c = tab.cos[i0] * rel.cos[i] - tab.sin[i0] * rel.sin[i];
          const double s = tab.sin[i0] * rel.cos[i] + tab.cos[i0] * rel.sin[i];
          law_err = std::max({law_err, std::abs(c - tab.cos[i]), std::abs(s - tab.sin[i])});
        }
      EXPECT_LT(norm_err, 1e-14);  // the recurrences between anchors add a few ulp
      EXPECT_LT(law_err, 1e-13);
    }
  }
}

// Long arithmetic windows (the kernel may fill the trig table by recurrences there).
TEST(KernelForward, ArithmeticPositionWindowsMatchReferenceMaps) {
  std::mt19937_64 rng(22);
  for (const std::string spec :
       {"rope", "jordan(m=3, regime=raw)", "damped_rope", "jetmix(m=3, gates=0.1/0.05)",
        "jordan(m=2, regime=scaled, L=64, c=1.5)"})
    for (const bool per_batch : {false, true}) {
      SCOPED_TRACE(spec + (per_batch ? " per-batch" : " shared"));
      const int64_t B = 2, T = per_batch ? 97 : 301;
      Problem pr =
          make_problem(spec, test::fitting_head_dims(spec, 1, 1).at(0) * 2, B, 1, T,
                       per_batch ? Layout::HalfSplit : Layout::Interleaved, per_batch, rng);
      pr.pos.clear();
      for (int64_t b = 0; b < (per_batch ? B : 1); ++b)
        for (int64_t t = 0; t < T; ++t)
          pr.pos.push_back(-30.0 + 3.0 * b + 0.75 * static_cast<double>(t));
      pr.center = 12.0;
      const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
      const auto err =
          compare_with_reference<double>(pr, q, k, test::run_forward<double>(pr, pr.params, q, k));
      EXPECT_LT(err.q, 1e-12);
      EXPECT_LT(err.k, 1e-12);
      const auto qf = test::cast_vec<float>(q), kf = test::cast_vec<float>(k);
      const auto errf = compare_with_reference<float>(
          pr, qf, kf, test::run_forward<float>(pr, pr.params, qf, kf));
      EXPECT_LT(errf.q, 1e-5);
      EXPECT_LT(errf.k, 1e-5);
    }
}

TEST(KernelForward, MechanismsWithoutTransformCopy) {
  std::mt19937_64 rng(3);
  for (const std::string spec : {"nope", "alibi"}) {
    Problem pr{build_mechanism(spec, 8, 2), {}, Layout::HalfSplit, {2, 2, 3}, {0, 1, 2}, false, 0};
    pr.params = default_params(pr.mech);
    const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
    const auto out = test::run_forward<double>(pr, pr.params, q, k);
    EXPECT_EQ(out.q, q) << spec;
    EXPECT_EQ(out.k, k) << spec;
  }
}

// With check_outputs the kernel reports which outputs hold a NaN or Inf, for a bad value in any
// row and coordinate (uncovered ones included) of q or k, every kernel mechanism, both layouts,
// both precisions; clean inputs report nothing, and the outputs are those of the unchecked call.
template <class T>
void check_finiteness_report(uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const auto& spec : kernel_specs())
    for (const Layout layout : {Layout::Interleaved, Layout::HalfSplit}) {
      const auto dims = test::fitting_head_dims(spec, 3, 3);
      if (dims.empty()) continue;
      SCOPED_TRACE(spec + " " + test::layout_name(layout));
      const Problem pr = make_problem(spec, dims.back(), 2, 3, 70, layout, false, rng);
      const auto plan = pr.plan();
      const auto P = pr.positions();
      const test::TypedParams<T> tp(pr.params);
      const auto trig = kernels::build_trig_table<T>(plan, pr.dims, P);
      const auto q = test::cast_vec<T>(test::normal_vec(pr.size(), rng));
      const auto k = test::cast_vec<T>(test::normal_vec(pr.size(), rng));
      std::vector<T> qo(q.size()), ko(k.size());
      EXPECT_EQ(kernels::transform_forward<T>(plan, pr.dims, P, tp.view(), trig.view(), q.data(),
                                              k.data(), qo.data(), ko.data(), true),
                0);
      EXPECT_EQ(qo, test::run_forward<T>(pr, pr.params, q, k).q);
      const T bad[] = {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity(),
                       -std::numeric_limits<T>::infinity()};
      for (int trial = 0; trial < 6; ++trial) {
        auto qb = q, kb = k;
        const bool on_q = trial % 2 == 0;
        auto& x = on_q ? qb : kb;
        const auto at = std::uniform_int_distribution<size_t>(0, x.size() - 1)(rng);
        x[at] = bad[trial % 3];
        const int got =
            kernels::transform_forward<T>(plan, pr.dims, P, tp.view(), trig.view(), qb.data(),
                                          kb.data(), qo.data(), ko.data(), true);
        EXPECT_EQ(got, on_q ? 1 : 2) << "element " << at;
        // k alone: its bit is still bit 1 of the call
        if (!on_q) {
          EXPECT_EQ(kernels::transform_forward<T>(plan, pr.dims, P, tp.view(), trig.view(), nullptr,
                                                  kb.data(), nullptr, ko.data(), true),
                    2);
        }
      }
    }
}

TEST(KernelForward, ReportsNonFiniteOutputsFloat64) {
  check_finiteness_report<double>(31);
}
TEST(KernelForward, ReportsNonFiniteOutputsFloat32) {
  check_finiteness_report<float>(32);
}

// The plain rotation checks its outputs in the registers (and its scalar tail pairs one by one)
// where it covers whole rows, and in memory where coordinates are left uncovered: a NaN or an
// infinity at every coordinate of a row, on q and on k, is reported, for head dims whose pairs
// fill whole registers, leave a tail past them, or fit in no register at all.
TEST(KernelForward, RotationFinitenessCheckSeesEveryCoordinate) {
  std::mt19937_64 rng(43);
  for (const std::string spec : {"rope", "partial_rope(fraction=0.5)"})
    for (const Layout layout : {Layout::Interleaved, Layout::HalfSplit})
      for (const int D : {8, 40, 64, 72}) {
        SCOPED_TRACE(spec + " " + test::layout_name(layout) + " D " + std::to_string(D));
        const Problem pr = make_problem(spec, D, 1, 2, 9, layout, false, rng);
        const auto plan = pr.plan();
        const auto P = pr.positions();
        const test::TypedParams<float> tp(pr.params);
        const auto trig = kernels::build_trig_table<float>(plan, pr.dims, P);
        const auto q = test::cast_vec<float>(test::normal_vec(pr.size(), rng));
        const auto k = test::cast_vec<float>(test::normal_vec(pr.size(), rng));
        std::vector<float> qo(q.size()), ko(k.size());
        ASSERT_EQ(kernels::transform_forward<float>(plan, pr.dims, P, tp.view(), trig.view(),
                                                    q.data(), k.data(), qo.data(), ko.data(), true),
                  0);
        const size_t row = (1 * 9 + 7) * static_cast<size_t>(D);  // head 1, token 7
        for (int c = 0; c < D; ++c)
          for (const bool on_q : {true, false}) {
            auto qb = q, kb = k;
            (on_q ? qb : kb)[row + c] = c % 2 ? std::numeric_limits<float>::infinity()
                                              : std::numeric_limits<float>::quiet_NaN();
            EXPECT_EQ(
                kernels::transform_forward<float>(plan, pr.dims, P, tp.view(), trig.view(),
                                                  qb.data(), kb.data(), qo.data(), ko.data(), true),
                on_q ? 1 : 2)
                << "coordinate " << c;
          }
      }
}

// Rotations whose inputs and outputs fill rot::kStreamFootprint (32 MB) write 64-byte aligned
// outputs with streaming stores and check them in registers: the same values as the cached
// stores of a misaligned copy, forward and backward, and the same finiteness report for a bad
// value anywhere in q or k.
TEST(KernelForward, StreamedRotationMatchesCachedStoresAndReportsNonFinite) {
  std::mt19937_64 rng(41);
  for (const Layout layout : {Layout::Interleaved, Layout::HalfSplit}) {
    SCOPED_TRACE(test::layout_name(layout));
    const Problem pr = make_problem("rope", 64, 1, 4, 8192, layout, false, rng);
    const auto plan = pr.plan();
    const auto P = pr.positions();
    const test::TypedParams<float> tp(pr.params);
    const auto trig = kernels::build_trig_table<float>(plan, pr.dims, P);
    const size_t n = pr.size();  // 2 x 8 MB read, as much written: streamed
    const auto q = test::cast_vec<float>(test::normal_vec(n, rng));
    const auto k = test::cast_vec<float>(test::normal_vec(n, rng));
    // [0]: 64-byte aligned (streamed), [1]: 4 bytes past it (stored through the cache)
    std::vector<float> buf(4 * n + 64);
    float* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) / sizeof(float);
    float* qo[2] = {base, base + 2 * n + 1};
    float* ko[2] = {base + n, base + 3 * n + 1};
    for (int i = 0; i < 2; ++i)
      EXPECT_EQ(kernels::transform_forward<float>(plan, pr.dims, P, tp.view(), trig.view(),
                                                  q.data(), k.data(), qo[i], ko[i], true),
                0);
    EXPECT_TRUE(std::equal(qo[0], qo[0] + n, qo[1]));
    EXPECT_TRUE(std::equal(ko[0], ko[0] + n, ko[1]));
    const kernels::ParamGrads<float> none{};
    for (int i = 0; i < 2; ++i)  // the gradients into the same buffers
      kernels::transform_backward<float>(plan, pr.dims, P, tp.view(), trig.view(), nullptr, nullptr,
                                         q.data(), k.data(), qo[i], ko[i], none);
    EXPECT_TRUE(std::equal(qo[0], qo[0] + n, qo[1]));
    EXPECT_TRUE(std::equal(ko[0], ko[0] + n, ko[1]));
    const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity()};
    for (int trial = 0; trial < 6; ++trial) {
      auto qb = q, kb = k;
      const bool on_q = trial % 2 == 0;
      auto& x = on_q ? qb : kb;
      const auto at = std::uniform_int_distribution<size_t>(0, n - 1)(rng);
      x[at] = bad[trial % 3];
      for (int i = 0; i < 2; ++i)
        EXPECT_EQ(kernels::transform_forward<float>(plan, pr.dims, P, tp.view(), trig.view(),
                                                    qb.data(), kb.data(), qo[i], ko[i], true),
                  on_q ? 1 : 2)
            << "element " << at << (i ? " cached" : " streamed");
    }
  }
}

TEST(KernelForward, RejectsUnsupportedPlans) {
  const Mechanism m = build_mechanism("jordan(m=2, regime=raw)", 8, 1);
  const ParamValues pv = default_params(m);
  const test::TypedParams<double> tp(pv);
  const std::vector<double> pos = {0.0};
  const kernels::Positions P{pos.data(), false, 0.0};
  std::vector<double> x(8, 1.0), y(8, 0.0);
  auto plan = kernels::TransformPlan::from(m, Layout::Interleaved);
  const auto trig = kernels::build_trig_table<double>(plan, {1, 1, 1}, P);
  plan.segments[0].order = 9;  // beyond the kernel's orders 1..8
  EXPECT_THROW(kernels::transform_forward<double>(plan, {1, 1, 1}, P, tp.view(), trig.view(),
                                                  x.data(), x.data(), y.data(), y.data()),
               InputError);
  auto odd = kernels::TransformPlan::from(build_mechanism("nope", 8, 1), Layout::Interleaved);
  odd.head_dim = 7;
  EXPECT_THROW(kernels::transform_forward<double>(odd, {1, 1, 1}, P, tp.view(), trig.view(),
                                                  x.data(), nullptr, y.data(), nullptr),
               InputError);
}

// ---------------------------------------------------------------------------------------------
// Backward

namespace {

struct Loss {
  std::vector<double> wq, wk;
  double operator()(const Problem& pr, const ParamValues& pv, const std::vector<double>& q,
                    const std::vector<double>& k) const {
    const auto o = test::run_forward<double>(pr, pv, q, k);
    double s = 0;
    for (size_t i = 0; i < q.size(); ++i) s += wq[i] * o.q[i] + wk[i] * o.k[i];
    return s;
  }
};

struct Analytic {
  std::vector<double> gq, gk;
  ParamValues g;  // gradients in the ParamValues layout
};

Analytic analytic_grads(const Problem& pr, const std::vector<double>& q,
                        const std::vector<double>& k, const Loss& L, double prefill = 0.0) {
  Analytic a;
  a.gq.assign(q.size(), 0.0);
  a.gk.assign(k.size(), 0.0);
  a.g = pr.params;
  for (auto* v : {&a.g.gamma, &a.g.eta, &a.g.gates, &a.g.alpha0})
    std::fill(v->begin(), v->end(), prefill);
  const auto plan = pr.plan();
  const auto P = pr.positions();
  const test::TypedParams<double> tp(pr.params);
  const auto trig = kernels::build_trig_table<double>(plan, pr.dims, P);
  const kernels::ParamGrads<double> G{a.g.gamma.data(), a.g.eta.data(),
                                      a.g.gates.empty() ? nullptr : a.g.gates.data(),
                                      a.g.alpha0.data()};
  kernels::transform_backward<double>(plan, pr.dims, P, tp.view(), trig.view(), q.data(), k.data(),
                                      L.wq.data(), L.wk.data(), a.gq.data(), a.gk.data(), G);
  return a;
}

// Central difference of the loss in one parameter entry.
double fd_param(const Problem& pr, const Loss& L, const std::vector<double>& q,
                const std::vector<double>& k, std::vector<double> ParamValues::*arr, size_t i,
                double h) {
  ParamValues plus = pr.params, minus = pr.params;
  (plus.*arr)[i] += h;
  (minus.*arr)[i] -= h;
  return (L(pr, plus, q, k) - L(pr, minus, q, k)) / (2 * h);
}

void check_backward(const std::string& spec, uint64_t seed) {
  SCOPED_TRACE(spec);
  std::mt19937_64 rng(seed);
  const auto dims = test::fitting_head_dims(spec, 2, 1, 24);
  ASSERT_FALSE(dims.empty());
  for (const Layout layout : {Layout::Interleaved, Layout::HalfSplit}) {
    SCOPED_TRACE(test::layout_name(layout));
    const bool per_batch = layout == Layout::HalfSplit;
    const Problem pr = make_problem(spec, dims[0], 2, 2, 5, layout, per_batch, rng);
    const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
    const Loss L{test::normal_vec(pr.size(), rng), test::normal_vec(pr.size(), rng)};
    const Analytic a = analytic_grads(pr, q, k, L);

    // inputs: the loss is linear in q and k, so the difference quotient is exact up to rounding
    for (int n = 0; n < 12; ++n) {
      const size_t i = std::uniform_int_distribution<size_t>(0, q.size() - 1)(rng);
      for (const bool is_q : {true, false}) {
        auto xp = is_q ? q : k, xm = xp;
        xp[i] += 1e-3;
        xm[i] -= 1e-3;
        const double fd = is_q ? (L(pr, pr.params, xp, k) - L(pr, pr.params, xm, k)) / 2e-3
                               : (L(pr, pr.params, q, xp) - L(pr, pr.params, q, xm)) / 2e-3;
        const double an = is_q ? a.gq[i] : a.gk[i];
        EXPECT_NEAR(an, fd, 1e-8 * (1 + std::abs(fd))) << (is_q ? "gq[" : "gk[") << i << "]";
      }
    }
    // every entry of every parameter array (entries a segment does not use must get 0)
    struct Arr {
      const char* name;
      std::vector<double> ParamValues::*ptr;
    };
    for (const Arr arr : {Arr{"gamma", &ParamValues::gamma}, Arr{"eta", &ParamValues::eta},
                          Arr{"gates", &ParamValues::gates}, Arr{"alpha0", &ParamValues::alpha0}}) {
      const auto& an = a.g.*arr.ptr;
      ASSERT_EQ(an.size(), (pr.params.*arr.ptr).size());
      for (size_t i = 0; i < an.size(); ++i) {
        const double fd = fd_param(pr, L, q, k, arr.ptr, i, 1e-6);
        EXPECT_NEAR(an[i], fd, 1e-6 * (1 + std::abs(fd))) << arr.name << "[" << i << "]";
      }
    }
  }
}

}  // namespace

TEST(KernelBackward, GradientsMatchFiniteDifferences) {
  uint64_t seed = 300;
  for (const auto& spec : kernel_specs()) check_backward(spec, ++seed);
}

TEST(KernelBackward, ParameterGradientsAccumulate) {
  std::mt19937_64 rng(5);
  const Problem pr = make_problem("jetmixfull(m=4, alpha=1/0.5/0.3/0.2)", 16, 2, 2, 4,
                                  Layout::Interleaved, false, rng);
  const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
  const Loss L{test::normal_vec(pr.size(), rng), test::normal_vec(pr.size(), rng)};
  const Analytic a0 = analytic_grads(pr, q, k, L, 0.0), a1 = analytic_grads(pr, q, k, L, 1.0);
  for (size_t i = 0; i < a0.g.gamma.size(); ++i) {
    EXPECT_NEAR(a1.g.gamma[i], a0.g.gamma[i] + 1.0, 1e-12 * (1 + std::abs(a0.g.gamma[i])));
    EXPECT_NEAR(a1.g.alpha0[i], a0.g.alpha0[i] + 1.0, 1e-12 * (1 + std::abs(a0.g.alpha0[i])));
  }
  for (size_t i = 0; i < a0.g.gates.size(); ++i)
    EXPECT_NEAR(a1.g.gates[i], a0.g.gates[i] + 1.0, 1e-12 * (1 + std::abs(a0.g.gates[i])));
}

TEST(KernelBackward, ParameterGradientsWithoutInputGradients) {
  std::mt19937_64 rng(7);
  const Problem pr =
      make_problem("jordan(m=3, regime=raw)", 12, 2, 3, 5, Layout::HalfSplit, true, rng);
  const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
  const Loss L{test::normal_vec(pr.size(), rng), test::normal_vec(pr.size(), rng)};
  const Analytic full = analytic_grads(pr, q, k, L);
  const auto plan = pr.plan();
  const auto P = pr.positions();
  const test::TypedParams<double> tp(pr.params);
  const auto trig = kernels::build_trig_table<double>(plan, pr.dims, P);
  std::vector<double> gg(pr.params.gamma.size(), 0.0), ge(pr.params.eta.size(), 0.0);
  kernels::transform_backward<double>(plan, pr.dims, P, tp.view(), trig.view(), q.data(), k.data(),
                                      L.wq.data(), L.wk.data(), nullptr, nullptr,
                                      {gg.data(), ge.data(), nullptr, nullptr});
  for (size_t i = 0; i < gg.size(); ++i) {
    EXPECT_NEAR(gg[i], full.g.gamma[i], 1e-12 * (1 + std::abs(gg[i]))) << i;
    EXPECT_NEAR(ge[i], full.g.eta[i], 1e-12 * (1 + std::abs(ge[i]))) << i;
  }
  // keys only: the gradient of sum(wk * k_out) alone
  Loss Lk = L;
  std::fill(Lk.wq.begin(), Lk.wq.end(), 0.0);
  std::vector<double> gk(k.size(), 0.0), gk_only(pr.params.gamma.size(), 0.0);
  kernels::transform_backward<double>(plan, pr.dims, P, tp.view(), trig.view(), nullptr, k.data(),
                                      nullptr, L.wk.data(), nullptr, gk.data(),
                                      {gk_only.data(), nullptr, nullptr, nullptr});
  const Analytic keys = analytic_grads(pr, q, k, Lk);
  for (size_t i = 0; i < gk_only.size(); ++i)
    EXPECT_NEAR(gk_only[i], keys.g.gamma[i], 1e-12 * (1 + std::abs(gk_only[i]))) << i;
  for (size_t i = 0; i < gk.size(); ++i)
    EXPECT_NEAR(gk[i], full.gk[i], 1e-13 * (1 + std::abs(gk[i]))) << i;
}

namespace {

// |f - d| <= rel * max|d| + 1e-9 entry by entry (a float gradient against its float64 reference);
// reports the first entry that is not.
void expect_close_to_float64(const std::vector<float>& f, const std::vector<double>& d, double rel,
                             const char* what) {
  ASSERT_EQ(f.size(), d.size()) << what;
  double scale = 0;  // largest entry of the float64 gradient
  for (double v : d) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < d.size(); ++i)
    ASSERT_NEAR(f[i], d[i], rel * scale + 1e-9) << what << "[" << i << "]";
}

}  // namespace

TEST(KernelBackward, Float32AgreesWithFloat64) {
  std::mt19937_64 rng(6);
  // order-2 interleaved specs with an even block count and several token tiles take the AVX2
  // path whose parameter-gradient reduction stays in vector form
  const std::vector<std::pair<std::string, Layout>> cases = {
      {"jordan(m=3, regime=raw)", Layout::HalfSplit},
      {"jetmixfull(m=4, alpha=1/0.5/0.3/0.2)", Layout::HalfSplit},
      {"damped_rope(m=1)", Layout::HalfSplit},
      {"direct_sum(regime=raw)", Layout::HalfSplit},
      {"jordan(m=2, regime=raw)", Layout::Interleaved},
      {"jordan(m=2, regime=stabilized)", Layout::Interleaved},
      {"damped_rope", Layout::Interleaved}};
  for (const auto& [spec, layout] : cases) {
    SCOPED_TRACE(spec + " " + to_string(layout));
    const bool m2 = layout == Layout::Interleaved;
    const Problem pr = make_problem(spec, m2 ? 16 : test::fitting_head_dims(spec, 2, 1).at(0), 2, 2,
                                    m2 ? 40 : 7, layout, true, rng);
    const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
    const Loss L{test::normal_vec(pr.size(), rng), test::normal_vec(pr.size(), rng)};
    const ParamValues pf = rounded_to_float(pr.params);
    Problem prf = pr;
    prf.params = pf;
    // float run on the same (float-representable) data
    const auto qf = test::cast_vec<float>(q), kf = test::cast_vec<float>(k);
    const auto wqf = test::cast_vec<float>(L.wq), wkf = test::cast_vec<float>(L.wk);
    std::vector<double> qd(qf.begin(), qf.end()), kd(kf.begin(), kf.end());
    const Loss Ld{std::vector<double>(wqf.begin(), wqf.end()),
                  std::vector<double>(wkf.begin(), wkf.end())};
    const Analytic ref = analytic_grads(prf, qd, kd, Ld);
    const auto plan = prf.plan();
    const auto P = prf.positions();
    const test::TypedParams<float> tp(pf);
    const auto trig = kernels::build_trig_table<float>(plan, prf.dims, P);
    std::vector<float> gq(qf.size(), 0.f), gk(kf.size(), 0.f), gg(pf.gamma.size(), 0.f),
        ge(pf.eta.size(), 0.f), ga(pf.alpha0.size(), 0.f), gt(pf.gates.size(), 0.f);
    kernels::transform_backward<float>(
        plan, prf.dims, P, tp.view(), trig.view(), qf.data(), kf.data(), wqf.data(), wkf.data(),
        gq.data(), gk.data(), {gg.data(), ge.data(), gt.empty() ? nullptr : gt.data(), ga.data()});
    expect_close_to_float64(gq, ref.gq, 1e-5, "gq");
    expect_close_to_float64(gk, ref.gk, 1e-5, "gk");
    expect_close_to_float64(gg, ref.g.gamma, 1e-5, "gamma");
    expect_close_to_float64(ge, ref.g.eta, 1e-5, "eta");
    expect_close_to_float64(ga, ref.g.alpha0, 1e-5, "alpha0");
    expect_close_to_float64(gt, ref.g.gates, 1e-5, "gates");
  }
}

TEST(KernelFastPaths, Float32MatchesFloat64AcrossShapesAndPositions) {
  // The float kernels for RoPE (both layouts) and order-2 blocks in the interleaved layout take
  // hand-vectorised paths (8 pairs / 8 blocks per step, damping from per-head power tables at
  // evenly spaced positions, exact per-token values otherwise, a clamp that binds in some tiles).
  // Head dims give full and partial groups; T = 150 gives full and partial 64-token tiles.
  std::mt19937_64 rng(31);
  const std::vector<std::string> specs = {
      "rope", "jordan(m=2, regime=raw)", "jordan(m=2, regime=scaled, L=64, eta0=0.5, eta_max=1)",
      "jordan(m=2, regime=stabilized, L=64)", "jordan(m=2, regime=raw, max_exp=2)"};
  for (const auto& spec : specs)
    for (const int D : {64, 44, 12})
      for (const bool even : {true, false})
        for (const bool per_batch : {false, true})
          for (const Layout layout : {Layout::Interleaved, Layout::HalfSplit}) {
            if (layout == Layout::HalfSplit && spec != "rope") continue;  // rotations only
            SCOPED_TRACE(spec + " D=" + std::to_string(D) + (even ? " even" : " irregular") +
                         (per_batch ? " per-batch " : " shared ") + test::layout_name(layout));
            const int64_t B = 2, H = 2, T = 150;
            Problem pr = make_problem(spec, D, B, H, T, layout, per_batch, rng);
            if (even) {
              pr.pos.clear();
              for (int64_t b = 0; b < (per_batch ? B : 1); ++b)
                for (int64_t t = 0; t < T; ++t)
                  pr.pos.push_back(-40.0 + 7.0 * b + 1.0 * static_cast<double>(t));
            }
            // damping strong enough to matter over the window (|gamma p| up to ~3.5), so that
            // max_exp=2 binds at the window's ends and not near its centre
            if (pr.mech.segments().at(0).damped)
              for (auto& g : pr.params.gamma) g = test::uniform(rng, 0.005, 0.03);
            pr.params = rounded_to_float(pr.params);
            const auto qf = test::cast_vec<float>(test::normal_vec(pr.size(), rng));
            const auto kf = test::cast_vec<float>(test::normal_vec(pr.size(), rng));
            // forward against the float64 kernel (itself checked against the references and the
            // clamp semantics above), row by row
            const auto out = test::run_forward<float>(pr, pr.params, qf, kf);
            const std::vector<double> qd(qf.begin(), qf.end()), kd(kf.begin(), kf.end());
            const auto outd = test::run_forward<double>(pr, pr.params, qd, kd);
            for (int64_t row = 0; row < pr.rows(); ++row) {
              double eq = 0, nq = 0, ek = 0, nk = 0;
              for (int i = 0; i < D; ++i) {
                const size_t j = static_cast<size_t>(row * D + i);
                eq += std::pow(out.q[j] - outd.q[j], 2), nq += outd.q[j] * outd.q[j];
                ek += std::pow(out.k[j] - outd.k[j], 2), nk += outd.k[j] * outd.k[j];
              }
              ASSERT_LT(std::sqrt(eq / nq), 1e-5) << "q row " << row;
              ASSERT_LT(std::sqrt(ek / nk), 1e-5) << "k row " << row;
            }

            const auto wqf = test::cast_vec<float>(test::normal_vec(pr.size(), rng));
            const auto wkf = test::cast_vec<float>(test::normal_vec(pr.size(), rng));
            const Loss Ld{std::vector<double>(wqf.begin(), wqf.end()),
                          std::vector<double>(wkf.begin(), wkf.end())};
            const Analytic ref = analytic_grads(pr, qd, kd, Ld);
            const auto plan = pr.plan();
            const auto P = pr.positions();
            const test::TypedParams<float> tp(pr.params);
            const auto trig = kernels::build_trig_table<float>(plan, pr.dims, P);
            std::vector<float> gq(qf.size()), gk(kf.size()), gg(pr.params.gamma.size(), 0.f),
                ge(pr.params.eta.size(), 0.f);
            kernels::transform_backward<float>(plan, pr.dims, P, tp.view(), trig.view(), qf.data(),
                                               kf.data(), wqf.data(), wkf.data(), gq.data(),
                                               gk.data(), {gg.data(), ge.data(), nullptr, nullptr});
            expect_close_to_float64(gq, ref.gq, 2e-5, "gq");
            expect_close_to_float64(gk, ref.gk, 2e-5, "gk");
            expect_close_to_float64(gg, ref.g.gamma, 2e-5, "gamma");
            expect_close_to_float64(ge, ref.g.eta, 2e-5, "eta");
            // in place, and q-only / k-only calls, give the same bits as the two-tensor call
            std::vector<float> qi = qf, ki = kf;
            kernels::transform_forward<float>(plan, pr.dims, P, tp.view(), trig.view(), qi.data(),
                                              ki.data(), qi.data(), ki.data());
            EXPECT_EQ(qi, out.q);
            EXPECT_EQ(ki, out.k);
            std::vector<float> gk_only(kf.size());
            kernels::transform_backward<float>(plan, pr.dims, P, tp.view(), trig.view(), nullptr,
                                               kf.data(), nullptr, wkf.data(), nullptr,
                                               gk_only.data(), {});
            EXPECT_EQ(gk_only, gk);
          }
}

// ---------------------------------------------------------------------------------------------
// Exponent clamp

TEST(KernelClamp, ForwardSaturatesAndGammaGradientVanishes) {
  // one order-2 block (D = 4), gamma 0.1, max_exp 5: |gamma p| = 6..10 > 5 at every position
  Problem pr{build_mechanism("jordan(m=2, regime=raw, max_exp=5)", 4, 1),
             {},
             Layout::Interleaved,
             {1, 1, 4},
             {-100.0, -60.0, 60.0, 100.0},
             false,
             0.0};
  pr.params = default_params(pr.mech);
  pr.params.gamma = {0.1};
  pr.params.eta = {0.05};
  std::mt19937_64 rng(8);
  const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
  const auto out = test::run_forward<double>(pr, pr.params, q, k);
  ParamValues undamped = pr.params;
  undamped.gamma = {0.0};
  for (int t = 0; t < 4; ++t) {
    const double p = pr.pos[t];
    const double key_scale = std::exp(p > 0 ? 5.0 : -5.0), query_scale = 1.0 / key_scale;
    const Eigen::Map<const Eigen::Vector4d> qx(q.data() + 4 * t), kx(k.data() + 4 * t);
    const Eigen::Map<const Eigen::Vector4d> qy(out.q.data() + 4 * t), ky(out.k.data() + 4 * t);
    const Eigen::Vector4d kw =
        key_scale * reference::key_map(pr.mech, undamped, 0, p, pr.layout) * kx;
    const Eigen::Vector4d qw =
        query_scale * reference::query_map(pr.mech, undamped, 0, p, pr.layout) * qx;
    EXPECT_LT((ky - kw).norm(), 1e-13 * kw.norm()) << "p " << p;
    EXPECT_LT((qy - qw).norm(), 1e-13 * qw.norm()) << "p " << p;
    // the unclamped map is really different here
    const Eigen::Vector4d kfree = reference::key_map(pr.mech, pr.params, 0, p, pr.layout) * kx;
    EXPECT_GT((ky - kfree).norm(), 0.5 * ky.norm()) << "p " << p;
  }
  const Loss L{test::normal_vec(pr.size(), rng), test::normal_vec(pr.size(), rng)};
  const Analytic a = analytic_grads(pr, q, k, L);
  EXPECT_EQ(a.g.gamma[0], 0.0);
  EXPECT_NE(a.g.eta[0], 0.0);
  EXPECT_NEAR(a.g.eta[0], fd_param(pr, L, q, k, &ParamValues::eta, 0, 1e-6),
              1e-6 * (1 + std::abs(a.g.eta[0])));
  EXPECT_NEAR(fd_param(pr, L, q, k, &ParamValues::gamma, 0, 1e-6), 0.0, 1e-6);
}

TEST(KernelClamp, MixedWindowGammaGradientCountsOnlyUnclampedPositions) {
  Problem pr{build_mechanism("jordan(m=3, regime=raw, max_exp=5)", 12, 2),
             {},
             Layout::HalfSplit,
             {2, 2, 6},
             {-90.0, -20.0, -3.5, 0.0, 12.0, 75.0},
             false,
             0.0};
  std::mt19937_64 rng(9);
  pr.params = random_params(pr.mech, rng);
  for (auto& g : pr.params.gamma) g = test::uniform(rng, 0.08, 0.12);  // binds at |p| = 75, 90 only
  const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
  const Loss L{test::normal_vec(pr.size(), rng), test::normal_vec(pr.size(), rng)};
  const Analytic a = analytic_grads(pr, q, k, L);
  for (size_t i = 0; i < a.g.gamma.size(); ++i) {
    const double fd = fd_param(pr, L, q, k, &ParamValues::gamma, i, 1e-7);
    EXPECT_NEAR(a.g.gamma[i], fd, 1e-6 * (1 + std::abs(fd))) << i;
  }
}

// Long windows whose rows move into and out of the clamp (damping recurrences must re-anchor):
// one order-2 block per head, gamma 0.05 / 0.1 / 0.2 per head, max_exp 5, p = -75..75.
TEST(KernelClamp, LongWindowsEnterAndLeaveTheClamp) {
  for (const bool arithmetic : {true, false}) {
    SCOPED_TRACE(arithmetic ? "arithmetic positions" : "irregular positions");
    const int64_t B = 2, H = 3, T = 151;
    Problem pr{build_mechanism("jordan(m=2, regime=raw, max_exp=5)", 4, H),
               {},
               Layout::Interleaved,
               {B, H, T},
               {},
               false,
               0.0};
    for (int64_t t = 0; t < T; ++t)
      pr.pos.push_back(-75.0 + static_cast<double>(t) + (!arithmetic && t % 7 == 3 ? 0.25 : 0.0));
    pr.params = default_params(pr.mech);
    pr.params.gamma = {0.05, 0.1, 0.2};
    pr.params.eta = {0.03, -0.02, 0.01};
    std::mt19937_64 rng(10);
    const auto q = test::normal_vec(pr.size(), rng), k = test::normal_vec(pr.size(), rng);
    const auto out = test::run_forward<double>(pr, pr.params, q, k);
    ParamValues undamped = pr.params;
    undamped.gamma = {0.0, 0.0, 0.0};
    double worst = 0;
    int clamped = 0;
    for (int64_t row = 0; row < pr.rows(); ++row) {
      const double p = pr.row_pos(row);
      const int h = pr.row_head(row);
      const double a = pr.params.gamma[h] * p, ac = std::clamp(a, -5.0, 5.0);
      clamped += a != ac;
      const Eigen::Map<const Eigen::Vector4d> qx(q.data() + 4 * row), kx(k.data() + 4 * row);
      const Eigen::Map<const Eigen::Vector4d> qy(out.q.data() + 4 * row),
          ky(out.k.data() + 4 * row);
      const Eigen::Vector4d kw =
          std::exp(ac) * reference::key_map(pr.mech, undamped, h, p, pr.layout) * kx;
      const Eigen::Vector4d qw =
          std::exp(-ac) * reference::query_map(pr.mech, undamped, h, p, pr.layout) * qx;
      worst = std::max({worst, (ky - kw).norm() / kw.norm(), (qy - qw).norm() / qw.norm()});
    }
    EXPECT_GT(clamped, 100);              // the clamp really binds on many rows ...
    EXPECT_LT(clamped, pr.rows() - 100);  // ... and not on many others
    EXPECT_LT(worst, 1e-12);
  }
}

// Spec 1.1 (reference RotaryEmbedding): q and k of RoPE rotate by +omega p,
// y0 = x0 cos a - x1 sin a, y1 = x0 sin a + x1 cos a; Jordan blocks rotate by -omega p (spec 1.3).
// One rotation sense across the catalog (rope's); the Jordan-RoPE paper's opposite sense with
// direction=paper.
TEST(KernelConventions, RopeAndJordanRotateByPlusOmegaPThePaperSenseByMinus) {
  for (const std::string spec :
       {"rope", "jordan(m=2, regime=raw, zero_gamma=true)", "damped_rope(zero_gamma=true)",
        "jordan(m=2, regime=raw, zero_gamma=true, direction=paper)"}) {
    const Mechanism m = build_mechanism(spec, 4, 1);
    const auto plan = kernels::TransformPlan::from(m, Layout::Interleaved);
    const std::vector<double> pos = {3.0};
    kernels::Positions P{pos.data(), false, 0.0};
    const kernels::Dims dims{1, 1, 1};
    const auto pv = default_params(m);
    kernels::Params<double> par{pv.gamma.data(), pv.eta.data(), pv.gates.data(), pv.alpha0.data()};
    const auto trig = kernels::build_trig_table<double>(plan, dims, P);
    const std::vector<double> x = {1.0, 0.0, 1.0, 0.0};
    std::vector<double> y(4);
    kernels::transform_forward<double>(plan, dims, P, par, trig.view(), nullptr, x.data(), nullptr,
                                       y.data());
    const double sign = spec.find("direction=paper") == std::string::npos ? 1.0 : -1.0;
    EXPECT_NEAR(y[0], std::cos(3.0), 1e-15) << spec;
    EXPECT_NEAR(y[1], sign * std::sin(3.0), 1e-15) << spec;
  }
}

// transform_apply: each role of one map against the dense float64 references (key_map = A,
// query_map = A^{-T}; the other two their transposes), the round trips A^{-1} A = 1 and
// A^T A^{-T} = 1, and the same bits as transform_forward / transform_backward give.
namespace {

using kernels::MapRole;
constexpr MapRole kRoles[] = {MapRole::Primal, MapRole::Contragredient, MapRole::PrimalTranspose,
                              MapRole::Inverse};

const char* role_name(MapRole r) {
  switch (r) {
    case MapRole::Primal:
      return "A";
    case MapRole::Contragredient:
      return "A^-T";
    case MapRole::PrimalTranspose:
      return "A^T";
    case MapRole::Inverse:
      return "A^-1";
  }
  return "?";
}

Eigen::MatrixXd role_matrix(const Problem& pr, const ParamValues& pv, int h, double p, MapRole r) {
  switch (r) {
    case MapRole::Primal:
      return reference::key_map(pr.mech, pv, h, p, pr.layout);
    case MapRole::Contragredient:
      return reference::query_map(pr.mech, pv, h, p, pr.layout);
    case MapRole::PrimalTranspose:
      return reference::key_map(pr.mech, pv, h, p, pr.layout).transpose();
    case MapRole::Inverse:
      return reference::query_map(pr.mech, pv, h, p, pr.layout).transpose();
  }
  return {};
}

// Rows compared with the dense references: about 24, spread over the tensor (the dense maps
// are slow; transform_forward's tests cover every row, and the same-bits checks below tie the
// roles to it).
int64_t checked_row_stride(const Problem& pr) {
  return std::max<int64_t>(1, pr.rows() / 24);
}

// max over the checked rows of ||y - M x|| / ||M x|| with M the float64 matrix of the row.
template <class T, class F>
double max_row_error(const Problem& pr, const std::vector<T>& x, const std::vector<T>& y,
                     F&& matrix_of_row) {
  const int D = pr.D();
  double worst = 0;
  for (int64_t row = 0; row < pr.rows(); row += checked_row_stride(pr)) {
    Eigen::VectorXd xv(D), yv(D);
    for (int i = 0; i < D; ++i) xv[i] = x[row * D + i], yv[i] = y[row * D + i];
    const Eigen::VectorXd r = matrix_of_row(row) * xv;
    worst = std::max(worst, (yv - r).norm() / std::max(r.norm(), 1e-300));
  }
  return worst;
}

template <class T>
void check_apply(const std::string& spec, double tol, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto dims = test::fitting_head_dims(spec, 2, 1);
  ASSERT_FALSE(dims.empty()) << spec;
  // and one with full SIMD groups for the fast paths (float, interleaved)
  dims.push_back(test::fitting_head_dims(spec, 2, 64, 128).back());
  int n = 0;
  for (const Layout layout : {Layout::Interleaved, Layout::HalfSplit})
    for (const int D : dims)
      for (const bool even : {true, false}) {
        if (layout == Layout::HalfSplit && D == dims.back()) continue;
        const bool per_batch = n % 2 == 1;
        const int64_t B = 1 + n % 2, H = 2, Tn = even ? 70 : 9;
        ++n;
        SCOPED_TRACE(spec + " " + test::layout_name(layout) + " D=" + std::to_string(D) +
                     " T=" + std::to_string(Tn) + (even ? " evenly spaced" : " irregular") +
                     (per_batch ? " per-batch" : " shared"));
        Problem pr = make_problem(spec, D, B, H, Tn, layout, per_batch, rng);
        if (even)
          for (size_t i = 0; i < pr.pos.size(); ++i)
            pr.pos[i] = 3.0 + static_cast<double>(i % static_cast<size_t>(Tn));
        const ParamValues pv = sizeof(T) == 4 ? rounded_to_float(pr.params) : pr.params;
        const auto plan = pr.plan();
        const auto P = pr.positions();
        const test::TypedParams<T> tp(pr.params);
        const auto trig = kernels::build_trig_table<T>(plan, pr.dims, P);
        const auto x = test::cast_vec<T>(test::normal_vec(pr.size(), rng));
        const auto apply = [&](MapRole r, const std::vector<T>& in) {
          std::vector<T> out(in.size());
          kernels::transform_apply<T>(plan, pr.dims, P, tp.view(), trig.view(), r, in.data(),
                                      out.data());
          return out;
        };
        // A and A^{-T} of every row, once
        std::vector<Eigen::MatrixXd> ka(static_cast<size_t>(pr.rows())), qa(ka.size());
        double cond = 1;
        for (int64_t row = 0; row < pr.rows(); row += checked_row_stride(pr)) {
          ka[row] = role_matrix(pr, pv, pr.row_head(row), pr.row_pos(row), MapRole::Primal);
          qa[row] = role_matrix(pr, pv, pr.row_head(row), pr.row_pos(row), MapRole::Contragredient);
          cond = std::max(cond, ka[row].norm() * qa[row].norm());  // ||A|| ||A^{-1}||
        }
        std::vector<T> y[4];
        for (const MapRole r : kRoles) {
          SCOPED_TRACE(role_name(r));
          auto& yr = y[static_cast<int>(r)];
          yr = apply(r, x);
          EXPECT_LT(max_row_error(pr, x, yr,
                                  [&](int64_t row) -> Eigen::MatrixXd {
                                    switch (r) {
                                      case MapRole::Primal:
                                        return ka[row];
                                      case MapRole::Contragredient:
                                        return qa[row];
                                      case MapRole::PrimalTranspose:
                                        return ka[row].transpose();
                                      case MapRole::Inverse:
                                        break;
                                    }
                                    return qa[row].transpose();
                                  }),
                    tol);
          std::vector<T> inplace = x;  // in place gives the same bits
          kernels::transform_apply<T>(plan, pr.dims, P, tp.view(), trig.view(), r, inplace.data(),
                                      inplace.data());
          EXPECT_EQ(inplace, yr);
        }
        // round trips: A^{-1} (A x) = x and A^T (A^{-T} x) = x, up to the maps' conditioning
        const auto identity = [&](int64_t) { return Eigen::MatrixXd::Identity(D, D); };
        EXPECT_LT(max_row_error(pr, x, apply(MapRole::Inverse, y[0]), identity), tol * cond);
        EXPECT_LT(max_row_error(pr, x, apply(MapRole::PrimalTranspose, y[1]), identity),
                  tol * cond);
        // the public forward and backward are these maps: same bits
        std::vector<T> qo(x.size()), ko(x.size()), gq(x.size()), gk(x.size());
        kernels::transform_forward<T>(plan, pr.dims, P, tp.view(), trig.view(), x.data(), x.data(),
                                      qo.data(), ko.data());
        EXPECT_EQ(ko, y[static_cast<int>(MapRole::Primal)]);
        EXPECT_EQ(qo, y[static_cast<int>(MapRole::Contragredient)]);
        for (const bool with_params : {false, true}) {
          SCOPED_TRACE(with_params ? "backward with parameter gradients" : "backward");
          std::vector<T> dg(pr.params.gamma.size()), de(pr.params.eta.size()),
              dgt(pr.params.gates.size()), da(pr.params.alpha0.size());
          kernels::ParamGrads<T> G;
          if (with_params) G = {dg.data(), de.data(), dgt.data(), da.data()};
          kernels::transform_backward<T>(plan, pr.dims, P, tp.view(), trig.view(), x.data(),
                                         x.data(), x.data(), x.data(), gq.data(), gk.data(), G);
          if (!with_params) {
            EXPECT_EQ(gk, y[static_cast<int>(MapRole::PrimalTranspose)]);
            EXPECT_EQ(gq, y[static_cast<int>(MapRole::Inverse)]);
          } else {  // the fused loop is the same arithmetic, vectorised (and FMA-contracted) apart
            const auto near = [](const std::vector<T>& a, const std::vector<T>& b) {
              double d = 0, m = 0;
              for (size_t i = 0; i < a.size(); ++i)
                d = std::max(d, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]))),
                m = std::max(m, std::abs(static_cast<double>(b[i])));
              return d <= 64 * std::numeric_limits<T>::epsilon() * m;
            };
            EXPECT_TRUE(near(gk, y[static_cast<int>(MapRole::PrimalTranspose)]));
            EXPECT_TRUE(near(gq, y[static_cast<int>(MapRole::Inverse)]));
          }
        }
      }
}

std::vector<std::string> apply_specs() {
  return {"rope",
          "damped_rope",
          "direct_sum",
          "jordan(m=2, regime=raw, eta0=0.05)",
          "jordan(m=2, regime=scaled)",
          "jordan(m=2, regime=stabilized)",
          "jordan(m=3, regime=raw)",
          "jordan(m=3, regime=scaled, c=0.5, eta0=0.1, eta_max=1)",
          "jetmix(m=3, gates=0.1/0.05)",
          "jordan(m=2, regime=raw) + alibi"};
}

}  // namespace

TEST(KernelApply, Float64EveryRoleMatchesReferenceMaps) {
  uint64_t seed = 900;
  for (const auto& spec : apply_specs()) check_apply<double>(spec, 1e-12, ++seed);
}

TEST(KernelApply, Float32EveryRoleMatchesReferenceMaps) {
  uint64_t seed = 950;
  for (const auto& spec : apply_specs()) check_apply<float>(spec, 1e-5, ++seed);
}

TEST(KernelApply, RejectsMissingTensors) {
  const Mechanism m = build_mechanism("rope", 4, 1);
  const auto plan = kernels::TransformPlan::from(m, Layout::Interleaved);
  const std::vector<double> pos = {0.0};
  const kernels::Positions P{pos.data(), false, 0.0};
  const kernels::Dims dims{1, 1, 1};
  const auto trig = kernels::build_trig_table<float>(plan, dims, P);
  std::vector<float> x(4, 1.0f);
  EXPECT_THROW(kernels::transform_apply<float>(plan, dims, P, {}, trig.view(),
                                               kernels::MapRole::Primal, nullptr, x.data()),
               InputError);
}
