// 16 FP8 codes to f32 on AVX2 through f16 (F16C), shared by the fp8 rows' AVX2 kernels
// (kv_rows_avx2.cpp) and the fp8 tiles' (fp8_tiled_avx2.cpp). E5M2 is the high byte of an f16.
// The sign-extended E4M3 byte << 7 with bit 14 cleared is an f16 of value E4M3 * 2^-8 (the caller
// multiplies by 256 where it applies the scale); the NaN codes (S.1111.111) are the only ones whose
// bits 7..13 are all set, so adding 1 << 7 carries into bit 14 for them alone, and OR-ing that carry
// back sets the f16 exponent to all ones (a NaN) in integer ops. Include only from *_avx2.cpp files.
#pragma once
#include <immintrin.h>

namespace kvq {

// Codes b[0..7] -> x[0], b[8..15] -> x[1] (E4M3 unscaled by 2^-8).
template <bool E4M3>
[[gnu::always_inline]] inline void fp8_codes16_to_f32_avx2(__m128i b, __m256* x) {
  if constexpr (E4M3) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(int16_t(0xbfff)));
    const __m256i nan = _mm256_and_si256(_mm256_add_epi16(h, _mm256_set1_epi16(0x0080)), _mm256_set1_epi16(0x4000));
    const __m256i g = _mm256_or_si256(h, nan);
    x[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(g));
    x[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(g, 1));
  } else {
    x[0] = _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
    x[1] = _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), b));
  }
}

}  // namespace kvq
