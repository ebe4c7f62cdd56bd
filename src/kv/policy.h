// KV policy: which codec each layer's K and V use. Built from a format name (uniform), layers
// kept in f16 (skip rules), and per-layer overrides; the cache and the planner read it, the model
// code never does.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

struct KvLayerFormat {
  std::string k_codec;
  std::string v_codec;
};

struct KvPolicy {
  std::string name;                   // what the user asked for, for reports
  std::vector<KvLayerFormat> layers;  // one per model layer
};

// Every layer uses format `format` (a registry name or alias). Throws kvq::Error if unknown.
KvPolicy kv_policy_uniform(const std::string& format, int n_layer);

// "first:2,last:2,sliding_window,5" -> sorted unique layer indices (vLLM's
// --kv-cache-dtype-skip-layers). `sliding` marks sliding-window layers (may be empty: none).
// Throws kvq::Error on malformed items or indices out of range.
std::vector<int> kv_parse_skip_layers(std::string_view spec, int n_layer, const std::vector<bool>& sliding);

// Keeps the given layers in f16 (K and V).
void kv_policy_skip_layers(KvPolicy& p, const std::vector<int>& layers);

// "L=KFMT/VFMT" (or "L=FMT" for both): layer L uses the K codec of format KFMT and the V codec of
// format VFMT; returns L. Throws kvq::Error on malformed specs, unknown formats, layers out of
// range (errors name the spec and the layer).
int kv_policy_override_layer(KvPolicy& p, std::string_view spec);

// Human-readable summary: the format name, plus the layers that differ from it.
std::string kv_policy_describe(const KvPolicy& p);

}  // namespace kvq
