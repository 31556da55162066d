// `relpos diagnose --checkpoint RUN_DIR`: the PJ-RoPE bias diagnostics (probes/pj_diagnostics.hpp,
// float64) of every layer and head of a trained transformer, the model-level summary (head mean,
// then layer mean), their Markdown / JSON renderings, the learned lag kernels b_h(d) as CSV and a
// gnuplot PNG of them. docs/diagnostics.md defines every quantity.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "models/transformer.hpp"
#include "probes/pj_diagnostics.hpp"

namespace relpos::train {

struct PjDiagnoseOptions {
  int64_t length = 0;  // T_eval: the window d = 0..T_eval-1; 0 means 4 L (the reference's 4096)
  // A PJ-RoPE Table 3 teacher (probes/targets.hpp pj_target, at each head's omega and the layer's
  // L) for target-relative leave-one-order-out deltas; empty: self-relative deltas.
  std::string target;
};

struct PjLayerDiagnostics {
  int layer = 0;
  PjBiasConfig config;
  std::vector<probes::pj::PjHeadDiagnostics> heads;
  probes::pj::PjSummary summary;  // head means
};

struct PjModelDiagnostics {
  std::string mechanism;
  int64_t step = -1;  // the checkpoint's step (-1 for a model not loaded from a run)
  int64_t window = 0;
  std::string target;  // empty: LOO against each head's own kernel
  std::vector<PjLayerDiagnostics> layers;
  probes::pj::PjSummary summary;  // layer means of the head means
};

// Diagnostics of every block's PJ bias. InputError when the model has no PJ bias (naming its
// mechanism), for a bad length or an unknown target.
PjModelDiagnostics pj_model_diagnostics(models::TransformerLMImpl& model,
                                        const PjDiagnoseOptions& o);
// The same for a run folder (load_trained_model: named errors for a missing or corrupt
// checkpoint). A run without a PJ bias is an InputError that lists its mechanism statistics.
PjModelDiagnostics pj_run_diagnostics(const std::filesystem::path& run_dir,
                                      const PjDiagnoseOptions& o);

std::string pj_diagnostics_markdown(const PjModelDiagnostics& d);
std::string pj_diagnostics_json(const PjModelDiagnostics& d);

// CSV layer,head,d,bias of b_h(d), d = 0..len-1, every layer and head (float64 lag tables).
std::string pj_lag_kernels_csv(models::TransformerLMImpl& model, int64_t len);
// Writes DIR/pj_lag_kernels.csv and DIR/pj_lag_kernels.png (gnuplot: one panel per layer, one
// curve per head; the script stays when gnuplot is missing). Returns false when no PNG was drawn.
bool write_pj_lag_kernel_plot(models::TransformerLMImpl& model, int64_t len,
                              const std::filesystem::path& dir);

}  // namespace relpos::train
