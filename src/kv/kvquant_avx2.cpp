// AVX2 KVQuant score kernel: each key is dequantized (8 codes per byte of each bit plane; the
// 16-entry codebook lookup is two vpermps blended on bit 3 of the code), split into pair order,
// patched with its outliers, turned by R(t) and dotted with every query row.
#include <immintrin.h>

#include "core/dtypes.h"
#include "kv/grouped_common.h"
#include "kv/kvquant.h"

namespace kvq {

namespace {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 channels 8k..8k+7 of one row, dequantized.
inline __m256 dequant8(const uint8_t* planes, int bits, int pb, int k, __m256 cb_lo, __m256 cb_hi, const float* sc,
                       const float* md) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i v = _mm256_setzero_si256();
  for (int j = 0; j < bits; ++j) {
    const __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(planes[j * pb + k]), sel), sel);
    v = _mm256_add_epi32(v, _mm256_and_si256(m, _mm256_set1_epi32(1 << j)));
  }
  __m256 val = _mm256_permutevar8x32_ps(cb_lo, v);
  if (bits == 4)  // bit 3 moved to the sign bit selects the high half
    val = _mm256_blendv_ps(val, _mm256_permutevar8x32_ps(cb_hi, v), _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
  return _mm256_fmadd_ps(val, _mm256_loadu_ps(sc + 8 * k), _mm256_loadu_ps(md + 8 * k));
}

}  // namespace

void kvquant_scores_avx2(const KvquantScoreArgs& a, float* out, int out_stride) {
  const int D = a.head_dim, half = a.n_rot / 2, pb = D / 8;
  if (half % 8 != 0 || D > kvg_max_head_dim) return kvquant_scores_scalar(a, out, out_stride);
  alignas(32) float sc[kvg_max_head_dim], md[kvg_max_head_dim], kp[kvg_max_head_dim];
  for (int k = 0; k < D / 8; ++k) {
    _mm256_store_ps(sc + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.params + 16 * k))));
    _mm256_store_ps(md + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(a.params + 2 * size_t(D) + 16 * k))));
  }
  const KvquantScoreLayout& l = *a.layout;
  const bool lanes = l.layout == kvquant_layout_lanes;
  const __m256 cb_lo = _mm256_loadu_ps(a.codebook), cb_hi = _mm256_loadu_ps(a.codebook + 8);
  alignas(32) float kn[kvg_max_head_dim];
  for (int t = 0; t < a.n; ++t) {
    const uint8_t* row = a.rows + size_t(t) * a.row_bytes;
    if (lanes) {  // channel order, then permuted (the lanes order serves the AVX-512 kernel)
      for (int k = 0; k < D / 8; ++k) _mm256_store_ps(kn + 8 * k, dequant8(row, a.bits, pb, k, cb_lo, cb_hi, sc, md));
      for (int j = 0; j < a.k; ++j) {
        const size_t e = size_t(t) * a.k + j;
        kn[a.oidx[e]] = _cvtsh_ss(kvg_load_f16(a.ovals, e));
      }
      for (int c = 0; c < D; ++c) kp[l.slot[size_t(c)]] = kn[c];
    } else {
      int k = 0;
      if (!l.neox) {
        // Channels 16m..16m+15 = pairs 8m..8m+7: even lanes are the a-elements, odd the b-elements.
        for (; 8 * k < a.n_rot; k += 2) {
          const __m256 x0 = dequant8(row, a.bits, pb, k, cb_lo, cb_hi, sc, md);
          const __m256 x1 = dequant8(row, a.bits, pb, k + 1, cb_lo, cb_hi, sc, md);
          const __m256 ev = _mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));
          const __m256 od = _mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
          _mm256_store_ps(kp + 4 * k, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), _MM_SHUFFLE(3, 1, 2, 0))));
          _mm256_store_ps(kp + half + 4 * k,
                          _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), _MM_SHUFFLE(3, 1, 2, 0))));
        }
      }
      for (; k < D / 8; ++k) _mm256_store_ps(kp + 8 * k, dequant8(row, a.bits, pb, k, cb_lo, cb_hi, sc, md));
      for (int j = 0; j < a.k; ++j) {
        const size_t e = size_t(t) * a.k + j;
        kp[l.slot[a.oidx[e]]] = _cvtsh_ss(kvg_load_f16(a.ovals, e));
      }
    }
    const float* rc = a.rot_c + size_t(t) * a.rot_stride;
    const float* rs = a.rot_s + size_t(t) * a.rot_stride;
    const bool runs = lanes && !l.neox;  // a-elements in runs of 16, b-elements 16 after
    for (int m = 0; m < half; m += 8) {
      const int ia = runs ? 32 * (m / 16) + m % 16 : m, ib = ia + (runs ? 16 : half);
      const __m256 ka = _mm256_load_ps(kp + ia), kb = _mm256_load_ps(kp + ib);
      const __m256 c = _mm256_loadu_ps(rc + m), s = _mm256_loadu_ps(rs + m);
      _mm256_store_ps(kp + ia, _mm256_fmsub_ps(ka, c, _mm256_mul_ps(kb, s)));
      _mm256_store_ps(kp + ib, _mm256_fmadd_ps(ka, s, _mm256_mul_ps(kb, c)));
    }
    for (int i = 0; i < a.n_q; ++i) {
      const float* q = a.q + size_t(i) * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      for (int c = 0; c < D; c += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_load_ps(kp + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_load_ps(kp + c + 8), a1);
      }
      out[size_t(i) * out_stride + t] = hsum8(_mm256_add_ps(a0, a1));
    }
  }
}

}  // namespace kvq
