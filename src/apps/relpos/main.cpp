// relpos: the command-line tool. Every subcommand lives in its own cmd_*.cpp.
#include <fmt/format.h>

#include <ATen/Parallel.h>

#include <iostream>
#include <thread>

#include "apps/relpos/commands.hpp"
#include "core/types.hpp"

int main(int argc, char** argv) {
  // LibTorch's intra-op pool sized from the machine (our kernels use OpenMP's, same default)
  if (const unsigned n = std::thread::hardware_concurrency(); n > 0) at::set_num_threads(static_cast<int>(n));
  CLI::App app{"relpos: relative positional encodings for attention - verify, probe, train"};
  app.require_subcommand(1);
  relpos::app::add_list_command(app);
  relpos::app::add_verify_command(app);
  relpos::app::add_kernel_command(app);
  relpos::app::add_probe_command(app);
  relpos::app::add_reproduce_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const relpos::app::ExitStatus& e) {
    return e.code;
  } catch (const relpos::InputError& e) {
    std::cerr << "relpos: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "relpos: internal error: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
