// jetmix, jetmixfull, jetspec: jet gates and normalised jet spectra (Jordan-RoPE 4.5).
#include "core/mechanisms/family.hpp"

namespace relpos::mechanisms {

std::vector<TermDef> jet_gates_family() {
  std::vector<TermDef> d;
  // Jet gates and spectra: U(t) = alpha_0 I + sum_k g_k (s sigma(t))^k/k! N^k, s = 1/L.
  const auto gate_options = [](const std::string& m, const std::string& list_key,
                               const std::string& list_default, const std::string& gmax) {
    auto o = jordan_common_options("stabilized");
    o.push_back(direction_option());
    o.insert(o.begin(), {"m", m, "Jordan order (2..8)"});
    for (auto& x : o) {
      if (x.key == "c") x.default_value = "1.5";
      if (x.key == "regime") x.doc = "stabilized: bounded tau (reference); scaled: sigma(d)=d";
    }
    o.push_back({list_key, list_default, "jet coefficients separated by '/'"});
    if (!gmax.empty()) o.push_back({"gate_max", gmax, "tanh bound of learnable gates"});
    o.push_back({"theta", "10000", "frequency base"});
    return o;
  };
  const auto gate_segment = [](const Args& a, TermBuilder& b, int m) {
    const int D = b.m.head_dim;
    require_divisible(a, D, 2 * m, fmt::format("order {} blocks of {} coordinates", m, 2 * m));
    if (a.str("regime") == "raw")
      throw InputError(fmt::format("{}: regime must be stabilized or scaled", a.term()));
    JordanSegment s = jordan_base(a, m, /*scaled_damping=*/true);
    s.shear = ShearMode::Gates;
    s.shear_scale = 1.0 / s.L;
    s.blocks = D / (2 * m);
    s.omega = rope_frequencies(a.positive("theta"), D, s.blocks);
    s.grid = {a.positive("theta"), D};
    set_direction(a, s);
    return s;
  };
  d.push_back({{"jetmix",
                "transform",
                "jet gates: alpha_0 = 1, learnable g_k (tanh-bounded), bounded tau / L",
                "approximate",
                "Jordan-RoPE 4.5, 5.6; spec 1.8",
                gate_options("3", "gates", "0.1/0.05", "1"),
                {"jordan_jetmix_mM_cCCC_gG1_..."}},
               [gate_segment](const Args& a, TermBuilder& b) {
                 const int m = a.integer("m", 2, 8);
                 JordanSegment s = gate_segment(a, b, m);
                 s.gate_init = a.list("gates");
                 s.gate_max = a.positive("gate_max");
                 if (static_cast<int>(s.gate_init.size()) != m - 1)
                   throw InputError(fmt::format("jetmix: gates needs m-1 = {} values, got {}",
                                                m - 1, s.gate_init.size()));
                 for (double g : s.gate_init)
                   if (std::abs(g) >= s.gate_max)
                     throw InputError(
                         fmt::format("jetmix: |gate| {} must be below gate_max {}", g, s.gate_max));
                 s.learn_gates = true;
                 s.alpha0_init = 1.0;
                 b.add(s);
                 set_center(a, b.m, false);
               }});
  d.push_back({{"jetmixfull",
                "transform",
                "jet gates with a learnable alpha_0 too (only ratios g_k/alpha_0 reach the score)",
                "approximate",
                "Jordan-RoPE 4.5; spec 1.8",
                gate_options("4", "alpha", "1/0.5/0.3/0.2", "2"),
                {"jordan_jetmixfull_mM_cCCC_gG0_..."}},
               [gate_segment](const Args& a, TermBuilder& b) {
                 const int m = a.integer("m", 2, 8);
                 JordanSegment s = gate_segment(a, b, m);
                 const auto al = a.list("alpha");
                 s.gate_max = a.positive("gate_max");
                 if (static_cast<int>(al.size()) != m)
                   throw InputError(
                       fmt::format("jetmixfull: alpha needs m = {} values, got {}", m, al.size()));
                 for (double g : al)
                   if (std::abs(g) >= s.gate_max)
                     throw InputError(fmt::format(
                         "jetmixfull: |alpha| {} must be below gate_max {}", g, s.gate_max));
                 if (al[0] <= 0) throw InputError("jetmixfull: alpha_0 must be > 0");
                 s.alpha0_init = al[0];
                 s.gate_init.assign(al.begin() + 1, al.end());
                 s.learn_gates = s.learn_alpha0 = true;
                 b.add(s);
                 set_center(a, b.m, false);
               }});
  {
    auto o = gate_options("3", "alpha", "0.7/0.2/0.1", "");
    o.push_back({"learn", "false", "false: fixed spectrum; true: alpha = softmax(logits)"});
    d.push_back({{"jetspec",
                  "transform",
                  "normalized jet spectrum: alpha_r >= 0, sum 1, on (base phase, jets 1..m-1)",
                  "approximate",
                  "Jordan-RoPE 4.5, Tables 9/14/15 (Norm-jet)",
                  o,
                  {}},
                 [gate_segment](const Args& a, TermBuilder& b) {
                   const int m = a.integer("m", 2, 8);
                   JordanSegment s = gate_segment(a, b, m);
                   const auto al = a.list("alpha");
                   if (static_cast<int>(al.size()) != m)
                     throw InputError(
                         fmt::format("jetspec: alpha needs m = {} values, got {}", m, al.size()));
                   double sum = 0;
                   for (double x : al) {
                     if (x < 0) throw InputError("jetspec: alpha must be non-negative");
                     sum += x;
                   }
                   if (std::abs(sum - 1.0) > 1e-6)
                     throw InputError(fmt::format("jetspec: alpha must sum to 1, sums to {}", sum));
                   if (al[0] <= 0) throw InputError("jetspec: alpha_0 must be > 0");
                   s.alpha0_init = al[0];
                   s.gate_init.assign(al.begin() + 1, al.end());
                   s.spectrum_softmax = a.flag("learn");
                   s.learn_gates = s.learn_alpha0 = s.spectrum_softmax;
                   s.gate_max = 1.0;
                   b.add(s);
                   set_center(a, b.m, false);
                 }});
  }
  for (auto& x : d) x.info.options = with_ranges(std::move(x.info.options));

  return d;
}

}  // namespace relpos::mechanisms
