// AVX-512 KVQuant kernels: 16 codes are built from the bit planes with masked adds and looked up
// in the (at most 16-entry) codebook with one vpermps.
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

}  // namespace kvq
