// Integer codecs quantized per token at write time:
//  int8:        symmetric, scale absmax/127 per (token, head) as f32 (KvRowScaled):
//               8 + 32/head_dim bits; stored in int8t's 16-token tiles (kv/int8_tiled.h, the same
//               bytes and decode, integer-dot kernels) when head_dim % 32 == 0, else in rows
//               ("int8_rows": always rows).
//  int8_static: symmetric with calibrated per-tensor/per-head scales (kv/calib.h), no per-token
//               scale: 8 bits; it shows the scale reuse trap when the range grows past calibration.
//  int4_g{32,64,128}, int2_g{32,64,128}: asymmetric min/max per group of g elements along
//               head_dim, f16 scale and minimum per group: b + 32/g bits. Format "int2" is
//               int2t_g32 (kv/int2_tiled.h): int2_g32's quantization (3 bits: at 2 bits only small
//               groups keep the error tolerable) in the tiled layout; "int4" is int4t_g64
//               (kv/int4_tiled.h): int4_g64's quantization (4.5 bits, the HF QuantizedCache default)
//               in the tiled layout whose kernels are 1.8-3x faster.
#include <fmt/format.h>

#include "core/error.h"
#include "kv/calib.h"
#include "kv/registry_internal.h"
#include "kv/row_codec.h"

namespace kvq {

namespace {

void add_grouped(int bits, int g) {
  const std::string name = fmt::format("int{}_g{}", bits, g);
  const KvElem e = bits == 4 ? KvElem::int4g : KvElem::int2g;
  kv_register_codec(
      {name, fmt::format("int{} asymmetric, f16 scale + min per group of {} along head_dim", bits, g),
       [name, e, g](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
         kv_check_group_size(name, g, p.head_dim);
         return std::make_unique<KvRowCodec>(name, kv_row_fmt(e, p.head_dim, g), p.n_kv_heads);
       }});
}

}  // namespace

void kv_register_int_codecs() {
  // "int8" stores int8t's tiles (kv/int8_tiled.h: the same quantization, bytes and decode, with
  // integer-dot kernels) wherever they apply (head_dim a multiple of 32), else the rows;
  // "int8_rows" always the rows.
  const auto int8_rows = [](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
    return std::make_unique<KvRowCodec>("int8", kv_row_fmt(KvElem::int8, p.head_dim), p.n_kv_heads);
  };
  kv_register_codec({"int8_rows", "int8 symmetric, f32 absmax scale per (token, head), one row per token", int8_rows});
  kv_register_codec({"int8", "int8 symmetric, f32 absmax scale per (token, head)",
                     [int8_rows](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       if (p.head_dim % 32 == 0 && p.head_dim <= kv_max_head_dim) return kv_codec_create("int8t", p);
                       return int8_rows(p);
                     }});
  kv_register_codec({"int8_static", "int8 symmetric, calibrated per-tensor/per-head scale",
                     [](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       return std::make_unique<KvRowCodec>("int8_static", kv_row_fmt(KvElem::int8_static, p.head_dim),
                                                           p.n_kv_heads, kv_calib_head_scales(p, "int8_static"));
                     }});
  for (int bits : {4, 2})
    for (int g : {32, 64, 128}) add_grouped(bits, g);

  kv_register_format({"int8", {"int8_per_token"}, "int8", "int8",
                      "int8 symmetric per (token, head), f32 scale (int8t's tiles where head_dim % 32 == 0): "
                      "8 + 32/head_dim bits"});
  kv_register_format({"int8_rows", {}, "int8_rows", "int8_rows",
                      "int8 symmetric per (token, head), f32 scale, one row per token: 8 + 32/head_dim bits"});
  kv_register_format({"int8_static", {}, "int8_static", "int8_static",
                      "int8 with calibrated K/V scales (needs calibration JSON): 8 bits"});
  for (int bits : {4, 2}) {
    for (int g : {32, 64, 128}) {
      const std::string name = fmt::format("int{}_g{}", bits, g);
      // "int4" / "int2" name int4t_g64 / int2t_g32 (the same quantization and bytes, tiled for the
      // integer-dot kernels).
      kv_register_format({name, {}, name, name,
                          fmt::format("int{} asymmetric per group of {} channels, f16 scale + min: {} bits", bits,
                                      g, bits + 32.0 / g)});
    }
  }
}

}  // namespace kvq
