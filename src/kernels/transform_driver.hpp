// Driver of the transform kernels: the tile loops of the forward and backward passes (OpenMP over
// tiles of one (batch, head)), choosing per segment between the fast paths (transform_fast.hpp)
// and the generic path (transform_generic.hpp), with the segment's Jordan order as a
// compile-time constant; plus the helpers of the trig-table fill. Included once per instruction
// set by transform_isa.inc, whose entry points transform.cpp dispatches to. Internal header:
// include kernels/transform.hpp instead.
#pragma once

#ifndef RELPOS_ISA_NAMESPACE
#error "internal kernel header: include it from a per-ISA .inc (RELPOS_ISA_NAMESPACE set)"
#endif

#include <omp.h>

#include <string>
#include <type_traits>
#include <utility>

#include "kernels/transform_fast.hpp"
#include "kernels/transform_generic.hpp"
#include "kernels/transform_tiles.hpp"

namespace relpos::kernels::RELPOS_ISA_NAMESPACE {

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

// The span the pairs are addressed in: the head dim, except in the half-split layout, whose pairs
// are (j, j + span/2) over the covered pairs only (span = 2 x covered pairs: GPT-NeoX's partial
// rotary, rotate_half on the first rotary_dim coordinates; the whole head when every pair is
// covered).
template <Layout LY>
int pair_span(int covered, int D) {
  return LY == Layout::HalfSplit ? 2 * covered : D;
}

// Identity on the coordinates no segment covers: pairs first..span/2 - 1, then the
// coordinates past the span.
template <class T, Layout LY>
void copy_uncovered(int first, int span, int D, const T* x, T* y) {
  if (!x || !y || x == y) return;
  for (int j = first; j < span / 2; ++j) {
    y[Addr<LY>::re(j, span)] = x[Addr<LY>::re(j, span)];
    y[Addr<LY>::im(j, span)] = x[Addr<LY>::im(j, span)];
  }
  for (int e = span; e < D; ++e) y[e] = x[e];
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
           int64_t b, int64_t t0, int64_t D_, int64_t NB_, Layout layout = Layout::Interleaved)
      : x0((bh * dims.T + t0) * D_ + (layout == Layout::Interleaved ? 2 : 1) * s.first_pair),
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

// One tensor and the role it is mapped by (x -> y, in place allowed).
template <class T>
struct MapJob {
  MapRole role;
  const T* x;
  T* y;
};

// The tile loop of every map: jobs[0..njobs) (at most one per role) over the same tiles, each
// tile's series computed once for all of them. Per segment: the plain-rotation fast path (A =
// A^{-T} = R there, and A^T = A^{-1} = R^T), the order-2 fast path (its forward tile serves A on
// keys and A^{-T} on queries, its backward tile without parameters the transposes), or the
// generic map_segment of each job's role.
//
// With `check_outputs`, each job's outputs are checked for NaN / Inf: in registers by a lone plain
// rotation over whole rows, else each tile right after it is written (it is still in cache);
// returns the jobs with one, bit i for jobs[i] (else 0).
template <class T, Layout LY>
int map_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
             TrigView<T> trig, const MapJob<T>* jobs, int njobs, bool check_outputs = false) {
  const int64_t D = plan.head_dim, NB = plan.total_blocks;
  const int covered = covered_pairs(plan), span = pair_span<LY>(covered, static_cast<int>(D));
  const Tiling tiling(dims);
  // one plain rotation over whole rows (RoPE) whose outputs outgrow the cache streams them
  // (rot::stream_rows)
  [[maybe_unused]] bool stream = false;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (plan.segments.size() == 1 && plain_rotation(plan.segments[0]) &&
        plan.segments[0].first_pair == 0 && njobs > 0)
      stream = rot::stream_rows(njobs * dims.B * dims.H * dims.T * D * int64_t{sizeof(float)},
                                plan.segments[0].blocks, D,
                                {jobs[0].y, njobs > 1 ? jobs[1].y : nullptr});
  }
#endif
  // one segment covering every pair: the fast rotation's register check sees every output
  [[maybe_unused]] const bool whole_rotation =
      plan.segments.size() == 1 && plan.segments[0].first_pair == 0 && 2 * covered == D;
  // plain rotations only (no damping series carried from tile to tile): the heads of one token
  // block run one after another, so the block's cos/sin rows are read from memory once, not once
  // per head (a table of 2 MiB read 8 times is half as much again as q and k themselves)
  const bool all_plain = std::all_of(plan.segments.begin(), plan.segments.end(), plain_rotation);
  const bool heads_inner = all_plain && dims.H > 1;
  int nonfinite = 0;
#pragma omp parallel reduction(| : nonfinite) if (dims.B * dims.H * dims.T * D >= kThreadWork)
  {
    // plain rotations read only the tiles' positions: no [token][block] tables
    Scratch<T> sc(plan.total_blocks, tile_rows(dims), !all_plain);
#pragma omp for schedule(static)
    for (int64_t visit = 0; visit < tiling.count; ++visit) {
      const int64_t tile = heads_inner ? tiling.heads_inner(visit, dims.H) : visit;
      const auto [bh, t0, h, b, n] = start_tile(tile, tiling, dims, pos, sc);
      // the non-finite bits, by job, of outputs checked in the registers (a lone plain rotation
      // over whole rows; -1: check the tile in memory)
      int register_bad = -1;
      for (const auto& s : plan.segments)
        dispatch_order(s.order, [&]<int M>() {
#if defined(__AVX2__) && defined(__FMA__)
          // plain rotations in either layout, order 2 on interleaved pairs
          if constexpr (std::is_same_v<T, float> && (M == 1 || LY == Layout::Interleaved) &&
                        M <= 2) {
            // the fast paths take the roles by slot: [A^{-T} | A] forward, [A^{-1} | A^T] back
            const float *fx[2] = {}, *bx[2] = {};
            float *fy[2] = {}, *by[2] = {};
            int fjob[2] = {}, bjob[2] = {};  // the job of each slot
            for (int i = 0; i < njobs; ++i) {
              const MapJob<T>& jb = jobs[i];
              switch (jb.role) {
                case MapRole::Contragredient:
                  fx[0] = jb.x, fy[0] = jb.y, fjob[0] = i;
                  break;
                case MapRole::Primal:
                  fx[1] = jb.x, fy[1] = jb.y, fjob[1] = i;
                  break;
                case MapRole::Inverse:
                  bx[0] = jb.x, by[0] = jb.y, bjob[0] = i;
                  break;
                case MapRole::PrimalTranspose:
                  bx[1] = jb.x, by[1] = jb.y, bjob[1] = i;
                  break;
              }
            }
            const bool fwd = fx[0] || fx[1], bwd = bx[0] || bx[1];
            if constexpr (M == 1) {
              if (plain_rotation(s)) {
                const FastTile ft(s, dims, pos, trig, bh, b, t0, D, NB, LY);
                const int64_t half = LY == Layout::HalfSplit ? span / 2 : 0;
                // one direction's slots; the non-finite bits of their outputs, by job
                const auto rotate = [&]<bool INVERSE>(const float* const* x, float* const* y,
                                                      const int* job) {
                  const int bits =
                      (stream ? rot::rotate_tile<INVERSE, true>
                              : rot::rotate_tile<INVERSE, false>)(n, s.blocks, ft.cos, ft.sin, NB,
                                                                  D, ft.rows_after, ft.at(x[0]),
                                                                  ft.at(x[1]), ft.at(y[0]),
                                                                  ft.at(y[1]), half);
                  return (bits & 1 ? 1 << job[0] : 0) | (bits & 2 ? 1 << job[1] : 0);
                };
                const int bad = (fwd ? rotate.template operator()<false>(fx, fy, fjob) : 0) |
                                (bwd ? rotate.template operator()<true>(bx, by, bjob) : 0);
                if (whole_rotation) register_bad = bad;
                return;
              }
            } else {
              m2::Tile t;
              if (m2::prepare(s, P, h, dims.H, static_cast<int>(NB), n, sc, &t)) {
                const FastTile ft(s, dims, pos, trig, bh, b, t0, D, NB);
                ft.fill(&t);
                if (fwd)
                  m2::forward_tile(t, s.blocks, ft.at(fx[0]), ft.at(fx[1]), ft.at(fy[0]),
                                   ft.at(fy[1]));
                if (bwd)
                  m2::backward_tile(t, s.blocks, nullptr, nullptr, ft.at(bx[0]), ft.at(bx[1]),
                                    ft.at(by[0]), ft.at(by[1]), nullptr, nullptr, nullptr);
                return;
              }
            }
          }
#endif
          const bool plain = plain_rotation(s);
          if (!plain) tile_series<T, M>(s, P, h, dims.H, static_cast<int>(NB), n, sc);
          for (int tt = 0; tt < n; ++tt) {
            const int64_t row = bh * dims.T + t0 + tt;
            const int64_t trow = ((pos.per_batch ? b : 0) * dims.T + t0 + tt) * NB;
            for (int i = 0; i < njobs; ++i) {
              const MapJob<T>& jb = jobs[i];
              dispatch_role(jb.role, [&]<MapRole ROLE>() {
                const T* coef = plain                          ? nullptr
                                : RoleTraits<ROLE>::key_series ? sc.ck.data() + tt * s.blocks
                                                               : sc.cq.data() + tt * s.blocks;
                map_segment<T, M, LY, ROLE>(s, span, trig.cos + trow, trig.sin + trow, coef,
                                            n * s.blocks, jb.x + row * D, jb.y + row * D);
              });
            }
          }
        });
      if (2 * covered < D)  // (else nothing is uncovered: no row loop per tile)
        for (int tt = 0; tt < n; ++tt) {
          const int64_t row = bh * dims.T + t0 + tt;
          for (int i = 0; i < njobs; ++i)
            copy_uncovered<T, LY>(covered, span, static_cast<int>(D), jobs[i].x + row * D,
                                  jobs[i].y + row * D);
        }
      if (check_outputs && register_bad >= 0)
        nonfinite |= register_bad;
      else if (check_outputs)
        for (int i = 0; i < njobs; ++i)
          if (!all_finite(jobs[i].y + (bh * dims.T + t0) * D, n * D)) nonfinite |= 1 << i;
    }
#if defined(__AVX2__) && defined(__FMA__)
    rot::fence_streams(stream);  // before the barrier closing the parallel region
#endif
  }
  return nonfinite;
}

// y = A x on keys and y = A^{-T} x on queries (either may be null).
// With `check_outputs`: which outputs hold NaN / Inf, bit 0 qo, bit 1 ko.
template <class T, Layout LY>
int forward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                 TrigView<T> trig, const T* q, const T* k, T* qo, T* ko, bool check_outputs) {
  MapJob<T> jobs[2];
  int n = 0, bit[2] = {};
  if (q) bit[n] = 1, jobs[n++] = {MapRole::Contragredient, q, qo};
  if (k) bit[n] = 2, jobs[n++] = {MapRole::Primal, k, ko};
  const int bad = map_impl<T, LY>(plan, dims, pos, P, trig, jobs, n, check_outputs);
  return (bad & 1 ? bit[0] : 0) | (bad & 2 ? bit[1] : 0);
}

// Backward with the parameter gradients: the transposed maps and the parameter-gradient
// reductions fused in one tile loop (each tile reads q, k and the output gradients once).
template <class T, Layout LY>
void backward_impl(const TransformPlan& plan, Dims dims, const Positions& pos, const Params<T>& P,
                   TrigView<T> trig, const T* q, const T* k, const T* gqo, const T* gko, T* gq,
                   T* gk, const ParamGrads<T>& G) {
  if (!any(G)) {  // input gradients only: A^{-1} on queries, A^T on keys, the maps' tile loop
    MapJob<T> jobs[2];
    int nj = 0;
    if (gqo && gq) jobs[nj++] = {MapRole::Inverse, gqo, gq};
    if (gko && gk) jobs[nj++] = {MapRole::PrimalTranspose, gko, gk};
    map_impl<T, LY>(plan, dims, pos, P, trig, jobs, nj);
    return;
  }
  const int64_t D = plan.head_dim, NB = plan.total_blocks;
  const int covered = covered_pairs(plan), span = pair_span<LY>(covered, static_cast<int>(D));
  const Tiling tiling(dims);
  const GradSlots slot{static_cast<size_t>(dims.H * NB)};
  const size_t nacc = any(G) ? (3 + plan.gate_rows) * slot.hb : 0;
  std::vector<std::vector<double>> acc(static_cast<size_t>(omp_get_max_threads()));
  const T* xin[2] = {q, k};
  const T* gy[2] = {gqo, gko};
  T* gx[2] = {gqo ? gq : nullptr, gko ? gk : nullptr};
#pragma omp parallel if (dims.B * dims.H * dims.T * D >= kThreadWork)
  {
    Scratch<T> sc(plan.total_blocks, tile_rows(dims));
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
              const auto seg = [&]<MapRole ROLE>() {
                backward_segment<T, M, LY, ROLE>(
                    s, span, trig.cos + trow, trig.sin + trow,
                    plain ? nullptr : (key ? sc.ck.data() : sc.cq.data()) + off, stride,
                    params ? xin[io] + row * D : nullptr, gy[io] + row * D,
                    gx[io] ? gx[io] + row * D : nullptr, sc.dl.data() + off, sc.de.data() + off,
                    sc.dser.data() + off);
              };
              if (key)
                seg.template operator()<MapRole::PrimalTranspose>();
              else
                seg.template operator()<MapRole::Inverse>();
            }
            if (params)
              accumulate_param_grads<T, M>(s, h, static_cast<int>(NB), n, key, sc, a, slot);
          }
        });
      for (int io = 0; io < 2; ++io)
        if (gy[io] && gx[io] && 2 * covered < D)
          for (int tt = 0; tt < n; ++tt) {
            const int64_t row = bh * dims.T + t0 + tt;
            copy_uncovered<T, LY>(covered, span, static_cast<int>(D), gy[io] + row * D,
                                  gx[io] + row * D);
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

}  // namespace relpos::kernels::RELPOS_ISA_NAMESPACE
