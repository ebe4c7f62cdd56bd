// AVX-512 KIVI kernels: a bit plane of 16 channels is one 16-bit mask register, so unpacking a
// code is one masked add per bit.
#include <immintrin.h>

#include "kv/grouped_common.h"
#include "kv/kivi.h"

namespace kvq {

namespace {

inline __mmask16 plane_mask(const uint8_t* plane, int k) {
  uint16_t m;
  std::memcpy(&m, plane + 2 * k, 2);
  return __mmask16(m);
}

template <int B>
void k_scores_impl(const uint8_t* codes, size_t row_bytes, int n, int head_dim, const float* qs,
                   const float* qz, int n_q, float* out, int out_stride) {
  const int pb = head_dim / 8, nk = head_dim / 16;
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = codes + size_t(t) * row_bytes;
    for (int i = 0; i < n_q; ++i) {
      const float* w = qs + size_t(i) * head_dim;
      // Sum of q*s over the channels whose bit j is set, per bit; weighted by 2^j at the end.
      __m512 acc[B];
      for (int j = 0; j < B; ++j) acc[j] = _mm512_setzero_ps();
      for (int k = 0; k < nk; ++k) {
        const __m512 wv = _mm512_loadu_ps(w + 16 * k);
        for (int j = 0; j < B; ++j)
          acc[j] = _mm512_mask_add_ps(acc[j], plane_mask(row + j * pb, k), acc[j], wv);
      }
      __m512 tot = acc[B - 1];
      for (int j = B - 2; j >= 0; --j) tot = _mm512_fmadd_ps(tot, _mm512_set1_ps(2.f), acc[j]);
      out[size_t(i) * out_stride + t] = _mm512_reduce_add_ps(tot) + qz[i];
    }
  }
}

template <int B>
void v_accum_impl(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group,
                  const float* p, int p_stride, int n_q, float* acc) {
  const int ng = head_dim / group, nk = head_dim / 16, pb = head_dim / 8;
  alignas(64) float codef[kvg_max_head_dim];
  float sc[kvg_max_head_dim / 16], ze[kvg_max_head_dim / 16];
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = rows + size_t(t) * row_bytes;
    const uint8_t* planes = row + size_t(ng) * 4;
    for (int g = 0; g < ng; ++g) {
      sc[g] = f16_to_f32(kvg_load_f16(row, g));
      ze[g] = f16_to_f32(kvg_load_f16(row, ng + g));
    }
    // Codes unpacked once per token, reused by every query head of the GQA group.
    for (int k = 0; k < nk; ++k) {
      __m512i v = _mm512_setzero_si512();
      for (int j = 0; j < B; ++j)
        v = _mm512_mask_add_epi32(v, plane_mask(planes + j * pb, k), v, _mm512_set1_epi32(1 << j));
      _mm512_store_ps(codef + 16 * k, _mm512_cvtepi32_ps(v));
    }
    for (int i = 0; i < n_q; ++i) {
      const float w = p[size_t(i) * p_stride + t];
      float* a = acc + size_t(i) * head_dim;
      for (int k = 0; k < nk; ++k) {
        const int g = 16 * k / group;
        const __m512 av = _mm512_add_ps(_mm512_loadu_ps(a + 16 * k), _mm512_set1_ps(w * ze[g]));
        _mm512_storeu_ps(a + 16 * k,
                         _mm512_fmadd_ps(_mm512_set1_ps(w * sc[g]), _mm512_load_ps(codef + 16 * k), av));
      }
    }
  }
}

}  // namespace

void kivi_k_scores_avx512(const uint8_t* codes, size_t row_bytes, int n, int bits, int head_dim,
                          const float* qs, const float* qz, int n_q, float* out, int out_stride) {
  switch (bits) {
    case 2: return k_scores_impl<2>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
    case 3: return k_scores_impl<3>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
    default: return k_scores_impl<4>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
  }
}

void kivi_v_accum_avx512(const uint8_t* rows, size_t row_bytes, int n, int bits, int head_dim,
                         int group, const float* p, int p_stride, int n_q, float* acc) {
  switch (bits) {
    case 2: return v_accum_impl<2>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
    case 3: return v_accum_impl<3>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
    default: return v_accum_impl<4>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
  }
}

}  // namespace kvq
