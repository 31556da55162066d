// One function per subcommand; main.cpp wires them into one CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace relpos::app {

// Thrown by a subcommand that finished its output but must exit non-zero (e.g. verify failed).
struct ExitStatus {
  int code;
};

void add_list_command(CLI::App& app);
void add_verify_command(CLI::App& app);
void add_kernel_command(CLI::App& app);
void add_probe_command(CLI::App&);
void add_reproduce_command(CLI::App&);

}  // namespace relpos::app
