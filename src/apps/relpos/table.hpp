// Tables for the command line: Markdown for people, CSV and JSON for machines.
#pragma once

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

namespace relpos::app {

struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;

  void write_markdown(std::ostream& os) const {
    std::vector<size_t> w(header.size());
    for (size_t c = 0; c < header.size(); ++c) w[c] = header[c].size();
    for (const auto& r : rows)
      for (size_t c = 0; c < r.size() && c < w.size(); ++c) w[c] = std::max(w[c], r[c].size());
    const auto line = [&](const std::vector<std::string>& cells) {
      os << "|";
      for (size_t c = 0; c < w.size(); ++c)
        os << " " << fmt::format("{:<{}}", c < cells.size() ? cells[c] : "", w[c]) << " |";
      os << "\n";
    };
    line(header);
    os << "|";
    for (size_t c = 0; c < w.size(); ++c) os << std::string(w[c] + 2, '-') << "|";
    os << "\n";
    for (const auto& r : rows) line(r);
  }

  static std::string csv_cell(const std::string& s) {
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string o = "\"";
    for (char c : s) o += c == '"' ? std::string("\"\"") : std::string(1, c);
    return o + "\"";
  }
  void write_csv(std::ostream& os) const {
    for (size_t c = 0; c < header.size(); ++c) os << (c ? "," : "") << csv_cell(header[c]);
    os << "\n";
    for (const auto& r : rows) {
      for (size_t c = 0; c < r.size(); ++c) os << (c ? "," : "") << csv_cell(r[c]);
      os << "\n";
    }
  }
};

inline std::string sci(double x) {
  return fmt::format("{:.2e}", x);
}

}  // namespace relpos::app
