// AVX-512 KVQuant kernels: 16 codes are built from the bit planes with masked adds and looked up
// in the (at most 16-entry) codebook with one vpermps.
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstring>

#include "kv/kvquant.h"

namespace kvq {

void kvquant_dequant_avx512(const uint8_t* planes, int bits, int head_dim, const float* codebook,
                            const float* scale, const float* mid, float* out) {
  const int pb = head_dim / 8;
  const __m512 cb = _mm512_loadu_ps(codebook);
  for (int k = 0; k < head_dim / 16; ++k) {
    __m512i v = _mm512_setzero_si512();
    for (int j = 0; j < bits; ++j) {
      uint16_t m;
      std::memcpy(&m, planes + j * pb + 2 * k, 2);
      v = _mm512_mask_add_epi32(v, __mmask16(m), v, _mm512_set1_epi32(1 << j));
    }
    const __m512 val = _mm512_permutexvar_ps(v, cb);
    _mm512_storeu_ps(out + 16 * k, _mm512_fmadd_ps(val, _mm512_loadu_ps(scale + 16 * k),
                                                  _mm512_loadu_ps(mid + 16 * k)));
  }
}

void kvquant_dot_avx512(const float* q, int n_q, const float* k, int head_dim, float* out,
                        int out_stride) {
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * head_dim;
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < head_dim; c += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + c), _mm512_loadu_ps(k + c), acc);
    out[size_t(i) * out_stride] = _mm512_reduce_add_ps(acc);
  }
}

// Separate multiplies and adds: the same roundings as the scalar variant, so the rotated keys are
// bit-identical. The explicit-rounding forms, because GCC implements _mm512_mul_ps / _add_ps as
// vector arithmetic that -ffp-contract=fast fuses into FMAs.
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
namespace {
inline __m512 rmul_ps(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, RN); }
inline __m512 radd_ps(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, RN); }
inline __m512 rsub_ps(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, RN); }
inline __m512d rmul_pd(__m512d a, __m512d b) { return _mm512_mul_round_pd(a, b, RN); }
inline __m512d radd_pd(__m512d a, __m512d b) { return _mm512_add_round_pd(a, b, RN); }
inline __m512d rsub_pd(__m512d a, __m512d b) { return _mm512_sub_round_pd(a, b, RN); }
}  // namespace
void kvquant_rope_avx512(double* c, double* s, const double* dc, const double* ds, float* cf, float* sf,
                         int half, bool step, float* x, bool neox) {
  if (step) {
    for (int i = 0; i < half; i += 8) {
      const __mmask8 m = half - i >= 8 ? __mmask8(0xff) : __mmask8((1u << (half - i)) - 1);
      const __m512d cv = _mm512_maskz_loadu_pd(m, c + i), sv = _mm512_maskz_loadu_pd(m, s + i);
      const __m512d dcv = _mm512_maskz_loadu_pd(m, dc + i), dsv = _mm512_maskz_loadu_pd(m, ds + i);
      const __m512d c1 = rsub_pd(rmul_pd(cv, dcv), rmul_pd(sv, dsv));
      const __m512d s1 = radd_pd(rmul_pd(sv, dcv), rmul_pd(cv, dsv));
      _mm512_mask_storeu_pd(c + i, m, c1);
      _mm512_mask_storeu_pd(s + i, m, s1);
      _mm256_mask_storeu_ps(cf + i, m, _mm512_cvtpd_ps(c1));
      _mm256_mask_storeu_ps(sf + i, m, _mm512_cvtpd_ps(s1));
    }
  }
  if (neox) {
    for (int i = 0; i < half; i += 16) {
      const __mmask16 m = half - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (half - i)) - 1);
      const __m512 a = _mm512_maskz_loadu_ps(m, x + i), b = _mm512_maskz_loadu_ps(m, x + half + i);
      const __m512 cs = _mm512_maskz_loadu_ps(m, cf + i), sn = _mm512_maskz_loadu_ps(m, sf + i);
      _mm512_mask_storeu_ps(x + i, m, rsub_ps(rmul_ps(a, cs), rmul_ps(b, sn)));
      _mm512_mask_storeu_ps(x + half + i, m, radd_ps(rmul_ps(a, sn), rmul_ps(b, cs)));
    }
    return;
  }
  // Adjacent pairs: 8 pairs per vector; cos/sin duplicated onto both lanes of a pair, the partner
  // value by swapping within pairs, the sign of sin per lane (even: x0 cs - x1 sn, odd: x1 cs + x0 sn).
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512 sign = _mm512_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1);
  for (int i = 0; i < half; i += 8) {
    const int np = half - i >= 8 ? 8 : half - i;
    const __mmask8 m8 = __mmask8((1u << np) - 1);
    const __mmask16 m16 = __mmask16((1u << (2 * np)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m16, x + 2 * i);
    const __m512 cs = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_maskz_loadu_ps(m8, cf + i)));
    const __m512 sn = rmul_ps(_mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_maskz_loadu_ps(m8, sf + i))), sign);
    const __m512 sw = _mm512_permute_ps(v, 0xb1);
    _mm512_mask_storeu_ps(x + 2 * i, m16, radd_ps(rmul_ps(v, cs), rmul_ps(sw, sn)));
  }
}

#undef RN

}  // namespace kvq
