// relpos-bench attention: causal fp32 attention, B x H x T x D, forward and forward+backward:
//   ours       kernels::attention_forward / attention_backward, no bias
//   sdpa       at::scaled_dot_product_attention(q, k, v, is_causal=true)
//   sdpa_mask  SDPA with the ALiBi-shaped lag bias b_h(d) = -slope_h d materialised as a float
//              mask [1, H, T, T] (-inf above the diagonal), is_causal=false
//   ours_lag   our kernel with the same bias as a lag table [H, T] (lag_len = T)
// Those are --bias none (ours, sdpa) and --bias alibi (ours_lag, sdpa_mask), the default. With
// --bias fox and/or grape-ap, three cases per bias (X = fox or grape_ap):
//   ours_X      our kernel with the bias as its O(T) inputs: FoX cq = ck = c (bias c_i - c_j),
//               GRAPE-AP path_q, path_k, path_beta (bias(i, j) = sum_{l=j+1..i} beta_h
//               logsigmoid(scale pq_i . pk_l)); forward+backward also takes the gradients of c,
//               or of pq, pk, beta
//   composed_X  the same in plain LibTorch ops with the bias materialised as [B, H, T, T] on
//               every call (composed_bias), softmax(q k^T / sqrt(D) + bias, causal) v; the
//               backward goes through the bias construction (autograd)
//   sdpa_X      at::scaled_dot_product_attention fed that bias as a float mask (-inf above the
//               diagonal, is_causal=false), built and differentiated likewise
// They are checked against composed_X at the smallest T (outputs and every gradient). With
// --dtype bf16 / fp16, three more (no bias): ours_<dtype> (relpos::nn::fused_attention and its
// autograd on half copies of q, k, v, dout: the kernels read them as stored), sdpa_<dtype> (SDPA
// on the same half tensors) and ours_op (the same op and autograd on the float32 inputs: the
// like-for-like float32 baseline of ours_<dtype>).
// Timing: every case of one T in one process, once per repeat in a fresh random order (noise and
// what the previous case left spread over all cases alike), after a warm-up; medians, every run
// listed. Inputs, outputs and the mask are allocated outside the timed region except each call's
// own outputs and gradients; the mask is built once per T (not timed: a fixed ALiBi mask can be
// cached by a user). Memory: each case once more in a child process (this program re-run with
// --memory-child): it warms the case up at a small T (code pages, thread pools), allocates the
// inputs, reads its resident set, builds the mask (sdpa_mask; the bool causal mask of composed_X,
// sdpa_X), resets the peak (/proc/self/clear_refs), runs the case once and reports peak resident
// set - resident set after the inputs: the case's own memory (the mask included), nothing of the
// other cases.
#include "apps/bench/attention_bench.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <omp.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "apps/bench/bench_util.hpp"
#include "apps/bench/proc_memory.hpp"
#include "apps/cli_checks.hpp"
#include "core/charts.hpp"
#include "core/files.hpp"
#include "core/types.hpp"
#include "kernels/attention/attention.hpp"
#include "kernels/isa.hpp"
#include "nlohmann/json.hpp"
#include "torch/attention.hpp"

namespace relpos::bench {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

enum class Impl {
  Ours,
  Sdpa,
  SdpaMask,
  OursLag,
  OursFox,
  ComposedFox,
  SdpaFox,
  OursAp,
  ComposedAp,
  SdpaAp,
  OursBf16,
  SdpaBf16,
  OursFp16,
  SdpaFp16,
  OursOp
};
enum class Mode { Fwd, FwdBwd };
enum class Bias { None, Alibi, Fox, GrapeAp };
constexpr Impl kImpls[] = {Impl::Ours,       Impl::Sdpa,        Impl::SdpaMask, Impl::OursLag,
                           Impl::OursFox,    Impl::ComposedFox, Impl::SdpaFox,  Impl::OursAp,
                           Impl::ComposedAp, Impl::SdpaAp,      Impl::OursBf16, Impl::SdpaBf16,
                           Impl::OursFp16,   Impl::SdpaFp16,    Impl::OursOp};
constexpr Bias kBiases[] = {Bias::None, Bias::Alibi, Bias::Fox, Bias::GrapeAp};
constexpr int64_t kPathDim = 8;         // GRAPE-AP probe dimension P
constexpr double kPathScale = 1.0 / 8;  // GRAPE-AP path_scale

const char* name(Impl i) {
  switch (i) {
    case Impl::Ours:
      return "ours";
    case Impl::Sdpa:
      return "sdpa";
    case Impl::SdpaMask:
      return "sdpa_mask";
    case Impl::OursLag:
      return "ours_lag";
    case Impl::OursFox:
      return "ours_fox";
    case Impl::ComposedFox:
      return "composed_fox";
    case Impl::SdpaFox:
      return "sdpa_fox";
    case Impl::OursAp:
      return "ours_grape_ap";
    case Impl::ComposedAp:
      return "composed_grape_ap";
    case Impl::SdpaAp:
      return "sdpa_grape_ap";
    case Impl::OursBf16:
      return "ours_bf16";
    case Impl::SdpaBf16:
      return "sdpa_bf16";
    case Impl::OursFp16:
      return "ours_fp16";
    case Impl::SdpaFp16:
      return "sdpa_fp16";
    case Impl::OursOp:
      return "ours_op";
  }
  return "?";
}
// The storage dtype of a case's q, k, v and output (the --dtype cases: half storage).
at::ScalarType storage_of(Impl i) {
  return i == Impl::OursBf16 || i == Impl::SdpaBf16   ? at::kBFloat16
         : i == Impl::OursFp16 || i == Impl::SdpaFp16 ? at::kHalf
                                                      : at::kFloat;
}
// --dtype's name of a storage dtype.
const char* dtype_name(at::ScalarType t) {
  return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : "fp32";
}
const char* name(Bias b) {
  switch (b) {
    case Bias::None:
      return "none";
    case Bias::Alibi:
      return "alibi";
    case Bias::Fox:
      return "fox";
    case Bias::GrapeAp:
      return "grape-ap";
  }
  return "?";
}
Bias bias_of(Impl i) {
  switch (i) {
    case Impl::Ours:
    case Impl::Sdpa:
    case Impl::OursBf16:
    case Impl::SdpaBf16:
    case Impl::OursFp16:
    case Impl::SdpaFp16:
    case Impl::OursOp:
      return Bias::None;
    case Impl::SdpaMask:
    case Impl::OursLag:
      return Bias::Alibi;
    case Impl::OursFox:
    case Impl::ComposedFox:
    case Impl::SdpaFox:
      return Bias::Fox;
    case Impl::OursAp:
    case Impl::ComposedAp:
    case Impl::SdpaAp:
      return Bias::GrapeAp;
  }
  return Bias::None;
}
// The three cases of a FoX / GRAPE-AP bias: fused kernel, plain-op composition, SDPA + mask.
struct BiasCases {
  Impl ours, composed, sdpa;
};
BiasCases cases_of(Bias b) {
  return b == Bias::Fox ? BiasCases{Impl::OursFox, Impl::ComposedFox, Impl::SdpaFox}
                        : BiasCases{Impl::OursAp, Impl::ComposedAp, Impl::SdpaAp};
}
// Cases that build a [B, H, T, T] bias from the FoX / GRAPE-AP inputs on every call.
bool materialises(Impl i) {
  return i == Impl::ComposedFox || i == Impl::SdpaFox || i == Impl::ComposedAp || i == Impl::SdpaAp;
}
const char* name(Mode m) {
  return m == Mode::Fwd ? "fwd" : "fwdbwd";
}
Impl impl_named(const std::string& s) {
  for (Impl i : kImpls)
    if (s == name(i)) return i;
  throw InputError("unknown case '" + s + "'");
}
Mode mode_named(const std::string& s) {
  return s == "fwd" ? Mode::Fwd : Mode::FwdBwd;
}

struct Args {
  std::vector<int64_t> T = {1024, 4096, 8192, 16384};
  int64_t B = 1, H = 8, D = 64;
  int repeats = 5, warmup = 1, threads = 0, mm_n = 2048;
  std::string format = "md", json_out;
  std::vector<std::string> modes = {"fwd", "fwdbwd"};
  std::vector<std::string> biases = {"none", "alibi"};
  std::vector<std::string> cases;  // empty: every case of the selected biases
  std::string dtype = "fp32";      // bf16 / fp16: the half-storage cases beside the fp32 ones
  int64_t long_T = -1;             // -1: 32768 with the default T list, none otherwise
  double max_mask_gib = -1;        // -1: 60% of MemAvailable at the start
  bool memory = true, scaling = true;
  // one memory measurement in a child process (internal)
  std::string child_case, child_mode, child_out;
  int64_t child_T = 0;
};

struct Shape {
  int64_t B, H, T, D;
};

double flops(const Shape& s, Mode m) {
  // causal forward: QK^T and PV over half the T x T pairs, 2 flops per multiply-add;
  // the backward's five products count 2.5 times that
  const double fwd = 4.0 * double(s.B) * double(s.H) * double(s.T) * double(s.T) * double(s.D) / 2;
  return m == Mode::Fwd ? fwd : 3.5 * fwd;
}

// ALiBi slopes 2^(-8 (h + 1) / H).
at::Tensor alibi_slopes(int64_t H) {
  return at::exp2(-8.0 * (at::arange(H, at::kFloat) + 1) / static_cast<double>(H));
}

struct Inputs {
  Shape s;
  at::Tensor q, k, v, dout, lag, mask;
  // q, k, v, dout rounded to the half dtype of the --dtype cases (made by make_half)
  at::Tensor qh, kh, vh, douth;
  // FoX: c [B, H, T] float64 cumulative log forget gates. GRAPE-AP: probes pq, pk [B, H, T, P],
  // beta [H]. upper [T, T] bool, true above the diagonal (j > i): the causal mask of the
  // materialised FoX / GRAPE-AP cases (made by make_upper, like the ALiBi mask).
  at::Tensor c, pq, pk, beta, upper;
};

// q, k, v, dout ~ N(0, 1), the lag table [H, T]: lag[h][d] = -slope_h d (exact in fp32: slopes
// are powers of two); FoX c = cumsum(logsigmoid(N(0, 1))) in float64; GRAPE-AP probes ~ N(0, 1)
// with P = 8, beta = the ALiBi slopes (core/charts.hpp). The masks are made separately
// (make_mask, make_upper).
Inputs make_inputs(const Shape& s) {
  at::manual_seed(0);
  Inputs in{s, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  in.q = at::randn({s.B, s.H, s.T, s.D});
  in.k = at::randn({s.B, s.H, s.T, s.D});
  in.v = at::randn({s.B, s.H, s.T, s.D});
  in.dout = at::randn({s.B, s.H, s.T, s.D});
  in.lag =
      (-alibi_slopes(s.H).unsqueeze(1) * at::arange(s.T, at::kFloat).unsqueeze(0)).contiguous();
  in.c = at::log_sigmoid(at::randn({s.B, s.H, s.T}, at::kDouble)).cumsum(-1).contiguous();
  in.pq = at::randn({s.B, s.H, s.T, kPathDim});
  in.pk = at::randn({s.B, s.H, s.T, kPathDim});
  const std::vector<double> slopes = relpos::alibi_slopes(static_cast<int>(s.H));
  in.beta = at::tensor(slopes, at::kDouble).to(at::kFloat).contiguous();
  return in;
}

// The half copies of q, k, v, dout (untimed: a half model holds its activations in half).
void make_half(Inputs& in, at::ScalarType t) {
  in.qh = in.q.to(t);
  in.kh = in.k.to(t);
  in.vh = in.v.to(t);
  in.douth = in.dout.to(t);
}

// [T, T] bool, true above the diagonal.
void make_upper(Inputs& in) {
  in.upper = at::ones({in.s.T, in.s.T}, at::kBool).triu(1);
}

// [1, H, T, T]: -slope_h (i - j) for j <= i, -inf above the diagonal.
void make_mask(Inputs& in) {
  const int64_t H = in.s.H, T = in.s.T;
  const at::Tensor i = at::arange(T, at::kFloat);
  const at::Tensor d = i.unsqueeze(1) - i.unsqueeze(0);  // i - j
  at::Tensor m = -alibi_slopes(H).view({H, 1, 1}) * d.unsqueeze(0);
  m.masked_fill_(d.lt(0).unsqueeze(0), -std::numeric_limits<float>::infinity());
  in.mask = m.unsqueeze(0);
}

double mask_gib(const Shape& s) {
  return double(s.H) * double(s.T) * double(s.T) * 4.0 / double(int64_t{1} << 30);
}

// Peak memory of a materialised FoX / GRAPE-AP case in units of one fp32 [B, H, T, T] tensor:
// the number of such tensors alive at once (measured peaks, rounded up), for skipping the sizes
// that cannot fit (--max-mask-gib).
double tt_units(Impl i, Mode m) {
  const bool bwd = m == Mode::FwdBwd;
  switch (i) {  // measured at T = 1024, 2048 (B=1, H=8): 4.1 4.1 | 2.2 4.3 | 4.1 7.1 | 4.1 7.3
    case Impl::ComposedFox:
      return 5;
    case Impl::SdpaFox:
      return bwd ? 5 : 3;
    case Impl::ComposedAp:
      return bwd ? 8 : 5;
    case Impl::SdpaAp:
      return bwd ? 8 : 5;
    default:
      return 0;
  }
}
double tt_gib(const Shape& s) {
  return double(s.B) * double(s.H) * double(s.T) * double(s.T) * 4.0 / double(int64_t{1} << 30);
}

struct Outs {
  at::Tensor out, dq, dk, dv;
  std::vector<std::pair<std::string, at::Tensor>> dbias;  // gradients of the bias inputs
};

Outs run_ours(const Inputs& in, Bias b, Mode mode) {
  const Shape& s = in.s;
  const kernels::AttentionDims d{s.B, s.H, s.H, s.T, s.T, s.D};
  kernels::AttentionBias<float> bias;
  if (b == Bias::Alibi) {
    bias.lag_table = in.lag.data_ptr<float>();
    bias.lag_len = s.T;
  } else if (b == Bias::Fox) {  // c_i - c_j: the same cumulative sums twice
    bias.cq = in.c.data_ptr<double>();
    bias.ck = in.c.data_ptr<double>();
  } else if (b == Bias::GrapeAp) {
    bias.path_q = in.pq.data_ptr<float>();
    bias.path_k = in.pk.data_ptr<float>();
    bias.path_beta = in.beta.data_ptr<float>();
    bias.path_dim = kPathDim;
    bias.path_scale = kPathScale;
  }
  kernels::AttentionOptions o;
  o.causal = true;
  Outs r;
  r.out = at::empty_like(in.q);
  at::Tensor lse = at::empty({s.B, s.H, s.T}, in.q.options());
  kernels::attention_forward<float>(d, in.q.data_ptr<float>(), in.k.data_ptr<float>(),
                                    in.v.data_ptr<float>(), {}, bias, o, r.out.data_ptr<float>(),
                                    lse.data_ptr<float>());
  if (mode == Mode::FwdBwd) {
    r.dq = at::empty_like(in.q);
    r.dk = at::empty_like(in.k);
    r.dv = at::empty_like(in.v);
    kernels::AttentionBiasGrads<float> g;  // accumulated: zeroed
    at::Tensor gcq, gck, gpq, gpk, gbeta;
    if (b == Bias::Fox) {
      gcq = at::zeros_like(in.c);
      gck = at::zeros_like(in.c);
      g.cq = gcq.data_ptr<double>();
      g.ck = gck.data_ptr<double>();
    } else if (b == Bias::GrapeAp) {
      gpq = at::zeros_like(in.pq);
      gpk = at::zeros_like(in.pk);
      gbeta = at::zeros_like(in.beta);
      g.path_q = gpq.data_ptr<float>();
      g.path_k = gpk.data_ptr<float>();
      g.path_beta = gbeta.data_ptr<float>();
    }
    kernels::attention_backward<float>(
        d, in.q.data_ptr<float>(), in.k.data_ptr<float>(), in.v.data_ptr<float>(), {}, bias, o,
        in.dout.data_ptr<float>(), r.out.data_ptr<float>(), lse.data_ptr<float>(),
        r.dq.data_ptr<float>(), r.dk.data_ptr<float>(), r.dv.data_ptr<float>(), g);
    if (b == Bias::Fox) r.dbias = {{"dc", gcq + gck}};  // c enters as cq and as ck
    if (b == Bias::GrapeAp) r.dbias = {{"dpath_q", gpq}, {"dpath_k", gpk}, {"dpath_beta", gbeta}};
  }
  return r;
}

// The FoX / GRAPE-AP bias [B, H, T, T] from c (FoX) or pq, pk, beta (GRAPE-AP) in plain LibTorch
// ops; valid on and below the diagonal (above it: finite values the caller masks).
//   FoX       c_i - c_j, from c rounded to fp32 (what an fp32 model computes; the kernel
//             subtracts in float64)
//   GRAPE-AP  A = beta_h logsigmoid(scale pq_i . pk_l), zero for l > i; bias(i, j) =
//             sum_{l=j+1..i} A[i, l] = row total - inclusive cumulative sum along l
at::Tensor composed_bias(const Inputs& in, Bias b, const at::Tensor& c, const at::Tensor& pq,
                         const at::Tensor& pk, const at::Tensor& beta) {
  if (b == Bias::Fox) {
    const at::Tensor cf = c.to(at::kFloat);
    return cf.unsqueeze(-1) - cf.unsqueeze(-2);
  }
  at::Tensor a =
      at::log_sigmoid(at::matmul(pq, pk.transpose(-2, -1)) * kPathScale) * beta.view({1, -1, 1, 1});
  a = a.masked_fill(in.upper, 0.0);
  return a.sum(-1, true) - a.cumsum(-1);
}

// composed: softmax(q k^T / sqrt(D) + bias, causal) v in plain ops; sdpa: SDPA with the bias
// as a float mask (-inf above the diagonal). Forward+backward: autograd through the bias
// construction too (c, or pq, pk, beta, require grad).
Outs run_materialised(const Inputs& in, Bias b, bool sdpa, Mode mode) {
  const auto attend = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& bias) {
    const double ninf = -std::numeric_limits<double>::infinity();
    if (sdpa)
      return at::scaled_dot_product_attention(q, k, v, bias.masked_fill(in.upper, ninf), 0.0,
                                              false);
    const at::Tensor qs = q * (1.0 / std::sqrt(static_cast<double>(in.s.D)));
    const at::Tensor scores =
        (at::matmul(qs, k.transpose(-2, -1)) + bias).masked_fill(in.upper, ninf);
    return at::matmul(at::softmax(scores, -1), v);
  };
  if (mode == Mode::Fwd) {
    c10::InferenceMode guard;
    return {attend(in.q, in.k, in.v, composed_bias(in, b, in.c, in.pq, in.pk, in.beta)),
            {},
            {},
            {},
            {}};
  }
  const auto leaf = [](const at::Tensor& x) { return x.detach().requires_grad_(true); };
  const at::Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
  std::vector<at::Tensor> xs = {q, k, v};
  at::Tensor c, pq, pk, beta;
  if (b == Bias::Fox) {
    c = leaf(in.c);
    xs.push_back(c);
  } else {
    pq = leaf(in.pq);
    pk = leaf(in.pk);
    beta = leaf(in.beta);
    xs.insert(xs.end(), {pq, pk, beta});
  }
  const at::Tensor out = attend(q, k, v, composed_bias(in, b, c, pq, pk, beta));
  const auto g = torch::autograd::grad({out}, xs, {in.dout});
  Outs r{out.detach(), g[0], g[1], g[2], {}};
  if (b == Bias::Fox)
    r.dbias = {{"dc", g[3]}};
  else
    r.dbias = {{"dpath_q", g[3]}, {"dpath_k", g[4]}, {"dpath_beta", g[5]}};
  return r;
}

// A case through autograd: attend(q, k, v) -> out on the half copies (half: forward, and the
// backward by autograd from douth) or on the float32 inputs; outputs returned as computed (the
// checks promote them; a conversion here would be timed).
template <class Attend>
Outs run_autograd(const Inputs& in, bool half, Mode mode, Attend attend) {
  const at::Tensor &q0 = half ? in.qh : in.q, &k0 = half ? in.kh : in.k, &v0 = half ? in.vh : in.v;
  if (mode == Mode::Fwd) {
    c10::InferenceMode guard;
    return {attend(q0, k0, v0), {}, {}, {}, {}};
  }
  const at::Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
                   v = v0.detach().requires_grad_(true);
  const at::Tensor out = attend(q, k, v);
  const auto g = torch::autograd::grad({out}, {q, k, v}, {half ? in.douth : in.dout});
  return {out.detach(), g[0], g[1], g[2], {}};
}

// The op users call (relpos::nn::fused_attention and its autograd), on the half copies or on
// the float32 inputs (ours_op: the like-for-like float32 baseline of the half cases).
Outs run_ours_op(const Inputs& in, bool half, Mode mode) {
  nn::AttentionArgs args;
  args.causal = true;
  return run_autograd(in, half, mode,
                      [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
                        return nn::fused_attention(q, k, v, args)[0];
                      });
}

// SDPA on the half copies (its own half kernels).
Outs run_sdpa_half(const Inputs& in, Mode mode) {
  return run_autograd(in, true, mode,
                      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
                        return at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
                      });
}

Outs run_sdpa(const Inputs& in, bool mask, Mode mode) {
  std::optional<at::Tensor> m;
  if (mask) m = in.mask;
  if (mode == Mode::Fwd) {
    c10::InferenceMode guard;
    return {at::scaled_dot_product_attention(in.q, in.k, in.v, m, 0.0, !mask), {}, {}, {}, {}};
  }
  const at::Tensor q = in.q.detach().requires_grad_(true), k = in.k.detach().requires_grad_(true),
                   v = in.v.detach().requires_grad_(true);
  const at::Tensor out = at::scaled_dot_product_attention(q, k, v, m, 0.0, !mask);
  const auto g = torch::autograd::grad({out}, {q, k, v}, {in.dout});
  return {out.detach(), g[0], g[1], g[2], {}};
}

Outs run_case(const Inputs& in, Impl impl, Mode mode) {
  switch (impl) {
    case Impl::Ours:
      return run_ours(in, Bias::None, mode);
    case Impl::OursLag:
      return run_ours(in, Bias::Alibi, mode);
    case Impl::Sdpa:
      return run_sdpa(in, false, mode);
    case Impl::SdpaMask:
      return run_sdpa(in, true, mode);
    case Impl::OursFox:
    case Impl::OursAp:
      return run_ours(in, bias_of(impl), mode);
    case Impl::ComposedFox:
    case Impl::ComposedAp:
      return run_materialised(in, bias_of(impl), false, mode);
    case Impl::SdpaFox:
    case Impl::SdpaAp:
      return run_materialised(in, bias_of(impl), true, mode);
    case Impl::OursBf16:
    case Impl::OursFp16:
      return run_ours_op(in, true, mode);
    case Impl::OursOp:
      return run_ours_op(in, false, mode);
    case Impl::SdpaBf16:
    case Impl::SdpaFp16:
      return run_sdpa_half(in, mode);
  }
  return {};
}

// The per-T constants a case needs (built once per T, untimed): the ALiBi mask, the bool
// causal mask of the materialised FoX / GRAPE-AP cases.
void prepare(Inputs& in, Impl impl) {
  if (impl == Impl::SdpaMask && !in.mask.defined()) make_mask(in);
  if (materialises(impl) && !in.upper.defined()) make_upper(in);
  if (storage_of(impl) != at::kFloat && in.qh.scalar_type() != storage_of(impl))
    make_half(in, storage_of(impl));
}

// CPU time of the whole process (every thread), ms.
double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return 1e3 * static_cast<double>(ts.tv_sec) + 1e-6 * static_cast<double>(ts.tv_nsec);
}

// Wall-clock ms of one call; *cpu_ms (if given) gets the process CPU time it took.
double time_ms(const Inputs& in, Impl impl, Mode mode, double* cpu_ms = nullptr) {
  const double c0 = process_cpu_ms();
  const auto t0 = std::chrono::steady_clock::now();
  { const Outs r = run_case(in, impl, mode); }  // outputs freed inside the timed region too
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (cpu_ms) *cpu_ms = process_cpu_ms() - c0;
  return ms;
}

struct Memory {
  bool ok = false;
  double peak_above_inputs_mib = 0, inputs_rss_mib = 0, mask_mib = 0;
  bool peak_reset = false;
  std::string error;
};

struct Result {
  int64_t T;
  Mode mode;
  Impl impl;
  std::vector<double> runs_ms, cpu_ms;
  // at::mm's time in each round (the same rounds as runs_ms): this host's matrix-product rate
  // at the moment the case ran, which a start-and-end measurement misses on a shared machine
  std::vector<double> mm_ms;
  double median_ms = std::nan("");
  std::string skipped;
  Memory mem;
};

struct Check {
  int64_t T;
  Mode mode;
  std::string ours, ref;
  std::vector<std::pair<std::string, std::pair<double, double>>>
      diffs;  // name: max |diff|, max |ref|
  bool ok = true;
  std::string note;
};

Check compare(int64_t T, Mode mode, Impl ours, const Outs& a, Impl ref, const Outs& b) {
  Check c{T, mode, name(ours), name(ref), {}, true, {}};
  // fp32 accumulation in both; half storage adds the rounding of q, k, v, the output and the
  // gradients (a few units of 2^-8 for bf16, 2^-11 for fp16)
  const at::ScalarType st = storage_of(ours);
  const double tol = st == at::kBFloat16 ? 3e-2 : st == at::kHalf ? 4e-3 : 1e-3;
  const auto one = [&](const char* what, const at::Tensor& x, const at::Tensor& y) {
    if (!x.defined() || !y.defined()) return;
    const double diff = (x - y).abs().max().item<double>();
    const double scale = y.abs().max().item<double>();
    c.diffs.push_back({what, {diff, scale}});
    if (!(diff <= tol * std::max(1.0, scale))) c.ok = false;  // a NaN fails too
  };
  one("out", a.out, b.out);
  one("dq", a.dq, b.dq);
  one("dk", a.dk, b.dk);
  one("dv", a.dv, b.dv);
  for (const auto& [n, x] : a.dbias)
    for (const auto& [m, y] : b.dbias)
      if (n == m) one(n.c_str(), x, y);
  return c;
}

// ---------------------------------------------------------------------------------------------
// Memory of one case, measured in this (child) process; see the file comment.
Memory measure_here(const Shape& s, Impl impl, Mode mode) {
  {
    Inputs w = make_inputs({s.B, s.H, std::min<int64_t>(s.T, 256), s.D});
    prepare(w, impl);
    for (int r = 0; r < 2; ++r) run_case(w, impl, mode);
  }
  Inputs in = make_inputs(s);
  Memory m;
  const int64_t base = rss_kib();
  prepare(in, impl);
  if (in.mask.defined()) m.mask_mib = double(in.mask.numel()) * 4.0 / (1 << 20);
  if (in.upper.defined()) m.mask_mib = double(in.upper.numel()) / (1 << 20);
  m.peak_reset = reset_peak_rss();
  { const Outs r = run_case(in, impl, mode); }
  const int64_t peak = peak_rss_kib();
  m.ok = base > 0 && peak > 0;
  m.inputs_rss_mib = double(base) / 1024.0;
  m.peak_above_inputs_mib = double(peak - base) / 1024.0;
  return m;
}

json memory_json(const Memory& m) {
  json j = {{"ok", m.ok},
            {"peak_above_inputs_mib", m.peak_above_inputs_mib},
            {"inputs_rss_mib", m.inputs_rss_mib},
            {"peak_reset", m.peak_reset}};
  if (m.mask_mib > 0) j["mask_mib"] = m.mask_mib;
  if (!m.error.empty()) j["error"] = m.error;
  return j;
}

// Runs this program again with --memory-child for one case and reads its report.
Memory measure_in_child(const Args& a, int64_t T, Impl impl, Mode mode) {
  Memory m;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) {
    m.error = "cannot read /proc/self/exe";
    return m;
  }
  static int counter = 0;
  const fs::path out = fs::temp_directory_path() /
                       fmt::format("relpos-bench-memory-{}-{}.json", ::getpid(), counter++);
  std::vector<std::string> argv = {self.string(),
                                   "attention",
                                   "--memory-child",
                                   name(impl),
                                   "--memory-mode",
                                   name(mode),
                                   "--memory-T",
                                   std::to_string(T),
                                   "--memory-out",
                                   out.string(),
                                   "--B",
                                   std::to_string(a.B),
                                   "--H",
                                   std::to_string(a.H),
                                   "--D",
                                   std::to_string(a.D),
                                   "--threads",
                                   std::to_string(a.threads)};
  const int rc = run_program(argv, fs::current_path(ec));
  try {
    std::ifstream f(out);
    if (rc != 0 || !f) throw std::runtime_error(fmt::format("child exited with status {}", rc));
    const json j = json::parse(f);
    m.ok = j.at("ok").get<bool>();
    m.peak_above_inputs_mib = j.at("peak_above_inputs_mib").get<double>();
    m.inputs_rss_mib = j.at("inputs_rss_mib").get<double>();
    m.peak_reset = j.at("peak_reset").get<bool>();
    m.mask_mib = j.value("mask_mib", 0.0);
  } catch (const std::exception& e) {
    m.ok = false;
    m.error = e.what();
  }
  fs::remove(out, ec);
  return m;
}

// ---------------------------------------------------------------------------------------------
struct MmResult {
  int n;
  std::vector<double> runs_ms;
  double median_ms, gflops;
};

double mm_gflops(int n, double ms) {
  return 2.0 * double(n) * n * n / (ms * 1e6);
}

// One n x n x n float32 at::mm, the machine's matrix-product yardstick.
class MmYardstick {
 public:
  explicit MmYardstick(int n) : n_(n) {
    at::manual_seed(1);
    a_ = at::randn({n, n});
    b_ = at::randn({n, n});
    c_ = at::mm(a_, b_);
  }
  double time_ms() {
    const auto t0 = std::chrono::steady_clock::now();
    at::mm_out(c_, a_, b_);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  int n_;
  at::Tensor a_, b_, c_;
};

MmResult bench_mm(int n, int repeats) {
  MmYardstick mm(n);
  MmResult r{n, {}, 0, 0};
  for (int i = 0; i < std::max(repeats, 5); ++i) r.runs_ms.push_back(mm.time_ms());
  r.median_ms = median(r.runs_ms);
  r.gflops = mm_gflops(n, r.median_ms);
  return r;
}

json mm_json(const MmResult& m) {
  return {{"n", m.n}, {"runs_ms", m.runs_ms}, {"median_ms", m.median_ms}, {"gflops", m.gflops}};
}

struct ScalingRow {
  Impl impl;
  int threads;
  std::vector<double> runs_ms;
  double median_ms;
};

// ---------------------------------------------------------------------------------------------
struct Report {
  Args a;
  std::vector<Result> results, long_results;
  std::vector<Check> checks;
  MmResult mm_start{}, mm_end{};
  std::vector<ScalingRow> scaling;
  int64_t scaling_T = 0;
  double max_mask_gib = 0;
  int at_threads = 0, omp_max = 0, omp_used = 0;
  bool checks_ok = true;
};

const Result* find(const std::vector<Result>& rs, int64_t T, Mode m, Impl i) {
  for (const auto& r : rs)
    if (r.T == T && r.mode == m && r.impl == i && r.skipped.empty()) return &r;
  return nullptr;
}

std::optional<double> ratio(const std::vector<Result>& rs, int64_t T, Mode m, Impl num, Impl den) {
  const Result *a = find(rs, T, m, num), *b = find(rs, T, m, den);
  if (!a || !b) return std::nullopt;
  return a->median_ms / b->median_ms;
}
// Median over the repeats of num's run i / den's run i: the two ran in the same round, so load that
// comes and goes cancels more than in the ratio of medians.
std::optional<double> paired_ratio(const std::vector<Result>& rs, int64_t T, Mode m, Impl num,
                                   Impl den) {
  const Result *a = find(rs, T, m, num), *b = find(rs, T, m, den);
  if (!a || !b || a->runs_ms.size() != b->runs_ms.size()) return std::nullopt;
  std::vector<double> x;
  for (size_t i = 0; i < a->runs_ms.size(); ++i) x.push_back(a->runs_ms[i] / b->runs_ms[i]);
  return median(x);
}

bool selected(const Args& a, Bias b) {
  return std::find(a.biases.begin(), a.biases.end(), name(b)) != a.biases.end();
}

// composed / ours and sdpa / ours of a FoX / GRAPE-AP bias (medians, and paired in brackets).
struct BiasRatios {
  std::optional<double> composed, sdpa, composed_paired, sdpa_paired;
};
BiasRatios bias_ratios(const std::vector<Result>& rs, int64_t T, Mode m, Bias b) {
  const BiasCases c = cases_of(b);
  return {ratio(rs, T, m, c.composed, c.ours), ratio(rs, T, m, c.sdpa, c.ours),
          paired_ratio(rs, T, m, c.composed, c.ours), paired_ratio(rs, T, m, c.sdpa, c.ours)};
}

// Times every selected case at one T (round-robin), after checking ours against SDPA (and, at
// the smallest T, the FoX / GRAPE-AP cases against their composition).
void run_size(Report& rep, const Shape& s, const std::vector<Mode>& modes,
              const std::vector<Impl>& impls, bool long_run) {
  const Args& a = rep.a;
  std::vector<Result> res;
  for (Mode m : modes)
    for (Impl i : impls) {
      Result r{s.T, m, i, {}, {}, {}, std::nan(""), {}, {}};
      if (i == Impl::SdpaMask && mask_gib(s) > rep.max_mask_gib)
        r.skipped = fmt::format("mask {:.1f} GiB > limit {:.1f} GiB (--max-mask-gib)", mask_gib(s),
                                rep.max_mask_gib);
      if (materialises(i) && tt_units(i, m) * tt_gib(s) > rep.max_mask_gib)
        r.skipped = fmt::format(
            "about {:.0f} x {:.1f} GiB [B,H,T,T] tensors > limit {:.1f} GiB "
            "(--max-mask-gib)",
            tt_units(i, m), tt_gib(s), rep.max_mask_gib);
      res.push_back(r);
    }
  {
    Inputs in = make_inputs(s);
    for (const auto& r : res)
      if (r.skipped.empty()) prepare(in, r.impl);
    // correctness, once per case (the first call also warms it up)
    for (Mode m : modes) {
      std::vector<std::pair<Impl, Outs>> outs;
      for (const auto& r : res)
        if (r.mode == m && r.skipped.empty()) outs.push_back({r.impl, run_case(in, r.impl, m)});
      const auto get = [&](Impl i) -> const Outs* {
        for (const auto& [j, o] : outs)
          if (j == i) return &o;
        return nullptr;
      };
      // FoX / GRAPE-AP against their composition: at the smallest T only (the composition
      // rounds c to fp32, whose error grows with T; see composed_bias)
      std::vector<std::pair<Impl, Impl>> pairs = {{Impl::Ours, Impl::Sdpa},
                                                  {Impl::OursLag, Impl::SdpaMask},
                                                  {Impl::OursBf16, Impl::Sdpa},
                                                  {Impl::OursOp, Impl::Sdpa},
                                                  {Impl::OursFp16, Impl::Sdpa}};
      if (!long_run && s.T == *std::min_element(a.T.begin(), a.T.end()))
        for (Bias b : {Bias::Fox, Bias::GrapeAp}) {
          pairs.push_back({cases_of(b).ours, cases_of(b).composed});
          pairs.push_back({cases_of(b).sdpa, cases_of(b).composed});
        }
      for (const auto& [ours, ref] : pairs) {
        const Outs *x = get(ours), *y = get(ref);
        if (!x || !y) continue;
        rep.checks.push_back(compare(s.T, m, ours, *x, ref, *y));
        Check& c = rep.checks.back();
        if (ours == Impl::OursAp && !c.ok) {
          // a kernel without the path-integral bias ignores path_q etc.: say so
          const Outs plain = run_ours(in, Bias::None, Mode::Fwd);
          if (at::equal(plain.out, x->out))
            c.note =
                "the kernel ignored the path-integral bias (its output equals the unbiased "
                "one): this build has no GRAPE-AP support";
        }
        rep.checks_ok = rep.checks_ok && c.ok;
        double worst = 0;
        for (const auto& d : c.diffs) worst = std::max(worst, d.second.first);
        std::cerr << fmt::format("T={} {}: {} vs {}: max |diff| {:.2e} {}{}\n", s.T, name(m),
                                 c.ours, c.ref, worst, c.ok ? "ok" : "FAILED",
                                 c.note.empty() ? "" : " (" + c.note + ")");
      }
    }
    for (int w = 1; w < a.warmup; ++w)
      for (const auto& r : res)
        if (r.skipped.empty()) time_ms(in, r.impl, r.mode);
    // at::mm is one more case of every round (index res.size()), in the same random order
    MmYardstick mm(a.mm_n);
    RoundOrder order(res.size() + 1);
    for (int rep_i = 0; rep_i < a.repeats; ++rep_i) {
      double mm_ms = 0;
      for (const size_t i : order.next()) {
        if (i == res.size()) {
          mm_ms = mm.time_ms();
        } else if (auto& r = res[i]; r.skipped.empty()) {
          double cpu = 0;
          r.runs_ms.push_back(time_ms(in, r.impl, r.mode, &cpu));
          r.cpu_ms.push_back(cpu);
        }
      }
      for (auto& r : res)
        if (r.skipped.empty()) r.mm_ms.push_back(mm_ms);
    }
  }
  for (auto& r : res) {
    if (!r.skipped.empty()) {
      std::cerr << fmt::format("T={} {} {}: skipped ({})\n", r.T, name(r.mode), name(r.impl),
                               r.skipped);
      continue;
    }
    r.median_ms = median(r.runs_ms);
    if (a.memory) r.mem = measure_in_child(a, s.T, r.impl, r.mode);
    std::cerr << fmt::format(
        "T={} {} {}: median {:.2f} ms, {:.1f} GFLOP/s{}\n", r.T, name(r.mode), name(r.impl),
        r.median_ms, flops(s, r.mode) / (r.median_ms * 1e6),
        r.mem.ok ? fmt::format(", peak {:.0f} MiB above the inputs", r.mem.peak_above_inputs_mib)
                 : "");
  }
  auto& dst = long_run ? rep.long_results : rep.results;
  dst.insert(dst.end(), res.begin(), res.end());
}

// Forward of ours and sdpa with one thread and with all, round-robin over the repeats (a call
// after each change of the thread count is untimed).
void run_scaling(Report& rep, const Shape& s) {
  const int n = at::get_num_threads();
  if (n < 2) return;
  rep.scaling_T = s.T;
  Inputs in = make_inputs(s);
  for (Impl i : {Impl::Ours, Impl::Sdpa})
    for (int t : {1, n}) rep.scaling.push_back({i, t, {}, 0});
  for (int r = 0; r < rep.a.repeats; ++r)
    for (auto& row : rep.scaling) {
      at::set_num_threads(row.threads);
      time_ms(in, row.impl, Mode::Fwd);
      row.runs_ms.push_back(time_ms(in, row.impl, Mode::Fwd));
    }
  for (auto& row : rep.scaling) row.median_ms = median(row.runs_ms);
  at::set_num_threads(n);
}

// ---------------------------------------------------------------------------------------------
// The median over rounds of the case's GFLOP/s over at::mm's in the same round.
double fraction_of_mm_in_rounds(const Report& rep, const Result& r) {
  const double f = flops({rep.a.B, rep.a.H, r.T, rep.a.D}, r.mode);
  std::vector<double> ratios;
  for (size_t i = 0; i < r.runs_ms.size() && i < r.mm_ms.size(); ++i)
    ratios.push_back(f / (r.runs_ms[i] * 1e6) / mm_gflops(rep.a.mm_n, r.mm_ms[i]));
  return ratios.empty() ? std::nan("") : median(ratios);
}

json result_json(const Report& rep, const Result& r) {
  const Shape s{rep.a.B, rep.a.H, r.T, rep.a.D};
  json j = {{"T", r.T}, {"mode", name(r.mode)}, {"case", name(r.impl)}};
  if (!r.skipped.empty()) {
    j["skipped"] = r.skipped;
    return j;
  }
  const double gf = flops(s, r.mode) / (r.median_ms * 1e6);
  j["runs_ms"] = r.runs_ms;
  j["median_ms"] = r.median_ms;
  j["cpu_runs_ms"] = r.cpu_ms;
  j["median_cpu_ms"] = median(r.cpu_ms);
  j["gflops"] = gf;
  j["fraction_of_mm"] = gf / rep.mm_start.gflops;
  j["mm_runs_ms"] = r.mm_ms;
  j["fraction_of_mm_in_rounds"] = fraction_of_mm_in_rounds(rep, r);
  if (rep.a.memory) j["memory"] = memory_json(r.mem);
  return j;
}

json targets_json(const Report& rep) {
  json t = json::object();
  json nob = json::array();
  bool nob_met = true, any = false;
  for (int64_t T : rep.a.T)
    for (Mode m : {Mode::Fwd, Mode::FwdBwd})
      if (const auto x = ratio(rep.results, T, m, Impl::Ours, Impl::Sdpa)) {
        nob.push_back({{"T", T}, {"mode", name(m)}, {"ours_over_sdpa", *x}, {"met", *x <= 1.25}});
        nob_met = nob_met && *x <= 1.25;
        any = true;
      }
  t["no_bias_within_1.25x_of_sdpa"] = {{"rows", nob}, {"met", any ? json(nob_met) : json()}};
  json lag = json::array();
  bool lag_met = true;
  any = false;
  for (Mode m : {Mode::Fwd, Mode::FwdBwd})
    if (const auto x = ratio(rep.results, 8192, m, Impl::SdpaMask, Impl::OursLag)) {
      lag.push_back(
          {{"T", 8192}, {"mode", name(m)}, {"sdpa_mask_over_ours_lag", *x}, {"met", *x >= 2.0}});
      lag_met = lag_met && *x >= 2.0;
      any = true;
    }
  t["lag_table_2x_faster_than_sdpa_mask_at_8192"] = {{"rows", lag},
                                                     {"met", any ? json(lag_met) : json()}};
  json lm = json::array();
  bool lm_met = true;
  any = false;
  for (const auto& r : rep.long_results)
    if ((r.impl == Impl::Ours || r.impl == Impl::OursLag) && r.mem.ok) {
      const bool met = r.mem.peak_above_inputs_mib * (1 << 20) < 1e9;
      lm.push_back({{"T", r.T},
                    {"case", name(r.impl)},
                    {"peak_above_inputs_mib", r.mem.peak_above_inputs_mib},
                    {"met", met}});
      lm_met = lm_met && met;
      any = true;
    }
  t["long_forward_peak_below_1GB"] = {{"rows", lm}, {"met", any ? json(lm_met) : json()}};
  for (Bias b : {Bias::Fox, Bias::GrapeAp}) {
    if (!selected(rep.a, b)) continue;
    const BiasCases c = cases_of(b);
    const std::string key = b == Bias::Fox ? "fox" : "grape_ap";
    // forward+backward at T = 8192: at least 2x faster than the composition and than SDPA
    json rows = json::array();
    bool met = true;
    any = false;
    for (Mode m : {Mode::FwdBwd})
      for (Impl ref : {c.composed, c.sdpa}) {
        const std::optional<double> x = ratio(rep.results, 8192, m, ref, c.ours);
        if (x) {
          rows.push_back({{"T", 8192},
                          {"mode", name(m)},
                          {"case", name(ref)},
                          {"over_ours", *x},
                          {"met", *x >= 2.0}});
          met = met && *x >= 2.0;
          any = true;
        } else {
          for (const auto& r : rep.results)
            if (r.T == 8192 && r.mode == m && r.impl == ref && !r.skipped.empty())
              rows.push_back(
                  {{"T", 8192}, {"mode", name(m)}, {"case", name(ref)}, {"skipped", r.skipped}});
        }
      }
    t[key + "_fwdbwd_2x_faster_than_composed_and_sdpa_at_8192"] = {
        {"rows", rows}, {"met", any ? json(met) : json()}};
    // ours' peak memory linear in T: peak(T) <= 1.5 (T / T0) max(peak(T0), 8 MiB), T0 the
    // smallest T measured
    json mrows = json::array();
    bool mmet = true;
    any = false;
    for (Mode m : {Mode::Fwd, Mode::FwdBwd}) {
      const Result* first = nullptr;
      for (const auto& r : rep.results) {
        if (r.mode != m || r.impl != c.ours || !r.skipped.empty() || !r.mem.ok) continue;
        if (!first || r.T < first->T) first = &r;
      }
      if (!first) continue;
      for (const auto& r : rep.results) {
        if (r.mode != m || r.impl != c.ours || !r.skipped.empty() || !r.mem.ok) continue;
        const double bound =
            1.5 * double(r.T) / double(first->T) * std::max(first->mem.peak_above_inputs_mib, 8.0);
        const bool ok = r.mem.peak_above_inputs_mib <= bound;
        mrows.push_back({{"T", r.T},
                         {"mode", name(m)},
                         {"case", name(r.impl)},
                         {"peak_above_inputs_mib", r.mem.peak_above_inputs_mib},
                         {"bound_mib", bound},
                         {"met", ok}});
        if (r.T != first->T) {
          mmet = mmet && ok;
          any = true;
        }
      }
    }
    t[key + "_ours_memory_linear_in_T"] = {{"rows", mrows}, {"met", any ? json(mmet) : json()}};
  }
  // issue 26: faster than SDPA at every T (ratio of the medians and the per-round median both
  // under 1), and at least 75% of at::mm's GFLOP/s of the same rounds from T = 4096
  json fast = json::array(), frac = json::array();
  bool fast_met = true, frac_met = true, any_fast = false, any_frac = false;
  for (const auto* rs : {&rep.results, &rep.long_results})
    for (const Result& r : *rs) {
      if (r.impl != Impl::Ours || !r.skipped.empty()) continue;
      const auto x = ratio(*rs, r.T, r.mode, Impl::Ours, Impl::Sdpa);
      const auto y = paired_ratio(*rs, r.T, r.mode, Impl::Ours, Impl::Sdpa);
      if (x && y) {
        const bool met = *x < 1 && *y < 1;
        fast.push_back({{"T", r.T},
                        {"mode", name(r.mode)},
                        {"ours_over_sdpa", *x},
                        {"per_round", *y},
                        {"met", met}});
        fast_met = fast_met && met;
        any_fast = true;
      }
      if (r.T >= 4096) {
        const double f = fraction_of_mm_in_rounds(rep, r);
        const bool met = f >= 0.75;
        frac.push_back({{"T", r.T}, {"mode", name(r.mode)}, {"fraction", f}, {"met", met}});
        frac_met = frac_met && met;
        any_frac = true;
      }
    }
  t["faster_than_sdpa_at_every_T"] = {{"rows", fast}, {"met", any_fast ? json(fast_met) : json()}};
  t["at_least_75pct_of_mm_same_rounds_from_4096"] = {{"rows", frac},
                                                     {"met", any_frac ? json(frac_met) : json()}};
  return t;
}

// The first bytes of report_json(...).dump(2): "benchmark" is its first key (nlohmann::json
// orders keys), so an earlier report can be told from anyone else's file (--json-out).
constexpr const char* kJsonHeader = "{\n  \"benchmark\": \"attention\",\n";

json report_json(const Report& rep) {
  const Args& a = rep.a;
  json j;
  j["benchmark"] = "attention";
  j["shape"] = {{"B", a.B},      {"H", a.H},           {"D", a.D},
                {"T", a.T},      {"dtype", "float32"}, {"half_dtype", a.dtype},
                {"causal", true}};
  j["biases"] = a.biases;
  if (selected(a, Bias::Fox) || selected(a, Bias::GrapeAp))
    j["bias_setup"] = {
        {"fox",
         "c = cumsum(logsigmoid(N(0,1))) float64 [B,H,T]; bias c_i - c_j (ours: cq = ck "
         "= c; composed/sdpa: c rounded to fp32, then the difference)"},
        {"grape-ap",
         fmt::format("probes N(0,1) [B,H,T,{}], path_scale {}, beta = ALiBi slopes; bias(i,j) = "
                     "sum_{{l=j+1..i}} beta_h logsigmoid(scale pq_i . pk_l)",
                     kPathDim, kPathScale)},
        {"composed",
         "plain LibTorch ops with the materialised [B,H,T,T] bias, built on every call (and "
         "differentiated: the bias inputs require grad)"},
        {"sdpa",
         "at::scaled_dot_product_attention with the bias as a float mask (-inf above "
         "the diagonal), is_causal=false, built on every call"}};
  j["kernel_isa"] = kernels::kernel_isa();
  j["torch_version"] = torch_version();
  j["threads"] = {{"requested", a.threads},
                  {"at_get_num_threads", rep.at_threads},
                  {"omp_get_max_threads", rep.omp_max},
                  {"omp_threads_in_a_parallel_region", rep.omp_used},
                  {"hardware_concurrency", std::thread::hardware_concurrency()}};
  j["repeats"] = a.repeats;
  j["warmup"] = a.warmup;
  j["flop_convention"] =
      "useful flops: causal forward 4 B H T^2 D / 2 (two T x T x D products over half the "
      "pairs), backward 2.5x that, forward+backward 3.5x; sdpa_mask is credited with the same "
      "count although it computes every pair";
  j["memory_method"] =
      "each case once in a child process: warm-up at T=256, inputs allocated, VmRSS read, mask "
      "built (sdpa_mask), VmHWM reset (/proc/self/clear_refs), one call, VmHWM - VmRSS; the "
      "outputs, gradients and the mask count, the inputs q, k, v, dout and the lag table do not";
  j["timing_method"] =
      "one process, round-robin over the cases of one T, after a checking call and --warmup "
      "calls; each call allocates its outputs (not the mask: built once per T, untimed); "
      "runs_ms wall clock, cpu_runs_ms the process CPU time of the same calls (every thread, "
      "spinning at barriers included)";
  j["mask_limit_gib"] = rep.max_mask_gib;
  j["mm_start"] = mm_json(rep.mm_start);
  j["mm_end"] = mm_json(rep.mm_end);
  json res = json::array();
  for (const auto& r : rep.results) res.push_back(result_json(rep, r));
  j["results"] = res;
  json ratios = json::array();
  for (int64_t T : a.T)
    for (Mode m : {Mode::Fwd, Mode::FwdBwd}) {
      json row = {{"T", T}, {"mode", name(m)}};
      const auto x = ratio(rep.results, T, m, Impl::Ours, Impl::Sdpa);
      const auto y = ratio(rep.results, T, m, Impl::OursLag, Impl::SdpaMask);
      const auto z = ratio(rep.results, T, m, Impl::OursLag, Impl::Ours);
      if (!x && !y && !z) continue;
      row["ours_over_sdpa"] = x ? json(*x) : json();
      row["ours_lag_over_sdpa_mask"] = y ? json(*y) : json();
      row["ours_lag_over_ours"] = z ? json(*z) : json();
      const auto px = paired_ratio(rep.results, T, m, Impl::Ours, Impl::Sdpa);
      const auto py = paired_ratio(rep.results, T, m, Impl::OursLag, Impl::SdpaMask);
      row["ours_over_sdpa_paired"] = px ? json(*px) : json();
      row["ours_lag_over_sdpa_mask_paired"] = py ? json(*py) : json();
      ratios.push_back(row);
    }
  j["ratios"] = ratios;
  json bratios = json::array();
  for (int64_t T : a.T)
    for (Mode m : {Mode::Fwd, Mode::FwdBwd})
      for (Bias b : {Bias::Fox, Bias::GrapeAp}) {
        const BiasRatios r = bias_ratios(rep.results, T, m, b);
        if (!r.composed && !r.sdpa) continue;
        const auto opt = [](const std::optional<double>& x) { return x ? json(*x) : json(); };
        bratios.push_back({{"T", T},
                           {"mode", name(m)},
                           {"bias", name(b)},
                           {"composed_over_ours", opt(r.composed)},
                           {"sdpa_over_ours", opt(r.sdpa)},
                           {"composed_over_ours_paired", opt(r.composed_paired)},
                           {"sdpa_over_ours_paired", opt(r.sdpa_paired)}});
      }
  j["bias_ratios"] = bratios;
  json checks = json::array();
  for (const auto& c : rep.checks) {
    json d = json::object();
    for (const auto& [n, v] : c.diffs)
      d[n] = {{"max_abs_diff", v.first}, {"ref_max_abs", v.second}};
    checks.push_back({{"T", c.T},
                      {"mode", name(c.mode)},
                      {"ours", c.ours},
                      {"reference", c.ref},
                      {"diffs", d},
                      {"ok", c.ok}});
    if (!c.note.empty()) checks.back()["note"] = c.note;
  }
  j["checks"] = checks;
  j["checks_ok"] = rep.checks_ok;
  json lr = json::array();
  for (const auto& r : rep.long_results) lr.push_back(result_json(rep, r));
  j["long_forward"] = lr;
  json sc = json::array();
  for (const auto& r : rep.scaling)
    sc.push_back({{"T", rep.scaling_T},
                  {"mode", "fwd"},
                  {"case", name(r.impl)},
                  {"threads", r.threads},
                  {"runs_ms", r.runs_ms},
                  {"median_ms", r.median_ms}});
  j["thread_scaling"] = sc;
  j["targets"] = targets_json(rep);
  return j;
}

std::string fmt_opt(std::optional<double> x, const char* f = "{:.2f}") {
  return x ? fmt::format(fmt::runtime(f), *x) : std::string("-");
}

std::string runs_str(const std::vector<double>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? " / " : "") + fmt::format("{:.1f}", v[i]);
  return s;
}

void write_md_results(std::ostream& os, const Report& rep, const std::vector<Result>& rs) {
  os << "| T | pass | case | median ms | runs ms | CPU ms | GFLOP/s | of mm (start) | of mm (same "
        "rounds) | peak MiB above inputs |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rs) {
    if (!r.skipped.empty()) {
      os << fmt::format("| {} | {} | {} | skipped: {} | | | | | | |\n", r.T, name(r.mode),
                        name(r.impl), r.skipped);
      continue;
    }
    const double gf = flops({rep.a.B, rep.a.H, r.T, rep.a.D}, r.mode) / (r.median_ms * 1e6);
    std::string mem = "-";
    if (rep.a.memory)
      mem = r.mem.ok ? fmt::format("{:.0f}", r.mem.peak_above_inputs_mib) : "error: " + r.mem.error;
    if (r.mem.ok && r.mem.mask_mib > 0) mem += fmt::format(" (mask {:.0f})", r.mem.mask_mib);
    os << fmt::format("| {} | {} | {} | {:.2f} | {} | {:.1f} | {:.1f} | {:.0f}% | {:.0f}% | {} |\n",
                      r.T, name(r.mode), name(r.impl), r.median_ms, runs_str(r.runs_ms),
                      median(r.cpu_ms), gf, 100 * gf / rep.mm_start.gflops,
                      100 * fraction_of_mm_in_rounds(rep, r), mem);
  }
}

void write_md(std::ostream& os, const Report& rep) {
  const Args& a = rep.a;
  os << fmt::format(
      "# relpos bench attention\n\nB={} H={} D={} fp32 causal{}; kernel build {}; LibTorch {}; "
      "threads: at::get_num_threads {} / omp_get_max_threads {} / in a parallel region {}; "
      "{} repeats (medians), {} warm-up\n\n",
      a.B, a.H, a.D,
      a.dtype == "fp32" ? "" : fmt::format(" (and {} storage: the _{} cases)", a.dtype, a.dtype),
      kernels::kernel_isa(), torch_version(), rep.at_threads, rep.omp_max, rep.omp_used, a.repeats,
      a.warmup);
  os << fmt::format(
      "at::mm {}^3 fp32: {:.1f} GFLOP/s at the start ({:.1f} ms), {:.1f} GFLOP/s at the end\n\n",
      rep.mm_start.n, rep.mm_start.gflops, rep.mm_start.median_ms, rep.mm_end.gflops);
  write_md_results(os, rep, rep.results);
  if (selected(a, Bias::None) || selected(a, Bias::Alibi))
    os << "\nRatios of the medians (in brackets: the median over the rounds of the ratio within "
          "a round)\n\n| T | pass | ours / sdpa | ours_lag / sdpa_mask | sdpa_mask / ours_lag | "
          "ours_lag / ours |\n|---|---|---|---|---|---|\n";
  for (int64_t T : a.T)
    for (Mode m : {Mode::Fwd, Mode::FwdBwd}) {
      const auto x = ratio(rep.results, T, m, Impl::Ours, Impl::Sdpa);
      const auto y = ratio(rep.results, T, m, Impl::OursLag, Impl::SdpaMask);
      const auto z = ratio(rep.results, T, m, Impl::OursLag, Impl::Ours);
      if (!x && !y && !z) continue;
      const auto px = paired_ratio(rep.results, T, m, Impl::Ours, Impl::Sdpa);
      const auto py = paired_ratio(rep.results, T, m, Impl::OursLag, Impl::SdpaMask);
      os << fmt::format("| {} | {} | {} ({}) | {} ({}) | {} | {} |\n", T, name(m), fmt_opt(x),
                        fmt_opt(px), fmt_opt(y), fmt_opt(py),
                        fmt_opt(y ? std::optional<double>(1 / *y) : std::nullopt), fmt_opt(z));
    }
  if (a.dtype != "fp32") {
    const Impl oh = a.dtype == "bf16" ? Impl::OursBf16 : Impl::OursFp16,
               sh = a.dtype == "bf16" ? Impl::SdpaBf16 : Impl::SdpaFp16;
    os << fmt::format(
        "\nHalf storage ({0}): ratios of the medians (in brackets: the median over the rounds of "
        "the ratio within a round); ours_op is the same op on float32\n\n| T | pass | ours_{0} / "
        "ours_op (fp32) | ours_{0} / ours (fp32 kernel) | ours_{0} / sdpa_{0} | ours_{0} / sdpa "
        "(fp32) |\n|---|---|---|---|---|---|\n",
        a.dtype);
    for (int64_t T : a.T)
      for (Mode m : {Mode::Fwd, Mode::FwdBwd}) {
        std::string line = fmt::format("| {} | {} |", T, name(m));
        bool any = false;
        for (Impl base : {Impl::OursOp, Impl::Ours, sh, Impl::Sdpa}) {
          const auto x = ratio(rep.results, T, m, oh, base);
          any |= x.has_value();
          line += fmt::format(" {} ({}) |", fmt_opt(x),
                              fmt_opt(paired_ratio(rep.results, T, m, oh, base)));
        }
        if (any) os << line << "\n";
      }
  }
  bool any_bias = false;
  for (int64_t T : a.T)
    for (Mode m : {Mode::Fwd, Mode::FwdBwd})
      for (Bias b : {Bias::Fox, Bias::GrapeAp}) {
        const BiasRatios r = bias_ratios(rep.results, T, m, b);
        if (!r.composed && !r.sdpa) continue;
        if (!any_bias)
          os << "\nFoX / GRAPE-AP: time of the materialised bias over the fused kernel's (median "
                "ratio; in brackets the median over the rounds of the ratio within a round)\n\n"
                "| T | pass | bias | composed / ours | sdpa / ours |\n|---|---|---|---|---|\n";
        any_bias = true;
        os << fmt::format("| {} | {} | {} | {} ({}) | {} ({}) |\n", T, name(m), name(b),
                          fmt_opt(r.composed), fmt_opt(r.composed_paired), fmt_opt(r.sdpa),
                          fmt_opt(r.sdpa_paired));
      }
  os << "\nCorrectness (max |ours - reference|, max |reference|):\n\n";
  for (const auto& c : rep.checks) {
    std::string d;
    for (const auto& [n, v] : c.diffs)
      d += fmt::format(" {} {:.1e} ({:.1f})", n, v.first, v.second);
    os << fmt::format("- T={} {} {} vs {}:{} {}{}\n", c.T, name(c.mode), c.ours, c.ref, d,
                      c.ok ? "ok" : "FAILED", c.note.empty() ? "" : " (" + c.note + ")");
  }
  if (!rep.long_results.empty()) {
    os << "\nLong forward:\n\n";
    write_md_results(os, rep, rep.long_results);
  }
  if (!rep.scaling.empty()) {
    os << fmt::format("\nThreads (forward, T={}):", rep.scaling_T);
    for (const auto& r : rep.scaling)
      os << fmt::format(" {} {} thread{} {:.2f} ms;", name(r.impl), r.threads,
                        r.threads > 1 ? "s" : "", r.median_ms);
    os << "\n";
  }
  const json t = targets_json(rep);
  os << "\nTargets:\n";
  for (const auto& [k, v] : t.items())
    os << fmt::format(
        "- {}: {}\n", k,
        v["met"].is_null() ? "not measured" : (v["met"].get<bool>() ? "met" : "MISSED"));
}

void run(const Args& in_args) {
  Args a = in_args;
  set_threads(a.threads);
  if (!a.child_case.empty()) {  // one memory measurement (internal)
    const Memory m = measure_here({a.B, a.H, a.child_T, a.D}, impl_named(a.child_case),
                                  mode_named(a.child_mode));
    write_file_atomic(a.child_out, memory_json(m).dump());
    return;
  }
  for (int64_t T : a.T)
    if (T < 1 || T > (int64_t{1} << 20))
      throw InputError(fmt::format("--T {}: must be in [1, 2^20]", T));
  check_json_out(a.json_out, kJsonHeader);  // before anything runs
  Report rep;
  rep.a = a;
  if (a.long_T < 0) rep.a.long_T = 0;
  rep.at_threads = at::get_num_threads();
  rep.omp_max = omp_get_max_threads();
  rep.omp_used = used_omp_threads();
  const int64_t avail = mem_available_kib();
  rep.max_mask_gib =
      a.max_mask_gib >= 0 ? a.max_mask_gib : (avail > 0 ? 0.6 * double(avail) / (1 << 20) : 4.0);
  std::vector<Mode> modes;
  for (const auto& m : a.modes) modes.push_back(mode_named(m));
  std::vector<Impl> impls;
  for (Impl i : kImpls)
    if (selected(a, bias_of(i)) &&
        // (ours_op: with the half cases only, as their like-for-like float32 baseline)
        (i == Impl::OursOp ? a.dtype != "fp32"
                           : storage_of(i) == at::kFloat || a.dtype == dtype_name(storage_of(i))) &&
        (a.cases.empty() || std::find(a.cases.begin(), a.cases.end(), name(i)) != a.cases.end()))
      impls.push_back(i);
  if (impls.empty())
    throw InputError("no case left: --cases selects none of the cases of the --bias list");
  std::cerr << fmt::format("relpos bench attention: kernel build {}, {} threads\n",
                           kernels::kernel_isa(), rep.at_threads);
  rep.mm_start = bench_mm(a.mm_n, a.repeats);
  for (int64_t T : a.T) run_size(rep, {a.B, a.H, T, a.D}, modes, impls, false);
  if (rep.a.long_T > 0) {
    std::vector<Impl> li;
    for (Impl i : impls)
      if (i != Impl::SdpaMask && !materialises(i)) li.push_back(i);
    run_size(rep, {a.B, a.H, rep.a.long_T, a.D}, {Mode::Fwd}, li, true);
  }
  if (a.scaling) {
    int64_t ts = a.T.front();
    for (int64_t T : a.T)
      if (T <= 4096) ts = std::max(ts, T);
    run_scaling(rep, {a.B, a.H, ts, a.D});
  }
  rep.mm_end = bench_mm(a.mm_n, a.repeats);
  if (a.format == "json")
    std::cout << report_json(rep).dump(2) << "\n";
  else
    write_md(std::cout, rep);
  write_json_out(a.json_out, kJsonHeader, report_json(rep).dump(2) + "\n");
  if (!rep.checks_ok) {
    std::cerr << "relpos bench attention: a correctness check failed (see 'checks')\n";
    throw CheckFailed{};
  }
}

}  // namespace

void add_attention_command(CLI::App& app) {
  auto a = std::make_shared<Args>();
  auto* cmd = app.add_subcommand(
      "attention",
      "Fused attention kernel vs at::scaled_dot_product_attention (no bias, and an ALiBi lag "
      "bias as a materialised mask vs our lag table; with --bias fox / grape-ap: the fused FoX / "
      "GRAPE-AP biases vs their composition in plain ops and vs SDPA fed the materialised "
      "bias): time, GFLOP/s, peak memory, correctness");
  cmd->add_option("--T", a->T, "sequence lengths, comma-separated (default 1024,4096,8192,16384)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--B", a->B, "batch")->check(CLI::Range(1, 1024));
  cmd->add_option("--H", a->H, "heads")->check(CLI::Range(1, 1024));
  cmd->add_option("--D", a->D, "head dimension")->check(CLI::Range(1, 1024));
  cmd->add_option("--repeats", a->repeats, "timed calls per case (medians)")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--warmup", a->warmup, "untimed calls per case, the checking call included")
      ->check(CLI::Range(1, 100));
  cmd->add_option("--threads", a->threads, "threads (at::set_num_threads); 0: LibTorch's default")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--format", a->format, "md or json")->check(CLI::IsMember({"md", "json"}));
  cmd->add_option("--json-out", a->json_out, "also write the JSON report to this file");
  cmd->add_option("--modes", a->modes, "fwd,fwdbwd")
      ->delimiter(',')
      ->check(CLI::IsMember({"fwd", "fwdbwd"}));
  std::vector<std::string> bias_names, case_names;
  for (Bias b : kBiases) bias_names.push_back(name(b));
  for (Impl i : kImpls) case_names.push_back(name(i));
  cmd->add_option("--bias", a->biases,
                  "biases, comma-separated: none (ours, sdpa), alibi (ours_lag, sdpa_mask), fox "
                  "(ours_fox, composed_fox, sdpa_fox), grape-ap (ours_grape_ap, "
                  "composed_grape_ap, sdpa_grape_ap); default none,alibi")
      ->delimiter(',')
      ->check(CLI::IsMember(bias_names));
  cmd->add_option("--dtype", a->dtype,
                  "fp32, or bf16 / fp16: adds ours_<dtype> (half storage through the op), "
                  "sdpa_<dtype> (SDPA on the half tensors) and ours_op (the op on float32) beside "
                  "the fp32 cases, and their ratios")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  cmd->add_option("--cases", a->cases,
                  "restrict to these cases (comma-separated) of the --bias list; default: all "
                  "of them")
      ->delimiter(',')
      ->check(CLI::IsMember(case_names));
  auto* lt = cmd->add_option("--long-T", a->long_T,
                             "a forward-only size after the others (the selected cases that "
                             "materialise no T x T tensor: ours, sdpa, ours_lag, ours_fox, "
                             "ours_grape_ap); default 32768 with the default --T list, none when "
                             "--T is given; 0: none")
                 ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--max-mask-gib", a->max_mask_gib,
                  "skip sdpa_mask where the [1,H,T,T] mask is larger, and the materialised FoX / "
                  "GRAPE-AP cases where their estimated peak is (default: 60% of MemAvailable)")
      ->check(app::FiniteRange(0.0, 1e6));
  cmd->add_option("--mm-n", a->mm_n, "at::mm size for the machine's GFLOP/s")
      ->check(CLI::Range(16, 16384));
  cmd->add_flag("!--no-memory", a->memory, "skip the peak-memory measurements (child processes)");
  cmd->add_flag("!--no-scaling", a->scaling, "skip the 1-thread vs all-threads forward");
  cmd->add_option("--memory-child", a->child_case)->group("");
  cmd->add_option("--memory-mode", a->child_mode)
      ->group("")
      ->check(CLI::IsMember({"fwd", "fwdbwd"}));
  cmd->add_option("--memory-T", a->child_T)
      ->group("")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--memory-out", a->child_out)->group("");
  auto* T_opt = cmd->get_option("--T");
  cmd->callback([a, T_opt, lt] {
    Args args = *a;
    if (lt->count() == 0) args.long_T = T_opt->count() == 0 ? 32768 : 0;
    if (!args.child_case.empty() && (args.child_T < 1 || args.child_out.empty()))
      throw InputError("--memory-child needs --memory-T and --memory-out");
    run(args);
  });
}

}  // namespace relpos::bench
