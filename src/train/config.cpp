#include "train/config.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "core/files.hpp"
#include "core/parse.hpp"
#include "core/types.hpp"
#include "tasks/pj_query_lm.hpp"
#include "train/grid2d_train.hpp"

namespace relpos::train {

namespace {

// Reads the keys of one table into fields, remembering which it consumed so that anything left
// over is reported as unknown (with the valid keys).
class Reader {
 public:
  Reader(const toml::table& t, std::string where, std::string source)
      : t_(t), where_(std::move(where)), source_(std::move(source)) {}

  void get(const char* key, std::string& out) { read(key, out, "a string"); }
  void get(const char* key, double& out) {
    known_.insert(key);
    const auto* n = t_.get(key);
    if (!n) return;
    if (auto v = n->value<double>()) {  // integers are accepted as numbers too
      out = *v;
      return;
    }
    fail(key, "a number");
  }
  void get(const char* key, int64_t& out) { read(key, out, "an integer"); }
  void get(const char* key, std::vector<double>& out) {
    known_.insert(key);
    const auto* n = t_.get(key);
    if (!n) return;
    const auto* a = n->as_array();
    if (!a) fail(key, "an array of numbers");
    out.clear();
    for (const auto& e : *a) {
      const auto v = e.value<double>();  // integers are accepted as numbers too
      if (!v) fail(key, "an array of numbers");
      out.push_back(*v);
    }
  }
  void get(const char* key, bool& out) { read(key, out, "true or false"); }
  void get(const char* key, std::vector<int64_t>& out) {
    known_.insert(key);
    const auto* n = t_.get(key);
    if (!n) return;
    const auto* a = n->as_array();
    if (!a) fail(key, "an array of integers");
    out.clear();
    for (const auto& e : *a) {
      const auto v = e.value<int64_t>();
      if (!v || !e.is_integer()) fail(key, "an array of integers");
      out.push_back(*v);
    }
  }
  const toml::table* table(const char* key) {
    known_.insert(key);
    const auto* n = t_.get(key);
    if (!n) return nullptr;
    if (!n->is_table()) fail(key, "a table");
    return n->as_table();
  }
  void finish() const {
    for (const auto& [k, v] : t_)
      if (!known_.count(std::string(k.str()))) {
        std::string valid;
        for (const auto& s : known_) valid += (valid.empty() ? "" : ", ") + s;
        throw InputError(fmt::format(
            "{}: unknown key '{}{}' (valid keys{}: {})", source_, where_, k.str(),
            where_.empty() ? "" : " in [" + where_.substr(0, where_.size() - 1) + "]", valid));
      }
  }

 private:
  template <class T>
  void read(const char* key, T& out, const char* what) {
    known_.insert(key);
    const auto* n = t_.get(key);
    if (!n) return;
    const auto v = n->value_exact<T>();
    if (!v) fail(key, what);
    out = *v;
  }
  [[noreturn]] void fail(const char* key, const char* what) const {
    throw InputError(fmt::format("{}: '{}{}' must be {}", source_, where_, key, what));
  }
  const toml::table& t_;
  std::string where_, source_;
  std::set<std::string> known_;
};

TrainConfig from_table(const toml::table& root, const std::string& source) {
  TrainConfig c;
  Reader r(root, "", source);
  r.get("name", c.name);
  r.get("seed", c.seed);
  r.get("threads", c.threads);
  r.get("device", c.device);
  r.get("checkpoint_every", c.checkpoint_every);
  r.get("log_every", c.log_every);
  if (const auto* t = r.table("model")) {
    Reader m(*t, "model.", source);
    std::string preset = models::to_string(c.model.preset), layout = to_string(c.model.layout);
    m.get("preset", preset);
    m.get("d_model", c.model.d_model);
    m.get("heads", c.model.heads);
    m.get("layers", c.model.layers);
    m.get("mlp_ratio", c.model.mlp_ratio);
    m.get("mechanism", c.model.mechanism);
    m.get("layout", layout);
    m.get("attention", c.model.attention);
    m.get("include_self", c.model.include_self);
    m.get("freeze_qk", c.model.freeze_qk);
    m.get("weights", c.model.weights);
    m.get("dropout", c.model.dropout);
    m.get("embed_dim", c.model.embed_dim);
    m.get("angles_per_layer", c.model.angles_per_layer);
    m.get("kv_shift", c.model.kv_shift);
    m.finish();
    c.model.preset = models::parse_preset(preset);
    if (layout == "interleaved") {
      c.model.layout = Layout::Interleaved;
    } else if (layout == "half_split") {
      c.model.layout = Layout::HalfSplit;
    } else {
      throw InputError(fmt::format("{}: model.layout must be interleaved or half_split, got '{}'",
                                   source, layout));
    }
  }
  if (const auto* t = r.table("task")) {
    Reader k(*t, "task.", source);
    k.get("kind", c.task.kind);
    k.get("benchmark", c.task.benchmark);
    k.get("train_length", c.task.train_length);
    k.get("path", c.task.path);
    k.get("validation_path", c.task.validation_path);
    k.get("validation_fraction", c.task.validation_fraction);
    k.get("train_sample_seed", c.task.train_sample_seed);
    k.get("eval_sample_seed", c.task.eval_sample_seed);
    k.get("target", c.task.target);
    k.get("teacher", c.task.teacher);
    k.get("teacher_lambda", c.task.teacher_lambda);
    k.get("omega_cycles", c.task.omega_cycles);
    k.get("median_threshold", c.task.median_threshold);
    k.get("train_lengths", c.task.train_lengths);
    k.get("length_sampling", c.task.length_sampling);
    k.get("eval_offset", c.task.eval_offset);
    k.get("equivariance_shift", c.task.equivariance_shift);
    k.get("midi_seed", c.task.midi_seed);
    k.get("midi_max_files", c.task.midi_max_files);
    k.get("midi_programs", c.task.midi_programs);
    k.get("midi_controls", c.task.midi_controls);
    k.finish();
  }
  if (const auto* t = r.table("optim")) {
    Reader o(*t, "optim.", source);
    o.get("steps", c.optim.steps);
    o.get("batch", c.optim.batch);
    o.get("lr", c.optim.lr);
    o.get("weight_decay", c.optim.weight_decay);
    o.get("beta1", c.optim.beta1);
    o.get("beta2", c.optim.beta2);
    o.get("eps", c.optim.eps);
    o.get("clip", c.optim.clip);
    o.get("warmup", c.optim.warmup);
    o.get("schedule", c.optim.schedule);
    o.get("min_lr", c.optim.min_lr);
    o.finish();
  }
  if (const auto* t = r.table("eval")) {
    Reader e(*t, "eval.", source);
    e.get("every", c.eval.every);
    e.get("lengths", c.eval.lengths);
    e.get("batches", c.eval.batches);
    e.get("batch_size", c.eval.batch_size);
    e.get("full_split", c.eval.full_split);
    e.finish();
  }
  r.finish();
  return c;
}

toml::table to_table(const TrainConfig& c) {
  toml::array lengths, train_lengths, eval_offset, equivariance_shift;
  for (auto l : c.eval.lengths) lengths.push_back(l);
  for (auto l : c.task.train_lengths) train_lengths.push_back(l);
  for (auto x : c.task.eval_offset) eval_offset.push_back(x);
  for (auto x : c.task.equivariance_shift) equivariance_shift.push_back(x);
  return toml::table{
      {"name", c.name},
      {"seed", c.seed},
      {"threads", c.threads},
      {"device", c.device},
      {"checkpoint_every", c.checkpoint_every},
      {"log_every", c.log_every},
      {"model", toml::table{{"preset", models::to_string(c.model.preset)},
                            {"d_model", c.model.d_model},
                            {"heads", c.model.heads},
                            {"layers", c.model.layers},
                            {"mlp_ratio", c.model.mlp_ratio},
                            {"mechanism", c.model.mechanism},
                            {"layout", to_string(c.model.layout)},
                            {"attention", c.model.attention},
                            {"include_self", c.model.include_self},
                            {"freeze_qk", c.model.freeze_qk},
                            {"weights", c.model.weights},
                            {"dropout", c.model.dropout},
                            {"embed_dim", c.model.embed_dim},
                            {"angles_per_layer", c.model.angles_per_layer},
                            {"kv_shift", c.model.kv_shift}}},
      {"task", toml::table{{"kind", c.task.kind},
                           {"benchmark", c.task.benchmark},
                           {"train_length", c.task.train_length},
                           {"path", c.task.path},
                           {"validation_path", c.task.validation_path},
                           {"validation_fraction", c.task.validation_fraction},
                           {"train_sample_seed", c.task.train_sample_seed},
                           {"eval_sample_seed", c.task.eval_sample_seed},
                           {"target", c.task.target},
                           {"teacher", c.task.teacher},
                           {"teacher_lambda", c.task.teacher_lambda},
                           {"omega_cycles", c.task.omega_cycles},
                           {"median_threshold", c.task.median_threshold},
                           {"train_lengths", train_lengths},
                           {"length_sampling", c.task.length_sampling},
                           {"eval_offset", eval_offset},
                           {"equivariance_shift", equivariance_shift},
                           {"midi_seed", c.task.midi_seed},
                           {"midi_max_files", c.task.midi_max_files},
                           {"midi_programs", c.task.midi_programs},
                           {"midi_controls", c.task.midi_controls}}},
      {"optim", toml::table{{"steps", c.optim.steps},
                            {"batch", c.optim.batch},
                            {"lr", c.optim.lr},
                            {"weight_decay", c.optim.weight_decay},
                            {"beta1", c.optim.beta1},
                            {"beta2", c.optim.beta2},
                            {"eps", c.optim.eps},
                            {"clip", c.optim.clip},
                            {"warmup", c.optim.warmup},
                            {"schedule", c.optim.schedule},
                            {"min_lr", c.optim.min_lr}}},
      {"eval", toml::table{{"every", c.eval.every},
                           {"lengths", lengths},
                           {"batches", c.eval.batches},
                           {"batch_size", c.eval.batch_size},
                           {"full_split", c.eval.full_split}}},
  };
}

void check_range(int64_t v, int64_t lo, int64_t hi, const char* key) {
  if (v < lo || v > hi)
    throw InputError(fmt::format("config: {} must be in [{}, {}], got {}", key, lo, hi, v));
}
void check_range(double v, double lo, double hi, const char* key) {
  if (!(v >= lo && v <= hi))
    throw InputError(fmt::format("config: {} must be in [{}, {}], got {}", key, lo, hi, v));
}

}  // namespace

void TrainConfig::validate() const {
  check_name("config: name", name);
  check_range(seed, 0, int64_t{1} << 40, "seed");
  check_range(threads, 0, 1024, "threads");
  if (device != "cpu" && device != "cuda")
    throw InputError(fmt::format("config: device must be cpu or cuda, got '{}'", device));
  check_range(checkpoint_every, 0, int64_t{1} << 40, "checkpoint_every");
  check_range(log_every, 1, int64_t{1} << 40, "log_every");
  static const std::set<std::string> kinds{"query_lm", "pj_query_lm", "bytes", "chars",
                                           "midi",     "midi_text",   "grid2d"};
  if (!kinds.count(task.kind))
    throw InputError(fmt::format(
        "config: task.kind must be one of query_lm, pj_query_lm, bytes, chars, midi, midi_text, "
        "grid2d, got "
        "'{}'",
        task.kind));
  check_range(task.train_length, 2, int64_t{1} << 20, "task.train_length");
  check_range(task.validation_fraction, 1e-6, 1 - 1e-6, "task.validation_fraction");
  check_range(task.train_sample_seed, 0, int64_t{1} << 62, "task.train_sample_seed");
  check_range(task.eval_sample_seed, 0, int64_t{1} << 62, "task.eval_sample_seed");
  check_range(task.midi_seed, 0, int64_t{1} << 62, "task.midi_seed");
  check_range(task.midi_max_files, 1, 100000, "task.midi_max_files");
  for (auto l : task.train_lengths) check_range(l, 2, int64_t{1} << 20, "task.train_lengths[]");
  if (!task.train_lengths.empty() && task.kind != "pj_query_lm")
    throw InputError(fmt::format(
        "config: task.train_lengths (multi-length training) is for task.kind = pj_query_lm, not {}",
        task.kind));
  if (task.kind == "pj_query_lm") {
    if (task.teacher != "signed" && task.teacher != "attention")
      throw InputError(
          fmt::format("config: task.teacher must be signed or attention, got '{}'", task.teacher));
    if (task.length_sampling != "cycle" && task.length_sampling != "random")
      throw InputError(fmt::format("config: task.length_sampling must be cycle or random, got '{}'",
                                   task.length_sampling));
    check_range(task.teacher_lambda, 1e-12, 1e6, "task.teacher_lambda");
    check_range(task.omega_cycles, -1e9, 1e9, "task.omega_cycles");
    const auto targets = tasks::pj_query_lm_targets();
    if (std::find(targets.begin(), targets.end(), task.target) == targets.end())
      throw InputError(fmt::format("config: task.target must be one of {}, got '{}'",
                                   fmt::join(targets, ", "), task.target));
  }
  if (task.kind != "query_lm" && task.kind != "pj_query_lm" && task.kind != "grid2d" &&
      task.path.empty())
    throw InputError(fmt::format("config: task.kind = {} needs task.path", task.kind));
  check_range(optim.steps, 1, int64_t{1} << 40, "optim.steps");
  check_range(optim.batch, 1, int64_t{1} << 20, "optim.batch");
  check_range(optim.lr, 0.0, 10.0, "optim.lr");
  check_range(optim.weight_decay, 0.0, 10.0, "optim.weight_decay");
  check_range(optim.beta1, 0.0, 1.0 - 1e-12, "optim.beta1");
  check_range(optim.beta2, 0.0, 1.0 - 1e-12, "optim.beta2");
  check_range(optim.eps, 1e-300, 1.0, "optim.eps");
  check_range(optim.clip, 0.0, 1e9, "optim.clip");
  check_range(optim.warmup, 0, optim.steps, "optim.warmup");
  check_range(optim.min_lr, 0.0, optim.lr, "optim.min_lr");
  if (optim.schedule != "constant" && optim.schedule != "cosine")
    throw InputError(
        fmt::format("config: optim.schedule must be constant or cosine, got '{}'", optim.schedule));
  check_range(eval.every, 0, int64_t{1} << 40, "eval.every");
  check_range(eval.batches, 1, int64_t{1} << 20, "eval.batches");
  check_range(eval.batch_size, 1, int64_t{1} << 20, "eval.batch_size");
  for (auto l : eval.lengths) check_range(l, 2, int64_t{1} << 22, "eval.lengths[]");
  if (task.kind == "grid2d") {
    validate_grid2d(*this);  // its model is models/grid2d.hpp (2-D vector positions)
    return;
  }
  auto m = model;
  m.vocab = std::max<int64_t>(m.vocab, 2);
  m.validate();
}

std::string TrainConfig::to_toml() const {
  std::ostringstream s;
  s << to_table(*this) << "\n";
  return s.str();
}

TrainConfig parse_config(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    const auto& b = e.source().begin;
    throw InputError(fmt::format("{}:{}:{}: {}", source, b.line, b.column, e.description()));
  }
  return from_table(root, source);
}

TrainConfig load_config(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw InputError(
        fmt::format("config file '{}' does not exist or is not a file", path.string()));
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  if (!in && !in.eof())
    throw InputError(fmt::format("cannot read config file '{}'", path.string()));
  return parse_config(s.str(), path.string());
}

void apply_override(TrainConfig& c, const std::string& assignment) {
  // one key per --set: TOML would read a second line as another key, which would be dropped
  if (assignment.find_first_of(std::string("\n\r\0", 3)) != std::string::npos)
    throw InputError(fmt::format(
        "--set '{}': a newline, carriage return or NUL in an override (one key=value per --set)",
        brief(assignment, 80)));
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw InputError(fmt::format("--set '{}': expected section.key=value", assignment));
  const std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  // the override as a TOML fragment, merged into the current configuration's table and read back
  // through the same checks as a file
  toml::table root = to_table(c), frag;
  try {
    frag = toml::parse(std::string_view(key + " = " + value), std::string_view("--set"));
  } catch (const toml::parse_error& e) {
    // a bare word is taken as a string (mechanism=rope, model.preset=pj)
    std::ostringstream quoted;
    quoted << toml::value<std::string>(value);
    try {
      frag = toml::parse(std::string_view(key + " = " + quoted.str()), std::string_view("--set"));
    } catch (const toml::parse_error&) {
      throw InputError(fmt::format("--set '{}': {}", assignment, e.description()));
    }
  }
  // the (possibly dotted) key's node from the fragment into the configuration's table
  const auto dot = key.find('.');
  toml::table* target = &root;
  std::string leaf = key;
  if (dot != std::string::npos) {
    target = root.get_as<toml::table>(key.substr(0, dot));
    if (!target)
      throw InputError(
          fmt::format("--set '{}': unknown section '{}'", assignment, key.substr(0, dot)));
    leaf = key.substr(dot + 1);
  }
  const toml::node* node = frag.at_path(key).node();
  if (!node) throw InputError(fmt::format("--set '{}': expected section.key=value", assignment));
  node->visit([&](const auto& v) { target->insert_or_assign(leaf, v); });
  c = from_table(root, "--set " + assignment);
}

namespace {
// "section.key" -> the value as TOML text, for every key of a configuration
void flatten(const toml::table& t, const std::string& prefix,
             std::map<std::string, std::string>& out) {
  for (const auto& [k, v] : t) {
    const std::string key = prefix + std::string(k.str());
    if (const auto* sub = v.as_table()) {
      flatten(*sub, key + ".", out);
    } else {
      std::ostringstream s;
      v.visit([&](const auto& x) { s << x; });
      out[key] = s.str();
    }
  }
}
}  // namespace

const std::vector<std::string>& resume_mutable_keys() {
  static const std::vector<std::string> keys{
      "name",       "threads",      "optim.steps",  "checkpoint_every", "log_every",
      "eval.every", "eval.lengths", "eval.batches", "eval.batch_size",  "eval.full_split"};
  return keys;
}

const std::vector<std::string>& finished_run_free_keys() {
  static const std::vector<std::string> keys{"name", "threads", "checkpoint_every", "log_every"};
  return keys;
}

std::vector<std::string> resume_changes(const TrainConfig& saved, const TrainConfig& now) {
  return config_changes(saved, now, resume_mutable_keys());
}

std::vector<std::string> config_changes(const TrainConfig& saved, const TrainConfig& now,
                                        const std::vector<std::string>& free) {
  std::map<std::string, std::string> a, b;
  flatten(to_table(saved), "", a);
  flatten(to_table(now), "", b);
  std::vector<std::string> changed;
  for (const auto& [k, v] : b) {
    if (std::find(free.begin(), free.end(), k) != free.end()) continue;
    const auto it = a.find(k);
    const std::string was = it == a.end() ? std::string("(unset)") : it->second;
    if (was != v) changed.push_back(fmt::format("{} ({} -> {})", k, brief(was, 40), brief(v, 40)));
  }
  return changed;
}

}  // namespace relpos::train
