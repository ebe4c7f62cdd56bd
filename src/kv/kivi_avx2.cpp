// AVX2 KIVI kernels: one byte of a bit plane covers 8 channels; it is broadcast and compared
// against the lane bits (1, 2, ..., 128) to form a lane mask.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kv/bitplanes_avx2.h"
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

// Codes of channels 8k..8k+7 of a row's planes as floats (exact small integers).
template <int B>
inline __m256 codes8(const uint8_t* planes, int pb, int k) {
  __m256i v = _mm256_setzero_si256();
  for (int j = 0; j < B; ++j)
    v = _mm256_add_epi32(v, _mm256_and_si256(byte_mask(planes[j * pb + k]), _mm256_set1_epi32(1 << j)));
  return _mm256_cvtepi32_ps(v);
}

// Codes of channels 32m..32m+31 as floats into f (32), the planes decoded 32 channels at once.
template <int B>
inline void codes32(const uint8_t* planes, int pb, int m, float* f) {
  const __m256i codes =
      bitplane_codes32_avx2<B>(planes, pb, 4 * m, bitplane_rep_identity_avx2(), bitplane_bit_identity_avx2());
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  _mm256_store_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
  _mm256_store_ps(f + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
  _mm256_store_ps(f + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
  _mm256_store_ps(f + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
}

// Codes of a row decoded once to floats (exact small integers), then one FMA chain per query row.
template <int B>
void k_scores_impl(const uint8_t* codes, size_t row_bytes, int n, int head_dim, const float* qs,
                   const float* qz, int n_q, float* out, int out_stride) {
  const int pb = head_dim / 8;
  alignas(32) float codef[kvg_max_head_dim];
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = codes + size_t(t) * row_bytes;
    int k = 0;
    for (; k + 4 <= pb; k += 4) codes32<B>(row, pb, k / 4, codef + 8 * k);
    for (; k < pb; ++k) _mm256_store_ps(codef + 8 * k, codes8<B>(row, pb, k));
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

// NR query rows (weights pi, rows p_stride apart) times nt decoded tokens of one block of NV
// vectors (cf: 32 floats per token), scaled per token and group, accumulated in registers and
// added to a (rows acc_stride apart).
template <int NR, int NV>
inline void accum_block(const float* cf, int nt, const float* pi, int p_stride, const float (*sc)[kvg_max_head_dim / 16],
                        const int* gv, bool one_group, float* a, int acc_stride) {
  __m256 r[NR][NV];
  for (int h = 0; h < NR; ++h)
    for (int v = 0; v < NV; ++v) r[h][v] = _mm256_setzero_ps();
  for (int u = 0; u < nt; ++u)
    for (int h = 0; h < NR; ++h) {
      const float w = pi[size_t(h) * p_stride + u];
      if (one_group) {  // one weight per token and row
        const __m256 wv = _mm256_set1_ps(w * sc[u][gv[0]]);
        for (int v = 0; v < NV; ++v) r[h][v] = _mm256_fmadd_ps(wv, _mm256_load_ps(cf + 32 * u + 8 * v), r[h][v]);
      } else {
        for (int v = 0; v < NV; ++v)
          r[h][v] = _mm256_fmadd_ps(_mm256_set1_ps(w * sc[u][gv[v]]), _mm256_load_ps(cf + 32 * u + 8 * v), r[h][v]);
      }
    }
  for (int h = 0; h < NR; ++h)
    for (int v = 0; v < NV; ++v) {
      float* o = a + size_t(h) * acc_stride + 8 * v;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), r[h][v]));
    }
}

// acc[i] += sum_t p_it (scale_tg code_tc + zero_tg). Runs of kRun tokens: each block of up to 32
// channels decoded once for the run into cf, then two query rows at a time accumulate it in
// registers (8 FMA chains); the zero terms sum_t p_it zero_tg are added once per group.
template <int B>
void v_accum_impl(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group,
                  const float* p, int p_stride, int n_q, float* acc) {
  constexpr int kRun = 32;
  const int ng = head_dim / group, pb = head_dim / 8;
  alignas(32) float cf[kRun * 32];
  float sc[kRun][kvg_max_head_dim / 16];
  alignas(32) float ze[kvg_max_head_dim / 16][kRun];  // by group, so the zero terms are 8-token dots
  for (int t0 = 0; t0 < n; t0 += kRun) {
    const int nt = std::min(kRun, n - t0);
    for (int u = 0; u < kRun; ++u)
      for (int g = 0; g < ng; ++g) {
        const uint8_t* row = u < nt ? rows + size_t(t0 + u) * row_bytes : nullptr;
        sc[u][g] = row ? f16_to_f32(kvg_load_f16(row, g)) : 0.f;
        ze[g][u] = row ? f16_to_f32(kvg_load_f16(row, ng + g)) : 0.f;
      }
    for (int i = 0; i < n_q; ++i) {  // zero terms
      float* a = acc + size_t(i) * head_dim;
      alignas(32) float pi[kRun] = {};
      std::copy(p + size_t(i) * p_stride + t0, p + size_t(i) * p_stride + t0 + nt, pi);
      for (int g = 0; g < ng; ++g) {
        __m256 z8 = _mm256_setzero_ps();
        for (int u = 0; u < kRun; u += 8) z8 = _mm256_fmadd_ps(_mm256_load_ps(pi + u), _mm256_load_ps(ze[g] + u), z8);
        const float z = hsum(z8);
        for (int c = g * group; c < (g + 1) * group; ++c) a[c] += z;
      }
    }
    for (int c0 = 0; c0 < head_dim; c0 += 32) {
      const int nv = std::min(32, head_dim - c0) / 8;  // vectors in this block (4, or 2 at a 16-channel tail)
      for (int u = 0; u < nt; ++u) {
        const uint8_t* planes = rows + size_t(t0 + u) * row_bytes + size_t(ng) * 4;
        if (nv == 4) {
          codes32<B>(planes, pb, c0 / 32, cf + 32 * u);
        } else {
          for (int v = 0; v < nv; ++v) _mm256_store_ps(cf + 32 * u + 8 * v, codes8<B>(planes, pb, c0 / 8 + v));
        }
      }
      int gv[4];
      for (int v = 0; v < nv; ++v) gv[v] = (c0 + 8 * v) / group;
      const bool one_group = gv[0] == gv[nv - 1];
      for (int i = 0; i < n_q; i += 2) {
        float* a = acc + size_t(i) * head_dim + c0;
        const float* pi = p + size_t(i) * p_stride + t0;
        if (n_q - i >= 2) {
          nv == 4 ? accum_block<2, 4>(cf, nt, pi, p_stride, sc, gv, one_group, a, head_dim)
                  : accum_block<2, 2>(cf, nt, pi, p_stride, sc, gv, one_group, a, head_dim);
        } else {
          nv == 4 ? accum_block<1, 4>(cf, nt, pi, p_stride, sc, gv, one_group, a, head_dim)
                  : accum_block<1, 2>(cf, nt, pi, p_stride, sc, gv, one_group, a, head_dim);
        }
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
