// relpos midi-text: PJ-RoPE's MusicNet MIDI-token text corpus (tasks/midi_text.hpp), written as the
// reference's prepare script writes it, for reading or for `task.kind = "bytes"` elsewhere.
#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "apps/relpos/commands.hpp"
#include "core/files.hpp"
#include "tasks/midi_text.hpp"

namespace relpos::app {

void add_midi_text_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "midi-text",
      "Write PJ-RoPE's MusicNet MIDI-token text corpus (selector A: --seed 29, B: --seed 37)");
  struct Args {
    std::string dir, out;
    tasks::MusicnetTextOptions opt;
    bool no_programs = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("dir", a->dir, "folder with musicnet_metadata.csv and the .mid files")
      ->required();
  cmd->add_option("--out", a->out, "corpus file to write (atomically)")->required();
  add_seed_option(cmd, &a->opt.seed, "Python random.Random(seed).shuffle of the candidates");
  cmd->add_option("--max-files", a->opt.max_files, "pieces to keep")->check(CLI::Range(1, 100000));
  cmd->add_option("--grid-ms", a->opt.tokens.grid_ms, "time grid in milliseconds")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--max-events", a->opt.tokens.max_events_per_piece, "tokens per piece at most")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_flag("--controls", a->opt.tokens.include_controls, "control_change tokens");
  cmd->add_flag("--no-programs", a->no_programs, "no program_change tokens");
  cmd->callback([a] {
    a->opt.tokens.include_programs = !a->no_programs;
    std::error_code ec;
    if (std::filesystem::exists(a->out, ec)) {
      const std::string head =
          tasks::read_file_bytes(a->out).substr(0, tasks::kMusicnetTextFirstLine.size());
      if (head != tasks::kMusicnetTextFirstLine)
        throw InputError(fmt::format(
            "{} exists and is not a MusicNet MIDI-text corpus; not overwriting it", a->out));
    }
    const auto c = tasks::musicnet_midi_text(a->dir, a->opt);
    write_file_atomic(a->out, c.text);
    std::cout << fmt::format("wrote {} ({} bytes, {} pieces, {} skipped)\n", a->out, c.text.size(),
                             c.pieces.size(), c.skipped.size());
  });
}

}  // namespace relpos::app
