// AVX2 score kernel of kivi4t's keys (kv/kivi_tiled.h): the AVX-512 arithmetic with VPMADDUBSW
// (u8 codes x s8 query, two products per int16) as in int4t's AVX2 scores: per 32-dim block the
// 8 VPMADDUBSW sums of a half tile stay within 8 * 2 * 15 * 127 = 30480, one int16 chain and one
// widening per (row, half, block).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kv/grouped_common.h"
#include "kv/kivi_tiled.h"
#include "kv/kv_rows.h"
#include "kv/tiles_avx2.h"

namespace kvq {
namespace {

template <int NQ>
void scores_pass(const int8_t* q8, const float* dq, const float* cz, int hd, const uint8_t* tiles, int t0, int n,
                 float* out, int out_stride) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const size_t tile_bytes = size_t(8 * hd);
  const int nb = hd / 32;
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* codes = tiles + size_t(tile) * tile_bytes;
    __m256 facc[NQ][2];
    for (int h = 0; h < NQ; ++h) facc[h][0] = facc[h][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      __m256i s16[NQ][2];
      for (int h = 0; h < NQ; ++h) s16[h][0] = s16[h][1] = _mm256_setzero_si256();
      for (int o = 4 * b; o < 4 * b + 4; ++o) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o + 32));
        const __m256i lo0 = _mm256_and_si256(x0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(x0, 4), m4);
        const __m256i lo1 = _mm256_and_si256(x1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(x1, 4), m4);
        for (int h = 0; h < NQ; ++h) {
          const int8_t* qh = q8 + size_t(h) * size_t(hd);
          const __m256i ql = tile_bcast32_avx2(qh + 8 * o), qhi = tile_bcast32_avx2(qh + 8 * o + 4);
          s16[h][0] = _mm256_add_epi16(
              s16[h][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, ql), _mm256_maddubs_epi16(hi0, qhi)));
          s16[h][1] = _mm256_add_epi16(
              s16[h][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, ql), _mm256_maddubs_epi16(hi1, qhi)));
        }
      }
      for (int h = 0; h < NQ; ++h) {
        const __m256 d = _mm256_set1_ps(dq[size_t(h) * size_t(nb) + size_t(b)]);
        facc[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tile_widen_avx2(s16[h][0])), d, facc[h][0]);
        facc[h][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tile_widen_avx2(s16[h][1])), d, facc[h][1]);
      }
    }
    for (int h = 0; h < NQ; ++h)
      for (int e = 0; e < 2; ++e)
        tile_store_half_avx2(out + size_t(h) * size_t(out_stride), tile * 16 + 8 * e, t0, n,
                             _mm256_add_ps(facc[h][e], _mm256_set1_ps(cz[h])));
  }
}

}  // namespace

// kivit_fold_query_ref's arithmetic bit for bit (see the AVX-512 fold): the C lanes 0..7 and
// 8..15 in two accumulators, the block maximum exact (VMAXPS with the new value first returns the
// running maximum for a NaN lane: NaN lanes ignored, as std::max in the reference), the step and
// its inverse in IEEE vector divisions. The rounding: the product clamped to [-127, 127] first
// (VMAXPS against -127 returns -127 for a NaN product, as the reference's clamp does), then
// VCVTPS2DQ to nearest even: on [-127, 127] clamping before rounding equals the reference's
// rounding before clamping. A block's 32 bytes are packed at once.
namespace {

template <int FHD>
void fold_query(const uint8_t* params, const float* q, int n_q, int hd_arg, int8_t* q8, float* dq, float* cz) {
  const int hd = FHD ? FHD : hd_arg;
  const int nb = hd / 32;
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  alignas(32) float sc[1024], ze[1024];
  for (int d = 0; d < hd; d += 8) {
    _mm256_store_ps(sc + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 2 * size_t(d)))));
    _mm256_store_ps(ze + d,
                    _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + 2 * size_t(hd + d)))));
  }
  // Three passes so that the blocks' divisions overlap instead of each waiting on the last: the
  // products and block maxima of every row, then every block's step and inverse in vector
  // divisions (IEEE, as the scalar ones), then the rounding.
  constexpr int kMaxRows = 8;
  for (int i0 = 0; i0 < n_q; i0 += kMaxRows) {
    const int nr = std::min(kMaxRows, n_q - i0);
    alignas(32) float qs[kMaxRows][kv_max_head_dim];
    alignas(32) float amax[kMaxRows * kv_max_head_dim / 32 + 8];
    std::fill(amax + nr * nb, amax + (nr * nb + 7) / 8 * 8, 0.f);  // the last division vector's unused lanes
    for (int r = 0; r < nr; ++r) {
      const int i = i0 + r;
      const float* x = q + size_t(i) * size_t(hd);
      __m256 c[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int b0 = 0; b0 < nb; b0 += 4) {  // four blocks' maxima reduced at once (max is exact)
        __m256 am[4];
        for (int u = 0; u < 4; ++u) {
          am[u] = _mm256_setzero_ps();
          if (b0 + u >= nb) continue;
          for (int e = 0; e < 4; ++e) {
            const int d = 32 * (b0 + u) + 8 * e;
            const __m256 xv = _mm256_loadu_ps(x + d);
            const __m256 v = _mm256_mul_ps(xv, _mm256_load_ps(sc + d));
            _mm256_store_ps(qs[r] + d, v);
            c[e & 1] = _mm256_fmadd_ps(xv, _mm256_load_ps(ze + d), c[e & 1]);
            am[u] = _mm256_max_ps(_mm256_and_ps(v, absmask), am[u]);  // a NaN lane leaves am
          }
        }
        alignas(32) float m[8];
        _mm256_store_ps(m, tile_max4x8_avx2(am));
        std::copy(m, m + std::min(4, nb - b0), amax + r * nb + b0);
      }
      alignas(32) float lane[kivit_c_lanes];
      _mm256_store_ps(lane, c[0]);
      _mm256_store_ps(lane + 8, c[1]);
      cz[i] = kivit_reduce_lanes(lane);
    }
    // step = amax / 127, inv = 1 / step when step > 0 and both are finite, else 0 (both 0 then).
    alignas(32) float inv[kMaxRows * kv_max_head_dim / 32 + 8];
    const __m256 zero = _mm256_setzero_ps(), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    for (int k = 0; k < nr * nb; k += 8) {
      const __m256 step = _mm256_div_ps(_mm256_load_ps(amax + k), _mm256_set1_ps(127.f));
      const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(step, zero, _CMP_GT_OQ), _mm256_cmp_ps(step, inf, _CMP_LT_OQ));
      __m256 iv = _mm256_and_ps(ok, _mm256_div_ps(_mm256_set1_ps(1.f), step));
      iv = _mm256_and_ps(iv, _mm256_cmp_ps(iv, inf, _CMP_LT_OQ));  // an inverse that overflowed: 0
      _mm256_store_ps(inv + k, iv);
      _mm256_store_ps(amax + k, _mm256_and_ps(_mm256_cmp_ps(iv, zero, _CMP_GT_OQ), step));  // dq
    }
    for (int r = 0; r < nr; ++r) {
      const int i = i0 + r;
      int8_t* r8 = q8 + size_t(i) * size_t(hd);
      for (int b = 0; b < nb; ++b) {
        const __m256 iv = _mm256_set1_ps(inv[r * nb + b]);
        __m256i v[4];
        for (int e = 0; e < 4; ++e)
          v[e] = _mm256_cvtps_epi32(
              _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_load_ps(qs[r] + 32 * b + 8 * e), iv), lo), hi));
        // Per 128-bit lane the packs leave dwords v0 v1 v2 v3 (elements 0..3 of each, then 4..7).
        const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r8 + 32 * b),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        dq[size_t(i) * size_t(nb) + size_t(b)] = amax[r * nb + b];
      }
    }
  }
}

}  // namespace

void kivit_fold_query_avx2(const uint8_t* params, const float* q, int n_q, int hd, int8_t* q8, float* dq,
                           float* cz) {
  kvg_with_head_dim(hd, [&](auto fhd) { fold_query<fhd()>(params, q, n_q, hd, q8, dq, cz); });
}

void kivit_scores_avx2(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                       int t0, int n, float* out, int out_stride) {
  if (n <= 0) return;
  const int nb = hd / 32;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(q8 + size_t(i) * size_t(hd), dq + size_t(i) * size_t(nb), cz + i, hd, tiles, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

}  // namespace kvq
