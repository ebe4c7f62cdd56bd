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

}  // namespace kvq
