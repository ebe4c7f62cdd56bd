// Model hyperparameters read from GGUF metadata. The supported architectures (llama, gemma2,
// gemma3, qwen2, qwen3, phi3, smollm3, granite, olmo2, and the mixture-of-experts qwen2moe,
// qwen3moe, granitemoe, olmoe, gpt-oss and llama / granite with experts, as Mixtral) differ only in flags
// here; the forward pass reads the flags (one graph, no per-architecture file).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvq/kv_format.h"

namespace kvq {
namespace gguf { class File; }

struct ModelConfig {
  std::string arch;         // general.architecture: "llama", "gemma2", "gemma3", "qwen2", "qwen3", "phi3",
                            // "smollm3", "granite", "olmo2", "qwen2moe", "qwen3moe", "granitemoe", "olmoe",
                            // "gpt-oss"
  std::string name;         // general.name
  int n_layer = 0;
  int n_embd = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;         // key_length (== value_length for the supported models)
  int n_ff = 0;
  int n_vocab = 0;
  int n_ctx_train = 0;
  float rms_eps = 1e-5f;

  // RoPE
  int n_rot = 0;                 // rotated dims per head
  bool rope_neox = false;        // pairs (i, i + n_rot/2) instead of (2i, 2i+1)
  float rope_base = 10000.f;     // global layers
  float rope_scale = 1.f;        // scaling factor of global layers (linear: positions / factor; YaRN's factor)
  float rope_base_local = 10000.f;  // sliding-window layers (rope.freq_base_swa; Gemma 3: 10000)
  float rope_scale_local = 1.f;     // linear scaling of sliding-window layers (Gemma 2: as global)
  // Per-pair frequency factors of the global layers: pair i turns factor[i] times slower; empty:
  // none. Llama 3.1+: rope_freqs.weight. Phi-3 LongRoPE: rope_factors_long.weight when the context
  // kvq runs at exceeds n_ctx_orig, else rope_factors_short.weight (rope_long says which).
  std::vector<float> rope_freq_factors;
  std::vector<float> rope_factors_long, rope_factors_short;  // LongRoPE's two sets (else empty)
  bool has_long_rope = false;    // the file has LongRoPE's two sets
  bool rope_long = false;
  int n_ctx_orig = 0;            // rope.scaling.original_context_length (LongRoPE's switch point)
  // rope.scaling.attn_factor: the rotated dimensions of q and k are multiplied by it (LongRoPE's
  // magnitude correction, sqrt(1 + ln(scale) / ln(n_ctx_orig))) on all but sliding-window layers; 1: none.
  float rope_attn_factor = 1.f;
  // YaRN (rope.scaling.type "yarn"; OLMo 3, Qwen3 past 32K, gpt-oss): on the layers scaled by
  // rope_scale (> 1), pair i's angle mixes the interpolated rate (1 / rope_scale) and the trained
  // one with YaRN's ramp between the pairs that turn beta_fast and beta_slow times over
  // yarn_orig_ctx positions, and cos and sin are multiplied by 1 + 0.1 ln(rope_scale) or the file's
  // yarn_attn_factor (model_layer_rope, model_layer_rope_mscale). Sliding-window layers keep their
  // own scale (rope_scale_local): YaRN applies where it is not 1.
  bool rope_yarn = false;
  int yarn_orig_ctx = 0;         // rope.scaling.original_context_length (else n_ctx_train)
  float yarn_beta_fast = 32.f;   // rope.scaling.yarn_beta_fast
  float yarn_beta_slow = 1.f;    // rope.scaling.yarn_beta_slow
  float yarn_attn_factor = 0.f;  // rope.scaling.yarn_attn_factor: the magnitude itself (0: 1 + 0.1 ln(factor))

  // Layers without RoPE (SmolLM3: every 4th); empty: every layer has it.
  std::vector<bool> layer_no_rope;

  bool qkv_bias = false;         // biases added to q, k and v (Qwen2, gpt-oss)
  bool attn_out_bias = false;    // bias added to the attention output projection (gpt-oss)
  // gpt-oss: a learned sink logit per query head in each attention softmax (attn_sinks.weight;
  // AttnParams::sinks), SwiGLU with its clamps (GluAct::swiglu_oai), and the FFN norm stored as
  // post_attention_norm
  bool attn_sinks = false;
  bool swiglu_oai = false;
  bool fused_gate_up = false;    // ffn_up holds the gate rows, then the up rows (Phi-3)

  // Gemma-style flags
  bool embd_scale = false;       // multiply embeddings by sqrt(n_embd)
  bool geglu = false;            // GELU(tanh) gate instead of SiLU
  bool post_norms = false;       // RMSNorm after attention and after the FFN, before the residual add
  bool qk_norm = false;          // RMSNorm over head_dim on q and k before RoPE (Gemma 3, Qwen3)
  bool qk_norm_full = false;     // with qk_norm: over all of q's (and k's) heads at once (OLMo 2, OLMoE)
  bool pre_norms = true;         // RMSNorm before attention and FFN (OLMo 2 has only post_norms)
  float attn_scale = 0.f;        // q.k scale; 0 -> 1/sqrt(head_dim)
  float final_softcap = 0.f;     // logits = c * tanh(logits / c) when > 0
  float attn_softcap = 0.f;
  int sliding_window = 0;        // tokens a sliding-window layer sees (0: none)
  std::vector<bool> layer_sliding;  // per layer: true = sliding-window layer

  bool tied_output = false;      // output projection is token_embd

  // Mixture of experts (n_expert > 0): each layer's FFN is n_expert gated FFNs of n_ff_exp
  // channels (ffn_{gate,up,down}_exps); a router (ffn_gate_inp) scores them, the softmax over all
  // of them gives probabilities, and each token runs the n_expert_used most probable, its output
  // their sum weighted by those probabilities (divided by their sum when moe_norm_weights: Mixtral,
  // Qwen3-MoE, Granite MoE; as they are for Qwen2-MoE). A shared expert of n_ff_shexp channels
  // (Qwen2-MoE, Granite MoE Shared) runs on every token and is added, times sigmoid of its own
  // gate (ffn_gate_inp_shexp) when shexp_gated (Qwen2-MoE).
  // gpt-oss (moe_softmax_chosen): the router's logits plus a bias (moe_bias), the experts chosen by
  // their logits and weighted by the softmax over the chosen ones alone; each expert's gate, up and
  // down products plus its own biases.
  int n_expert = 0;
  int n_expert_used = 0;
  int n_ff_exp = 0;
  int n_ff_shexp = 0;
  bool moe_norm_weights = false;
  bool moe_softmax_chosen = false;
  bool moe_bias = false;
  bool shexp_gated = false;

  // Granite's multipliers (0: none): embeddings times embd_mult, each layer's attention and FFN
  // outputs times residual_scale before the residual add, logits divided by logit_scale.
  float embd_mult = 0.f;
  float residual_scale = 0.f;
  float logit_scale = 0.f;

  float layer_rope_base(int il) const { return layer_sliding[size_t(il)] ? rope_base_local : rope_base; }
  float layer_rope_scale(int il) const { return layer_sliding[size_t(il)] ? rope_scale_local : rope_scale; }
  const std::vector<float>& layer_rope_factors(int il) const {
    static const std::vector<float> none;
    return layer_sliding[size_t(il)] ? none : rope_freq_factors;
  }
  int layer_window(int il) const { return layer_sliding[size_t(il)] ? sliding_window : 0; }
  int layer_n_rot(int il) const { return !layer_no_rope.empty() && layer_no_rope[size_t(il)] ? 0 : n_rot; }
  // FFN channels one token runs through in a layer: n_ff, or the used experts' and the shared one's
  // (also the FFN hidden row the forward pass holds per token: a step runs them all at once).
  int64_t ffn_active_channels() const {
    return n_expert > 0 ? int64_t(n_expert_used) * n_ff_exp + n_ff_shexp : n_ff;
  }
};

// RoPE settings given on the command line in place of the file's (llama.cpp's flags of the same
// names): --rope-scaling none|linear|yarn, --rope-scale F, --yarn-orig-ctx N, --yarn-beta-fast F,
// --yarn-beta-slow F. Unset fields keep the file's.
struct RopeOverrides {
  std::string scaling;      // "", "none", "linear" or "yarn"
  double scale = 0;         // 0: the file's factor
  int yarn_orig_ctx = 0;    // 0: the file's original context (else the trained one)
  double yarn_beta_fast = 0, yarn_beta_slow = 0;  // 0: the file's (else 32 and 1)
  bool any() const { return !scaling.empty() || scale != 0 || yarn_orig_ctx != 0 || yarn_beta_fast != 0 || yarn_beta_slow != 0; }
};

// Applies the overrides to a config read from a file; throws kvq::Error on bad values. A factor
// other than the file's makes the model's context (n_ctx_train) yarn_orig_ctx x factor for YaRN, as
// llama.cpp does, or the file's context times the change for linear scaling; "none" switches
// scaling off (the context stays the file's). Sliding-window layers keep the file's scaling.
void model_config_apply_rope(ModelConfig& c, const RopeOverrides& o);

// The RoPE of layer il as the model and its KV cache rotate: base, linear scale, per-pair factors,
// with YaRN folded into the per-pair factors (pair i's angle is linear in the position, at a rate
// YaRN mixes from the interpolated and the trained one). n_rot 0 on a layer without RoPE.
KvRope model_layer_rope(const ModelConfig& c, int il);
// What RoPE multiplies cos and sin by on layer il: rope.scaling.attn_factor (not on sliding-window
// layers) times, on the layers YaRN scales, its magnitude (1 + 0.1 ln(factor), or the file's
// rope.scaling.yarn_attn_factor); 1: none. The forward pass multiplies q's rotated dims by its
// square instead (the cache keeps keys without it).
float model_layer_rope_mscale(const ModelConfig& c, int il);
// YaRN's per-pair rate multiplier (n_rot / 2 values in (1 / factor, 1]) for RoPE of n_rot dims at
// `base`, as ggml's rope_yarn: 1 / factor mixed with 1 by the ramp between ggml_rope_yarn_corr_dims.
std::vector<double> model_yarn_pair_rates(int n_rot, float base, float factor, int orig_ctx, float beta_fast,
                                          float beta_slow);
// One line naming the RoPE scaling (linear, YaRN with its parameters); empty for none.
std::string model_rope_scaling_note(const ModelConfig& c);

// Reads and validates the hyperparameters; throws kvq::Error for unsupported architectures or
// missing/inconsistent values. Phi-3's LongRoPE factors are picked for the trained context
// (model_config_pick_rope / Model::set_context pick them for another).
ModelConfig model_config_from_gguf(const gguf::File& f);

// Picks LongRoPE's factor set for a context of `ctx` tokens (0: the trained context): the long one
// past n_ctx_orig, as llama.cpp picks by its context size. No effect on models without the two sets.
void model_config_pick_rope(ModelConfig& c, int ctx);

// The architectures kvq runs (general.architecture), and their list for messages.
bool model_arch_supported(const std::string& arch);
const char* model_arch_list();

// For models with two sets of RoPE factors (LongRoPE): which set the config uses and why, as a
// line for stderr; empty for other models.
std::string model_rope_note(const ModelConfig& c, int ctx);

// The sliding-window layout an architecture has when its file does not say: the pattern in
// gguf_sliding_layers' sense (Gemma 3: 6, Gemma 2: 2, Phi-3: 1, whose window is not used; -1:
// unknown) and the window (Gemma 3: 512, Gemma 2: 4096; 0: none known).
int model_arch_swa_pattern(const std::string& arch);
int64_t model_arch_swa_window(const std::string& arch);

// Which layers use sliding-window attention, from `ARCH.attention.sliding_window_pattern` as
// llama.cpp reads it: an array of booleans (true: sliding), or an integer n (0: every layer; else
// layer il slides unless il % n == n - 1, so n = 1 is none); without the key, `default_pattern` in
// the same sense, or nullopt when default_pattern < 0 (the architecture's layout is unknown).
// `where` names the file in errors.
std::optional<std::vector<bool>> gguf_sliding_layers(const gguf::File& f, const std::string& arch, int n_layer,
                                                     int default_pattern, const std::string& where);

}  // namespace kvq
