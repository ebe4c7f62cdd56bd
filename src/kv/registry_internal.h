// Registration hooks for KV codecs and formats (library-internal). Each format family defines a
// `kv_register_<family>()` function that calls kv_register_codec / kv_register_format; registry.cpp
// calls every family's hook once, on first use (explicit calls, because a static library drops
// object files that nothing references).
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "kvq/kv_format.h"

namespace kvq {

struct KvCodecEntry {
  std::string name;         // e.g. "int4_g32", "tq3.5", "kivi2_k"
  std::string description;  // one line
  // Throws kvq::Error on invalid parameters (message lists what is valid).
  std::function<std::unique_ptr<KvCodec>(const KvCodecParams&)> make;
};

void kv_register_codec(KvCodecEntry e);
void kv_register_format(KvFormatDesc d);

// The per-group codecs' (int4_gN, int2_gN, int4t_gN, int2t_gN) parameter check: unless group
// divides head_dim, throws kvq::Error naming codec `name` and listing the group sizes (32, 64, 128)
// that do. (head_dim itself is checked by kv_codec_create: at most kv_max_head_dim.)
void kv_check_group_size(const std::string& name, int group, int head_dim);

}  // namespace kvq
