// relpos-bench: the benchmarks that need LibTorch (the relpos CLI links none; `relpos bench ARGS`
// runs this program from its own directory with ARGS verbatim). Exit codes as relpos
// (docs/errors.md): 0 ok, 1 a correctness check failed, 2 bad input, 3 internal error.
#include <c10/util/Exception.h>

#include <iostream>
#include <string_view>

#include "apps/bench/attention_bench.hpp"
#include "apps/cli_checks.hpp"
#include "core/parse.hpp"
#include "core/types.hpp"

int main(int argc, char** argv) {
  CLI::App app{"relpos-bench: benchmarks against LibTorch (usually run as 'relpos bench ...')"};
  app.name("relpos bench");
  app.require_subcommand(1);
  relpos::bench::add_attention_command(app);
  relpos::bench::add_decode_command(app);
  relpos::app::refuse_empty_values(app);  // `--json-out ""` is bad input, never "not given"
  try {
    // CLI11 would call an unknown benchmark name "A subcommand is required"
    if (argc > 1 && argv[1][0] != '-' && std::string_view(argv[1]) != "attention" &&
        std::string_view(argv[1]) != "decode")
      throw relpos::InputError("unknown benchmark '" + relpos::brief(argv[1]) +
                               "' (available: attention, decode; relpos bench step runs the "
                               "training step's, relpos-train bench-step)");
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << "relpos: error: " << relpos::brief(e.what(), 1000) << "\n"
              << "run 'relpos bench attention --help' or 'relpos bench decode --help' for the "
                 "options\n";
    return 2;
  } catch (const relpos::bench::CheckFailed&) {
    return 1;
  } catch (const relpos::InputError& e) {
    std::cerr << "relpos: error: " << relpos::brief(e.what(), 1000) << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "relpos: internal error (LibTorch): "
              << relpos::brief(e.what_without_backtrace(), 1000) << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "relpos: internal error (please report): " << relpos::brief(e.what(), 1000)
              << "\n";
    return 3;
  }
  return 0;
}
