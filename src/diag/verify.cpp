#include "diag/verify.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/reference.hpp"
#include "core/registry.hpp"
#include "kernels/transform.hpp"

namespace relpos::diag {

namespace {

std::vector<double> sample_positions(const VerifyOptions& o, std::mt19937_64& rng) {
  const double N = static_cast<double>(o.max_lag);
  std::vector<double> p = {0, 1, 2, 3, 7, N / 2, N - 1, N};
  std::uniform_int_distribution<int64_t> U(0, o.max_lag);
  while (static_cast<int>(p.size()) < o.positions) {
    const auto x = static_cast<double>(U(rng));
    p.push_back(x);  // clusters give short lags everywhere in the window
    if (x + 1 <= N) p.push_back(x + 1);
    if (x + 5 <= N) p.push_back(x + 5);
  }
  std::sort(p.begin(), p.end());
  p.erase(std::unique(p.begin(), p.end()), p.end());
  return p;
}

template <class T>
struct Applied {
  std::vector<T> q, k;
};

// Runs the fast kernel on [1, H, K, D] inputs at the given positions and centre.
template <class T>
Applied<T> apply(const Mechanism& m, const ParamValues& pv, Layout layout,
                 const std::vector<double>& pos, double center, const std::vector<double>& q,
                 const std::vector<double>& k, bool wrong_query = false) {
  const auto plan = kernels::TransformPlan::from(m, layout);
  kernels::Dims dims{1, m.heads, static_cast<int64_t>(pos.size())};
  kernels::Positions P{pos.data(), false, center};
  std::vector<T> g(pv.gamma.begin(), pv.gamma.end()), e(pv.eta.begin(), pv.eta.end()),
      gt(pv.gates.begin(), pv.gates.end()), a0(pv.alpha0.begin(), pv.alpha0.end());
  kernels::Params<T> par{g.data(), e.data(), gt.data(), a0.data()};
  const auto trig = kernels::build_trig_table<T>(plan, dims, P);
  Applied<T> out;
  std::vector<T> qi(q.begin(), q.end()), ki(k.begin(), k.end());
  out.q.resize(q.size());
  out.k.resize(k.size());
  if (wrong_query) {
    kernels::transform_forward<T>(plan, dims, P, par, trig.view(), nullptr, qi.data(), nullptr,
                                  out.q.data());
    kernels::transform_forward<T>(plan, dims, P, par, trig.view(), nullptr, ki.data(), nullptr,
                                  out.k.data());
  } else {
    kernels::transform_forward<T>(plan, dims, P, par, trig.view(), qi.data(), ki.data(), out.q.data(),
                                  out.k.data());
  }
  return out;
}

double norm(const double* x, int D) {
  double s = 0;
  for (int i = 0; i < D; ++i) s += x[i] * x[i];
  return std::sqrt(s);
}
template <class T>
double norm(const T* x, int D) {
  double s = 0;
  for (int i = 0; i < D; ++i) s += static_cast<double>(x[i]) * x[i];
  return std::sqrt(s);
}
template <class T>
double dot(const T* a, const T* b, int D) {
  double s = 0;
  for (int i = 0; i < D; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

struct Residuals {
  double rel = 0, rel_qk = 0;
};

template <class T>
Residuals relative_law(const Mechanism& m, const ParamValues& pv, Layout layout,
                       const std::vector<double>& pos, const std::vector<double>& q,
                       const std::vector<double>& k, const Applied<T>& a) {
  const int D = m.head_dim, K = static_cast<int>(pos.size());
  Residuals r;
  for (int h = 0; h < m.heads; ++h)
    for (int i = 0; i < K; ++i)
      for (int j = 0; j <= i; ++j) {
        const size_t qi = (static_cast<size_t>(h) * K + i) * D, kj = (static_cast<size_t>(h) * K + j) * D;
        const double s = dot(a.q.data() + qi, a.k.data() + kj, D);
        const double ref =
            reference::relative_score(m, pv, h, pos[i] - pos[j], q.data() + qi, k.data() + kj, layout);
        const double err = std::abs(s - ref);
        const double n1 = norm(a.q.data() + qi, D) * norm(a.k.data() + kj, D);
        const double n2 = norm(q.data() + qi, D) * norm(k.data() + kj, D);
        if (n1 > 0) r.rel = std::max(r.rel, err / n1);
        if (n2 > 0) r.rel_qk = std::max(r.rel_qk, err / n2);
      }
  return r;
}

template <class T>
void growth(const Mechanism& m, const std::vector<double>& q, const std::vector<double>& k,
            const Applied<T>& a, double& kg, double& qg) {
  const int D = m.head_dim;
  const size_t rows = q.size() / D;
  kg = qg = 0;
  for (size_t r = 0; r < rows; ++r) {
    kg = std::max(kg, norm(a.k.data() + r * D, D) / norm(k.data() + r * D, D));
    qg = std::max(qg, norm(a.q.data() + r * D, D) / norm(q.data() + r * D, D));
  }
}

bool clamp_binds(const Mechanism& m, const ParamValues& pv, double max_abs_pos) {
  for (const auto& s : m.segments) {
    if (!s.damped) continue;
    for (int h = 0; h < pv.heads; ++h)
      for (int b = 0; b < s.blocks; ++b)
        if (std::abs(pv.gamma[static_cast<size_t>(h) * pv.blocks + s.first_block + b]) * max_abs_pos >
            s.max_exponent)
          return true;
  }
  return false;
}

template <class T>
VerifyRow run_one(const std::string& spec, const Mechanism& m, const ParamValues& pv,
                  const VerifyOptions& o, const std::vector<double>& pos,
                  const std::vector<double>& q, const std::vector<double>& k) {
  VerifyRow row;
  row.spec = spec;
  row.canonical = m.spec;
  row.head_dim = m.head_dim;
  row.declared = m.exactness();
  row.transform_exact = m.transform_exact();
  row.dtype = sizeof(T) == 8 ? "f64" : "f32";
  const double pmin = pos.front(), pmax = pos.back();
  row.center = m.window_center(pmin, pmax);
  const auto a = apply<T>(m, pv, o.layout, pos, row.center, q, k);
  const auto res = relative_law(m, pv, o.layout, pos, q, k, a);
  row.residual = res.rel;
  row.residual_qk = res.rel_qk;
  growth(m, q, k, a, row.key_growth, row.query_growth);
  const auto a0 = apply<T>(m, pv, o.layout, pos, 0.0, q, k);
  growth(m, q, k, a0, row.key_growth_uncentered, row.query_growth_uncentered);
  row.clamp_bound = clamp_binds(m, pv, std::max(std::abs(pmin - row.center), std::abs(pmax - row.center)));
  row.clamp_bound_uncentered = clamp_binds(m, pv, std::max(std::abs(pmin), std::abs(pmax)));
  // shift invariance with a fixed centre, so the shift really moves the absolute positions
  {
    std::vector<double> shifted(pos);
    for (auto& x : shifted) x += o.shift;
    const auto b = apply<T>(m, pv, o.layout, shifted, row.center, q, k);
    const int D = m.head_dim, K = static_cast<int>(pos.size());
    for (int h = 0; h < m.heads; ++h)
      for (int i = 0; i < K; ++i)
        for (int j = 0; j <= i; ++j) {
          const size_t qi = (static_cast<size_t>(h) * K + i) * D, kj = (static_cast<size_t>(h) * K + j) * D;
          const double s0 = dot(a.q.data() + qi, a.k.data() + kj, D);
          const double s1 = dot(b.q.data() + qi, b.k.data() + kj, D);
          const double n = norm(a.q.data() + qi, D) * norm(a.k.data() + kj, D);
          if (n > 0) row.shift_residual = std::max(row.shift_residual, std::abs(s1 - s0) / n);
        }
  }
  if (m.alibi) {
    row.alibi_lift_residual = 0;
    for (double slope : m.alibi->slopes)
      for (size_t i = 0; i < pos.size(); ++i)
        for (size_t j = 0; j <= i; ++j) {
          const auto l = reference::alibi_lift(slope, pos[i], pos[j]);
          const double err = std::abs(l.q.dot(l.k) + slope * (pos[i] - pos[j]));
          row.alibi_lift_residual =
              std::max(row.alibi_lift_residual, err / (l.q.norm() * l.k.norm()));
        }
  }
  const double worst = std::max(row.residual, std::max(0.0, row.alibi_lift_residual));
  if (row.dtype == "f32") {
    row.status = "INFO";
  } else if (!row.transform_exact) {
    row.status = "APPROX";
  } else if (worst <= o.exact_tol) {
    row.status = "PASS";
  } else {
    row.status = row.clamp_bound ? "CLAMPED" : "FAIL";
  }
  return row;
}

Mechanism build_for_verify(const std::string& spec, const VerifyOptions& o) {
  try {
    return build_mechanism(spec, o.head_dim, o.heads);
  } catch (const InputError&) {
    if (!o.auto_head_dim) throw;
    // orders 3 and 5 need head dims divisible by 6 and 10: try the nearest multiples of 2m
    for (int m = 2; m <= 8; ++m) {
      const int D = 2 * m * ((o.head_dim + 2 * m - 1) / (2 * m));
      try {
        return build_mechanism(spec, D, o.heads);
      } catch (const InputError&) {
      }
    }
    throw;
  }
}

// Mechanism, sampled positions and random q, k shared by the checks of one spec.
struct Sample {
  Mechanism m;
  std::mt19937_64 rng;
  std::vector<double> pos, q, k;
};
Sample make_sample(const std::string& spec, const VerifyOptions& o) {
  Sample s{build_for_verify(spec, o), std::mt19937_64(o.seed), {}, {}, {}};
  s.pos = sample_positions(o, s.rng);
  std::normal_distribution<double> N01;
  const size_t n = static_cast<size_t>(s.m.heads) * s.pos.size() * s.m.head_dim;
  s.q.resize(n);
  s.k.resize(n);
  for (auto& x : s.q) x = N01(s.rng);
  for (auto& x : s.k) x = N01(s.rng);
  return s;
}

}  // namespace

std::vector<VerifyRow> verify_spec(const std::string& spec, const VerifyOptions& o,
                                   const std::vector<std::string>& dtypes) {
  Sample s = make_sample(spec, o);
  std::vector<VerifyRow> rows;
  const ParamValues def = default_params(s.m);
  const ParamValues rnd = random_params(s.m, s.rng);
  for (const auto* pv : {&def, &rnd})
    for (const auto& dt : dtypes) {
      VerifyRow r = dt == "f32" ? run_one<float>(spec, s.m, *pv, o, s.pos, s.q, s.k)
                                : run_one<double>(spec, s.m, *pv, o, s.pos, s.q, s.k);
      r.params = pv == &def ? "default" : "random";
      rows.push_back(std::move(r));
    }
  return rows;
}

double wrong_contragredient_residual(const std::string& spec, const VerifyOptions& o) {
  Sample s = make_sample(spec, o);
  const ParamValues pv = random_params(s.m, s.rng);
  const double c = s.m.window_center(s.pos.front(), s.pos.back());
  const auto a = apply<double>(s.m, pv, o.layout, s.pos, c, s.q, s.k, /*wrong_query=*/true);
  return relative_law(s.m, pv, o.layout, s.pos, s.q, s.k, a).rel;
}

}  // namespace relpos::diag
