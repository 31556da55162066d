// The tile machinery shared by every path of the transform kernels: addressing of the two
// layouts, the per-thread scratch, the work split into tiles of kTile tokens of one (batch, head)
// and, per tile and segment, the coefficient series (damping, shear) in structure-of-arrays
// loops. Both the generic path (transform_generic.hpp) and the fast paths (transform_fast.hpp)
// start from here. Part of the per-ISA build (transform_isa.inc): internal header, include
// kernels/transform.hpp instead.
#pragma once

#ifndef RELPOS_ISA_NAMESPACE
#error "internal kernel header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set)"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/charts.hpp"
#include "kernels/transform.hpp"

namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

constexpr int kMaxOrder = 8;
constexpr int64_t kTrigAnchor = 32;
// Values (B H T D, or trig entries) below which a call runs on its own thread: a decode step
// transforms one token, and waking OpenMP's sleeping workers would cost it 0.1-0.4 ms.
constexpr int64_t kThreadWork = int64_t{1} << 14;

// Whether x[0..n) holds no NaN or Inf: the exponent bits of each value, OR-reduced as integers
// (vectorised without fast-math; a tile is checked while it is still in cache).
template <class T>
bool all_finite(const T* x, int64_t n) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  static_assert(sizeof(T) == sizeof(Bits) && std::numeric_limits<T>::is_iec559);
  constexpr Bits kExp = static_cast<Bits>(sizeof(T) == 4 ? 0x7f800000ull : 0x7ff0000000000000ull);
  Bits least = kExp;  // the least (~x & kExp) seen: 0 exactly when some x is NaN or Inf
  for (int64_t i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, x + i, sizeof b);
    least = std::min<Bits>(least, ~b & kExp);
  }
  return least != 0;
}

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
  // blocks, and rows per tile: the tiles' token count, at most kTile (a one-token call, as a
  // decode step's, allocates and clears one row's scratch, not kTile's)
  int nb, tr;
  int tab;  // rows of the [token][block] tables: tr, or 0 when no segment reads them
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
  // tables: false where every segment is a plain rotation, which reads none of the [token][block]
  // tables (about 390 KB a thread at 32 blocks, allocated and cleared on every call)
  explicit Scratch(int blocks, int rows = kTile, bool tables = true)
      : nb(std::max(1, blocks)),
        tr(std::clamp(rows, 1, kTile)),
        tab(tables ? tr : 0),
        ek(tab * nb),
        eq(tab * nb),
        x(tab * nb),
        ck(kMaxOrder * tab * nb),
        cq(kMaxOrder * tab * nb),
        dl(tab * nb),
        de(tab * nb),
        dser(kMaxOrder * tab * nb),
        part(nb),
        ekd(tab * nb),
        eqd(tab * nb),
        pos(tr),
        u(tr),
        clamped(tab * nb),
        ek_last(nb),
        eq_last(nb),
        rk(nb),
        rq(nb),
        rk_d(nb),
        rk_bh(nb, -1),
        f_u(tr),
        f_p(tr),
        f_eta(nb + 16),
        f_e0k(nb + 16),
        f_e0q(nb + 16),
        f_ones(tab * (nb + 16), 1.0f),
        f_pk(tab * (nb + 16)),
        f_pq(tab * (nb + 16)),
        f_sk(tab * (nb + 16)),
        f_sq(tab * (nb + 16)),
        f_gm(tab * (nb + 16)),
        f_acc(2 * (nb + 16)),
        pw_k(tab * (nb + 16)),
        pw_q(tab * (nb + 16)),
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

// Rows of the largest tile of a call (its Scratch's size).
inline int tile_rows(Dims d) {
  return static_cast<int>(std::min<int64_t>(kTile, d.T));
}

// Work items: tiles of up to kTile consecutive tokens of one (batch, head).
struct Tiling {
  int64_t per_bh, count;
  explicit Tiling(Dims d) : per_bh((d.T + kTile - 1) / kTile), count(d.B * d.H * per_bh) {}
  // The tile visited `visit`-th when the heads of each token block follow one another (tiles are
  // numbered (batch, head, block)).
  int64_t heads_inner(int64_t visit, int64_t H) const {
    const int64_t b = visit / (per_bh * H), rest = visit % (per_bh * H);
    return (b * H + rest % H) * per_bh + rest / H;
  }
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

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
