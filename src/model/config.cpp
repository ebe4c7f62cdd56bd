#include "model/config.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

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

std::optional<std::vector<bool>> gguf_sliding_layers(const gguf::File& f, const std::string& arch, int n_layer,
                                                     int default_pattern, const std::string& where) {
  const std::string key = arch + ".attention.sliding_window_pattern";
  std::vector<bool> sliding(size_t(n_layer), false);
  const gguf::Value* pat = f.find(key);
  if (pat && pat->type == gguf::ValueType::array) {
    if (int64_t(pat->arr.size()) != n_layer)
      fail("{}: '{}' has {} entries for {} layers", where, key, pat->arr.size(), n_layer);
    for (int il = 0; il < n_layer; ++il) {
      const gguf::Value& e = pat->arr[size_t(il)];
      std::optional<int64_t> x = e.type == gguf::ValueType::boolean ? std::optional<int64_t>(int64_t(e.u)) : e.as_int();
      if (!x) fail("{}: '{}' must hold booleans", where, key);
      sliding[size_t(il)] = *x != 0;
    }
    return sliding;
  }
  int64_t n = default_pattern;
  if (pat) {
    std::optional<int64_t> x = pat->as_int();
    if (!x || *x < 0 || *x > (int64_t(1) << 30)) fail("{}: '{}' must be an integer in [0, 2^30] or an array of booleans", where, key);
    n = *x;
  } else if (default_pattern < 0) {
    return std::nullopt;
  }
  for (int il = 0; il < n_layer; ++il) sliding[size_t(il)] = n == 0 || il % n < n - 1;
  return sliding;
}

int model_arch_swa_pattern(const std::string& arch) {
  return arch == "gemma3" ? 6 : arch == "gemma2" || arch == "gpt-oss" ? 2 : arch == "phi3" ? 1 : arch == "olmo2" ? 4 : -1;
}

int64_t model_arch_swa_window(const std::string& arch) { return arch == "gemma3" ? 512 : arch == "gemma2" ? 4096 : 0; }

void model_config_pick_rope(ModelConfig& c, int ctx) {
  if (!c.has_long_rope) return;
  c.rope_long = (ctx > 0 ? ctx : c.n_ctx_train) > c.n_ctx_orig;
  c.rope_freq_factors = c.rope_long ? c.rope_factors_long : c.rope_factors_short;
}

bool model_arch_supported(const std::string& arch) {
  for (const char* a : {"llama", "gemma2", "gemma3", "qwen2", "qwen3", "phi3", "smollm3", "granite", "olmo2", "qwen2moe",
                        "qwen3moe", "granitemoe", "olmoe", "gpt-oss"})
    if (arch == a) return true;
  return false;
}

const char* model_arch_list() {
  return "llama (and Mixtral's experts), gemma2, gemma3, qwen2, qwen3, phi3, smollm3, granite, olmo2, qwen2moe, "
         "qwen3moe, granitemoe, olmoe, gpt-oss";
}

std::string model_rope_note(const ModelConfig& c, int ctx) {
  if (!c.has_long_rope) return {};
  const int at = ctx > 0 ? ctx : c.n_ctx_train;
  return c.rope_long ? fmt::format("[kvq] LongRoPE: the long factors (context {} > {} original)", at, c.n_ctx_orig)
                     : fmt::format("[kvq] LongRoPE: the short factors (context {} <= {} original)", at, c.n_ctx_orig);
}

namespace {
void model_config_check_yarn(const ModelConfig& c, const std::string& where) {
  if (!c.rope_yarn) return;
  if (!(std::isfinite(c.yarn_beta_fast) && c.yarn_beta_fast > 0 && std::isfinite(c.yarn_beta_slow) &&
        c.yarn_beta_slow > 0))
    fail("{}: YaRN beta_fast {} and beta_slow {} must be finite numbers > 0", where, c.yarn_beta_fast, c.yarn_beta_slow);
  if (c.yarn_orig_ctx <= 0) fail("{}: YaRN original context {} must be > 0", where, c.yarn_orig_ctx);
}
}  // namespace

std::vector<double> model_yarn_pair_rates(int n_rot, float base, float factor, int orig_ctx, float beta_fast,
                                          float beta_slow) {
  // ggml_rope_yarn_corr_dims: the pair whose wavelength fits n_turns times into orig_ctx positions,
  // corr_dim(n_turns) = n_rot ln(orig_ctx / (n_turns 2 pi)) / (2 ln base), from floor(corr_dim(beta_fast))
  // to ceil(corr_dim(beta_slow)), held within [0, n_rot - 1]. Pairs below `low` keep the trained
  // rate (1), pairs above `high` are interpolated (1 / factor), the ramp mixes linearly between.
  auto corr = [&](float n_turns) {
    return float(n_rot) * std::log(float(orig_ctx) / (n_turns * 2.0f * float(M_PI))) / (2.0f * std::log(base));
  };
  const float low = std::max(0.0f, std::floor(corr(beta_fast)));
  const float high = std::min(float(n_rot - 1), std::ceil(corr(beta_slow)));
  const double interp = 1.0 / double(factor);
  std::vector<double> rate(size_t(n_rot / 2));
  for (int i = 0; i < n_rot / 2; ++i) {
    const float y = (float(i) - low) / std::max(0.001f, high - low);
    const double mix = 1.0 - double(std::min(1.0f, std::max(0.0f, y)));  // ggml's rope_yarn_ramp
    rate[size_t(i)] = interp * (1.0 - mix) + mix;
  }
  return rate;
}

namespace {
bool layer_yarn(const ModelConfig& c, int il) { return c.rope_yarn && c.layer_rope_scale(il) != 1.f; }
}  // namespace

KvRope model_layer_rope(const ModelConfig& c, int il) {
  KvRope r;
  r.n_rot = c.layer_n_rot(il);
  r.freq_base = c.layer_rope_base(il);
  r.freq_scale = 1.0f / c.layer_rope_scale(il);
  r.neox = c.rope_neox;
  if (r.n_rot <= 0) return r;
  r.freq_factors = c.layer_rope_factors(il);  // none on a layer without RoPE
  if (layer_yarn(c, il)) {
    // YaRN's rate per pair as a factor (pair i turns 1 / rate_i times slower), on top of the file's
    const std::vector<double> rate = model_yarn_pair_rates(r.n_rot, r.freq_base, c.layer_rope_scale(il), c.yarn_orig_ctx,
                                                           c.yarn_beta_fast, c.yarn_beta_slow);
    if (r.freq_factors.empty()) r.freq_factors.assign(rate.size(), 1.0f);
    for (size_t i = 0; i < rate.size(); ++i) r.freq_factors[i] = float(double(r.freq_factors[i]) / rate[i]);
    r.freq_scale = 1.0f;
  }
  return r;
}

float model_layer_rope_mscale(const ModelConfig& c, int il) {
  if (c.layer_n_rot(il) <= 0) return 1.f;
  float m = c.layer_sliding[size_t(il)] ? 1.f : c.rope_attn_factor;
  // YaRN's magnitude (as llama.cpp's, without a log multiplier): 1 + 0.1 ln(factor) for a factor > 1
  if (layer_yarn(c, il))
    m *= c.yarn_attn_factor > 0 ? c.yarn_attn_factor
                                : c.layer_rope_scale(il) > 1.f ? 1.0f + 0.1f * std::log(c.layer_rope_scale(il)) : 1.f;
  return m;
}

std::string model_rope_scaling_note(const ModelConfig& c) {
  if (c.rope_scale == 1.f) return {};
  if (!c.rope_yarn) return fmt::format("linear RoPE scaling x{}", c.rope_scale);
  return fmt::format("YaRN RoPE scaling x{} of {} positions (beta {} / {})", c.rope_scale, c.yarn_orig_ctx,
                     c.yarn_beta_fast, c.yarn_beta_slow);
}

void model_config_apply_rope(ModelConfig& c, const RopeOverrides& o) {
  if (!o.any()) return;
  const std::string& st = o.scaling;
  if (!st.empty() && st != "none" && st != "linear" && st != "yarn")
    fail("--rope-scaling '{}' is not one of: none, linear, yarn", st);
  if (o.scale != 0 && !(o.scale >= 1.0 / 1024 && o.scale <= 1024))
    fail("--rope-scale {} must be a number in [1/1024, 1024]", o.scale);
  if (o.yarn_orig_ctx > (1 << 30)) fail("--yarn-orig-ctx {} must be at most 2^30", o.yarn_orig_ctx);
  if (o.yarn_orig_ctx < 0) fail("--yarn-orig-ctx {} must be > 0", o.yarn_orig_ctx);
  for (double b : {o.yarn_beta_fast, o.yarn_beta_slow})
    if (b != 0 && !(b >= 1e-6 && b <= 1e6)) fail("--yarn-beta-fast / --yarn-beta-slow {} must be a number in [1e-6, 1e6]", b);
  if (st == "none" && o.scale != 0) fail("--rope-scaling none takes no --rope-scale");
  const float before = c.rope_scale;
  const bool was_yarn = c.rope_yarn;
  if (st == "none") {
    c.rope_scale = 1.f;
    c.rope_yarn = false;
  } else if (!st.empty()) {
    c.rope_yarn = st == "yarn";
  }
  if (o.scale != 0) c.rope_scale = float(o.scale);
  if (o.yarn_orig_ctx > 0) c.yarn_orig_ctx = o.yarn_orig_ctx;
  if (o.yarn_beta_fast > 0) c.yarn_beta_fast = float(o.yarn_beta_fast);
  if (o.yarn_beta_slow > 0) c.yarn_beta_slow = float(o.yarn_beta_slow);
  if (!c.rope_yarn && (o.yarn_orig_ctx > 0 || o.yarn_beta_fast > 0 || o.yarn_beta_slow > 0))
    fail("--yarn-orig-ctx, --yarn-beta-fast and --yarn-beta-slow need YaRN scaling (--rope-scaling yarn, or a file that has it)");
  // (a factor the file gave for linear scaling carries over to YaRN)
  if (c.rope_yarn && !was_yarn && o.scale == 0 && c.rope_scale == 1.f)
    fail("--rope-scaling yarn needs --rope-scale (the factor: context / original context)");
  // The sliding-window layers keep the file's scaling (rope_scale_local), as llama.cpp's
  // (rope_freq_scale_train_swa): Gemma 2's then rotate as the file says while its global layers follow
  // the flags (under YaRN, a local layer whose file factor is 1 rotates plainly, magnitude 1).
  model_config_check_yarn(c, "--rope-scaling");
  if (c.rope_scale != before) c.yarn_attn_factor = 0.f;  // the file's magnitude was for its own factor
  // The context the scaling is for, when the factor changed (as llama.cpp adjusts it): YaRN's
  // original context x the factor; linear: the file's context times the change of factor. The
  // kind changed alone, or switched off: the file's.
  if (c.rope_scale != before && st != "none") {
    const double n = c.rope_yarn ? double(c.yarn_orig_ctx) * double(c.rope_scale)
                                 : double(c.n_ctx_train) * double(c.rope_scale) / double(before);
    c.n_ctx_train = int(std::max(1.0, std::min(n, double(1 << 30))));
  }
}

namespace {
// A per-pair RoPE factor tensor (n_rot / 2 finite values > 0), or empty when absent.
std::vector<float> rope_factor_tensor(const gguf::File& f, const char* name, int n_rot) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) return {};
  if (t->type != GgmlType::F32 || t->n_elements() != n_rot / 2)
    fail("{}: tensor '{}' must be F32 with {} values (one per rotated pair), is {} with {}", f.path(), name, n_rot / 2,
         ggml_type_name(t->type), t->n_elements());
  std::vector<float> v(size_t(n_rot / 2));
  std::memcpy(v.data(), t->data, v.size() * sizeof(float));
  for (float x : v)
    if (!(std::isfinite(x) && x > 0)) fail("{}: {} holds {}: the factors must be finite numbers > 0", f.path(), name, x);
  return v;
}
}  // namespace

namespace {
// The mixture-of-experts hyperparameters, as llama.cpp reads them per architecture: the experts'
// width is feed_forward_length for Mixtral (llama) and Granite MoE, expert_feed_forward_length
// (else feed_forward_length / expert_used_count) for the Qwen MoE models; Qwen2-MoE's shared
// expert is expert_shared_feed_forward_length wide (else feed_forward_length) and gated, Granite
// MoE Shared's ungated and present when that key is > 0.
void read_experts(const gguf::File& f, ModelConfig& c) {
  const std::string a = c.arch + ".";
  const bool qwen_moe = c.arch == "qwen2moe" || c.arch == "qwen3moe", oss = c.arch == "gpt-oss";
  const bool needs = qwen_moe || c.arch == "olmoe" || oss;
  // An integer key, or an array of one value per layer as llama.cpp accepts for some of these
  // (kvq takes the array when every layer has the same value); nullopt when absent.
  auto uniform_int = [&](const std::string& key) -> std::optional<int64_t> {
    const gguf::Value* v = f.find(key);
    if (!v) return std::nullopt;
    if (v->type != gguf::ValueType::array) {
      const std::optional<int64_t> x = v->as_int();
      if (!x) fail("{}: '{}' must be an integer", f.path(), key);
      return x;
    }
    std::optional<int64_t> first;
    for (const gguf::Value& e : v->arr) {
      const std::optional<int64_t> x = e.as_int();
      if (!x || (first && *x != *first))
        fail("{}: '{}' must hold one integer for every layer (per-layer values are not supported)", f.path(), key);
      first = x;
    }
    if (!first) fail("{}: '{}' is an empty array", f.path(), key);
    return first;
  };
  const int64_t ne = uniform_int(a + "expert_count").value_or(0);
  if (ne == 0) {
    if (needs) fail("{}: a {} model needs '{}expert_count' > 0", f.path(), c.arch, a);
    return;
  }
  if (c.arch != "llama" && c.arch != "granite" && c.arch != "granitemoe" && !needs)
    fail("{}: '{}expert_count' = {}: experts are not supported in a {} model (kvq runs them in llama (Mixtral), "
         "qwen2moe, qwen3moe, granite, granitemoe, olmoe and gpt-oss files)", f.path(), a, ne, c.arch);
  // llama.cpp's limit (LLAMA_MAX_EXPERTS)
  if (ne < 0 || ne > 1024) fail("{}: '{}expert_count' = {} is out of range [1, 1024]", f.path(), a, ne);
  const std::optional<int64_t> nu = uniform_int(a + "expert_used_count");
  if (!nu) fail("{}: '{}expert_count' = {} without '{}expert_used_count' (the experts each token runs)", f.path(), a, ne, a);
  if (*nu <= 0 || *nu > ne)
    fail("{}: '{}expert_used_count' = {} must be in [1, {}] (the experts each token runs)", f.path(), a, *nu, ne);
  // DeepSeek-style group routing (a token's experts taken from its best groups) is not implemented
  if (const std::optional<int64_t> g = uniform_int(a + "expert_group_count"); g && *g > 1)
    fail("{}: '{}expert_group_count' = {}: routing within expert groups is not supported", f.path(), a, *g);
  c.n_expert = int(ne);
  c.n_expert_used = int(*nu);
  c.n_ff_exp = c.n_ff;
  if (qwen_moe || oss) {  // the experts' width, else (absent or 0) feed_forward_length / expert_used_count
    const std::string key = a + "expert_feed_forward_length";
    const int64_t fe = uniform_int(key).value_or(0);
    if (fe < 0 || fe > (int64_t(1) << 30)) fail("{}: '{}' = {} is out of range", f.path(), key, fe);
    if (oss && fe == 0) fail("{}: a gpt-oss model needs '{}' > 0 (its experts' width)", f.path(), key);
    c.n_ff_exp = fe > 0 ? int(fe) : c.n_ff / c.n_expert_used;
    if (c.n_ff_exp <= 0) fail("{}: no '{}' and feed_forward_length {} < expert_used_count {}", f.path(), key, c.n_ff, *nu);
  }
  const std::string shk = a + "expert_shared_feed_forward_length";
  const std::optional<int64_t> sh = f.get_int(shk);
  if (sh && (*sh < 0 || *sh > (int64_t(1) << 30))) fail("{}: '{}' = {} is out of range", f.path(), shk, *sh);
  if (c.arch == "qwen2moe") {
    c.n_ff_shexp = int(sh && *sh > 0 ? *sh : c.n_ff);
    c.shexp_gated = true;
  } else if (c.arch == "granite" || c.arch == "granitemoe") {
    c.n_ff_shexp = int(sh.value_or(0));
  }
  // gpt-oss: the softmax over the chosen experts' logits (sums to 1 already)
  c.moe_norm_weights = c.arch != "qwen2moe" && c.arch != "olmoe" && !oss;
  c.moe_softmax_chosen = c.moe_bias = oss;
}
}  // namespace

ModelConfig model_config_from_gguf(const gguf::File& f) {
  ModelConfig c;
  auto arch = f.get_string("general.architecture");
  if (!arch) fail("{}: missing metadata key 'general.architecture'", f.path());
  c.arch = *arch;
  if (!model_arch_supported(c.arch))
    fail("{}: unsupported architecture '{}' (supported: {})", f.path(), printable(c.arch), model_arch_list());
  const bool gemma = c.arch == "gemma2" || c.arch == "gemma3";
  c.name = f.get_string("general.name").value_or(c.arch);
  const std::string a = c.arch + ".";
  auto req = [&](const char* k) { return int(positive(f, a + k, require_int(f, a + k))); };
  c.n_layer = req("block_count");
  c.n_embd = req("embedding_length");
  // (gpt-oss: every FFN is experts, whose width is expert_feed_forward_length; llama.cpp does not
  // need feed_forward_length there)
  c.n_ff = c.arch == "gpt-oss" && !f.get_int(a + "feed_forward_length") ? 0 : req("feed_forward_length");
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
  if (auto st = f.get_string(a + "rope.scaling.type"); st && (*st == "linear" || *st == "yarn")) {
    c.rope_scale = float(f.get_float(a + "rope.scaling.factor").value_or(1.0));
    c.rope_yarn = *st == "yarn";
  } else if (st && *st != "none") {
    fail("{}: rope scaling type '{}' is not supported (supported: none, linear, yarn)", f.path(), printable(*st));
  }
  if (c.rope_yarn) {
    c.yarn_beta_fast = float(f.get_float(a + "rope.scaling.yarn_beta_fast").value_or(32.0));
    c.yarn_beta_slow = float(f.get_float(a + "rope.scaling.yarn_beta_slow").value_or(1.0));
    // transformers' attention_factor (the converter writes it when the config has it): the magnitude
    // itself, in place of 1 + 0.1 ln(factor). (llama.cpp computes 1 + 0.1 ln(factor) whatever the
    // file says; the two agree on the files that carry it, e.g. OLMo 3's 1.2079 at factor 8.)
    if (auto af = f.get_float(a + "rope.scaling.yarn_attn_factor")) {
      c.yarn_attn_factor = float(*af);
      if (!(std::isfinite(c.yarn_attn_factor) && c.yarn_attn_factor > 0 && c.yarn_attn_factor < 16))
        fail("{}: rope.scaling.yarn_attn_factor {} must be a finite number in (0, 16)", f.path(), c.yarn_attn_factor);
    }
    // DeepSeek's and Mistral 3's attention scaling by log multiplier: another formula for the
    // magnitude, on architectures kvq does not run
    if (f.get_float(a + "rope.scaling.yarn_log_multiplier").value_or(0.0) != 0.0)
      fail("{}: rope.scaling.yarn_log_multiplier (DeepSeek-style YaRN magnitude) is not supported", f.path());
  }
  if (!(c.rope_base > 1 && std::isfinite(c.rope_base)))
    fail("{}: RoPE frequency base {} must be a finite number > 1", f.path(), c.rope_base);
  if (!(c.rope_scale > 0 && std::isfinite(c.rope_scale)))
    fail("{}: rope scaling factor {} must be a finite number > 0", f.path(), c.rope_scale);
  // Sliding-window layers: Gemma 2 alternates (local first, window 4096 by default), Gemma 3 has 5
  // local layers then a global one; both as the file's sliding_window_pattern says when it has
  // one. Phi-3 files carry a sliding window too, which kvq ignores, as llama.cpp does (full
  // attention on every layer).
  c.layer_sliding.assign(size_t(c.n_layer), false);
  // OLMo 3 (architecture olmo2 with a sliding window): 3 local layers then a global one unless the
  // file's pattern says otherwise; its local layers' RoPE unscaled, as llama.cpp runs them.
  const bool olmo_swa = c.arch == "olmo2" && f.get_int(a + "attention.sliding_window").value_or(0) > 0;
  // gpt-oss: sliding-window and global layers alternate, local first (its window: 128)
  const bool oss = c.arch == "gpt-oss";
  if (oss && !f.get_int(a + "attention.sliding_window"))
    fail("{}: a gpt-oss model needs '{}attention.sliding_window'", f.path(), a);
  if (gemma || olmo_swa || oss) {
    const int64_t sw = f.get_int(a + "attention.sliding_window").value_or(model_arch_swa_window(c.arch));
    if (sw <= 0 || sw > (int64_t(1) << 30)) fail("{}: sliding window {} must be in [1, 2^30]", f.path(), sw);
    c.sliding_window = int(sw);
    c.layer_sliding = *gguf_sliding_layers(f, c.arch, c.n_layer, model_arch_swa_pattern(c.arch), f.path());
  }
  // The local layers' RoPE: Gemma 3's base 10000 and no scaling, Gemma 2's as the global layers'.
  // (OLMo 3's graph in llama.cpp rotates its local layers at the global base whatever the file says)
  c.rope_base_local = c.arch == "olmo2" ? c.rope_base
                                        : float(f.get_float(a + "rope.freq_base_swa").value_or(c.arch == "gemma3" ? 10000.0 : c.rope_base));
  // (gpt-oss's local layers are scaled as its global ones: YaRN on every layer, as llama.cpp runs it)
  c.rope_scale_local = c.arch == "gemma3" || c.arch == "olmo2" ? 1.f : c.rope_scale;
  if (!(c.rope_base_local > 1 && std::isfinite(c.rope_base_local)))
    fail("{}: RoPE frequency base of the sliding-window layers {} must be a finite number > 1", f.path(), c.rope_base_local);

  // Per-pair RoPE factors: Llama 3.1's one set, or Phi-3's LongRoPE pair chosen by the context.
  c.rope_freq_factors = rope_factor_tensor(f, "rope_freqs.weight", c.n_rot);
  std::vector<float> lng = rope_factor_tensor(f, "rope_factors_long.weight", c.n_rot);
  std::vector<float> sht = rope_factor_tensor(f, "rope_factors_short.weight", c.n_rot);
  if (lng.empty() != sht.empty())
    fail("{}: LongRoPE needs both 'rope_factors_long.weight' and 'rope_factors_short.weight'; the file has only '{}'",
         f.path(), lng.empty() ? "rope_factors_short.weight" : "rope_factors_long.weight");
  if (!lng.empty() && !c.rope_freq_factors.empty())
    fail("{}: the file has both 'rope_freqs.weight' and LongRoPE factors; one set of RoPE factors is expected", f.path());
  c.n_ctx_orig = f.get_int(a + "rope.scaling.original_context_length") ? req("rope.scaling.original_context_length")
                                                                        : c.n_ctx_train;
  c.yarn_orig_ctx = c.n_ctx_orig;
  model_config_check_yarn(c, f.path());
  if (!lng.empty()) {
    c.has_long_rope = true;
    c.rope_factors_long = std::move(lng);
    c.rope_factors_short = std::move(sht);
    model_config_pick_rope(c, 0);
  }
  c.rope_attn_factor = float(f.get_float(a + "rope.scaling.attn_factor").value_or(1.0));
  if (!(std::isfinite(c.rope_attn_factor) && c.rope_attn_factor > 0 && c.rope_attn_factor < 16))
    fail("{}: rope.scaling.attn_factor {} must be a finite number in (0, 16)", f.path(), c.rope_attn_factor);

  if (c.arch == "qwen2" || c.arch == "qwen3" || c.arch == "qwen2moe" || c.arch == "qwen3moe") {
    c.rope_neox = true;
    c.qkv_bias = c.arch == "qwen2" || c.arch == "qwen2moe";
    c.qk_norm = c.arch == "qwen3" || c.arch == "qwen3moe";
  }
  read_experts(f, c);
  if (c.arch == "olmo2" || c.arch == "olmoe") {  // q and k normalized over all their heads at once
    c.rope_neox = true;
    c.qk_norm = c.qk_norm_full = true;
    c.pre_norms = c.arch == "olmoe";  // OLMo 2 normalizes the attention and FFN outputs instead
    c.post_norms = c.arch == "olmo2";
  }
  if (c.arch == "phi3") {
    c.rope_neox = true;
    c.fused_gate_up = true;
  }
  if (oss) {
    c.rope_neox = true;
    c.qkv_bias = c.attn_out_bias = c.attn_sinks = c.swiglu_oai = true;
    if (c.n_ff == 0) c.n_ff = c.n_ff_exp;
  }
  if (c.arch == "smollm3") {  // no RoPE on every 4th layer (3, 7, ...), as llama.cpp reads SmolLM3
    c.layer_no_rope.assign(size_t(c.n_layer), false);
    for (int il = 0; il < c.n_layer; ++il) c.layer_no_rope[size_t(il)] = (il + 1) % 4 == 0;
  }
  if (c.arch == "granite" || c.arch == "granitemoe") {
    auto mult = [&](const char* key, bool required) {
      const std::optional<double> v = f.get_float(a + key);
      if (!v && required) fail("{}: missing metadata key '{}{}'", f.path(), a, key);
      if (v && !(std::isfinite(*v) && *v > 0 && *v < 1e6))
        fail("{}: '{}{}' = {} must be a finite number in (0, 1e6)", f.path(), a, key, *v);
      return float(v.value_or(0.0));
    };
    c.logit_scale = mult("logit_scale", true);
    c.residual_scale = mult("residual_scale", false);
    c.embd_mult = mult("embedding_scale", false);
    c.attn_scale = mult("attention.scale", false);  // 0: 1/sqrt(head_dim)
    for (const char* b : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})
      for (int il = 0; il < c.n_layer; ++il)
        if (const std::string t = fmt::format("blk.{}.{}.bias", il, b); f.find_tensor(t))
          fail("{}: tensor '{}': biases in Granite's layers are not supported", f.path(), t);
    // rope.scaling.finetuned = false switches Granite's RoPE off (as llama.cpp reads it)
    // (Granite MoE's reader does not look at the key)
    if (c.arch == "granite" && !f.get_bool(a + "rope.scaling.finetuned").value_or(true))
      c.layer_no_rope.assign(size_t(c.n_layer), true);
  }
  if (gemma) {
    c.rope_neox = true;
    c.embd_scale = true;
    c.geglu = true;
    c.post_norms = true;
    c.qk_norm = c.arch == "gemma3";
    // q.k is scaled by 1/sqrt(query_pre_attn_scalar), which GGUF does not carry: head_dim, except
    // for the 27B models (Gemma 2: 46 layers, Gemma 3: 62), where it is n_embd / n_head; the same
    // rule as llama.cpp's.
    const bool is_27b = c.n_layer == (c.arch == "gemma2" ? 46 : 62);
    c.attn_scale = 1.0f / std::sqrt(float(is_27b ? c.n_embd / c.n_head : c.head_dim));
    // Gemma 2 soft-caps attention scores at 50 and logits at 30 unless the file says otherwise;
    // Gemma 3 caps neither.
    const double cap_final = c.arch == "gemma2" ? 30.0 : 0.0, cap_attn = c.arch == "gemma2" ? 50.0 : 0.0;
    c.final_softcap = float(f.get_float(a + "final_logit_softcapping").value_or(cap_final));
    c.attn_softcap = float(f.get_float(a + "attn_logit_softcapping").value_or(cap_attn));
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
