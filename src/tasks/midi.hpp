// Standard MIDI Files and the music-token streams of Jordan-RoPE (jordan-rope.md 3.8, the MIDI
// part of scripts/prepare_audio_lm_tokens.py, which reads files through pretty_midi and mido).
//
// Event vocabulary (209 events, written one byte each):
//   0          file separator, first token of every file
//   1..32      time shift of s quanta (token s); longer gaps repeat 32 and end with the remainder
//   33..120    note-on,  pitch 21..108 (33 + pitch - 21)
//   121..208   note-off, pitch 21..108 (121 + pitch - 21)
// The quantum is 0.02 s. Notes come from non-drum channels (channel 10, index 9, is drums) with
// pitch 21..108; their on and off events are sorted by (time, off before on, pitch); event time
// t becomes tick round(t / 0.02) (round half to even, as Python's round) and a shift token
// covers the gap from the previous event's tick. There are no velocity or program tokens.
// The language model reads the event bytes as byte + 1: tokens 1..209 of a 257-token vocabulary
// (kByteVocab), the reference's byte LM over its train.bin / eval.bin files.
//
// Seconds follow pretty_midi: the tempo map is read from track 0 only (a tempo event at tick 0
// replaces the 120 bpm default, a later one with an unchanged tick scale is ignored), each track
// pairs note-ons and note-offs (or note-ons of velocity 0) by (channel, pitch): a note-off closes
// every open note of that key that started at an earlier tick; notes it would close at their own
// start tick stay open only when it closed some other note, else they are dropped; notes never
// closed are dropped.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "core/types.hpp"
#include "tasks/corpus.hpp"

namespace relpos::tasks {

inline constexpr int32_t kMidiFileSeparator = 0;
inline constexpr int32_t kMidiTimeShiftFirst = 1;
inline constexpr int32_t kMidiTimeShiftBins = 32;
inline constexpr int32_t kMidiNoteOnFirst = 33;
inline constexpr int32_t kMidiNoteOffFirst = 121;
inline constexpr int32_t kMidiPitchMin = 21;
inline constexpr int32_t kMidiPitchMax = 108;
inline constexpr int32_t kMidiEventVocab = 209;
inline constexpr double kMidiTimeQuantum = 0.02;

// A file the reader cannot use. what() is "NAME: PROBLEM at byte offset N" where an offset exists.
struct MidiError : InputError {
  using InputError::InputError;
};

// One event with its absolute tick. Channel messages keep status 0x80..0xEF and their data bytes;
// meta events status 0xFF, meta_type and the payload; sysex (0xF0 / 0xF7) the payload; system
// messages (0xF1..0xFE) their data bytes.
struct SmfEvent {
  int64_t tick = 0;
  uint8_t status = 0;
  uint8_t meta_type = 0;
  std::vector<uint8_t> data;
};

struct SmfFile {
  int format = 0;
  int ticks_per_beat = 0;
  std::vector<std::vector<SmfEvent>> tracks;  // the tracks the header declares, in file order
  // Bytes after the last declared track (mido, and so the reference, ignores them): their count
  // and the offset where they start.
  int64_t trailing_bytes = 0;
  int64_t trailing_offset = 0;
};

// Parses an SMF held in memory; `name` goes into messages. Never reads out of bounds; throws
// MidiError for: a missing or short MThd header, SMPTE or zero time division, no tracks, a missing
// track (truncated file), a chunk other than MTrk where a track should start, a track length past
// the end of the file, an event crossing the end of its track chunk, a variable-length quantity
// longer than 4 bytes or cut off, running status without a previous channel status, a data byte
// above 127, an undefined status byte (0xF4, 0xF5, 0xF9, 0xFD), a meta or sysex payload over
// 1,000,000 bytes, and meta payloads that mido cannot decode (set_tempo under 3 bytes,
// time_signature under 4, key_signature under 2 or outside -7..7 sharps / mode 0..1, smpte_offset
// under 5 or with a frame-rate code above 3, channel_prefix empty, sequence_number of 1 byte).
// Deviations from mido, which the reference used (docs/tasks.md): mido reads on past a chunk's end
// and accepts longer quantities, and gives sysex and system messages running status.
SmfFile parse_smf(std::span<const uint8_t> bytes, const std::string& name);

// A note in seconds, as pretty_midi reports it.
struct MidiNote {
  double start = 0, end = 0;
  int pitch = 0;
  int channel = 0;
  int track = 0;
};

// pretty_midi's notes of every track (all channels and pitches, in order of their note-off).
// Throws MidiError where pretty_midi refuses the file: a track with no events, a largest tick
// above 10^7, a tempo of 0.
std::vector<MidiNote> smf_notes(const SmfFile& f, const std::string& name);

struct MidiTokenizerOptions {
  // Files whose event stream would exceed this many events are refused (a corrupt tempo map can
  // ask for hundreds of millions of time shifts; real files give thousands).
  int64_t max_events = int64_t{1} << 26;
};

// The event stream of one parsed file, starting with the separator.
std::vector<int32_t> midi_events(const SmfFile& f, const std::string& name,
                                 const MidiTokenizerOptions& opt = {});

// parse_smf + midi_events on a file's bytes.
std::vector<int32_t> tokenize_midi(std::span<const uint8_t> bytes, const std::string& name,
                                   const MidiTokenizerOptions& opt = {});

// Every *.mid / *.midi file under `dir` (recursively, case-insensitive extension), named by its
// path relative to `dir` with '/' separators and sorted bytewise. InputError when `dir` is not a
// readable directory or holds no MIDI file.
std::vector<std::string> list_midi_files(const std::filesystem::path& dir);

struct MidiCorpusOptions {
  double eval_fraction = 0.2;      // round(n f) files (at least 1 when n > 1) go to validation
  uint64_t split_seed = 20260506;  // Python random.Random(seed).shuffle of the file list
  int64_t max_files = 0;           // keep only the first max_files names before splitting; 0 = all
  // A file with bytes after its declared tracks: the reference (mido) uses the declared tracks and
  // ignores the rest; a warning says so either way. False skips such files.
  bool keep_files_with_trailing_bytes = true;
  MidiTokenizerOptions tokenizer;
};

struct MidiCorpus {
  TokenCorpus tokens;  // LM tokens (event + 1), vocabulary 257
  std::vector<int32_t> train_events, validation_events;
  std::vector<std::string> train_files, validation_files;  // relative paths, in stream order
  std::vector<std::string> skipped;                        // "PATH: PROBLEM" for each file left out
  std::vector<std::string> warnings;                       // every warning also sent to the sink
};

// Every MIDI file under `dir` (list_midi_files). As the reference: the names
// (first max_files of them) are shuffled with Python's random.Random(split_seed); the first
// round(n * eval_fraction) go to validation (at least one when n > 1, none when n == 1), the rest
// to training; each split is the concatenation of its files' event streams in that shuffled order.
// A malformed file is skipped with a warning naming it and the problem; it still counts in the
// split, as in the reference, which splits the names before reading them. InputError when `dir` is
// not a readable directory or holds no MIDI file.
MidiCorpus load_midi_corpus(const std::filesystem::path& dir, const MidiCorpusOptions& opt = {},
                            const WarningSink& warn = warn_to_stderr);

// Writes the event streams as the reference's train.bin and eval.bin (one byte per event) into
// `out_dir` (created if missing), atomically; byte_corpus(train.bin, eval.bin) reads them back as
// the same LM tokens.
void save_midi_corpus(const MidiCorpus& c, const std::filesystem::path& out_dir);

}  // namespace relpos::tasks
