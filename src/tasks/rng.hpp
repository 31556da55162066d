// Random streams that reproduce the reference implementations' generators draw for draw, so that
// a data stream here is the reference's stream, not only one with the same distribution.
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace relpos::tasks {

// PyTorch's CPU generator (`g = torch.Generator(); g.manual_seed(seed)`): MT19937 seeded with the
// low 32 bits of the seed. randint() and bernoulli() draw as torch's CPU kernels do, one element
// after another in row-major order, so `torch.randint(0, n, (B, T), generator=g)` is B*T calls of
// randint(0, n). Checked against torch 2.15 (tests/core/test_tasks.cpp). CUDA generators
// (Philox), which the reference's query-LM runs used, are not reproduced.
class TorchCpuGenerator {
 public:
  explicit TorchCpuGenerator(uint64_t seed) : engine_(static_cast<uint32_t>(seed)) {}

  uint32_t random() { return static_cast<uint32_t>(engine_()); }
  uint64_t random64();  // two draws, the first one the high word

  // An integer in [low, high): (r % (high - low)) + low with r = random() when the range is below
  // 2^32, else random64() (torch's modulo bias included). Throws InputError when high <= low.
  int64_t randint(int64_t low, int64_t high);

  // torch.bernoulli on a float32 probability: u = (random() & 0xFFFFFF) / 2^24, true when u < p.
  bool bernoulli(float p);

 private:
  std::mt19937 engine_;
};

// CPython's `random.Random(seed)` for a non-negative integer seed: the MT19937 state that
// init_by_array makes from the seed's 32-bit words, getrandbits, _randbelow (rejection sampling)
// and shuffle. Used where the reference shuffles file lists with Python's random module.
class PythonRandom {
 public:
  explicit PythonRandom(uint64_t seed);

  uint32_t getrandbits(int k);     // 1 <= k <= 32
  uint64_t randbelow(uint64_t n);  // uniform in [0, n), 0 < n < 2^32

  // random.shuffle: for i = n-1 .. 1, swap x[i] with x[randbelow(i + 1)].
  template <class T>
  void shuffle(std::vector<T>& x) {
    for (size_t i = x.size(); i-- > 1;) std::swap(x[i], x[randbelow(i + 1)]);
  }

 private:
  std::mt19937 engine_;
};

}  // namespace relpos::tasks
