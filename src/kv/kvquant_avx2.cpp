// AVX2 KVQuant kernels: 8 codes per byte of each bit plane; the 16-entry codebook lookup is two
// vpermps (low and high half) blended on bit 3 of the code.
#include <immintrin.h>

#include "kv/kvquant.h"

namespace kvq {

void kvquant_dequant_avx2(const uint8_t* planes, int bits, int head_dim, const float* codebook,
                          const float* scale, const float* mid, float* out) {
  const int pb = head_dim / 8;
  const __m256 cb_lo = _mm256_loadu_ps(codebook), cb_hi = _mm256_loadu_ps(codebook + 8);
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int k = 0; k < pb; ++k) {
    __m256i v = _mm256_setzero_si256();
    for (int j = 0; j < bits; ++j) {
      const __m256i m =
          _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(planes[j * pb + k]), sel), sel);
      v = _mm256_add_epi32(v, _mm256_and_si256(m, _mm256_set1_epi32(1 << j)));
    }
    __m256 val = _mm256_permutevar8x32_ps(cb_lo, v);
    if (bits == 4)  // bit 3 moved to the sign bit selects the high half
      val = _mm256_blendv_ps(val, _mm256_permutevar8x32_ps(cb_hi, v),
                             _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
    _mm256_storeu_ps(out + 8 * k, _mm256_fmadd_ps(val, _mm256_loadu_ps(scale + 8 * k),
                                                 _mm256_loadu_ps(mid + 8 * k)));
  }
}

void kvquant_dot_avx2(const float* q, int n_q, const float* k, int head_dim, float* out,
                      int out_stride) {
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * head_dim;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int c = 0; c < head_dim; c += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qi + c), _mm256_loadu_ps(k + c), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qi + c + 8), _mm256_loadu_ps(k + c + 8), a1);
    }
    a0 = _mm256_add_ps(a0, a1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[size_t(i) * out_stride] = _mm_cvtss_f32(s);
  }
}

}  // namespace kvq
