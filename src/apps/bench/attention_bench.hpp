// relpos-bench attention: the fused attention kernel (kernels/attention) against LibTorch's
// at::scaled_dot_product_attention, with and without an ALiBi-shaped lag bias.
#pragma once

#include <CLI/CLI.hpp>

namespace relpos::bench {

// Thrown when the benchmark finished its output but a correctness check failed (exit 1).
struct CheckFailed {};

void add_attention_command(CLI::App& app);
// relpos-bench decode (decode_bench.cpp)
void add_decode_command(CLI::App& app);

}  // namespace relpos::bench
