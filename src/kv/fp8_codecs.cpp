// FP8 codecs (E4M3, E5M2) in three scale modes:
//  fixed   (fp8_e4m3, fp8_e5m2): x ~= fp8 * 1.0, as vLLM's default; E4M3's exponent absorbs the
//          range of typical K/V (|x| <= 448), E5M2 trades mantissa for range (57344).
//  static  (fp8_*_static): per-tensor or per-head scales from calibration JSON (kv/calib.h).
//  dynamic (fp8_*_dyn): an f32 scale absmax / fp8_max stored with each token (KvRowScaled):
//          8 + 32/head_dim bits.
// Each is stored in 16-token tiles (kv/fp8_tiled.h: the same codes, scales, bytes and decode, with
// VDPBF16PS kernels that need no horizontal sums) where head_dim % 32 == 0 and the CPU runs the
// AVX-512 level, else in rows; the "_rows" codecs and formats (fp8_e4m3_rows,
// fp8_e4m3_static_rows, ...) always store rows.
#include "core/cpu.h"
#include "kv/calib.h"
#include "kv/registry_internal.h"
#include "kv/row_codec.h"

namespace kvq {

namespace {
enum class Mode { fixed, calibrated, dynamic };

// tiled: the codec of the same quantization in fp8t's tiles (kv/fp8_tiled.cpp).
void add(const std::string& name, const std::string& tiled, KvElem e, Mode mode, const std::string& what) {
  const std::string rows = name + "_rows";
  auto make_rows = [name, rows, e, mode](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
    std::vector<float> scales;
    if (mode == Mode::calibrated) scales = kv_calib_head_scales(p, name);
    return std::make_unique<KvRowCodec>(rows, kv_row_fmt(e, p.head_dim), p.n_kv_heads, std::move(scales));
  };
  kv_register_codec({rows, what + ", one row per token", make_rows});
  kv_register_codec({name, what, [tiled, make_rows](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       // The tiles' VDPBF16PS kernels need AVX-512 BF16; on AVX2 the rows' kernels
                       // are faster than the tiles' (bench/BENCHMARKS.md, "FP8 in 16-token tiles").
                       if (p.head_dim % 32 == 0 && p.head_dim <= kv_max_head_dim && cpu_level() == CpuLevel::avx512)
                         return kv_codec_create(tiled, p);
                       return make_rows(p);
                     }});
}
}  // namespace

void kv_register_fp8_codecs() {
  add("fp8_e4m3", "fp8_e4m3t", KvElem::e4m3, Mode::fixed, "FP8 E4M3, scale 1.0, saturating at +-448");
  add("fp8_e5m2", "fp8_e5m2t", KvElem::e5m2, Mode::fixed, "FP8 E5M2, scale 1.0, saturating at +-57344");
  add("fp8_e4m3_static", "fp8_e4m3t_static", KvElem::e4m3, Mode::calibrated,
      "FP8 E4M3, calibrated per-tensor/per-head scale");
  add("fp8_e5m2_static", "fp8_e5m2t_static", KvElem::e5m2, Mode::calibrated,
      "FP8 E5M2, calibrated per-tensor/per-head scale");
  add("fp8_e4m3_dyn", "fp8_e4m3t_dyn", KvElem::e4m3_dyn, Mode::dynamic, "FP8 E4M3, f32 scale absmax/448 per (token, head)");
  add("fp8_e5m2_dyn", "fp8_e5m2t_dyn", KvElem::e5m2_dyn, Mode::dynamic,
      "FP8 E5M2, f32 scale absmax/57344 per (token, head)");
  kv_register_format({"fp8_e4m3", {"fp8", "fp8_e4m3fn", "e4m3"}, "fp8_e4m3", "fp8_e4m3",
                      "FP8 E4M3 with scale 1.0 (vLLM default; 16-token tiles on AVX-512): 8 bits"});
  kv_register_format({"fp8_e5m2", {"e5m2"}, "fp8_e5m2", "fp8_e5m2", "FP8 E5M2 with scale 1.0 (16-token tiles on AVX-512): 8 bits"});
  kv_register_format({"fp8_e4m3_static", {"fp8_static"}, "fp8_e4m3_static", "fp8_e4m3_static",
                      "FP8 E4M3 with calibrated K/V scales (needs calibration JSON): 8 bits"});
  kv_register_format({"fp8_e5m2_static", {}, "fp8_e5m2_static", "fp8_e5m2_static",
                      "FP8 E5M2 with calibrated K/V scales (needs calibration JSON): 8 bits"});
  kv_register_format({"fp8_e4m3_dyn", {"fp8_dyn", "fp8_dynamic"}, "fp8_e4m3_dyn", "fp8_e4m3_dyn",
                      "FP8 E4M3 with a per-token f32 scale: 8 + 32/head_dim bits"});
  kv_register_format({"fp8_e5m2_dyn", {}, "fp8_e5m2_dyn", "fp8_e5m2_dyn",
                      "FP8 E5M2 with a per-token f32 scale: 8 + 32/head_dim bits"});
  for (const char* n : {"fp8_e4m3", "fp8_e5m2", "fp8_e4m3_static", "fp8_e5m2_static", "fp8_e4m3_dyn", "fp8_e5m2_dyn"}) {
    const std::string rows = std::string(n) + "_rows";
    kv_register_format({rows, {}, rows, rows, std::string(n) + " stored one row per token (no tiles)"});
  }
}

}  // namespace kvq
