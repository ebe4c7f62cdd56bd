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


// Bit `bit` (0..7) of every byte of h as 0x10 in that byte, else 0: the fifth bits of a q5 code
// vector. Word shifts (left by at most 4, right by at most 3) keep each byte's bit 4 within its byte.
[[gnu::always_inline]] inline __m256i fifth_bits(__m256i h, int bit) {
  const __m256i b =
      bit < 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - bit)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(bit - 4));
  return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
}

// iq4_nlt's VPSHUFB tables: |grid| (the u8 operand) and grid (its sign).
inline void grid_tables(const int8_t* lut, __m256i* abs, __m256i* sgn) {
  int8_t a[16];
  for (int i = 0; i < 16; ++i) a[i] = int8_t(lut[i] < 0 ? -lut[i] : lut[i]);
  *abs = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
  *sgn = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut)));
}

// Scores (tiles_scores_pass_avx2's pass) with int4t's block dot: both 8-token halves (bytes 0..31
// and 32..63 of every 64-byte octet record) against the same query broadcasts. Per query block b (4 octets, low and high nibbles:
// 8 VPMADDUBSW per half) the int16 sums stay within 8 * 2 * 15 * 127 = 30480, so a block's dot
// is one int16 chain and one widening per (row, half).
template <int NQ>
void scores_pass(const Int4TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  tiles_scores_pass_avx2<NQ>(
      L, qp, block, t0, n, out, out_stride,
      [=](const uint8_t* codes, int b, const int8_t* const* q8, __m256i(*dot)[2]) {
        __m256i s16[NQ][2];
        for (int h = 0; h < NQ; ++h) s16[h][0] = s16[h][1] = _mm256_setzero_si256();
        for (int o = 4 * b; o < 4 * b + 4; ++o) {
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o + 32));
          const __m256i lo0 = _mm256_and_si256(x0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(x0, 4), m4);
          const __m256i lo1 = _mm256_and_si256(x1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(x1, 4), m4);
          for (int h = 0; h < NQ; ++h) {
            const __m256i ql = tile_bcast32_avx2(q8[h] + 8 * o), qh = tile_bcast32_avx2(q8[h] + 8 * o + 4);
            s16[h][0] = _mm256_add_epi16(
                s16[h][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, ql), _mm256_maddubs_epi16(hi0, qh)));
            s16[h][1] = _mm256_add_epi16(
                s16[h][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, ql), _mm256_maddubs_epi16(hi1, qh)));
          }
        }
        for (int h = 0; h < NQ; ++h) {
          dot[h][0] = tile_widen_avx2(s16[h][0]);
          dot[h][1] = tile_widen_avx2(s16[h][1]);
        }
      });
}

// The scores of q5_0t / q5_1t (Mode kFive) and iq4_nlt (kGrid), as scores_pass's with the
// codes' values widened: kFive ORs the fifth bits into the nibbles (bit 4), codes up to 31, and
// widens the int16 chains every 2 octets; kGrid looks each nibble up as |grid| and as grid, whose
// sign goes onto the query bytes (VPSIGNB), and widens every product (a pair sum reaches
// 2 * 127 * 127). A block function of their own: folding the modes into scores_pass's cost the
// 4-bit kernel 25%.
enum ScoreMode { kFive, kGrid };
template <int NQ, int Mode>
void scores_pass_wide(const Int4TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                      int out_stride) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  __m256i lut_abs = m4, lut_sgn = m4;
  if constexpr (Mode == kGrid) grid_tables(L.lut, &lut_abs, &lut_sgn);
  const size_t unit = size_t(L.unit_bytes);
  tiles_scores_pass_avx2<NQ>(
      L, qp, block, t0, n, out, out_stride,
      [=](const uint8_t* codes, int b, const int8_t* const* q8, __m256i(*dot)[2]) {
        const uint8_t* cb = codes + unit * size_t(b);
        __m256i s16[NQ][2];
        for (int h = 0; h < NQ; ++h) {
          s16[h][0] = s16[h][1] = _mm256_setzero_si256();
          dot[h][0] = dot[h][1] = _mm256_setzero_si256();
        }
        __m256i h5[2];
        if constexpr (Mode == kFive)
          for (int e = 0; e < 2; ++e) h5[e] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + 32 * e));
        for (int oo = 0; oo < 4; ++oo) {
          const int o = 4 * b + oo;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * oo));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * oo + 32));
          __m256i v[4] = {_mm256_and_si256(x0, m4), _mm256_and_si256(_mm256_srli_epi16(x0, 4), m4),
                          _mm256_and_si256(x1, m4), _mm256_and_si256(_mm256_srli_epi16(x1, 4), m4)};
          if constexpr (Mode == kGrid) {
            __m256i va[4], vs[4];
            for (int i = 0; i < 4; ++i) {
              va[i] = _mm256_shuffle_epi8(lut_abs, v[i]);
              vs[i] = _mm256_shuffle_epi8(lut_sgn, v[i]);
            }
            for (int h = 0; h < NQ; ++h) {
              const __m256i qv[2] = {tile_bcast32_avx2(q8[h] + 8 * o), tile_bcast32_avx2(q8[h] + 8 * o + 4)};
              for (int i = 0; i < 4; ++i)
                dot[h][i / 2] = _mm256_add_epi32(
                    dot[h][i / 2], tile_widen_avx2(_mm256_maddubs_epi16(va[i], _mm256_sign_epi8(qv[i % 2], vs[i]))));
            }
          } else {
            for (int e = 0; e < 2; ++e) {  // the low nibbles' fifth bits are bit 2 oo, the high ones' 2 oo + 1
              v[2 * e] = _mm256_or_si256(v[2 * e], fifth_bits(h5[e], 2 * oo));
              v[2 * e + 1] = _mm256_or_si256(v[2 * e + 1], fifth_bits(h5[e], 2 * oo + 1));
            }
            for (int h = 0; h < NQ; ++h) {
              const __m256i ql = tile_bcast32_avx2(q8[h] + 8 * o), qh = tile_bcast32_avx2(q8[h] + 8 * o + 4);
              for (int e = 0; e < 2; ++e)
                s16[h][e] = _mm256_add_epi16(s16[h][e], _mm256_add_epi16(_mm256_maddubs_epi16(v[2 * e], ql),
                                                                         _mm256_maddubs_epi16(v[2 * e + 1], qh)));
            }
            if (oo % 2 == 1)
              for (int h = 0; h < NQ; ++h)
                for (int e = 0; e < 2; ++e) {
                  dot[h][e] = _mm256_add_epi32(dot[h][e], tile_widen_avx2(s16[h][e]));
                  s16[h][e] = _mm256_setzero_si256();
                }
          }
        }
      });
}

}  // namespace

void int4t_scores_avx2(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    const float* qi = qp + size_t(i) * size_t(L.qdim);
    float* oi = out + size_t(i) * size_t(out_stride);
    if (L.lut) scores_pass_wide<decltype(m)::value, kGrid>(L, qi, block, t0, n, oi, out_stride);
    else if (L.code_bits == 5) scores_pass_wide<decltype(m)::value, kFive>(L, qi, block, t0, n, oi, out_stride);
    else scores_pass<decltype(m)::value>(L, qi, block, t0, n, oi, out_stride);
  });
}

// The weighted sum: tiles_accum_avx2 with int4t's nibbles. Int16 chains over a tile's 4 token quads:
// u8 weights x s8 codes 4 quads * 2 * 255 * 15 = 30600, s8 weights x u8 codes 4 * 2 * 15 * 127: both fit.
// q5_0t / q5_1t: the fifth bits ORed in at bit 4 (lo[k]: bit k of the chunk half's fifth-bit
// vector, hi[k]: bit 4 + k); their u8 chains are widened every 2 quads (tiles_accum_avx2's Five).
void int4t_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  auto nibbles = [m4](const uint8_t* cp, __m256i* lo, __m256i* hi) {
    for (int k = 0; k < 4; ++k) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * k));
      lo[k] = _mm256_and_si256(x, m4);
      hi[k] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
    }
  };
  if (L.lut) {  // iq4_nlt: signed scales, s8 weights always (tile_accum_chunk_signlut_avx2)
    __m256i lut_abs, lut_sgn;
    grid_tables(L.lut, &lut_abs, &lut_sgn);
    return tiles_accum_lut_avx2<false>(
        L, p, p_stride, n_q, block, t0, n, acc,
        [nibbles](const uint8_t* codes, int c, int half, __m256i* lo, __m256i* hi) {
          nibbles(codes + size_t(c) * 256 + 32 * size_t(half), lo, hi);
        },
        [lut_abs, lut_sgn](int, __m256i* t1, __m256i* t2) {
          *t1 = lut_abs;
          *t2 = lut_sgn;
        });
  }
  if (L.code_bits != 5)
    return tiles_accum_avx2(L, p, p_stride, n_q, block, t0, n, acc,
                            [nibbles](const uint8_t* codes, int c, int half, __m256i* lo, __m256i* hi) {
                              nibbles(codes + size_t(c) * 256 + 32 * size_t(half), lo, hi);
                            });
  tiles_accum_avx2<true>(L, p, p_stride, n_q, block, t0, n, acc,
                         [nibbles](const uint8_t* codes, int c, int half, __m256i* lo, __m256i* hi) {
                           const uint8_t* u = codes + size_t(c) * 320;
                           nibbles(u + 32 * size_t(half), lo, hi);
                           const __m256i h5 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 256 + 32 * half));
                           for (int k = 0; k < 4; ++k) {  // token quad k: bits k (low nibbles) and 4 + k
                             lo[k] = _mm256_or_si256(lo[k], fifth_bits(h5, k));
                             hi[k] = _mm256_or_si256(hi[k], fifth_bits(h5, 4 + k));
                           }
                         });
}

}  // namespace kvq
