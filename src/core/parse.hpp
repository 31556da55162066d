// Strict parsing of user-supplied numbers and a short form of long user strings for messages.
// Every user-facing number goes through these: the whole text must be the number (no trailing
// junk, no whitespace), doubles must be finite, integers must fit their type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace relpos {

// A finite double written in full ("1", "-2.5", "1e3", "+4"); nullopt otherwise (junk, nan, inf,
// overflow to inf, empty).
std::optional<double> parse_finite_double(std::string_view s);

// A decimal integer in [lo, hi] written in full; nullopt otherwise (junk, overflow, out of range).
std::optional<int64_t> parse_int64(std::string_view s, int64_t lo, int64_t hi);

// An unsigned 64-bit decimal integer written in full (no sign); nullopt on junk or overflow.
std::optional<uint64_t> parse_uint64(std::string_view s);

// `s` as it should appear in a message: unchanged when short, else its first `keep` characters
// followed by "... (N characters)", so that a 100 KB argument does not flood stderr.
std::string brief(std::string_view s, size_t keep = 160);

}  // namespace relpos
