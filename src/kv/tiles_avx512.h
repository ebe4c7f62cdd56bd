// Small AVX-512 helpers of the tiled integer-dot kernels (int4t, int2t, int8t, kivi4t / kivi2t) and
// the weight quantization of int4t's / int2t's weighted sums, written once so that every kernel
// rounds the same way. Include only from *_avx512.cpp files (after core/avx512.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kv/hsum_avx512.h"
#include "kv/int4_tiled.h"
#include "kv/prefetch_along.h"

namespace kvq {

// Four int8 values as one dword, broadcast to every lane (the VPDPBUSD operand).
inline __m512i tile_bcast32_avx512(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A tile's bytes requested into L1 (the int8 and fp8 tiles' kernels, a tile or a step of tiles
// ahead of the one they compute).
inline void tile_prefetch_l1(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
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

// Row h's 16 weights of the tile whose first token is `base` (rows p_stride apart, weight of token t
// at p[t - t0]) in pv[h]; 0 outside [t0, t0 + n) and for rows h >= NQ. Returns the valid lanes.
template <int NQ>
[[gnu::always_inline]] inline __mmask16 tile_load_weights_avx512(const float* p, int p_stride, int t0, int n, int base,
                                                                 __m512* pv) {
  const __mmask16 mask = tile_mask_avx512(base, t0, n);
  const bool full = mask == 0xffff;
  for (int h = 0; h < 4; ++h) {
    const float* ph = p + size_t(h) * size_t(p_stride);
    pv[h] = h >= NQ ? _mm512_setzero_ps()
            : full  ? _mm512_loadu_ps(ph + (base - t0))
                    : _mm512_maskz_expandloadu_ps(mask, ph + std::max(0, base - t0));
  }
  return mask;
}

// Lane 4L + e of the result = the largest of the 16 lanes of v[4e + L] (hsum16_avx512's tree with
// max): 16 maxima in 15 maxima and 30 shuffles.
[[gnu::always_inline]] inline __m512 tile_max16x16_avx512(const __m512* v) { return tree16_avx512(v, kv_max16); }

// The weight quantization of one tile's weighted sum with int4t_weight_step's arithmetic, bit for
// bit with the references (tile_quantize_weights_ref): pv[4] the rows' weights
// (tile_load_weights_avx512), scale_row(g) group g's 16 token scales (0 outside the range: their
// slots may hold NaN). Per 4 groups: the 16 (row, group) weight vectors w = p * s, their maxima in
// one tree (tile_max16x16_avx512) and the steps and inverses of all 16 in two divisions; the weights
// rint(w * inv) as u8 (U8) or s8 in w8[g] (64 bytes; byte 16k + 4h + m: row h, token 4k + m, what
// VPACK*DW / VPACK*WB of rows 0..3 leave in place: one store per group for all rows), the steps in
// dws[g / 4] (lane 4h + g % 4: row h's dw for group g), and for s8 weights, when wsum is given,
// wsum[h * ng + g] = 128 * the sum of row h's stored weights (int8t's correction).
template <int NQ, bool U8, class ScaleRow>
[[gnu::always_inline]] inline void tile_quantize_weights_avx512(const __m512* pv, int ng, ScaleRow scale_row,
                                                                uint8_t (*w8)[64], float (*dws)[16],
                                                                int32_t* wsum = nullptr) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 lv = _mm512_set1_ps(U8 ? kv_int4t_u8_levels : kv_int4t_s8_levels);
  for (int g0 = 0; g0 < ng; g0 += 4) {
    const int gc = std::min(4, ng - g0);
    __m512 w[4][4], wa[16];  // w[j][h]: group g0 + j, row h; wa[4j + h] = |w[j][h]|
    for (int j = 0; j < 4; ++j) {
      const __m512 sv = j < gc ? scale_row(g0 + j) : zero;
      for (int h = 0; h < 4; ++h) {
        w[j][h] = h < NQ && j < gc ? _mm512_mul_ps(pv[h], sv) : zero;
        wa[4 * j + h] = U8 ? w[j][h] : _mm512_abs_ps(w[j][h]);
      }
    }
    // lane 4h + j: max_t |w[j][h]|. One or two groups: a 4-row tree each (its lanes 4h..4h+3 all hold
    // row h's maximum) and a blend; three or four: one 16-vector tree.
    __m512 wmax;
    if (gc <= 2) {
      wmax = tile_max4x16_avx512(wa);
      if (gc == 2) wmax = _mm512_mask_mov_ps(wmax, 0x2222, tile_max4x16_avx512(wa + 4));
    } else {
      wmax = tile_max16x16_avx512(wa);
    }
    _mm512_store_ps(dws[g0 / 4], _mm512_div_ps(wmax, lv));
    const __m512 inv =
        _mm512_maskz_div_ps(_mm512_cmp_ps_mask(wmax, _mm512_set1_ps(kv_tile_wmin), _CMP_GE_OQ), lv, wmax);
    for (int j = 0; j < gc; ++j) {
      const int g = g0 + j;
      __m512i wi[4];
      for (int h = 0; h < 4; ++h)
        wi[h] = h < NQ ? _mm512_cvtps_epi32(_mm512_mul_ps(w[j][h], _mm512_permutexvar_ps(_mm512_set1_epi32(4 * h + j), inv)))
                       : _mm512_setzero_si512();
      // Saturation is the reference's clamp: [0, 255], or [-127, 127] (a NaN product converts to
      // INT_MIN, which the reference's clamp makes -127, or 0 for u8).
      __m512i q;
      if (U8) {
        q = _mm512_packus_epi16(_mm512_packus_epi32(wi[0], wi[1]), _mm512_packus_epi32(wi[2], wi[3]));
      } else {
        q = _mm512_max_epi8(_mm512_packs_epi16(_mm512_packs_epi32(wi[0], wi[1]), _mm512_packs_epi32(wi[2], wi[3])),
                            _mm512_set1_epi8(-127));
        if (wsum)
          for (int h = 0; h < NQ; ++h)
            wsum[h * ng + g] = 128 * _mm512_reduce_add_epi32(
                                         _mm512_max_epi32(_mm512_min_epi32(wi[h], _mm512_set1_epi32(127)),
                                                          _mm512_set1_epi32(-127)));
      }
      _mm512_store_si512(w8[g], q);
    }
  }
}

// Step 1 of int4t's / int2t's weighted sum for the tile at tp whose first token is `base`: the
// weights of query rows h < NQ quantized by tile_quantize_weights_avx512 against the scale table
// (w8[g], dws[g / 4]), and the min term p_t m_tg added into the 16 lanes of msv[h * ng + g] (the
// arrays are packed by the actual group count, not strided by the largest one; msv null: a layout
// without min terms).
template <int NQ, bool U8>
[[gnu::always_inline]] inline void tile_quantize_group_weights_avx512(const float* p, int p_stride, int t0, int n,
                                                                      int base, const uint8_t* tp, size_t min_off,
                                                                      int ng, uint8_t (*w8)[64], float (*dws)[16],
                                                                      float (*msv)[16], int32_t* wsum = nullptr) {
  __m512 pv[4];
  const __mmask16 mask = tile_load_weights_avx512<NQ>(p, p_stride, t0, n, base, pv);
  tile_quantize_weights_avx512<NQ, U8>(
      pv, ng, [&](int g) { return _mm512_maskz_mov_ps(mask, tile_load_f16x16_avx512(tp + 32 * size_t(g))); }, w8,
      dws, wsum);
  for (int g = 0; msv && g < ng; ++g) {
    const __m512 mv = _mm512_maskz_mov_ps(mask, tile_load_f16x16_avx512(tp + min_off + 32 * size_t(g)));
    for (int h = 0; h < NQ; ++h)
      _mm512_store_ps(msv[h * ng + g], _mm512_fmadd_ps(pv[h], mv, _mm512_load_ps(msv[h * ng + g])));
  }
}

// Step 2 of int4t's / int2t's weighted sum over a segment of nt tiles (tiles[tt]: tile tt's bytes,
// which may lie in different blocks) whose weights tile_quantize_group_weights_avx512 stored in
// w8 + tt * ng / dws + tt * ngc (ngc = ceil(ng / 4)): per chunk c of 32 channels and tile, per token
// quad k the chunk's codes as u8 lanes (lo: channels 32c + i, hi: 32c + 16 + i) from
// quad_codes(tile_codes, c, k, &lo, &hi), 2 * NQ VPDPBUSD chains (u8 weights x codes when U8, else
// codes x s8 weights), flushed to f32 with the tile's step; the f32 sums go to acc once per segment,
// with the min terms (mins) in the last one. at(c, tt) runs before chunk c of tile tt (the prefetch
// requests). Flip (s8 weights only): quad_codes returns each code's value + 128 as u8 (a signed
// value table, iq4_nlt's grid), and the dots subtract 128 * the tile's weight sum (wsum[tt][h * ng + g]).
template <int NQ, bool U8, class QuadCodes, bool Flip = false, class At>
[[gnu::always_inline]] inline void tiles_accum_segment_avx512(const Int4TiledLayout& L, const uint8_t* const* tiles,
                                                              int nt, const uint8_t (*w8)[64], const float (*dws)[16],
                                                              const float* mins, float* acc, QuadCodes quad_codes,
                                                              const int32_t (*wsum)[NQ * 32], At at) {
  static_assert(!(Flip && U8), "flipped codes take s8 weights");
  const int ng = L.ng, ngc = (L.ng + 3) / 4;
  for (int c = 0; c < L.hd / 32; ++c) {
    const int g = c * 32 / L.group;
    __m512 flo[NQ], fhi[NQ];
    for (int h = 0; h < NQ; ++h) flo[h] = fhi[h] = _mm512_setzero_ps();
    for (int tt = 0; tt < nt; ++tt) {
      at(c, tt);
      const uint8_t* codes = tiles[tt] + L.code_off;
      __m512i ilo[NQ], ihi[NQ];
      for (int h = 0; h < NQ; ++h) ilo[h] = ihi[h] = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) {
        __m512i lo, hi;
        quad_codes(codes, c, k, &lo, &hi);
        for (int h = 0; h < NQ; ++h) {
          const __m512i wb = tile_bcast32_avx512(w8[tt * ng + g] + 16 * k + 4 * h);
          if (U8) {
            ilo[h] = _mm512_dpbusd_epi32(ilo[h], wb, lo);
            ihi[h] = _mm512_dpbusd_epi32(ihi[h], wb, hi);
          } else {
            ilo[h] = _mm512_dpbusd_epi32(ilo[h], lo, wb);
            ihi[h] = _mm512_dpbusd_epi32(ihi[h], hi, wb);
          }
        }
      }
      if constexpr (Flip)
        for (int h = 0; h < NQ; ++h) {
          const __m512i w = _mm512_set1_epi32(wsum[tt][h * ng + g]);
          ilo[h] = _mm512_sub_epi32(ilo[h], w);
          ihi[h] = _mm512_sub_epi32(ihi[h], w);
        }
      for (int h = 0; h < NQ; ++h) {
        const __m512 s = _mm512_set1_ps(dws[tt * ngc + g / 4][4 * h + g % 4]);
        flo[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo[h]), s, flo[h]);
        fhi[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi[h]), s, fhi[h]);
      }
    }
    for (int h = 0; h < NQ; ++h) {
      if (mins) {  // the call's last segment adds the min terms (group g's 32-channel chunk c)
        const __m512 m = _mm512_set1_ps(mins[h * ng + g]);
        flo[h] = _mm512_add_ps(flo[h], m);
        fhi[h] = _mm512_add_ps(fhi[h], m);
      }
      float* a = acc + size_t(h) * size_t(L.hd) + size_t(32 * c);
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), flo[h]));
      _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), fhi[h]));
    }
  }
}

// The min terms of int4t's / int2t's weighted sums: the 16 lanes of each of the n vectors msv[i]
// (sum_t p_t m_tg for i = h * ng + g) reduced, times min_mul, into mins[i]; 16 vectors per
// hsum16_avx512 (lane 4(i % 4) + i / 4 of a batch's result holds its vector i's sum).
inline void tiles_reduce_min_terms_avx512(const float (*msv)[16], int n, float min_mul, float* mins) {
  for (int i0 = 0; i0 < n; i0 += 16) {
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = i0 + i < n ? _mm512_load_ps(msv[i0 + i]) : _mm512_setzero_ps();
    alignas(64) float r[16];
    _mm512_store_ps(r, _mm512_mul_ps(hsum16_avx512(v), _mm512_set1_ps(min_mul)));  // min_mul: q4_0t's -8
    for (int i = 0; i < 16 && i0 + i < n; ++i) mins[i0 + i] = r[4 * (i % 4) + i / 4];
  }
}

// f(span, col, along) for each span with n > 0 of a multi-block call: col its first output column
// (the n of the spans before it summed), along its range to request along the span's tiles.
template <class F>
[[gnu::always_inline]] inline void tile_spans(const KvSpan* spans, int n_spans, F&& f) {
  for (int s = 0, col = 0; s < n_spans; ++s) {
    if (spans[s].n <= 0) continue;
    f(spans[s], col, KvPrefetchAlong{spans[s].along, spans[s].along_bytes});
    col += spans[s].n;
  }
}

// f(tile, nt, tp) for tiles [tile0, tile1) of a block two at a time (one at an odd end): the score
// kernels read a pair against the same query broadcasts. nt: std::integral_constant<int, 1 or 2>
// (the kernels' tile count as a template argument); tp[t]: the bytes of tile tile + t. Callers mark
// f always_inline: GCC otherwise outlined the pair case (a call per pair, kivi4 hot +4%).
template <class F>
[[gnu::always_inline]] inline void tile_pairs(const uint8_t* block, size_t tile_bytes, int tile0, int tile1, F&& f) {
  for (int tile = tile0; tile < tile1; tile += 2) {
    const bool pair = tile + 1 < tile1;
    const uint8_t* tp[2] = {block + size_t(tile) * tile_bytes, block + size_t(tile + int(pair)) * tile_bytes};
    if (pair) f(tile, std::integral_constant<int, 2>{}, tp);
    else f(tile, std::integral_constant<int, 1>{}, tp);
  }
}

// The tiles of a multi-block call's spans two at a time: f(sp, col, tile, nt, tp) as tile_pairs'
// f for span sp (col: its first output column), each tile's share of the span's along range
// requested before the pair is read. f is always_inline at the callers, as for tile_pairs.
template <class F>
[[gnu::always_inline]] inline void tile_span_pairs(const KvSpan* spans, int n_spans, size_t tile_bytes, F&& f) {
  tile_spans(spans, n_spans, [&](const KvSpan& sp, int col, KvPrefetchAlong along) __attribute__((always_inline)) {
    const int tile0 = sp.t0 / 16, tile1 = (sp.t0 + sp.n + 15) / 16;
    tile_pairs(sp.block, tile_bytes, tile0, tile1,
               [&](int tile, auto nt, const uint8_t* const* tp) __attribute__((always_inline)) {
                 for (int t = 0; t < decltype(nt)::value; ++t)
                   kv_prefetch_along_step(along, tile + t - tile0, tile1 - tile0);
                 f(sp, col, tile, nt, tp);
               });
  });
}

// A single-block call as a span, its along range this thread's kv_prefetch_along (what the
// per-block entry points of the multi-span kernels pass on).
inline KvSpan tile_span(const uint8_t* block, int t0, int n) {
  return {block, 0, t0, n, 0, kv_prefetch_along.p, kv_prefetch_along.bytes};
}

// int4t's / int2t's whole weighted sum (kv/int4_tiled.h) over the tokens of several value blocks
// (KvCodec::accumulate_spans: span s's token t0 + t weighted by column o_s + t of p): row passes of
// up to 4 rows; per segment of up to kSegTiles tiles, taken in order across the spans, first the
// weights of every tile quantized (tile_quantize_group_weights_avx512: each tile's quantization is
// a long dependency chain of maxima, divisions and packs, and the segment's tiles are independent,
// so a long segment lets them overlap), then the channel loop (tiles_accum_segment_avx512 with the
// layout's quad_codes reader). The min terms (times L.min_mul) are summed over all spans and added
// once, in the call's last segment. Each tile requests its span's along range in a share of one
// step per tile (kv_prefetch_along_step), spread over the segment's channel loop. U8 weights when
// every weight is >= 0 and the scales are (not q4_0t's signed ones), else s8.
template <int NQ, bool U8, bool Flip = false, class QuadCodes>
void tiles_accum_pass_avx512(const Int4TiledLayout& L, const float* p, int p_stride, const KvSpan* spans, int n_spans,
                             float* acc, QuadCodes quad_codes) {
  // At most 8 tiles per segment: at 32K tokens and head_dim 128 (bench/BENCHMARKS.md) 4-8 tiles
  // equal, 12-16 slower from DRAM (a segment reads every tile's scale table first, so the last
  // tiles' lines are needed soon after attention requested them).
  constexpr int kSegTiles = 8;
  constexpr int kSegGroups = 128;  // and at most this many (tile, group) weight vectors of 64 bytes
  constexpr int kMaxGroups = 1024 / 32;
  // Per (query row, group): the min term sum_t p_t m_tg, 16 lanes, reduced once per call (mins).
  const int ng = L.ng, ngc = (L.ng + 3) / 4;
  const int seg_tiles = std::min(kSegTiles, kSegGroups / ng);
  // A layout without them (min_mul 0: tq's, iq4_nlt's) skips them whole.
  const bool with_min = L.min_mul != 0.f;
  alignas(64) float msv[NQ * kMaxGroups][16];
  if (with_min)
    for (int i = 0; i < NQ * ng; ++i) _mm512_store_ps(msv[i], _mm512_setzero_ps());
  alignas(64) uint8_t w8[kSegGroups][64];
  alignas(64) float dws[kSegGroups][16];
  float mins[NQ * kMaxGroups];
  int32_t wsum[Flip ? kSegTiles : 1][NQ * kMaxGroups];  // Flip: 128 * each (row, group) weight sum per tile
  struct SegRequest {  // a segment tile's share of its span's along range: step `step` of n_steps
    KvPrefetchAlong along;
    int step, n_steps;
  };
  SegRequest seg[kSegTiles];
  const uint8_t* seg_tp[kSegTiles];
  int nt = 0;
  int last_span = n_spans - 1;
  while (last_span >= 0 && spans[last_span].n <= 0) --last_span;
  auto flush = [&](bool last) {
    if (last && with_min) tiles_reduce_min_terms_avx512(msv, NQ * ng, L.min_mul, mins);
    const int nc = L.hd / 32;
    tiles_accum_segment_avx512<NQ, U8, QuadCodes, Flip>(
        L, seg_tp, nt, w8, dws, last && with_min ? mins : nullptr, acc, quad_codes, wsum, [&](int c, int tt) {
          if (c == tt * nc / nt) kv_prefetch_along_step(seg[tt].along, seg[tt].step, seg[tt].n_steps);
        });
    nt = 0;
  };
  for (int s = 0, col = 0; s <= last_span; col += std::max(0, spans[s].n), ++s) {
    const uint8_t* block = spans[s].block;
    const int t0 = spans[s].t0, n = spans[s].n;
    if (n <= 0) continue;
    const float* ps = p + col;
    const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
    const KvPrefetchAlong along{spans[s].along, spans[s].along_bytes};
    for (int tile = tile0; tile < tile1; ++tile) {
      const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
      tile_quantize_group_weights_avx512<NQ, U8>(ps, p_stride, t0, n, tile * 16, tp, L.min_off, ng, w8 + nt * ng,
                                                 dws + nt * ngc, with_min ? msv : nullptr, Flip ? wsum[nt] : nullptr);
      seg[nt] = {along, tile - tile0, tile1 - tile0};
      seg_tp[nt] = tp;
      ++nt;
      // The min terms are complete once the call's last tile's weights are: its segment adds them.
      const bool last = s == last_span && tile + 1 == tile1;
      if (nt == seg_tiles || last) flush(last);
    }
  }
}
// Whether every weight of the spans' columns of p is >= 0.
inline bool tiles_spans_weights_nonneg_avx512(const float* p, int p_stride, int n_q, const KvSpan* spans,
                                              int n_spans) {
  int n = 0;
  for (int s = 0; s < n_spans; ++s) n += std::max(0, spans[s].n);
  return tiles_weights_nonneg_avx512(p, p_stride, n_q, n);
}
template <bool Flip = false, class QuadCodes>
void tiles_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                        int n_spans, float* acc, QuadCodes quad_codes) {
  if constexpr (Flip) {  // signed code values: s8 weights always
    tile_row_passes(n_q, [&](int i, auto m) {
      tiles_accum_pass_avx512<decltype(m)::value, false, true>(L, p + size_t(i) * size_t(p_stride), p_stride, spans,
                                                               n_spans, acc + size_t(i) * size_t(L.hd), quad_codes);
    });
    return;
  }
  const bool u8 = !L.signed_scales && tiles_spans_weights_nonneg_avx512(p, p_stride, n_q, spans, n_spans);
  tile_row_passes(n_q, [&](int i, auto m) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    float* a = acc + size_t(i) * size_t(L.hd);
    if (u8) tiles_accum_pass_avx512<decltype(m)::value, true>(L, pi, p_stride, spans, n_spans, a, quad_codes);
    else tiles_accum_pass_avx512<decltype(m)::value, false>(L, pi, p_stride, spans, n_spans, a, quad_codes);
  });
}
// One block's tokens [t0, t0 + n), requesting this thread's kv_prefetch_along.
template <bool Flip = false, class QuadCodes>
void tiles_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                        int n, float* acc, QuadCodes quad_codes) {
  if (n <= 0) return;
  const KvSpan sp = tile_span(block, t0, n);
  tiles_accum_avx512<Flip>(L, p, p_stride, n_q, &sp, 1, acc, quad_codes);
}

}  // namespace kvq
