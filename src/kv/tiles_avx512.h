// Small AVX-512 helpers of the tiled integer-dot kernels (int4t, int2t, int8t, kivi4t / kivi2t) and
// the weight quantization of int4t's / int2t's weighted sums, written once so that every kernel
// rounds the same way. Include only from *_avx512.cpp files (after core/avx512.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kv/int4_tiled.h"

namespace kvq {

// Four int8 values as one dword, broadcast to every lane (the VPDPBUSD operand).
inline __m512i tile_bcast32_avx512(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One f16 table row of a tile (16 tokens' scales or minimums) as f32.
inline __m512 tile_load_f16x16_avx512(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Valid lanes of a tile whose first token is `base`, for the range [t0, t0 + n).
inline __mmask16 tile_mask_avx512(int base, int t0, int n) {
  const int lo = std::max(0, t0 - base), hi = std::min(16, t0 + n - base);
  if (hi <= lo) return 0;
  return __mmask16(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// Stores the lanes of a tile's 16 scores (tokens base..base+15) that lie in [t0, t0 + n) at
// o[token - t0]: one store for a whole tile, a copy of the valid lanes at the range's edges.
inline void tile_store_avx512(float* o, int base, int t0, int n, __m512 v) {
  const int lo = std::max(0, t0 - base), hi = std::min(16, t0 + n - base);
  if (lo == 0 && hi == 16) {
    _mm512_storeu_ps(o + (base - t0), v);
  } else if (hi > lo) {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    std::memcpy(o + (base + lo - t0), tmp + lo, sizeof(float) * size_t(hi - lo));
  }
}

// int4t_weights_nonneg, 16 weights per compare (the scalar scan with its early exit cost a third
// of the weighted sum's time).
inline bool tiles_weights_nonneg_avx512(const float* p, int p_stride, int n_q, int n) {
  __mmask16 neg = 0;
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 tail = __mmask16((1u << (n % 16)) - 1u);
  for (int i = 0; i < n_q; ++i) {
    const float* r = p + size_t(i) * size_t(p_stride);
    int t = 0;
    for (; t + 16 <= n; t += 16) neg |= _mm512_cmp_ps_mask(_mm512_loadu_ps(r + t), zero, _CMP_LT_OQ);
    if (t < n) neg |= _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, r + t), zero, _CMP_LT_OQ);
  }
  return neg == 0;
}

// Lanes 4h..4h+3 of the result = the largest of the 16 lanes of v[h], h < 4: 6 shuffles and 5
// maxima for four vectors instead of a reduction each.
inline __m512 tile_max4x16_avx512(const __m512* v) {
  const __m512 a = _mm512_max_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 b = _mm512_max_ps(_mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 c = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d = _mm512_max_ps(c, _mm512_permute_ps(c, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_max_ps(d, _mm512_permute_ps(d, _MM_SHUFFLE(2, 3, 0, 1)));
}

// The weight steps of one tile for up to 4 query rows at once, with the scalar arithmetic of
// int4t_weight_step: w[h] holds row h's 16 weights (zero for rows that do not exist); steps[4h]
// receives row h's dw = wmax / levels, and lanes 4h..4h+3 of the result its inv = levels / wmax
// (0 when wmax is 0). U8: 255 levels (every weight >= 0), else 127.
template <bool U8>
inline __m512 tile_weight_steps_avx512(const __m512* w, float* steps) {
  __m512 wa[4];
  for (int h = 0; h < 4; ++h) wa[h] = _mm512_abs_ps(w[h]);
  const __m512 wmax = tile_max4x16_avx512(wa);
  const __m512 lv = _mm512_set1_ps(U8 ? kv_int4t_u8_levels : kv_int4t_s8_levels);
  _mm512_store_ps(steps, _mm512_div_ps(wmax, lv));
  return _mm512_maskz_div_ps(_mm512_cmp_ps_mask(wmax, _mm512_setzero_ps(), _CMP_GT_OQ), lv, wmax);
}

// Row h's weights w rounded to int32 steps of tile_weight_steps_avx512's inv (the reference's
// nearbyint; the u8 / s8 saturation is the caller's conversion).
inline __m512i tile_weights_int_avx512(__m512 w, __m512 inv, int h) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(w, _mm512_permutexvar_ps(_mm512_set1_epi32(4 * h), inv)));
}

// Step 1 of int4t's / int2t's weighted sum for the tile at tp whose first token is `base`: per
// query row h < NQ of p (rows p_stride apart, weight of token t at p[t - t0]) and group g < ng,
// the weights w_t = p_t s_tg rounded to u8 (U8) or s8 steps in w8[h][g] with step dw[h][g], and
// the min term p_t m_tg added into the 16 lanes of msv[h][g]. Lanes outside [t0, t0 + n) weigh 0.
template <int NQ, bool U8, int MaxGroups>
[[gnu::always_inline]] inline void tile_quantize_group_weights_avx512(const float* p, int p_stride, int t0, int n,
                                                                      int base, const uint8_t* tp, size_t min_off,
                                                                      int ng, uint8_t (*w8)[MaxGroups][16],
                                                                      float (*dw)[MaxGroups],
                                                                      float (*msv)[MaxGroups][16]) {
  const __mmask16 mask = tile_mask_avx512(base, t0, n);
  const bool full = mask == 0xffff;
  __m512 pv[NQ];
  for (int h = 0; h < NQ; ++h) {
    const float* ph = p + size_t(h) * size_t(p_stride);
    pv[h] = full ? _mm512_loadu_ps(ph + (base - t0)) : _mm512_maskz_expandloadu_ps(mask, ph + std::max(0, base - t0));
  }
  for (int g = 0; g < ng; ++g) {
    // Masked: slots outside the range may hold anything (NaN scales of unwritten tokens).
    const __m512 sv = _mm512_maskz_mov_ps(mask, tile_load_f16x16_avx512(tp + 32 * size_t(g)));
    const __m512 mv = _mm512_maskz_mov_ps(mask, tile_load_f16x16_avx512(tp + min_off + 32 * size_t(g)));
    __m512 w[4];
    for (int h = 0; h < 4; ++h) w[h] = h < NQ ? _mm512_mul_ps(pv[h], sv) : _mm512_setzero_ps();
    alignas(64) float steps[16];
    const __m512 inv = tile_weight_steps_avx512<U8>(w, steps);
    for (int h = 0; h < NQ; ++h) {
      dw[h][g] = steps[4 * h];
      const __m512i wi = tile_weights_int_avx512(w[h], inv, h);
      _mm_store_si128(reinterpret_cast<__m128i*>(w8[h][g]),
                      U8 ? _mm512_cvtusepi32_epi8(wi) : _mm512_cvtsepi32_epi8(wi));
      _mm512_store_ps(msv[h][g], _mm512_fmadd_ps(pv[h], mv, _mm512_load_ps(msv[h][g])));
    }
  }
}

// Step 2 of int4t's / int2t's weighted sum over a segment of nt tiles (seg: the segment's first tile)
// whose weights tile_quantize_group_weights_avx512 stored in w8[tt] / dw[tt]: per chunk c of 32
// channels and tile, per token quad k the chunk's codes as u8 lanes (lo: channels 32c + i, hi:
// 32c + 16 + i) from quad_codes(tile_codes, c, k, &lo, &hi), 2 * NQ VPDPBUSD chains (u8 weights x
// codes when U8, else codes x s8 weights), flushed to f32 with the tile's step; the f32 sums go to
// acc once per segment.
template <int NQ, bool U8, int MaxGroups, class QuadCodes>
[[gnu::always_inline]] inline void tiles_accum_segment_avx512(const Int4TiledLayout& L, const uint8_t* seg, int nt,
                                                              const uint8_t (*w8)[NQ][MaxGroups][16],
                                                              const float (*dw)[NQ][MaxGroups], float* acc,
                                                              QuadCodes quad_codes) {
  for (int c = 0; c < L.hd / 32; ++c) {
    const int g = c * 32 / L.group;
    __m512 flo[NQ], fhi[NQ];
    for (int h = 0; h < NQ; ++h) flo[h] = fhi[h] = _mm512_setzero_ps();
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* codes = seg + size_t(tt) * L.tile_bytes + L.code_off;
      __m512i ilo[NQ], ihi[NQ];
      for (int h = 0; h < NQ; ++h) ilo[h] = ihi[h] = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {
        __m512i lo, hi;
        quad_codes(codes, c, k, &lo, &hi);
        for (int h = 0; h < NQ; ++h) {
          const __m512i wb = tile_bcast32_avx512(w8[tt][h][g] + 4 * k);
          if (U8) {
            ilo[h] = _mm512_dpbusd_epi32(ilo[h], wb, lo);
            ihi[h] = _mm512_dpbusd_epi32(ihi[h], wb, hi);
          } else {
            ilo[h] = _mm512_dpbusd_epi32(ilo[h], lo, wb);
            ihi[h] = _mm512_dpbusd_epi32(ihi[h], hi, wb);
          }
        }
      }
      for (int h = 0; h < NQ; ++h) {
        const __m512 s = _mm512_set1_ps(dw[tt][h][g]);
        flo[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo[h]), s, flo[h]);
        fhi[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi[h]), s, fhi[h]);
      }
    }
    for (int h = 0; h < NQ; ++h) {
      float* a = acc + size_t(h) * size_t(L.hd) + size_t(32 * c);
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), flo[h]));
      _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), fhi[h]));
    }
  }
}

// The min terms of int4t's / int2t's weighted sums, after the tiles: per query row h < NQ and group
// g < ng the 16 lanes of msv[h][g] (sum_t p_t m_tg) reduced once and added to the group's channels
// of acc row h (rows hd apart), times min_mul.
template <int NQ, int MaxGroups>
inline void tiles_add_min_terms_avx512(float (*msv)[MaxGroups][16], int ng, int group, int hd, float* acc,
                                       float min_mul = 1.f) {
  for (int h = 0; h < NQ; ++h)
    for (int g = 0; g < ng; ++g) {
      // min_mul: q4_0t's -8 (kv/int4_tiled.h)
      const __m512 m = _mm512_set1_ps(min_mul * _mm512_reduce_add_ps(_mm512_load_ps(msv[h][g])));
      float* a = acc + size_t(h) * size_t(hd) + size_t(g * group);
      for (int d = 0; d < group; d += 16) _mm512_storeu_ps(a + d, _mm512_add_ps(_mm512_loadu_ps(a + d), m));
    }
}

// int4t's / int2t's whole weighted sum (kv/int4_tiled.h) over tokens [t0, t0 + n) of a value block:
// row passes of up to 4 rows; per segment of 4 tiles the weights quantized ahead
// (tile_quantize_group_weights_avx512), then the channel loop (tiles_accum_segment_avx512 with the
// layout's quad_codes reader), then the min terms (times L.min_mul). U8 weights when every weight
// is >= 0 and the scales are (not q4_0t's signed ones), else s8.
template <int NQ, bool U8, class QuadCodes>
void tiles_accum_pass_avx512(const Int4TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0,
                             int n, float* acc, QuadCodes quad_codes) {
  constexpr int kSegTiles = 4;  // tiles whose weights are quantized ahead of the channel loop
  constexpr int kMaxGroups = 1024 / 32;
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  // Per (query row, group): the min term sum_t p_t m_tg, 16 lanes, reduced once per call.
  alignas(64) float msv[NQ][kMaxGroups][16];
  for (int h = 0; h < NQ; ++h)
    for (int g = 0; g < L.ng; ++g) _mm512_store_ps(msv[h][g], _mm512_setzero_ps());
  alignas(64) uint8_t w8[kSegTiles][NQ][kMaxGroups][16];
  float dw[kSegTiles][NQ][kMaxGroups];
  for (int seg = tile0; seg < tile1; seg += kSegTiles) {
    const int nt = std::min(kSegTiles, tile1 - seg);
    for (int tt = 0; tt < nt; ++tt)
      tile_quantize_group_weights_avx512<NQ, U8>(p, p_stride, t0, n, (seg + tt) * 16,
                                                 block + size_t(seg + tt) * L.tile_bytes, L.min_off, L.ng, w8[tt],
                                                 dw[tt], msv);
    tiles_accum_segment_avx512<NQ, U8>(L, block + size_t(seg) * L.tile_bytes, nt, w8, dw, acc, quad_codes);
  }
  tiles_add_min_terms_avx512<NQ>(msv, L.ng, L.group, L.hd, acc, L.min_mul);
}
template <class QuadCodes>
void tiles_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                        int n, float* acc, QuadCodes quad_codes) {
  if (n <= 0) return;
  const bool u8 = !L.signed_scales && tiles_weights_nonneg_avx512(p, p_stride, n_q, n);
  tile_row_passes(n_q, [&](int i, auto m) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    float* a = acc + size_t(i) * size_t(L.hd);
    if (u8) tiles_accum_pass_avx512<decltype(m)::value, true>(L, pi, p_stride, block, t0, n, a, quad_codes);
    else tiles_accum_pass_avx512<decltype(m)::value, false>(L, pi, p_stride, block, t0, n, a, quad_codes);
  });
}

}  // namespace kvq
