// FP8 codes to bf16 on AVX-512 (VBMI): every E4M3 / E5M2 value, subnormals, inf and NaN included,
// is a bf16, so the conversion is exact. Shared by the fp8 rows' VDPBF16PS kernels
// (kv_rows_bf16_avx512.cpp) and the fp8 tiles' (fp8_tiled_avx512.cpp). Include only from
// *_avx512.cpp files (after core/avx512.h).
#pragma once
#include <cstdint>

#include "core/dtypes.h"
#include "kv/fp8.h"

namespace kvq {

// bf16 bits of the 128 FP8 magnitudes (E4M3 or E5M2): 4 vectors of 32 words (t), and the same as
// two byte tables of 128 entries, the low bytes (b[0], b[1]) and the high bytes (b[2], b[3]).
struct Fp8Lut {
  __m512i t[4];
  __m512i b[4];
};
inline Fp8Lut make_fp8_lut(bool e4m3) {
  alignas(64) uint16_t w[128];
  alignas(64) uint8_t lo[128], hi[128];
  for (int m = 0; m < 128; ++m) {
    const float v = e4m3 ? fp8_e4m3_to_f32(uint8_t(m)) : fp8_e5m2_to_f32(uint8_t(m));
    w[m] = f32_to_bf16(v);  // exact: every FP8 value (and inf / NaN) is a bf16
    lo[m] = uint8_t(w[m] & 0xff);
    hi[m] = uint8_t(w[m] >> 8);
  }
  Fp8Lut l;
  for (int j = 0; j < 4; ++j) l.t[j] = _mm512_load_si512(w + 32 * j);
  for (int j = 0; j < 2; ++j) {
    l.b[j] = _mm512_load_si512(lo + 64 * j);
    l.b[2 + j] = _mm512_load_si512(hi + 64 * j);
  }
  return l;
}
inline const Fp8Lut& fp8_lut(bool e4m3) {
  static const Fp8Lut e4 = make_fp8_lut(true), e5 = make_fp8_lut(false);
  return e4m3 ? e4 : e5;
}

// 64 FP8 codes x -> 64 bf16 values as two vectors: the low and high bytes of each value looked up
// in two 128-entry byte tables (VPERMI2B reads the code's 7 low bits, the magnitude), the code's
// sign ORed into the high byte, the bytes interleaved into words. Word k of 128-bit lane L of *a
// is the value of byte 16L + k of x, of *b that of byte 16L + 8 + k (k < 8): five instructions.
[[gnu::always_inline]] inline void fp8_bytes_to_bf16_64(__m512i x, const Fp8Lut& L, __m512i* a, __m512i* b) {
  const __m512i lo = _mm512_permutex2var_epi8(L.b[0], x, L.b[1]);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(L.b[2], x, L.b[3]), x,
                                               _mm512_set1_epi8(char(0x80)), 0xF8);  // A | (B & C)
  *a = _mm512_unpacklo_epi8(lo, hi);
  *b = _mm512_unpackhi_epi8(lo, hi);
}

}  // namespace kvq
