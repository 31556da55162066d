// relpos list: every mechanism with options, defaults, exactness and paper section.
#include <iostream>

#include "apps/relpos/commands.hpp"
#include "apps/relpos/table.hpp"
#include "core/registry.hpp"

namespace relpos::app {

void add_list_command(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("list", "List every mechanism: options, defaults, exactness, paper");
  auto format = std::make_shared<std::string>("md");
  cmd->add_option("--format", *format, "md or json")->check(CLI::IsMember({"md", "json"}));
  cmd->callback([format] {
    const auto& cat = mechanism_catalog();
    if (*format == "json") {
      const nlohmann::json j = catalog_json();
      std::cout << j.dump(2) << "\n";
      return;
    }
    Table t{{"mechanism", "kind", "exactness", "paper", "what it is"}, {}};
    for (const auto& m : cat) t.rows.push_back({m.name, m.kind, m.exactness, m.paper, m.summary});
    t.write_markdown(std::cout);
    for (const auto& m : cat) {
      std::cout << "\n### " << m.name << "\n";
      if (!m.aliases.empty())
        std::cout << "reference names: " << fmt::format("{}", fmt::join(m.aliases, ", ")) << "\n";
      if (m.options.empty()) {
        std::cout << "no options\n";
        continue;
      }
      Table o{{"option", "default", "range", "meaning"}, {}};
      for (const auto& x : m.options)
        o.rows.push_back({x.key, x.default_value,
                          x.has_range() ? fmt::format("[{:g}, {:g}]", x.min, x.max) : "", x.doc});
      std::cout << "\n";
      o.write_markdown(std::cout);
    }
    std::cout << "\nCompose with '+': e.g. 'jordan(m=2, regime=raw) + alibi'. Any '<name>_alibi' "
                 "reference name adds ALiBi.\n";
  });
}

}  // namespace relpos::app
