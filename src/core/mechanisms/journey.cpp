// journey: JoFormer's journey transform (JoFormer Sec. 3; spec grape-joformer.md 4). Every position
// t has a frame R_t built from plane rotations on the D/2 coordinate pairs; queries and keys are
// rotated by their frames (scores q_i^T R(theta_j - theta_i) k_j), values are rotated into their
// key's frame and the output back into the query's frame:
//   o_i = R(theta_i)^{-1} sum_j alpha_ij R(theta_j) v_j = sum_j alpha_ij R(theta_j - theta_i) v_j.
// Angles:
//   rope     theta_{t,m} = t theta^(-2m/D)  (the paper's "standard rotary" spectrum)
//   integer  theta_{t,m} = t m               (the reference code's integer frequencies; the code's
//            time reversal only flips every frequency's sign, which the free q/k/v/out maps absorb)
//   token    theta_t = Phi_t, the causal scan of per-token angle vectors a(x_s) (the model owns the
//            angle table, shared by the layers): Phi_t = sum_{s<t} a_s (scan=exclusive, the
//            paper's T_{t,s} = R_s ... R_{t-1}) or the reference's reversed inclusive sum
//            (scan=reversed_inclusive: reads later tokens, a causality leak kept to reproduce it)
// values=false keeps values and outputs unrotated (RoFormer with these angles).
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> journey_family() {
  return {{{"journey",
            "transform",
            "JoFormer journey transform: q, k, v rotated by their frames R(theta_t), outputs "
            "rotated back; fixed angles (rope, integer) or per-token angles by a causal scan",
            "exact (fixed angles: a function of i - j; token: of the tokens between i and j)",
            "JoFormer 3-4; spec grape-joformer.md 4",
            {{"angles", "rope",
              "rope (theta^(-2m/D) per step), integer (m rad per step) or token "
              "(learned per-token angles, scanned)"},
             {"theta", "10000", "frequency base (angles=rope)"},
             {"values", "true",
              "rotate values into the key frame and outputs back (false: "
              "RoFormer, q and k only)"},
             {"scan", "exclusive",
              "angles=token: exclusive (causal, the paper) or "
              "reversed_inclusive (the reference code's leak)"}},
            {}},
           [](const Args& a, TermBuilder& b) {
             const int D = b.m.head_dim;
             require_divisible(a, D, 2, "rotation planes");
             const std::string angles = a.choice("angles", {"rope", "integer", "token"});
             const std::string scan = a.choice("scan", {"exclusive", "reversed_inclusive"});
             if (angles != "token" && scan != "exclusive")
               throw InputError(fmt::format(
                   "{}: scan={} applies to angles=token only (fixed angles need no scan)", a.term(),
                   scan));
             JordanSegment s;
             if (angles == "rope") {
               s = rope_segment(a.positive("theta"), D, D / 2);
             } else {
               // segments rotate keys by -omega p (rope_segment's convention): frame angle
               // theta_t = t * f_m needs omega_m = -f_m; token angles drive the phase directly
               s.order = 1;
               s.blocks = D / 2;
               s.omega.resize(static_cast<size_t>(D / 2));
               for (int m = 0; m < D / 2; ++m) s.omega[m] = angles == "integer" ? -m : -1.0;
             }
             b.add(std::move(s));
             TransformTerm& t = b.m.transforms[static_cast<size_t>(b.current)];
             t.roles.values = t.roles.outputs = a.flag("values");
             if (angles == "token") {
               t.time = TimeSource::ContentPhase;
               t.scan = scan == "exclusive" ? PhaseScan::Exclusive : PhaseScan::ReversedInclusive;
             }
           }}};
}

}  // namespace relpos::mechanisms
