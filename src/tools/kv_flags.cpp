#include "tools/kv_flags.h"

#include <CLI/CLI.hpp>

#include "kvq/kv_format.h"

namespace kvq {

void kv_flags_add(CLI::App& app, KvFlags& f) {
  app.add_option("--kv-cache-dtype,--kv", f.kv_cache_dtype,
                 "KV cache format for K and V (kvq formats lists them; vLLM names auto/fp8/fp8_e4m3/fp8_e5m2 work)")
      ->capture_default_str();
  app.add_option("--cache-type-k", f.cache_type_k, "format of the K cache (also -ctk; llama.cpp spellings f16, q8_0, q4_0 work)");
  app.add_option("--cache-type-v", f.cache_type_v, "format of the V cache (also -ctv)");
  app.add_option("--kv-page-tokens", f.page_tokens, "tokens per KV page (power of two, 16..256)")->capture_default_str();
}

KvPolicy kv_flags_policy(const KvFlags& f, int n_layer) {
  KvPolicy p = kv_policy_uniform(f.kv_cache_dtype, n_layer);
  if (!f.cache_type_k.empty() || !f.cache_type_v.empty()) {
    const std::string kname = f.cache_type_k.empty() ? p.name : kv_format_find(f.cache_type_k).name;
    const std::string vname = f.cache_type_v.empty() ? p.name : kv_format_find(f.cache_type_v).name;
    const KvFormatDesc& kd = kv_format_find(kname);
    const KvFormatDesc& vd = kv_format_find(vname);
    for (auto& l : p.layers) l = KvLayerFormat{kd.k_codec, vd.v_codec};
    p.name = kname == vname ? kname : "K:" + kname + "/V:" + vname;
  }
  return p;
}

}  // namespace kvq
