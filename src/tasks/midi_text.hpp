// PJ-RoPE's MIDI-token text corpora (spec pj-rope.md 3.5: prepare_phase_e_musicnet_midi.py, which
// reads files through mido). One text token per MIDI message, pieces one per line, and the file is
// then modelled as raw bytes by the byte LM (Table 4b, Fig. 5). This is not Jordan-RoPE's event
// stream of tasks/midi.hpp, which pairs notes through pretty_midi.
//
// Timing follows mido's `for msg in MidiFile`: the tracks are merged by absolute tick (a stable
// sort, so ties keep track order), end-of-track events are dropped with their time carried to the
// next message, and each message's tick delta becomes seconds as tick * (tempo * 1e-6 / tpb) at
// the tempo in force before it (120 bpm until the first set_tempo of any track). Every message,
// meta and skipped ones included, adds round(seconds * 1000 / grid_ms) (half to even) to a pending
// delta; an emitted token carries the pending delta clamped to [0, max_delta] and resets it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "tasks/corpus.hpp"
#include "tasks/midi.hpp"

namespace relpos::tasks {

struct MidiTextOptions {
  int grid_ms = 20;
  int max_delta = 999;
  int64_t max_events_per_piece = 20000;  // tokens per piece; later messages are dropped
  bool include_controls = false;         // d###.cc###.v###.c#
  bool include_programs = false;         // d###.pg###.c#
};

// The tokens of one parsed file, in order: d{delta:03d}.on{note:03d}.v{vel:03d}.c{ch} for a
// note_on of velocity > 0, d{delta:03d}.off{note:03d}.c{ch} for a note_off or a note_on of
// velocity 0, and the control / program tokens when enabled. InputError for an SMF of format 2
// (mido cannot merge asynchronous tracks) or a set_tempo payload under 3 bytes.
std::vector<std::string> midi_text_tokens(const SmfFile& f, const std::string& name,
                                          const MidiTextOptions& opt = {});

// The reference's clean_text on UTF-8 text, in the spec's order: each character (code point)
// outside [A-Za-z0-9_ .,+:/()-] becomes '_', then each run of whitespace (spaces by then) becomes
// one '_'; the result is cut to 80 characters, and "NA" replaces an empty one. InputError on
// invalid UTF-8.
std::string midi_text_clean(std::string_view s);

// The MusicNet reference-MIDI selectors: `dir` holds musicnet_metadata.csv and the .mid files
// (any folder layout; a file's MusicNet id is the number that starts its name, the first file in
// sorted order with a warning when two share one; the regex
// /(\d+)[^/]*\.midi?$ of the reference). The candidates are the metadata rows, in CSV order, that
// have a file; Python's random.Random(seed).shuffle orders them, and pieces are read in that order
// until max_files of them parse (files that do not parse are skipped, as mido's refusals are).
// Selector A is seed 29, selector B seed 37, both 64 pieces with program tokens.
struct MusicnetTextOptions {
  uint64_t seed = 29;
  int64_t max_files = 64;
  MidiTextOptions tokens{.include_programs = true};
};

// The first line of every corpus musicnet_midi_text writes.
inline constexpr std::string_view kMusicnetTextFirstLine = "# musicnet_reference_midi\n";

struct MidiTextCorpus {
  std::string text;                  // the corpus file: header comment lines, a blank line, pieces
  std::vector<std::string> pieces;   // relative paths, in corpus order
  std::vector<std::string> skipped;  // "PATH: PROBLEM" for each candidate that did not parse
};

// The corpus text. Each piece is one line,
// PIECE=%04d|ID=..|SEC=%.2f|COMP=..|ENS=..|WORK=..|MOVE=..| then a space and the tokens joined by
// single spaces (SEC is the metadata's seconds; the text fields pass through midi_text_clean).
// InputError when the folder, the metadata or its columns are missing, or no piece parses; a
// warning when fewer than max_files do.
MidiTextCorpus musicnet_midi_text(const std::filesystem::path& dir,
                                  const MusicnetTextOptions& opt = {},
                                  const WarningSink& warn = warn_to_stderr);

}  // namespace relpos::tasks
