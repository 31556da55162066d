// Resident memory of this process from /proc (Linux): the current and peak resident set, and a
// reset of the peak (writing 5 to /proc/self/clear_refs, Linux >= 4.0), so that a measurement's
// peak starts from the memory resident when it begins.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace relpos::bench {

// A "Name:   123 kB" field of /proc/self/status (or /proc/meminfo) in KiB; -1 when missing.
inline int64_t proc_kib(const char* file, const std::string& field) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, field.size(), field) != 0 || line.size() <= field.size() ||
        line[field.size()] != ':')
      continue;
    std::istringstream s(line.substr(field.size() + 1));
    int64_t v = -1;
    s >> v;
    return v;
  }
  return -1;
}

inline int64_t rss_kib() {
  return proc_kib("/proc/self/status", "VmRSS");
}
inline int64_t peak_rss_kib() {
  return proc_kib("/proc/self/status", "VmHWM");
}
inline int64_t mem_available_kib() {
  return proc_kib("/proc/meminfo", "MemAvailable");
}

// Sets the peak resident set (VmHWM) to the current one; false where the kernel refuses.
inline bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace relpos::bench
