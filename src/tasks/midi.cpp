#include "tasks/midi.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <system_error>
#include <tuple>

#include "core/files.hpp"

namespace relpos::tasks {

namespace {

constexpr size_t kMaxPayload = 1000000;  // mido's MAX_MESSAGE_LENGTH
constexpr int64_t kMaxTick = 10000000;   // pretty_midi's MAX_TICK

// Bounds-checked big-endian reads over bytes[pos, limit): every read names what it wanted and
// where, and never passes `limit` (the file's end, or the end of the current track chunk).
class Reader {
 public:
  Reader(std::span<const uint8_t> bytes, const std::string& name) : b_(bytes), name_(name) {}

  size_t pos = 0;
  size_t limit = 0;
  std::string where;  // "track 3" while reading a track, for messages

  [[noreturn]] void fail(size_t at, const std::string& what) const {
    throw MidiError(fmt::format("{}: {}{}{} at byte offset {}", name_, where,
                                where.empty() ? "" : ": ", what, at));
  }

  // `n` more bytes must lie before the limit; `start` is the offset of the item being read.
  void need(size_t n, size_t start, const char* what) const {
    if (n > limit - pos) {
      if (limit < b_.size())
        fail(start, fmt::format("{} crosses the end of the track chunk (offset {})", what, limit));
      fail(start, fmt::format("{} cut off by the end of the file ({} bytes)", what, b_.size()));
    }
  }
  uint8_t u8(size_t start, const char* what) {
    need(1, start, what);
    return b_[pos++];
  }
  uint32_t u32(size_t start, const char* what) {
    need(4, start, what);
    const uint32_t v = (uint32_t{b_[pos]} << 24) | (uint32_t{b_[pos + 1]} << 16) |
                       (uint32_t{b_[pos + 2]} << 8) | b_[pos + 3];
    pos += 4;
    return v;
  }
  uint16_t u16(size_t start, const char* what) {
    need(2, start, what);
    const auto v = static_cast<uint16_t>((b_[pos] << 8) | b_[pos + 1]);
    pos += 2;
    return v;
  }
  // A variable-length quantity: at most 4 bytes (the SMF limit, 0x0FFFFFFF).
  uint32_t vlq(const char* what) {
    const size_t start = pos;
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = u8(start, what);
      v = (v << 7) | (byte & 0x7Fu);
      if (byte < 0x80) return v;
    }
    fail(start, fmt::format("{} is a variable-length quantity longer than 4 bytes", what));
  }
  std::vector<uint8_t> bytes(size_t n, size_t start, const char* what) {
    need(n, start, what);
    std::vector<uint8_t> v(b_.begin() + static_cast<ptrdiff_t>(pos),
                           b_.begin() + static_cast<ptrdiff_t>(pos + n));
    pos += n;
    return v;
  }
  std::string tag(size_t at) const {  // 4 bytes as text for messages, non-printables escaped
    std::string s;
    for (size_t i = at; i < at + 4 && i < b_.size(); ++i) {
      const uint8_t c = b_[i];
      s += c >= 0x20 && c < 0x7F && c != '\'' ? std::string(1, static_cast<char>(c))
                                              : fmt::format("\\x{:02x}", c);
    }
    return s;
  }
  size_t size() const { return b_.size(); }

 private:
  std::span<const uint8_t> b_;
  const std::string& name_;
};

// Data bytes after the status of a channel or system message; -1 where mido knows no message.
int data_length(uint8_t status) {
  if (status < 0xF0) return (status & 0xF0) == 0xC0 || (status & 0xF0) == 0xD0 ? 1 : 2;
  switch (status) {
    case 0xF1:
    case 0xF3:
      return 1;
    case 0xF2:
      return 2;
    case 0xF6:
    case 0xF8:
    case 0xFA:
    case 0xFB:
    case 0xFC:
    case 0xFE:
      return 0;
    default:
      return -1;
  }
}

// The meta payloads mido's decoders (and the attribute checks they trigger) refuse.
void check_meta(const Reader& r, size_t at, uint8_t type, const std::vector<uint8_t>& d) {
  auto bad = [&](const std::string& why) {
    r.fail(at, fmt::format("meta event 0x{:02x}: {}", type, why));
  };
  switch (type) {
    case 0x00:
      if (d.size() == 1) bad("sequence number of 1 byte (0 or 2 expected)");
      break;
    case 0x20:
      if (d.empty()) bad("empty channel prefix");
      break;
    case 0x51:
      if (d.size() < 3) bad(fmt::format("tempo of {} bytes (3 expected)", d.size()));
      break;
    case 0x54:
      if (d.size() < 5) bad(fmt::format("SMPTE offset of {} bytes (5 expected)", d.size()));
      if ((d[0] >> 5) > 3) bad(fmt::format("SMPTE frame-rate code {} (0..3 expected)", d[0] >> 5));
      if (d[1] > 59 || d[2] > 59 || d[4] > 99)
        bad("SMPTE offset minutes, seconds or subframes out of range");
      break;
    case 0x58:
      if (d.size() < 4) bad(fmt::format("time signature of {} bytes (4 expected)", d.size()));
      break;
    case 0x59: {
      if (d.size() < 2) bad(fmt::format("key signature of {} bytes (2 expected)", d.size()));
      const int sf = static_cast<int8_t>(d[0]);
      if (sf < -7 || sf > 7 || d[1] > 1)
        bad(fmt::format("key signature {} sharps, mode {} (-7..7 and 0..1 expected)", sf, d[1]));
      break;
    }
    default:
      break;
  }
}

std::vector<SmfEvent> parse_track(Reader& r) {
  std::vector<SmfEvent> events;
  int64_t tick = 0;
  int running = -1;  // last channel status; meta events keep it, sysex and system messages clear it
  while (r.pos < r.limit) {
    const size_t at = r.pos;
    tick += r.vlq("delta time");
    SmfEvent e;
    e.tick = tick;
    const size_t status_at = r.pos;
    uint8_t status = r.u8(at, "status byte");
    int peeked = -1;
    if (status < 0x80) {
      if (running < 0) r.fail(status_at, "running status without a previous channel status byte");
      peeked = status;
      status = static_cast<uint8_t>(running);
    } else if (status < 0xF0) {
      running = status;
    } else if (status != 0xFF) {
      running = -1;
    }
    e.status = status;
    if (status == 0xFF) {
      e.meta_type = r.u8(at, "meta event type");
      const uint32_t len = r.vlq("meta event length");
      if (len > kMaxPayload)
        r.fail(at, fmt::format("meta event of {} bytes (more than {})", len, kMaxPayload));
      e.data = r.bytes(len, at, "meta event");
      check_meta(r, at, e.meta_type, e.data);
    } else if (status == 0xF0 || status == 0xF7) {
      const uint32_t len = r.vlq("sysex length");
      if (len > kMaxPayload)
        r.fail(at, fmt::format("sysex of {} bytes (more than {})", len, kMaxPayload));
      e.data = r.bytes(len, at, "sysex event");
      // mido strips a leading 0xF0 and a trailing 0xF7 and requires 7-bit data in between
      const size_t first = !e.data.empty() && e.data.front() == 0xF0 ? 1 : 0;
      size_t last = e.data.size();
      if (last > first && e.data.back() == 0xF7) --last;
      for (size_t i = first; i < last; ++i)
        if (e.data[i] > 127)
          r.fail(at, fmt::format("sysex data byte 0x{:02x} above 127", e.data[i]));
    } else {
      const int n = data_length(status);
      if (n < 0) r.fail(status_at, fmt::format("undefined status byte 0x{:02x}", status));
      if (peeked >= 0) e.data.push_back(static_cast<uint8_t>(peeked));
      while (static_cast<int>(e.data.size()) < n) {
        const size_t data_at = r.pos;
        const uint8_t v = r.u8(at, "message data");
        if (v > 127)
          r.fail(data_at, fmt::format("data byte 0x{:02x} above 127 (status 0x{:02x})", v, status));
        e.data.push_back(v);
      }
    }
    events.push_back(std::move(e));
  }
  return events;
}

}  // namespace

SmfFile parse_smf(std::span<const uint8_t> bytes, const std::string& name) {
  Reader r(bytes, name);
  r.limit = bytes.size();
  if (bytes.size() < 8 || r.tag(0) != "MThd")
    r.fail(0, fmt::format("not a Standard MIDI File (expected 'MThd', found '{}')", r.tag(0)));
  r.pos = 4;
  const uint32_t hlen = r.u32(4, "header length");
  if (hlen < 6) r.fail(4, fmt::format("header chunk of {} bytes (at least 6 expected)", hlen));
  if (hlen > bytes.size() - 8)
    r.fail(4, fmt::format("header chunk of {} bytes runs past the end of the file ({} bytes)", hlen,
                          bytes.size()));
  SmfFile f;
  f.format = r.u16(8, "format");
  const uint16_t ntracks = r.u16(10, "track count");
  const auto division = static_cast<int16_t>(r.u16(12, "time division"));
  if (division <= 0)
    r.fail(12, division == 0
                   ? std::string("time division of 0 ticks per beat")
                   : std::string("SMPTE time division (only ticks per beat are supported)"));
  if (ntracks == 0) r.fail(10, "the header declares no tracks");
  f.ticks_per_beat = division;
  r.pos = 8 + size_t{hlen};
  for (int k = 0; k < ntracks; ++k) {
    const size_t at = r.pos;
    r.where.clear();
    if (bytes.size() - at < 8)
      r.fail(at, fmt::format("track {} of {} missing: file ends after {} bytes", k, ntracks,
                             bytes.size()));
    if (r.tag(at) != "MTrk")
      r.fail(at, fmt::format("track {}: expected 'MTrk', found '{}'", k, r.tag(at)));
    r.pos = at + 4;
    const uint32_t len = r.u32(at + 4, "track length");
    if (len > bytes.size() - r.pos)
      r.fail(at + 4,
             fmt::format("track {}: chunk length {} runs past the end of the file ({} bytes)", k,
                         len, bytes.size()));
    r.limit = r.pos + len;
    r.where = fmt::format("track {}", k);
    f.tracks.push_back(parse_track(r));
    r.limit = bytes.size();
  }
  f.trailing_offset = static_cast<int64_t>(r.pos);
  f.trailing_bytes = static_cast<int64_t>(bytes.size() - r.pos);
  return f;
}

std::vector<MidiNote> smf_notes(const SmfFile& f, const std::string& name) {
  if (f.tracks.empty()) throw MidiError(fmt::format("{}: no tracks", name));
  int64_t max_tick = 0;
  for (size_t k = 0; k < f.tracks.size(); ++k) {
    if (f.tracks[k].empty()) throw MidiError(fmt::format("{}: track {} has no events", name, k));
    max_tick = std::max(max_tick, f.tracks[k].back().tick);
  }
  if (max_tick + 1 > kMaxTick)
    throw MidiError(fmt::format("{}: largest tick {} above {} (pretty_midi's limit)", name,
                                max_tick + 1, kMaxTick));

  // Tempo map: (start tick, seconds per tick, seconds at the start tick), as pretty_midi's
  // _load_tempo_changes and _update_tick_to_time compute it (same float64 operations).
  struct Segment {
    int64_t tick;
    double scale;
    double start;
  };
  const double res = f.ticks_per_beat;
  std::vector<Segment> segs{{0, 60.0 / (120.0 * res), 0.0}};
  for (const SmfEvent& e : f.tracks[0]) {
    if (e.status != 0xFF || e.meta_type != 0x51) continue;
    const uint32_t tempo = (uint32_t{e.data[0]} << 16) | (uint32_t{e.data[1]} << 8) | e.data[2];
    if (tempo == 0)
      throw MidiError(fmt::format("{}: tempo of 0 microseconds per beat at tick {}", name, e.tick));
    const double scale = 60.0 / ((6e7 / tempo) * res);
    if (e.tick == 0) {
      segs = {{0, scale, 0.0}};
    } else if (scale != segs.back().scale) {
      const Segment& p = segs.back();
      segs.push_back({e.tick, scale, p.start + p.scale * static_cast<double>(e.tick - p.tick)});
    }
  }
  auto seconds = [&](int64_t tick) {
    const auto it = std::upper_bound(segs.begin(), segs.end(), tick,
                                     [](int64_t t, const Segment& s) { return t < s.tick; });
    const Segment& s = *(it - 1);
    return s.start + s.scale * static_cast<double>(tick - s.tick);
  };

  std::vector<MidiNote> notes;
  for (size_t k = 0; k < f.tracks.size(); ++k) {
    std::map<std::pair<int, int>, std::vector<int64_t>> open;  // (channel, pitch) -> start ticks
    for (const SmfEvent& e : f.tracks[k]) {
      const int kind = e.status & 0xF0, channel = e.status & 0x0F;
      if (e.status >= 0xF0 || (kind != 0x80 && kind != 0x90)) continue;
      const int pitch = e.data[0], velocity = e.data[1];
      const std::pair<int, int> key{channel, pitch};
      if (kind == 0x90 && velocity > 0) {
        open[key].push_back(e.tick);
        continue;
      }
      const auto it = open.find(key);
      if (it == open.end()) continue;  // a note-off without a note-on
      std::vector<int64_t> keep;
      bool closed = false;
      for (int64_t start : it->second) {
        if (start == e.tick) {
          keep.push_back(start);
        } else {
          notes.push_back({seconds(start), seconds(e.tick), pitch, channel, static_cast<int>(k)});
          closed = true;
        }
      }
      if (closed && !keep.empty()) {
        it->second = std::move(keep);
      } else {
        open.erase(it);
      }
    }
  }
  return notes;
}

std::vector<int32_t> midi_events(const SmfFile& f, const std::string& name,
                                 const MidiTokenizerOptions& opt) {
  struct Ev {
    double time;
    int on;
    int pitch;
    bool operator<(const Ev& o) const {
      return std::tie(time, on, pitch) < std::tie(o.time, o.on, o.pitch);
    }
  };
  std::vector<Ev> evs;
  for (const MidiNote& n : smf_notes(f, name)) {
    if (n.channel == 9 || n.pitch < kMidiPitchMin || n.pitch > kMidiPitchMax) continue;
    evs.push_back({n.start, 1, n.pitch});
    evs.push_back({n.end, 0, n.pitch});
  }
  std::sort(evs.begin(), evs.end());

  std::vector<int32_t> out{kMidiFileSeparator};
  int64_t cursor = 0;
  for (const Ev& e : evs) {
    // round half to even, as Python's round(); times are finite and below 10^7 ticks of tempo
    const auto tick =
        std::max<int64_t>(0, static_cast<int64_t>(std::nearbyint(e.time / kMidiTimeQuantum)));
    int64_t delta = std::max<int64_t>(0, tick - cursor);
    if (delta / kMidiTimeShiftBins > opt.max_events - static_cast<int64_t>(out.size()))
      throw MidiError(fmt::format("{}: more than {} events (a gap of {} quanta at {} s)", name,
                                  opt.max_events, delta, e.time));
    for (; delta > 0; delta -= kMidiTimeShiftBins)
      out.push_back(kMidiTimeShiftFirst +
                    static_cast<int32_t>(std::min<int64_t>(delta, kMidiTimeShiftBins)) - 1);
    cursor = tick;
    out.push_back((e.on ? kMidiNoteOnFirst : kMidiNoteOffFirst) + e.pitch - kMidiPitchMin);
  }
  if (static_cast<int64_t>(out.size()) > opt.max_events)
    throw MidiError(fmt::format("{}: more than {} events", name, opt.max_events));
  return out;
}

std::vector<int32_t> tokenize_midi(std::span<const uint8_t> bytes, const std::string& name,
                                   const MidiTokenizerOptions& opt) {
  return midi_events(parse_smf(bytes, name), name, opt);
}

std::vector<std::string> list_midi_files(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw InputError(fmt::format("{}: not a readable directory", dir.string()));
  std::vector<std::string> names;
  try {
    for (const auto& entry : fs::recursive_directory_iterator(dir)) {
      if (!entry.is_regular_file()) continue;
      std::string ext = entry.path().extension().string();
      std::transform(ext.begin(), ext.end(), ext.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (ext == ".mid" || ext == ".midi")
        names.push_back(fs::relative(entry.path(), dir).generic_string());
    }
  } catch (const fs::filesystem_error& e) {
    throw InputError(fmt::format("{}: cannot list: {}", dir.string(), e.code().message()));
  }
  std::sort(names.begin(), names.end());
  if (names.empty()) throw InputError(fmt::format("{}: no .mid or .midi files", dir.string()));
  return names;
}

MidiCorpus load_midi_corpus(const std::filesystem::path& dir, const MidiCorpusOptions& opt,
                            const WarningSink& warn) {
  if (!(opt.eval_fraction >= 0.0 && opt.eval_fraction <= 1.0))
    throw InputError(
        fmt::format("MIDI corpus: eval fraction {} outside [0, 1]", opt.eval_fraction));
  if (opt.max_files < 0)
    throw InputError(fmt::format("MIDI corpus: max_files {} < 0", opt.max_files));
  std::vector<std::string> names = list_midi_files(dir);
  if (opt.max_files > 0 && static_cast<int64_t>(names.size()) > opt.max_files)
    names.resize(static_cast<size_t>(opt.max_files));

  // The reference's split_items: shuffle, then max(1, round(n f)) to evaluation when n > 1.
  PythonRandom rng(opt.split_seed);
  rng.shuffle(names);
  const auto n = static_cast<int64_t>(names.size());
  const int64_t n_eval =
      n > 1
          ? std::max<int64_t>(
                1, static_cast<int64_t>(std::nearbyint(static_cast<double>(n) * opt.eval_fraction)))
          : 0;

  MidiCorpus c;
  auto note = [&](const std::string& m) {
    c.warnings.push_back(m);
    if (warn) warn(m);
  };
  for (int64_t i = 0; i < n; ++i) {
    const std::string& rel = names[static_cast<size_t>(i)];
    const bool eval = i < n_eval;
    std::vector<int32_t> events;
    try {
      const std::string raw = read_file_bytes(dir / rel);
      const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(raw.data()),
                                           raw.size());
      const SmfFile f = parse_smf(bytes, rel);
      if (f.trailing_bytes > 0) {
        const std::string what =
            fmt::format("{} bytes after the {} declared track(s), from byte offset {}{}",
                        f.trailing_bytes, f.tracks.size(), f.trailing_offset,
                        raw.compare(static_cast<size_t>(f.trailing_offset), 4, "MTrk") == 0
                            ? " (the file holds more tracks than its header declares)"
                            : "");
        if (!opt.keep_files_with_trailing_bytes) throw MidiError(fmt::format("{}: {}", rel, what));
        note(fmt::format(
            "{}: ignoring {}; the declared tracks are used, as the reference (mido) does", rel,
            what));
      }
      events = midi_events(f, rel, opt.tokenizer);
    } catch (const InputError& e) {
      c.skipped.push_back(e.what());
      note(fmt::format("skipping {}", e.what()));
      continue;
    }
    auto& dst = eval ? c.validation_events : c.train_events;
    dst.insert(dst.end(), events.begin(), events.end());
    (eval ? c.validation_files : c.train_files).push_back(rel);
  }
  auto to_lm = [](const std::vector<int32_t>& ev) {
    std::vector<int64_t> t(ev.size());
    for (size_t i = 0; i < ev.size(); ++i) t[i] = int64_t{ev[i]} + 1;
    return t;
  };
  c.tokens.train = to_lm(c.train_events);
  c.tokens.validation = to_lm(c.validation_events);
  c.tokens.vocab_size = 257;
  return c;
}

void save_midi_corpus(const MidiCorpus& c, const std::filesystem::path& out_dir) {
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec)
    throw InputError(
        fmt::format("{}: cannot create directory: {}", out_dir.string(), ec.message()));
  auto bytes = [](const std::vector<int32_t>& ev) {
    std::string s(ev.size(), '\0');
    for (size_t i = 0; i < ev.size(); ++i) s[i] = static_cast<char>(ev[i] & 0xFF);
    return s;
  };
  write_file_atomic(out_dir / "train.bin", bytes(c.train_events));
  write_file_atomic(out_dir / "eval.bin", bytes(c.validation_events));
}

}  // namespace relpos::tasks
