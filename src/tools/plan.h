// kvq plan: memory planning before a model is loaded. Where the bytes go (weights, KV cache,
// activations), how many bytes per token each KV format costs, and what fits on a device.
//
// Every KV figure comes from the format registry: a format's cost per token is the exact size of
// its codecs' head blocks (KvCodec::block_bytes(page_tokens) / page_tokens), so the planner and the
// cache allocate the same bytes. Nothing here keeps a table of per-format sizes.
//
// Library entry points: the plan_model_from_* constructors, plan_compute (numbers only) and
// plan_command (the `kvq plan` subcommand: options -> text/JSON/CSV on `out`, errors on `err`).
#pragma once
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/config.h"

namespace CLI {
class App;
}

namespace kvq {

namespace gguf {
class File;
}

// ---------------------------------------------------------------------------------------------
// Model shape: what the planner needs to know about a model, wherever it came from.

struct PlanLayer {
  int n_kv_heads = 0;
  int head_dim_k = 0;
  int head_dim_v = 0;
  int64_t window = 0;  // sliding-window layer: keeps at most this many tokens; 0 = full attention
};

struct PlanModel {
  std::string name;
  std::string source;        // "preset", "gguf", "config.json"
  std::string arch;          // GGUF architecture / HF model_type (informational)
  int n_layers = 0;
  int n_heads = 0;           // query heads
  int head_dim = 0;          // query head dim
  int64_t n_embd = 0;
  int64_t n_ff = 0;          // FFN hidden size (largest over layers; with experts, a token's chosen and shared ones')
  int64_t n_vocab = 0;
  int64_t ctx_train = 0;     // trained context length; 0 = unknown
  std::vector<PlanLayer> layers;  // (n_layers)
  int64_t n_params = 0;      // 0 = unknown
  // Mixture of experts: experts per layer and per token (0: dense), and the parameters one token
  // runs through (0: unknown or dense), which is what a decode step of one sequence reads.
  int n_expert = 0, n_expert_used = 0;
  int64_t n_params_active = 0;
  int64_t weights_bytes = -1;  // -1 = unknown (capacity then needs --weights-bytes)
  std::string weights_note;    // how weights_bytes was obtained
  std::vector<std::string> notes;  // assumptions the planner had to make about this model
};

// Built-in models with public hyperparameters. Parameter counts are computed from the shapes
// (decoder: embeddings, attention, gated FFN or experts, norms), see plan_params().
struct PlanPreset {
  std::string name;
  std::string hf_name;       // the public checkpoint the shapes are taken from
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int64_t n_embd = 0;
  int64_t n_ff = 0;
  int64_t n_vocab = 0;
  int64_t ctx_train = 0;
  int64_t window = 0;        // sliding window of local layers (0: none)
  int swa_pattern = 0;       // 0: no local layers; 1: every layer local; k>1: every k-th layer global
  bool tied_embeddings = false;
  bool qkv_bias = false;
  int norms_per_layer = 2;   // RMSNorm weight vectors of width n_embd per layer
  bool qk_norm = false;      // per-head RMSNorm on q and k (head_dim weights each)
  bool qk_norm_full = false; // with qk_norm: over all heads at once (q heads x head_dim + KV heads x head_dim weights)
  // Mixture of experts (n_expert > 0): each layer's FFN is n_expert gated FFNs of n_ff_exp
  // channels and a router (n_embd x n_expert), n_expert_used of them run per token, plus a shared
  // expert of n_ff_shexp channels (with a one-output gate when shexp_gate); n_dense_layers of
  // the layers keep a dense FFN of n_ff channels instead (Qwen3-MoE's mlp_only_layers).
  int n_expert = 0;
  int n_expert_used = 0;
  int64_t n_ff_exp = 0;
  int64_t n_ff_shexp = 0;
  bool shexp_gate = false;
  int n_dense_layers = 0;
  // gpt-oss: a bias on the attention output, a sink logit per query head, and biases on the router
  // and on every expert's gate, up and down
  bool oss_biases = false;
  // Bits per parameter of the experts' matrices when they are stored apart from the rest (gpt-oss's
  // checkpoints: MXFP4, 4.25 bits); 0: the weights' bits.
  double expert_bits = 0;
};

const std::vector<PlanPreset>& plan_presets();
// Unknown name: kvq::Error listing the presets.
const PlanPreset& plan_preset_find(const std::string& name);
// All parameters; with experts, plan_active_params counts those one token runs through (the
// n_expert_used experts of each layer instead of all of them).
int64_t plan_params(const PlanPreset& p);
int64_t plan_active_params(const PlanPreset& p);

// True when layer `il` of a model with a sliding window uses it, for pattern k (see PlanPreset).
bool plan_layer_is_local(int il, int swa_pattern);

// weights_bits: bits per parameter for the weights estimate (e.g. 16, 8, 4.5).
PlanModel plan_model_from_preset(const std::string& name, double weights_bits);
// Hyperparameters from GGUF metadata, weights from the tensor index (no tensor data is read).
PlanModel plan_model_from_gguf(const gguf::File& f);
PlanModel plan_model_from_gguf_path(const std::string& path);
// Hugging Face config.json (multimodal configs: the "text_config" part). weights_bits: override
// of torch_dtype (nullopt: use torch_dtype). Missing required fields: kvq::Error naming them.
PlanModel plan_model_from_hf_config(const nlohmann::json& cfg, std::optional<double> weights_bits,
                                    const std::string& name = "config.json");
PlanModel plan_model_from_hf_config_path(const std::string& path,
                                         std::optional<double> weights_bits);

// ---------------------------------------------------------------------------------------------
// Parsing of user-supplied values (kvq::Error with the offending text on anything malformed).

// "4096", "4K", "32k", "1M" -> tokens (K = 1024, M = 1024^2, G = 1024^3). Must be > 0.
int64_t plan_parse_count(std::string_view s, const char* what);
// Comma-separated list of plan_parse_count values.
std::vector<int64_t> plan_parse_count_list(std::string_view s, const char* what);
// Bytes: "141107412992", "64G", "64GiB", "1.5T" (binary multiples). Must be > 0.
int64_t plan_parse_bytes(std::string_view s, const char* what);
// "first:2,last:2,sliding_window,5" -> sorted unique layer indices kept in f16.
std::vector<int> plan_parse_skip_layers(std::string_view spec, const PlanModel& m);

// ---------------------------------------------------------------------------------------------
// Computation.

struct PlanConfig {
  std::vector<int64_t> ctx{4096, 16384, 32768};
  std::vector<int64_t> batch{1, 8, 32};
  std::vector<std::string> formats;  // registry names/aliases; empty: every registered format
  std::vector<int> skip_layers;      // layers kept in f16 for every format
  int page_tokens = 64;
  int tp = 1;
  int64_t gpu_mem_bytes = 0;         // per device; 0: no capacity figures
  double util = 0.9;
  int64_t prefill_chunk = 512;       // tokens per prefill chunk (activation estimate)
};

// One format's cost, per device shard summed over the tp devices = the whole model's.
struct PlanFormatCost {
  std::string name;                    // registry name
  std::string k_codec, v_codec;
  int k_group = 1, k_residual = 0;     // grouped codecs: G and R
  int v_group = 1, v_residual = 0;
  int64_t page_bytes = 0;              // one page (page_tokens tokens), all layers, K+V, whole model
  int64_t page_bytes_device = 0;       // one page on one device
  double per_token_bytes = 0;          // page_bytes / page_tokens (every layer full attention)
  double code_bytes_per_token = 0;     // the codes alone (code_bits x elements)
  double overhead_bytes_per_token = 0; // scales, zero points, norms inside the head blocks
  int64_t residual_bytes_max = 0;      // full-precision tail of grouped codecs, largest per sequence
  std::vector<int64_t> layer_page_bytes;         // (n_layers) whole model
  std::vector<int64_t> layer_page_bytes_device;  // (n_layers) one device
  // per layer: bytes of the tail for one (K or V) head-token row; 0 when the codec is per-token
  std::vector<int64_t> layer_tail_row_bytes_k, layer_tail_row_bytes_v;  // (n_layers) whole model
  std::vector<int64_t> layer_tail_row_bytes_k_device, layer_tail_row_bytes_v_device;
};

struct PlanRow {
  int64_t ctx = 0, batch = 0;
  std::string format;
  int64_t kv_bytes = 0;              // whole model
  int64_t kv_bytes_device = 0;       // one device
  int64_t activation_bytes_device = 0;
  int64_t total_bytes_device = 0;    // weights + activations + KV on one device
  bool fits = true;                  // total <= budget (only meaningful with gpu_mem_bytes)
};

struct PlanCapacity {
  std::string format;
  int64_t max_kv_tokens = 0;                      // pool pages x page_tokens (batch-1 activations)
  std::vector<int64_t> max_sequences;             // (ctx.size())
  std::vector<std::optional<int64_t>> max_context;  // (batch.size()); nullopt: no limit (all local)
};

struct PlanResult {
  PlanModel model;
  PlanConfig config;
  std::vector<PlanFormatCost> formats;
  std::vector<std::string> skipped_formats;       // default list only: formats that could not be sized, with why
  int64_t weights_bytes_device = -1;
  std::vector<int64_t> activation_bytes_device;  // (batch.size())
  std::vector<PlanRow> rows;                      // ctx-major, then batch, then format
  int64_t budget_bytes_device = 0;                // floor(gpu_mem x util)
  std::vector<PlanCapacity> capacity;             // (formats.size()) when gpu_mem_bytes > 0
};

// Tokens layer `l` holds for a sequence of n tokens.
int64_t plan_layer_tokens(const PlanLayer& l, int64_t n);
// KV bytes of one sequence of n tokens (device: one device's shard).
int64_t plan_sequence_kv_bytes(const PlanModel& m, const PlanFormatCost& c, int page_tokens,
                               int64_t n, bool device);
// Activation/scratch estimate on one device for `batch` decoding sequences plus one prefill chunk.
int64_t plan_activation_bytes(const PlanModel& m, const PlanConfig& c, int64_t batch);
PlanFormatCost plan_format_cost(const PlanModel& m, const PlanConfig& c, const std::string& format);
PlanResult plan_compute(const PlanModel& m, const PlanConfig& c);

// ---------------------------------------------------------------------------------------------
// The subcommand.

struct PlanOptions {
  std::string model_path;    // -m GGUF
  std::string config_path;   // --config config.json
  std::string preset;        // --preset
  bool list_presets = false; // --presets
  std::string ctx = "4K,16K,32K";
  std::string batch = "1,8,32";
  std::string kv;            // comma-separated formats; empty: all registered formats
  std::string skip_layers;   // --kv-cache-dtype-skip-layers
  std::optional<double> gpu_mem_gib;   // --gpu-mem (GiB per device); absent: no capacity figures
  int tp = 1;
  double util = 0.9;
  std::string weights_bytes; // --weights-bytes override
  std::optional<double> weights_bits;  // --weights-bits; absent: 16 for presets, torch_dtype for config
  int page_tokens = 64;
  int64_t prefill_chunk = 512;
  bool json = false;
  bool csv = false;
  bool explain = false;
  bool measure = false;      // --measure: run the engine and compare measured memory with the plan
  RopeOverrides rope;        // --rope-scaling etc. (-m): the context they give the model, and --measure's engine
};

// Registers `plan`'s options on `app` (the subcommand's App), storing into `opts`.
void plan_add_cli(CLI::App& app, PlanOptions& opts);
// Runs the subcommand; returns the process exit code (0 ok, 1 bad input).
int plan_command(const PlanOptions& opts, std::FILE* out, std::FILE* err);
// --measure (src/tools/plan_measure.cpp): needs -m; prints measured vs predicted KV growth.
int plan_measure(const PlanOptions& o, const PlanModel& m, const PlanConfig& c, std::FILE* out);

// Formatting helpers (exposed for tests): 3 significant digits in the largest binary unit,
// e.g. 1342177280 -> "1.25 GiB", 10737418240 -> "10.0 GiB".
std::string plan_format_bytes(double bytes);

}  // namespace kvq
