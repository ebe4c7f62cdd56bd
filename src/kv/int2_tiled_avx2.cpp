// AVX2 kernels of the tiled int2 codec and kivi2t's key scores (layout and error bounds in
// kv/int2_tiled.h): the arithmetic of the AVX-512 ones with VPMADDUBSW (u8 x s8, two products per
// int16) in place of VPDPBUSD, int16 chains widened once per 32-dim block (scores) or tile
// (weighted sum), as int4t's AVX2 kernels.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kv/int2_tiled.h"
#include "kv/tiles_avx2.h"

namespace kvq {
namespace {


inline __m256i plane(__m256i x, int r) {
  const __m256i m2 = _mm256_set1_epi8(0x03);
  return r == 0 ? _mm256_and_si256(x, m2) : _mm256_and_si256(_mm256_srli_epi16(x, 2 * r), m2);
}

// Exact dots of both 8-token halves of a K tile's 32-dim block b (bytes 0..31 and 32..63 of the
// two 64-byte records) with each row's int8 query. int16 chain per (row, half): 8 VPMADDUBSW of
// at most 2 * 3 * 127, 6096 in all.
template <int NQ>
inline void key_block_dots(const uint8_t* codes, int b, const int8_t* const* q8, __m256i (*dot)[2]) {
  __m256i s16[NQ][2];
  for (int h = 0; h < NQ; ++h) s16[h][0] = s16[h][1] = _mm256_setzero_si256();
  for (int o = 2 * b; o < 2 * b + 2; ++o)
    for (int e = 0; e < 2; ++e) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o + 32 * e));
      const __m256i p0 = plane(x, 0), p1 = plane(x, 1), p2 = plane(x, 2), p3 = plane(x, 3);
      for (int h = 0; h < NQ; ++h) {
        const int8_t* q = q8[h] + 16 * o;
        const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(p0, tile_bcast32_avx2(q)),
                                           _mm256_maddubs_epi16(p1, tile_bcast32_avx2(q + 4)));
        const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(p2, tile_bcast32_avx2(q + 8)),
                                           _mm256_maddubs_epi16(p3, tile_bcast32_avx2(q + 12)));
        s16[h][e] = _mm256_add_epi16(s16[h][e], _mm256_add_epi16(a, c));
      }
    }
  for (int h = 0; h < NQ; ++h) {
    dot[h][0] = tile_widen_avx2(s16[h][0]);
    dot[h][1] = tile_widen_avx2(s16[h][1]);
  }
}

template <int NQ>
void scores_pass(const Int4TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  tiles_scores_pass_avx2<NQ>(L, qp, block, t0, n, out, out_stride,
                             [](const uint8_t* codes, int b, const int8_t* const* q8, __m256i(*dot)[2]) {
                               key_block_dots<NQ>(codes, b, q8, dot);
                             });
}

template <int NQ>
void kivi_scores_pass(const int8_t* q8, const float* dq, const float* cz, int hd, const uint8_t* tiles, int t0,
                      int n, float* out, int out_stride) {
  const size_t tile_bytes = int2t_code_bytes(hd);
  const int nb = hd / 32;
  const int8_t* qh[NQ];
  for (int h = 0; h < NQ; ++h) qh[h] = q8 + size_t(h) * size_t(hd);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* codes = tiles + size_t(tile) * tile_bytes;
    __m256 facc[NQ][2];
    for (int h = 0; h < NQ; ++h) facc[h][0] = facc[h][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      __m256i dot[NQ][2];
      key_block_dots<NQ>(codes, b, qh, dot);
      for (int h = 0; h < NQ; ++h) {
        const __m256 d = _mm256_set1_ps(dq[size_t(h) * size_t(nb) + size_t(b)]);
        facc[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][0]), d, facc[h][0]);
        facc[h][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][1]), d, facc[h][1]);
      }
    }
    for (int h = 0; h < NQ; ++h)
      for (int e = 0; e < 2; ++e)
        tile_store_half_avx2(out + size_t(h) * size_t(out_stride), tile * 16 + 8 * e, t0, n,
                   _mm256_add_ps(facc[h][e], _mm256_set1_ps(cz[h])));
  }
}

}  // namespace

void int2t_scores_avx2(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

// The weighted sum: tiles_accum_avx2 with int2t's crumbs, a chunk's 2 octet loads split into 8
// planes (4 token quads x 2 channel halves); u8 weights x s8 codes 4 quads * 2 * 255 * 3 = 6120, or
// s8 x u8 4 * 2 * 3 * 127 per int16.
void int2t_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc) {
  tiles_accum_avx2(L, p, p_stride, n_q, block, t0, n, acc,
                   [](const uint8_t* codes, int c, int half, __m256i* lo, __m256i* hi) {
                     const uint8_t* cp = codes + size_t(c) * 128 + 32 * size_t(half);
                     for (int o = 0; o < 2; ++o) {
                       const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * o));
                       lo[2 * o] = plane(x, 0);
                       hi[2 * o] = plane(x, 1);
                       lo[2 * o + 1] = plane(x, 2);
                       hi[2 * o + 1] = plane(x, 3);
                     }
                   });
}

void kivi2t_scores_avx2(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                        int t0, int n, float* out, int out_stride) {
  if (n <= 0) return;
  const int nb = hd / 32;
  tile_row_passes(n_q, [&](int i, auto m) {
    kivi_scores_pass<decltype(m)::value>(q8 + size_t(i) * size_t(hd), dq + size_t(i) * size_t(nb), cz + i, hd, tiles,
                                         t0, n, out + size_t(i) * size_t(out_stride), out_stride);
  });
}

}  // namespace kvq
