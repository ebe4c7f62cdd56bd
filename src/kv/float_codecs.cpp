// Unquantized formats: f32, f16, bf16 (plain rows).
#include "kv/registry_internal.h"
#include "kv/row_codec.h"

namespace kvq {

namespace {
void add(const char* name, KvElem e, const char* what) {
  kv_register_codec({name, what, [name, e](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       return std::make_unique<KvRowCodec>(name, kv_row_fmt(e, p.head_dim), p.n_kv_heads);
                     }});
}
}  // namespace

void kv_register_float_codecs() {
  add("f32", KvElem::f32, "IEEE f32 (reference)");
  add("f16", KvElem::f16, "IEEE f16, round to nearest even");
  add("bf16", KvElem::bf16, "bfloat16, round to nearest even");
  kv_register_format({"f32", {"fp32", "float32"}, "f32", "f32", "unquantized f32 (32 bits)"});
  kv_register_format({"f16", {"auto", "fp16", "half", "float16"}, "f16", "f16",
                      "unquantized f16 (16 bits): the baseline"});
  kv_register_format({"bf16", {"bfloat16"}, "bf16", "bf16", "unquantized bfloat16 (16 bits)"});
}

}  // namespace kvq
