// One function per subcommand; main.cpp wires them into one CLI11 app.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "core/parse.hpp"

namespace relpos::app {

// Thrown by a subcommand that finished its output but must exit non-zero (e.g. verify failed).
struct ExitStatus {
  int code;
};

// --seed as a full-range unsigned 64-bit integer: "-1", "1e3" or a 20-digit overflow are input
// errors (CLI11 alone would wrap or truncate some of them).
inline CLI::Option* add_seed_option(CLI::App* cmd, uint64_t* seed, const std::string& help) {
  return cmd
      ->add_option_function<std::string>(
          "--seed",
          [seed](const std::string& s) {
            const auto v = parse_uint64(s);
            if (!v)
              throw CLI::ValidationError("--seed",
                                         "'" + brief(s) + "' is not an integer in [0, 2^64 - 1]");
            *seed = *v;
          },
          help)
      ->type_name("UINT64");
}

void add_list_command(CLI::App& app);
void add_verify_command(CLI::App& app);
void add_kernel_command(CLI::App& app);
void add_probe_command(CLI::App&);
void add_reproduce_command(CLI::App&);
void add_midi_text_command(CLI::App&);  // PJ-RoPE's MusicNet MIDI-token text corpus
// The reproductions this CLI runs itself (basis-level, no LibTorch); every other experiment name
// is a trained one of experiments/ and goes to relpos-train.
bool is_builtin_experiment(const std::string& name);
void add_linear_attention_command(CLI::App&);  // FAVOR+ linear vs softmax attention timing
void add_torch_commands(CLI::App&);  // train, eval, sweep (relpos-train), bench (relpos-bench)
// Runs `program` from this executable's directory with `args`, output shared; its exit status.
int run_beside(const std::string& program, const std::vector<std::string>& args);

}  // namespace relpos::app
