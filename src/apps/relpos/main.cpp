// relpos: the command-line tool. Every subcommand lives in its own cmd_*.cpp.
#include <fmt/format.h>

#include <iostream>

#include "apps/cli_checks.hpp"
#include "apps/relpos/commands.hpp"
#include "core/parse.hpp"
#include "core/types.hpp"

int main(int argc, char** argv) {
  // The CLI needs no LibTorch: its kernels run on OpenMP's pool (one thread per core by default,
  // OMP_NUM_THREADS to change), and a call starts in milliseconds.
  CLI::App app{
      "relpos: relative positional encodings for attention - list, verify, kernel, probe, "
      "reproduce, linear-attention, train, eval, sweep, bench"};
  app.require_subcommand(1);
  relpos::app::add_list_command(app);
  relpos::app::add_verify_command(app);
  relpos::app::add_kernel_command(app);
  relpos::app::add_probe_command(app);
  relpos::app::add_reproduce_command(app);
  relpos::app::add_midi_text_command(app);
  relpos::app::add_linear_attention_command(app);
  relpos::app::add_torch_commands(app);
  relpos::app::refuse_empty_values(app);  // `--out ""` is bad input, never "not given"
  // Exit codes (docs/errors.md): 0 ok, 1 a check failed, 2 bad input, anything else a bug.
  try {
    // a trained experiment (experiments/NAME.toml) is relpos-train's, with its own options (so
    // its name decides the parser before CLI11 runs); the CLI's own reproductions are listed in
    // cmd_reproduce.cpp
    if (argc > 2 && std::string(argv[1]) == "reproduce" && argv[2][0] != '-' &&
        !relpos::app::is_builtin_experiment(argv[2]))
      return relpos::app::run_beside("relpos-train", {argv + 1, argv + argc});
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with code 0 to CLI11; every real parse error is input
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << "relpos: error: " << relpos::brief(e.what(), 1000) << "\n"
              << "run 'relpos --help' or 'relpos COMMAND --help' for the options\n";
    return 2;
  } catch (const relpos::app::ExitStatus& e) {
    return e.code;
  } catch (const relpos::InputError& e) {
    std::cerr << "relpos: error: " << relpos::brief(e.what(), 1000) << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "relpos: internal error (please report): " << relpos::brief(e.what(), 1000)
              << "\n";
    return 3;
  }
  return 0;
}
