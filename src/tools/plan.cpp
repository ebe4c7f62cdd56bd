#include "tools/plan.h"

#include "kv/calib.h"
#include "kv/policy.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <tuple>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/strings.h"
#include "gguf/gguf.h"
#include "kvq/kv_format.h"
#include "model/config.h"
#include "tools/kv_flags.h"

namespace kvq {

namespace {

// The full-precision tail of grouped codecs is f32 rows (the encoders read f32; kv_format.h
// counts the tail at 32 bits per element too).
constexpr int64_t kTailBytesPerElement = 4;
// Activations and logits are f32 in the engine.
constexpr int64_t kActBytes = 4;
// Upper end of the max-context search: a model whose every layer is sliding-window never runs out.
constexpr int64_t kMaxContextSearch = int64_t(1) << 40;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Largest --gpu-mem: 1e9 GiB keeps every byte count of the plan well inside int64.
constexpr double kMaxGpuMemGiB = 1e9;

// Bounds on a model's shape, checked on config.json fields and GGUF metadata before anything is
// sized from them. Each is far above the largest public model (in parentheses), and together they
// keep the parameter count below 2^56 and every per-layer figure small.
constexpr int64_t kMaxLayers = 4096;            // 126 (Llama 3.1 405B)
constexpr int64_t kMaxHeads = 65536;            // 128 (Llama 3.1 405B, DeepSeek-V3)
constexpr int64_t kMaxHeadDim = 65536;          // 256 (Gemma), 576 (DeepSeek's MLA keys)
// heads x head_dim, query and KV alike: 24,576 (DeepSeek-V3 queries), 14,336 (BLOOM's KV).
// Codecs that need calibration are sized with placeholder artifacts of this width.
constexpr int64_t kMaxAttnWidth = int64_t(1) << 18;
constexpr int64_t kMaxEmbd = int64_t(1) << 20;  // 16,384 (Llama 3.1 405B)
constexpr int64_t kMaxFf = int64_t(1) << 20;    // 53,248 (Llama 3.1 405B)
constexpr int64_t kMaxVocab = int64_t(1) << 24; // 262,208 (Gemma 3)
// Trained context and sliding window: the engine's own metadata bound (model_config_from_gguf);
// 10,485,760 (Llama 4 Scout). Informational here, nothing is sized from it.
constexpr int64_t kMaxContext = int64_t(1) << 30;

// A bound as the error messages give it: powers of two from 2^16 up as "2^18", others in digits.
std::string bound_text(int64_t hi) {
  if (hi >= 65536 && (hi & (hi - 1)) == 0) return fmt::format("2^{}", __builtin_ctzll(uint64_t(hi)));
  return std::to_string(hi);
}
// "1..4096", "1..2^20"
std::string range_text(int64_t lo, int64_t hi) { return fmt::format("{}..{}", lo, bound_text(hi)); }

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = char(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

// "1234567" -> "1,234,567"
std::string group_digits(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v);
  std::string r;
  int n = 0;
  for (auto it = s.rbegin(); it != s.rend(); ++it) {
    if (n && n % 3 == 0) r.push_back(',');
    r.push_back(*it);
    ++n;
  }
  if (v < 0) r.push_back('-');
  return std::string(r.rbegin(), r.rend());
}

std::string format_per_token(double v) {
  double r = std::round(v);
  if (std::fabs(v - r) < 1e-9) return group_digits(int64_t(r));
  const double cents = std::round(v * 100);  // two decimals, carried into the integer part
  return fmt::format("{}.{:02d}", group_digits(int64_t(cents) / 100), int(int64_t(cents) % 100));
}

std::string format_count(int64_t n) {
  // Token counts as users type them: 4K, 32K, 1M when exact.
  const int64_t m = int64_t(1) << 20, k = 1024;
  if (n >= m && n % m == 0) return fmt::format("{}M", n / m);
  if (n >= k && n % k == 0) return fmt::format("{}K", n / k);
  return std::to_string(n);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Saturating arithmetic: sizes past 2^63 bytes become INT64_MAX (never fit, never wrap).
constexpr int64_t kSat = std::numeric_limits<int64_t>::max();
int64_t sat_mul(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? kSat : r;
}
int64_t sat_add(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_add_overflow(a, b, &r) ? kSat : r;
}

// Same rule as kv_quantized_tokens(), in 64 bits (contexts past 2^31 tokens are planned too).
int64_t quantized_tokens64(int64_t n, int group_tokens, int residual_tokens) {
  if (group_tokens <= 1) return n;
  int64_t over = n - residual_tokens;
  return over <= 0 ? 0 : (over / group_tokens) * group_tokens;
}

// Per-device share of a layer's KV heads under tensor parallelism: heads are split across
// devices; with more devices than heads each device keeps a replica of one head.
int kv_heads_per_device(int n_kv_heads, int tp) {
  if (tp <= 1) return n_kv_heads;
  if (n_kv_heads % tp == 0) return n_kv_heads / tp;
  if (tp % n_kv_heads == 0) return 1;
  fail("--tp {}: a layer has {} KV heads; tensor parallelism needs the head count to divide by "
       "the device count or the device count to divide by the head count",
       tp, n_kv_heads);
}

void validate_model(const PlanModel& m) {
  if (m.n_layers <= 0 || m.n_layers > kMaxLayers)
    fail("{}: layer count {} is out of range ({})", m.name, m.n_layers, range_text(1, kMaxLayers));
  if (m.n_heads <= 0 || m.head_dim <= 0) fail("{}: {} heads of {} dims is not a valid attention shape", m.name, m.n_heads, m.head_dim);
  if (m.n_heads > kMaxHeads || m.head_dim > kMaxHeadDim || int64_t(m.n_heads) * m.head_dim > kMaxAttnWidth)
    fail("{}: {} heads of {} dims is out of range (heads {}, head_dim {}, heads x head_dim at most {})", m.name,
         m.n_heads, m.head_dim, range_text(1, kMaxHeads), range_text(1, kMaxHeadDim), bound_text(kMaxAttnWidth));
  if (m.n_embd < 0 || m.n_ff < 0 || m.n_vocab < 0) fail("{}: negative model dimensions", m.name);
  if (m.n_embd > kMaxEmbd || m.n_ff > kMaxFf || m.n_vocab > kMaxVocab)
    fail("{}: hidden size {}, FFN size {}, vocabulary {}: out of range (hidden {}, FFN {}, vocabulary {})", m.name,
         m.n_embd, m.n_ff, m.n_vocab, range_text(0, kMaxEmbd), range_text(0, kMaxFf), range_text(0, kMaxVocab));
  if (m.ctx_train < 0 || m.ctx_train > kMaxContext)
    fail("{}: trained context {} is out of range ({}; 0 = unknown)", m.name, m.ctx_train, range_text(0, kMaxContext));
  if (int(m.layers.size()) != m.n_layers) fail("{}: {} layer entries for {} layers", m.name, m.layers.size(), m.n_layers);
  for (size_t il = 0; il < m.layers.size(); ++il) {
    const PlanLayer& l = m.layers[il];
    if (l.n_kv_heads <= 0 || l.head_dim_k <= 0 || l.head_dim_v <= 0 || l.window < 0)
      fail("{}: layer {} has an invalid shape ({} KV heads, key dim {}, value dim {}, window {})",
           m.name, il, l.n_kv_heads, l.head_dim_k, l.head_dim_v, l.window);
    if (l.n_kv_heads > kMaxHeads || l.head_dim_k > kMaxHeadDim || l.head_dim_v > kMaxHeadDim ||
        int64_t(l.n_kv_heads) * std::max(l.head_dim_k, l.head_dim_v) > kMaxAttnWidth || l.window > kMaxContext)
      fail("{}: layer {} is out of range ({} KV heads, key dim {}, value dim {}, window {}; KV heads {}, dims {}, "
           "KV heads x dim at most {}, window at most {})",
           m.name, il, l.n_kv_heads, l.head_dim_k, l.head_dim_v, l.window, range_text(1, kMaxHeads),
           range_text(1, kMaxHeadDim), bound_text(kMaxAttnWidth), bound_text(kMaxContext));
    // Grouped-query attention: every KV head serves the same number of query heads.
    if (m.n_heads % l.n_kv_heads)
      fail("{}: layer {} has {} KV heads for {} query heads; the query heads must divide evenly among the KV heads",
           m.name, il, l.n_kv_heads, m.n_heads);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Presets

const std::vector<PlanPreset>& plan_presets() {
  // Shapes from the public config.json of each checkpoint (hf_name).
  static const std::vector<PlanPreset> presets = [] {
    std::vector<PlanPreset> v;
    auto add = [&](PlanPreset p) { v.push_back(std::move(p)); };
    PlanPreset p;
    p = {};
    p.name = "llama-3-70b"; p.hf_name = "meta-llama/Meta-Llama-3-70B";
    p.n_layers = 80; p.n_heads = 64; p.n_kv_heads = 8; p.head_dim = 128; p.n_embd = 8192;
    p.n_ff = 28672; p.n_vocab = 128256; p.ctx_train = 8192;
    add(p);
    p = {};
    p.name = "llama-3.1-8b"; p.hf_name = "meta-llama/Llama-3.1-8B";
    p.n_layers = 32; p.n_heads = 32; p.n_kv_heads = 8; p.head_dim = 128; p.n_embd = 4096;
    p.n_ff = 14336; p.n_vocab = 128256; p.ctx_train = 131072;
    add(p);
    p = {};
    p.name = "llama-3.2-1b"; p.hf_name = "meta-llama/Llama-3.2-1B";
    p.n_layers = 16; p.n_heads = 32; p.n_kv_heads = 8; p.head_dim = 64; p.n_embd = 2048;
    p.n_ff = 8192; p.n_vocab = 128256; p.ctx_train = 131072; p.tied_embeddings = true;
    add(p);
    p = {};
    p.name = "qwen2.5-7b"; p.hf_name = "Qwen/Qwen2.5-7B-Instruct";
    p.n_layers = 28; p.n_heads = 28; p.n_kv_heads = 4; p.head_dim = 128; p.n_embd = 3584;
    p.n_ff = 18944; p.n_vocab = 152064; p.ctx_train = 32768; p.qkv_bias = true;
    add(p);
    p = {};
    p.name = "mistral-7b"; p.hf_name = "mistralai/Mistral-7B-v0.3";
    p.n_layers = 32; p.n_heads = 32; p.n_kv_heads = 8; p.head_dim = 128; p.n_embd = 4096;
    p.n_ff = 14336; p.n_vocab = 32768; p.ctx_train = 32768;
    add(p);
    p = {};
    p.name = "gemma-2-9b"; p.hf_name = "google/gemma-2-9b";
    p.n_layers = 42; p.n_heads = 16; p.n_kv_heads = 8; p.head_dim = 256; p.n_embd = 3584;
    p.n_ff = 14336; p.n_vocab = 256000; p.ctx_train = 8192; p.window = 4096; p.swa_pattern = 2;
    p.tied_embeddings = true; p.norms_per_layer = 4;
    add(p);
    p = {};
    p.name = "phi-3.5-mini"; p.hf_name = "microsoft/Phi-3.5-mini-instruct";
    p.n_layers = 32; p.n_heads = 32; p.n_kv_heads = 32; p.head_dim = 96; p.n_embd = 3072;
    p.n_ff = 8192; p.n_vocab = 32064; p.ctx_train = 131072;
    add(p);
    p = {};
    p.name = "gemma-3-27b"; p.hf_name = "google/gemma-3-27b-it (text model)";
    p.n_layers = 62; p.n_heads = 32; p.n_kv_heads = 16; p.head_dim = 128; p.n_embd = 5376;
    p.n_ff = 21504; p.n_vocab = 262208; p.ctx_train = 131072; p.window = 1024; p.swa_pattern = 6;
    p.tied_embeddings = true; p.norms_per_layer = 4; p.qk_norm = true;
    add(p);
    p = {};
    p.name = "gemma-3-270m"; p.hf_name = "google/gemma-3-270m";
    p.n_layers = 18; p.n_heads = 4; p.n_kv_heads = 1; p.head_dim = 256; p.n_embd = 640;
    p.n_ff = 2048; p.n_vocab = 262144; p.ctx_train = 32768; p.window = 512; p.swa_pattern = 6;
    p.tied_embeddings = true; p.norms_per_layer = 4; p.qk_norm = true;
    add(p);
    p = {};
    p.name = "mixtral-8x7b"; p.hf_name = "mistralai/Mixtral-8x7B-v0.1";
    p.n_layers = 32; p.n_heads = 32; p.n_kv_heads = 8; p.head_dim = 128; p.n_embd = 4096;
    p.n_ff = 14336; p.n_vocab = 32000; p.ctx_train = 32768;
    p.n_expert = 8; p.n_expert_used = 2; p.n_ff_exp = 14336;
    add(p);
    p = {};
    p.name = "qwen3-30b-a3b"; p.hf_name = "Qwen/Qwen3-30B-A3B";
    p.n_layers = 48; p.n_heads = 32; p.n_kv_heads = 4; p.head_dim = 128; p.n_embd = 2048;
    p.n_ff = 6144; p.n_vocab = 151936; p.ctx_train = 40960; p.qk_norm = true;
    p.n_expert = 128; p.n_expert_used = 8; p.n_ff_exp = 768;
    add(p);
    p = {};
    p.name = "gpt-oss-20b"; p.hf_name = "openai/gpt-oss-20b";
    p.n_layers = 24; p.n_heads = 64; p.n_kv_heads = 8; p.head_dim = 64; p.n_embd = 2880;
    p.n_ff = 2880; p.n_vocab = 201088; p.ctx_train = 131072; p.window = 128; p.swa_pattern = 2;
    p.qkv_bias = true; p.oss_biases = true; p.n_expert = 32; p.n_expert_used = 4; p.n_ff_exp = 2880;
    p.expert_bits = 4.25;
    add(p);
    p.name = "gpt-oss-120b"; p.hf_name = "openai/gpt-oss-120b";
    p.n_layers = 36; p.n_expert = 128;
    add(p);
    p = {};
    p.name = "smollm2-135m"; p.hf_name = "HuggingFaceTB/SmolLM2-135M";
    p.n_layers = 30; p.n_heads = 9; p.n_kv_heads = 3; p.head_dim = 64; p.n_embd = 576;
    p.n_ff = 1536; p.n_vocab = 49152; p.ctx_train = 8192; p.tied_embeddings = true;
    add(p);
    return v;
  }();
  return presets;
}

const PlanPreset& plan_preset_find(const std::string& name) {
  const std::string n = lower(trim(name));
  std::string names;
  for (const PlanPreset& p : plan_presets()) {
    if (p.name == n) return p;
    names += (names.empty() ? "" : ", ") + p.name;
  }
  fail("unknown preset '{}' (presets: {}; `kvq plan --presets` shows their shapes)", name, names);
}

namespace {
int64_t count_params(const PlanPreset& p, bool active) {
  if (p.n_layers < 0 || p.n_heads < 0 || p.n_kv_heads < 0 || p.head_dim < 0 || p.n_embd < 0 || p.n_ff < 0 ||
      p.n_vocab < 0 || p.norms_per_layer < 0 || p.n_expert < 0 || p.n_expert_used < 0 || p.n_ff_exp < 0 ||
      p.n_ff_shexp < 0 || p.n_dense_layers < 0 || p.n_dense_layers > p.n_layers)
    fail("parameter count of '{}': negative model dimensions", p.name);
  // Checked arithmetic: shapes within the planner's bounds stay below 2^56 parameters; shapes
  // past them fail here rather than wrap.
  auto overflow = [&]() -> int64_t { fail("parameter count of '{}' exceeds 2^63", p.name); };
  auto mul = [&](int64_t a, int64_t b) {
    int64_t r;
    return __builtin_mul_overflow(a, b, &r) ? overflow() : r;
  };
  auto add = [&](int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? overflow() : r;
  };
  const int64_t e = p.n_embd, q = mul(p.n_heads, p.head_dim), kv = mul(p.n_kv_heads, p.head_dim);
  int64_t layer = add(add(mul(e, q), mul(2, mul(e, kv))), mul(q, e));  // Wq, Wk, Wv, Wo
  if (p.qkv_bias) layer = add(layer, add(q, mul(2, kv)));
  if (p.oss_biases) layer = add(layer, add(e, p.n_heads));  // output bias, sinks
  layer = add(layer, mul(p.norms_per_layer, e));
  if (p.qk_norm) layer = add(layer, p.qk_norm_full ? add(q, kv) : mul(2, p.head_dim));
  const int64_t dense_ffn = mul(3, mul(e, p.n_ff));  // gated FFN: gate, up, down
  int64_t total = mul(p.n_layers, layer);
  if (p.n_expert > 0) {
    int64_t moe = mul(mul(active ? p.n_expert_used : p.n_expert, 3), mul(e, p.n_ff_exp));  // experts
    moe = add(moe, mul(e, p.n_expert));                                                    // router
    if (p.oss_biases)  // the router's bias, each expert's gate / up / down biases
      moe = add(moe, add(p.n_expert, mul(active ? p.n_expert_used : p.n_expert, add(mul(2, p.n_ff_exp), e))));
    moe = add(moe, add(mul(3, mul(e, p.n_ff_shexp)), p.shexp_gate ? e : 0));               // shared expert
    total = add(total, add(mul(p.n_layers - p.n_dense_layers, moe), mul(p.n_dense_layers, dense_ffn)));
  } else {
    total = add(total, mul(p.n_layers, dense_ffn));
  }
  total = add(total, mul(mul(p.n_vocab, e), p.tied_embeddings ? 1 : 2));
  total = add(total, e);                         // final norm
  return total;
}
}  // namespace

int64_t plan_params(const PlanPreset& p) { return count_params(p, false); }
int64_t plan_active_params(const PlanPreset& p) { return count_params(p, true); }

namespace {

// params x bits / 8, rounded up; kvq::Error where it does not fit in int64.
int64_t weights_bytes_of(int64_t n_params, double bits) {
  const double b = std::ceil(double(n_params) * bits / 8.0);
  if (!(b >= 0) || b >= 9.2e18) fail("weights of {} parameters at {} bits exceed 2^63 bytes", n_params, bits);
  return int64_t(b);
}

// The weights' bytes and their note: every parameter at `bits`, or, with p.expert_bits, the
// experts' matrices at those bits and the rest at `bits`.
void set_weights(PlanModel& m, const PlanPreset& p, double bits, const char* what, const char* how = "") {
  if (p.expert_bits <= 0 || p.n_expert <= 0) {
    m.weights_bytes = weights_bytes_of(m.n_params, bits);
    m.weights_note = fmt::format("{}{} params{} x {} bits", what, group_digits(m.n_params), how, bits);
    return;
  }
  const int64_t experts = int64_t(p.n_layers - p.n_dense_layers) * p.n_expert * 3 * p.n_embd * p.n_ff_exp;
  m.weights_bytes = weights_bytes_of(experts, p.expert_bits) + weights_bytes_of(m.n_params - experts, bits);
  m.weights_note = fmt::format("{}{} params{}: {} of the experts' matrices x {} bits (MXFP4), the rest x {} bits", what,
                               group_digits(m.n_params), how, group_digits(experts), p.expert_bits, bits);
}

}  // namespace

bool plan_layer_is_local(int il, int swa_pattern) {
  if (swa_pattern <= 0) return false;
  if (swa_pattern == 1) return true;
  return (il + 1) % swa_pattern != 0;
}

namespace {
std::string moe_note(const PlanModel& m, bool tied_embeddings, int64_t embd_params) {
  std::string s = fmt::format("mixture of experts: {} of {} experts per token", m.n_expert_used, m.n_expert);
  if (m.n_params_active > 0 && m.n_params > 0) {
    s += fmt::format(", {} of the {} parameters ({:.1f}%) per token", group_digits(m.n_params_active),
                     group_digits(m.n_params), 100.0 * double(m.n_params_active) / double(m.n_params));
    // a decode step reads one row of an embedding table that is not also the output projection
    s += tied_embeddings || embd_params <= 0
             ? std::string(", which is what one sequence's decode step reads")
             : fmt::format(", of which one sequence's decode step reads all but the input embedding table ({} "
                           "parameters; one row of it)",
                           group_digits(embd_params));
  }
  return s;
}

// The planner's view of a shape with experts: counts, active parameters, and the FFN buffers of a
// token's chosen experts and the shared one (the engine runs them at once), or of a dense layer.
void fill_experts(PlanModel& m, const PlanPreset& p) {
  if (p.n_expert <= 0) return;
  m.n_expert = p.n_expert;
  m.n_expert_used = p.n_expert_used;
  m.n_params_active = plan_active_params(p);
  m.n_ff = std::max(p.n_expert_used * p.n_ff_exp + p.n_ff_shexp, p.n_dense_layers > 0 ? p.n_ff : int64_t(0));
  m.notes.push_back(moe_note(m, p.tied_embeddings, p.n_vocab * p.n_embd));
}
}  // namespace

PlanModel plan_model_from_preset(const std::string& name, double weights_bits) {
  const PlanPreset& p = plan_preset_find(name);
  if (!(weights_bits > 0) || weights_bits > 64) fail("--weights-bits must be in (0, 64] (got {})", weights_bits);
  PlanModel m;
  m.name = p.name;
  m.source = "preset";
  m.arch = p.hf_name;
  m.n_layers = p.n_layers;
  m.n_heads = p.n_heads;
  m.head_dim = p.head_dim;
  m.n_embd = p.n_embd;
  m.n_ff = p.n_ff;
  m.n_vocab = p.n_vocab;
  m.ctx_train = p.ctx_train;
  for (int il = 0; il < p.n_layers; ++il) {
    PlanLayer l;
    l.n_kv_heads = p.n_kv_heads;
    l.head_dim_k = l.head_dim_v = p.head_dim;
    l.window = plan_layer_is_local(il, p.swa_pattern) ? p.window : 0;
    m.layers.push_back(l);
  }
  m.n_params = plan_params(p);
  fill_experts(m, p);
  set_weights(m, p, weights_bits, "");
  return m;
}

// ---------------------------------------------------------------------------------------------
// GGUF

namespace {

std::optional<int64_t> gguf_int_or_max(const gguf::File& f, const std::string& key, std::vector<int64_t>* per_layer) {
  const gguf::Value* v = f.find(key);
  if (!v) return std::nullopt;
  if (v->type == gguf::ValueType::array) {
    if (v->arr.empty()) fail("{}: '{}' is an empty array", f.path(), key);
    int64_t mx = 0;
    for (const gguf::Value& e : v->arr) {
      std::optional<int64_t> x = e.as_int();
      if (!x) fail("{}: '{}' must hold integers", f.path(), key);
      if (per_layer) per_layer->push_back(*x);
      mx = std::max(mx, *x);
    }
    return mx;
  }
  std::optional<int64_t> x = v->as_int();
  if (!x) fail("{}: '{}' must be an integer (it is {})", f.path(), key, gguf::value_type_name(v->type));
  return x;
}

// A required integer in 1..max.
int64_t positive_int(std::optional<int64_t> v, const std::string& what, const std::string& where, int64_t max) {
  if (!v) fail("{}: missing '{}'", where, what);
  if (*v <= 0 || *v > max) fail("{}: '{}' = {} is out of range ({})", where, what, *v, range_text(1, max));
  return *v;
}

// An optional integer in lo..max.
std::optional<int64_t> bounded_int(std::optional<int64_t> v, const std::string& what, const std::string& where,
                                   int64_t lo, int64_t max) {
  if (v && (*v < lo || *v > max)) fail("{}: '{}' = {} is out of range ({})", where, what, *v, range_text(lo, max));
  return v;
}

// Every float among the architecture's metadata (arrays included) must be finite: a NaN epsilon
// or an infinite RoPE base is a broken file, whatever the planner reads.
void check_finite(const gguf::File& f, const std::string& prefix) {
  for (const gguf::KeyValue& kv : f.metadata()) {
    if (kv.key.rfind(prefix, 0) != 0) continue;
    const gguf::Value& v = kv.value;
    if (v.is_float() && !std::isfinite(v.f))
      fail("{}: '{}' = {} is not a finite number", f.path(), kv.key, v.f);
    if (v.type == gguf::ValueType::array)
      for (size_t i = 0; i < v.arr.size(); ++i)
        if (v.arr[i].is_float() && !std::isfinite(v.arr[i].f))
          fail("{}: '{}'[{}] = {} is not a finite number", f.path(), kv.key, i, v.arr[i].f);
  }
}

// "blk.12.attn_k.weight" -> 12; nullopt for tensors outside the layers.
std::optional<int64_t> tensor_layer(const std::string& name) {
  if (name.rfind("blk.", 0) != 0) return std::nullopt;
  size_t i = 4;
  int64_t n = 0;
  for (; i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])); ++i)
    if (n <= kMaxLayers) n = n * 10 + (name[i] - '0');  // past the bound: stays past it, never wraps
  if (i == 4 || i >= name.size() || name[i] != '.') return std::nullopt;
  return n;
}

// The metadata against the tensor index, for every architecture: the file holds tensors, the
// layers block_count names are the blk.N tensors present, and K/V projections, where the file has
// them as attn_k / attn_v, have KV heads x head size outputs.
void check_gguf_tensors(const gguf::File& f, const PlanModel& m, const std::string& a) {
  const std::string& where = f.path();
  if (f.tensors().empty()) fail("{}: the file holds no tensors (no weights to plan for)", where);
  std::vector<bool> present(size_t(m.n_layers), false);
  for (const gguf::TensorInfo& t : f.tensors()) {
    std::optional<int64_t> il = tensor_layer(t.name);
    if (!il) continue;
    if (*il >= m.n_layers)
      fail("{}: tensor '{}' belongs to a layer past '{}block_count' = {} (layers 0..{})", where, t.name, a,
           m.n_layers, m.n_layers - 1);
    present[size_t(*il)] = true;
  }
  for (int il = 0; il < m.n_layers; ++il)
    if (!present[size_t(il)])
      fail("{}: '{}block_count' = {} but the file has no tensors for layer {} (blk.{}.*)", where, a, m.n_layers, il, il);
  for (int il = 0; il < m.n_layers; ++il) {
    const PlanLayer& l = m.layers[size_t(il)];
    for (const auto& [kind, dim, key] : {std::tuple<const char*, int, const char*>{"k", l.head_dim_k, "key_length"},
                                         std::tuple<const char*, int, const char*>{"v", l.head_dim_v, "value_length"}}) {
      const std::string name = fmt::format("blk.{}.attn_{}.weight", il, kind);
      const gguf::TensorInfo* t = f.find_tensor(name);
      if (!t) continue;
      int64_t out = 1;  // outputs: every dimension past the first (as the engine's loader reads them)
      for (size_t d = 1; d < t->ne.size(); ++d) out = sat_mul(out, t->ne[d]);
      const int64_t want = int64_t(l.n_kv_heads) * dim;
      if (t->ne.size() < 2 || out != want)
        fail("{}: tensor '{}' has {} outputs, but '{}attention.head_count_kv' x {} = {} x {} = {} for layer {}", where,
             name, t->ne.size() < 2 ? 1 : out, a, key, l.n_kv_heads, dim, want, il);
    }
  }
}

}  // namespace

PlanModel plan_model_from_gguf(const gguf::File& f) {
  PlanModel m;
  m.source = "gguf";
  const std::string where = f.path();
  std::optional<std::string> arch = f.get_string("general.architecture");
  if (!arch) fail("{}: missing 'general.architecture'", where);
  m.arch = *arch;
  m.name = f.get_string("general.name").value_or(*arch);
  const std::string a = *arch + ".";
  check_finite(f, a);

  // Every count is bounded before anything is sized from it.
  m.n_layers = int(positive_int(gguf_int_or_max(f, a + "block_count", nullptr), a + "block_count", where, kMaxLayers));
  m.n_heads = int(positive_int(gguf_int_or_max(f, a + "attention.head_count", nullptr), a + "attention.head_count", where,
                               kMaxHeads));
  std::vector<int64_t> kv_per_layer;
  std::optional<int64_t> n_kv = bounded_int(gguf_int_or_max(f, a + "attention.head_count_kv", &kv_per_layer),
                                            a + "attention.head_count_kv", where, 1, kMaxHeads);
  if (!n_kv) {
    n_kv = m.n_heads;
    m.notes.push_back(fmt::format("'{}attention.head_count_kv' absent: assuming {} KV heads (= query heads)", a, m.n_heads));
  }
  if (!kv_per_layer.empty() && int64_t(kv_per_layer.size()) != m.n_layers)
    fail("{}: '{}attention.head_count_kv' has {} entries for {} layers", where, a, kv_per_layer.size(), m.n_layers);
  std::optional<int64_t> n_embd =
      bounded_int(gguf_int_or_max(f, a + "embedding_length", nullptr), a + "embedding_length", where, 1, kMaxEmbd);
  m.n_embd = n_embd.value_or(0);
  std::optional<int64_t> kl = gguf_int_or_max(f, a + "attention.key_length", nullptr);
  std::optional<int64_t> vl = gguf_int_or_max(f, a + "attention.value_length", nullptr);
  if (!kl || !vl) {
    if (!n_embd) fail("{}: missing '{}attention.key_length' and '{}embedding_length' (one is needed for the head size)", where, a, a);
    if (*n_embd % m.n_heads) fail("{}: embedding_length {} is not a multiple of head_count {}", where, *n_embd, m.n_heads);
    if (!kl) kl = *n_embd / m.n_heads;
    if (!vl) vl = *n_embd / m.n_heads;
  }
  int64_t hk = positive_int(kl, a + "attention.key_length", where, kMaxHeadDim);
  int64_t hv = positive_int(vl, a + "attention.value_length", where, kMaxHeadDim);
  m.head_dim = int(hk);
  // Present: a real length (0 is not "unknown"); absent: unknown.
  m.ctx_train = bounded_int(gguf_int_or_max(f, a + "context_length", nullptr), a + "context_length", where, 1, kMaxContext)
                    .value_or(0);
  if (m.ctx_train == 0) m.notes.push_back(fmt::format("'{}context_length' absent: trained context unknown", a));
  m.n_ff = bounded_int(gguf_int_or_max(f, a + "feed_forward_length", nullptr), a + "feed_forward_length", where, 0, kMaxFf)
               .value_or(0);
  if (m.n_ff == 0) m.notes.push_back("feed_forward_length absent: FFN buffers left out of the activation estimate");

  // Vocabulary: explicit key, else the embedding matrix, else the tokenizer.
  if (auto nv = gguf_int_or_max(f, a + "vocab_size", nullptr)) {
    m.n_vocab = *bounded_int(nv, a + "vocab_size", where, 1, kMaxVocab);
  } else if (const gguf::TensorInfo* t = f.find_tensor("token_embd.weight"); t && t->ne.size() >= 2) {
    m.n_vocab = *bounded_int(t->ne[1], "token_embd.weight rows (vocabulary)", where, 1, kMaxVocab);
  } else if (const gguf::Value* tok = f.find("tokenizer.ggml.tokens"); tok && tok->type == gguf::ValueType::array) {
    m.n_vocab = *bounded_int(int64_t(tok->arr.size()), "tokenizer.ggml.tokens (vocabulary)", where, 1, kMaxVocab);
  }

  // Sliding window: which layers use it. An explicit per-layer pattern wins; otherwise the
  // architecture's known layout; otherwise every layer is counted as full attention (the
  // conservative answer) and the output says so.
  std::optional<int64_t> window = bounded_int(gguf_int_or_max(f, a + "attention.sliding_window", nullptr),
                                              a + "attention.sliding_window", where, 0, kMaxContext);
  if (!window && *arch == "gemma2") window = model_arch_swa_window(*arch);  // as the engine (and llama.cpp) take it
  std::vector<bool> local(size_t(m.n_layers), false);
  if (window && *window > 0) {
    // The pattern key as llama.cpp reads it, else the architecture's known layout (Phi-3's window
    // is not used, by kvq as by llama.cpp: no sliding layer).
    if (std::optional<std::vector<bool>> sl =
            gguf_sliding_layers(f, *arch, int(m.n_layers), model_arch_swa_pattern(*arch), where)) {
      local = std::move(*sl);
    } else {
      m.notes.push_back(fmt::format("'{}attention.sliding_window' = {} but the layer pattern of '{}' is unknown: "
                                    "every layer counted as full attention", a, *window, *arch));
    }
  }
  for (int il = 0; il < m.n_layers; ++il) {
    PlanLayer l;
    l.n_kv_heads = int(kv_per_layer.empty() ? *n_kv : kv_per_layer[size_t(il)]);
    l.head_dim_k = int(hk);
    l.head_dim_v = int(hv);
    l.window = local[size_t(il)] ? *window : 0;
    m.layers.push_back(l);
  }
  for (size_t il = 0; il < m.layers.size(); ++il)
    if (m.layers[il].n_kv_heads <= 0)
      fail("{}: layer {} has {} KV heads (layers without attention are not supported by the planner)",
           where, il, m.layers[il].n_kv_heads);
  validate_model(m);  // the shape bounds that span fields (heads x head_dim), with their ranges
  check_gguf_tensors(f, m, a);
  // The architectures kvq runs: the engine's own metadata checks as well (the same file must load).
  std::optional<ModelConfig> engine_cfg;
  if (model_arch_supported(*arch)) engine_cfg = model_config_from_gguf(f);

  int64_t params = 0, expert_params = 0;
  for (const gguf::TensorInfo& t : f.tensors()) {
    params = sat_add(params, t.n_elements());
    if (t.name.size() > 12 && t.name.compare(t.name.size() - 12, 12, "_exps.weight") == 0)
      expert_params = sat_add(expert_params, t.n_elements());
  }
  m.n_params = params;
  m.weights_bytes = int64_t(f.tensor_bytes());
  m.weights_note = fmt::format("tensor data in the GGUF ({} tensors)", f.tensors().size());
  // Experts: a token runs expert_used_count of expert_count; the FFN buffers are one expert wide.
  const std::optional<int64_t> ne = bounded_int(gguf_int_or_max(f, a + "expert_count", nullptr), a + "expert_count", where, 0, 1024);
  if (ne && *ne > 0) {
    const std::optional<int64_t> nu =
        bounded_int(gguf_int_or_max(f, a + "expert_used_count", nullptr), a + "expert_used_count", where, 1, *ne);
    if (!nu) fail("{}: '{}expert_count' = {} without '{}expert_used_count'", where, a, *ne, a);
    m.n_expert = int(*ne);
    m.n_expert_used = int(*nu);
    m.n_params_active = params - int64_t(double(expert_params) * double(*ne - *nu) / double(*ne));
    // The FFN buffers: a token's chosen experts and the shared one, which the engine runs at once,
    // with the widths the engine reads (for architectures it runs; others keep feed_forward_length).
    if (engine_cfg) m.n_ff = std::min<int64_t>(engine_cfg->ffn_active_channels(), kMaxFf);
    const gguf::TensorInfo* embd = f.find_tensor("token_embd.weight");
    m.notes.push_back(moe_note(m, f.find_tensor("output.weight") == nullptr, embd ? embd->n_elements() : 0));
  }
  return m;
}

PlanModel plan_model_from_gguf_path(const std::string& path) {
  std::unique_ptr<gguf::File> f = gguf::File::open(path);
  return plan_model_from_gguf(*f);
}

// ---------------------------------------------------------------------------------------------
// Hugging Face config.json

namespace {

struct HfFields {
  const nlohmann::json& top;
  const nlohmann::json* text;  // text_config of multimodal configs, or null
  std::string where;

  const nlohmann::json* get(const char* key) const {
    if (text && text->contains(key) && !(*text)[key].is_null()) return &(*text)[key];
    if (top.contains(key) && !top[key].is_null()) return &top[key];
    return nullptr;
  }
  // A positive integer of at most `max` (checked before anything is sized from it).
  std::optional<int64_t> opt_int(const char* key, int64_t max) const {
    const nlohmann::json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_number_integer() || v->get<int64_t>() <= 0 || v->get<int64_t>() > max)
      fail("{}: field '{}' must be an integer in {} (got {})", where, key, range_text(1, max), v->dump());
    return v->get<int64_t>();
  }
  int64_t req_int(const char* key, int64_t max) const {
    std::optional<int64_t> v = opt_int(key, max);
    if (!v) fail("{}: missing field '{}'", where, key);
    return *v;
  }
  std::optional<std::string> opt_string(const char* key) const {
    const nlohmann::json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) fail("{}: field '{}' must be a string (got {})", where, key, v->dump());
    return v->get<std::string>();
  }
  std::optional<bool> opt_bool(const char* key) const {
    const nlohmann::json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) fail("{}: field '{}' must be true or false (got {})", where, key, v->dump());
    return v->get<bool>();
  }
};

double torch_dtype_bits(const std::string& dtype, const std::string& where) {
  const std::string d = lower(dtype);
  if (d == "bfloat16" || d == "float16" || d == "half" || d == "torch.bfloat16" || d == "torch.float16") return 16;
  if (d == "float32" || d == "float" || d == "torch.float32") return 32;
  if (d == "float8_e4m3fn" || d == "float8_e5m2") return 8;
  fail("{}: unknown torch_dtype '{}' (pass --weights-bits)", where, dtype);
}

}  // namespace

PlanModel plan_model_from_hf_config(const nlohmann::json& cfg, std::optional<double> weights_bits, const std::string& name) {
  if (!cfg.is_object()) fail("{}: expected a JSON object", name);
  const nlohmann::json* text = nullptr;
  if (cfg.contains("text_config") && cfg["text_config"].is_object()) text = &cfg["text_config"];
  HfFields f{cfg, text, name};

  PlanModel m;
  m.source = "config.json";
  m.name = name;
  m.arch = f.opt_string("model_type").value_or("");
  m.n_layers = int(f.req_int("num_hidden_layers", kMaxLayers));
  m.n_heads = int(f.req_int("num_attention_heads", kMaxHeads));
  m.n_embd = f.req_int("hidden_size", kMaxEmbd);
  m.n_ff = f.req_int("intermediate_size", kMaxFf);
  m.n_vocab = f.req_int("vocab_size", kMaxVocab);
  std::optional<int64_t> n_kv = f.opt_int("num_key_value_heads", kMaxHeads);
  if (!n_kv) {
    n_kv = m.n_heads;
    m.notes.push_back(fmt::format("'num_key_value_heads' absent: {} KV heads (= attention heads, the transformers default)", m.n_heads));
  }
  // The shape rules the engine's GGUF loader enforces (model_config_from_gguf).
  if (m.n_heads % *n_kv)
    fail("{}: num_attention_heads {} is not a multiple of num_key_value_heads {} (each KV head serves a whole "
         "group of query heads)", name, m.n_heads, *n_kv);
  if (std::optional<int64_t> hd = f.opt_int("head_dim", kMaxHeadDim)) {
    m.head_dim = int(*hd);
  } else {
    if (m.n_embd % m.n_heads) fail("{}: no 'head_dim' and hidden_size {} is not a multiple of num_attention_heads {}", name, m.n_embd, m.n_heads);
    m.head_dim = int(m.n_embd / m.n_heads);
  }
  if (m.head_dim % 2) fail("{}: head dimension {} must be even (rotary embeddings turn pairs of dimensions)", name, m.head_dim);
  if (int64_t(m.n_heads) * m.head_dim > kMaxAttnWidth)
    fail("{}: num_attention_heads {} x head dimension {} = {} is out of range (at most {})", name, m.n_heads,
         m.head_dim, int64_t(m.n_heads) * m.head_dim, bound_text(kMaxAttnWidth));
  m.ctx_train = f.opt_int("max_position_embeddings", kMaxContext).value_or(0);
  if (m.ctx_train == 0) m.notes.push_back("'max_position_embeddings' absent: trained context unknown");
  // YaRN (rope_scaling {"rope_type": "yarn", "factor": F, "original_max_position_embeddings": N}, as
  // Qwen3's model cards say to add past 32K): the context is N x F, as vLLM derives its maximum
  // length and kvq's engine sets it (Model::load's RoPE flags).
  const nlohmann::json* rs = f.get("rope_scaling");
  if (!rs) rs = f.get("rope_parameters");  // transformers 5's name
  if (rs && rs->is_object()) {
    const auto str = [&](const char* k) {
      const auto it = rs->find(k);
      return it != rs->end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    const std::string kind = !str("rope_type").empty() ? str("rope_type") : str("type");
    const auto fac = rs->find("factor");
    if (kind == "yarn" && fac != rs->end() && fac->is_number() && fac->get<double>() > 1 && fac->get<double>() <= 1024) {
      const auto orig = rs->find("original_max_position_embeddings");
      const int64_t n = orig != rs->end() && orig->is_number_integer() && orig->get<int64_t>() > 0 &&
                                orig->get<int64_t>() <= kMaxContext
                            ? orig->get<int64_t>()
                            : m.ctx_train;
      if (n > 0) {
        m.ctx_train = std::min<int64_t>(kMaxContext, int64_t(double(n) * fac->get<double>()));
        m.notes.push_back(fmt::format("YaRN RoPE scaling x{}: context {} ({} original)", fac->get<double>(), m.ctx_train, n));
      }
    }
  }

  // Sliding window layers: layer_types names each layer; else sliding_window_pattern; else the
  // model type's known layout; else (sliding_window set) every layer, as in Mistral v0.1.
  const std::string mt = lower(m.arch);
  std::vector<bool> local(size_t(m.n_layers), false);
  std::optional<int64_t> window;
  bool use_sw = f.opt_bool("use_sliding_window").value_or(true);
  if (mt == "phi3" && f.get("sliding_window")) {
    // Phi-3's window is not used by kvq's engine (nor by llama.cpp's): every layer full
    use_sw = false;
    m.notes.push_back("Phi-3's 'sliding_window' is not used (kvq and llama.cpp attend to the whole context)");
  }
  if (const nlohmann::json* w = f.get("sliding_window"); w && use_sw) {
    if (!w->is_number_integer() || w->get<int64_t>() <= 0 || w->get<int64_t>() > kMaxContext)
      fail("{}: field 'sliding_window' must be an integer in {} or null (got {})", name, range_text(1, kMaxContext), w->dump());
    window = w->get<int64_t>();
  }
  if (window) {
    if (const nlohmann::json* lt = f.get("layer_types")) {
      if (!lt->is_array() || int64_t(lt->size()) != m.n_layers)
        fail("{}: field 'layer_types' must be an array of {} strings (one per layer)", name, m.n_layers);
      for (int il = 0; il < m.n_layers; ++il) {
        const nlohmann::json& t = (*lt)[size_t(il)];
        if (!t.is_string()) fail("{}: field 'layer_types' must hold strings", name);
        const std::string s = t.get<std::string>();
        if (s == "sliding_attention") local[size_t(il)] = true;
        else if (s == "full_attention") local[size_t(il)] = false;
        else fail("{}: layer_types[{}] = '{}' (expected 'sliding_attention' or 'full_attention')", name, il, s);
      }
    } else {
      int pattern = 1;
      // Hugging Face's sliding_window_pattern: layer i is global where (i + 1) % n == 0, so n = 1
      // makes every layer global.
      if (std::optional<int64_t> p = f.opt_int("sliding_window_pattern", std::numeric_limits<int32_t>::max()))
        pattern = *p == 1 ? 0 : int(*p);
      else if (mt.rfind("gemma3", 0) == 0) pattern = 6;
      else if (mt == "gemma2") pattern = 2;
      for (int il = 0; il < m.n_layers; ++il) local[size_t(il)] = plan_layer_is_local(il, pattern);
    }
  }
  for (int il = 0; il < m.n_layers; ++il) {
    PlanLayer l;
    l.n_kv_heads = int(*n_kv);
    l.head_dim_k = l.head_dim_v = m.head_dim;
    l.window = local[size_t(il)] ? *window : 0;
    m.layers.push_back(l);
  }

  // Weights: parameters from the shapes. Mixture-of-experts configs of the families whose expert
  // layout is known (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE, OLMoE) are counted; others need
  // --weights-bytes.
  PlanPreset shape;
  const bool moe = f.get("num_local_experts") || f.get("num_experts") || f.get("n_routed_experts");
  const bool qwen_moe = mt == "qwen2_moe" || mt == "qwen3_moe";
  const bool oss = mt == "gpt_oss";
  const bool known_moe = mt == "mixtral" || qwen_moe || mt == "granitemoe" || mt == "granitemoeshared" || mt == "olmoe" || oss;
  if (moe && !known_moe) {
    m.notes.push_back(fmt::format("mixture-of-experts config ('{}'): expert layout not known to kvq, weights not "
                                  "estimated (pass --weights-bytes)", mt));
    m.weights_note = "unknown (mixture of experts)";
    return m;
  }
  if (moe) {
    shape.n_expert = int(f.req_int(qwen_moe || mt == "olmoe" ? "num_experts" : "num_local_experts", 4096));
    shape.n_expert_used = int(f.req_int("num_experts_per_tok", shape.n_expert));
    if (shape.n_expert < 1 || shape.n_expert_used < 1)
      fail("{}: {} experts with {} per token: both must be at least 1", name, shape.n_expert, shape.n_expert_used);
    shape.n_ff_exp = qwen_moe ? f.req_int("moe_intermediate_size", kMaxFf) : m.n_ff;
    if (mt == "qwen2_moe") {
      shape.n_ff_shexp = f.opt_int("shared_expert_intermediate_size", kMaxFf).value_or(0);
      shape.shexp_gate = shape.n_ff_shexp > 0;
    }
    if (mt == "granitemoeshared") shape.n_ff_shexp = f.opt_int("shared_intermediate_size", kMaxFf).value_or(0);
    if (qwen_moe) {  // layers in mlp_only_layers, or off the decoder_sparse_step, keep a dense FFN
      const int64_t step = f.opt_int("decoder_sparse_step", kMaxLayers).value_or(1);
      std::vector<bool> dense(size_t(m.n_layers), false);
      if (const nlohmann::json* only = f.get("mlp_only_layers")) {
        if (!only->is_array()) fail("{}: field 'mlp_only_layers' must be an array of layer indices", name);
        for (const auto& x : *only) {
          if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= m.n_layers)
            fail("{}: 'mlp_only_layers' holds {}, not a layer index in [0, {})", name, x.dump(), m.n_layers);
          dense[size_t(x.get<int64_t>())] = true;
        }
      }
      for (int il = 0; il < m.n_layers; ++il)
        if (step < 1 || (il + 1) % step != 0) dense[size_t(il)] = true;
      shape.n_dense_layers = int(std::count(dense.begin(), dense.end(), true));
    }
  }
  shape.name = name;
  shape.n_layers = m.n_layers;
  shape.n_heads = m.n_heads;
  shape.n_kv_heads = int(*n_kv);
  shape.head_dim = m.head_dim;
  shape.n_embd = m.n_embd;
  shape.n_ff = m.n_ff;
  shape.n_vocab = m.n_vocab;
  const bool gemma = mt.rfind("gemma", 0) == 0;
  shape.tied_embeddings = f.opt_bool("tie_word_embeddings").value_or(gemma);
  shape.qkv_bias = f.opt_bool("attention_bias").value_or(mt == "qwen2" || mt == "qwen2_moe" || oss);
  shape.oss_biases = oss;
  // gpt-oss's checkpoints store the experts' matrices in MXFP4 (quantization_config), the rest in
  // torch_dtype
  if (const nlohmann::json* qc = f.get("quantization_config");
      oss && qc && qc->is_object() && qc->value("quant_method", std::string()) == "mxfp4")
    shape.expert_bits = 4.25;
  shape.norms_per_layer = gemma && mt != "gemma" ? 4 : 2;
  shape.qk_norm = mt.rfind("gemma3", 0) == 0 || mt == "qwen3" || mt == "qwen3_moe" || mt == "olmo2" || mt == "olmo3" ||
                  mt == "olmoe";
  shape.qk_norm_full = mt == "olmo2" || mt == "olmo3" || mt == "olmoe";
  m.n_params = plan_params(shape);
  fill_experts(m, shape);
  double bits = 0;
  if (weights_bits) {
    bits = *weights_bits;
  } else {
    std::optional<std::string> dt = f.opt_string("torch_dtype");
    if (!dt) dt = f.opt_string("dtype");
    if (!dt) {
      bits = 16;
      m.notes.push_back("'torch_dtype' absent: weights counted at 16 bits");
    } else {
      bits = torch_dtype_bits(*dt, name);
    }
  }
  if (!(bits > 0) || bits > 64) fail("--weights-bits must be in (0, 64] (got {})", bits);
  if (weights_bits) shape.expert_bits = 0;  // --weights-bits: every parameter at those bits
  set_weights(m, shape, bits, "~", " (from the shapes)");
  return m;
}

PlanModel plan_model_from_hf_config_path(const std::string& path, std::optional<double> weights_bits) {
  std::ifstream in(path);
  if (!in) fail("{}: cannot open", path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("{}: read error", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", path, e.what());
  }
  return plan_model_from_hf_config(j, weights_bits, path);
}

// ---------------------------------------------------------------------------------------------
// Parsing

int64_t plan_parse_count(std::string_view s0, const char* what) {
  const std::string s = trim(s0);
  if (s.empty()) fail("{}: empty value", what);
  size_t i = 0;
  if (s[0] == '-' || s[0] == '+') fail("{}: '{}' must be a positive count", what, s);
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
  if (i == 0) fail("{}: '{}' is not a count (examples: 4096, 4K, 32k, 1M)", what, s);
  const std::string digits = s.substr(0, i);
  const std::string suffix = lower(s.substr(i));
  int64_t mult = 1;
  if (suffix.empty()) mult = 1;
  else if (suffix == "k") mult = int64_t(1) << 10;
  else if (suffix == "m") mult = int64_t(1) << 20;
  else if (suffix == "g") mult = int64_t(1) << 30;
  else fail("{}: '{}' has an unknown suffix '{}' (use K = 1024, M = 1024^2 or G = 1024^3)", what, s, s.substr(i));
  if (digits.size() > 15) fail("{}: '{}' is too large", what, s);
  const int64_t v = std::stoll(digits);
  if (v <= 0) fail("{}: '{}' must be positive", what, s);
  if (v > (int64_t(1) << 40) / mult) fail("{}: '{}' is too large (at most 1024G)", what, s);
  return v * mult;
}

std::vector<int64_t> plan_parse_count_list(std::string_view s, const char* what) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(s)) out.push_back(plan_parse_count(item, what));
  return out;
}

int64_t plan_parse_bytes(std::string_view s0, const char* what) {
  const std::string s = trim(s0);
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0 || s.empty()) fail("{}: '{}' is not a size in bytes (examples: 141107412992, 64G, 1.5TiB)", what, s);
  std::string suffix = lower(s.substr(i));
  if (suffix.size() >= 2 && suffix.substr(suffix.size() - 2) == "ib") suffix.resize(suffix.size() - 2);
  else if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();
  double mult = 1;
  if (suffix.empty()) mult = 1;
  else if (suffix == "k") mult = 1024.0;
  else if (suffix == "m") mult = 1024.0 * 1024;
  else if (suffix == "g") mult = kGiB;
  else if (suffix == "t") mult = kGiB * 1024;
  else fail("{}: '{}' has an unknown unit (use K, M, G, T: binary multiples)", what, s);
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(s.substr(0, i), &used);
    if (used != i) throw std::invalid_argument("number");
  } catch (const std::exception&) {
    fail("{}: '{}' is not a number", what, s);
  }
  const double bytes = std::round(v * mult);
  if (!(bytes >= 1)) fail("{}: '{}' must be positive", what, s);
  if (bytes > 1e18) fail("{}: '{}' is too large", what, s);
  return int64_t(bytes);
}

std::vector<int> plan_parse_skip_layers(std::string_view spec, const PlanModel& m) {
  std::vector<bool> sliding;
  for (const auto& l : m.layers) sliding.push_back(l.window > 0);
  return kv_parse_skip_layers(spec, m.n_layers, sliding);
}

// ---------------------------------------------------------------------------------------------
// Computation

int64_t plan_layer_tokens(const PlanLayer& l, int64_t n) { return l.window > 0 ? std::min(n, l.window) : n; }

int64_t plan_sequence_kv_bytes(const PlanModel& m, const PlanFormatCost& c, int page_tokens, int64_t n, bool device) {
  int64_t total = 0;
  const auto& page = device ? c.layer_page_bytes_device : c.layer_page_bytes;
  const auto& tail_k = device ? c.layer_tail_row_bytes_k_device : c.layer_tail_row_bytes_k;
  const auto& tail_v = device ? c.layer_tail_row_bytes_v_device : c.layer_tail_row_bytes_v;
  for (int il = 0; il < m.n_layers; ++il) {
    const int64_t t = plan_layer_tokens(m.layers[size_t(il)], n);
    total = sat_add(total, sat_mul(ceil_div(t, page_tokens), page[size_t(il)]));
    if (tail_k[size_t(il)]) total = sat_add(total, (t - quantized_tokens64(t, c.k_group, c.k_residual)) * tail_k[size_t(il)]);
    if (tail_v[size_t(il)]) total = sat_add(total, (t - quantized_tokens64(t, c.v_group, c.v_residual)) * tail_v[size_t(il)]);
  }
  return total;
}

namespace {

struct ActTerms {
  int64_t fixed = 0;    // bytes independent of the batch (one prefill chunk)
  int64_t per_seq = 0;  // bytes per decoding sequence
};

ActTerms activation_terms(const PlanModel& m, const PlanConfig& c) {
  const int64_t tp = c.tp;
  int64_t kv_dim = 0;
  for (const PlanLayer& l : m.layers)
    kv_dim = std::max<int64_t>(kv_dim, int64_t(kv_heads_per_device(l.n_kv_heads, c.tp)) * std::max(l.head_dim_k, l.head_dim_v));
  const int64_t heads = ceil_div(m.n_heads, tp);
  const int64_t q_dim = heads * m.head_dim;
  const int64_t ff = ceil_div(m.n_ff, tp);
  // One token's working set: residual stream + two normed/projected copies, q, k, v, FFN gate+up.
  int64_t per_token = 3 * m.n_embd + q_dim + 2 * kv_dim + 2 * ff;
  // Experts: the chosen experts' gathered inputs and outputs (and the shared expert's output), the
  // router's scores, the chosen experts' weights and indices, the shared expert's gate.
  if (m.n_expert > 0) per_token += (2 * int64_t(m.n_expert_used) + 1) * m.n_embd + m.n_expert + 2 * m.n_expert_used + 1;
  // Attention works page by page (online softmax): one page of scores per head in flight.
  const int64_t scores = heads * c.page_tokens;
  ActTerms t;
  t.per_seq = kActBytes * (per_token + scores + m.n_vocab);
  t.fixed = kActBytes * c.prefill_chunk * (per_token + scores);
  return t;
}

int64_t format_param_bytes(const KvCodec& codec, int page_tokens, const std::string& format) {
  const KvCodecInfo& info = codec.info();
  if (info.group_tokens > 1 && page_tokens % info.group_tokens != 0)
    fail("format '{}': codec '{}' encodes groups of {} tokens; --page-tokens {} must be a multiple of it",
         format, info.name, info.group_tokens, page_tokens);
  return int64_t(codec.block_bytes(page_tokens));
}

}  // namespace

int64_t plan_activation_bytes(const PlanModel& m, const PlanConfig& c, int64_t batch) {
  ActTerms t = activation_terms(m, c);
  return sat_add(t.fixed, sat_mul(batch, t.per_seq));
}

PlanFormatCost plan_format_cost(const PlanModel& m, const PlanConfig& c, const std::string& format) {
  validate_model(m);
  // Per-layer codecs: the format everywhere (a registered name, KFMT/VFMT, either side with
  // @gN, as --kv-cache-dtype takes it), f16 on the skipped layers.
  const KvPolicy uniform = kv_policy_uniform(format, 1);
  struct LayerCodecs {
    std::string k, v;
  };
  const KvLayerFormat& desc = uniform.layers[0];
  std::vector<LayerCodecs> policy(size_t(m.n_layers), LayerCodecs{desc.k_codec, desc.v_codec});
  if (!c.skip_layers.empty()) {
    const KvFormatDesc& f16 = kv_format_find("f16");
    for (int il : c.skip_layers) {
      if (il < 0 || il >= m.n_layers) fail("skip layer {} out of range (0..{})", il, m.n_layers - 1);
      policy[size_t(il)] = LayerCodecs{f16.k_codec, f16.v_codec};
    }
  }
  PlanFormatCost r;
  r.name = uniform.name;
  r.k_codec = desc.k_codec;
  r.v_codec = desc.v_codec;

  // Codec sizes do not depend on the layer index, so one instance per (codec, role, shape).
  std::map<std::tuple<std::string, int, int, int>, std::unique_ptr<KvCodec>> codecs;
  auto codec_for = [&](const std::string& name, KvRole role, int head_dim, int heads, int layer) -> const KvCodec& {
    auto key = std::make_tuple(name, int(role), head_dim, heads);
    auto it = codecs.find(key);
    if (it == codecs.end()) {
      KvCodecParams p;
      p.role = role;
      p.head_dim = head_dim;
      p.n_kv_heads = heads;
      p.layer = layer;
      std::unique_ptr<KvCodec> cd;
      try {
        cd = kv_codec_create(name, p);
      } catch (const Error&) {
        // Codecs that read calibration artifacts (static scales, channel means) have the same
        // size whatever their values: size them with placeholder ones. Other errors (a group
        // that does not divide head_dim, ...) stand.
        // One layer of placeholders, read as layer 0: the size does not depend on the layer.
        const nlohmann::json cal = kv_placeholder_calib(1, heads, head_dim);
        p.calib = &cal;
        p.layer = 0;
        try {
          cd = kv_codec_create(name, p);
        } catch (const Error& e2) {
          // With the placeholders in hand, what still fails is the codec's real objection.
          fail("format '{}' at head_dim {}: {}", r.name, head_dim, e2.what());
        }
      }
      it = codecs.emplace(key, std::move(cd)).first;
    }
    return *it->second;
  };

  const size_t nl = size_t(m.n_layers);
  r.layer_page_bytes.assign(nl, 0);
  r.layer_page_bytes_device.assign(nl, 0);
  r.layer_tail_row_bytes_k.assign(nl, 0);
  r.layer_tail_row_bytes_v.assign(nl, 0);
  r.layer_tail_row_bytes_k_device.assign(nl, 0);
  r.layer_tail_row_bytes_v_device.assign(nl, 0);
  double code_bits_total = 0;  // bits of codes per token, whole model
  int64_t tail_max = 0;
  bool first_grouped_k = true, first_grouped_v = true;
  for (int il = 0; il < m.n_layers; ++il) {
    const PlanLayer& l = m.layers[size_t(il)];
    const LayerCodecs& lf = policy[size_t(il)];
    const KvCodec& kc = codec_for(lf.k, KvRole::key, l.head_dim_k, l.n_kv_heads, il);
    const KvCodec& vc = codec_for(lf.v, KvRole::value, l.head_dim_v, l.n_kv_heads, il);
    const int64_t kb = format_param_bytes(kc, c.page_tokens, r.name);
    const int64_t vb = format_param_bytes(vc, c.page_tokens, r.name);
    const int dev_heads = kv_heads_per_device(l.n_kv_heads, c.tp);
    r.layer_page_bytes[size_t(il)] = int64_t(l.n_kv_heads) * (kb + vb);
    r.layer_page_bytes_device[size_t(il)] = int64_t(dev_heads) * (kb + vb);
    code_bits_total += double(l.n_kv_heads) * (kc.info().code_bits * l.head_dim_k + vc.info().code_bits * l.head_dim_v);
    auto grouped = [&](const KvCodec& cd, int head_dim, int heads, int64_t& row, int64_t& row_dev,
                       int& g, int& rr, bool& first) {
      const KvCodecInfo& info = cd.info();
      if (info.group_tokens <= 1) return;
      if (first) {
        g = info.group_tokens;
        rr = info.residual_tokens;
        first = false;
      } else if (g != info.group_tokens || rr != info.residual_tokens) {
        fail("format '{}': layers use different token groups ({}/{} vs {}/{}); the planner assumes one", r.name,
             g, rr, info.group_tokens, info.residual_tokens);
      }
      row = int64_t(heads) * head_dim * kTailBytesPerElement;
      row_dev = int64_t(kv_heads_per_device(heads, c.tp)) * head_dim * kTailBytesPerElement;
      tail_max += int64_t(std::min<int64_t>(info.residual_tokens + info.group_tokens - 1,
                                            l.window > 0 ? l.window : std::numeric_limits<int64_t>::max())) * row;
    };
    grouped(kc, l.head_dim_k, l.n_kv_heads, r.layer_tail_row_bytes_k[size_t(il)], r.layer_tail_row_bytes_k_device[size_t(il)],
            r.k_group, r.k_residual, first_grouped_k);
    grouped(vc, l.head_dim_v, l.n_kv_heads, r.layer_tail_row_bytes_v[size_t(il)], r.layer_tail_row_bytes_v_device[size_t(il)],
            r.v_group, r.v_residual, first_grouped_v);
    r.page_bytes += r.layer_page_bytes[size_t(il)];
    r.page_bytes_device += r.layer_page_bytes_device[size_t(il)];
  }
  r.per_token_bytes = double(r.page_bytes) / c.page_tokens;
  r.code_bytes_per_token = code_bits_total / 8.0;
  r.overhead_bytes_per_token = r.per_token_bytes - r.code_bytes_per_token;
  r.residual_bytes_max = tail_max;
  return r;
}

namespace {

void validate_config(const PlanConfig& c) {
  if (c.ctx.empty()) fail("--ctx: no context lengths given");
  if (c.batch.empty()) fail("--batch: no batch sizes given");
  constexpr int64_t kMaxCount = int64_t(1) << 40;
  for (int64_t v : c.ctx) if (v <= 0 || v > kMaxCount) fail("--ctx: {} must be in 1..2^40", v);
  for (int64_t v : c.batch) if (v <= 0 || v > kMaxCount) fail("--batch: {} must be in 1..2^40", v);
  if (c.page_tokens < 16 || c.page_tokens > 256 || (c.page_tokens & (c.page_tokens - 1)))
    fail("--page-tokens {}: must be a power of two from 16 to 256", c.page_tokens);
  if (c.tp <= 0) fail("--tp {}: must be a positive device count", c.tp);
  if (c.gpu_mem_bytes < 0) fail("--gpu-mem must be positive");
  if (!(c.util > 0) || c.util > 1) fail("--util {}: must be a fraction in (0, 1]", c.util);
  if (c.prefill_chunk <= 0 || c.prefill_chunk > kMaxCount) fail("--prefill-chunk {}: must be positive", c.prefill_chunk);
}

}  // namespace

PlanResult plan_compute(const PlanModel& m, const PlanConfig& c0) {
  validate_model(m);
  validate_config(c0);
  PlanResult res;
  res.model = m;
  res.config = c0;
  PlanConfig& c = res.config;
  std::set<std::string> seen;
  if (c.formats.empty()) {
    // Every registered format that can be sized without more input (formats whose codecs need
    // calibration artifacts are listed as skipped, with the codec's reason).
    for (const KvFormatDesc& d : kv_formats()) {
      try {
        res.formats.push_back(plan_format_cost(m, c, d.name));
        c.formats.push_back(d.name);
      } catch (const Error& e) {
        res.skipped_formats.push_back(e.what());
      }
    }
  } else {
    for (const std::string& f : c.formats) {
      PlanFormatCost cost = plan_format_cost(m, c, f);
      if (!seen.insert(cost.name).second) continue;  // an alias of a format already listed
      res.formats.push_back(std::move(cost));
    }
  }
  if (m.weights_bytes >= 0) res.weights_bytes_device = ceil_div(m.weights_bytes, c.tp);
  const ActTerms act = activation_terms(m, c);
  for (int64_t b : c.batch) res.activation_bytes_device.push_back(sat_add(act.fixed, sat_mul(b, act.per_seq)));

  const bool cap = c.gpu_mem_bytes > 0;
  if (cap) {
    if (m.weights_bytes < 0) fail("capacity needs the weights' size: {} (pass --weights-bytes)", m.weights_note);
    res.budget_bytes_device = int64_t(std::floor(double(c.gpu_mem_bytes) * c.util));
  }
  for (int64_t ctx : c.ctx)
    for (size_t bi = 0; bi < c.batch.size(); ++bi)
      for (const PlanFormatCost& f : res.formats) {
        PlanRow row;
        row.ctx = ctx;
        row.batch = c.batch[bi];
        row.format = f.name;
        row.kv_bytes = sat_mul(row.batch, plan_sequence_kv_bytes(m, f, c.page_tokens, ctx, false));
        row.kv_bytes_device = sat_mul(row.batch, plan_sequence_kv_bytes(m, f, c.page_tokens, ctx, true));
        if (row.kv_bytes == kSat) fail("{} tokens x batch {}: more than 2^63 bytes of KV", ctx, row.batch);
        row.activation_bytes_device = res.activation_bytes_device[bi];
        row.total_bytes_device = sat_add(sat_add(std::max<int64_t>(res.weights_bytes_device, 0), row.activation_bytes_device),
                                         row.kv_bytes_device);
        row.fits = !cap || row.total_bytes_device <= res.budget_bytes_device;
        res.rows.push_back(row);
      }

  if (cap) {
    // What is left for KV after weights; activations are subtracted per case below.
    const int64_t free0 = res.budget_bytes_device - res.weights_bytes_device;
    for (const PlanFormatCost& f : res.formats) {
      PlanCapacity pc;
      pc.format = f.name;
      const int64_t pool = free0 - (act.fixed + act.per_seq);
      pc.max_kv_tokens = pool > 0 ? (pool / f.page_bytes_device) * c.page_tokens : 0;
      for (int64_t ctx : c.ctx) {
        const int64_t per_seq = plan_sequence_kv_bytes(m, f, c.page_tokens, ctx, true) + act.per_seq;
        const int64_t avail = free0 - act.fixed;
        pc.max_sequences.push_back(avail > 0 ? avail / per_seq : 0);
      }
      for (int64_t b : c.batch) {
        const int64_t avail = free0 - act.fixed - sat_mul(b, act.per_seq);
        auto fits = [&](int64_t n) { return sat_mul(b, plan_sequence_kv_bytes(m, f, c.page_tokens, n, true)) <= avail; };
        if (avail < 0 || !fits(1)) {
          pc.max_context.push_back(int64_t(0));
        } else if (fits(kMaxContextSearch)) {
          pc.max_context.push_back(std::nullopt);
        } else {
          int64_t lo = 1, hi = kMaxContextSearch;  // fits(lo), !fits(hi)
          while (hi - lo > 1) {
            const int64_t mid = lo + (hi - lo) / 2;
            (fits(mid) ? lo : hi) = mid;
          }
          pc.max_context.push_back(lo);
        }
      }
      res.capacity.push_back(std::move(pc));
    }
  }
  return res;
}

// ---------------------------------------------------------------------------------------------
// Output

std::string plan_format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024 && u < 6) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return fmt::format("{} B", int64_t(std::llround(v)));
  // 3 significant digits; rounding up to 1000+ keeps 4 digits rather than switching units mid-table.
  if (std::fabs(v) >= 99.95) return fmt::format("{:.0f} {}", v, units[u]);
  if (std::fabs(v) >= 9.995) return fmt::format("{:.1f} {}", v, units[u]);
  return fmt::format("{:.2f} {}", v, units[u]);
}

namespace {

const char* kExplain =
    "Formulas (P = --page-tokens, tp = --tp, all sizes in bytes):\n"
    "  per-token bytes(format) = sum over layers l of n_kv_heads(l) x (K.block_bytes(P) + V.block_bytes(P)) / P\n"
    "      block_bytes: exact size of a codec's head block of P tokens, from the format registry;\n"
    "      it includes the codec's scales, zero points and norms (shown as overhead next to the codes);\n"
    "      layers named by --kv-cache-dtype-skip-layers use f16 codecs.\n"
    "  tokens(l, n) = n for full-attention layers, min(n, window) for sliding-window layers\n"
    "  KV(sequence of n tokens) = sum over l of ceil(tokens(l, n) / P) x page_bytes(l) + tail(l, n)\n"
    "      tail(l, n) (grouped codecs, e.g. KIVI: G tokens per group, R-token full-precision window)\n"
    "      = (t - G x floor(max(0, t - R) / G)) x n_kv_heads(l) x head_dim x 4 (f32), t = tokens(l, n)\n"
    "  KV(ctx, batch) = batch x KV(sequence of ctx tokens); per device: KV heads / tp\n"
    "      (with more devices than KV heads, each device holds one head)\n"
    "  weights per device = ceil(weights / tp); presets: params x --weights-bits / 8\n"
    "  activations per device (f32 estimate) = 4 x [batch x (w + h x P + n_vocab) + chunk x (w + h x P)]\n"
    "      w = 3 x n_embd + h x head_dim + 2 x kv_dim + 2 x n_ff (residual, normed copies, q, k, v, FFN gate+up)\n"
    "      h = query heads / tp, kv_dim = KV heads per device x head_dim, n_ff / tp; h x P = one page of scores\n"
    "      per head (online softmax); n_vocab = logits per sequence; chunk = --prefill-chunk tokens;\n"
    "      with experts n_ff is the used experts' widths and the shared expert's, and w adds (2 x used + 1)\n"
    "      x n_embd + n_expert + 2 x used + 1 (the experts' gathered rows in and out, router scores, choices,\n"
    "      shared gate)\n"
    "  budget per device = floor(gpu_mem x util)\n"
    "  max KV tokens = floor((budget - weights/tp - activations(batch 1)) / page_bytes per device) x P\n"
    "      (counts every layer at the full-attention rate; sliding-window models fit more, see max context)\n"
    "  max sequences at ctx = floor((budget - weights/tp - activations(batch 0)) /\n"
    "                               (KV per device of one ctx-token sequence + activations per sequence))\n"
    "  max context at batch b = largest n with b x KV per device(n) + activations(b) <= budget - weights/tp\n";

std::string pad_right(const std::string& s, size_t w) { return s.size() >= w ? s : s + std::string(w - s.size(), ' '); }
std::string pad_left(const std::string& s, size_t w) { return s.size() >= w ? s : std::string(w - s.size(), ' ') + s; }

// Aligned table: first column left-aligned, the rest right-aligned.
void print_table(std::FILE* out, const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w;
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); ++i) {
      if (w.size() <= i) w.push_back(0);
      w[i] = std::max(w[i], r[i].size());
    }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      if (i) line += "  ";
      line += i == 0 ? pad_right(r[i], w[i]) : pad_left(r[i], w[i]);
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::fprintf(out, "%s\n", line.c_str());
  }
}

nlohmann::json number_json(double v) {
  double r = std::round(v);
  if (std::fabs(v - r) < 1e-9 && std::fabs(r) < 9e15) return nlohmann::json(int64_t(r));
  return nlohmann::json(v);
}

std::string model_shape_line(const PlanModel& m) {
  int n_local = 0;
  int64_t window = 0;
  std::set<int> kvh;
  for (const PlanLayer& l : m.layers) {
    kvh.insert(l.n_kv_heads);
    if (l.window > 0) {
      ++n_local;
      window = std::max(window, l.window);
    }
  }
  std::string kv;
  if (kvh.size() == 1) kv = std::to_string(*kvh.begin());
  else kv = fmt::format("{}..{} (per layer)", *kvh.begin(), *kvh.rbegin());
  std::string s = fmt::format("{} layers, {} heads, {} KV heads, head_dim {}", m.n_layers, m.n_heads, kv,
                              m.layers.empty() ? m.head_dim : m.layers[0].head_dim_k);
  if (!m.layers.empty() && m.layers[0].head_dim_v != m.layers[0].head_dim_k) s += fmt::format("/{}", m.layers[0].head_dim_v);
  if (n_local) s += fmt::format(", {} sliding-window layers (window {}) + {} global", n_local, window, m.n_layers - n_local);
  if (m.ctx_train) s += fmt::format(", trained context {}", m.ctx_train);
  return s;
}

// How the KV heads are spread over tp devices, as kv_heads_per_device computes it, e.g.
// "8 KV heads / 2 = 4 per device" or "3 KV heads on 9 devices: 1 per device, each head replicated
// on 3 devices"; one clause per distinct head count of a model with per-layer counts.
std::string tp_kv_split_text(const PlanModel& m, int tp) {
  std::set<int> counts;
  for (const PlanLayer& l : m.layers) counts.insert(l.n_kv_heads);
  std::string s;
  for (int n : counts) {
    if (!s.empty()) s += "; ";
    const int per = kv_heads_per_device(n, tp);
    if (n % tp == 0)
      s += fmt::format("{} KV heads / {} = {} per device", n, tp, per);
    else
      s += fmt::format("{} KV head{} on {} devices: {} per device, each head replicated on {} devices", n,
                       n == 1 ? "" : "s", tp, per, tp / n);
  }
  return s;
}

nlohmann::json result_json(const PlanResult& r) {
  using nlohmann::json;
  const PlanModel& m = r.model;
  const PlanConfig& c = r.config;
  json j;
  json model = {{"name", m.name}, {"source", m.source}, {"arch", m.arch}, {"n_layers", m.n_layers},
                {"n_heads", m.n_heads}, {"head_dim", m.head_dim}, {"n_embd", m.n_embd}, {"n_ff", m.n_ff},
                {"n_vocab", m.n_vocab}, {"ctx_train", m.ctx_train}, {"n_params", m.n_params}};
  if (m.n_expert > 0) {
    model["n_expert"] = m.n_expert;
    model["n_expert_used"] = m.n_expert_used;
    model["n_params_active"] = m.n_params_active > 0 ? nlohmann::json(m.n_params_active) : nlohmann::json(nullptr);
  }
  json layers = json::array();
  for (const PlanLayer& l : m.layers)
    layers.push_back({{"n_kv_heads", l.n_kv_heads}, {"head_dim_k", l.head_dim_k}, {"head_dim_v", l.head_dim_v}, {"window", l.window}});
  model["layers"] = layers;
  model["notes"] = m.notes;
  j["model"] = model;
  j["page_tokens"] = c.page_tokens;
  j["tp"] = c.tp;
  j["skip_layers"] = c.skip_layers;
  j["weights_bytes"] = m.weights_bytes >= 0 ? json(m.weights_bytes) : json(nullptr);
  j["weights_bytes_per_device"] = r.weights_bytes_device >= 0 ? json(r.weights_bytes_device) : json(nullptr);
  j["weights_note"] = m.weights_note;
  json act = json::object();
  for (size_t i = 0; i < c.batch.size(); ++i) act[std::to_string(c.batch[i])] = r.activation_bytes_device[i];
  j["activation_bytes_per_device"] = act;
  j["prefill_chunk"] = c.prefill_chunk;
  json ptb = json::object(), fmts = json::array();
  for (const PlanFormatCost& f : r.formats) {
    ptb[f.name] = number_json(f.per_token_bytes);
    fmts.push_back({{"name", f.name}, {"k_codec", f.k_codec}, {"v_codec", f.v_codec},
                    {"per_token_bytes", number_json(f.per_token_bytes)},
                    {"code_bytes_per_token", number_json(f.code_bytes_per_token)},
                    {"overhead_bytes_per_token", number_json(f.overhead_bytes_per_token)},
                    {"page_bytes", f.page_bytes}, {"page_bytes_per_device", f.page_bytes_device},
                    {"residual_bytes_per_sequence_max", f.residual_bytes_max},
                    {"k_group_tokens", f.k_group}, {"k_residual_tokens", f.k_residual},
                    {"v_group_tokens", f.v_group}, {"v_residual_tokens", f.v_residual}});
  }
  j["per_token_bytes"] = ptb;
  j["skipped_formats"] = r.skipped_formats;
  j["formats"] = fmts;
  const bool cap = c.gpu_mem_bytes > 0;
  json rows = json::array();
  for (const PlanRow& row : r.rows) {
    json x = {{"ctx", row.ctx}, {"batch", row.batch}, {"format", row.format}, {"kv_bytes", row.kv_bytes},
              {"kv_bytes_per_device", row.kv_bytes_device},
              {"activation_bytes_per_device", row.activation_bytes_device},
              {"total_bytes_per_device", row.total_bytes_device}};
    if (cap) x["fits"] = row.fits;
    rows.push_back(x);
  }
  j["rows"] = rows;
  if (cap) {
    json capj = {{"gpu_mem_bytes", c.gpu_mem_bytes}, {"util", c.util}, {"budget_bytes_per_device", r.budget_bytes_device},
                 {"kv_pool_bytes_per_device",
                  std::max<int64_t>(0, r.budget_bytes_device - r.weights_bytes_device - plan_activation_bytes(m, c, 1))}};
    json per = json::object();
    for (const PlanCapacity& pc : r.capacity) {
      json seqs = json::object(), ctxs = json::object();
      for (size_t i = 0; i < c.ctx.size(); ++i) seqs[std::to_string(c.ctx[i])] = pc.max_sequences[i];
      for (size_t i = 0; i < c.batch.size(); ++i)
        ctxs[std::to_string(c.batch[i])] = pc.max_context[i] ? json(*pc.max_context[i]) : json(nullptr);
      per[pc.format] = {{"max_kv_tokens", pc.max_kv_tokens}, {"max_sequences", seqs}, {"max_context", ctxs}};
    }
    capj["formats"] = per;
    j["capacity"] = capj;
  }
  return j;
}

void print_csv(std::FILE* out, const PlanResult& r) {
  const bool cap = r.config.gpu_mem_bytes > 0;
  std::fprintf(out, "format,ctx,batch,per_token_bytes,kv_bytes,kv_bytes_per_device,activation_bytes_per_device,total_bytes_per_device%s\n",
               cap ? ",fits" : "");
  for (const PlanRow& row : r.rows) {
    double ptb = 0;
    for (const PlanFormatCost& f : r.formats)
      if (f.name == row.format) ptb = f.per_token_bytes;
    std::string p = number_json(ptb).dump();
    std::fprintf(out, "%s,%lld,%lld,%s,%lld,%lld,%lld,%lld%s\n", row.format.c_str(), (long long)row.ctx,
                 (long long)row.batch, p.c_str(), (long long)row.kv_bytes, (long long)row.kv_bytes_device,
                 (long long)row.activation_bytes_device, (long long)row.total_bytes_device,
                 cap ? (row.fits ? ",1" : ",0") : "");
  }
}

void print_text(std::FILE* out, const PlanResult& r, bool explain) {
  const PlanModel& m = r.model;
  const PlanConfig& c = r.config;
  std::fprintf(out, "model: %s (%s)\n  %s\n", m.name.c_str(), m.source.c_str(), model_shape_line(m).c_str());
  for (const std::string& n : m.notes) std::fprintf(out, "  note: %s\n", n.c_str());
  if (m.weights_bytes >= 0)
    std::fprintf(out, "weights: %s B (%s): %s\n", group_digits(m.weights_bytes).c_str(),
                 plan_format_bytes(double(m.weights_bytes)).c_str(), m.weights_note.c_str());
  else
    std::fprintf(out, "weights: %s\n", m.weights_note.c_str());
  std::string skip;
  for (int il : c.skip_layers) skip += (skip.empty() ? "" : ",") + std::to_string(il);
  std::fprintf(out, "page: %d tokens; tensor parallel: %d%s%s\n", c.page_tokens, c.tp,
               skip.empty() ? "" : "; layers kept in f16: ", skip.c_str());
  for (const std::string& sk : r.skipped_formats) std::fprintf(out, "  skipped: %s\n", sk.c_str());
  if (explain) std::fprintf(out, "\n%s", kExplain);

  // Per-token cost.
  std::fprintf(out, "\nKV bytes per token (all layers, K+V, every layer at full attention):\n");
  double f16_rate = 0;
  for (const PlanFormatCost& f : r.formats)
    if (f.name == "f16") f16_rate = f.per_token_bytes;
  if (f16_rate == 0 && !r.formats.empty()) {
    PlanConfig plain = c;
    plain.skip_layers.clear();
    f16_rate = plan_format_cost(m, plain, "f16").per_token_bytes;
  }
  std::vector<std::vector<std::string>> t;
  t.push_back({"format", "K codec", "V codec", "codes", "scale/zero/norm", "total", f16_rate > 0 ? "vs f16" : "", "fp tail/seq (max)"});
  for (const PlanFormatCost& f : r.formats) {
    std::string tail = "-";
    if (f.residual_bytes_max)
      tail = fmt::format("{} (G={}, R={})", plan_format_bytes(double(f.residual_bytes_max)),
                         std::max(f.k_group, f.v_group), std::max(f.k_residual, f.v_residual));
    t.push_back({f.name, f.k_codec, f.v_codec, format_per_token(f.code_bytes_per_token),
                 format_per_token(f.overhead_bytes_per_token), format_per_token(f.per_token_bytes),
                 f16_rate > 0 ? fmt::format("{:.3f}x", f.per_token_bytes / f16_rate) : "", tail});
  }
  print_table(out, t);

  // KV size table.
  // Formats down, ctx x batch across: many formats stay readable, the columns stay few.
  std::fprintf(out, "\nKV cache size, whole model (columns: ctx x batch):\n");
  const size_t nf = r.formats.size();
  const size_t ncol = r.rows.size() / std::max<size_t>(nf, 1);  // rows are ctx-major, then batch, then format
  auto grid = [&](auto cell) {
    std::vector<std::vector<std::string>> g;
    std::vector<std::string> head{"format"};
    for (size_t j = 0; j < ncol; ++j)
      head.push_back(format_count(r.rows[j * nf].ctx) + " x " + std::to_string(r.rows[j * nf].batch));
    g.push_back(head);
    for (size_t k = 0; k < nf; ++k) {
      std::vector<std::string> line{r.formats[k].name};
      for (size_t j = 0; j < ncol; ++j) line.push_back(cell(r.rows[j * nf + k]));
      g.push_back(line);
    }
    print_table(out, g);
  };
  grid([](const PlanRow& row) { return plan_format_bytes(double(row.kv_bytes)); });

  // The split on one device.
  const bool cap = c.gpu_mem_bytes > 0;
  std::fprintf(out, "\nMemory per device: weights %s, activations (estimate) ",
               r.weights_bytes_device >= 0 ? plan_format_bytes(double(r.weights_bytes_device)).c_str() : "unknown");
  for (size_t i = 0; i < c.batch.size(); ++i)
    std::fprintf(out, "%s%s at batch %lld", i ? ", " : "", plan_format_bytes(double(r.activation_bytes_device[i])).c_str(),
                 (long long)c.batch[i]);
  std::fprintf(out, "\n");
  if (cap)
    std::fprintf(out, "budget per device: %s x %.2f = %s\n", plan_format_bytes(double(c.gpu_mem_bytes)).c_str(), c.util,
                 plan_format_bytes(double(r.budget_bytes_device)).c_str());
  if (c.tp > 1) {
    std::fprintf(out, "KV per device (%s):\n", tp_kv_split_text(m, c.tp).c_str());
    grid([](const PlanRow& row) { return plan_format_bytes(double(row.kv_bytes_device)); });
  }
  if (r.weights_bytes_device >= 0) {
    std::fprintf(out, "total per device = weights + activations + KV%s:\n", cap ? " ('!' = over budget)" : "");
    grid([cap](const PlanRow& row) {
      return plan_format_bytes(double(row.total_bytes_device)) + (cap ? (row.fits ? "  " : " !") : "");
    });
  }

  if (cap) {
    std::fprintf(out, "\nCapacity per device:\n");
    const int64_t act1 = plan_activation_bytes(m, c, 1);
    if (r.budget_bytes_device - r.weights_bytes_device - act1 <= 0)
      std::fprintf(out, "  weights (%s) + activations (%s) exceed the budget (%s): no KV fits; try a larger --tp or fewer --weights-bits\n",
                   plan_format_bytes(double(r.weights_bytes_device)).c_str(), plan_format_bytes(double(act1)).c_str(),
                   plan_format_bytes(double(r.budget_bytes_device)).c_str());
    t.clear();
    std::vector<std::string> h{"format", "max KV tokens"};
    for (int64_t ctx : c.ctx) h.push_back("seqs@" + format_count(ctx));
    for (int64_t b : c.batch) h.push_back("ctx@b=" + std::to_string(b));
    t.push_back(h);
    for (const PlanCapacity& pc : r.capacity) {
      std::vector<std::string> line{pc.format, group_digits(pc.max_kv_tokens)};
      for (int64_t s : pc.max_sequences) line.push_back(group_digits(s));
      for (const auto& mc : pc.max_context) line.push_back(mc ? group_digits(*mc) : "unbounded");
      t.push_back(line);
    }
    print_table(out, t);
    if (m.ctx_train) std::fprintf(out, "(max context is the memory limit; the model was trained to %lld tokens)\n", (long long)m.ctx_train);
  }
}

void print_presets(std::FILE* out, bool json) {
  if (json) {
    nlohmann::json a = nlohmann::json::array();
    for (const PlanPreset& p : plan_presets())
      a.push_back({{"name", p.name}, {"hf_name", p.hf_name}, {"n_layers", p.n_layers}, {"n_heads", p.n_heads},
                   {"n_kv_heads", p.n_kv_heads}, {"head_dim", p.head_dim}, {"n_embd", p.n_embd}, {"n_ff", p.n_ff},
                   {"n_vocab", p.n_vocab}, {"ctx_train", p.ctx_train}, {"sliding_window", p.window},
                   {"sliding_window_pattern", p.swa_pattern}, {"n_params", plan_params(p)}});
    std::fprintf(out, "%s\n", a.dump(2).c_str());
    return;
  }
  std::vector<std::vector<std::string>> t;
  t.push_back({"preset", "layers", "heads", "KV heads", "head_dim", "n_embd", "n_ff", "vocab", "context", "sliding window", "params", "shapes from"});
  for (const PlanPreset& p : plan_presets()) {
    std::string sw = "-";
    if (p.swa_pattern == 1) sw = fmt::format("{} (all layers)", p.window);
    else if (p.swa_pattern > 1) sw = fmt::format("{} ({}:1 local:global)", p.window, p.swa_pattern - 1);
    t.push_back({p.name, std::to_string(p.n_layers), std::to_string(p.n_heads), std::to_string(p.n_kv_heads),
                 std::to_string(p.head_dim), std::to_string(p.n_embd), std::to_string(p.n_ff), std::to_string(p.n_vocab),
                 std::to_string(p.ctx_train), sw, group_digits(plan_params(p)), p.hf_name});
  }
  print_table(out, t);
}

}  // namespace

void plan_add_cli(CLI::App& app, PlanOptions& o) {
  app.description("Memory planning: weights vs KV cache vs activations, capacity per KV format");
  app.add_option("-m,--model", o.model_path, "GGUF model (hyperparameters and tensor sizes; no tensor data is read)");
  app.add_option("--config", o.config_path, "Hugging Face config.json");
  app.add_option("--preset", o.preset, "built-in model (see --presets)");
  app.add_flag("--presets", o.list_presets, "list the built-in models with their shapes");
  app.add_option("--ctx", o.ctx, "context lengths, comma-separated (4096, 4K, 32k, 1M)")->capture_default_str();
  app.add_option("--batch", o.batch, "batch sizes (concurrent sequences), comma-separated")->capture_default_str();
  app.add_option("--kv", o.kv, "KV formats, comma-separated (KFMT/VFMT, FMT@gN; default: every registered format)");
  app.add_option("--kv-cache-dtype-skip-layers", o.skip_layers,
                 "layers kept in f16: first:N, last:N, sliding_window, layer indices (comma-separated)");
  app.add_option_function<double>("--gpu-mem", [&o](const double& v) { o.gpu_mem_gib = v; },
                                  "memory per device in GiB (enables capacity figures)");
  app.add_option("--tp", o.tp, "tensor-parallel devices (KV heads and weights split across them)")->capture_default_str();
  app.add_option("--util", o.util, "fraction of device memory the engine may use")->capture_default_str();
  app.add_option("--weights-bytes", o.weights_bytes, "weights size override (bytes; K/M/G/T suffixes = binary multiples)");
  app.add_option_function<double>("--weights-bits", [&o](const double& v) { o.weights_bits = v; },
                                  "bits per parameter for presets and config.json (default: 16 / torch_dtype)");
  app.add_option("--page-tokens", o.page_tokens, "tokens per KV page")->capture_default_str();
  app.add_option("--prefill-chunk", o.prefill_chunk, "tokens per prefill chunk (activation estimate)")->capture_default_str();
  app.add_flag("--json", o.json, "JSON output");
  app.add_flag("--csv", o.csv, "CSV output (one line per ctx, batch, format)");
  app.add_flag("--explain", o.explain, "print the formulas behind every figure");
  app.add_flag("--measure", o.measure, "run the engine (-m) at the --ctx lengths and compare measured memory with the plan");
  rope_flags_add(app, o.rope);
}

int plan_command(const PlanOptions& o, std::FILE* out, std::FILE* err) {
  try {
    if (o.json && o.csv) fail("--json and --csv are exclusive");
    if (o.list_presets) {
      print_presets(out, o.json);
      return 0;
    }
    const int n_sources = int(!o.model_path.empty()) + int(!o.config_path.empty()) + int(!o.preset.empty());
    if (n_sources != 1)
      fail("give exactly one model: -m MODEL.gguf, --config config.json or --preset NAME (`--presets` lists them)");
    if (o.weights_bits && (!(*o.weights_bits > 0) || *o.weights_bits > 64))
      fail("--weights-bits {}: must be in (0, 64]", *o.weights_bits);
    if (o.rope.any() && o.model_path.empty())
      fail("--rope-scaling and the --yarn-* flags apply to a GGUF model (-m); a config.json says its own rope_scaling");
    PlanModel m;
    if (!o.preset.empty()) {
      m = plan_model_from_preset(o.preset, o.weights_bits.value_or(16.0));
    } else if (!o.config_path.empty()) {
      m = plan_model_from_hf_config_path(o.config_path, o.weights_bits);
    } else {
      if (o.weights_bits)
        fail("--weights-bits applies to presets and config.json; a GGUF's weights are its tensor sizes (override with --weights-bytes)");
      m = plan_model_from_gguf_path(o.model_path);
      if (o.rope.any()) {  // the context the RoPE flags give the model, as the engine runs it
        const std::unique_ptr<gguf::File> f = gguf::File::open(o.model_path);
        if (!model_arch_supported(f->get_string("general.architecture").value_or("")))
          fail("--rope-scaling and the --yarn-* flags apply to models kvq runs ({})", model_arch_list());
        ModelConfig mc = model_config_from_gguf(*f);
        model_config_apply_rope(mc, o.rope);
        m.ctx_train = mc.n_ctx_train;
        if (const std::string n = model_rope_scaling_note(mc); !n.empty())
          m.notes.push_back(fmt::format("{}: context {}", n, mc.n_ctx_train));
      }
    }
    if (!o.weights_bytes.empty()) {
      m.weights_bytes = plan_parse_bytes(o.weights_bytes, "--weights-bytes");
      m.weights_note = "--weights-bytes";
    }
    if (std::any_of(m.layers.begin(), m.layers.end(), [](const PlanLayer& l) { return l.window > 0; }))
      m.notes.push_back(
          "sliding-window layers are counted at their window, as vLLM and llama.cpp store them and as kvq stores them "
          "(kvq run, eval and calibrate, and the serving pool of kvq serve and kvq bench, whose sliding layers' "
          "pages are freed behind the window; a prompt step adds its own tokens to the window while it runs)");
    PlanConfig c;
    c.ctx = plan_parse_count_list(o.ctx, "--ctx");
    c.batch = plan_parse_count_list(o.batch, "--batch");
    if (!trim(o.kv).empty())
      for (const std::string& f : split_list(o.kv)) {
        if (f.empty()) fail("--kv: empty format name in '{}'", o.kv);
        c.formats.push_back(f);
      }
    c.skip_layers = plan_parse_skip_layers(o.skip_layers, m);
    c.page_tokens = o.page_tokens;
    c.tp = o.tp;
    c.util = o.util;
    c.prefill_chunk = o.prefill_chunk;
    if (o.gpu_mem_gib) {
      if (!(*o.gpu_mem_gib > 0) || *o.gpu_mem_gib > kMaxGpuMemGiB)
        fail("--gpu-mem {}: must be a number of GiB per device above 0 and at most {:.0f}", *o.gpu_mem_gib, kMaxGpuMemGiB);
      c.gpu_mem_bytes = int64_t(std::llround(*o.gpu_mem_gib * kGiB));
      if (c.gpu_mem_bytes <= 0) fail("--gpu-mem {}: too small", *o.gpu_mem_gib);
    }
    if (o.measure) {
      validate_config(c);
      return plan_measure(o, m, c, out);
    }
    PlanResult r = plan_compute(m, c);
    if (o.json) {
      nlohmann::json j = result_json(r);
      if (o.explain) j["explain"] = kExplain;
      std::fprintf(out, "%s\n", j.dump(2).c_str());
    } else if (o.csv) {
      if (o.explain) std::fprintf(err, "%s", kExplain);
      print_csv(out, r);
    } else {
      print_text(out, r, o.explain);
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(err, "kvq plan: %s\n", e.what());
    return 1;
  }
}

}  // namespace kvq
