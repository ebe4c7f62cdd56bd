// llama.cpp's KV cache types q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl (blocks of 32 along head_dim,
// f16 scale; layouts kv_block_* in kv_rows.h), quantized by ggml's reference formulas so codes are
// bit-comparable: every type `llama-cli -ctk / -ctv` takes besides the float ones.
#include <fmt/format.h>

#include "core/error.h"
#include "kv/registry_internal.h"
#include "kv/row_codec.h"

namespace kvq {

namespace {
void add(const std::string& name, KvElem e, const std::string& what) {
  kv_register_codec({name, what, [name, e](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       if (p.head_dim % 32 != 0)
                         fail("KV codec '{}' stores blocks of 32 along head_dim; head_dim {} is not a multiple of 32",
                              name, p.head_dim);
                       return std::make_unique<KvRowCodec>(name, kv_row_fmt(e, p.head_dim), p.n_kv_heads);
                     }});
}
}  // namespace

void kv_register_ggml_codecs() {
  // Each type: its row codec, the format of its name storing its 16-token tiles (q8_0t, q4_0t ..
  // iq4_nlt: kv/int8_tiled.h, kv/int4_tiled.h; the same quantization, bytes and decode with
  // integer-dot attention kernels), and "<type>_rows" keeping llama.cpp's row layout itself.
  struct Type {
    const char* name;
    KvElem elem;
    const char* block;  // what a block of 32 holds
    const char* tiles;  // the format's summary
    const char* bits;
  };
  for (const Type t : {
           Type{"q8_0", KvElem::q8_0, "32 int8 + f16 absmax/127 scale per block", "", "8.5"},
           Type{"q4_0", KvElem::q4_0, "32 4-bit codes + f16 scale per block", "", "4.5"},
           Type{"q4_1", KvElem::q4_1, "32 4-bit codes + f16 scale and min per block", "min + scale per 32, ", "5"},
           Type{"q5_0", KvElem::q5_0, "32 5-bit codes + f16 scale per block", "5-bit codes, scale per 32, ", "5.5"},
           Type{"q5_1", KvElem::q5_1, "32 5-bit codes + f16 scale and min per block",
                "5-bit codes, min + scale per 32, ", "6"},
           Type{"iq4_nl", KvElem::iq4_nl, "32 4-bit indices into a non-uniform grid + f16 scale per block",
                "non-uniform 4-bit grid, scale per 32, ", "4.5"},
       }) {
    const std::string name = t.name;
    add(t.name, t.elem, fmt::format("llama.cpp {}: {}", name, t.block));
    kv_register_format({name, {"ggml_" + name, "llama_" + name}, name + "t", name + "t",
                        fmt::format("llama.cpp {0} (-ctk/-ctv {0}) in 16-token tiles: {1}{2} bits", name, t.tiles,
                                    t.bits)});
    kv_register_format({name + "_rows", {}, name, name,
                        fmt::format("llama.cpp {} in its own row layout: {} bits", name, t.bits)});
  }
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
