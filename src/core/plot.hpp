// Plots through gnuplot (Debian's gnuplot-nox), safely: the script is ours, written beside its CSV
// data in the output folder; gnuplot runs there without a shell with the script name as its only
// argument, and the PNG appears atomically (drawn to a temp name, then renamed). No user path is
// ever written into a script.
#pragma once

#include <filesystem>
#include <string>

namespace relpos {

// A gnuplot single-quoted string ('' is a literal quote; newlines dropped).
std::string quote_gp(const std::string& s);

// File stems from names: letters, digits, '-', '_' and '.' only.
std::string safe_stem(const std::string& s);

enum class PlotStatus { Drawn, NoGnuplot, Failed };

// Writes DIR/STEM.gp (a terminal line for a width x height PNG, then `body`) and draws
// DIR/STEM.png. The script stays when gnuplot is missing or fails.
PlotStatus gnuplot_png(const std::filesystem::path& dir, const std::string& stem,
                       const std::string& body, int width = 1400, int height = 900);

}  // namespace relpos
