#include "model/config.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/strings.h"
#include "gguf/gguf.h"

namespace kvq {

namespace {
int64_t require_int(const gguf::File& f, const std::string& key) {
  auto v = f.get_int(key);
  if (!v) fail("{}: missing metadata key '{}'", f.path(), key);
  return *v;
}
int64_t positive(const gguf::File& f, const std::string& key, int64_t v) {
  if (v <= 0 || v > (int64_t(1) << 30)) fail("{}: metadata '{}' = {} is out of range", f.path(), key, v);
  return v;
}
}  // namespace

ModelConfig model_config_from_gguf(const gguf::File& f) {
  ModelConfig c;
  auto arch = f.get_string("general.architecture");
  if (!arch) fail("{}: missing metadata key 'general.architecture'", f.path());
  c.arch = *arch;
  if (c.arch != "llama" && c.arch != "gemma3" && c.arch != "qwen2" && c.arch != "qwen3")
    fail("{}: unsupported architecture '{}' (supported: llama, gemma3, qwen2, qwen3)", f.path(), printable(c.arch));
  c.name = f.get_string("general.name").value_or(c.arch);
  const std::string a = c.arch + ".";
  auto req = [&](const char* k) { return int(positive(f, a + k, require_int(f, a + k))); };
  c.n_layer = req("block_count");
  c.n_embd = req("embedding_length");
  c.n_ff = req("feed_forward_length");
  c.n_head = req("attention.head_count");
  c.n_head_kv = f.get_int(a + "attention.head_count_kv") ? req("attention.head_count_kv") : c.n_head;
  c.n_ctx_train = f.get_int(a + "context_length") ? req("context_length") : 2048;
  if (c.n_head % c.n_head_kv != 0)
    fail("{}: head_count {} is not a multiple of head_count_kv {}", f.path(), c.n_head, c.n_head_kv);
  c.head_dim = f.get_int(a + "attention.key_length") ? req("attention.key_length") : c.n_embd / c.n_head;
  if (auto vl = f.get_int(a + "attention.value_length"); vl && *vl != c.head_dim)
    fail("{}: key_length {} != value_length {} is not supported", f.path(), c.head_dim, *vl);
  if (c.head_dim % 2) fail("{}: head dimension {} must be even", f.path(), c.head_dim);
  c.rms_eps = float(f.get_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5));
  if (!(std::isfinite(c.rms_eps) && c.rms_eps > 0 && c.rms_eps < 1))
    fail("{}: RMS norm epsilon {} must be a finite number in (0, 1)", f.path(), c.rms_eps);
  c.n_rot = f.get_int(a + "rope.dimension_count") ? req("rope.dimension_count") : c.head_dim;
  if (c.n_rot > c.head_dim || c.n_rot % 2) fail("{}: rope dimension {} invalid for head dim {}", f.path(), c.n_rot, c.head_dim);
  c.rope_base = float(f.get_float(a + "rope.freq_base").value_or(10000.0));
  c.rope_base_local = c.rope_base;
  if (auto st = f.get_string(a + "rope.scaling.type"); st && *st == "linear") {
    c.rope_scale = float(f.get_float(a + "rope.scaling.factor").value_or(1.0));
  } else if (st && *st != "none") {
    fail("{}: rope scaling type '{}' is not supported (supported: none, linear)", f.path(), printable(*st));
  }
  if (!(c.rope_base > 1 && std::isfinite(c.rope_base)))
    fail("{}: RoPE frequency base {} must be a finite number > 1", f.path(), c.rope_base);
  if (!(c.rope_scale > 0 && std::isfinite(c.rope_scale)))
    fail("{}: rope scaling factor {} must be a finite number > 0", f.path(), c.rope_scale);
  c.layer_sliding.assign(size_t(c.n_layer), false);

  // Llama 3.1-style RoPE: a frequency factor per rotated pair
  if (const gguf::TensorInfo* t = f.find_tensor("rope_freqs.weight")) {
    if (t->type != GgmlType::F32 || t->n_elements() != c.n_rot / 2)
      fail("{}: tensor 'rope_freqs.weight' must be F32 with {} values (one per rotated pair), is {} with {}", f.path(),
           c.n_rot / 2, ggml_type_name(t->type), t->n_elements());
    c.rope_freq_factors.resize(size_t(c.n_rot / 2));
    std::memcpy(c.rope_freq_factors.data(), t->data, c.rope_freq_factors.size() * sizeof(float));
    for (float x : c.rope_freq_factors)
      if (!(std::isfinite(x) && x > 0))
        fail("{}: rope_freqs.weight holds {}: the factors must be finite numbers > 0", f.path(), x);
  }
  if (c.arch == "qwen2" || c.arch == "qwen3") {
    c.rope_neox = true;
    c.qkv_bias = c.arch == "qwen2";
    c.qk_norm = c.arch == "qwen3";
  }
  if (c.arch == "gemma3") {
    c.rope_neox = true;
    c.embd_scale = true;
    c.geglu = true;
    c.post_norms = true;
    c.qk_norm = true;
    c.rope_base_local = 10000.f;  // Gemma 3's local (sliding-window) layers use base 10k
    c.attn_scale = 1.0f / std::sqrt(float(c.head_dim));
    const int64_t sw = f.get_int(a + "attention.sliding_window").value_or(512);
    if (sw <= 0 || sw > (int64_t(1) << 30)) fail("{}: sliding window {} must be in [1, 2^30]", f.path(), sw);
    c.sliding_window = int(sw);
    // 5 local layers then 1 global layer, repeating
    for (int il = 0; il < c.n_layer; ++il) c.layer_sliding[size_t(il)] = (il + 1) % 6 != 0;
    c.final_softcap = float(f.get_float(a + "final_logit_softcapping").value_or(0.0));
    c.attn_softcap = float(f.get_float(a + "attn_logit_softcapping").value_or(0.0));
    if (!(c.final_softcap >= 0 && std::isfinite(c.final_softcap) && c.attn_softcap >= 0 && std::isfinite(c.attn_softcap)))
      fail("{}: logit soft-capping values ({} final, {} attention) must be finite and >= 0 (0: off)", f.path(),
           c.final_softcap, c.attn_softcap);
  }

  auto tokens = f.find("tokenizer.ggml.tokens");
  if (!tokens || tokens->type != gguf::ValueType::array)
    fail("{}: missing vocabulary 'tokenizer.ggml.tokens'", f.path());
  c.n_vocab = int(tokens->arr.size());
  c.tied_output = f.find_tensor("output.weight") == nullptr;
  return c;
}

}  // namespace kvq
