#include "kernels/structured.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/isa.hpp"

namespace relpos::kernels {

namespace {

constexpr int64_t kTile = 128;   // tokens per tile
constexpr int64_t kChunks = 16;  // backward tasks per head: fixed, so the reduction order is too

template <class T>
void check(const StructuredDims& d, const T* U, const T* lambda, const double* pos) {
  if (d.B < 0 || d.H < 0 || d.T < 0 || d.D < 0 || d.M < 0 || d.DC < 0)
    throw InputError(
        fmt::format("structured: dimensions must be >= 0 (B {}, H {}, T {}, D {}, M {}, dc {})",
                    d.B, d.H, d.T, d.D, d.M, d.DC));
  if (d.D % 2) throw InputError(fmt::format("structured: head dim {} is odd", d.D));
  if (d.M < 1 || 2 * d.M > d.D)
    throw InputError(
        fmt::format("structured: {} planes do not fit head dim {} (need 1 <= 2m <= D)", d.M, d.D));
  if (d.DC < 1 || d.DC > 3)
    throw InputError(fmt::format("structured: {} position axes (d_c must be 1..3)", d.DC));
  const int64_t PB = d.positions_per_batch ? d.B : 1;
  for (int64_t i = 0; i < PB * d.T * d.DC; ++i)
    if (!std::isfinite(pos[i]))
      throw InputError(fmt::format("structured: position {} (token {}, axis {}) is not finite",
                                   pos[i], (i / d.DC) % std::max<int64_t>(d.T, 1), i % d.DC));
  const int64_t HL = d.freqs_per_head ? d.H : 1;
  for (int64_t i = 0; i < HL * d.DC * d.M; ++i)
    if (!std::isfinite(static_cast<double>(lambda[i])))
      throw InputError(fmt::format("structured: frequency lambda[{}] is not finite", i));
  const int64_t HU = d.basis_per_head ? d.H : 1;
  for (int64_t i = 0; i < HU * d.D * d.D; ++i)
    if (!std::isfinite(static_cast<double>(U[i])))
      throw InputError(fmt::format("structured: basis entry U[{}] is not finite", i));
  if (!d.check_basis) return;
  const double tol = sizeof(T) == 4 ? 1e-4 : 1e-10;
  const int64_t A = 2 * d.M;
  // the Gram matrices of the active columns in float64 (upper triangles), a row of U at a time
  std::vector<double> gram(static_cast<size_t>(HU * A * A), 0.0);
#pragma omp parallel for schedule(static) if (HU * A * A * d.D > (1 << 18))
  for (int64_t h = 0; h < HU; ++h) {
    const T* u = U + h * d.D * d.D;
    double* g = gram.data() + h * A * A;
    std::vector<double> ui(static_cast<size_t>(A));
    for (int64_t i = 0; i < d.D; ++i) {
      for (int64_t a = 0; a < A; ++a) ui[a] = static_cast<double>(u[i * d.D + a]);
      for (int64_t a = 0; a < A; ++a) {
        const double ua = ui[a];
        double* ga = g + a * A;
        for (int64_t b = a; b < A; ++b) ga[b] += ua * ui[b];
      }
    }
  }
  for (int64_t h = 0; h < HU; ++h) {
    for (int64_t a = 0; a < A; ++a)
      for (int64_t b = a; b < A; ++b) {
        const double s = gram[static_cast<size_t>((h * A + a) * A + b)];
        if (std::abs(s - (a == b ? 1.0 : 0.0)) > tol)
          throw InputError(fmt::format(
              "structured: basis U{} is not orthogonal: columns {} and {} have inner product "
              "{:.6g}",
              d.basis_per_head ? fmt::format(" of head {}", h) : std::string(), a, b, s));
      }
  }
}

bool parallel(const StructuredDims& d) {
  return d.B * d.H * d.T * d.D * d.M > (1 << 15);
}

// Tokens of one (batch, head) are processed a tile at a time as matrix products: Z = X U_act
// [nt, 2M], the planes of Z turned, Y = X + dZ U_act^T. The products run in T on U_act packed
// once per call (rows padded to kPad elements with zeros) by a register-blocked kernel written
// with vector extensions and compiled for the baseline, AVX2+FMA and AVX-512 (kernels/isa.hpp
// picks one at run time).
constexpr int64_t kPad = 16;  // the widest vector (64 bytes) in floats

int64_t padded(int64_t n) {
  return (n + kPad - 1) / kPad * kPad;
}

// The read-only state of one call.
template <class T>
struct Ctx {
  StructuredDims d;
  bool inverse = false;
  int64_t A = 0, Ap = 0, Dp = 0, Mp = 0;
  const T *x = nullptr, *dy = nullptr;
  std::vector<double> lambda;  // [HL][dc][M] in float64
  const double* pos = nullptr;
  T *y = nullptr, *dx = nullptr;
  bool gU = false, gL = false;
  std::vector<T> ua;   // [HU][D][Ap]: U_act
  std::vector<T> uat;  // [HU][2M][Dp]: U_act^T
};

template <class T>
void pack(Ctx<T>& c, const T* U, const T* lambda) {
  const auto& d = c.d;
  const int64_t HU = d.basis_per_head ? d.H : 1;
  c.A = 2 * d.M;
  c.Ap = padded(c.A);
  c.Dp = padded(d.D);
  c.Mp = padded(d.M);
  c.ua.assign(static_cast<size_t>(HU * d.D * c.Ap), T(0));
  c.uat.assign(static_cast<size_t>(HU * c.A * c.Dp), T(0));
  const int64_t HL = d.freqs_per_head ? d.H : 1;
  c.lambda.assign(lambda, lambda + HL * d.DC * d.M);
  for (int64_t h = 0; h < HU; ++h)
    for (int64_t i = 0; i < d.D; ++i)
      for (int64_t a = 0; a < c.A; ++a) {
        const T v = U[(h * d.D + i) * d.D + a];
        c.ua[static_cast<size_t>((h * d.D + i) * c.Ap + a)] = v;
        c.uat[static_cast<size_t>((h * c.A + a) * c.Dp + i)] = v;
      }
}

// Per-thread buffers for one tile of kTile tokens.
template <class T>
struct Work {
  std::vector<T> zb;        // [2 kTile, Ap]: Z (then dZ, or W - Z), and below it Delta
  std::vector<T> gb;        // [kTile, Ap]: g' = U_act^T dy
  std::vector<T> ob;        // [kTile, Dp]: the lifted rows
  std::vector<T> cu;        // [D, Ap]: the tile's dU_act
  std::vector<double> th;   // [kTile, M]
  std::vector<T> cs, sn;    // [kTile, M]
  std::vector<double> dt;   // [kTile, Mp]: d/dtheta
  std::vector<double> dlt;  // [dc, Mp]: the tile's dlambda
  explicit Work(const Ctx<T>& c)
      : zb(static_cast<size_t>(2 * kTile * c.Ap), T(0)),
        gb(static_cast<size_t>(kTile * c.Ap), T(0)),
        ob(static_cast<size_t>(kTile * c.Dp), T(0)),
        cu(static_cast<size_t>(c.d.D * c.Ap), T(0)),
        th(static_cast<size_t>(kTile * c.d.M)),
        cs(th.size()),
        sn(th.size()),
        dt(static_cast<size_t>(kTile * c.Mp), 0.0),
        dlt(static_cast<size_t>(c.d.DC * c.Mp), 0.0) {}
};

// C[RB rows, CB vectors] = (ACC: Ci +) A[RB, K] B[K, CB vectors] (row-major, strides lda, ldb,
// ldc, ldi); TA: A is stored transposed ([K, RB], element (r, k) at A[k lda + r]).
template <class T, int VB, int RB, int CB, bool TA, bool ACC>
[[gnu::always_inline]] inline void gemm_block(int64_t K, const T* A, int64_t lda, const T* B,
                                              int64_t ldb, T* C, int64_t ldc, const T* Ci,
                                              int64_t ldi) {
  constexpr int L = VB / static_cast<int>(sizeof(T));
  typedef T V __attribute__((vector_size(VB)));
  V c[RB][CB];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < CB; ++j) {
      c[r][j] = V{};
      if (ACC) __builtin_memcpy(&c[r][j], Ci + r * ldi + j * L, VB);
    }
  for (int64_t k = 0; k < K; ++k) {
    V b[CB];
#pragma GCC unroll 8
    for (int j = 0; j < CB; ++j) __builtin_memcpy(&b[j], B + k * ldb + j * L, VB);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const V a = A[TA ? k * lda + r : r * lda + k] - V{};  // a broadcast (x - 0 == x exactly)
#pragma GCC unroll 8
      for (int j = 0; j < CB; ++j) c[r][j] += a * b[j];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < CB; ++j) __builtin_memcpy(C + r * ldc + j * L, &c[r][j], VB);
}

// C[n, N] = (ACC: Ci +) A[n, K] B[K, N], N a multiple of the vector (TA: A stored as [K, n]).
// C may be Ci.
template <class T, int VB, int RB, int CB, bool TA = false, bool ACC = false>
[[gnu::always_inline]] inline void gemm(int64_t n, int64_t N, int64_t K, const T* A, int64_t lda,
                                        const T* B, int64_t ldb, T* C, int64_t ldc,
                                        const T* Ci = nullptr, int64_t ldi = 0) {
  constexpr int L = VB / static_cast<int>(sizeof(T));
  if (!ACC) {  // (not read)
    Ci = C;
    ldi = ldc;
  }
  const int64_t nv = N / L;
  int64_t j = 0;
  for (; j + CB <= nv; j += CB) {
    int64_t i = 0;
    for (; i + RB <= n; i += RB)
      gemm_block<T, VB, RB, CB, TA, ACC>(K, A + (TA ? i : i * lda), lda, B + j * L, ldb,
                                         C + i * ldc + j * L, ldc, Ci + i * ldi + j * L, ldi);
    for (; i < n; ++i)
      gemm_block<T, VB, 1, CB, TA, ACC>(K, A + (TA ? i : i * lda), lda, B + j * L, ldb,
                                        C + i * ldc + j * L, ldc, Ci + i * ldi + j * L, ldi);
  }
  for (; j < nv; ++j) {
    int64_t i = 0;
    for (; i + RB <= n; i += RB)
      gemm_block<T, VB, RB, 1, TA, ACC>(K, A + (TA ? i : i * lda), lda, B + j * L, ldb,
                                        C + i * ldc + j * L, ldc, Ci + i * ldi + j * L, ldi);
    for (; i < n; ++i)
      gemm_block<T, VB, 1, 1, TA, ACC>(K, A + (TA ? i : i * lda), lda, B + j * L, ldb,
                                       C + i * ldc + j * L, ldc, Ci + i * ldi + j * L, ldi);
  }
}

// cos and sin of x in float64 without branches (vectorisable): x = n pi/2 + r by a three-part
// Cody-Waite reduction, fdlibm's kernels on |r| <= pi/4; exact to an ulp or two for
// |x| <= kBigAngle (larger angles go to std::cos / std::sin).
constexpr double kBigAngle = 1e5;

[[gnu::always_inline]] inline void sincos_small(double x, double& c, double& s) {
  constexpr double magic = 0x1.8p52, two_over_pi = 6.36619772367581382433e-01;
  constexpr double p1 = 1.57079632673412561417e+00, p2 = 6.07710050630396597660e-11,
                   p3 = 2.02226624871116645580e-21;
  const double t = x * two_over_pi + magic;
  const double n = t - magic;
  const double r = ((x - n * p1) - n * p2) - n * p3;
  uint64_t bits;
  __builtin_memcpy(&bits, &t, sizeof bits);
  const uint64_t q = bits & 3;
  constexpr double s1 = -1.66666666666666324348e-01, s2 = 8.33333333332248946124e-03,
                   s3 = -1.98412698298579493134e-04, s4 = 2.75573137070700676789e-06,
                   s5 = -2.50507602534068634195e-08, s6 = 1.58969099521155010221e-10;
  constexpr double c1 = 4.16666666666666019037e-02, c2 = -1.38888888888741095749e-03,
                   c3 = 2.48015872894767294178e-05, c4 = -2.75573143513906633035e-07,
                   c5 = 2.08757232129817482790e-09, c6 = -1.13596475577881948265e-11;
  const double z = r * r;
  const double sr = r + r * z * (s1 + z * (s2 + z * (s3 + z * (s4 + z * (s5 + z * s6)))));
  const double cr =
      1.0 - 0.5 * z + z * z * (c1 + z * (c2 + z * (c3 + z * (c4 + z * (c5 + z * c6)))));
  const double s0 = (q & 1) ? cr : sr, c0 = (q & 1) ? sr : cr;
  s = (q & 2) ? -s0 : s0;
  c = ((q + 1) & 2) ? -c0 : c0;
}

// theta (times -1 when inverse) of the tile's tokens and planes, and its cos and sin in T.
template <class T>
[[gnu::always_inline]] inline void tile_angles(const Ctx<T>& c, Work<T>& w, int64_t b, int64_t h,
                                               int64_t t0, int64_t nt) {
  const auto& d = c.d;
  const double* lam = c.lambda.data() + (d.freqs_per_head ? h : 0) * d.DC * d.M;
  const double* r = c.pos + ((d.positions_per_batch ? b : 0) * d.T + t0) * d.DC;
  double* th = w.th.data();
  const int64_t M = d.M;
  for (int64_t i = 0; i < nt; ++i) {
    double* ti = th + i * M;
    for (int64_t u = 0; u < M; ++u) ti[u] = 0;
    for (int64_t k = 0; k < d.DC; ++k) {
      const double rk = r[i * d.DC + k];
      const double* lk = lam + k * M;
      for (int64_t u = 0; u < M; ++u) ti[u] += lk[u] * rk;
    }
    if (c.inverse)
      for (int64_t u = 0; u < M; ++u) ti[u] = -ti[u];
  }
  T* cs = w.cs.data();
  T* sn = w.sn.data();
  const int64_t n = nt * d.M;
  for (int64_t j = 0; j < n; ++j) {
    double cj, sj;
    sincos_small(th[j], cj, sj);
    cs[j] = static_cast<T>(cj);
    sn[j] = static_cast<T>(sj);
  }
  int64_t big = 0;  // (a sum, not a max, so that it vectorises)
  for (int64_t j = 0; j < n; ++j) big += !(std::abs(th[j]) <= kBigAngle);
  if (big)
    for (int64_t j = 0; j < n; ++j)
      if (!(std::abs(th[j]) <= kBigAngle)) {
        cs[j] = static_cast<T>(std::cos(th[j]));
        sn[j] = static_cast<T>(std::sin(th[j]));
      }
}

// Y = X + dZ U_act^T for nt rows (Y may be X): straight into Y when D fills whole vectors.
template <class T, int VB, int RB, int CB>
[[gnu::always_inline]] inline void lift(const Ctx<T>& c, int64_t nt, const T* dZ, const T* uat,
                                        const T* X, T* Y, T* O) {
  const int64_t D = c.d.D, Dp = c.Dp;
  if (D == Dp) {
    gemm<T, VB, RB, CB, false, true>(nt, D, c.A, dZ, c.Ap, uat, Dp, Y, D, X, D);
    return;
  }
  gemm<T, VB, RB, CB>(nt, Dp, c.A, dZ, c.Ap, uat, Dp, O, Dp);
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t j = 0; j < D; ++j) Y[i * D + j] = X[i * D + j] + O[i * Dp + j];
}

template <class T, int VB, int RB, int CB>
[[gnu::always_inline]] inline void forward_tile(const Ctx<T>& c, Work<T>& w, int64_t b, int64_t h,
                                                int64_t t0, int64_t nt) {
  const auto& d = c.d;
  const int64_t A = c.A, Ap = c.Ap, Dp = c.Dp, M = d.M;
  const int64_t hu = d.basis_per_head ? h : 0;
  const int64_t row = ((b * d.H + h) * d.T + t0) * d.D;
  const T* X = c.x + row;
  T* Z = w.zb.data();
  gemm<T, VB, RB, CB>(nt, Ap, d.D, X, d.D, c.ua.data() + hu * d.D * Ap, Ap, Z, Ap);
  tile_angles(c, w, b, h, t0, nt);
  const T* cs = w.cs.data();
  const T* sn = w.sn.data();
  for (int64_t i = 0; i < nt; ++i) {
    T* zi = Z + i * Ap;
    for (int64_t u = 0; u < M; ++u) {
      const T co = cs[i * M + u], si = sn[i * M + u], z0 = zi[2 * u], z1 = zi[2 * u + 1];
      zi[2 * u] = co * z0 - si * z1 - z0;
      zi[2 * u + 1] = si * z0 + co * z1 - z1;
    }
  }
  lift<T, VB, RB, CB>(c, nt, Z, c.uat.data() + hu * A * Dp, X, c.y + row, w.ob.data());
}

// dx of the tile, and where asked its dU_act (added to du [D, 2M]) and dlambda (added to dl).
template <class T, int VB, int RB, int CB>
[[gnu::always_inline]] inline void backward_tile(const Ctx<T>& c, Work<T>& w, int64_t b, int64_t h,
                                                 int64_t t0, int64_t nt, double* du, double* dl) {
  const auto& d = c.d;
  const int64_t A = c.A, Ap = c.Ap, Dp = c.Dp, M = d.M, D = d.D;
  const int64_t hu = d.basis_per_head ? h : 0;
  const int64_t row = ((b * d.H + h) * d.T + t0) * D;
  const T* G = c.dy + row;
  const T* X = c.x + row;
  const T* ua = c.ua.data() + hu * D * Ap;
  T* Gp = w.gb.data();
  gemm<T, VB, RB, CB>(nt, Ap, D, G, D, ua, Ap, Gp, Ap);  // g' = U_act^T dy
  tile_angles(c, w, b, h, t0, nt);
  const T* cs = w.cs.data();
  const T* sn = w.sn.data();
  T* Wz = w.zb.data();   // rows [0, nt): W - Z
  T* Dl = Wz + nt * Ap;  // rows [nt, 2 nt): Delta = R^T g' - g'
  for (int64_t i = 0; i < nt; ++i) {
    const T* gi = Gp + i * Ap;
    T* di = Dl + i * Ap;
    for (int64_t u = 0; u < M; ++u) {
      const T co = cs[i * M + u], si = sn[i * M + u], g0 = gi[2 * u], g1 = gi[2 * u + 1];
      di[2 * u] = co * g0 + si * g1 - g0;
      di[2 * u + 1] = co * g1 - si * g0 - g1;
    }
  }
  if (c.gU || c.gL) {
    gemm<T, VB, RB, CB>(nt, Ap, D, X, D, ua, Ap, Wz, Ap);  // z = U_act^T x
    const double* r = c.pos + ((d.positions_per_batch ? b : 0) * d.T + t0) * d.DC;
    double* dth = w.dt.data();
    const int64_t Mp = c.Mp;
    for (int64_t i = 0; i < nt; ++i) {
      const T* gi = Gp + i * Ap;
      T* zi = Wz + i * Ap;
      for (int64_t u = 0; u < M; ++u) {
        const T co = cs[i * M + u], si = sn[i * M + u], z0 = zi[2 * u], z1 = zi[2 * u + 1];
        const T w0 = co * z0 - si * z1, w1 = si * z0 + co * z1;
        // d/dtheta of g'^T R(theta) z = g'^T J w
        dth[i * Mp + u] = static_cast<double>(gi[2 * u + 1]) * static_cast<double>(w0) -
                          static_cast<double>(gi[2 * u]) * static_cast<double>(w1);
        zi[2 * u] = w0 - z0;
        zi[2 * u + 1] = w1 - z1;
      }
    }
    if (c.gL) {  // dlambda_{k,u} = sum_t r_{t,k} d/dtheta_{t,u} (times -1 when inverse)
      double* lt = w.dlt.data();
      gemm<double, VB, RB, CB, true, false>(d.DC, Mp, nt, r, d.DC, dth, Mp, lt, Mp);
      for (int64_t k = 0; k < d.DC; ++k)
        for (int64_t u = 0; u < M; ++u)
          dl[k * M + u] += c.inverse ? -lt[k * Mp + u] : lt[k * Mp + u];
    }
    if (c.gU) {  // d<dy, y>/dU_act = dy (w - z)^T + x (R^T g' - g')^T
      T* C = w.cu.data();
      gemm<T, VB, RB, CB, true, false>(D, Ap, nt, G, D, Wz, Ap, C, Ap);
      gemm<T, VB, RB, CB, true, true>(D, Ap, nt, X, D, Dl, Ap, C, Ap, C, Ap);
      for (int64_t i = 0; i < D; ++i)
        for (int64_t a = 0; a < A; ++a) du[i * A + a] += static_cast<double>(C[i * Ap + a]);
    }
  }
  // dx = dy + U_act Delta, last: dx may be dy
  lift<T, VB, RB, CB>(c, nt, Dl, c.uat.data() + hu * A * Dp, G, c.dx + row, w.ob.data());
}

template <class T>
using ForwardTile = void (*)(const Ctx<T>&, Work<T>&, int64_t, int64_t, int64_t, int64_t);
template <class T>
using BackwardTile = void (*)(const Ctx<T>&, Work<T>&, int64_t, int64_t, int64_t, int64_t, double*,
                              double*);

// One build of the tile functions per instruction set: vector bytes, rows x vectors per block.
#define RELPOS_STRUCTURED_ISA(NAME, TARGET, VB, RB, CB)                                           \
  template <class T>                                                                              \
  TARGET void forward_tile_##NAME(const Ctx<T>& c, Work<T>& w, int64_t b, int64_t h, int64_t t0,  \
                                  int64_t nt) {                                                   \
    forward_tile<T, VB, RB, CB>(c, w, b, h, t0, nt);                                              \
  }                                                                                               \
  template <class T>                                                                              \
  TARGET void backward_tile_##NAME(const Ctx<T>& c, Work<T>& w, int64_t b, int64_t h, int64_t t0, \
                                   int64_t nt, double* du, double* dl) {                          \
    backward_tile<T, VB, RB, CB>(c, w, b, h, t0, nt, du, dl);                                     \
  }
RELPOS_STRUCTURED_ISA(base, , 16, 4, 2)
#if defined(__x86_64__)
RELPOS_STRUCTURED_ISA(avx2, __attribute__((target("avx2,fma"))), 32, 6, 2)
RELPOS_STRUCTURED_ISA(avx512, __attribute__((target("avx512f,avx512vl,avx2,fma"))), 64, 4, 4)
#endif
#undef RELPOS_STRUCTURED_ISA

template <class T>
std::pair<ForwardTile<T>, BackwardTile<T>> tile_functions() {
#if defined(__x86_64__)
  switch (selected_isa()) {
    case Isa::Amx:
    case Isa::Avx512Bf16:
    case Isa::Avx512:
      return {forward_tile_avx512<T>, backward_tile_avx512<T>};
    case Isa::Avx2:
      return {forward_tile_avx2<T>, backward_tile_avx2<T>};
    case Isa::Baseline:
      break;
  }
#endif
  return {forward_tile_base<T>, backward_tile_base<T>};
}

}  // namespace

template <class T>
void structured_forward(const StructuredDims& d, bool inverse, const T* x, const T* U,
                        const T* lambda, const double* positions, T* y) {
  check(d, U, lambda, positions);
  Ctx<T> c;
  c.d = d;
  c.inverse = inverse;
  c.x = x;
  c.pos = positions;
  c.y = y;
  pack(c, U, lambda);
  const auto tile = tile_functions<T>().first;
  const int64_t tiles = (d.T + kTile - 1) / kTile;
#pragma omp parallel if (parallel(d))
  {
    Work<T> w(c);
#pragma omp for collapse(3) schedule(static)
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < d.H; ++h)
        for (int64_t t = 0; t < tiles; ++t)
          tile(c, w, b, h, t * kTile, std::min(kTile, d.T - t * kTile));
  }
}

template <class T>
void structured_backward(const StructuredDims& d, bool inverse, const T* x, const T* U,
                         const T* lambda, const double* positions, const T* dy, T* dx, double* dU,
                         double* dlambda) {
  check(d, U, lambda, positions);
  Ctx<T> c;
  c.d = d;
  c.inverse = inverse;
  c.x = x;
  c.pos = positions;
  c.dy = dy;
  c.dx = dx;
  c.gU = dU != nullptr;
  c.gL = dlambda != nullptr;
  pack(c, U, lambda);
  const auto tile = tile_functions<T>().second;
  const int64_t A = 2 * d.M, n = d.B * d.T;
  const bool gU = c.gU, gL = c.gL;
  const int64_t chunks = std::min<int64_t>(kChunks, std::max<int64_t>(n, 1));
  // per (head, chunk) partial sums in float64: dU_act [D, 2M] and dlambda [dc, M]; a chunk's
  // tiles are fixed by the chunk and run in order, so the sums are the same for any thread count
  const int64_t su = gU ? d.D * A : 0, sl = gL ? d.DC * d.M : 0;
  std::vector<double> pu(static_cast<size_t>(d.H * chunks * su), 0.0);
  std::vector<double> pl(static_cast<size_t>(d.H * chunks * sl), 0.0);
#pragma omp parallel if (parallel(d))
  {
    Work<T> w(c);
#pragma omp for collapse(2) schedule(static)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t ch = 0; ch < chunks; ++ch) {
        double* du = pu.data() + (h * chunks + ch) * su;
        double* dl = pl.data() + (h * chunks + ch) * sl;
        const int64_t hi = (ch + 1) * n / chunks;
        for (int64_t bt = ch * n / chunks; bt < hi;) {
          const int64_t b = bt / d.T, t = bt % d.T;
          const int64_t nt = std::min({kTile, hi - bt, d.T - t});
          tile(c, w, b, h, t, nt, du, dl);
          bt += nt;
        }
      }
  }
  if (gU) {
    const int64_t HU = d.basis_per_head ? d.H : 1;
    std::fill(dU, dU + HU * d.D * d.D, 0.0);
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t c = 0; c < chunks; ++c) {
        const double* p = pu.data() + (h * chunks + c) * su;
        double* o = dU + (d.basis_per_head ? h : 0) * d.D * d.D;
        for (int64_t i = 0; i < d.D; ++i)
          for (int64_t a = 0; a < A; ++a) o[i * d.D + a] += p[i * A + a];
      }
  }
  if (gL) {
    const int64_t HL = d.freqs_per_head ? d.H : 1;
    std::fill(dlambda, dlambda + HL * sl, 0.0);
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t c = 0; c < chunks; ++c) {
        const double* p = pl.data() + (h * chunks + c) * sl;
        double* o = dlambda + (d.freqs_per_head ? h : 0) * sl;
        for (int64_t i = 0; i < sl; ++i) o[i] += p[i];
      }
  }
}

#define RELPOS_STRUCTURED_INSTANTIATE(T)                                                          \
  template void structured_forward<T>(const StructuredDims&, bool, const T*, const T*, const T*,  \
                                      const double*, T*);                                         \
  template void structured_backward<T>(const StructuredDims&, bool, const T*, const T*, const T*, \
                                       const double*, const T*, T*, double*, double*);
RELPOS_STRUCTURED_INSTANTIATE(float)
RELPOS_STRUCTURED_INSTANTIATE(double)
#undef RELPOS_STRUCTURED_INSTANTIATE

}  // namespace relpos::kernels
