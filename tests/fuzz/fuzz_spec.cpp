// libFuzzer target for the spec grammar, the reference-alias expander and the registry's builder
// (src/core/spec.hpp, src/core/registry.hpp). Built by tests/fuzz/CMakeLists.txt with clang and
// -fsanitize=fuzzer,address,undefined; run by scripts/fuzz.sh. See docs/fuzzing.md.
//
// Input: the bytes are the spec string. An optional shape prefix "@<head_dim>x<heads>:" (e.g.
// "@48x4:jordan(m=3)") picks the head shape explicitly; without it, the spec is built once at
// head_dim 96 with 2 heads (divisible by every order 1, 2, 3, 4, 6, 8) and once at a shape taken
// from a hash of the input out of head_dim {2..128} x heads {1..16}, so that the divisibility
// and per-head paths are exercised as the input mutates.
//
// Contract checked: for any input, expand_reference_alias / parse_spec / build_mechanism either
// return or throw relpos::InputError (with a non-empty message). Anything else (another
// exception type, a crash, a sanitizer report) aborts. For every mechanism that builds, cheap
// invariants of the result are checked (shape as asked, canonical spec re-parses and re-builds to
// itself, segments tile the head without overlap, per-block arrays have the right sizes).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <typeinfo>

#include "core/mechanism.hpp"
#include "core/registry.hpp"
#include "core/spec.hpp"
#include "core/types.hpp"

namespace {

constexpr size_t kMaxLen = 4096;
constexpr int kHeadDims[] = {2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128};
constexpr int kNumHeadDims = sizeof(kHeadDims) / sizeof(kHeadDims[0]);

const std::string* g_input = nullptr;  // for messages

[[noreturn]] void die(const char* where, const std::string& what) {
  std::fprintf(stderr, "\nfuzz_spec: %s: %s\n  input (%zu bytes): '%s'\n", where, what.c_str(),
               g_input ? g_input->size() : size_t{0}, g_input ? g_input->c_str() : "");
  std::abort();
}

#define FUZZ_CHECK(cond, where, msg)                                                 \
  do {                                                                               \
    if (!(cond)) die(where, std::string("invariant failed: " #cond " -- ") + (msg)); \
  } while (0)

// Runs f; InputError (with a message) is the accepted outcome for bad input, any other exception
// aborts so that libFuzzer records the input. Returns true when f returned normally.
template <class F>
bool call(const char* where, F&& f) {
  try {
    f();
    return true;
  } catch (const relpos::InputError& e) {
    if (e.what() == nullptr || e.what()[0] == '\0') die(where, "InputError with an empty message");
    return false;
  } catch (const std::exception& e) {
    die(where, std::string("non-InputError exception ") + typeid(e).name() + ": " + e.what());
  } catch (...) {
    die(where, "non-std exception");
  }
}

void check_mechanism(const relpos::Mechanism& m, int head_dim, int heads) {
  const char* w = "build_mechanism result";
  FUZZ_CHECK(m.head_dim == head_dim, w, "head_dim differs from the one asked");
  FUZZ_CHECK(m.heads == heads, w, "heads differs from the one asked");
  FUZZ_CHECK(!m.spec.empty(), w, "empty canonical spec");
  FUZZ_CHECK(!m.name.empty(), w, "empty name");
  int next_pair = 0, next_block = 0;
  for (const auto& s : m.segments()) {
    FUZZ_CHECK(s.order >= 1 && s.order <= 8, w, m.spec);
    FUZZ_CHECK(s.blocks >= 1, w, m.spec);
    FUZZ_CHECK(s.first_pair == next_pair, w, m.spec);
    FUZZ_CHECK(s.first_block == next_block, w, m.spec);
    FUZZ_CHECK(static_cast<int>(s.omega.size()) == s.blocks, w, m.spec);
    for (double x : s.omega) FUZZ_CHECK(std::isfinite(x), w, m.spec);
    FUZZ_CHECK(std::isfinite(s.L) && s.L > 0, w, m.spec);
    FUZZ_CHECK(std::isfinite(s.shear_scale) && s.shear_scale > 0, w, m.spec);
    FUZZ_CHECK(std::isfinite(s.max_exponent) && s.max_exponent > 0, w, m.spec);
    FUZZ_CHECK(std::isfinite(s.gamma_init) && std::isfinite(s.gamma_min), w, m.spec);
    FUZZ_CHECK(s.gamma_init >= s.gamma_min, w, m.spec);
    FUZZ_CHECK(std::isfinite(s.eta_init) && std::isfinite(s.eta_max), w, m.spec);
    if (s.shear == relpos::ShearMode::Gates)
      FUZZ_CHECK(static_cast<int>(s.gate_init.size()) == s.order - 1, w, m.spec);
    next_pair += s.pairs();
    next_block += s.blocks;
  }
  FUZZ_CHECK(2 * next_pair <= head_dim, w, m.spec);
  FUZZ_CHECK(m.total_blocks() == next_block, w, m.spec);
  if (m.slope_bias())
    FUZZ_CHECK(static_cast<int>(m.slope_bias()->slopes.size()) == heads, w, m.spec);
  FUZZ_CHECK(m.has_transform() || !m.biases.empty() || m.name == "nope", w, m.spec);
  int driven = 0;
  for (const auto& t : m.transforms) {
    driven += t.position_driven();
    if (t.kind == relpos::TransformKind::FixedLinear) {
      FUZZ_CHECK(t.matrix.size() == static_cast<size_t>(head_dim) * head_dim, w, m.spec);
      FUZZ_CHECK(t.matrix_inv_t.size() == t.matrix.size(), w, m.spec);
      for (double x : t.matrix) FUZZ_CHECK(std::isfinite(x), w, m.spec);
    }
    if (t.vector_positions()) {  // alone, every pair a plane, lambda [heads, d_c, planes] finite
      FUZZ_CHECK(m.transforms.size() == 1 && m.biases.empty(), w, m.spec);
      FUZZ_CHECK(t.vector_dims >= 1 && t.vector_dims <= 3 && 2 * t.planes == head_dim, w, m.spec);
      FUZZ_CHECK(t.plane_freqs.size() == static_cast<size_t>(heads) * t.vector_dims * t.planes, w,
                 m.spec);
      for (double x : t.plane_freqs) FUZZ_CHECK(std::isfinite(x), w, m.spec);
    }
  }
  FUZZ_CHECK(driven <= 1, w, m.spec);
  for (const auto& p : m.params) {
    FUZZ_CHECK(p.shape.back() == m.total_blocks(), w, m.spec);
    FUZZ_CHECK(p.bound.size() == static_cast<size_t>(m.total_blocks()), w, m.spec);
    FUZZ_CHECK(p.learn.size() == p.bound.size(), w, m.spec);
  }

  // The canonical spec is a valid spec that builds to itself (so `relpos list`/`verify` output can
  // be pasted back as --enc).
  try {
    (void)relpos::parse_spec(m.spec);
    const relpos::Mechanism again = relpos::build_mechanism(m.spec, head_dim, heads);
    FUZZ_CHECK(again.spec == m.spec, "canonical spec round trip", again.spec + " != " + m.spec);
    FUZZ_CHECK(again.segments().size() == m.segments().size(), "canonical spec round trip", m.spec);
    FUZZ_CHECK(again.transforms.size() == m.transforms.size(), "canonical spec round trip", m.spec);
    FUZZ_CHECK((again.slope_bias() != nullptr) == (m.slope_bias() != nullptr),
               "canonical spec round trip", m.spec);
  } catch (const std::exception& e) {
    die("canonical spec round trip",
        std::string("canonical spec '") + m.spec + "' does not rebuild: " + e.what());
  }
}

void build_at(const std::string& spec, int head_dim, int heads) {
  relpos::Mechanism m;
  if (call("build_mechanism", [&] { m = relpos::build_mechanism(spec, head_dim, heads); }))
    check_mechanism(m, head_dim, heads);
}

// "@<head_dim>x<heads>:" prefix; returns false (leaving the input alone) when absent or malformed.
bool shape_prefix(std::string& spec, int& head_dim, int& heads) {
  if (spec.size() < 5 || spec[0] != '@') return false;
  size_t i = 1;
  long hd = 0, h = 0;
  auto digits = [&](long& v) {
    const size_t start = i;
    while (i < spec.size() && i - start < 4 && spec[i] >= '0' && spec[i] <= '9')
      v = v * 10 + (spec[i++] - '0');
    return i > start;
  };
  if (!digits(hd) || i >= spec.size() || spec[i++] != 'x' || !digits(h) || i >= spec.size() ||
      spec[i++] != ':')
    return false;
  if (hd < 1 || hd > 512 || h < 1 || h > 64) return false;  // keep allocations tiny
  head_dim = static_cast<int>(hd);
  heads = static_cast<int>(h);
  spec.erase(0, i);
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > kMaxLen) return 0;
  const std::string input(reinterpret_cast<const char*>(data), size);
  std::string spec = input;
  g_input = &input;

  // Alias expansion: an alias must expand to a string the grammar accepts.
  std::string alias;
  call("expand_reference_alias", [&] { alias = relpos::expand_reference_alias(spec); });
  if (!alias.empty()) call("parse_spec(alias expansion)", [&] { (void)relpos::parse_spec(alias); });

  // Grammar alone: a parsed term has a non-empty name.
  call("parse_spec", [&] {
    for (const auto& t : relpos::parse_spec(spec)) {
      FUZZ_CHECK(!t.name.empty(), "parse_spec", "empty term name");
      for (const auto& [k, v] : t.args) FUZZ_CHECK(!k.empty() && !v.empty(), "parse_spec", k);
    }
  });

  int head_dim = 96, heads = 2;
  if (shape_prefix(spec, head_dim, heads)) {
    build_at(spec, head_dim, heads);
  } else {
    build_at(spec, 96, 2);
    uint32_t hash = 2166136261u;  // FNV-1a
    for (size_t i = 0; i < size; ++i) hash = (hash ^ data[i]) * 16777619u;
    build_at(spec, kHeadDims[hash % kNumHeadDims], 1 + static_cast<int>((hash >> 8) % 16));
  }
  // Invalid shapes are input errors, never crashes.
  if (size > 0 && (data[0] & 1)) build_at(spec, (data[0] & 2) ? 0 : -4, (data[0] & 4) ? 0 : 1);
  g_input = nullptr;
  return 0;
}
