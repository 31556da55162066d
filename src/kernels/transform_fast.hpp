// Fast paths of the transform kernels: float, interleaved layout, AVX2+FMA or AVX-512 builds only
// (empty otherwise). rot:: plain rotations (RoPE; kernels/rotate_simd.hpp, shared with the
// rotation of journey frames); m2:: order-2 Jordan blocks (with or without
// damping and exponential shear; not jet gates), forward maps, transposed maps and the fused
// parameter gradients. The driver (transform_driver.hpp) picks them per tile and segment.
//
// Order-2 blocks (Jordan-RoPE m = 2): a group of G blocks is four registers of
// (re0, im0, re1, im1) per block; in-lane 4x4 transposes turn them into re0, im0, re1, im1
// vectors whose elements are the blocks in "lane order" (AVX2: [0, 2, 4, 6 | 1, 3, 5, 7]). Every
// per-block scalar (cos, sin, damping, eta) is then one plain vector load, the arithmetic needs
// no shuffles, and the parameter gradients accumulate per block without horizontal sums. The
// transposes cost two shuffles per register each way.
//
// Part of the per-ISA build (transform_isa.inc): internal header.
#pragma once

#ifndef RELPOS_ISA_NAMESPACE
#error "internal kernel header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set)"
#endif

#include "kernels/rotate_simd.hpp"
#include "kernels/simd_ops.hpp"
#include "kernels/transform_tiles.hpp"

#if defined(__AVX2__) && defined(__FMA__)
namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

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
        for (int tt = 0; tt < sc.tr; ++tt, ak *= rk, aq *= rq) {
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

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
#endif  // __AVX2__ && __FMA__
