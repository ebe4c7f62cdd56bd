// Small AVX2 helpers of the tiled integer-dot kernels (int4t, int2t, int8t, kivi4t / kivi2t) and
// the weight quantization of int4t's / int2t's weighted sums, written once so that every kernel
// rounds the same way. Include only from *_avx2.cpp files.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kv/int4_tiled.h"
#include "kv/prefetch_along.h"

namespace kvq {

// Four int8 values as one dword, broadcast to every lane (the VPMADDUBSW operand).
inline __m256i tile_bcast32_avx2(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Eight f16 values of a tile's table row (8 tokens' scales or minimums) as f32.
inline __m256 tile_load_f16x8_avx2(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// int16 pairs -> int32 lanes.
inline __m256i tile_widen_avx2(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }

// Stores the lanes of a half tile's 8 scores (tokens base..base+7) that lie in [t0, t0 + n) at
// o[token - t0].
inline void tile_store_half_avx2(float* o, int base, int t0, int n, __m256 v) {
  const int lo = std::max(0, t0 - base), hi = std::min(8, t0 + n - base);
  if (hi <= lo) return;
  if (lo == 0 && hi == 8) {
    _mm256_storeu_ps(o + (base - t0), v);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(o + (base + lo - t0), tmp + lo, sizeof(float) * size_t(hi - lo));
  }
}

// The score kernels' pass over tiles for int4t-layout key blocks (int4t's, int2t's, and the q5_0t /
// q5_1t / iq4_nlt variants of int4t's), up to 4 query rows (NQ): per tile and group, the 32-dim blocks'
// exact integer dots block_dots(codes, b, q8, dot) (dot[h][e]: int32 lanes of row h's 8-token half
// e; q8[h]: row h's int8 query) times the block's query step, then the group's scale and min terms
// in the reference's FMA order, and the lanes inside [t0, t0 + n) stored.
template <int NQ, class BlockDots>
[[gnu::always_inline]] inline void tiles_scores_pass_avx2(const Int4TiledLayout& L, const float* qp,
                                                          const uint8_t* block, int t0, int n, float* out,
                                                          int out_stride, BlockDots block_dots) {
  const int bpg = L.group / 32;
  Int4tQueryRow qr[NQ];
  const int8_t* q8[NQ];
  for (int h = 0; h < NQ; ++h) {
    qr[h] = int4t_query_row(L, qp, h);
    q8[h] = qr[h].q8;
  }
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const KvPrefetchAlong along = kv_prefetch_along;
  for (int tile = tile0; tile < tile1; ++tile) {
    kv_prefetch_along_step(along, tile - tile0, tile1 - tile0);
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off;
    __m256 score[NQ][2];
    for (int h = 0; h < NQ; ++h) score[h][0] = score[h][1] = _mm256_setzero_ps();
    for (int g = 0; g < L.ng; ++g) {
      __m256 facc[NQ][2];
      for (int h = 0; h < NQ; ++h) facc[h][0] = facc[h][1] = _mm256_setzero_ps();
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
        __m256i dot[NQ][2];
        block_dots(codes, b, q8, dot);
        for (int h = 0; h < NQ; ++h) {
          const __m256 d = _mm256_set1_ps(qr[h].dq[b]);
          facc[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][0]), d, facc[h][0]);
          facc[h][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][1]), d, facc[h][1]);
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
    for (int h = 0; h < NQ; ++h)
      for (int e = 0; e < 2; ++e)
        tile_store_half_avx2(out + size_t(h) * size_t(out_stride), tile * 16 + 8 * e, t0, n, score[h][e]);
  }
}

// int4t_weights_nonneg, 8 weights per compare.
inline bool tiles_weights_nonneg_avx2(const float* p, int p_stride, int n_q, int n) {
  __m256 neg = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
  for (int i = 0; i < n_q; ++i) {
    const float* r = p + size_t(i) * size_t(p_stride);
    int t = 0;
    for (; t + 8 <= n; t += 8) neg = _mm256_or_ps(neg, _mm256_cmp_ps(_mm256_loadu_ps(r + t), zero, _CMP_LT_OQ));
    for (; t < n; ++t)
      if (r[t] < 0) return false;
  }
  return _mm256_movemask_ps(neg) == 0;
}

// Lanes h and 4 + h of the result = the largest of the 8 lanes of v[h], h < 4.
inline __m256 tile_max4x8_avx2(const __m256* v) {
  const __m256 a = _mm256_max_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
  const __m256 b = _mm256_max_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
  const __m256 c = _mm256_max_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_max_ps(c, _mm256_permute2f128_ps(c, c, 1));
}

// Quantized weights of one (group, row pair) of a tile (tile_quantize_group_weights_avx2):
// VPACKSSDW / VPACKUSWB (VPACKSSWB) of rows A and B leave the token quads in the dwords A: 0 4 1 5,
// B: 2 6 3 7, read through this index instead of a permute. Dword of row h's token quad k.
inline int tile_w8_dword(int h, int k) { return (h & 1) * 2 + (k >> 1) + (k & 1) * 4; }

// Step 1 of int4t's / int2t's AVX2 weighted sum for the tile at tp whose first token is `base`:
// per group g < ng the weights w_t = p_t s_tg of query rows h < NQ (rows p_stride apart, weight of
// token t at p[t - t0]) rounded with vector arithmetic (the scalar steps of int4t_weight_step, bit
// for bit) to u8 (U8) or s8, row pair r's in w8[g][r] (dwords by tile_w8_dword), row h's step in
// dw[g][h], and (Min) the min term p_t m_tg added into the 8 lanes of msv[h][g]. Lanes outside
// [t0, t0 + n) weigh 0 and their scales / minimums (which may hold anything, NaN included) are
// masked off.
template <int NQ, bool U8, int MaxGroups, bool Min = true>
[[gnu::always_inline]] inline void tile_quantize_group_weights_avx2(const float* p, int p_stride, int t0, int n,
                                                                    int base, const uint8_t* tp, size_t min_off,
                                                                    int ng, uint8_t (*w8)[(NQ + 1) / 2][32],
                                                                    float (*dw)[8], float (*msv)[MaxGroups][8]) {
  constexpr int NP = (NQ + 1) / 2;  // row pairs
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 lv = _mm256_set1_ps(U8 ? kv_int4t_u8_levels : kv_int4t_s8_levels);
  const bool full = base >= t0 && base + 16 <= t0 + n;
  __m256 pv[NQ][2];
  __m256 mk[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  if (full) {
    for (int h = 0; h < NQ; ++h) {
      const float* ph = p + size_t(h) * size_t(p_stride) + size_t(base - t0);
      pv[h][0] = _mm256_loadu_ps(ph);
      pv[h][1] = _mm256_loadu_ps(ph + 8);
    }
  } else {
    const int lo = std::max(0, t0 - base), hi = std::min(16, t0 + n - base);
    alignas(32) float pt[NQ][16] = {};
    alignas(32) int32_t mi[16];
    for (int j = 0; j < 16; ++j) mi[j] = j >= lo && j < hi ? -1 : 0;
    for (int h = 0; h < NQ; ++h)
      for (int j = lo; j < hi; ++j) pt[h][j] = p[size_t(h) * size_t(p_stride) + size_t(base + j - t0)];
    for (int h = 0; h < NQ; ++h) {
      pv[h][0] = _mm256_load_ps(pt[h]);
      pv[h][1] = _mm256_load_ps(pt[h] + 8);
    }
    mk[0] = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mi)));
    mk[1] = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mi + 8)));
  }
  for (int g = 0; g < ng; ++g) {
    __m256 sv0 = tile_load_f16x8_avx2(tp + 32 * size_t(g)), sv1 = tile_load_f16x8_avx2(tp + 32 * size_t(g) + 16);
    if (!full) {
      sv0 = _mm256_and_ps(sv0, mk[0]);
      sv1 = _mm256_and_ps(sv1, mk[1]);
    }
    __m256 w[NQ][2], wa[4];
    for (int h = 0; h < 4; ++h) {
      if (h < NQ) {
        w[h][0] = _mm256_mul_ps(pv[h][0], sv0);
        w[h][1] = _mm256_mul_ps(pv[h][1], sv1);
        wa[h] = _mm256_max_ps(_mm256_andnot_ps(sign, w[h][0]), _mm256_andnot_ps(sign, w[h][1]));
      } else {
        wa[h] = _mm256_setzero_ps();
      }
    }
    // int4t_weight_step for all rows at once: dw = wmax / levels, inv = levels / wmax or 0 (below 2^-100).
    const __m256 wmax = tile_max4x8_avx2(wa);
    _mm256_store_ps(dw[g], _mm256_div_ps(wmax, lv));
    const __m256 inv =
        _mm256_and_ps(_mm256_div_ps(lv, wmax), _mm256_cmp_ps(wmax, _mm256_set1_ps(kv_tile_wmin), _CMP_GE_OQ));
    for (int r = 0; r < NP; ++r) {
      __m256i pk[2];
      for (int e = 0; e < 2; ++e) {
        const int h = 2 * r + e;
        if (h < NQ) {
          const __m256 ih = _mm256_permutevar_ps(inv, _mm256_set1_epi32(h));
          pk[e] = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w[h][0], ih)),
                                     _mm256_cvtps_epi32(_mm256_mul_ps(w[h][1], ih)));
        } else {
          pk[e] = _mm256_setzero_si256();
        }
      }
      // Saturation is the reference's clamp: [0, 255], or [-127, 127] (a NaN product converts to
      // INT_MIN, which the reference's clamp makes -127).
      const __m256i q = U8 ? _mm256_packus_epi16(pk[0], pk[1])
                           : _mm256_max_epi8(_mm256_packs_epi16(pk[0], pk[1]), _mm256_set1_epi8(-127));
      _mm256_store_si256(reinterpret_cast<__m256i*>(w8[g][r]), q);
    }
    if constexpr (Min) {
      __m256 mv0 = tile_load_f16x8_avx2(tp + min_off + 32 * size_t(g));
      __m256 mv1 = tile_load_f16x8_avx2(tp + min_off + 32 * size_t(g) + 16);
      if (!full) {
        mv0 = _mm256_and_ps(mv0, mk[0]);
        mv1 = _mm256_and_ps(mv1, mk[1]);
      }
      for (int h = 0; h < NQ; ++h)
        _mm256_store_ps(msv[h][g],
                        _mm256_fmadd_ps(pv[h][1], mv1, _mm256_fmadd_ps(pv[h][0], mv0, _mm256_load_ps(msv[h][g]))));
    }
  }
}

// a[0..7] += dlo * step, a[16..23] += dhi * step: a chunk half's integer sums of one query row
// into its accumulator (channels at and at + 16). AddMin: the row's min term m (the same for
// every channel of the chunk's group) added too, a[i] = (a[i] + m) + d * step.
template <bool AddMin = false>
[[gnu::always_inline]] inline void tile_accum_add_avx2(float* a, __m256i dlo, __m256i dhi, float step, float m = 0.f) {
  const __m256 s = _mm256_set1_ps(step);
  __m256 alo = _mm256_loadu_ps(a), ahi = _mm256_loadu_ps(a + 16);
  if constexpr (AddMin) {
    const __m256 mv = _mm256_set1_ps(m);
    alo = _mm256_add_ps(alo, mv);
    ahi = _mm256_add_ps(ahi, mv);
  }
  _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo), s, alo));
  _mm256_storeu_ps(a + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi), s, ahi));
}

// Step 2 of int4t's / int2t's AVX2 weighted sum for one (tile, 8-lane half, chunk of 32 channels):
// lo[k] / hi[k] hold the chunk's codes of token quad k (lanes: channels 32c + 8 half + i and 32c + 16
// + 8 half + i, as u8 0..15 or 0..3), w8 / dw the group's quantized weights and steps
// (tile_quantize_group_weights_avx2). Per query row two int16 chains over the 4 quads (at most
// 4 * 2 * 255 * 15 or 4 * 2 * 15 * 127: no overflow), widened once and added with the step into
// acc row h at channel `at` (low) and at + 16 (high). Each row's chains run and are flushed before
// the next row's: about 12 live registers (all rows' chains at once spilled). Five (codes 0..31:
// q5_0t / q5_1t): u8 chains widened every 2 quads (2 * 2 * 255 * 31; s8 ones fit 4 * 2 * 31 * 127).
// AddMin: row h's min term mt[h] added with the sums (tile_accum_add_avx2).
template <int NQ, bool U8, bool Five = false, bool AddMin = false>
[[gnu::always_inline]] inline void tile_accum_chunk_avx2(const __m256i* lo, const __m256i* hi,
                                                         const uint8_t (*w8)[32], const float* dw, float* acc, int hd,
                                                         int at, const float* mt = nullptr) {
  constexpr bool kSplit = Five && U8;
  for (int h = 0; h < NQ; ++h) {
    const uint8_t* wp = w8[h / 2];
    __m256i slo = _mm256_setzero_si256(), shi = _mm256_setzero_si256();
    __m256i wlo = _mm256_setzero_si256(), whi = _mm256_setzero_si256();  // kSplit: the first 2 quads, widened
    for (int k = 0; k < 4; ++k) {
      const __m256i wb = tile_bcast32_avx2(wp + 4 * tile_w8_dword(h, k));
      slo = _mm256_add_epi16(slo, U8 ? _mm256_maddubs_epi16(wb, lo[k]) : _mm256_maddubs_epi16(lo[k], wb));
      shi = _mm256_add_epi16(shi, U8 ? _mm256_maddubs_epi16(wb, hi[k]) : _mm256_maddubs_epi16(hi[k], wb));
      if (kSplit && k == 1) {
        wlo = tile_widen_avx2(slo);
        whi = tile_widen_avx2(shi);
        slo = shi = _mm256_setzero_si256();
      }
    }
    const __m256i dlo = kSplit ? _mm256_add_epi32(wlo, tile_widen_avx2(slo)) : tile_widen_avx2(slo);
    const __m256i dhi = kSplit ? _mm256_add_epi32(whi, tile_widen_avx2(shi)) : tile_widen_avx2(shi);
    tile_accum_add_avx2<AddMin>(acc + size_t(h) * size_t(hd) + size_t(at), dlo, dhi, dw[h], AddMin ? mt[h] : 0.f);
  }
}

// tq's chunks (kv/tq_tiled.h): codes looked up in the int8 codebook image C, which against u8
// weights would overflow VPMADDUBSW's int16 pair sums; C = 16 Ch + Cl (Ch = C >> 4 in -8..7,
// Cl = C & 15) splits each product into two chains within int4t's bounds (4 * 2 * 255 * 8 and
// 4 * 2 * 255 * 15), joined exactly in int32 as 16 Ch-sum + Cl-sum. lo / hi: raw nibbles.
template <int NQ>
[[gnu::always_inline]] inline void tile_accum_chunk_lut_avx2(const __m256i* lo, const __m256i* hi, __m256i lut_h,
                                                             __m256i lut_l, const uint8_t (*w8)[32], const float* dw,
                                                             float* acc, int hd, int at) {
  __m256i loh[4], lol[4], hih[4], hil[4];
  for (int k = 0; k < 4; ++k) {
    loh[k] = _mm256_shuffle_epi8(lut_h, lo[k]);
    lol[k] = _mm256_shuffle_epi8(lut_l, lo[k]);
    hih[k] = _mm256_shuffle_epi8(lut_h, hi[k]);
    hil[k] = _mm256_shuffle_epi8(lut_l, hi[k]);
  }
  for (int h = 0; h < NQ; ++h) {
    const uint8_t* wp = w8[h / 2];
    __m256i sloh = _mm256_setzero_si256(), slol = _mm256_setzero_si256();
    __m256i shih = _mm256_setzero_si256(), shil = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i wb = tile_bcast32_avx2(wp + 4 * tile_w8_dword(h, k));
      sloh = _mm256_add_epi16(sloh, _mm256_maddubs_epi16(wb, loh[k]));
      slol = _mm256_add_epi16(slol, _mm256_maddubs_epi16(wb, lol[k]));
      shih = _mm256_add_epi16(shih, _mm256_maddubs_epi16(wb, hih[k]));
      shil = _mm256_add_epi16(shil, _mm256_maddubs_epi16(wb, hil[k]));
    }
    const __m256i dlo = _mm256_add_epi32(_mm256_slli_epi32(tile_widen_avx2(sloh), 4), tile_widen_avx2(slol));
    const __m256i dhi = _mm256_add_epi32(_mm256_slli_epi32(tile_widen_avx2(shih), 4), tile_widen_avx2(shil));
    tile_accum_add_avx2(acc + size_t(h) * size_t(hd) + size_t(at), dlo, dhi, dw[h]);
  }
}

// iq4_nlt's chunks (kv/int4_tiled.h): s8 weights against codes looked up as |C| (lut_abs, the u8
// operand) and C (lut_sgn, whose sign goes onto the weights: VPSIGNB); a pair sum reaches
// 2 * 127 * 127, so each product is widened at once. lo / hi: raw nibbles.
template <int NQ>
[[gnu::always_inline]] inline void tile_accum_chunk_signlut_avx2(const __m256i* lo, const __m256i* hi,
                                                                 __m256i lut_abs, __m256i lut_sgn,
                                                                 const uint8_t (*w8)[32], const float* dw, float* acc,
                                                                 int hd, int at) {
  __m256i loa[4], los[4], hia[4], his[4];
  for (int k = 0; k < 4; ++k) {
    loa[k] = _mm256_shuffle_epi8(lut_abs, lo[k]);
    los[k] = _mm256_shuffle_epi8(lut_sgn, lo[k]);
    hia[k] = _mm256_shuffle_epi8(lut_abs, hi[k]);
    his[k] = _mm256_shuffle_epi8(lut_sgn, hi[k]);
  }
  for (int h = 0; h < NQ; ++h) {
    const uint8_t* wp = w8[h / 2];
    __m256i dlo = _mm256_setzero_si256(), dhi = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i wb = tile_bcast32_avx2(wp + 4 * tile_w8_dword(h, k));
      dlo = _mm256_add_epi32(dlo, tile_widen_avx2(_mm256_maddubs_epi16(loa[k], _mm256_sign_epi8(wb, los[k]))));
      dhi = _mm256_add_epi32(dhi, tile_widen_avx2(_mm256_maddubs_epi16(hia[k], _mm256_sign_epi8(wb, his[k]))));
    }
    tile_accum_add_avx2(acc + size_t(h) * size_t(hd) + size_t(at), dlo, dhi, dw[h]);
  }
}

// The min terms of int4t's / int2t's weighted sums: per query row h < NQ and group g < ng the 8
// lanes of msv[h][g] (sum_t p_t m_tg) reduced, times min_mul (q4_0t's -8: kv/int4_tiled.h), into
// mt[g][h].
template <int NQ, int MaxGroups>
inline void tiles_min_terms_avx2(float (*msv)[MaxGroups][8], int ng, float min_mul, float (*mt)[4]) {
  for (int h = 0; h < NQ; ++h)
    for (int g = 0; g < ng; ++g) {
      const __m256 v = _mm256_load_ps(msv[h][g]);
      __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      x = _mm_add_ps(x, _mm_movehl_ps(x, x));
      x = _mm_add_ss(x, _mm_movehdup_ps(x));
      mt[g][h] = min_mul * _mm_cvtss_f32(x);
    }
}

// int4t's / int2t's whole weighted sum on AVX2 (kv/int4_tiled.h) over tokens [t0, t0 + n) of a
// value block: row passes of up to 4 rows; per segment of 4 tiles the weights quantized ahead
// (tile_quantize_group_weights_avx2: a segment's tiles are quantized before its channel loop
// reads them, so the dword loads find the stores long retired), then per tile, 8-lane half and
// chunk of 32 channels the layout's chunk_codes(codes, c, half, lo, hi) gives the 4 token quads'
// code vectors (lo: channels 32c + 8 half + i, hi: 32c + 16 + 8 half + i) for
// tile_accum_chunk_avx2. The group is stepped along the one chunk loop (no c / cpg division; a
// loop per group had the compiler hoist and spill the weight broadcasts). U8 weights when every
// weight is >= 0 and the scales are, else s8.
// The min terms (times L.min_mul) are summed over all tiles in msv and, once the last segment's
// weights are quantized, added by that segment's first tile along with its sums: no pass of their
// own over the accumulator. A layout without them (min_mul 0: tq's, iq4_nlt's) skips them whole.
// ChunkLut: chunk_lut(c, &t1, &t2) gives chunk c's codebook tables: with u8 weights (tq's tiles)
// the split tables C >> 4, C & 15 for tile_accum_chunk_lut_avx2, with s8 weights (iq4_nlt) |C|
// and C for tile_accum_chunk_signlut_avx2; std::nullptr_t: the codes are the values.
template <int NQ, bool U8, bool Five, class ChunkCodes, class ChunkLut = std::nullptr_t>
void tiles_accum_pass_avx2(const Int4TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0,
                           int n, float* acc, ChunkCodes chunk_codes, ChunkLut chunk_lut = nullptr) {
  constexpr bool Lut = !std::is_same_v<ChunkLut, std::nullptr_t>;
  constexpr int kSegTiles = 4;
  constexpr int kMaxGroups = 1024 / 32;
  constexpr int NP = (NQ + 1) / 2;  // row pairs
  const int hd = L.hd, ng = L.ng, cpg = L.group / 32;
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const bool with_min = L.min_mul != 0.f;
  // Per (row, group): the min term sum_t p_t m_tg in 8 lanes, reduced once per call into mt.
  alignas(32) float msv[NQ][kMaxGroups][8];
  float mt[kMaxGroups][4];
  if (with_min)
    for (int h = 0; h < NQ; ++h)
      for (int g = 0; g < ng; ++g) _mm256_store_ps(msv[h][g], _mm256_setzero_ps());
  // (tile of the segment, group, row pair): quantized weights; (.., group, row h in lane h): steps.
  alignas(32) uint8_t w8[kSegTiles][kMaxGroups][NP][32];
  alignas(32) float dw[kSegTiles][kMaxGroups][8];
  const KvPrefetchAlong along = kv_prefetch_along;
  const int n_seg = (tile1 - tile0 + kSegTiles - 1) / kSegTiles;
  for (int seg = tile0; seg < tile1; seg += kSegTiles) {
    const int nt = std::min(kSegTiles, tile1 - seg);
    kv_prefetch_along_step(along, (seg - tile0) / kSegTiles, n_seg);
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* tp = block + size_t(seg + tt) * L.tile_bytes;
      if (with_min)
        tile_quantize_group_weights_avx2<NQ, U8, kMaxGroups, true>(p, p_stride, t0, n, (seg + tt) * 16, tp, L.min_off,
                                                                   ng, w8[tt], dw[tt], msv);
      else
        tile_quantize_group_weights_avx2<NQ, U8, kMaxGroups, false>(p, p_stride, t0, n, (seg + tt) * 16, tp,
                                                                    L.min_off, ng, w8[tt], dw[tt], msv);
    }
    // The last segment's first tile adds the min terms (not with codebook lookups: added after).
    const bool fold = !Lut && with_min && seg + nt >= tile1;
    if (fold) tiles_min_terms_avx2<NQ>(msv, ng, L.min_mul, mt);
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* codes = block + size_t(seg + tt) * L.tile_bytes + L.code_off;
      for (int half = 0; half < 2; ++half)
        for (int c = 0, g = 0, cg = 0; c < hd / 32; ++c) {
          __m256i lo[4], hi[4];
          chunk_codes(codes, c, half, lo, hi);
          if constexpr (Lut) {
            __m256i t1, t2;
            chunk_lut(c, &t1, &t2);
            if constexpr (U8)
              tile_accum_chunk_lut_avx2<NQ>(lo, hi, t1, t2, w8[tt][g], dw[tt][g], acc, hd, 32 * c + 8 * half);
            else
              tile_accum_chunk_signlut_avx2<NQ>(lo, hi, t1, t2, w8[tt][g], dw[tt][g], acc, hd, 32 * c + 8 * half);
          } else {
            if (fold && tt == 0)
              tile_accum_chunk_avx2<NQ, U8, Five, true>(lo, hi, w8[tt][g], dw[tt][g], acc, hd, 32 * c + 8 * half,
                                                        mt[g]);
            else
              tile_accum_chunk_avx2<NQ, U8, Five>(lo, hi, w8[tt][g], dw[tt][g], acc, hd, 32 * c + 8 * half);
          }
          if (++cg == cpg) {  // chunk c + 1 starts the next group
            cg = 0;
            ++g;
          }
        }
    }
  }
  if (Lut && with_min) {
    tiles_min_terms_avx2<NQ>(msv, ng, L.min_mul, mt);
    for (int h = 0; h < NQ; ++h)
      for (int g = 0; g < ng; ++g) {
        const __m256 m = _mm256_set1_ps(mt[g][h]);
        float* a = acc + size_t(h) * size_t(hd) + size_t(g * L.group);
        for (int d = 0; d < L.group; d += 8) _mm256_storeu_ps(a + d, _mm256_add_ps(_mm256_loadu_ps(a + d), m));
      }
  }
}
// Five: chunk_codes gives codes up to 31 (tile_accum_chunk_avx2).
template <bool Five = false, class ChunkCodes>
void tiles_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc, ChunkCodes chunk_codes) {
  if (n <= 0) return;
  const bool u8 = !L.signed_scales && tiles_weights_nonneg_avx2(p, p_stride, n_q, n);
  tile_row_passes(n_q, [&](int i, auto m) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    float* a = acc + size_t(i) * size_t(L.hd);
    if (u8) tiles_accum_pass_avx2<decltype(m)::value, true, Five>(L, pi, p_stride, block, t0, n, a, chunk_codes);
    else tiles_accum_pass_avx2<decltype(m)::value, false, Five>(L, pi, p_stride, block, t0, n, a, chunk_codes);
  });
}
// Codes looked up per chunk (ChunkLut above): U8 true, tq's tiles (u8 weights only: the caller
// routes weights with a negative entry elsewhere); false, iq4_nlt's s8 weights.
template <bool U8 = true, class ChunkCodes, class ChunkLut>
void tiles_accum_lut_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                          int t0, int n, float* acc, ChunkCodes chunk_codes, ChunkLut chunk_lut) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    tiles_accum_pass_avx2<decltype(m)::value, U8, false>(L, p + size_t(i) * size_t(p_stride), p_stride, block, t0, n,
                                                         acc + size_t(i) * size_t(L.hd), chunk_codes, chunk_lut);
  });
}

}  // namespace kvq
