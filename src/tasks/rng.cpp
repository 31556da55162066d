#include "tasks/rng.hpp"

#include <fmt/format.h>

#include <array>
#include <bit>

#include "core/types.hpp"

namespace relpos::tasks {

uint64_t TorchCpuGenerator::random64() {
  const uint64_t hi = random();
  const uint64_t lo = random();
  return (hi << 32) | lo;
}

int64_t TorchCpuGenerator::randint(int64_t low, int64_t high) {
  if (high <= low) throw InputError(fmt::format("randint: empty range [{}, {})", low, high));
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  const uint64_t r = range >= (uint64_t{1} << 32) ? random64() : uint64_t{random()};
  return static_cast<int64_t>(static_cast<uint64_t>(low) + r % range);
}

bool TorchCpuGenerator::bernoulli(float p) {
  const double u = static_cast<double>(random() & 0xFFFFFFu) / static_cast<double>(1u << 24);
  return u < static_cast<double>(p);
}

namespace {

// A seed sequence that hands std::mt19937 a ready-made state: the one CPython's init_by_array
// builds. std::mt19937::seed(seq) takes the 624 generated words as its state unchanged (the
// standard fixes that), so the engine then draws exactly CPython's stream.
struct PythonStateSeq {
  using result_type = uint32_t;
  std::array<uint32_t, 624> state{};

  template <class It>
  void generate(It first, It last) const {
    for (size_t i = 0; first != last && i < state.size(); ++first, ++i) *first = state[i];
  }
};

PythonStateSeq python_init_by_array(uint64_t seed) {
  constexpr int N = 624;
  std::vector<uint32_t> key{static_cast<uint32_t>(seed)};
  if (seed >> 32) key.push_back(static_cast<uint32_t>(seed >> 32));

  PythonStateSeq s;
  auto& mt = s.state;
  mt[0] = 19650218u;  // init_genrand(19650218)
  for (int i = 1; i < N; ++i)
    mt[i] = 1812433253u * (mt[i - 1] ^ (mt[i - 1] >> 30)) + static_cast<uint32_t>(i);

  int i = 1;
  size_t j = 0;
  for (size_t k = std::max<size_t>(N, key.size()); k; --k) {
    mt[i] =
        (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525u)) + key[j] + static_cast<uint32_t>(j);
    ++i;
    ++j;
    if (i >= N) {
      mt[0] = mt[N - 1];
      i = 1;
    }
    if (j >= key.size()) j = 0;
  }
  for (int k = N - 1; k; --k) {
    mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941u)) - static_cast<uint32_t>(i);
    ++i;
    if (i >= N) {
      mt[0] = mt[N - 1];
      i = 1;
    }
  }
  mt[0] = 0x80000000u;
  return s;
}

}  // namespace

PythonRandom::PythonRandom(uint64_t seed) {
  PythonStateSeq seq = python_init_by_array(seed);
  engine_.seed(seq);
}

uint32_t PythonRandom::getrandbits(int k) {
  if (k < 1 || k > 32) throw InputError(fmt::format("getrandbits: k = {} outside [1, 32]", k));
  return static_cast<uint32_t>(engine_()) >> (32 - k);
}

uint64_t PythonRandom::randbelow(uint64_t n) {
  if (n == 0 || n >= (uint64_t{1} << 32))
    throw InputError(fmt::format("randbelow: n = {} outside [1, 2^32)", n));
  const int k = std::bit_width(n);
  uint64_t r = getrandbits(k);
  while (r >= n) r = getrandbits(k);
  return r;
}

}  // namespace relpos::tasks
