// Implementation of the transform kernels, included once per instruction set (transform_isa.inc):
// the same code is compiled for the baseline x86-64 and for AVX2+FMA, and transform.cpp picks the
// best at run time. Internal header: include kernels/transform.hpp instead.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "core/charts.hpp"
#include "kernels/transform.hpp"

namespace relpos::kernels {
namespace RELPOS_ISA_NAMESPACE {

constexpr int kMaxOrder = 8;
constexpr int64_t kTrigAnchor = 32;

template <Layout LY>
struct Addr {
  static int re(int j, int /*D*/) { return LY == Layout::Interleaved ? 2 * j : j; }
  static int im(int j, int D) { return LY == Layout::Interleaved ? 2 * j + 1 : j + D / 2; }
};

int covered_pairs(const TransformPlan& plan) {
  int n = 0;
  for (const auto& s : plan.segments) n = std::max(n, s.first_pair + s.blocks * s.order);
  return n;
}

// Tokens of one (batch, head) processed together: the per-token, per-block scalars (damping,
// coefficient series) are computed for a whole tile in loops of kTile * blocks elements, which
// vectorise well and amortise loop overheads that dominated when done token by token.
constexpr int kTile = 64;
constexpr int kTileRun = 2;  // tiles between exact re-anchorings of the damping recurrence

// Per-thread scratch, structure-of-arrays: series[k][tt][b], per-token scalars [tt][b].
template <class T>
struct Scratch {
  int nb;
  std::vector<T> ek, eq, x, ck, cq, dl, de, dser, part;
  bool tile_clamped = false;  // did the exponent clamp bind anywhere in this tile's segment
  std::vector<double> ekd, eqd, pos, u;
  std::vector<unsigned char> clamped;
  // Damping carried from tile to tile of one (batch, head): e^{+-gamma p} of the last token and
  // the step ratios e^{+-gamma d}, per global block; re-anchored exactly every kTileRun tiles.
  std::vector<double> ek_last, eq_last, rk, rq, rk_d;
  std::vector<int64_t> rk_bh;  // (bh, d) the ratios of each block were computed for
  int64_t last_tile = -2, last_bh = -1, bh = -1;
  double last_p = 0, d = 0, last_d = std::numeric_limits<double>::quiet_NaN();
  int run = 0;
  bool even = false, contiguous = false, force_fresh = true;
  // The order-2 float fast path (m2): per-token u and p, lane-order per-block values and
  // [token][NB + 16] tables; the powers e^{+-gamma d tt} are kept per head (pw_h, pw_d).
  std::vector<float> f_u, f_p, f_eta, f_e0k, f_e0q, f_ones, f_pk, f_pq, f_sk, f_sq, f_gm, f_acc;
  std::vector<double> pw_k, pw_q, pw_d;
  std::vector<int64_t> pw_h;
  explicit Scratch(int blocks)
      : nb(std::max(1, blocks)),
        ek(kTile * nb),
        eq(kTile * nb),
        x(kTile * nb),
        ck(kMaxOrder * kTile * nb),
        cq(kMaxOrder * kTile * nb),
        dl(kTile * nb),
        de(kTile * nb),
        dser(kMaxOrder * kTile * nb),
        part(nb),
        ekd(kTile * nb),
        eqd(kTile * nb),
        pos(kTile),
        u(kTile),
        clamped(kTile * nb),
        ek_last(nb),
        eq_last(nb),
        rk(nb),
        rq(nb),
        rk_d(nb),
        rk_bh(nb, -1),
        f_u(kTile),
        f_p(kTile),
        f_eta(nb + 16),
        f_e0k(nb + 16),
        f_e0q(nb + 16),
        f_ones(kTile * (nb + 16), 1.0f),
        f_pk(kTile * (nb + 16)),
        f_pq(kTile * (nb + 16)),
        f_sk(kTile * (nb + 16)),
        f_sq(kTile * (nb + 16)),
        f_gm(kTile * (nb + 16)),
        f_acc(2 * (nb + 16)),
        pw_k(kTile * (nb + 16)),
        pw_q(kTile * (nb + 16)),
        pw_d(nb, std::numeric_limits<double>::quiet_NaN()),
        pw_h(nb, -1) {}

  // Called once per tile after pos[0..n) is filled: may the damping continue the last tile's?
  void begin_tile(int64_t tile, int64_t tile_bh, int n) {
    bh = tile_bh;
    even = n > 1;
    d = n > 1 ? pos[1] - pos[0] : 0.0;
    for (int tt = 2; tt < n && even; ++tt) even = pos[tt] - pos[tt - 1] == d;
    contiguous = even && bh == last_bh && d == last_d && tile == last_tile + 1 &&
                 pos[0] - last_p == d && run < kTileRun && !force_fresh;
    run = contiguous ? run + 1 : 0;
    force_fresh = false;
    last_tile = tile;
    last_bh = bh;
    last_p = pos[n - 1];
    last_d = even ? d : std::numeric_limits<double>::quiet_NaN();
  }
};

// Scaled coefficient series of every (token, block) of the tile for one segment:
//   ck[k][tt][b] = e^{+gamma p} c_k (keys),  cq[k][tt][b] = e^{-gamma p} ic_k (queries),
// c_k = x^k/k!, ic_k = (-x)^k/k!, x = eta s sigma(-p) (exponential shear), or the jet-gate series
// and its power-series inverse. Damping: exact exp at the tile's first token, then float64
// recurrences e^{gamma (p + d)} = e^{gamma p} e^{gamma d} when positions step evenly; exact
// (clamped) values wherever the exponent clamp binds.
template <class T, int M>
void tile_series(const SegmentDesc& s, const Params<T>& P, int64_t h, int64_t H, int NB, int n,
                 Scratch<T>& sc) {
  const int nb = s.blocks, stride = n * nb;
  const int64_t off = h * NB + s.first_block;
  for (int tt = 0; tt < n; ++tt) sc.u[tt] = s.shear_scale * chart_value(s.chart, -sc.pos[tt], s.L);
  T* ek = sc.ek.data();
  T* eq = sc.eq.data();
  sc.tile_clamped = false;
  if (s.damped) {
    const double X = s.max_exponent;
    const T* g = P.gamma + off;
    double* ekd = sc.ekd.data();
    double* eqd = sc.eqd.data();
    // clamp flags per entry, skipped when a bound shows none can bind in this tile
    double gmax = 0, pmax = 0;
    for (int b = 0; b < nb; ++b) gmax = std::max(gmax, std::abs(static_cast<double>(g[b])));
    for (int tt = 0; tt < n; ++tt) pmax = std::max(pmax, std::abs(sc.pos[tt]));
    bool any_clamped = false;
    if (gmax * pmax * (1 + 1e-12) <= X) {
      std::fill(sc.clamped.begin(), sc.clamped.begin() + stride, static_cast<unsigned char>(0));
    } else {
      for (int tt = 0; tt < n; ++tt)
        for (int b = 0; b < nb; ++b) {
          const bool cl = std::abs(static_cast<double>(g[b]) * sc.pos[tt]) > X;
          sc.clamped[tt * nb + b] = cl;
          any_clamped |= cl;
        }
    }
    if (sc.even && !any_clamped) {
      double* rk = sc.rk.data() + s.first_block;
      double* rq = sc.rq.data() + s.first_block;
      double* ekl = sc.ek_last.data() + s.first_block;
      double* eql = sc.eq_last.data() + s.first_block;
      if (sc.rk_bh[s.first_block] != sc.bh || sc.rk_d[s.first_block] != sc.d) {
        for (int b = 0; b < nb; ++b) {
          rk[b] = std::exp(static_cast<double>(g[b]) * sc.d);
          rq[b] = 1.0 / rk[b];
        }
        sc.rk_bh[s.first_block] = sc.bh;
        sc.rk_d[s.first_block] = sc.d;
      }
      if (sc.contiguous) {
        for (int b = 0; b < nb; ++b) {
          ekd[b] = ekl[b] * rk[b];
          eqd[b] = eql[b] * rq[b];
        }
      } else {
        for (int b = 0; b < nb; ++b) {
          const double gb = static_cast<double>(g[b]);
          ekd[b] = std::exp(gb * sc.pos[0]);
          eqd[b] = std::exp(-gb * sc.pos[0]);
        }
      }
      for (int tt = 1; tt < n; ++tt)
        for (int b = 0; b < nb; ++b) {
          ekd[tt * nb + b] = ekd[(tt - 1) * nb + b] * rk[b];
          eqd[tt * nb + b] = eqd[(tt - 1) * nb + b] * rq[b];
        }
      std::copy(ekd + (n - 1) * nb, ekd + n * nb, ekl);
      std::copy(eqd + (n - 1) * nb, eqd + n * nb, eql);
    } else {  // irregular positions or a binding clamp: exact (clamped) values everywhere
      sc.force_fresh = true;
      sc.tile_clamped = any_clamped;
      for (int tt = 0; tt < n; ++tt)
        for (int b = 0; b < nb; ++b) {
          const double a = static_cast<double>(g[b]) * sc.pos[tt];
          ekd[tt * nb + b] = std::exp(std::min(std::max(a, -X), X));
          eqd[tt * nb + b] = std::exp(std::min(std::max(-a, -X), X));
        }
    }
    for (int i = 0; i < stride; ++i) {
      ek[i] = static_cast<T>(ekd[i]);
      eq[i] = static_cast<T>(eqd[i]);
    }
  } else {
    std::fill(ek, ek + stride, T(1));
    std::fill(eq, eq + stride, T(1));
  }
  T* ck = sc.ck.data();
  T* cq = sc.cq.data();
  std::copy(ek, ek + stride, ck);
  std::copy(eq, eq + stride, cq);
  if (M == 1) return;
  if (s.shear == ShearMode::Gates) {
    for (int tt = 0; tt < n; ++tt)
      for (int b = 0; b < nb; ++b) {
        double gates[kMaxOrder], c[kMaxOrder], ic[kMaxOrder];
        for (int k = 1; k < M; ++k)
          gates[k - 1] = static_cast<double>(P.gates[(k - 1) * H * NB + off + b]);
        shear_coefficients(ShearMode::Gates, M, 0.0, gates, 1,
                           static_cast<double>(P.alpha0[off + b]), sc.u[tt], c);
        inverse_series(M, c, ic);
        const int i = tt * nb + b;
        for (int k = 0; k < M; ++k) {
          ck[k * stride + i] = static_cast<T>(c[k]) * ek[i];
          cq[k * stride + i] = static_cast<T>(ic[k]) * eq[i];
        }
      }
    return;
  }
  T* x = sc.x.data();
  if (s.shear == ShearMode::Exponential) {
    const T* e = P.eta + off;
    for (int tt = 0; tt < n; ++tt) {
      const T ut = static_cast<T>(sc.u[tt]);
      for (int b = 0; b < nb; ++b) x[tt * nb + b] = e[b] * ut;
    }
  } else {
    std::fill(x, x + stride, T(0));
  }
  for (int k = 1; k < M; ++k) {
    const T inv = T(1) / static_cast<T>(k);
    T* cur = ck + k * stride;
    const T* prev = ck + (k - 1) * stride;
    T* curq = cq + k * stride;
    const T* prevq = cq + (k - 1) * stride;
    for (int i = 0; i < stride; ++i) {
      cur[i] = prev[i] * x[i] * inv;
      curq[i] = -prevq[i] * x[i] * inv;
    }
  }
}

// Forward of one segment on one token row for q and k, with the tile's series at token tt.
// key:   y_r = e_k sum_{c>=r} c_{c-r}  R z_c      query: y_r = e_q sum_{c<=r} ic_{r-c} R z_c
template <class T, int M, Layout LY>
void forward_segment(const SegmentDesc& s, int D, const T* cosr, const T* sinr, const T* ck,
                     const T* cq, int stride, const T* q, const T* k, T* qo, T* ko) {
  using A = Addr<LY>;
  const T* cs = cosr + s.first_block;
  const T* sn = sinr + s.first_block;
  const int nb = s.blocks;
  for (int io = 0; io < 2; ++io) {
    const bool key = io == 1;
    const T* x = key ? k : q;
    T* y = key ? ko : qo;
    if (!x) continue;
    if (M == 1 && !ck) {  // plain rotation: the RoPE hot loop (in place is fine: no overlap)
#pragma GCC ivdep
      for (int b = 0; b < nb; ++b) {
        const int j = s.first_pair + b;
        const T xr = x[A::re(j, D)], xi = x[A::im(j, D)];
        y[A::re(j, D)] = xr * cs[b] - xi * sn[b];
        y[A::im(j, D)] = xr * sn[b] + xi * cs[b];
      }
      continue;
    }
    const T* coef = key ? ck : cq;
    // one fused pass per block: load the m slots, rotate, mix with the token's series, store.
    // The slot loops are unrolled by hand (pragma) so that the block loop vectorises.
    const auto block_loop = [&]<bool KEY>() {
#pragma GCC ivdep
      for (int b = 0; b < nb; ++b) {
        const int j0 = s.first_pair + b * M;
        T zr[M], zi[M];
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          const T xr = x[A::re(j0 + r, D)], xi = x[A::im(j0 + r, D)];
          zr[r] = xr * cs[b] - xi * sn[b];
          zi[r] = xr * sn[b] + xi * cs[b];
        }
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) {
          T ar = 0, ai = 0;
#pragma GCC unroll 8
          for (int c = 0; c < M; ++c) {
            if (KEY ? c < r : c > r) continue;
            const T w = coef[(KEY ? c - r : r - c) * stride + b];
            ar += w * zr[c];
            ai += w * zi[c];
          }
          y[A::re(j0 + r, D)] = ar;
          y[A::im(j0 + r, D)] = ai;
        }
      }
    };
    if (key) {
      block_loop.template operator()<true>();
    } else {
      block_loop.template operator()<false>();
    }
  }
}

// Index of the parameter-gradient accumulators: [gamma | eta | alpha0 | gates rows] x (H*NB).
struct GradSlots {
  size_t hb;
  size_t gamma(size_t i) const { return i; }
  size_t eta(size_t i) const { return hb + i; }
  size_t alpha0(size_t i) const { return 2 * hb + i; }
  size_t gate(int k, size_t i) const { return (3 + k - 1) * hb + i; }
};

// Backward of one segment on one token row: input gradients by the transposed maps and, when
// xin is given, dser'_k = sum_r <w_r, x_{r+k}> (key) or <w_r, x_{r-k}> (query) with w = R^T gy,
// reduced with the scaled series coef = e * series into dl = sum_k coef_k dser'_k
// (dL/dexponent) and de = sum_{k>=1} coef_{k-1} dser'_k (dL/deta up to +-u).
template <class T, int M, Layout LY>
void backward_segment(const SegmentDesc& s, int D, const T* cosr, const T* sinr, const T* coef,
                      int stride, bool key, const T* x, const T* g, T* o, T* dl, T* de, T* dser) {
  using A = Addr<LY>;
  const T* cs = cosr + s.first_block;
  const T* sn = sinr + s.first_block;
  const int nb = s.blocks;
  if (M == 1 && !coef) {  // transpose of a rotation
    if (!o) return;
#pragma GCC ivdep
    for (int b = 0; b < nb; ++b) {
      const int j = s.first_pair + b;
      const T gr = g[A::re(j, D)], gi = g[A::im(j, D)];
      o[A::re(j, D)] = gr * cs[b] + gi * sn[b];
      o[A::im(j, D)] = -gr * sn[b] + gi * cs[b];
    }
    return;
  }
#pragma GCC ivdep
  for (int b = 0; b < nb; ++b) {
    const int j0 = s.first_pair + b * M;
    T wr[M], wi[M];
    for (int r = 0; r < M; ++r) {
      const T gr = g[A::re(j0 + r, D)], gi = g[A::im(j0 + r, D)];
      wr[r] = gr * cs[b] + gi * sn[b];
      wi[r] = -gr * sn[b] + gi * cs[b];
    }
    if (o) {
      for (int c = 0; c < M; ++c) {
        T ar = 0, ai = 0;
        if (key) {
          for (int r = 0; r <= c; ++r)
            ar += coef[(c - r) * stride + b] * wr[r], ai += coef[(c - r) * stride + b] * wi[r];
        } else {
          for (int r = c; r < M; ++r)
            ar += coef[(r - c) * stride + b] * wr[r], ai += coef[(r - c) * stride + b] * wi[r];
        }
        o[A::re(j0 + c, D)] = ar;
        o[A::im(j0 + c, D)] = ai;
      }
    }
    if (x) {
      T xr[M], xi[M];
      for (int c = 0; c < M; ++c) xr[c] = x[A::re(j0 + c, D)], xi[c] = x[A::im(j0 + c, D)];
      T dlb = 0, deb = 0;
      for (int kk = 0; kk < M; ++kk) {
        T d = 0;
        for (int r = 0; r < M; ++r) {
          const int c = key ? r + kk : r - kk;
          if (c >= 0 && c < M) d += wr[r] * xr[c] + wi[r] * xi[c];
        }
        dser[kk * stride + b] = d;
        dlb += coef[kk * stride + b] * d;
        if (kk >= 1) deb += coef[(kk - 1) * stride + b] * d;
      }
      dl[b] = dlb;
      de[b] = deb;
    }
  }
}

// Parameter gradients of one segment from a tile's dl/de/dser, accumulated in float64.
template <class T, int M>
void accumulate_param_grads(const SegmentDesc& s, int64_t h, int NB, int n, bool key,
                            Scratch<T>& sc, double* acc, const GradSlots& slot) {
  const int nb = s.blocks, stride = n * nb;
  const size_t off = static_cast<size_t>(h) * NB + s.first_block;
  // partial sums over the tile's tokens in T (at most kTile terms), then into float64
  if (s.damped) {  // d exponent / d gamma = +-p; no gradient through a binding clamp
    T* tmp = sc.part.data();
    for (int tt = 0; tt < n; ++tt) {
      const T sp = static_cast<T>(key ? sc.pos[tt] : -sc.pos[tt]);
      const T* dlt = sc.dl.data() + tt * nb;
      const unsigned char* cl = sc.clamped.data() + tt * nb;
      if (tt == 0) {
        for (int b = 0; b < nb; ++b) tmp[b] = cl[b] ? T(0) : sp * dlt[b];
      } else {
        for (int b = 0; b < nb; ++b) tmp[b] += cl[b] ? T(0) : sp * dlt[b];
      }
    }
    double* ag = acc + slot.gamma(off);
    for (int b = 0; b < nb; ++b) ag[b] += static_cast<double>(tmp[b]);
  }
  if (M == 1) return;
  if (s.shear == ShearMode::Exponential) {
    T* tmp = sc.part.data();
    for (int tt = 0; tt < n; ++tt) {
      const T su = static_cast<T>(key ? sc.u[tt] : -sc.u[tt]);
      const T* det = sc.de.data() + tt * nb;
      if (tt == 0) {
        for (int b = 0; b < nb; ++b) tmp[b] = su * det[b];
      } else {
        for (int b = 0; b < nb; ++b) tmp[b] += su * det[b];
      }
    }
    double* ae = acc + slot.eta(off);
    for (int b = 0; b < nb; ++b) ae[b] += static_cast<double>(tmp[b]);
  } else if (s.shear == ShearMode::Gates) {
    // dL/dc via the unscaled series (d ic = -P^2 d c for queries); c_0 = alpha_0, c_k = g_k u^k/k!
    const T* coef = key ? sc.ck.data() : sc.cq.data();
    for (int tt = 0; tt < n; ++tt)
      for (int b = 0; b < nb; ++b) {
        const int i = tt * nb + b;
        const double e = static_cast<double>(key ? sc.ek[i] : sc.eq[i]);
        double dser2[kMaxOrder], ser[kMaxOrder], dc[kMaxOrder];
        for (int kk = 0; kk < M; ++kk) {
          dser2[kk] = static_cast<double>(sc.dser[kk * stride + i]) * e;
          ser[kk] = static_cast<double>(coef[kk * stride + i]) / e;
        }
        if (key) {
          for (int kk = 0; kk < M; ++kk) dc[kk] = dser2[kk];
        } else {
          double p2[kMaxOrder];
          for (int kk = 0; kk < M; ++kk) {
            p2[kk] = 0;
            for (int j = 0; j <= kk; ++j) p2[kk] += ser[j] * ser[kk - j];
          }
          for (int j = 0; j < M; ++j) {
            dc[j] = 0;
            for (int kk = j; kk < M; ++kk) dc[j] -= dser2[kk] * p2[kk - j];
          }
        }
        acc[slot.alpha0(off + b)] += dc[0];
        double pw = 1;
        for (int kk = 1; kk < M; ++kk) {
          pw *= sc.u[tt] / kk;
          acc[slot.gate(kk, off + b)] += dc[kk] * pw;
        }
      }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Asks for every cache line of the rows kAhead tokens ahead in the given tensors: on the
// development VM the hardware prefetchers alone leave the kernels far from memory speed (Jordan
// m = 2 forward at T = 8192: 1.55 -> 1.13 ms; every line has to be asked for, every second one
// is not enough). Addresses are formed as integers: the last rows reach past a tensor.
class RowPrefetcher {
 public:
  static constexpr int kAhead = 8;
  // rows of D floats; rows_after: rows from the first one to the end of the tensors
  RowPrefetcher(int64_t D, int64_t rows_after, std::initializer_list<const float*> reads,
                std::initializer_list<float*> writes)
      : bytes_(D * static_cast<int64_t>(sizeof(float))), rows_(rows_after) {
    for (const float* x : reads)
      if (x) base_[n_++] = reinterpret_cast<uintptr_t>(x);
    for (float* y : writes)
      if (y) base_[n_++] = reinterpret_cast<uintptr_t>(y);
  }
  void row(int tt) const {
    if (tt + kAhead >= rows_) return;
    const uintptr_t off = static_cast<uintptr_t>((tt + kAhead) * bytes_);
    for (int i = 0; i < n_; ++i)
      for (int64_t b = 0; b < bytes_; b += 64) line(base_[i] + off + static_cast<uintptr_t>(b));
  }

 private:
  // volatile asm: GCC deletes loops whose only effect is __builtin_prefetch
  static void line(uintptr_t address) { asm volatile("prefetcht0 (%0)" : : "r"(address)); }

  uintptr_t base_[6] = {};
  int n_ = 0;
  int64_t bytes_, rows_;
};

// ---------------------------------------------------------------------------------------------
// Hand-vectorised float paths of the interleaved layout, written once against a vector-traits
// class (Avx2Ops: 8 lanes, Avx512Ops: 16 lanes) and compiled in the ISA build that has it.
//
// Order-2 blocks (Jordan-RoPE m = 2): a group of G blocks is four registers of
// (re0, im0, re1, im1) per block; in-lane 4x4 transposes turn them into re0, im0, re1, im1
// vectors whose elements are the blocks in "lane order" (AVX2: [0, 2, 4, 6 | 1, 3, 5, 7]). Every
// per-block scalar (cos, sin, damping, eta) is then one plain vector load, the arithmetic needs
// no shuffles, and the parameter gradients accumulate per block without horizontal sums. The
// transposes cost two shuffles per register each way.
//
// Plain rotations (RoPE): two shuffles split two registers into real and imaginary parts whose
// pairs are in "pair order" (AVX2: [0, 1, 4, 5 | 2, 3, 6, 7]), cos and sin are one permuted
// load shared by q and k, and two unpacks interleave the result again.

struct Avx2Ops {
  using R = __m256;
  static constexpr int W =
      8;  // floats per register = blocks per order-2 group = pairs per rotation step
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R zero() { return _mm256_setzero_ps(); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }    // a b + c
  static R fmsub(R a, R b, R c) { return _mm256_fmsub_ps(a, b, c); }    // a b - c
  static R fnmadd(R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  // masks of a partial group of r blocks: per data register j, and for W per-block values
  struct Mask {
    __m256i vec[4], blocks;
  };
  static Mask mask(int r) {
    Mask m;
    const __m256i rv = _mm256_set1_epi32(r);
    m.blocks = _mm256_cmpgt_epi32(rv, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int j = 0; j < 4; ++j) {  // register j holds blocks 2j (lanes 0-3) and 2j + 1
      const int a = 2 * j, b = 2 * j + 1;
      m.vec[j] = _mm256_cmpgt_epi32(rv, _mm256_setr_epi32(a, a, a, a, b, b, b, b));
    }
    return m;
  }
  static R load_masked(const float* p, __m256i m) { return _mm256_maskload_ps(p, m); }
  static void store_masked(float* p, __m256i m, R v) { _mm256_maskstore_ps(p, m, v); }
  static R to_lane_order(R v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
  }
  static R to_block_order(R v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  static int lane_slot(int b) {
    constexpr int slot[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    return (b & ~7) | slot[b & 7];
  }
  static R to_pair_order(R v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  }
  // the in-lane shuffles below are the same instructions at both widths
  static R unpacklo(R a, R b) { return _mm256_unpacklo_ps(a, b); }
  static R unpackhi(R a, R b) { return _mm256_unpackhi_ps(a, b); }
  template <int IMM>
  static R shuffle(R a, R b) {
    return _mm256_shuffle_ps(a, b, IMM);
  }
};

#if defined(__AVX512F__)
struct Avx512Ops {
  using R = __m512;
  static constexpr int W = 16;
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R zero() { return _mm512_setzero_ps(); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R fmsub(R a, R b, R c) { return _mm512_fmsub_ps(a, b, c); }
  static R fnmadd(R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); }
  struct Mask {
    __mmask16 vec[4], blocks;
  };
  static Mask mask(int r) {
    Mask m;
    m.blocks = static_cast<__mmask16>((1u << r) - 1);
    for (int j = 0; j < 4; ++j) {  // register j holds blocks 4j .. 4j + 3, one per 128-bit lane
      unsigned bits = 0;
      for (int l = 0; l < 4; ++l)
        if (4 * j + l < r) bits |= 0xFu << (4 * l);
      m.vec[j] = static_cast<__mmask16>(bits);
    }
    return m;
  }
  static R load_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store_masked(float* p, __mmask16 m, R v) { _mm512_mask_storeu_ps(p, m, v); }
  // lane l of a transposed register holds blocks l, l + 4, l + 8, l + 12: a 4x4 transpose of
  // the block index, its own inverse
  static R to_lane_order(R v) {
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
  }
  static R to_block_order(R v) { return to_lane_order(v); }
  static int lane_slot(int b) { return (b & ~15) | ((b & 3) * 4 + ((b & 15) >> 2)); }
  static R to_pair_order(R v) {
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15), v);
  }
  static R unpacklo(R a, R b) { return _mm512_unpacklo_ps(a, b); }
  static R unpackhi(R a, R b) { return _mm512_unpackhi_ps(a, b); }
  template <int IMM>
  static R shuffle(R a, R b) {
    return _mm512_shuffle_ps(a, b, IMM);
  }
};
using SimdOps = Avx512Ops;
#else
using SimdOps = Avx2Ops;
#endif

namespace rot {

// INVERSE: the transposed rotation (backward). W pairs from x to y.
template <class V, bool INVERSE>
inline void rotate_pairs(const float* x, float* y, typename V::R c, typename V::R s) {
  const auto x0 = V::load(x), x1 = V::load(x + V::W);
  const auto re = V::template shuffle<0x88>(x0, x1), im = V::template shuffle<0xDD>(x0, x1);
  const auto yr = INVERSE ? V::fmadd(c, re, s * im) : V::fmsub(c, re, s * im);
  const auto yi = INVERSE ? V::fnmadd(s, re, c * im) : V::fmadd(s, re, c * im);
  V::store(y, V::unpacklo(yr, yi));
  V::store(y + V::W, V::unpackhi(yr, yi));
}

// Rows tt < n of a tile: a -> ya and b -> yb (either may be null), `pairs` pairs from the row
// start; cos/sin: the tile's first trig row at the segment's first block, rows trig_ld apart.
template <bool INVERSE, class V = SimdOps>
void rotate_tile(int n, int pairs, const float* cos, const float* sin, int64_t trig_ld, int64_t D,
                 int64_t rows_after, const float* a, const float* b, float* ya, float* yb) {
  const RowPrefetcher ahead(D, rows_after, {a, b}, {ya, yb});
  const int full = pairs / V::W * V::W;
  for (int tt = 0; tt < n; ++tt) {
    ahead.row(tt);
    const float* cr = cos + tt * trig_ld;
    const float* sr = sin + tt * trig_ld;
    const int64_t o = tt * D;
    for (int j = 0; j < full; j += V::W) {
      const auto c = V::to_pair_order(V::load(cr + j)), s = V::to_pair_order(V::load(sr + j));
      if (a) rotate_pairs<V, INVERSE>(a + o + 2 * j, ya + o + 2 * j, c, s);
      if (b) rotate_pairs<V, INVERSE>(b + o + 2 * j, yb + o + 2 * j, c, s);
    }
    for (int j = full; j < pairs; ++j)
      for (int io = 0; io < 2; ++io) {
        const float* x = io ? b : a;
        float* y = io ? yb : ya;
        if (!x) continue;
        const float xr = x[o + 2 * j], xi = x[o + 2 * j + 1], c = cr[j],
                    s = INVERSE ? -sr[j] : sr[j];
        y[o + 2 * j] = xr * c - xi * s;
        y[o + 2 * j + 1] = xr * s + xi * c;
      }
  }
}

}  // namespace rot

namespace m2 {

constexpr int kPad = 16;  // rows of lane-order tables are padded: a partial group reads W floats

template <class V>
struct Group {
  typename V::R r0, i0, r1, i1;  // slot 0 and slot 1 of a group's blocks, lane order
};

// Loads and stores of one group of V::W blocks; a partial group (r < W blocks) is masked.
template <class V, bool FULL>
struct GroupIO {
  using R = typename V::R;
  typename V::Mask m;
  explicit GroupIO(int r) {
    if constexpr (!FULL)
      m = V::mask(r);
    else
      (void)r;
  }
  R load(const float* p, int j) const {
    if constexpr (FULL)
      return V::load(p + V::W * j);
    else
      return V::load_masked(p + V::W * j, m.vec[j]);
  }
  void store(float* p, int j, R v) const {
    if constexpr (FULL)
      V::store(p + V::W * j, v);
    else
      V::store_masked(p + V::W * j, m.vec[j], v);
  }
  // W per-block values stored in block order, returned in lane order
  R blocks(const float* p) const {
    if constexpr (FULL)
      return V::to_lane_order(V::load(p));
    else
      return V::to_lane_order(V::load_masked(p, m.blocks));
  }
  Group<V> load_group(const float* x) const {
    const R x0 = load(x, 0), x1 = load(x, 1), x2 = load(x, 2), x3 = load(x, 3);
    const R t0 = V::unpacklo(x0, x1), t1 = V::unpackhi(x0, x1);
    const R t2 = V::unpacklo(x2, x3), t3 = V::unpackhi(x2, x3);
    return {V::template shuffle<0x44>(t0, t2), V::template shuffle<0xEE>(t0, t2),
            V::template shuffle<0x44>(t1, t3), V::template shuffle<0xEE>(t1, t3)};
  }
  void store_group(float* y, const Group<V>& v) const {
    const R u0 = V::unpacklo(v.r0, v.i0), u1 = V::unpackhi(v.r0, v.i0);
    const R u2 = V::unpacklo(v.r1, v.i1), u3 = V::unpackhi(v.r1, v.i1);
    store(y, 0, V::template shuffle<0x44>(u0, u2));
    store(y, 1, V::template shuffle<0xEE>(u0, u2));
    store(y, 2, V::template shuffle<0x44>(u1, u3));
    store(y, 3, V::template shuffle<0xEE>(u1, u3));
  }
};

// z = R x (forward maps) and w = R^T g (their transposes), R = rotation by the table's angle.
template <class V>
inline Group<V> rotate(const Group<V>& x, typename V::R c, typename V::R s) {
  return {V::fmsub(c, x.r0, s * x.i0), V::fmadd(s, x.r0, c * x.i0), V::fmsub(c, x.r1, s * x.i1),
          V::fmadd(s, x.r1, c * x.i1)};
}
template <class V>
inline Group<V> rotate_back(const Group<V>& g, typename V::R c, typename V::R s) {
  return {V::fmadd(c, g.r0, s * g.i0), V::fmsub(c, g.i0, s * g.r0), V::fmadd(c, g.r1, s * g.i1),
          V::fmsub(c, g.i1, s * g.r1)};
}
// <a, b> of one complex slot per block
template <class V>
inline typename V::R dot(typename V::R ar, typename V::R ai, typename V::R br, typename V::R bi) {
  return V::fmadd(ar, br, ai * bi);
}

// One tile of one segment, prepared once per tile (lane order within each group of W blocks).
// Key map: y0 = e0 R x0 + e1 R x1, y1 = e0 R x1; query map: y0 = f0 R x0, y1 = f0 R x1 - f1 R x0,
// with e0 = e^{+gamma p}, f0 = e^{-gamma p}, e1 = e0 eta u, f1 = f0 eta u (Jordan-RoPE Prop. 1).
struct Tile {
  int n = 0, ld = 0;             // tokens; row length of the per-token tables
  const float *e0k, *e0q, *eta;  // per block: damping at the first token (or 1), eta (or 0)
  const float *pk, *pq;          // [tt][ld]: damping of token tt relative to e0k / e0q
  const float* gmask = nullptr;  // [tt][ld]: 0 where the exponent clamp binds, or null
  const float *u, *p;            // per token: shear time u and position p - c0
  const float *cos, *sin;        // trig rows of the first token at the segment's blocks
  int64_t trig_ld = 0, D = 0;    // row strides of the trig table and of the tensors
  int64_t rows_after = 0;        // rows from the tile's first to the end of the tensors
};

// Token tt of group g (r blocks).
template <class V, bool FULL>
inline void forward_group(const Tile& t, int tt, int g, int r, const float* q, const float* k,
                          float* qo, float* ko) {
  using R = typename V::R;
  const GroupIO<V, FULL> io(r);
  const int lb = V::W * g;
  const R c = io.blocks(t.cos + tt * t.trig_ld + lb), s = io.blocks(t.sin + tt * t.trig_ld + lb);
  const R sh = V::load(t.eta + lb) * V::set1(t.u[tt]);
  const int64_t o = tt * t.D + 4 * V::W * g;
  if (k) {
    const R e0 = V::load(t.e0k + lb) * V::load(t.pk + tt * t.ld + lb), e1 = e0 * sh;
    const Group<V> z = rotate<V>(io.load_group(k + o), c, s);
    io.store_group(ko + o, {V::fmadd(e1, z.r1, e0 * z.r0), V::fmadd(e1, z.i1, e0 * z.i0), e0 * z.r1,
                            e0 * z.i1});
  }
  if (q) {
    const R f0 = V::load(t.e0q + lb) * V::load(t.pq + tt * t.ld + lb), f1 = f0 * sh;
    const Group<V> z = rotate<V>(io.load_group(q + o), c, s);
    io.store_group(qo + o, {f0 * z.r0, f0 * z.i0, V::fnmadd(f1, z.r0, f0 * z.r1),
                            V::fnmadd(f1, z.i0, f0 * z.i1)});
  }
}

// Transposed maps for the input gradients and, when acc is given, the parameter gradients:
// acc_gamma += p (dl_k - dl_q), acc_eta += u (de_k - de_q) per block (lane order), with dl =
// dL/d(exponent) and de = dL/d(eta u) of each map.
template <class V, bool FULL>
inline void backward_group(const Tile& t, int tt, int g, int r, const float* q, const float* k,
                           const float* gqo, const float* gko, float* gq, float* gk, float* acc) {
  using R = typename V::R;
  const GroupIO<V, FULL> io(r);
  const int lb = V::W * g;
  const R c = io.blocks(t.cos + tt * t.trig_ld + lb), s = io.blocks(t.sin + tt * t.trig_ld + lb);
  const R sh = V::load(t.eta + lb) * V::set1(t.u[tt]);
  const int64_t o = tt * t.D + 4 * V::W * g;
  R dl = V::zero(), de = V::zero();
  if (gko) {
    const R e0 = V::load(t.e0k + lb) * V::load(t.pk + tt * t.ld + lb), e1 = e0 * sh;
    const Group<V> w = rotate_back<V>(io.load_group(gko + o), c, s);
    if (gk)
      io.store_group(gk + o, {e0 * w.r0, e0 * w.i0, V::fmadd(e1, w.r0, e0 * w.r1),
                              V::fmadd(e1, w.i0, e0 * w.i1)});
    if (k && acc) {
      const Group<V> x = io.load_group(k + o);
      const R d1 = dot<V>(w.r0, w.i0, x.r1, x.i1);
      const R d0 = dot<V>(w.r0, w.i0, x.r0, x.i0) + dot<V>(w.r1, w.i1, x.r1, x.i1);
      dl = V::fmadd(e1, d1, e0 * d0);
      de = e0 * d1;
    }
  }
  if (gqo) {
    const R f0 = V::load(t.e0q + lb) * V::load(t.pq + tt * t.ld + lb), f1 = f0 * sh;
    const Group<V> w = rotate_back<V>(io.load_group(gqo + o), c, s);
    if (gq)
      io.store_group(gq + o, {V::fnmadd(f1, w.r1, f0 * w.r0), V::fnmadd(f1, w.i1, f0 * w.i0),
                              f0 * w.r1, f0 * w.i1});
    if (q && acc) {
      const Group<V> x = io.load_group(q + o);
      const R d1 = dot<V>(w.r1, w.i1, x.r0, x.i0);
      const R d0 = dot<V>(w.r0, w.i0, x.r0, x.i0) + dot<V>(w.r1, w.i1, x.r1, x.i1);
      dl = dl - V::fnmadd(f1, d1, f0 * d0);
      de = V::fnmadd(f0, d1, de);
    }
  }
  if (!acc) return;
  R pv = V::set1(t.p[tt]);
  if (t.gmask) pv = pv * V::load(t.gmask + tt * t.ld + lb);
  float* ag = acc + 2 * lb;
  V::store(ag, V::fmadd(pv, dl, V::load(ag)));
  V::store(ag + V::W, V::fmadd(V::set1(t.u[tt]), de, V::load(ag + V::W)));
}

// Fills `t` for one segment of the current tile, or returns false for the general path (jet
// gates). Damping: float64 anchors and per-head power tables at evenly spaced positions where no
// clamp can bind; otherwise the exact (clamped) per-token values of tile_series.
template <class T, class V = SimdOps>
bool prepare(const SegmentDesc& s, const Params<T>& P, int64_t h, int64_t H, int NB, int n,
             Scratch<T>& sc, Tile* t) {
  if (s.shear == ShearMode::Gates) return false;
  const int nb = s.blocks, fb = s.first_block, ld = NB + kPad;
  const int64_t off = h * NB + fb;
  {  // per token: shear time and position (locals: the loops then vectorise)
    const double* pos = sc.pos.data();
    double* u = sc.u.data();
    float* fu = sc.f_u.data();
    float* fp = sc.f_p.data();
    if (s.chart == Chart::Raw) {
      for (int tt = 0; tt < n; ++tt) u[tt] = s.shear_scale * -pos[tt];
    } else {
      for (int tt = 0; tt < n; ++tt) u[tt] = s.shear_scale * chart_value(s.chart, -pos[tt], s.L);
    }
    for (int tt = 0; tt < n; ++tt)
      fu[tt] = static_cast<float>(u[tt]), fp[tt] = static_cast<float>(pos[tt]);
  }
  const int padded = (nb + V::W - 1) / V::W * V::W;
  float* eta = sc.f_eta.data() + fb;
  std::fill(eta, eta + padded, 0.0f);
  if (s.shear == ShearMode::Exponential)
    for (int b = 0; b < nb; ++b) eta[V::lane_slot(b)] = static_cast<float>(P.eta[off + b]);
  *t = Tile{};
  t->n = n;
  t->ld = ld;
  t->eta = eta;
  t->u = sc.f_u.data();
  t->p = sc.f_p.data();
  t->e0k = t->e0q = sc.f_ones.data();
  t->pk = t->pq = sc.f_ones.data();
  if (!s.damped) return true;
  const T* g = P.gamma + off;
  double gmax = 0, pmax = 0;
  for (int b = 0; b < nb; ++b) gmax = std::max(gmax, std::abs(static_cast<double>(g[b])));
  if (sc.even) {  // evenly spaced: the extremes are the ends
    pmax = std::max(std::abs(sc.pos[0]), std::abs(sc.pos[n - 1]));
  } else {
    for (int tt = 0; tt < n; ++tt) pmax = std::max(pmax, std::abs(sc.pos[tt]));
  }
  if (sc.even && gmax * pmax * (1 + 1e-12) <= s.max_exponent) {
    double* pk = sc.pw_k.data();
    double* pq = sc.pw_q.data();
    if (sc.pw_h[fb] != h || sc.pw_d[fb] != sc.d) {  // e^{+-gamma d tt}, once per head
      for (int b = 0; b < nb; ++b) {
        const double gb = static_cast<double>(g[b]), rk = std::exp(gb * sc.d),
                     rq = std::exp(-gb * sc.d);
        double ak = 1, aq = 1;
        for (int tt = 0; tt < kTile; ++tt, ak *= rk, aq *= rq) {
          pk[tt * ld + fb + b] = ak;
          pq[tt * ld + fb + b] = aq;
          sc.f_pk[tt * ld + fb + V::lane_slot(b)] = static_cast<float>(ak);
          sc.f_pq[tt * ld + fb + V::lane_slot(b)] = static_cast<float>(aq);
        }
      }
      sc.pw_h[fb] = h;
      sc.pw_d[fb] = sc.d;
    }
    float* e0k = sc.f_e0k.data() + fb;
    float* e0q = sc.f_e0q.data() + fb;
    std::fill(e0k, e0k + padded, 0.0f);
    std::fill(e0q, e0q + padded, 0.0f);
    for (int b = 0; b < nb; ++b) {
      const double gb = static_cast<double>(g[b]);
      double& kl = sc.ek_last[fb + b];
      double& ql = sc.eq_last[fb + b];
      const double ak = sc.contiguous ? kl * pk[ld + fb + b] : std::exp(gb * sc.pos[0]);
      const double aq = sc.contiguous ? ql * pq[ld + fb + b] : std::exp(-gb * sc.pos[0]);
      kl = ak * pk[(n - 1) * ld + fb + b];  // carried to the next tile
      ql = aq * pq[(n - 1) * ld + fb + b];
      e0k[V::lane_slot(b)] = static_cast<float>(ak);
      e0q[V::lane_slot(b)] = static_cast<float>(aq);
    }
    t->e0k = e0k;
    t->e0q = e0q;
    t->pk = sc.f_pk.data() + fb;
    t->pq = sc.f_pq.data() + fb;
    return true;
  }
  // irregular positions or a clamp that may bind: exact per-token values, in lane order
  tile_series<T, 2>(s, P, h, H, NB, n, sc);
  for (int tt = 0; tt < n; ++tt)
    for (int b = 0; b < nb; ++b) {
      const int i = tt * ld + fb + V::lane_slot(b);
      sc.f_sk[i] = static_cast<float>(sc.ek[tt * nb + b]);
      sc.f_sq[i] = static_cast<float>(sc.eq[tt * nb + b]);
      sc.f_gm[i] = sc.clamped[tt * nb + b] ? 0.0f : 1.0f;
    }
  t->pk = sc.f_sk.data() + fb;
  t->pq = sc.f_sq.data() + fb;
  if (sc.tile_clamped) t->gmask = sc.f_gm.data() + fb;
  return true;
}

// Forward / backward of one prepared tile: token by token (the order of memory), every group of
// the segment per token.
template <class V = SimdOps>
void forward_tile(const Tile& t, int nb, const float* q, const float* k, float* qo, float* ko) {
  const RowPrefetcher ahead(t.D, t.rows_after, {q, k}, {qo, ko});
  for (int tt = 0; tt < t.n; ++tt) {
    ahead.row(tt);
    int g = 0;
    for (; V::W * (g + 1) <= nb; ++g) forward_group<V, true>(t, tt, g, V::W, q, k, qo, ko);
    if (V::W * g < nb) forward_group<V, false>(t, tt, g, nb - V::W * g, q, k, qo, ko);
  }
}
// acc (if given): [group][gamma x W | eta x W] float sums over the tile, lane order; returned
// per block in block order as dgamma[b], deta[b].
template <class V = SimdOps>
void backward_tile(const Tile& t, int nb, const float* q, const float* k, const float* gqo,
                   const float* gko, float* gq, float* gk, float* acc, float* dgamma, float* deta) {
  const int groups = (nb + V::W - 1) / V::W;
  if (acc) std::fill(acc, acc + 2 * V::W * groups, 0.0f);
  const RowPrefetcher ahead(t.D, t.rows_after, {gqo, gko, acc ? q : nullptr, acc ? k : nullptr},
                            {gq, gk});
  for (int tt = 0; tt < t.n; ++tt) {
    ahead.row(tt);
    int g = 0;
    for (; V::W * (g + 1) <= nb; ++g)
      backward_group<V, true>(t, tt, g, V::W, q, k, gqo, gko, gq, gk, acc);
    if (V::W * g < nb)
      backward_group<V, false>(t, tt, g, nb - V::W * g, q, k, gqo, gko, gq, gk, acc);
  }
  if (!acc) return;
  for (int g = 0; g < groups; ++g) {
    float gs[V::W], es[V::W];
    V::store(gs, V::to_block_order(V::load(acc + 2 * V::W * g)));
    V::store(es, V::to_block_order(V::load(acc + 2 * V::W * g + V::W)));
    for (int j = 0; j < std::min(V::W, nb - V::W * g); ++j)
      dgamma[V::W * g + j] = gs[j], deta[V::W * g + j] = es[j];
  }
}

}  // namespace m2
#endif

// Calls f.template operator()<M>() with the segment's order as a compile-time constant.
template <class F, int... M>
void dispatch_order_in(int order, F&& f, std::integer_sequence<int, M...>) {
  const bool called = ((order == M && (f.template operator()<M>(), true)) || ...);
  if (!called) throw InputError("kernel supports Jordan orders 1..8, got " + std::to_string(order));
}
template <class F>
void dispatch_order(int order, F&& f) {
  static_assert(kMaxOrder == 8);
  dispatch_order_in(order, f, std::integer_sequence<int, 1, 2, 3, 4, 5, 6, 7, 8>{});
}

// Identity on the complex coordinates no segment covers.
template <class T, Layout LY>
void copy_uncovered(int first, int D, const T* x, T* y) {
  if (!x || !y || x == y) return;
  for (int j = first; j < D / 2; ++j) {
    y[Addr<LY>::re(j, D)] = x[Addr<LY>::re(j, D)];
    y[Addr<LY>::im(j, D)] = x[Addr<LY>::im(j, D)];
  }
}

// Work items: tiles of up to kTile consecutive tokens of one (batch, head).
struct Tiling {
  int64_t per_bh, count;
  explicit Tiling(Dims d) : per_bh((d.T + kTile - 1) / kTile), count(d.B * d.H * per_bh) {}
};

struct TileInfo {
  int64_t bh, t0, h, b;
  int n;
};
// Where tile `tile` lies; loads its positions into the scratch and starts its damping state.
template <class T>
TileInfo start_tile(int64_t tile, const Tiling& tiling, Dims dims, const Positions& pos,
                    Scratch<T>& sc) {
  TileInfo ti;
  ti.bh = tile / tiling.per_bh;
  ti.t0 = (tile % tiling.per_bh) * kTile;
  ti.h = ti.bh % dims.H;
  ti.b = ti.bh / dims.H;
  ti.n = static_cast<int>(std::min<int64_t>(kTile, dims.T - ti.t0));
  for (int tt = 0; tt < ti.n; ++tt) sc.pos[tt] = pos.at(ti.b, ti.t0 + tt, dims.T);
  sc.begin_tile(tile, ti.bh, ti.n);
  return ti;
}

bool plain_rotation(const SegmentDesc& s) {
  return s.order == 1 && !s.damped;
}

#if defined(__AVX2__) && defined(__FMA__)
// Where one segment of one tile lies for the fast paths: tensor offset of its first row and
// pair, its trig rows, and how many rows remain to the end of the tensors (for prefetching).
struct FastTile {
  int64_t x0, rows_after;
  const float *cos = nullptr, *sin = nullptr;
  int64_t D, NB;
  template <class T>
  FastTile(const SegmentDesc& s, Dims dims, const Positions& pos, TrigView<T> trig, int64_t bh,
           int64_t b, int64_t t0, int64_t D_, int64_t NB_)
      : x0((bh * dims.T + t0) * D_ + 2 * s.first_pair),
        rows_after(dims.B * dims.H * dims.T - (bh * dims.T + t0)),
        D(D_),
        NB(NB_) {
    if constexpr (std::is_same_v<T, float>) {
      const int64_t trow0 = ((pos.per_batch ? b : 0) * dims.T + t0) * NB_ + s.first_block;
      cos = trig.cos + trow0;
      sin = trig.sin + trow0;
    }
  }
  template <class P>
  P* at(P* p) const {
    return p ? p + x0 : nullptr;
  }
  void fill(m2::Tile* t) const {
    t->cos = cos;
    t->sin = sin;
    t->trig_ld = NB;
    t->D = D;
    t->rows_after = rows_after;
  }
};
#endif

template <class T, Layout LY>
void forward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                  TrigView<T> trig, const T* q, const T* k, T* qo, T* ko) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks;
  const int covered = covered_pairs(plan);
  const Tiling tiling(dims);
#pragma omp parallel
  {
    Scratch<T> sc(plan.total_blocks);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiling.count; ++tile) {
      const auto [bh, t0, h, b, n] = start_tile(tile, tiling, dims, pos, sc);
      for (const auto& s : plan.segments)
        dispatch_order(s.order, [&]<int M>() {
#if defined(__AVX2__) && defined(__FMA__)
          if constexpr (std::is_same_v<T, float> && M == 1 && LY == Layout::Interleaved) {
            if (plain_rotation(s)) {
              const FastTile ft(s, dims, pos, trig, bh, b, t0, D, NB);
              rot::rotate_tile<false>(n, s.blocks, ft.cos, ft.sin, NB, D, ft.rows_after, ft.at(q),
                                      ft.at(k), ft.at(q ? qo : nullptr), ft.at(k ? ko : nullptr));
              return;
            }
          }
          if constexpr (std::is_same_v<T, float> && M == 2 && LY == Layout::Interleaved) {
            m2::Tile t;
            if (m2::prepare(s, P, h, dims.H, static_cast<int>(NB), n, sc, &t)) {
              const FastTile ft(s, dims, pos, trig, bh, b, t0, D, NB);
              ft.fill(&t);
              m2::forward_tile(t, s.blocks, ft.at(q), ft.at(k), ft.at(q ? qo : nullptr),
                               ft.at(k ? ko : nullptr));
              return;
            }
          }
#endif
          const bool plain = plain_rotation(s);
          if (!plain) tile_series<T, M>(s, P, h, dims.H, static_cast<int>(NB), n, sc);
          for (int tt = 0; tt < n; ++tt) {
            const int64_t row = bh * dims.T + t0 + tt;
            const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t0 + tt) * NB;
            forward_segment<T, M, LY>(s, static_cast<int>(D), trig.cos + trow, trig.sin + trow,
                                      plain ? nullptr : sc.ck.data() + tt * s.blocks,
                                      plain ? nullptr : sc.cq.data() + tt * s.blocks, n * s.blocks,
                                      q ? q + row * D : nullptr, k ? k + row * D : nullptr,
                                      q ? qo + row * D : nullptr, k ? ko + row * D : nullptr);
          }
        });
      for (int tt = 0; tt < n; ++tt) {
        const int64_t row = bh * dims.T + t0 + tt;
        if (q) copy_uncovered<T, LY>(covered, static_cast<int>(D), q + row * D, qo + row * D);
        if (k) copy_uncovered<T, LY>(covered, static_cast<int>(D), k + row * D, ko + row * D);
      }
    }
  }
}

template <class T, Layout LY>
void backward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                   TrigView<T> trig, const T* q, const T* k, const T* gqo, const T* gko, T* gq,
                   T* gk, const ParamGrads<T>& G) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks;
  const int covered = covered_pairs(plan);
  const Tiling tiling(dims);
  const GradSlots slot{static_cast<size_t>(dims.H * NB)};
  const size_t nacc = G.any() ? (3 + plan.gate_rows) * slot.hb : 0;
  std::vector<std::vector<double>> acc(static_cast<size_t>(omp_get_max_threads()));
  const T* xin[2] = {q, k};
  const T* gy[2] = {gqo, gko};
  T* gx[2] = {gqo ? gq : nullptr, gko ? gk : nullptr};
#pragma omp parallel
  {
    Scratch<T> sc(plan.total_blocks);
    auto& mine = acc[static_cast<size_t>(omp_get_thread_num())];
    mine.assign(nacc, 0.0);
    double* a = nacc ? mine.data() : nullptr;
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiling.count; ++tile) {
      const auto [bh, t0, h, b, n] = start_tile(tile, tiling, dims, pos, sc);
      for (const auto& s : plan.segments)
        dispatch_order(s.order, [&]<int M>() {
#if defined(__AVX2__) && defined(__FMA__)
          if constexpr (std::is_same_v<T, float> && M == 1 && LY == Layout::Interleaved) {
            if (plain_rotation(s)) {
              const FastTile ft(s, dims, pos, trig, bh, b, t0, D, NB);
              rot::rotate_tile<true>(n, s.blocks, ft.cos, ft.sin, NB, D, ft.rows_after,
                                     ft.at(gx[0] ? gy[0] : nullptr), ft.at(gx[1] ? gy[1] : nullptr),
                                     ft.at(gx[0]), ft.at(gx[1]));
              return;
            }
          }
          if constexpr (std::is_same_v<T, float> && M == 2 && LY == Layout::Interleaved) {
            m2::Tile t;
            if (m2::prepare(s, P, h, dims.H, static_cast<int>(NB), n, sc, &t)) {
              const FastTile ft(s, dims, pos, trig, bh, b, t0, D, NB);
              ft.fill(&t);
              float* dg = sc.part.data();
              float* dk = sc.dl.data();
              m2::backward_tile(t, s.blocks, ft.at(q), ft.at(k), ft.at(gy[0]), ft.at(gy[1]),
                                ft.at(gx[0]), ft.at(gx[1]), a ? sc.f_acc.data() : nullptr, dg, dk);
              if (a) {
                const size_t off = static_cast<size_t>(h) * NB + s.first_block;
                for (int blk = 0; blk < s.blocks; ++blk) {
                  if (s.damped) a[slot.gamma(off + blk)] += static_cast<double>(dg[blk]);
                  if (s.shear == ShearMode::Exponential)
                    a[slot.eta(off + blk)] += static_cast<double>(dk[blk]);
                }
              }
              return;
            }
          }
#endif
          const bool plain = plain_rotation(s);
          if (!plain) tile_series<T, M>(s, P, h, dims.H, static_cast<int>(NB), n, sc);
          const int stride = n * s.blocks;
          for (int io = 0; io < 2; ++io) {
            if (!gy[io]) continue;
            const bool key = io == 1;
            const bool params = a && xin[io] && !plain;
            for (int tt = 0; tt < n; ++tt) {
              const int64_t row = bh * dims.T + t0 + tt;
              const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t0 + tt) * NB;
              const int off = tt * s.blocks;
              backward_segment<T, M, LY>(
                  s, static_cast<int>(D), trig.cos + trow, trig.sin + trow,
                  plain ? nullptr : (key ? sc.ck.data() : sc.cq.data()) + off, stride, key,
                  params ? xin[io] + row * D : nullptr, gy[io] + row * D,
                  gx[io] ? gx[io] + row * D : nullptr, sc.dl.data() + off, sc.de.data() + off,
                  sc.dser.data() + off);
            }
            if (params)
              accumulate_param_grads<T, M>(s, h, static_cast<int>(NB), n, key, sc, a, slot);
          }
        });
      for (int io = 0; io < 2; ++io)
        if (gy[io] && gx[io])
          for (int tt = 0; tt < n; ++tt) {
            const int64_t row = bh * dims.T + t0 + tt;
            copy_uncovered<T, LY>(covered, static_cast<int>(D), gy[io] + row * D, gx[io] + row * D);
          }
    }
  }
  if (!nacc) return;
  for (size_t i = 0; i < slot.hb; ++i) {
    double g = 0, e = 0, a0 = 0;
    for (const auto& v : acc)
      if (!v.empty()) g += v[slot.gamma(i)], e += v[slot.eta(i)], a0 += v[slot.alpha0(i)];
    if (G.gamma) G.gamma[i] += static_cast<T>(g);
    if (G.eta) G.eta[i] += static_cast<T>(e);
    if (G.alpha0) G.alpha0[i] += static_cast<T>(a0);
    for (int kk = 1; kk <= plan.gate_rows && G.gates; ++kk) {
      double sum = 0;
      for (const auto& v : acc)
        if (!v.empty()) sum += v[slot.gate(kk, i)];
      G.gates[(kk - 1) * slot.hb + i] += static_cast<T>(sum);
    }
  }
}

// True when every row of positions is p0 + t * step exactly (then the trig table can be filled by
// rotation recurrences instead of one sin/cos per entry).
bool arithmetic(const Positions& pos, int64_t rows, int64_t T, double* step) {
  *step = T > 1 ? pos.data[1] - pos.data[0] : 1.0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* p = pos.data + r * T;
    if (T > 1 && p[1] - p[0] != *step) return false;
    for (int64_t t = 0; t < T; ++t)
      if (p[t] != p[0] + static_cast<double>(t) * *step) return false;
  }
  return true;
}

}  // namespace RELPOS_ISA_NAMESPACE
}  // namespace relpos::kernels
