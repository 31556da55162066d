#include "core/plot.hpp"

#include <fmt/format.h>

#include <cctype>

#include "core/files.hpp"

namespace relpos {

namespace fs = std::filesystem;

std::string quote_gp(const std::string& s) {
  std::string o = "'";
  for (char c : s) {
    if (c == '\n' || c == '\r') continue;
    o += c == '\'' ? std::string("''") : std::string(1, c);
  }
  return o + "'";
}

std::string safe_stem(const std::string& s) {
  std::string o;
  for (char c : s)
    o +=
        (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.') ? c : '_';
  return o;
}

PlotStatus gnuplot_png(const fs::path& dir, const std::string& stem, const std::string& body,
                       int width, int height) {
  const std::string png_tmp = temp_path_for(fs::path(stem + ".png")).filename().string();
  write_file_atomic(dir / (stem + ".gp"),
                    fmt::format("set terminal pngcairo size {},{} noenhanced\nset output {}\n{}",
                                width, height, quote_gp(png_tmp), body));
  if (!fs::exists("/usr/bin/gnuplot")) return PlotStatus::NoGnuplot;
  const fs::path png = dir / png_tmp;
  std::error_code ec;
  if (run_program({"/usr/bin/gnuplot", stem + ".gp"}, dir) != 0 || !fs::exists(png)) {
    fs::remove(png, ec);
    return PlotStatus::Failed;
  }
  fs::rename(png, dir / (stem + ".png"), ec);
  return ec ? PlotStatus::Failed : PlotStatus::Drawn;
}

}  // namespace relpos
