// json_close A.json B.json [--rtol R] [--atol A] [--loose KEY=VALUE:RTOL]: exit 0 when the two JSON
// documents have the same structure, equal strings/booleans/nulls, and numbers with |a - b| <= atol
// + rtol * max(|a|, |b|); else print the first differences (JSON pointer, both values) and exit 1.
// Used by tests/golden.sh to check that a refactoring keeps every number the CLI prints.
#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

using nlohmann::json;

struct Compare {
  double rtol = 0, atol = 0;
  // objects with loose_key == loose_value compare their numbers to loose_rtol instead (verify's
  // float32 rows: rounding-level residuals that differ between -O2 and -O3 or two ISA builds)
  std::string loose_key, loose_value;
  double loose_rtol = -1;
  int reported = 0, differences = 0;

  void report(const std::string& where, const json& a, const json& b) {
    ++differences;
    if (reported++ < 20) std::cout << where << ": " << a.dump() << " != " << b.dump() << "\n";
  }

  bool loose(const json& a, const json& b) const {
    return loose_rtol >= 0 && a.contains(loose_key) && b.contains(loose_key) &&
           a.at(loose_key) == loose_value && b.at(loose_key) == loose_value;
  }

  void run(const json& a, const json& b, const std::string& where, double rt) {
    if (a.is_number() && b.is_number()) {
      const double x = a.get<double>(), y = b.get<double>();
      if (!(std::abs(x - y) <= atol + rt * std::max(std::abs(x), std::abs(y)))) report(where, a, b);
      return;
    }
    if (a.type() != b.type()) return report(where, a, b);
    if (a.is_object()) {
      const double inner = loose(a, b) ? loose_rtol : rt;
      for (auto it = a.begin(); it != a.end(); ++it) {
        if (!b.contains(it.key()))
          report(where + "/" + it.key(), it.value(), json("<missing>"));
        else
          run(it.value(), b.at(it.key()), where + "/" + it.key(), inner);
      }
      for (auto it = b.begin(); it != b.end(); ++it)
        if (!a.contains(it.key())) report(where + "/" + it.key(), json("<missing>"), it.value());
    } else if (a.is_array()) {
      if (a.size() != b.size())
        return report(where + " (array size)", json(a.size()), json(b.size()));
      for (size_t i = 0; i < a.size(); ++i) run(a[i], b[i], where + "/" + std::to_string(i), rt);
    } else if (a != b) {
      report(where, a, b);
    }
  }
};

json load(const char* path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error(std::string("cannot read ") + path);
  return json::parse(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: json_close A.json B.json [--rtol R] [--atol A]\n";
    return 2;
  }
  Compare c;
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--loose") {  // KEY=VALUE:RTOL
      const std::string v = argv[i + 1];
      const auto eq = v.find('='), colon = v.rfind(':');
      if (eq == std::string::npos || colon == std::string::npos || colon < eq) {
        std::cerr << "json_close: --loose wants KEY=VALUE:RTOL\n";
        return 2;
      }
      c.loose_key = v.substr(0, eq);
      c.loose_value = v.substr(eq + 1, colon - eq - 1);
      c.loose_rtol = std::stod(v.substr(colon + 1));
      continue;
    }
    if (flag == "--rtol")
      c.rtol = std::stod(argv[i + 1]);
    else if (flag == "--atol")
      c.atol = std::stod(argv[i + 1]);
    else {
      std::cerr << "json_close: unknown flag " << flag << "\n";
      return 2;
    }
  }
  try {
    c.run(load(argv[1]), load(argv[2]), "", c.rtol);
  } catch (const std::exception& e) {
    std::cerr << "json_close: " << e.what() << "\n";
    return 2;
  }
  if (c.differences) std::cout << c.differences << " difference(s)\n";
  return c.differences ? 1 : 0;
}
