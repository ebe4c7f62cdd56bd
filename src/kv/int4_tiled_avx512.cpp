// AVX-512 VNNI kernels of the tiled int4 codec (layout and error bounds in kv/int4_tiled.h): one
// token per int32 lane, so a tile's 16 scores or a tile's contribution to 32 channels are plain
// VPDPBUSD chains with the other operand an embedded dword broadcast.
#include "core/avx512.h"

#include <algorithm>
#include <cstring>

#include "kv/int4_tiled.h"
#include "kv/prefetch_along.h"
#include "kv/tiles_avx512.h"

namespace kvq {
namespace {


template <int NQ>
void scores_pass(const Int4TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const int bpg = L.group / 32;
  Int4tQueryRow qr[NQ];
  for (int h = 0; h < NQ; ++h) qr[h] = int4t_query_row(L, qp, h);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const KvPrefetchAlong along = kv_prefetch_along;
  for (int tile = tile0; tile < tile1; ++tile) {
    kv_prefetch_along_step(along, tile - tile0, tile1 - tile0);
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off;
    __m512 score[NQ];
    for (int h = 0; h < NQ; ++h) score[h] = _mm512_setzero_ps();
    for (int g = 0; g < L.ng; ++g) {
      __m512 facc[NQ];
      for (int h = 0; h < NQ; ++h) facc[h] = _mm512_setzero_ps();
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
        // Low- and high-nibble dots in separate chains: 2 * NQ independent VPDPBUSD chains.
        __m512i ilo[NQ], ihi[NQ];
        for (int h = 0; h < NQ; ++h) ilo[h] = ihi[h] = _mm512_setzero_si512();
        for (int o = 4 * b; o < 4 * b + 4; ++o) {
          const __m512i x = _mm512_loadu_si512(codes + 64 * o);
          const __m512i lo = _mm512_and_si512(x, m4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
          for (int h = 0; h < NQ; ++h) {
            ilo[h] = _mm512_dpbusd_epi32(ilo[h], lo, tile_bcast32_avx512(qr[h].q8 + 8 * o));
            ihi[h] = _mm512_dpbusd_epi32(ihi[h], hi, tile_bcast32_avx512(qr[h].q8 + 8 * o + 4));
          }
        }
        for (int h = 0; h < NQ; ++h)
          facc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ilo[h], ihi[h])), _mm512_set1_ps(qr[h].dq[b]),
                                    facc[h]);
      }
      const __m512 sv = tile_load_f16x16_avx512(tp + 32 * size_t(g));
      const __m512 mv = tile_load_f16x16_avx512(tp + L.min_off + 32 * size_t(g));
      for (int h = 0; h < NQ; ++h) {
        score[h] = _mm512_fmadd_ps(facc[h], sv, score[h]);
        score[h] = _mm512_fmadd_ps(mv, _mm512_set1_ps(qr[h].qsum[g]), score[h]);
      }
    }
    for (int h = 0; h < NQ; ++h) tile_store_avx512(out + size_t(h) * size_t(out_stride), tile * 16, t0, n, score[h]);
  }
}

}  // namespace

void int4t_scores_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride) {
  // q5_0t / q5_1t / iq4_nlt: the AVX2 kernels (no AVX-512 variant of the 5-bit codes or the grid).
  if (L.code_bits == 5 || L.lut) return int4t_scores_avx2(L, qp, n_q, block, t0, n, out, out_stride);
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void int4t_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                        int t0, int n, float* acc) {
  if (L.code_bits == 5 || L.lut) return int4t_accum_avx2(L, p, p_stride, n_q, block, t0, n, acc);
  // Channel chunks of 32: per tile 4 loads (token quads), split into low and high nibbles.
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  tiles_accum_avx512(L, p, p_stride, n_q, block, t0, n, acc,
                     [m4](const uint8_t* codes, int c, int k, __m512i* lo, __m512i* hi) {
                       const __m512i x = _mm512_loadu_si512(codes + size_t(c) * 256 + 64 * k);
                       *lo = _mm512_and_si512(x, m4);
                       *hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
                     });
}

}  // namespace kvq
