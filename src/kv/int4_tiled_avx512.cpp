// AVX-512 VNNI kernels of the tiled int4 codec (layout and error bounds in kv/int4_tiled.h): one
// token per int32 lane, so a tile's 16 scores or a tile's contribution to 32 channels are plain
// VPDPBUSD chains with the other operand an embedded dword broadcast.
#include "core/avx512.h"

#include <algorithm>
#include <cstring>

#include "kv/int4_tiled.h"
#include "kv/kv_rows.h"
#include "kv/prefetch_along.h"
#include "kv/tiles_avx512.h"

namespace kvq {
namespace {

// Bit `bit` (0..7) of every byte of h as 0x10 in that byte, else 0: the fifth bits of a q5 code
// vector (kv/int4_tiled.h's layout). Word shifts (left by at most 4, right by at most 3) keep each
// byte's bit 4 within its byte.
[[gnu::always_inline]] inline __m512i fifth_bits(__m512i h, int bit) {
  const __m512i b =
      bit < 4 ? _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - bit)) : _mm512_srl_epi16(h, _mm_cvtsi32_si128(bit - 4));
  return _mm512_and_si512(b, _mm512_set1_epi8(0x10));
}

// iq4_nlt's grid + 128 as u8 in every 128-bit lane (VPSHUFB's table): the u8 operand of VPDPBUSD
// for a signed value table; the dots then subtract 128 times the other operand's sum.
inline __m512i grid_table_u8(const int8_t* lut) {
  alignas(16) uint8_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = uint8_t(int(lut[i]) + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

// kFour: int4t / q4_0t / q4_1t; kFive: q5_0t / q5_1t, the fifth bits ORed in at bit 4 (codes
// 0..31); kGrid: iq4_nlt, each nibble looked up as grid + 128 and the block's dot less 128 times
// the query block's int8 sum. The integer dots are exact in every mode (int32 lanes), so the
// scores equal the reference's bit for bit.
enum ScoreMode { kFour, kFive, kGrid };

// The scores of NT (1 or 2) tiles (tp[t]: tile t's bytes) for NQ query rows, into score[t][h]. Two
// tiles share each query dword broadcast (the loads, not the dot products, bound this kernel: two
// loads per cycle, one broadcast per VPDPBUSD otherwise); their dots then run one chain per (tile,
// row), the low and high nibbles in the same chain (8 chains), while a lone tile keeps them in two
// (8 chains again). The integer dots are exact in every order, so both give the same scores.
template <int NQ, int Mode, int NT>
[[gnu::always_inline]] inline void score_tiles(const Int4TiledLayout& L, const Int4tQueryRow* qr,
                                               const int32_t (*qoff)[kv_max_head_dim / 32], __m512i gtab,
                                               const uint8_t* const* tp, __m512 (*score)[NQ]) {
  constexpr bool kSplit = NT == 1;  // separate low / high nibble chains
  constexpr int kChains = kSplit ? 2 : 1;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const int bpg = L.group / 32;
  const size_t unit = Mode == kFour ? 256 : size_t(L.unit_bytes);
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < NQ; ++h) score[t][h] = _mm512_setzero_ps();
  for (int g = 0; g < L.ng; ++g) {
    __m512 facc[NT][NQ];
    for (int t = 0; t < NT; ++t)
      for (int h = 0; h < NQ; ++h) facc[t][h] = _mm512_setzero_ps();
    for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
      const uint8_t* cb[NT];
      for (int t = 0; t < NT; ++t) cb[t] = tp[t] + L.code_off + unit * size_t(b);
      [[maybe_unused]] __m512i h5[NT];
      if constexpr (Mode == kFive)
        for (int t = 0; t < NT; ++t) h5[t] = _mm512_loadu_si512(cb[t] + 256);
      __m512i acc[NT][kChains][NQ];
      for (int t = 0; t < NT; ++t)
        for (int c = 0; c < kChains; ++c)
          for (int h = 0; h < NQ; ++h) acc[t][c][h] = _mm512_setzero_si512();
      for (int oo = 0; oo < 4; ++oo) {
        const int o = 4 * b + oo;
        __m512i lo[NT], hi[NT];
        for (int t = 0; t < NT; ++t) {
          const __m512i x = _mm512_loadu_si512(cb[t] + 64 * oo);
          lo[t] = _mm512_and_si512(x, m4);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
          if constexpr (Mode == kFive) {  // the low nibbles' fifth bits are bit 2 oo, the high ones' 2 oo + 1
            lo[t] = _mm512_or_si512(lo[t], fifth_bits(h5[t], 2 * oo));
            hi[t] = _mm512_or_si512(hi[t], fifth_bits(h5[t], 2 * oo + 1));
          } else if constexpr (Mode == kGrid) {
            lo[t] = _mm512_shuffle_epi8(gtab, lo[t]);
            hi[t] = _mm512_shuffle_epi8(gtab, hi[t]);
          }
        }
        for (int h = 0; h < NQ; ++h) {
          const __m512i ql = tile_bcast32_avx512(qr[h].q8 + 8 * o);
          for (int t = 0; t < NT; ++t) acc[t][0][h] = _mm512_dpbusd_epi32(acc[t][0][h], lo[t], ql);
          const __m512i qh = tile_bcast32_avx512(qr[h].q8 + 8 * o + 4);
          for (int t = 0; t < NT; ++t)
            acc[t][kChains - 1][h] = _mm512_dpbusd_epi32(acc[t][kChains - 1][h], hi[t], qh);
        }
      }
      for (int h = 0; h < NQ; ++h) {
        const __m512 dq = _mm512_set1_ps(qr[h].dq[b]);
        for (int t = 0; t < NT; ++t) {
          __m512i dot = kSplit ? _mm512_add_epi32(acc[t][0][h], acc[t][kChains - 1][h]) : acc[t][0][h];
          if constexpr (Mode == kGrid) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(qoff[h][b]));
          facc[t][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dq, facc[t][h]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 sv = tile_load_f16x16_avx512(tp[t] + 32 * size_t(g));
      const __m512 mv = tile_load_f16x16_avx512(tp[t] + L.min_off + 32 * size_t(g));
      for (int h = 0; h < NQ; ++h) {
        score[t][h] = _mm512_fmadd_ps(facc[t][h], sv, score[t][h]);
        score[t][h] = _mm512_fmadd_ps(mv, _mm512_set1_ps(qr[h].qsum[g]), score[t][h]);
      }
    }
  }
}

template <int NQ, int Mode>
void scores_pass(const Int4TiledLayout& L, const float* qp, const KvSpan* spans, int n_spans, float* out,
                 int out_stride) {
  Int4tQueryRow qr[NQ];
  for (int h = 0; h < NQ; ++h) qr[h] = int4t_query_row(L, qp, h);
  __m512i gtab = _mm512_setzero_si512();
  // kGrid: 128 * sum of each query block's int8 values, per row and block.
  [[maybe_unused]] int32_t qoff[NQ][kv_max_head_dim / 32];
  if constexpr (Mode == kGrid) {
    gtab = grid_table_u8(L.lut);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int h = 0; h < NQ; ++h)
      for (int b = 0; b < L.hd / 32; ++b) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr[h].q8 + 32 * b));
        const __m512i s4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_zextsi256_si512(q));
        qoff[h][b] = 128 * _mm512_reduce_add_epi32(s4);
      }
  }
  tile_span_pairs(spans, n_spans, L.tile_bytes,
                  [&](const KvSpan& sp, int col, int tile, auto nt, const uint8_t* const* tp)
                      __attribute__((always_inline)) {
                        constexpr int NT = decltype(nt)::value;
                        __m512 score[NT][NQ];
                        score_tiles<NQ, Mode, NT>(L, qr, qoff, gtab, tp, score);
                        for (int t = 0; t < NT; ++t)
                          for (int h = 0; h < NQ; ++h)
                            tile_store_avx512(out + size_t(h) * size_t(out_stride) + col, (tile + t) * 16, sp.t0,
                                              sp.n, score[t][h]);
                      });
}

}  // namespace

void int4t_scores_spans_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans,
                               float* out, int out_stride) {
  tile_row_passes(n_q, [&](int i, auto m) {
    const float* qi = qp + size_t(i) * size_t(L.qdim);
    float* oi = out + size_t(i) * size_t(out_stride);
    if (L.lut) scores_pass<decltype(m)::value, kGrid>(L, qi, spans, n_spans, oi, out_stride);
    else if (L.code_bits == 5) scores_pass<decltype(m)::value, kFive>(L, qi, spans, n_spans, oi, out_stride);
    else scores_pass<decltype(m)::value, kFour>(L, qi, spans, n_spans, oi, out_stride);
  });
}

void int4t_scores_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride) {
  if (n <= 0) return;
  const KvSpan sp = tile_span(block, t0, n);
  int4t_scores_spans_avx512(L, qp, n_q, &sp, 1, out, out_stride);
}

void int4t_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                        int t0, int n, float* acc) {
  if (n <= 0) return;
  const KvSpan sp = tile_span(block, t0, n);
  int4t_accum_spans_avx512(L, p, p_stride, n_q, &sp, 1, acc);
}

void int4t_accum_spans_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                              int n_spans, float* acc) {
  // Channel chunks of 32: per tile 4 loads (token quads), split into low and high nibbles.
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  if (L.lut) {  // iq4_nlt: the grid + 128 as u8 codes against s8 weights (tiles_accum_avx512's Flip)
    const __m512i gtab = grid_table_u8(L.lut);
    return tiles_accum_avx512<true>(L, p, p_stride, n_q, spans, n_spans, acc,
                                    [m4, gtab](const uint8_t* codes, int c, int k, __m512i* lo, __m512i* hi) {
                                      const __m512i x = _mm512_loadu_si512(codes + size_t(c) * 256 + 64 * k);
                                      *lo = _mm512_shuffle_epi8(gtab, _mm512_and_si512(x, m4));
                                      *hi = _mm512_shuffle_epi8(gtab, _mm512_and_si512(_mm512_srli_epi16(x, 4), m4));
                                    });
  }
  if (L.code_bits == 5)  // q5_0t / q5_1t: token quad k's fifth bits are bit k (low nibbles) and 4 + k
    return tiles_accum_avx512(L, p, p_stride, n_q, spans, n_spans, acc,
                              [m4](const uint8_t* codes, int c, int k, __m512i* lo, __m512i* hi) {
                                const uint8_t* u = codes + size_t(c) * 320;
                                const __m512i x = _mm512_loadu_si512(u + 64 * k);
                                const __m512i h5 = _mm512_loadu_si512(u + 256);
                                *lo = _mm512_or_si512(_mm512_and_si512(x, m4), fifth_bits(h5, k));
                                *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(x, 4), m4),
                                                      fifth_bits(h5, 4 + k));
                              });
  tiles_accum_avx512(L, p, p_stride, n_q, spans, n_spans, acc,
                     [m4](const uint8_t* codes, int c, int k, __m512i* lo, __m512i* hi) {
                       const __m512i x = _mm512_loadu_si512(codes + size_t(c) * 256 + 64 * k);
                       *lo = _mm512_and_si512(x, m4);
                       *hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
                     });
}

}  // namespace kvq
