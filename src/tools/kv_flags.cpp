#include "tools/kv_flags.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <map>

#include "core/error.h"
#include "kvq/kv_format.h"
#include "tools/files.h"
#include "model/model.h"

namespace kvq {

void kv_flags_add(CLI::App& app, KvFlags& f) {
  app.add_option("--kv-cache-dtype,--kv", f.kv_cache_dtype,
                 "KV cache format for K and V (kvq formats lists them; vLLM names auto/fp8/fp8_e4m3/fp8_e5m2 work); "
                 "KFMT/VFMT splits K and V, FMT@gN sets a grouped format's token group (e.g. kvquant3@g128/tq2.5_s)")
      ->capture_default_str();
  app.add_option("--cache-type-k", f.cache_type_k,
                 "format of the K cache (also -ctk; llama.cpp spellings f16, q8_0, q4_0 work); replaces the K side "
                 "of --kv-cache-dtype")
      ->each([&f](const std::string&) { f.cache_type_k_given = true; });
  app.add_option("--cache-type-v", f.cache_type_v, "format of the V cache (also -ctv); replaces the V side of --kv-cache-dtype")
      ->each([&f](const std::string&) { f.cache_type_v_given = true; });
  app.add_option("--kv-cache-dtype-skip-layers", f.skip_layers,
                 "layers kept in f16: first:N, last:N, sliding_window, layer indices (comma-separated)");
  app.add_option("--kv-layer", f.layer_overrides, "per-layer override L=KFMT/VFMT (repeatable)");
  app.add_option("--kv-scales", f.scales_file,
                 "calibration JSON (kvq calibrate) with K/V scales and codebooks; 'qk-norm': the key channel "
                 "scales of the *_s formats from the model's QK-norm weights, without calibration");
  app.add_option("--kv-page-tokens", f.page_tokens, "tokens per KV page (power of two, 16..256)")->capture_default_str();
  app.add_option("--kv-group-tokens", f.group_tokens,
                 "grouped formats (kivi*, kvquant*): tokens per quantization group G (default: the format's; "
                 "a name's @gN wins)");
  app.add_option("--kv-residual-tokens", f.residual_tokens,
                 "grouped formats: newest tokens kept in full precision R (default: the format's)");
  kv_flags_add_kvquant(app, f);
  rope_flags_add(app, f.rope);
}

void kv_flags_add_shared(CLI::App& app, KvFlags& f) {
  app.add_option("--kv-cache-dtype-skip-layers", f.skip_layers, "layers kept in f16 for every format");
  app.add_option("--kv-layer", f.layer_overrides, "per-layer override L=KFMT/VFMT (repeatable)");
  app.add_option("--kv-scales", f.scales_file,
                 "calibration JSON (kvq calibrate), or 'qk-norm' (the *_s formats' key scales from the model's "
                 "QK-norm weights)");
  app.add_option("--kv-page-tokens", f.page_tokens, "tokens per KV page")->capture_default_str();
  app.add_option("--kv-group-tokens", f.group_tokens,
                 "grouped formats (kivi*, kvquant*): tokens per group G (a format name's @gN wins)");
  app.add_option("--kv-residual-tokens", f.residual_tokens, "grouped formats: newest tokens kept in full precision R");
  kv_flags_add_kvquant(app, f);
  rope_flags_add(app, f.rope);
}

void rope_flags_add(CLI::App& app, RopeOverrides& r) {
  app.add_option("--rope-scaling", r.scaling,
                 "RoPE scaling in place of the model file's: none, linear, yarn (e.g. Qwen3 past 32K: --rope-scaling "
                 "yarn --rope-scale 4 --yarn-orig-ctx 32768)");
  app.add_option("--rope-scale", r.scale,
                 "RoPE scaling factor in place of the file's (context / original context); sets the model's context "
                 "to the original x this for YaRN")
      ->check(CLI::PositiveNumber);
  app.add_option("--yarn-orig-ctx", r.yarn_orig_ctx, "YaRN: the context the model was trained at (default: the file's)")
      ->check(CLI::PositiveNumber);
  app.add_option("--yarn-beta-fast", r.yarn_beta_fast, "YaRN: turns over the original context above which a pair keeps "
                 "its trained rate (default: the file's, else 32)")
      ->check(CLI::PositiveNumber);
  app.add_option("--yarn-beta-slow", r.yarn_beta_slow, "YaRN: turns below which a pair is fully interpolated (default: "
                 "the file's, else 1)")
      ->check(CLI::PositiveNumber);
}

void kv_flags_add_kvquant(CLI::App& app, KvFlags& f) {
  app.add_option("--kv-outliers", f.outlier_fraction,
                 "kvquant* keys: share of each key vector kept exact as dense-and-sparse outliers, 0..0.125 "
                 "(default 0.01)");
  app.add_option("--kv-sink-tokens", f.sink_tokens,
                 "kvquant* keys: first positions of the sequence kept exact (attention sink; default 1)");
}

nlohmann::json kv_qk_norm_calib(const Model& m) {
  const ModelConfig& c = m.config();
  if (!c.qk_norm)
    fail("--kv-scales qk-norm: the model ({}) has no QK-norm weights (attn_q_norm / attn_k_norm) to take key "
         "scales from; calibrate instead: kvq calibrate -m MODEL --data TEXT -o calib.json, then --kv-scales calib.json",
         c.name.empty() ? c.arch : c.name);
  if (c.qk_norm_full)
    fail("--kv-scales qk-norm: the model ({}) normalizes q and k over all heads at once, so its norm weights do not "
         "give each head's key scale; calibrate instead: kvq calibrate -m MODEL --data TEXT -o calib.json, then "
         "--kv-scales calib.json", c.name.empty() ? c.arch : c.name);
  nlohmann::json layers = nlohmann::json::array();
  for (int il = 0; il < c.n_layer; ++il) {
    const LayerWeights& L = m.layer(il);
    auto abs_row = [&](const WeightView& w) {
      const float* x = static_cast<const float*>(w.data);
      std::vector<float> r(size_t(c.head_dim));
      for (int i = 0; i < c.head_dim; ++i) r[size_t(i)] = std::fabs(x[i]);
      return nlohmann::json(std::vector<std::vector<float>>(size_t(c.n_head_kv), r));
    };
    layers.push_back({{"layer", il}, {"k_rms", abs_row(L.attn_k_norm)}, {"q_rms", abs_row(L.attn_q_norm)}});
  }
  return {{"source", "qk-norm"}, {"model", c.name}, {"layers", std::move(layers)}};
}

namespace {

// The policy of --kv-cache-dtype (or eval's `format`) with -ctk / -ctv replacing its K or V side.
// A side keeps its own "@gN"; each is resolved as a whole format (its K or V codec is used).
KvPolicy resolve_formats(const KvFlags& f, const std::string& format, int n_layer) {
  const std::string kv = format.empty() ? f.kv_cache_dtype : format;
  const char* valid = "valid: a name or alias that `kvq formats` lists, e.g. f16, q8_0, q4_0";
  if (kv.empty()) fail("--kv-cache-dtype: the format name is empty ({})", valid);
  if (f.cache_type_k_given && f.cache_type_k.empty()) fail("--cache-type-k (-ctk): the format name is empty ({})", valid);
  if (f.cache_type_v_given && f.cache_type_v.empty()) fail("--cache-type-v (-ctv): the format name is empty ({})", valid);
  if (f.cache_type_k.empty() && f.cache_type_v.empty()) return kv_policy_uniform(kv, n_layer);
  // Even when -ctk and -ctv replace both of its sides, a --kv-cache-dtype given is checked: a typo
  // there is not silently ignored.
  try {
    kv_policy_uniform(kv, n_layer);
  } catch (const Error& e) {
    fail("--kv-cache-dtype: {}", e.what());
  }
  for (const auto& [flag, side] : {std::pair{"--cache-type-k (-ctk)", &f.cache_type_k},
                                   std::pair{"--cache-type-v (-ctv)", &f.cache_type_v}})
    if (side->find('/') != std::string::npos)
      fail("{}: '{}' is a K/V split; the flag takes one format for its side (a split goes in --kv-cache-dtype "
           "KFMT/VFMT)",
           flag, *side);
  const size_t slash = kv.find('/');
  const std::string k_side = !f.cache_type_k.empty() ? f.cache_type_k : kv.substr(0, slash);
  const std::string v_side = !f.cache_type_v.empty() ? f.cache_type_v
                             : slash == std::string::npos ? kv
                                                          : kv.substr(slash + 1);
  auto side = [&](const std::string& name, bool from_flag, const char* flag) {
    try {
      return kv_policy_uniform(name, n_layer);
    } catch (const Error& e) {
      fail("{}: {}", from_flag ? flag : "--kv-cache-dtype", e.what());
    }
  };
  const KvPolicy k = side(k_side, !f.cache_type_k.empty(), "--cache-type-k (-ctk)");
  const KvPolicy v = side(v_side, !f.cache_type_v.empty(), "--cache-type-v (-ctv)");
  KvPolicy p;
  p.name = k.name == v.name ? k.name : "K:" + k.name + "/V:" + v.name;
  p.layers.assign(size_t(n_layer), KvLayerFormat{k.layers[0].k_codec, v.layers[0].v_codec});
  return p;
}

}  // namespace

KvSetup kv_flags_resolve(const KvFlags& f, const Model& m, const std::string& format) {
  const ModelConfig& cfg = m.config();
  KvSetup s;
  KvPolicy& p = s.policy;
  p = resolve_formats(f, format, cfg.n_layer);
  if (!f.skip_layers.empty()) {
    kv_policy_skip_layers(p, kv_parse_skip_layers(f.skip_layers, cfg.n_layer, cfg.layer_sliding));
    p.name += " skip(" + f.skip_layers + ")";
  }
  std::map<int, std::string> overridden;  // layer -> its --kv-layer spec
  for (const auto& o : f.layer_overrides) {
    const int il = kv_policy_override_layer(p, o);
    if (const auto [it, fresh] = overridden.emplace(il, o); !fresh)
      fail("--kv-layer: layer {} is given twice ('{}' and '{}'); give each layer once", il, it->second, o);
  }
  if (!overridden.empty()) {  // the name says which layers differ from the format it names
    std::string specs;
    for (const auto& [il, spec] : overridden) specs += (specs.empty() ? "" : ",") + spec;
    p.name += " layers(" + specs + ")";
  }
  if (f.scales_file == "qk-norm") {
    s.calib = std::make_shared<const nlohmann::json>(kv_qk_norm_calib(m));
  } else if (!f.scales_file.empty()) {
    const std::string text = read_text_file(f.scales_file, "--kv-scales");
    try {
      s.calib = std::make_shared<const nlohmann::json>(nlohmann::json::parse(text));
    } catch (const nlohmann::json::exception& e) {
      fail("--kv-scales '{}': malformed JSON (a calibration from kvq calibrate -o FILE, or qk-norm): {}",
           f.scales_file, e.what());
    }
    // A LongRoPE model calibrated with the other factor set: the statistics of the rotated key
    // channels were taken at other rates (attention stays right; the codecs rotate with the
    // running model's RoPE).
    const ModelConfig& mc = m.config();
    if (mc.has_long_rope && s.calib->is_object() && s.calib->contains("rope_factors") &&
        (*s.calib)["rope_factors"] != (mc.rope_long ? "long" : "short"))
      std::fprintf(stderr,
                   "[kvq] warning: --kv-scales '%s' was calibrated with the %s LongRoPE factors, the model runs with "
                   "the %s ones (calibrate at a --ctx on the same side of %d tokens)\n",
                   f.scales_file.c_str(), (*s.calib)["rope_factors"].dump().c_str(), mc.rope_long ? "long" : "short",
                   mc.n_ctx_orig);
    // Calibrated under another RoPE scaling (the file's or --rope-scaling's): the same. Calibrations
    // that do not say (made before kvq ran YaRN) were not made with YaRN.
    if (s.calib->is_object()) {
      const std::string want = model_rope_scaling_note(mc);
      const auto it = s.calib->find("rope_scaling");
      const bool said = it != s.calib->end() && it->is_string();
      const std::string got = said ? it->get<std::string>() : "";
      if (said ? got != want : mc.rope_yarn && mc.rope_scale != 1.f)
        std::fprintf(stderr, "[kvq] warning: --kv-scales '%s' was calibrated with %s, the model runs with %s\n",
                     f.scales_file.c_str(), got.empty() ? "no RoPE scaling" : got.c_str(),
                     want.empty() ? "none" : want.c_str());
    }
    // The formats read a layer's entry by its place in "layers": an entry that names another
    // layer would hand one layer's scales to another.
    if (s.calib->is_object() && s.calib->contains("layers") && (*s.calib)["layers"].is_array()) {
      const auto& layers = (*s.calib)["layers"];
      for (size_t i = 0; i < layers.size(); ++i) {
        const auto& e = layers[i];
        if (!e.is_object() || !e.contains("layer")) continue;
        if (!e["layer"].is_number_integer() || e["layer"].get<int64_t>() != int64_t(i))
          fail("--kv-scales '{}': entry {} of \"layers\" names layer {}; the entries must be in layer order, "
               "entry i for layer i (as kvq calibrate writes them)",
               f.scales_file, i, e["layer"].dump());
      }
    }
  }
  if (f.group_tokens < 0 || f.group_tokens == 1 || f.group_tokens > 1024)
    fail("--kv-group-tokens: {} is out of range (2..1024, as @gN; or 0 for the format's default)", f.group_tokens);
  if (f.residual_tokens < -1 || f.residual_tokens > (1 << 20))
    fail("--kv-residual-tokens: {} is out of range (0..1048576, or -1 for the format's default)", f.residual_tokens);
  if (f.outlier_fraction != -1 && !(f.outlier_fraction >= 0 && f.outlier_fraction <= 0.125))
    fail("--kv-outliers: {} is out of range (0..0.125, a share of head_dim)", f.outlier_fraction);
  if (f.sink_tokens < -1 || f.sink_tokens > 1024)
    fail("--kv-sink-tokens: {} is out of range (0..1024)", f.sink_tokens);
  s.group_tokens = f.group_tokens;
  s.residual_tokens = f.residual_tokens;
  s.outlier_fraction = f.outlier_fraction;
  s.sink_tokens = f.sink_tokens;
  // The overridden layers' codecs are built here, as the cache builds them, so that a format that
  // does not fit its layer (a group wider than head_dim, a calibration without the layer) is
  // reported with the --kv-layer that chose it.
  if (!overridden.empty()) {
    KvCacheConfig kc = m.kv_cache_config(p, 1, f.page_tokens);
    s.apply(kc);
    for (const auto& [il, spec] : overridden) {
      KvCodecParams cp = kv_cache_codec_params(kc, il);
      try {
        cp.role = KvRole::key;
        kv_codec_create(p.layers[size_t(il)].k_codec, cp);
        cp.role = KvRole::value;
        kv_codec_create(p.layers[size_t(il)].v_codec, cp);
      } catch (const Error& e) {
        fail("--kv-layer '{}' (layer {}): {}", spec, il, e.what());
      }
    }
  }
  return s;
}

void kv_flags_warn_unused(const KvFlags& f, const KvSetup& s, const Model& m) {
  if (!(f.group_tokens > 0 || f.residual_tokens >= 0 || f.outlier_fraction >= 0 || f.sink_tokens >= 0)) return;
  KvCacheConfig kc = m.kv_cache_config(s.policy, 1, f.page_tokens);
  s.apply(kc);
  bool grouped = false, kvquant = false;
  for (int il = 0; il < m.config().n_layer; ++il) {
    KvCodecParams cp = kv_cache_codec_params(kc, il);
    for (KvRole role : {KvRole::key, KvRole::value}) {
      cp.role = role;
      const KvLayerFormat& lf = s.policy.layers[size_t(il)];
      const auto codec = kv_codec_create(role == KvRole::key ? lf.k_codec : lf.v_codec, cp);
      grouped = grouped || codec->info().group_tokens > 1;
      kvquant = kvquant || codec->info().name.rfind("kvquant", 0) == 0;  // registry names: lower case
    }
  }
  std::string unused;
  if (!grouped && f.group_tokens > 0) unused += " --kv-group-tokens";
  if (!grouped && f.residual_tokens >= 0) unused += " --kv-residual-tokens";
  if (!kvquant && f.outlier_fraction >= 0) unused += " --kv-outliers";
  if (!kvquant && f.sink_tokens >= 0) unused += " --kv-sink-tokens";
  if (!unused.empty())
    std::fprintf(stderr,
                 "[kvq] warning:%s: no layer of '%s' reads it (grouped formats: kivi*, kvquant*; outliers and sink "
                 "tokens: kvquant*); ignored\n",
                 unused.c_str(), s.policy.name.c_str());
}

}  // namespace kvq
