// AVX2 kernels of the tiled int8 codec (layout and error bounds in kv/int8_tiled.h). Without
// VNNI the 8-bit dots go through VPMADDWD: the codes widened to int16 (VPMOVZXBW / VPMOVSXBW as
// they are loaded) against int16 operands, two products per int32 lane, never saturating:
//  scores: the key's u8 image c + 128 against the query's two digits as one int16,
//          q16 = 254 q8 + q8lo (|(c + 128) q16| <= 255 * 32385), one VPMADDWD per 4 tokens x 4
//          dims and query row; the 128 terms leave with qs8 as in the reference;
//  sums:   the s8 codes against the quantized weights as int16 (u8 or s8), one VPMADDWD per 4
//          channels x 4 tokens and query row.
// Each int32 lane then holds a pair's partial dot; VPHADDD of the two halves' accumulators gives
// the 8 tokens (channels) in the order 0 1 4 5 2 3 6 7, which one permutation (pair_order(), its
// own inverse) undoes. The integer dots are the reference's exactly: scores bit-identical, sums
// up to f32 order.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kv/int4_tiled.h"
#include "kv/int8_tiled.h"
#include "kv/prefetch_along.h"
#include "kv/tiles_avx2.h"
#include "kv/tiles_ref.h"

namespace kvq {
namespace {

// Lane order of VPHADDD(a, b) over the pair sums of two 4-item halves, and back.
inline __m256i pair_order() { return _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); }

// Four int16 values (8 bytes) broadcast to every 64-bit lane.
inline __m256i bcast64_avx2(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}

// 8 tokens (half of a tile: `half` 0 or 1) for NQ query rows.
template <int NQ>
void scores_half(const Int8TiledLayout& L, const Int8tQueryRow* qr, const uint8_t* tp, int half, __m256* res) {
  const __m256i perm = pair_order();
  const uint8_t* codes = tp + L.code_off + 32 * half;
  __m256 facc[NQ];
  for (int h = 0; h < NQ; ++h) facc[h] = _mm256_setzero_ps();
  for (int b = 0; b < L.hd / 32; ++b) {
    __m256i a0[NQ], a1[NQ];  // tokens 0..3 / 4..7 of the half, a pair of dims per int32 lane
    for (int h = 0; h < NQ; ++h) a0[h] = a1[h] = _mm256_setzero_si256();
    for (int o = 8 * b; o < 8 * b + 8; ++o) {
      const __m256i x0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 64 * o)));
      const __m256i x1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 64 * o + 16)));
      for (int h = 0; h < NQ; ++h) {
        const __m256i qv = bcast64_avx2(qr[h].q16 + 4 * o);
        a0[h] = _mm256_add_epi32(a0[h], _mm256_madd_epi16(x0, qv));
        a1[h] = _mm256_add_epi32(a1[h], _mm256_madd_epi16(x1, qv));
      }
    }
    // q8_0t: the block's scales of the 8 tokens, in the lanes' order.
    const __m256 sv = L.block_scales ? _mm256_permutevar8x32_ps(tile_load_f16x8_avx2(tp + 32 * size_t(b) + 16 * size_t(half)), perm)
                                     : _mm256_setzero_ps();
    for (int h = 0; h < NQ; ++h) {
      // = the reference's 254 <c + 128, q8> + <c + 128, q8lo> - qs8 (the 128 terms cancel).
      const __m256i dot = _mm256_sub_epi32(_mm256_hadd_epi32(a0[h], a1[h]), _mm256_set1_epi32(qr[h].qs8[b]));
      if (L.block_scales) {  // q8_0t: the reference's fma(float(dot) * dq_b, d_tb, facc)
        facc[h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(qr[h].dq[b])), sv, facc[h]);
      } else {
        facc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(qr[h].dq[b]), facc[h]);
      }
    }
  }
  for (int h = 0; h < NQ; ++h) facc[h] = _mm256_permutevar8x32_ps(facc[h], perm);
  if (L.block_scales) {
    for (int h = 0; h < NQ; ++h) res[h] = facc[h];
    return;
  }
  const __m256 sv = _mm256_loadu_ps(reinterpret_cast<const float*>(tp) + 8 * half);
  for (int h = 0; h < NQ; ++h) res[h] = _mm256_mul_ps(facc[h], sv);
}

template <int NQ>
void scores_pass(const Int8TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  Int8tQueryRow qr[NQ];
  for (int h = 0; h < NQ; ++h) qr[h] = int8t_query_row(L, qp, h);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const KvPrefetchAlong along = kv_prefetch_along;
  for (int tile = tile0; tile < tile1; ++tile) {
    kv_prefetch_along_step(along, tile - tile0, tile1 - tile0);
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    for (int half = 0; half < 2; ++half) {
      const int base = tile * 16 + 8 * half;
      if (std::min(8, t0 + n - base) <= std::max(0, t0 - base)) continue;  // no token of the range
      __m256 res[NQ];
      scores_half<NQ>(L, qr, tp, half, res);
      for (int h = 0; h < NQ; ++h) tile_store_half_avx2(out + size_t(h) * size_t(out_stride), base, t0, n, res[h]);
    }
  }
}

// Rows h < NQ of one tile and scale block, w[h] = p_t s_t (two halves), rounded as
// tile_quantize_weights_ref does (int4t_weight_step's step, nearest-even rounding, clamp) into
// out[h] (16 int16 in token order), steps in dw[h]: the rows' maxima in one tree and their steps
// in two vector divisions (as tile_quantize_group_weights_avx2), not two scalar ones per row.
template <int NQ>
inline void quantize_weights(const __m256 (*w)[2], bool u8, int16_t (*out)[16], float* dw) {
  const __m256 sign = _mm256_set1_ps(-0.f), zero = _mm256_setzero_ps();
  const float levels = u8 ? kv_int4t_u8_levels : kv_int4t_s8_levels;
  const __m256 lv = _mm256_set1_ps(levels);
  __m256 wa[4];
  for (int h = 0; h < 4; ++h)
    wa[h] = h < NQ ? _mm256_max_ps(_mm256_andnot_ps(sign, w[h][0]), _mm256_andnot_ps(sign, w[h][1])) : zero;
  const __m256 wmax = tile_max4x8_avx2(wa);  // lanes h and 4 + h: row h's maximum
  alignas(32) float steps[8];
  _mm256_store_ps(steps, _mm256_div_ps(wmax, lv));
  const __m256 inv = _mm256_and_ps(_mm256_div_ps(lv, wmax), _mm256_cmp_ps(wmax, _mm256_set1_ps(kv_tile_wmin), _CMP_GE_OQ));
  const __m256i lo = _mm256_set1_epi32(u8 ? 0 : -int(kv_int4t_s8_levels)), hi = _mm256_set1_epi32(int(levels));
  for (int h = 0; h < NQ; ++h) {
    const __m256 iv = _mm256_permutevar_ps(inv, _mm256_set1_epi32(h));
    const __m256i q0 = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w[h][0], iv)), lo), hi);
    const __m256i q1 = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w[h][1], iv)), lo), hi);
    // VPACKSSDW interleaves the halves' 128-bit lanes: tokens 0-3 8-11 4-7 12-15; VPERMQ restores them.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[h]),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), _MM_SHUFFLE(3, 1, 2, 0)));
    dw[h] = steps[h];
  }
}

// Segments of up to kSegTiles tiles: every tile's weights quantized first (per scale block, the
// whole head for int8t, 32 channels for q8_0t, with the reference's quantization), then per tile
// and 8 channels the integer dots of the NQ rows (two int32 chains a row) flushed with the tile's
// step into a local f32 accumulator kept in VPHADDD's lane order, which is permuted and added to
// acc once per call. Only the chains live in registers across the token quads (no f32
// accumulator per row held across tiles: at 4 rows that spilled the chains).
template <int NQ>
void accum_pass(const Int8TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0, int n, bool u8,
                float* acc) {
  constexpr int kSegTiles = 4;
  constexpr int kMaxSb = kv_max_head_dim / 32;
  const int hd = L.hd;
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const int nsb = L.block_scales ? hd / 32 : 1, chunks = hd / 16 / nsb;
  const __m256i perm = pair_order();
  alignas(32) int16_t w16[kSegTiles][kMaxSb][NQ][16];
  float dw[kSegTiles][kMaxSb][NQ];
  alignas(32) float lacc[NQ][kv_max_head_dim];
  for (int h = 0; h < NQ; ++h) std::memset(lacc[h], 0, sizeof(float) * size_t(hd));
  const KvPrefetchAlong along = kv_prefetch_along;
  const int n_seg = (tile1 - tile0 + kSegTiles - 1) / kSegTiles;
  for (int seg = tile0; seg < tile1; seg += kSegTiles) {
    kv_prefetch_along_step(along, (seg - tile0) / kSegTiles, n_seg);
    const int nt = std::min(kSegTiles, tile1 - seg);
    for (int tt = 0; tt < nt; ++tt) {
      const int base = (seg + tt) * 16;
      const uint8_t* tp = block + size_t(seg + tt) * L.tile_bytes;
      __m256 pv[NQ][2];
      __m256 mk0 = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), mk1 = mk0;
      if (base >= t0 && base + 16 <= t0 + n) {
        for (int h = 0; h < NQ; ++h) {
          const float* ph = p + size_t(h) * size_t(p_stride) + size_t(base - t0);
          pv[h][0] = _mm256_loadu_ps(ph);
          pv[h][1] = _mm256_loadu_ps(ph + 8);
        }
      } else {
        // Lanes outside [t0, t0 + n) weigh 0 and their scales (anything, NaN included) are masked off.
        alignas(32) int32_t mi[16];
        for (int j = 0; j < 16; ++j) mi[j] = base + j >= t0 && base + j < t0 + n ? -1 : 0;
        mk0 = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mi)));
        mk1 = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mi + 8)));
        for (int h = 0; h < NQ; ++h) {
          alignas(32) float pt[16];
          const float* ph = p + size_t(h) * size_t(p_stride);
          for (int j = 0; j < 16; ++j) pt[j] = mi[j] ? ph[base + j - t0] : 0.f;
          pv[h][0] = _mm256_load_ps(pt);
          pv[h][1] = _mm256_load_ps(pt + 8);
        }
      }
      for (int sb = 0; sb < nsb; ++sb) {
        __m256 s0, s1;
        if (L.block_scales) {
          s0 = tile_load_f16x8_avx2(tp + 32 * size_t(sb));
          s1 = tile_load_f16x8_avx2(tp + 32 * size_t(sb) + 16);
        } else {
          s0 = _mm256_loadu_ps(reinterpret_cast<const float*>(tp));
          s1 = _mm256_loadu_ps(reinterpret_cast<const float*>(tp) + 8);
        }
        s0 = _mm256_and_ps(s0, mk0);
        s1 = _mm256_and_ps(s1, mk1);
        __m256 w[NQ][2];
        for (int h = 0; h < NQ; ++h) {
          w[h][0] = _mm256_mul_ps(pv[h][0], s0);
          w[h][1] = _mm256_mul_ps(pv[h][1], s1);
        }
        quantize_weights<NQ>(w, u8, w16[tt][sb], dw[tt][sb]);
      }
    }
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* codes = block + size_t(seg + tt) * L.tile_bytes + L.code_off;
      for (int c = 0, sb = 0, cs = 0; c < hd / 16; ++c) {
        if (cs == chunks) {  // chunk c starts the next scale block
          cs = 0;
          ++sb;
        }
        ++cs;
        for (int half = 0; half < 2; ++half) {  // channels 16c + 8 * half .. + 7
          __m256i a0[NQ], a1[NQ];  // channels 0..3 / 4..7 of the half, a pair of tokens per int32 lane
          for (int h = 0; h < NQ; ++h) a0[h] = a1[h] = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) {
            const uint8_t* src = codes + 64 * (4 * c + k) + 32 * half;
            const __m256i y0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
            const __m256i y1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
            for (int h = 0; h < NQ; ++h) {
              const __m256i wv = bcast64_avx2(&w16[tt][sb][h][4 * k]);
              a0[h] = _mm256_add_epi32(a0[h], _mm256_madd_epi16(y0, wv));
              a1[h] = _mm256_add_epi32(a1[h], _mm256_madd_epi16(y1, wv));
            }
          }
          for (int h = 0; h < NQ; ++h) {
            float* la = lacc[h] + 16 * c + 8 * half;
            _mm256_store_ps(la, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(a0[h], a1[h])),
                                                _mm256_set1_ps(dw[tt][sb][h]), _mm256_load_ps(la)));
          }
        }
      }
    }
  }
  for (int h = 0; h < NQ; ++h)
    for (int d = 0; d < hd; d += 8) {
      float* a = acc + size_t(h) * size_t(hd) + size_t(d);
      _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_permutevar8x32_ps(_mm256_load_ps(lacc[h] + d), perm)));
    }
}

}  // namespace

// Both kernels take the query rows two a pass: a pass of 4 rows kept more int32 chains than the 16
// registers hold, and the spilled chains made it slower than two passes reading the codes twice
// (bench/BENCHMARKS.md, "The int8 tiles on AVX2").
void int8t_scores_avx2(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes_of<2>(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void int8t_accum_avx2(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc) {
  if (n <= 0) return;
  const bool u8 = tiles_weights_nonneg_avx2(p, p_stride, n_q, n);
  tile_row_passes_of<2>(n_q, [&](int i, auto m) {
    accum_pass<decltype(m)::value>(L, p + size_t(i) * size_t(p_stride), p_stride, block, t0, n, u8,
                                   acc + size_t(i) * size_t(L.hd));
  });
}

}  // namespace kvq
