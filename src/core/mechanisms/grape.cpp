// grape: the GRAPE family (group representational position encoding; spec grape-joformer.md 2).
// A position acts through a one-parameter group G(n) = exp(n omega L):
//   grape_m   multiplicative, L in so(D): RoPE planes with learned per-plane frequencies
//             theta_m = exp(lambda_m / 16) (lambda initialised at the RoPE spectrum); context=true
//             drives the planes by a content phase Phi_t = sum_{s<t} sigmoid((w.x_s + b)/16)
//             instead of t, with theta_m = exp(lambda_m) (the reference's GRAPE-M-ctx)
//   grape_a   additive, L nilpotent (a unipotent lift): the slope -(i - j) omega_h m_h times
//             content gates softplus(u_h . k_j / sqrt D) (gate=k), of the query (q), or both (qk)
//   fox       additive with endpoint-independent edge potentials ln f_l, f = sigmoid(w_h.x + b_h):
//             the Forgetting Transformer's c_i - c_j (constant f = e^{-m_h} is ALiBi)
//   grape_ap  path-integral additive: sum_{l=j+1..i} m_h logsigmoid(p_i . R_l p^_l / P) with
//             probes p = W_p x (P = probe), the key probe RMS-normalised and rotated by l radians
// The gates, probes and phases are functions of the tokens: a model computes them
// (torch/grape.hpp) and the fused kernel adds the biases from O(T) or O(T P) per-token state.
// form=paper selects the paper's parameterisation where the reference code differs.
#include "core/charts.hpp"
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

namespace {

BiasTerm content_bias(const char* name, BiasShape shape, int heads) {
  BiasTerm t;
  t.name = name;
  t.shape = shape;
  t.slopes = alibi_slopes(heads);
  return t;
}

bool paper_form(const Args& a) {
  return a.choice("form", {"reference", "paper"}) == "paper";
}

}  // namespace

std::vector<TermDef> grape_family() {
  std::vector<TermDef> d;
  d.push_back(
      {{"grape_m",
        "transform",
        "multiplicative GRAPE: RoPE planes (half-split in the grape preset) with learned "
        "per-plane log-frequencies theta_m = exp(lambda_m / 16); context=true: planes driven by "
        "the content phase Phi_t = sum_{s<t} sigmoid((w.x_s + b)/16), theta_m = exp(lambda_m)",
        "exact (relative law in t; in Phi for context=true)",
        "GRAPE 3; spec grape-joformer.md 2.2-2.3",
        {{"theta", "10000", "frequency base of the initial spectrum"},
         {"context", "false", "true: contextual phase (GRAPE-M-ctx) instead of the position"},
         {"basis", "none",
          "none, or a learned commuting basis E R E^T with E = cayley or exp of a learned skew "
          "matrix (the paper's Alg. 1; E = I at init)"}},
        {}},
       [](const Args& a, TermBuilder& b) {
         const int D = b.m.head_dim;
         require_divisible(a, D, 2, "rotation planes");
         b.add(rope_segment(a.positive("theta"), D, D / 2));
         TransformTerm& t = b.m.transforms[static_cast<size_t>(b.current)];
         t.learned_frequencies = true;
         const bool context = a.flag("context");
         t.frequency_scale = context ? 1.0 : 16.0;
         t.basis = a.choice("basis", {"none", "cayley", "exp"});
         if (context) t.time = TimeSource::ContentPhase;
       }});
  d.push_back({{"grape_a",
                "bias",
                "additive GRAPE: content-gated slope -(i-j) omega_h m_h [softplus(v_h.q_i/sqrt D) "
                "(gate q) + softplus(u_h.k_j/sqrt D) (gate k)], unit u, v, omega_h = "
                "softplus(rho_h); form=paper: -(i-j) omega_h [..] with raw u, v, no m_h",
                "content-gated (relative in the positions for fixed gates)",
                "GRAPE 4 (Eq. 4.6); spec grape-joformer.md 2.6",
                {{"gate", "qk", "which side gates the slope: k, q or qk"},
                 {"form", "reference", "reference (the code) or paper"}},
                {}},
               [](const Args& a, TermBuilder& b) {
                 BiasTerm t = content_bias("grape_a", BiasShape::GatedSlope, b.m.heads);
                 t.gate = a.choice("gate", {"k", "q", "qk"});
                 t.paper_form = paper_form(a);
                 b.add_bias(std::move(t));
               }});
  d.push_back({{"fox",
                "bias",
                "Forgetting Transformer: c_i - c_j, c_t = sum_{s<=t} logsigmoid(w_h.x_s + b_h) "
                "(data-dependent forget gates)",
                "content-gated (path-additive with endpoint-independent edges)",
                "FoX (Lin et al. 2025); GRAPE 5; spec grape-joformer.md 2.7",
                {},
                {}},
               [](const Args&, TermBuilder& b) {
                 b.add_bias(content_bias("fox", BiasShape::Separable, b.m.heads));
               }});
  d.push_back({{"grape_ap",
                "bias",
                "path-integral GRAPE: sum_{l=j+1..i} beta_h logsigmoid(p_i . R_l p^_l / P), key "
                "probe RMS-normalised and rotated by l rad, beta_h = m_h; form=paper: query probe "
                "normalised too, beta_h = softplus(rho_h) learned",
                "path-additive (not translation invariant: R_l is absolute)",
                "GRAPE 5; spec grape-joformer.md 2.8",
                {{"probe", "8", "probe width P (even)"},
                 {"form", "reference", "reference (the code) or paper"}},
                {}},
               [](const Args& a, TermBuilder& b) {
                 BiasTerm t = content_bias("grape_ap", BiasShape::PathIntegral, b.m.heads);
                 t.probe_dim = a.integer("probe", 2, 256);
                 if (t.probe_dim % 2)
                   throw InputError(
                       fmt::format("{}: option probe={} must be even (its rotation turns pairs)",
                                   a.term(), t.probe_dim));
                 t.paper_form = paper_form(a);
                 b.add_bias(std::move(t));
               }});
  return d;
}

}  // namespace relpos::mechanisms
