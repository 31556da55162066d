// A learned lag table: an additive bias b_h(d) per head that depends on the lag d = i - j only
// (d = 0..len-1; the attention kernel rounds lags and clamps them into the table,
// kernels/attention/attention.hpp), computed from learned parameters. The kernels only ever see
// the table [H, len], never a T x T tensor. One implementation per family (PJ-RoPE's bias in
// core/pj_bias.hpp, T5's buckets and KERPLE in their family files under core/mechanisms/); the
// torch layer builds the same table differentiably in the family's runtime file
// (torch/mechanisms/, found by the kernel's term name), and the float64 table here is the
// reference it is tested against (docs/architecture.md, "Learned lag tables").
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace relpos {

// One learned parameter of a lag table: its state-dict name (unique within a mechanism, e.g.
// "pj_omega"), its shape and its deterministic initial values (row-major). A spec string names
// exactly these values (the kernels' and the spec-only attention calls' table); a torch module may
// draw some of them from torch's generator instead (its runtime says). `trained`: whether the
// table depends on it; one it does not (a part of the kernel the spec leaves off, a softmax over
// one entry) is kept, under its name, as a module buffer, not a parameter: it would get no
// gradient or a zero one, and torch's DistributedDataParallel refuses a parameter with none.
struct LagParam {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<double> init;
  bool trained = true;
  int64_t numel() const;
};

// Values of a kernel's parameters, one row-major vector per LagParam, in params() order.
using LagParamValues = std::vector<std::vector<double>>;

class LagKernel {
 public:
  // term: the spec term (the key of its torch runtime); options: the term's resolved options
  LagKernel(std::string term, std::map<std::string, std::string> options)
      : term_(std::move(term)), options_(std::move(options)) {}
  virtual ~LagKernel() = default;

  const std::string& term() const { return term_; }
  // The parameters for `heads` heads, with their initial values.
  virtual std::vector<LagParam> params(int heads) const = 0;
  // table[h * len + d] = b_h(d), d = 0..len-1, float64 (the paper's formula). `values` are
  // checked (check_lag_values) by the caller.
  virtual std::vector<double> table(const LagParamValues& values, int heads, int64_t len) const = 0;
  // The lag from which b_h(d) no longer changes, whatever the parameters (every longer lag has
  // its value): a table through it serves every lag, since the attention kernels read lags past
  // a table's end at its last entry. kUnbounded: the table changes at every lag.
  static constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();
  virtual int64_t constant_from() const { return kUnbounded; }

  // The term's resolved options as canonical text: the runtime reads its settings from them.
  const std::map<std::string, std::string>& options() const { return options_; }
  double number(const std::string& key) const;  // std::logic_error when absent
  const std::string& text(const std::string& key) const;

 private:
  std::string term_;
  std::map<std::string, std::string> options_;
};

// The initial values of every parameter, in params() order.
LagParamValues initial_lag_values(const LagKernel& k, int heads);
// InputError naming the parameter when `values` do not fit params(heads) (count or size).
void check_lag_values(const LagKernel& k, const LagParamValues& values, int heads);
// The checked table (len >= 1).
std::vector<double> lag_table(const LagKernel& k, const LagParamValues& values, int heads,
                              int64_t len);
// The table at the initial values (what a spec string names).
std::vector<double> initial_lag_table(const LagKernel& k, int heads, int64_t len);

}  // namespace relpos
