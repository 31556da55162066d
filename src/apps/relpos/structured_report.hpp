// relpos verify --structured / --structured-sweep: the structured-rotation checks (issue 15) as
// tables. The math is core/structured.hpp; this file formats it, writes the sweep's CSV and plot.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace relpos::app {

// Theorem 1 rows (family kinds x d_c in `dims`), printed as md / csv / json; true when all pass.
bool report_structured_theorem1(const std::vector<int>& dims, uint64_t seed,
                                const std::string& format);

// The Theorem 2 sweep over `dims`: the table and the fitted C on stdout; with `out` non-empty,
// OUT/theorem2.csv (atomic) and OUT/theorem2.png (deviation against the bound term, log-log) where
// gnuplot is installed. Returns false when a bound check fails (no finite positive C, or a
// deviation above 1e-12 where the bound term is 0).
bool report_structured_sweep(const std::vector<int>& dims, uint64_t seed, const std::string& format,
                             const std::string& out);

// "1,2,3" -> {1, 2, 3}; InputError naming the bad entry (each must be 1..3).
std::vector<int> parse_structured_dims(const std::string& s);

}  // namespace relpos::app
