// The torch runtime of the `journey` family (JoFormer; core/mechanisms/journey.cpp): q and k turned
// by their frames R(theta_t) (pair m by +theta_{t,m}), and the frames handed back so that the
// module turns values into them (roles.values) and outputs back out (roles.outputs):
//   fixed angles   theta_t = p_t f_m from the positions (torch/journey.hpp fixed_frame_angles)
//   angles=token   theta_t = Phi_t = sum_{s<t} a_s, the causal scan of per-token increments
//                  a_s = x_s A projected from the layer's hidden states x [B, T, model_dim] by the
//                  module's `angle_table` A [model_dim, D/2] (N(0, 1) radians, the reference's
//                  table; one-hot inputs give its rows); decoding continues from each row's phase
// The reference code's reversed inclusive scan reads later tokens: nn::attention_refusal refuses
// it here (the JoFormer model keeps it, torch/journey.hpp).
#include "torch/journey.hpp"

#include <fmt/format.h>

#include "core/types.hpp"
#include "torch/mechanisms/content_runtime.hpp"

namespace relpos::nn {

namespace {

int64_t pairs(const TransformTerm& t) {
  int64_t n = 0;
  for (const auto& s : t.segments) n += s.blocks;
  return n;
}

std::vector<std::string> journey_names(const TransformTerm& t) {
  if (t.time == TimeSource::ContentPhase) return {"angle_table"};
  return {};
}

std::vector<torch::Tensor> journey_create(const TransformTerm& t, torch::nn::Module& owner,
                                          int64_t model_dim, int64_t /*kv_heads*/,
                                          int64_t /*head_dim*/) {
  if (t.time != TimeSource::ContentPhase) return {};
  return {owner.register_parameter("angle_table", torch::randn({model_dim, pairs(t)}))};
}

Rotated journey_rotate(const TransformTerm& t, const std::vector<torch::Tensor>& p,
                       const RotationCall& c) {
  const auto dt = c.q.scalar_type();
  Rotated out;
  if (t.time == TimeSource::ContentPhase) {
    const auto& x = c.inputs;
    if (x.size(2) != p.at(0).size(0))
      throw InputError(fmt::format("{}: inputs have model_dim {}; the angle table was built for {}",
                                   t.name, x.size(2), p.at(0).size(0)));
    // (attention_refusal keeps the reference's reversed scan out: the phases are exclusive)
    const Phases ph =
        continued_phases(torch::matmul(x, p[0].to(x.scalar_type())), c.phase, c.starts);
    out.phase_end = ph.end;
    out.frames = ph.phases.to(dt);
  } else {
    out.frames = fixed_frame_angles(t, c.positions, dt);
  }
  const Frame f = Frame::of(out.frames);
  out.q = rotate_pairs(c.q, f, false, c.layout);
  out.k = rotate_pairs(c.k, f, false, c.layout);
  return out;
}

}  // namespace

RotationRuntime journey_rotation_runtime() {
  return {journey_names, journey_create, journey_rotate};
}

}  // namespace relpos::nn
