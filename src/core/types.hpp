// Basic enumerations shared by every layer. No LibTorch here: core and kernels stand alone.
#pragma once

#include <stdexcept>
#include <string>

namespace relpos {

// Thrown for every user-facing input problem (bad spec, bad shape, NaN, bad file). The CLI turns
// it into a message and a non-zero exit; messages always name the offending thing.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// How the two real coordinates of complex coordinate j sit in a head of dimension D.
enum class Layout {
  Interleaved,  // (2j, 2j+1): Jordan-RoPE, JoFormer, the reference repositories
  HalfSplit,    // (j, j + D/2): GPT-NeoX, GRAPE
};

// Lag chart sigma(t): the "time" that drives the nilpotent (shear) part of a Jordan block.
enum class Chart {
  Raw,            // t             (exact; "scaled" is Raw with shear_scale 1/L)
  Bounded,        // t/(1+|t|/L)   (Stabilized Jordan-RoPE; approximate)
  LightconePhi,   // L asinh(t/L)  (PJ-RoPE light-cone chart)
  LightconeBeta,  // t/sqrt(t^2+L^2)
};

// How the nilpotent coefficients c_k(t) of a block are formed.
enum class ShearMode {
  None,         // no nilpotent part (RoPE, damped RoPE with eta forced 0)
  Exponential,  // c_k = (eta * s * sigma(t))^k / k!   -> exp(eta s sigma(t) N)
  Gates,        // c_0 = alpha_0, c_k = g_k (s sigma(t))^k / k!  (jet gates / jet spectra)
};

std::string to_string(Layout l);
std::string to_string(Chart c);
Layout parse_layout(const std::string& s);

}  // namespace relpos
