#include "tasks/midi_text.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>

#include "tasks/rng.hpp"
#include "tasks/text_lm.hpp"

namespace relpos::tasks {

namespace {

// One message of mido's merged track: its absolute tick and the event.
struct MergedMessage {
  int64_t tick;
  const SmfEvent* event;
};

bool is_end_of_track(const SmfEvent& e) {
  return e.status == 0xFF && e.meta_type == 0x2F;
}

// Rows of a CSV file with double-quoted fields ("" inside quotes is one quote), as Python's csv.
std::vector<std::vector<std::string>> read_csv(const std::string& text, const std::string& name) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> row;
  std::string field;
  bool quoted = false, any = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c != '"') {
        field += c;
      } else if (i + 1 < text.size() && text[i + 1] == '"') {
        field += '"';
        ++i;
      } else {
        quoted = false;
      }
      continue;
    }
    if (c == '"') {
      quoted = any = true;
    } else if (c == ',') {
      row.push_back(std::move(field));
      field.clear();
      any = true;
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      if (any || !field.empty()) row.push_back(std::move(field));
      if (!row.empty()) rows.push_back(std::move(row));
      row.clear();
      field.clear();
      any = false;
    } else {
      field += c;
      any = true;
    }
  }
  if (quoted) throw InputError(fmt::format("{}: unterminated quoted field", name));
  if (any || !field.empty()) row.push_back(std::move(field));
  if (!row.empty()) rows.push_back(std::move(row));
  return rows;
}

}  // namespace

std::vector<std::string> midi_text_tokens(const SmfFile& f, const std::string& name,
                                          const MidiTextOptions& opt) {
  if (f.format == 2)
    throw MidiError(fmt::format("{}: SMF format 2 (asynchronous tracks) cannot be merged", name));
  if (opt.grid_ms <= 0 || opt.max_delta < 0 || opt.max_events_per_piece < 0)
    throw InputError(
        fmt::format("MIDI text: grid_ms {} must be > 0, max_delta {} and "
                    "max_events_per_piece {} >= 0",
                    opt.grid_ms, opt.max_delta, opt.max_events_per_piece));
  std::vector<MergedMessage> merged;
  for (const auto& track : f.tracks)
    for (const SmfEvent& e : track)
      if (!is_end_of_track(e)) merged.push_back({e.tick, &e});
  std::stable_sort(merged.begin(), merged.end(),
                   [](const MergedMessage& a, const MergedMessage& b) { return a.tick < b.tick; });

  std::vector<std::string> tokens;
  double tempo = 500000.0;  // mido's DEFAULT_TEMPO
  int64_t previous_tick = 0;
  int64_t pending = 0;
  for (const MergedMessage& m : merged) {
    const SmfEvent& e = *m.event;
    const int64_t ticks = m.tick - previous_tick;
    previous_tick = m.tick;
    if (ticks > 0) {
      const double scale = tempo * 1e-6 / static_cast<double>(f.ticks_per_beat);
      const double seconds = static_cast<double>(ticks) * scale;
      // (a corrupt file's delta can exceed int64; anything above 10^15 clamps to max_delta anyway)
      pending +=
          static_cast<int64_t>(std::min(std::nearbyint(seconds * 1000.0 / opt.grid_ms), 1e15));
      pending = std::min<int64_t>(pending, int64_t{1} << 60);
    }
    if (e.status == 0xFF && e.meta_type == 0x51) {
      if (e.data.size() < 3)
        throw MidiError(
            fmt::format("{}: set_tempo of {} bytes at tick {}", name, e.data.size(), m.tick));
      tempo =
          static_cast<double>((uint32_t{e.data[0]} << 16) | (uint32_t{e.data[1]} << 8) | e.data[2]);
    }
    if (static_cast<int64_t>(tokens.size()) >= opt.max_events_per_piece) break;
    const int kind = e.status & 0xF0, channel = e.status & 0x0F;
    if (e.status >= 0xF0 || e.data.empty()) continue;
    const auto d = std::clamp<int64_t>(pending, 0, opt.max_delta);
    std::string token;
    if (kind == 0x90 && e.data.size() >= 2 && e.data[1] > 0) {
      token =
          fmt::format("d{:03d}.on{:03d}.v{:03d}.c{}", d, int{e.data[0]}, int{e.data[1]}, channel);
    } else if ((kind == 0x80 || kind == 0x90) && e.data.size() >= 2) {
      token = fmt::format("d{:03d}.off{:03d}.c{}", d, int{e.data[0]}, channel);
    } else if (kind == 0xB0 && opt.include_controls && e.data.size() >= 2) {
      token =
          fmt::format("d{:03d}.cc{:03d}.v{:03d}.c{}", d, int{e.data[0]}, int{e.data[1]}, channel);
    } else if (kind == 0xC0 && opt.include_programs) {
      token = fmt::format("d{:03d}.pg{:03d}.c{}", d, int{e.data[0]}, channel);
    } else {
      continue;
    }
    tokens.push_back(std::move(token));
    pending = 0;
  }
  return tokens;
}

std::string midi_text_clean(std::string_view s) {
  // The reference's two re.sub calls in order, per code point as Python's re on a str: first
  // every character outside the set becomes '_' (a non-ASCII character is one '_'; tabs and
  // newlines too), then each run of the whitespace left, spaces, becomes one '_'.
  std::string out;
  bool in_space = false;
  for (const char32_t c : decode_utf8(s, "MIDI text metadata")) {
    if (c == U' ') {
      if (!in_space) out += '_';
      in_space = true;
      continue;
    }
    in_space = false;
    const bool keep = c < 0x80 && (std::isalnum(static_cast<int>(c)) ||
                                   std::string_view("_.,+:/()-").find(static_cast<char>(c)) !=
                                       std::string_view::npos);
    out += keep ? static_cast<char>(c) : '_';
  }
  if (out.size() > 80) out.resize(80);
  return out.empty() ? "NA" : out;
}

MidiTextCorpus musicnet_midi_text(const std::filesystem::path& dir, const MusicnetTextOptions& opt,
                                  const WarningSink& warn) {
  if (opt.max_files < 1)
    throw InputError(fmt::format("MusicNet MIDI text: max_files {} < 1", opt.max_files));
  const std::vector<std::string> files = list_midi_files(dir);
  // the reference's /(\d+)[^/]*\.midi?$ on a member path: the digits that start the file name
  // (list_midi_files has kept the .mid / .midi names; std::regex is avoided: GCC 12 warns inside
  // it under the sanitizers)
  std::map<std::string, std::string> file_of_id;
  for (const auto& rel : files) {
    const std::string name = rel.substr(rel.rfind('/') + 1);
    const size_t digits = name.find_first_not_of("0123456789");
    if (digits == 0 || digits == std::string::npos) continue;
    const auto [it, added] = file_of_id.emplace(name.substr(0, digits), rel);
    if (!added && warn)
      warn(fmt::format("MusicNet MIDI text: {} and {} both carry id {}; using {}", it->second, rel,
                       it->first, it->second));
  }

  const auto meta_path = dir / "musicnet_metadata.csv";
  const auto rows = read_csv(read_file_bytes(meta_path), meta_path.string());
  if (rows.empty()) throw InputError(fmt::format("{}: empty", meta_path.string()));
  auto column = [&](const char* want) {
    const auto& h = rows[0];
    const auto it = std::find(h.begin(), h.end(), want);
    if (it == h.end())
      throw InputError(fmt::format("{}: no '{}' column", meta_path.string(), want));
    return static_cast<size_t>(it - h.begin());
  };
  const size_t c_id = column("id"), c_comp = column("composer"), c_ens = column("ensemble"),
               c_work = column("composition"), c_move = column("movement"),
               c_sec = column("seconds");
  std::vector<const std::vector<std::string>*> candidates;
  for (size_t r = 1; r < rows.size(); ++r) {
    if (rows[r].size() != rows[0].size())
      throw InputError(fmt::format("{}: row {} has {} fields, the header {}", meta_path.string(),
                                   r + 1, rows[r].size(), rows[0].size()));
    if (file_of_id.count(rows[r][c_id])) candidates.push_back(&rows[r]);
  }
  PythonRandom rng(opt.seed);
  rng.shuffle(candidates);

  MidiTextCorpus c;
  std::string body;
  for (const auto* row : candidates) {
    if (static_cast<int64_t>(c.pieces.size()) >= opt.max_files) break;
    const std::string& rel = file_of_id.at((*row)[c_id]);
    std::vector<std::string> tokens;
    try {
      const std::string raw = read_file_bytes(dir / rel);
      const SmfFile f = parse_smf({reinterpret_cast<const uint8_t*>(raw.data()), raw.size()}, rel);
      tokens = midi_text_tokens(f, rel, opt.tokens);
    } catch (const InputError& e) {
      c.skipped.push_back(e.what());
      if (warn) warn(fmt::format("skipping {}", e.what()));
      continue;
    }
    char* end = nullptr;
    const std::string& sec = (*row)[c_sec];
    const double seconds = std::strtod(sec.c_str(), &end);
    if (sec.empty() || end != sec.c_str() + sec.size())
      throw InputError(fmt::format("{}: id {}: seconds '{}' is not a number", meta_path.string(),
                                   (*row)[c_id], sec));
    body += fmt::format("PIECE={:04d}|ID={}|SEC={:.2f}|COMP={}|ENS={}|WORK={}|MOVE={}| {}\n",
                        c.pieces.size(), midi_text_clean((*row)[c_id]), seconds,
                        midi_text_clean((*row)[c_comp]), midi_text_clean((*row)[c_ens]),
                        midi_text_clean((*row)[c_work]), midi_text_clean((*row)[c_move]),
                        fmt::join(tokens, " "));
    c.pieces.push_back(rel);
  }
  if (c.pieces.empty())
    throw InputError(
        fmt::format("{}: none of the {} candidate pieces parses", dir.string(), candidates.size()));
  if (static_cast<int64_t>(c.pieces.size()) < opt.max_files && warn)
    warn(fmt::format("MusicNet MIDI text: {} pieces parse, fewer than the {} asked for",
                     c.pieces.size(), opt.max_files));
  const auto& t = opt.tokens;
  c.text = fmt::format(
      "{}# split=all/selection=random(seed {})/pieces={}/grid_ms={}{}{}\n"
      "# source: MusicNet reference MIDI (Zenodo 5120004) with musicnet_metadata.csv\n\n{}",
      kMusicnetTextFirstLine, opt.seed, c.pieces.size(), t.grid_ms,
      t.include_programs ? "/programs" : "", t.include_controls ? "/controls" : "", body);
  return c;
}

}  // namespace relpos::tasks
