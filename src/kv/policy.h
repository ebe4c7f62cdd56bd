// KV policy: which codec each layer's K and V use. Built from a format name (uniform) and
// per-layer overrides; the cache and the planner read it, the model code never does.
#pragma once
#include <string>
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

}  // namespace kvq
