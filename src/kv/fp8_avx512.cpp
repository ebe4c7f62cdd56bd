// AVX-512 FP8 encoding: the exact round-to-nearest-even conversion of fp8.cpp (same codes for
// every input, NaN/inf/saturation included), 16 values per step with integer arithmetic on the
// f32 bits instead of a double-precision frexp / ldexp / nearbyint per value.
//
// For |v| (f32 bits A) and a minifloat with M mantissa bits and bias B (smallest normal 2^emin,
// emin = 1 - B):
//  - |v| >= 2^emin: RNE to M mantissa bits in the bit pattern, R = (A + 2^(22-M) - 1 +
//    lsb) >> (23 - M) (a carry out of the mantissa correctly bumps the exponent), then the
//    exponent rebased: code = R - ((127 - B) << M);
//  - |v| < 2^emin (subnormal or zero): the FPU rounds: y = |v| + 2^(emin - M + 23) has ulp
//    2^(emin - M), the subnormal quantum, so bits(y) - bits(2^(emin - M + 23)) is the code
//    (2^M, the smallest normal, when it rounds up: codes are continuous there);
//  - codes past the largest finite one saturate to it; E5M2 keeps +-inf, both keep NaN (0x7f).
#include "core/avx512.h"

#include "kv/fp8.h"

namespace kvq {

namespace {

template <int M, int B, int MaxCode, bool HasInf>
inline __m128i encode16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  constexpr int shift = 23 - M, emin = 1 - B;
  // Normal path.
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, shift), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32((1 << (shift - 1)) - 1), lsb));
  r = _mm512_sub_epi32(_mm512_srli_epi32(r, shift), _mm512_set1_epi32((127 - B) << M));
  // Subnormal path (exponent of C: emin - M + 23, positive for both formats).
  const __m512 c = _mm512_castsi512_ps(_mm512_set1_epi32((emin - M + 23 + 127) << 23));
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), c)),
                                       _mm512_castps_si512(c));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32((emin + 127) << 23));
  __m512i code = _mm512_mask_blend_epi32(is_sub, r, sub);
  // Saturation (signed compare: the rebased exponent of inputs far above the range is large and
  // positive; inf lands there too), then the special codes.
  code = _mm512_min_epi32(code, _mm512_set1_epi32(MaxCode));
  const __mmask16 is_inf = _mm512_cmpeq_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
  if constexpr (HasInf) code = _mm512_mask_mov_epi32(code, is_inf, _mm512_set1_epi32(0x7c));
  code = _mm512_mask_mov_epi32(code, is_nan, _mm512_set1_epi32(0x7f));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}

template <int M, int B, int MaxCode, bool HasInf>
void encode(const float* x, int n, float scale, uint8_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int i = 0;
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     encode16<M, B, MaxCode, HasInf>(_mm512_div_ps(_mm512_loadu_ps(x + i), s)));
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    _mm_mask_storeu_epi8(out + i, k, encode16<M, B, MaxCode, HasInf>(_mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), s)));
  }
}

}  // namespace

void fp8_e4m3_encode_avx512(const float* x, int n, float scale, uint8_t* out) {
  encode<3, 7, 0x7e, false>(x, n, scale, out);
}

void fp8_e5m2_encode_avx512(const float* x, int n, float scale, uint8_t* out) {
  encode<2, 15, 0x7b, true>(x, n, scale, out);
}

}  // namespace kvq
