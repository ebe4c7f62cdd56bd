// AVX2 KIVI kernels: one byte of a bit plane covers 8 channels; it is broadcast and compared
// against the lane bits (1, 2, ..., 128) to form a lane mask.
#include <immintrin.h>

#include "kv/grouped_common.h"
#include "kv/kivi.h"

namespace kvq {

namespace {

inline __m256i byte_mask(uint8_t b) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(b), sel), sel);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Codes of a row decoded once to floats (exact small integers), then one FMA chain per query row.
template <int B>
void k_scores_impl(const uint8_t* codes, size_t row_bytes, int n, int head_dim, const float* qs,
                   const float* qz, int n_q, float* out, int out_stride) {
  const int pb = head_dim / 8;
  alignas(32) float codef[kvg_max_head_dim];
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = codes + size_t(t) * row_bytes;
    for (int k = 0; k < pb; ++k) {
      __m256i v = _mm256_setzero_si256();
      for (int j = 0; j < B; ++j)
        v = _mm256_add_epi32(v, _mm256_and_si256(byte_mask(row[j * pb + k]), _mm256_set1_epi32(1 << j)));
      _mm256_store_ps(codef + 8 * k, _mm256_cvtepi32_ps(v));
    }
    for (int i = 0; i < n_q; ++i) {
      const float* w = qs + size_t(i) * head_dim;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int k = 0; k < pb; k += 2) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8 * k), _mm256_load_ps(codef + 8 * k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8 * k + 8), _mm256_load_ps(codef + 8 * k + 8), a1);
      }
      out[size_t(i) * out_stride + t] = hsum(_mm256_add_ps(a0, a1)) + qz[i];
    }
  }
}

template <int B>
void v_accum_impl(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group,
                  const float* p, int p_stride, int n_q, float* acc) {
  const int ng = head_dim / group, pb = head_dim / 8;
  alignas(32) float codef[kvg_max_head_dim];
  float sc[kvg_max_head_dim / 16], ze[kvg_max_head_dim / 16];
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = rows + size_t(t) * row_bytes;
    const uint8_t* planes = row + size_t(ng) * 4;
    for (int g = 0; g < ng; ++g) {
      sc[g] = f16_to_f32(kvg_load_f16(row, g));
      ze[g] = f16_to_f32(kvg_load_f16(row, ng + g));
    }
    for (int k = 0; k < pb; ++k) {
      __m256i v = _mm256_setzero_si256();
      for (int j = 0; j < B; ++j)
        v = _mm256_add_epi32(v, _mm256_and_si256(byte_mask(planes[j * pb + k]), _mm256_set1_epi32(1 << j)));
      _mm256_store_ps(codef + 8 * k, _mm256_cvtepi32_ps(v));
    }
    for (int i = 0; i < n_q; ++i) {
      const float w = p[size_t(i) * p_stride + t];
      float* a = acc + size_t(i) * head_dim;
      for (int k = 0; k < pb; ++k) {
        const int g = 8 * k / group;
        const __m256 av = _mm256_add_ps(_mm256_loadu_ps(a + 8 * k), _mm256_set1_ps(w * ze[g]));
        _mm256_storeu_ps(a + 8 * k,
                         _mm256_fmadd_ps(_mm256_set1_ps(w * sc[g]), _mm256_load_ps(codef + 8 * k), av));
      }
    }
  }
}

}  // namespace

void kivi_k_scores_avx2(const uint8_t* codes, size_t row_bytes, int n, int bits, int head_dim,
                        const float* qs, const float* qz, int n_q, float* out, int out_stride) {
  switch (bits) {
    case 2: return k_scores_impl<2>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
    case 3: return k_scores_impl<3>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
    default: return k_scores_impl<4>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
  }
}

void kivi_v_accum_avx2(const uint8_t* rows, size_t row_bytes, int n, int bits, int head_dim,
                       int group, const float* p, int p_stride, int n_q, float* acc) {
  switch (bits) {
    case 2: return v_accum_impl<2>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
    case 3: return v_accum_impl<3>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
    default: return v_accum_impl<4>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
  }
}

}  // namespace kvq
