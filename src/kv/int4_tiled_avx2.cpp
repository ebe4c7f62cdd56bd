// AVX2 kernels of the tiled int4 codec (layout and error bounds in kv/int4_tiled.h): the
// arithmetic of the AVX-512 ones with VPMADDUBSW (u8 x s8, two products per int16) in place of
// VPDPBUSD. The int16 pair sums are added in int16 as long as the bound allows and widened once
// (VPMADDWD by ones), so the multiply ports do about one widening per 8 (scores) or 4 (weighted
// sum) VPMADDUBSW instead of one each.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kv/int4_tiled.h"
#include "kv/tiles_avx2.h"

namespace kvq {
namespace {

constexpr int kSegTiles = 4;  // tiles whose weights are quantized ahead of the channel loop
constexpr int kMaxGroups = 1024 / 32;

// Scores on whole tiles: both 8-token halves (bytes 0..31 and 32..63 of every 64-byte octet
// record) against the same query broadcasts. Per query block b (4 octets, low and high nibbles:
// 8 VPMADDUBSW per half) the int16 sums stay within 8 * 2 * 15 * 127 = 30480, so a block's dot
// is one int16 chain and one widening per (row, half).
template <int NQ>
void scores_pass(const Int4TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const int bpg = L.group / 32;
  Int4tQueryRow qr[NQ];
  for (int h = 0; h < NQ; ++h) qr[h] = int4t_query_row(L, qp, h);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off;
    __m256 score[NQ][2];
    for (int h = 0; h < NQ; ++h) score[h][0] = score[h][1] = _mm256_setzero_ps();
    for (int g = 0; g < L.ng; ++g) {
      __m256 facc[NQ][2];
      for (int h = 0; h < NQ; ++h) facc[h][0] = facc[h][1] = _mm256_setzero_ps();
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
        __m256i s16[NQ][2];
        for (int h = 0; h < NQ; ++h) s16[h][0] = s16[h][1] = _mm256_setzero_si256();
        for (int o = 4 * b; o < 4 * b + 4; ++o) {
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o + 32));
          const __m256i lo0 = _mm256_and_si256(x0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(x0, 4), m4);
          const __m256i lo1 = _mm256_and_si256(x1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(x1, 4), m4);
          for (int h = 0; h < NQ; ++h) {
            const __m256i ql = tile_bcast32_avx2(qr[h].q8 + 8 * o), qh = tile_bcast32_avx2(qr[h].q8 + 8 * o + 4);
            s16[h][0] = _mm256_add_epi16(
                s16[h][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, ql), _mm256_maddubs_epi16(hi0, qh)));
            s16[h][1] = _mm256_add_epi16(
                s16[h][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, ql), _mm256_maddubs_epi16(hi1, qh)));
          }
        }
        for (int h = 0; h < NQ; ++h) {
          const __m256 d = _mm256_set1_ps(qr[h].dq[b]);
          facc[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tile_widen_avx2(s16[h][0])), d, facc[h][0]);
          facc[h][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tile_widen_avx2(s16[h][1])), d, facc[h][1]);
        }
      }
      for (int e = 0; e < 2; ++e) {
        const __m256 sv = tile_load_f16x8_avx2(tp + 32 * size_t(g) + 16 * size_t(e));
        const __m256 mv = tile_load_f16x8_avx2(tp + L.min_off + 32 * size_t(g) + 16 * size_t(e));
        for (int h = 0; h < NQ; ++h) {
          score[h][e] = _mm256_fmadd_ps(facc[h][e], sv, score[h][e]);
          score[h][e] = _mm256_fmadd_ps(mv, _mm256_set1_ps(qr[h].qsum[g]), score[h][e]);
        }
      }
    }
    for (int e = 0; e < 2; ++e) {
      const int base = tile * 16 + 8 * e;
      const int lo = std::max(0, t0 - base), hi = std::min(8, t0 + n - base);
      if (hi <= lo) continue;
      for (int h = 0; h < NQ; ++h) {
        float* o = out + size_t(h) * size_t(out_stride);
        if (lo == 0 && hi == 8) {
          _mm256_storeu_ps(o + (base - t0), score[h][e]);
        } else {  // partial: only lanes inside [t0, t0 + n)
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, score[h][e]);
          std::memcpy(o + (base + lo - t0), tmp + lo, sizeof(float) * size_t(hi - lo));
        }
      }
    }
  }
}

// The weighted sum in segments of kSegTiles tiles: their weights quantized with vector
// arithmetic (the scalar steps of int4t_weight_step, bit for bit), then per tile, chunk of 32
// channels and 8-lane half, NQ * 2 int16 chains over the tile's 4 token quads, widened and scaled
// into acc once per tile (the f32 sums live in acc: registers hold the int16 chains).
// U8: all weights >= 0, u8 weights (255 levels) x s8 codes: 4 quads * 2 * 255 * 15 = 30600;
// else s8 weights x u8 codes: 4 * 2 * 15 * 127. Both fit int16.
template <int NQ, bool U8>
void accum_pass(const Int4TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0, int n,
                float* acc) {
  constexpr int NP = (NQ + 1) / 2;  // row pairs
  const int hd = L.hd, ng = L.ng, cpg = L.group / 32;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  // Per (row, group): the min term sum_t p_t m_tg in 8 lanes, reduced once per call.
  alignas(32) float msv[NQ][kMaxGroups][8];
  for (int h = 0; h < NQ; ++h)
    for (int g = 0; g < ng; ++g) _mm256_store_ps(msv[h][g], _mm256_setzero_ps());
  // (tile of the segment, group, row pair): quantized weights; (.., group, row h in lane h):
  // their steps. A segment's tiles are quantized before its channel loop reads them, so the
  // dword loads find the stores long retired.
  alignas(32) uint8_t w8[kSegTiles][kMaxGroups][NP][32];
  alignas(32) float dw[kSegTiles][kMaxGroups][8];
  for (int seg = tile0; seg < tile1; seg += kSegTiles) {
    const int nt = std::min(kSegTiles, tile1 - seg);
    for (int tt = 0; tt < nt; ++tt)
      tile_quantize_group_weights_avx2<NQ, U8>(p, p_stride, t0, n, (seg + tt) * 16,
                                               block + size_t(seg + tt) * L.tile_bytes, L.min_off, ng, w8[tt], dw[tt],
                                               msv);
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* codes = block + size_t(seg + tt) * L.tile_bytes + L.code_off;
      // Per (half, chunk) the tile's 4 token-quad loads are split into 8 code vectors once;
      // then each row's two int16 chains run and are flushed before the next row's: about 12
      // live registers (all rows' chains at once need 8 more and spilled). The group is
      // stepped along the one chunk loop (no c / cpg division; and in a loop per group the
      // compiler hoists the 16 weight broadcasts it shares, spilling most of them).
      for (int half = 0; half < 2; ++half)
        for (int c = 0, g = 0, cg = 0; c < hd / 32; ++c) {
            const uint8_t* cp = codes + size_t(c) * 256 + 32 * size_t(half);
            __m256i lo[4], hi[4];
            for (int k = 0; k < 4; ++k) {
              const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * k));
              lo[k] = _mm256_and_si256(x, m4);
              hi[k] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            }
            // Lanes: channel 32c + 8 half + i (low nibbles), 32c + 16 + 8 half + i (high).
            tile_accum_chunk_avx2<NQ, U8>(lo, hi, w8[tt][g], dw[tt][g], acc, hd, 32 * c + 8 * half);
            if (++cg == cpg) {  // chunk c + 1 starts the next group
              cg = 0;
              ++g;
            }
          }
    }
  }
  tiles_add_min_terms_avx2<NQ>(msv, ng, L.group, hd, acc, L.min_mul);
}

}  // namespace

void int4t_scores_avx2(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void int4t_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc) {
  if (n <= 0) return;
  const bool u8 = !L.signed_scales && tiles_weights_nonneg_avx2(p, p_stride, n_q, n);
  tile_row_passes(n_q, [&](int i, auto m) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    float* a = acc + size_t(i) * size_t(L.hd);
    if (u8) accum_pass<decltype(m)::value, true>(L, pi, p_stride, block, t0, n, a);
    else accum_pass<decltype(m)::value, false>(L, pi, p_stride, block, t0, n, a);
  });
}

}  // namespace kvq
