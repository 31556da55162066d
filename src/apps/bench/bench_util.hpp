// What every relpos-bench benchmark shares: medians, the thread count, LibTorch's version.
#pragma once

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <omp.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/files.hpp"

namespace relpos::bench {

inline double median(std::vector<double> x) {
  if (x.empty()) return std::nan("");
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

// The order of the cases in each round: a fresh seeded shuffle per round. A call's time depends
// on what ran before it (the memory it freed, the cache it left), and with a fixed or alternating
// order the same cases would always follow the heaviest one.
class RoundOrder {
 public:
  explicit RoundOrder(size_t cases, uint64_t seed = 0) : order_(cases), rng_(seed) {
    std::iota(order_.begin(), order_.end(), size_t{0});
  }
  const std::vector<size_t>& next() {
    std::shuffle(order_.begin(), order_.end(), rng_);
    return order_;
  }

 private:
  std::vector<size_t> order_;
  std::mt19937_64 rng_;
};

inline std::string torch_version() {
  return fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}

// The threads an OpenMP region gets (what our kernels and LibTorch use).
inline int used_omp_threads() {
  int n = 0;
#pragma omp parallel
  {
#pragma omp single
    n = omp_get_num_threads();
  }
  return n;
}

inline void set_threads(int n) {
  if (n > 0) at::set_num_threads(n);  // OpenMP (and MKL) threads of LibTorch and our kernels
}

// --json-out FILE of a benchmark (docs/errors.md, "Output directories"): the file must be new or
// an earlier report of the same benchmark, which starts with `header` (the first bytes of its
// JSON); a folder, a symbolic link or anyone else's file is refused naming the flag. Checked
// before the benchmark runs (check_json_out) and again when the report is written, atomically
// (write_json_out).
inline void check_json_out(const std::string& path, const std::string& header) {
  if (!path.empty()) check_output_file(path, header, "--json-out");
}
inline void write_json_out(const std::string& path, const std::string& header,
                           const std::string& text) {
  if (path.empty()) return;
  // a report that did not start with its header could never be replaced by the next run
  if (text.compare(0, header.size(), header) != 0)
    throw std::logic_error("a benchmark report does not start with its own header");
  check_json_out(path, header);
  write_file_atomic(path, text);
}

}  // namespace relpos::bench
