// llama.cpp's KV cache types q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl (blocks of 32 along head_dim,
// f16 scale; layouts kv_block_* in kv_rows.h), quantized by ggml's reference formulas so codes are
// bit-comparable: every type `llama-cli -ctk / -ctv` takes besides the float ones.
#include "core/error.h"
#include "kv/registry_internal.h"
#include "kv/row_codec.h"

namespace kvq {

namespace {
void add(const char* name, KvElem e, const char* what) {
  kv_register_codec({name, what, [name, e](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       if (p.head_dim % 32 != 0)
                         fail("KV codec '{}' stores blocks of 32 along head_dim; head_dim {} is not a multiple of 32",
                              name, p.head_dim);
                       return std::make_unique<KvRowCodec>(name, kv_row_fmt(e, p.head_dim), p.n_kv_heads);
                     }});
}
}  // namespace

void kv_register_ggml_codecs() {
  add("q8_0", KvElem::q8_0, "llama.cpp q8_0: 32 int8 + f16 absmax/127 scale per block");
  add("q4_0", KvElem::q4_0, "llama.cpp q4_0: 32 4-bit codes + f16 scale per block");
  // "q8_0" / "q4_0" store q8_0t / q4_0t's tiles (kv/int8_tiled.h, kv/int4_tiled.h): their
  // quantization, bytes and decode with integer-dot attention kernels; "q8_0_rows" / "q4_0_rows"
  // keep llama.cpp's row layout itself.
  kv_register_format({"q8_0", {"ggml_q8_0", "llama_q8_0"}, "q8_0t", "q8_0t",
                      "llama.cpp q8_0 (-ctk/-ctv q8_0) in 16-token tiles: 8.5 bits"});
  kv_register_format({"q8_0_rows", {}, "q8_0", "q8_0", "llama.cpp q8_0 in its own row layout: 8.5 bits"});
  kv_register_format({"q4_0", {"ggml_q4_0", "llama_q4_0"}, "q4_0t", "q4_0t",
                      "llama.cpp q4_0 (-ctk/-ctv q4_0) in 16-token tiles: 4.5 bits"});
  kv_register_format({"q4_0_rows", {}, "q4_0", "q4_0", "llama.cpp q4_0 in its own row layout: 4.5 bits"});
  add("q4_1", KvElem::q4_1, "llama.cpp q4_1: 32 4-bit codes + f16 scale and min per block");
  add("q5_0", KvElem::q5_0, "llama.cpp q5_0: 32 5-bit codes + f16 scale per block");
  add("q5_1", KvElem::q5_1, "llama.cpp q5_1: 32 5-bit codes + f16 scale and min per block");
  add("iq4_nl", KvElem::iq4_nl, "llama.cpp iq4_nl: 32 4-bit indices into a non-uniform grid + f16 scale per block");
  // "q4_1", "q5_0", "q5_1" and "iq4_nl" store their tiles (q4_1t .. iq4_nlt: kv/int4_tiled.h), as
  // "q4_0" does.
  kv_register_format({"q4_1", {"ggml_q4_1", "llama_q4_1"}, "q4_1t", "q4_1t",
                      "llama.cpp q4_1 (-ctk/-ctv q4_1) in 16-token tiles: min + scale per 32, 5 bits"});
  kv_register_format({"q4_1_rows", {}, "q4_1", "q4_1", "llama.cpp q4_1 in its own row layout: 5 bits"});
  kv_register_format({"q5_0", {"ggml_q5_0", "llama_q5_0"}, "q5_0t", "q5_0t",
                      "llama.cpp q5_0 (-ctk/-ctv q5_0) in 16-token tiles: 5-bit codes, scale per 32, 5.5 bits"});
  kv_register_format({"q5_0_rows", {}, "q5_0", "q5_0", "llama.cpp q5_0 in its own row layout: 5.5 bits"});
  kv_register_format({"q5_1", {"ggml_q5_1", "llama_q5_1"}, "q5_1t", "q5_1t",
                      "llama.cpp q5_1 (-ctk/-ctv q5_1) in 16-token tiles: 5-bit codes, min + scale per 32, 6 bits"});
  kv_register_format({"q5_1_rows", {}, "q5_1", "q5_1", "llama.cpp q5_1 in its own row layout: 6 bits"});
  kv_register_format({"iq4_nl", {"ggml_iq4_nl", "llama_iq4_nl"}, "iq4_nlt", "iq4_nlt",
                      "llama.cpp iq4_nl (-ctk/-ctv iq4_nl) in 16-token tiles: non-uniform 4-bit grid, scale per 32, "
                      "4.5 bits"});
  kv_register_format({"iq4_nl_rows", {}, "iq4_nl", "iq4_nl", "llama.cpp iq4_nl in its own row layout: 4.5 bits"});
}

// Formats whose K and V use different codecs (keys are the more sensitive half: outlier channels
// and softmax amplification, so K gets the bits).
// The 4- and 2-bit halves are the tiled codecs (the same quantization and bytes as int4_g64 /
// int2_g32 / q4_0 rows, integer-dot kernels).
void kv_register_mixed_formats() {
  kv_register_format({"k8v4", {"int8_int4"}, "int8", "int4t_g64", "K int8 per token, V int4 g64: ~6.4 bits"});
  kv_register_format({"k8v2", {"int8_int2"}, "int8", "int2t_g32", "K int8 per token, V int2 g32: ~5.6 bits"});
  kv_register_format({"k4v2", {"int4_int2"}, "int4t_g64", "int2t_g32", "K int4 g64, V int2 g32: 3.75 bits"});
  kv_register_format({"kfp8v4", {"fp8_int4"}, "fp8_e4m3", "int4t_g64", "K FP8 E4M3, V int4 g64: 6.25 bits"});
  kv_register_format({"q8_0_q4_0", {"kq8_0_vq4_0"}, "q8_0t", "q4_0t",
                      "llama.cpp -ctk q8_0 -ctv q4_0: 6.5 bits"});
}

}  // namespace kvq
