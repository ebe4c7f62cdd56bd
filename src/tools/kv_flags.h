// The KV-cache flags shared by every subcommand that runs a model (run, eval, bench, serve):
// vLLM spellings (--kv-cache-dtype, --kv-cache-dtype-skip-layers), llama.cpp spellings
// (-ctk/-ctv), kvq names, per-layer overrides and calibration scales.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/kv_cache.h"
#include "kv/policy.h"
#include "model/config.h"

namespace CLI { class App; }

namespace kvq {

class Model;

struct KvFlags {
  std::string kv_cache_dtype = "f16";  // --kv-cache-dtype: format for K and V
  std::string cache_type_k;            // -ctk: K side (a format name; its K codec is used)
  std::string cache_type_v;            // -ctv: V side (a format name; its V codec is used)
  bool cache_type_k_given = false;     // -ctk was on the command line (an empty value is an error)
  bool cache_type_v_given = false;
  std::string skip_layers;             // --kv-cache-dtype-skip-layers
  std::vector<std::string> layer_overrides;  // --kv-layer L=KFMT/VFMT (repeatable)
  std::string scales_file;             // --kv-scales FILE.json (kvq calibrate output), or "qk-norm"
  int page_tokens = 64;                // --kv-page-tokens
  int group_tokens = 0;                // --kv-group-tokens: G of grouped codecs (0 = codec default)
  int residual_tokens = -1;            // --kv-residual-tokens: R of grouped codecs (-1 = codec default)
  double outlier_fraction = -1;        // --kv-outliers: dense-and-sparse share (kvquant*; -1 = default)
  int sink_tokens = -1;                // --kv-sink-tokens: exact first positions (kvquant*; -1 = default)
  // The RoPE flags (--rope-scaling, --rope-scale, --yarn-*), which travel with these to every
  // subcommand that runs a model: the model is loaded with them (Model::load).
  RopeOverrides rope;
};

// What the flags resolve to for one model.
struct KvSetup {
  KvPolicy policy;
  std::shared_ptr<const nlohmann::json> calib;  // null when no --kv-scales (kv_qk_norm_calib for qk-norm)
  int group_tokens = 0;
  int residual_tokens = -1;
  double outlier_fraction = -1;
  int sink_tokens = -1;
  // Copies what the flags set beyond the policy (calibration, G, R) into a cache config.
  void apply(KvCacheConfig& kc) const {
    kc.calib = calib.get();
    kc.group_tokens = group_tokens;
    kc.residual_tokens = residual_tokens;
    kc.outlier_fraction = outlier_fraction;
    kc.sink_tokens = sink_tokens;
  }
};

// Adds the KV flags and the RoPE flags (rope_flags_add) of f.
void kv_flags_add(CLI::App& app, KvFlags& f);
// --rope-scaling, --rope-scale, --yarn-orig-ctx, --yarn-beta-fast, --yarn-beta-slow (llama.cpp's names).
void rope_flags_add(CLI::App& app, RopeOverrides& r);
// The flags that apply to every format of a --kv list (eval, bench): all of kv_flags_add but the
// format choice itself (--kv-cache-dtype, -ctk, -ctv).
void kv_flags_add_shared(CLI::App& app, KvFlags& f);
// --kv-outliers and --kv-sink-tokens alone (for subcommands that take a subset of the flags).
void kv_flags_add_kvquant(CLI::App& app, KvFlags& f);
// Resolves the flags for a model; throws kvq::Error naming the bad flag (and listing valid
// formats for unknown names). `format` overrides --kv-cache-dtype when not empty (eval's --kv list).
KvSetup kv_flags_resolve(const KvFlags& f, const Model& m, const std::string& format = "");

// Warns on stderr when --kv-group-tokens, --kv-residual-tokens, --kv-outliers or --kv-sink-tokens
// is given and no layer of the resolved formats reads it (grouped formats: kivi*, kvquant*;
// outliers and sink tokens: kvquant*), instead of ignoring it silently.
void kv_flags_warn_unused(const KvFlags& f, const KvSetup& s, const Model& m);

// `--kv-scales qk-norm`: the channel statistics that a model with QK-norm (Gemma 3, Qwen3, OLMo 2)
// implies without any sample text. Its keys and queries leave RMSNorm as x / rms(x) * w, so their
// channel RMS is proportional to |w| (attn_k_norm, attn_q_norm: one vector per layer, shared by the
// heads) as far as the normalized vectors spread evenly over channels; the channel-scaled formats
// (*_s) need nothing more for keys (kv/centered_codecs.cpp). Schema as kvq calibrate's:
//   {"source": "qk-norm", "model": NAME, "layers": [{"layer": l, "k_rms": [[..]], "q_rms": [[..]]}, ..]}
// (n_kv_heads rows of head_dim each). No value statistics: the model does not normalize values, so
// the *_s formats leave values unscaled. Throws kvq::Error when the model has no QK-norm.
nlohmann::json kv_qk_norm_calib(const Model& m);

}  // namespace kvq
