// The KV-cache flags shared by every subcommand that runs a model (run, eval, bench, serve):
// vLLM spellings (--kv-cache-dtype), llama.cpp spellings (-ctk/-ctv), kvq names.
#pragma once
#include <string>

#include "kv/policy.h"

namespace CLI { class App; }

namespace kvq {

struct KvFlags {
  std::string kv_cache_dtype = "f16";  // --kv-cache-dtype: format for K and V
  std::string cache_type_k;            // -ctk: K side (a format name; its K codec is used)
  std::string cache_type_v;            // -ctv: V side (a format name; its V codec is used)
  int page_tokens = 64;                // --kv-page-tokens
};

void kv_flags_add(CLI::App& app, KvFlags& f);
// Builds the per-layer policy; throws kvq::Error naming the bad flag and listing valid formats.
KvPolicy kv_flags_policy(const KvFlags& f, int n_layer);

}  // namespace kvq
