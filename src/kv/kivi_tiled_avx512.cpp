// AVX-512 VNNI score kernel of kivi4t's keys (kv/kivi_tiled.h): int4t's VPDPBUSD chain over a
// 16-token tile with unit token scale (the channel scales are folded into the int8 query), so
// per tile and query row only one FMA per 32-dim block and one add of the group constant remain.
#include "core/avx512.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kv/tiles_avx512.h"
#include "kv/grouped_common.h"
#include "kv/kivi_tiled.h"

namespace kvq {
namespace {

// The scores of NT (1 or 2) tiles (codes[t]) for NQ rows into facc[t][h], before the group
// constant. Two tiles share each query broadcast (loads bound the dots: two per cycle, one
// broadcast per VPDPBUSD), in one chain per (tile, row); a lone tile keeps the low and high
// nibbles in two chains per row. The integer dots are exact in any order.
template <int NQ, int NT>
[[gnu::always_inline]] inline void score_tiles(const int8_t* q8, const float* dq, int hd, const uint8_t* const* codes,
                                               __m512 (*facc)[NQ]) {
  constexpr int kChains = NT == 1 ? 2 : 1;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const int nb = hd / 32;
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < NQ; ++h) facc[t][h] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    __m512i acc[NT][kChains][NQ];
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < kChains; ++c)
        for (int h = 0; h < NQ; ++h) acc[t][c][h] = _mm512_setzero_si512();
    for (int o = 4 * b; o < 4 * b + 4; ++o) {
      __m512i lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) {
        const __m512i x = _mm512_loadu_si512(codes[t] + 64 * o);
        lo[t] = _mm512_and_si512(x, m4);
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
      }
      for (int h = 0; h < NQ; ++h) {
        const int8_t* qh = q8 + size_t(h) * size_t(hd);
        const __m512i ql = tile_bcast32_avx512(qh + 8 * o);
        for (int t = 0; t < NT; ++t) acc[t][0][h] = _mm512_dpbusd_epi32(acc[t][0][h], lo[t], ql);
        const __m512i qhi = tile_bcast32_avx512(qh + 8 * o + 4);
        for (int t = 0; t < NT; ++t)
          acc[t][kChains - 1][h] = _mm512_dpbusd_epi32(acc[t][kChains - 1][h], hi[t], qhi);
      }
    }
    for (int h = 0; h < NQ; ++h) {
      const __m512 d = _mm512_set1_ps(dq[size_t(h) * size_t(nb) + size_t(b)]);
      for (int t = 0; t < NT; ++t) {
        const __m512i dot = kChains == 2 ? _mm512_add_epi32(acc[t][0][h], acc[t][kChains - 1][h]) : acc[t][0][h];
        facc[t][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, facc[t][h]);
      }
    }
  }
}

template <int NQ>
void scores_pass(const int8_t* q8, const float* dq, const float* cz, int hd, const uint8_t* tiles, int t0, int n,
                 float* out, int out_stride) {
  const size_t tile_bytes = size_t(8 * hd);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  tile_pairs(tiles, tile_bytes, tile0, tile1,
             [&](int tile, auto nt, const uint8_t* const* codes) __attribute__((always_inline)) {
    constexpr int NT = decltype(nt)::value;
    __m512 facc[NT][NQ];
    score_tiles<NQ, NT>(q8, dq, hd, codes, facc);
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < NQ; ++h)
        tile_store_avx512(out + size_t(h) * size_t(out_stride), (tile + t) * 16, t0, n,
                          _mm512_add_ps(facc[t][h], _mm512_set1_ps(cz[h])));
  });
}

}  // namespace

// kivit_fold_query_ref's arithmetic bit for bit: the same products, the same C lanes (lane l of
// the accumulator is the reference's lane l), an exact maximum (NaN lanes ignored as std::max
// does), IEEE division for the step and its inverse (four blocks per vector), conversion to
// nearest even as nearbyint, and saturation and clamp such that NaN becomes -127 as in the reference.
namespace {

// FHD > 0: head_dim as a constant (the loops unroll whole), else hd.
template <int FHD>
void fold_query(const uint8_t* params, const float* q, int n_q, int hd_arg, int8_t* q8, float* dq, float* cz) {
  const int hd = FHD ? FHD : hd_arg;
  const int nb = hd / 32;
  // The group's scales and zeros as f32, once for all rows.
  alignas(64) float sc[1024], ze[1024];
  for (int d = 0; d < hd; d += 16) {
    _mm512_store_ps(sc + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 2 * size_t(d)))));
    _mm512_store_ps(ze + d, _mm512_cvtph_ps(
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 2 * size_t(hd + d)))));
  }
  // Four rows at a time: the maxima of 4 rows x 4 blocks share one vector, so the two divisions
  // (step and its inverse, a long latency chain) run once per 16 (row, block) pairs. The products
  // q * scale are recomputed for the rounding pass (the same bits) instead of held in registers.
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const int nr = std::min(4, n_q - i0);
    __m512 c[4];
    for (int r = 0; r < 4; ++r) c[r] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += 4) {
      __m512 mr[4];
      for (int r = 0; r < 4; ++r) {
        mr[r] = _mm512_setzero_ps();
        if (r >= nr) continue;
        const float* x = q + size_t(i0 + r) * size_t(hd);
        __m512 am[4];
        for (int h = 0; h < 4; ++h) {
          am[h] = _mm512_setzero_ps();
          if (b0 + h >= nb) continue;
          for (int e = 0; e < 2; ++e) {
            const int d = 32 * (b0 + h) + 16 * e;
            const __m512 xv = _mm512_loadu_ps(x + d);
            const __m512 qs = _mm512_mul_ps(xv, _mm512_load_ps(sc + d));
            c[r] = _mm512_fmadd_ps(xv, _mm512_load_ps(ze + d), c[r]);
            // MAXPS returns its second operand when the first is NaN: NaN products are skipped.
            am[h] = _mm512_max_ps(_mm512_abs_ps(qs), am[h]);
          }
        }
        mr[r] = tile_max4x16_avx512(am);
      }
      // Lane 4h + r: block b0 + h of row i0 + r.
      __m512 m = mr[0];
      m = _mm512_mask_mov_ps(m, 0x2222, mr[1]);
      m = _mm512_mask_mov_ps(m, 0x4444, mr[2]);
      m = _mm512_mask_mov_ps(m, 0x8888, mr[3]);
      const __m512 step = _mm512_div_ps(m, _mm512_set1_ps(127.f));
      const __mmask16 ok = _mm512_cmp_ps_mask(step, _mm512_setzero_ps(), _CMP_GT_OQ) &
                           _mm512_cmp_ps_mask(step, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
      const __m512 inv0 = _mm512_maskz_div_ps(ok, _mm512_set1_ps(1.f), step);
      // An inverse that overflowed (a block below ~3.7e-37): no int8 image, as the reference.
      const __mmask16 fin = ok & _mm512_cmp_ps_mask(inv0, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
      const __m512 inv = _mm512_maskz_mov_ps(fin, inv0);
      alignas(64) float st[16];
      _mm512_store_ps(st, _mm512_maskz_mov_ps(fin, step));
      // Rounding: 4 vectors (two 32-dim blocks) at a time, converted to int32 (to nearest even, as
      // nearbyint), packed with signed saturation and clamped to -127 (NaN converts to INT_MIN,
      // which becomes -127 as the reference's clamp makes it), then put back in channel order.
      const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
      for (int r = 0; r < nr; ++r) {
        const float* x = q + size_t(i0 + r) * size_t(hd);
        int8_t* r8 = q8 + size_t(i0 + r) * size_t(hd);
        for (int h = 0; h < 4 && b0 + h < nb; ++h) dq[size_t(i0 + r) * size_t(nb) + size_t(b0 + h)] = st[4 * h + r];
        for (int h = 0; h < 4 && b0 + h < nb; h += 2) {
          const bool two = b0 + h + 1 < nb;
          __m512i wi[4];
          for (int u = 0; u < 4; ++u) {
            const int hb = h + u / 2;
            if (u >= 2 && !two) {
              wi[u] = _mm512_setzero_si512();
              continue;
            }
            const int d = 32 * (b0 + hb) + 16 * (u % 2);
            const __m512 iv = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * hb + r), inv);
            const __m512 qs = _mm512_mul_ps(_mm512_loadu_ps(x + d), _mm512_load_ps(sc + d));
            wi[u] = _mm512_cvtps_epi32(_mm512_mul_ps(qs, iv));
          }
          const __m512i pk = _mm512_permutexvar_epi32(
              order, _mm512_max_epi8(_mm512_packs_epi16(_mm512_packs_epi32(wi[0], wi[1]), _mm512_packs_epi32(wi[2], wi[3])),
                                     _mm512_set1_epi8(-127)));
          int8_t* dst = r8 + 32 * (b0 + h);
          if (two) _mm512_storeu_si512(dst, pk);
          else _mm512_mask_storeu_epi8(dst, __mmask64(0xffffffffull), pk);
        }
      }
    }
    // kivit_reduce_lanes in registers, the same additions in the same order: lanes l + 8, then
    // l + 4, l + 2, l + 1.
    for (int r = 0; r < nr; ++r) {
      const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(c[r]), _mm512_extractf32x8_ps(c[r], 1));
      const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      const __m128 d = _mm_add_ps(b, _mm_movehl_ps(b, b));
      cz[i0 + r] = _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
    }
  }
}

}  // namespace

void kivit_fold_query_avx512(const uint8_t* params, const float* q, int n_q, int hd, int8_t* q8, float* dq,
                             float* cz) {
  kvg_with_head_dim(hd, [&](auto fhd) { fold_query<fhd()>(params, q, n_q, hd, q8, dq, cz); });
}

void kivit_scores_avx512(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                         int t0, int n, float* out, int out_stride) {
  if (n <= 0) return;
  const int nb = hd / 32;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(q8 + size_t(i) * size_t(hd), dq + size_t(i) * size_t(nb), cz + i, hd, tiles, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

}  // namespace kvq
