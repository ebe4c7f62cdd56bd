// Model hyperparameters read from GGUF metadata. The llama family and Gemma 3 differ only in
// flags here; the forward pass reads the flags (one graph, no per-architecture file).
#pragma once
#include <string>
#include <vector>

namespace kvq {
namespace gguf { class File; }

struct ModelConfig {
  std::string arch;         // general.architecture: "llama", "gemma3", "qwen2", "qwen3"
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
  float rope_scale = 1.f;        // linear scaling factor of global layers (positions / factor)
  float rope_base_local = 10000.f;  // sliding-window layers (Gemma 3)
  // Per-pair frequency factors of the global layers (rope_freqs.weight, Llama 3.1+): pair i turns
  // factor[i] times slower; empty: none.
  std::vector<float> rope_freq_factors;

  bool qkv_bias = false;         // biases added to q, k and v (Qwen2)

  // Gemma-style flags
  bool embd_scale = false;       // multiply embeddings by sqrt(n_embd)
  bool geglu = false;            // GELU(tanh) gate instead of SiLU
  bool post_norms = false;       // RMSNorm after attention and after the FFN, before the residual add
  bool qk_norm = false;          // RMSNorm over head_dim on q and k before RoPE (Gemma 3, Qwen3)
  float attn_scale = 0.f;        // q.k scale; 0 -> 1/sqrt(head_dim)
  float final_softcap = 0.f;     // logits = c * tanh(logits / c) when > 0
  float attn_softcap = 0.f;
  int sliding_window = 0;        // tokens a sliding-window layer sees (0: none)
  std::vector<bool> layer_sliding;  // per layer: true = sliding-window layer

  bool tied_output = false;      // output projection is token_embd

  float layer_rope_base(int il) const { return layer_sliding[size_t(il)] ? rope_base_local : rope_base; }
  float layer_rope_scale(int il) const { return layer_sliding[size_t(il)] ? 1.f : rope_scale; }
  const std::vector<float>& layer_rope_factors(int il) const {
    static const std::vector<float> none;
    return layer_sliding[size_t(il)] ? none : rope_freq_factors;
  }
  int layer_window(int il) const { return layer_sliding[size_t(il)] ? sliding_window : 0; }
};

// Reads and validates the hyperparameters; throws kvq::Error for unsupported architectures or
// missing/inconsistent values.
ModelConfig model_config_from_gguf(const gguf::File& f);

}  // namespace kvq
