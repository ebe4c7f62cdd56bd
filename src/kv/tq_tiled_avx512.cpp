// AVX-512 VNNI kernels of TurboQuant's tiles (layout, arithmetic and error bounds in kv/tq_tiled.h):
// per 32-channel block the codes become 8 vectors of 16 token lanes x 4 codes, looked up in the
// segment's codebook image with VPSHUFB and dotted with VPDPBUSD.
#include "core/avx512.h"

#include <cstring>

#include "kv/prefetch_along.h"
#include "kv/tiles_avx512.h"
#include "kv/tq_tiled.h"

namespace kvq {
namespace {

// The segment's codebook image in every 128-bit lane, xor `flip` (0x80: C + 128, the unsigned operand).
inline __m512i seg_lut(const TqTileSeg& g, int flip) {
  __m128i l;
  std::memcpy(&l, g.lut8, 16);
  return _mm512_broadcast_i32x4(_mm_xor_si128(l, _mm_set1_epi8(char(flip))));
}

// Bit k of every byte of y moved to bit 2 (the high bit of a 3-bit code).
inline __m512i high_bit(__m512i y, int k) {
  const __m512i b = k >= 2 ? _mm512_srli_epi16(y, unsigned(k - 2)) : _mm512_slli_epi16(y, unsigned(2 - k));
  return _mm512_and_si512(b, _mm512_set1_epi8(4));
}

// Vectors v = U * o .. U * o + U - 1 (U = 2 at 4 bits, else 4) of the key block at `base` (64 * bits
// bytes), from its o-th 64-byte load: vec[v] = codes of channels 4v..4v+3, one token per 32-bit lane.
template <int U>
[[gnu::always_inline]] inline void key_unit_codes(const uint8_t* base, int bits, int o, __m512i* vec) {
  const __m512i x = _mm512_loadu_si512(base + 64 * o);
  if constexpr (U == 2) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    vec[0] = _mm512_and_si512(x, m4);
    vec[1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
  } else {
    const __m512i m2 = _mm512_set1_epi8(0x03);
    const __m512i y = bits == 3 ? _mm512_loadu_si512(base + 128) : _mm512_setzero_si512();
    for (int r = 0; r < 4; ++r) {
      __m512i c = _mm512_and_si512(r ? _mm512_srli_epi16(x, unsigned(2 * r)) : x, m2);
      if (bits == 3) c = _mm512_or_si512(c, high_bit(y, r + 4 * o));
      vec[r] = c;
    }
  }
}

// Block b's dots of NT (1 or 2) tiles (tp[t]) with NQ query rows, added into facc[t][h]: per
// 64-byte load of each tile its U code vectors (U = 2 at 4 bits, else 4), looked up, against U
// query broadcasts per row that the tiles share (loads bound the dots: two per cycle, one
// broadcast per VPDPBUSD otherwise). The integer dots are exact, so one tile or two give the same
// scores.
template <int NQ, int NT, int U>
[[gnu::always_inline]] inline void score_block(const TqTiledLayout& L, int b, const int8_t* const* q8,
                                               const float* const* dq, const int32_t* const* corr,
                                               const __m512i* lutu, const uint8_t* const* tp, __m512 (*facc)[NQ]) {
  const int s = L.block_seg[b];
  const TqTileSeg& g = L.seg[s];
  const size_t off = g.off + size_t(b - g.ch0 / 32) * size_t(64 * g.bits);
  __m512i a[NT][NQ];
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < NQ; ++h) a[t][h] = _mm512_setzero_si512();
  for (int o = 0; o < 8 / U; ++o) {
    __m512i vec[NT][U];
    for (int t = 0; t < NT; ++t) {
      key_unit_codes<U>(tp[t] + off, g.bits, o, vec[t]);
      for (int u = 0; u < U; ++u) vec[t][u] = _mm512_shuffle_epi8(lutu[s], vec[t][u]);
    }
    for (int h = 0; h < NQ; ++h)
      for (int u = 0; u < U; ++u) {
        const __m512i qb = tile_bcast32_avx512(q8[h] + 32 * b + 4 * (U * o + u));
        for (int t = 0; t < NT; ++t) a[t][h] = _mm512_dpbusd_epi32(a[t][h], vec[t][u], qb);
      }
  }
  for (int h = 0; h < NQ; ++h) {
    const __m512 d = _mm512_set1_ps(dq[h][b]);
    const __m512i c = _mm512_set1_epi32(corr[h][b]);
    for (int t = 0; t < NT; ++t)
      facc[t][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[t][h], c)), d, facc[t][h]);
  }
}

template <int NQ, int NT>
[[gnu::always_inline]] inline void score_tiles(const TqTiledLayout& L, const int8_t* const* q8, const float* const* dq,
                                               const int32_t* const* corr, const __m512i* lutu,
                                               const uint8_t* const* tp, __m512 (*facc)[NQ]) {
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < NQ; ++h) facc[t][h] = _mm512_setzero_ps();
  for (int b = 0; b < L.hd / 32; ++b) {
    if (L.seg[L.block_seg[b]].bits == 4) score_block<NQ, NT, 2>(L, b, q8, dq, corr, lutu, tp, facc);
    else score_block<NQ, NT, 4>(L, b, q8, dq, corr, lutu, tp, facc);
  }
}

template <int NQ>
void scores_pass(const TqTiledLayout& L, const float* qp, const KvSpan* spans, int n_spans, float* out,
                 int out_stride) {
  const int8_t* q8[NQ];
  const float* dq[NQ];
  const int32_t* corr[NQ];
  for (int h = 0; h < NQ; ++h) {
    const float* r = qp + size_t(h) * size_t(L.qdim);
    q8[h] = reinterpret_cast<const int8_t*>(r + L.q8_off);
    dq[h] = r + L.dq_off;
    corr[h] = reinterpret_cast<const int32_t*>(r + L.corr_off);
  }
  __m512i lutu[2];
  for (int s = 0; s < L.nseg; ++s) lutu[s] = seg_lut(L.seg[s], 0x80);
  tile_span_pairs(spans, n_spans, L.tile_bytes,
                  [&](const KvSpan& sp, int col, int tile, auto nt, const uint8_t* const* tp)
                      __attribute__((always_inline)) {
                        constexpr int NT = decltype(nt)::value;
                        __m512 facc[NT][NQ];
                        score_tiles<NQ, NT>(L, q8, dq, corr, lutu, tp, facc);
                        for (int t = 0; t < NT; ++t) {
                          const __m512 norms = tile_load_f16x16_avx512(tp[t]);
                          for (int h = 0; h < NQ; ++h)
                            tile_store_avx512(out + size_t(h) * size_t(out_stride) + col, (tile + t) * 16, sp.t0,
                                              sp.n, _mm512_mul_ps(facc[t][h], norms));
                        }
                      });
}

}  // namespace

void tq_tiled_scores_spans_avx512(const TqTiledLayout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans,
                                  float* out, int out_stride) {
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), spans, n_spans,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void tq_tiled_scores_avx512(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                            float* out, int out_stride) {
  if (n <= 0) return;
  const KvSpan sp = tile_span(block, t0, n);
  tq_tiled_scores_spans_avx512(L, qp, n_q, &sp, 1, out, out_stride);
}

void tq_tiled_accum_avx512(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                           int t0, int n, float* acc) {
  if (n <= 0) return;
  const KvSpan sp = tile_span(block, t0, n);
  tq_tiled_accum_spans_avx512(L, p, p_stride, n_q, &sp, 1, acc);
}

// int4t's weighted sum (tiles_accum_avx512) with the value codes of chunk c, token quad k looked
// up in the chunk's segment image (s8, the operand against u8 weights). Weights with a negative
// entry take the reference's f32 path: the s8-weight path would need the codes unsigned.
void tq_tiled_accum_spans_avx512(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                                 int n_spans, float* acc) {
  if (!tiles_spans_weights_nonneg_avx512(p, p_stride, n_q, spans, n_spans)) {
    tile_spans(spans, n_spans, [&](const KvSpan& sp, int col, KvPrefetchAlong) {
      tq_tiled_accum_signed_ref(L, p + col, p_stride, n_q, sp.block, sp.t0, sp.n, acc);
    });
    return;
  }
  __m512i lut[2];
  for (int s = 0; s < L.nseg; ++s) lut[s] = seg_lut(L.seg[s], 0);
  const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x03);
  tiles_accum_avx512(L.values, p, p_stride, n_q, spans, n_spans, acc,
                     [&](const uint8_t* tp, int c, int k, __m512i* lo, __m512i* hi) {
                       const int s = L.block_seg[c];
                       const TqTileSeg& g = L.seg[s];
                       const uint8_t* base = tp + g.off + size_t(c - g.ch0 / 32) * size_t(64 * g.bits);
                       __m512i l, h;
                       if (g.bits == 4) {
                         const __m512i x = _mm512_loadu_si512(base + 64 * k);
                         l = _mm512_and_si512(x, m4);
                         h = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
                       } else {
                         // Octet k / 2; crumbs 2 (k % 2) (channels i) and 2 (k % 2) + 1 (16 + i).
                         const int p0 = 2 * (k % 2);
                         const __m512i x = _mm512_loadu_si512(base + 64 * (k / 2));
                         l = _mm512_and_si512(p0 ? _mm512_srli_epi16(x, unsigned(2 * p0)) : x, m2);
                         h = _mm512_and_si512(_mm512_srli_epi16(x, unsigned(2 * p0 + 2)), m2);
                         if (g.bits == 3) {
                           const __m512i y = _mm512_loadu_si512(base + 128);
                           l = _mm512_or_si512(l, high_bit(y, p0 + 4 * (k / 2)));
                           h = _mm512_or_si512(h, high_bit(y, p0 + 1 + 4 * (k / 2)));
                         }
                       }
                       *lo = _mm512_shuffle_epi8(lut[s], l);
                       *hi = _mm512_shuffle_epi8(lut[s], h);
                     });
}

}  // namespace kvq
