// AVX-512 VNNI kernels of the tiled int2 codec and kivi2t's key scores (layout and error bounds in
// kv/int2_tiled.h): one token per int32 lane; a 64-byte load is 4 crumb planes, each extracted
// with one shift and one AND and fed to a VPDPBUSD whose other operand is a dword broadcast.
#include "core/avx512.h"

#include <algorithm>
#include <cstring>

#include "kv/int2_tiled.h"
#include "kv/prefetch_along.h"
#include "kv/tiles_avx512.h"

namespace kvq {
namespace {


inline __m512i plane(__m512i x, int r) {
  const __m512i m2 = _mm512_set1_epi8(0x03);
  return r == 0 ? _mm512_and_si512(x, m2) : _mm512_and_si512(_mm512_srli_epi16(x, 2 * r), m2);
}

// 16 tokens' exact dots of a K tile's 32-dim block b with each row's int8 query (q8[h]: the row's
// hd values): planes 0 / 2 and 1 / 3 in two chains per row.
template <int NQ>
inline void key_block_dots(const uint8_t* codes, int b, const int8_t* const* q8, __m512i* dot) {
  __m512i a[NQ], c[NQ];
  for (int h = 0; h < NQ; ++h) a[h] = c[h] = _mm512_setzero_si512();
  for (int o = 2 * b; o < 2 * b + 2; ++o) {
    const __m512i x = _mm512_loadu_si512(codes + 64 * o);
    const __m512i p0 = plane(x, 0), p1 = plane(x, 1), p2 = plane(x, 2), p3 = plane(x, 3);
    for (int h = 0; h < NQ; ++h) {
      const int8_t* q = q8[h] + 16 * o;
      a[h] = _mm512_dpbusd_epi32(a[h], p0, tile_bcast32_avx512(q));
      c[h] = _mm512_dpbusd_epi32(c[h], p1, tile_bcast32_avx512(q + 4));
      a[h] = _mm512_dpbusd_epi32(a[h], p2, tile_bcast32_avx512(q + 8));
      c[h] = _mm512_dpbusd_epi32(c[h], p3, tile_bcast32_avx512(q + 12));
    }
  }
  for (int h = 0; h < NQ; ++h) dot[h] = _mm512_add_epi32(a[h], c[h]);
}

template <int NQ>
void scores_pass(const Int4TiledLayout& L, const float* qp, const KvSpan* spans, int n_spans, float* out,
                 int out_stride) {
  const int bpg = L.group / 32;
  Int4tQueryRow qr[NQ];
  const int8_t* q8[NQ];
  for (int h = 0; h < NQ; ++h) {
    qr[h] = int4t_query_row(L, qp, h);
    q8[h] = qr[h].q8;
  }
  tile_spans(spans, n_spans, [&](const KvSpan& sp, int col, KvPrefetchAlong along) {
  const int t0 = sp.t0, n = sp.n;
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  for (int tile = tile0; tile < tile1; ++tile) {
    kv_prefetch_along_step(along, tile - tile0, tile1 - tile0);
    const uint8_t* tp = sp.block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off;
    __m512 score[NQ];
    for (int h = 0; h < NQ; ++h) score[h] = _mm512_setzero_ps();
    for (int g = 0; g < L.ng; ++g) {
      __m512 facc[NQ];
      for (int h = 0; h < NQ; ++h) facc[h] = _mm512_setzero_ps();
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
        __m512i dot[NQ];
        key_block_dots<NQ>(codes, b, q8, dot);
        for (int h = 0; h < NQ; ++h)
          facc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[h]), _mm512_set1_ps(qr[h].dq[b]), facc[h]);
      }
      const __m512 sv = tile_load_f16x16_avx512(tp + 32 * size_t(g));
      const __m512 mv = tile_load_f16x16_avx512(tp + L.min_off + 32 * size_t(g));
      for (int h = 0; h < NQ; ++h) {
        score[h] = _mm512_fmadd_ps(facc[h], sv, score[h]);
        score[h] = _mm512_fmadd_ps(mv, _mm512_set1_ps(qr[h].qsum[g]), score[h]);
      }
    }
    for (int h = 0; h < NQ; ++h)
      tile_store_avx512(out + size_t(h) * size_t(out_stride) + col, tile * 16, t0, n, score[h]);
  }
  });
}

template <int NQ>
void kivi_scores_pass(const int8_t* q8, const float* dq, const float* cz, int hd, const uint8_t* tiles, int t0,
                      int n, float* out, int out_stride) {
  const size_t tile_bytes = int2t_code_bytes(hd);
  const int nb = hd / 32;
  const int8_t* qh[NQ];
  for (int h = 0; h < NQ; ++h) qh[h] = q8 + size_t(h) * size_t(hd);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* codes = tiles + size_t(tile) * tile_bytes;
    __m512 facc[NQ];
    for (int h = 0; h < NQ; ++h) facc[h] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      __m512i dot[NQ];
      key_block_dots<NQ>(codes, b, qh, dot);
      for (int h = 0; h < NQ; ++h)
        facc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[h]), _mm512_set1_ps(dq[size_t(h) * size_t(nb) + size_t(b)]),
                                  facc[h]);
    }
    for (int h = 0; h < NQ; ++h)
      tile_store_avx512(out + size_t(h) * size_t(out_stride), tile * 16, t0, n,
                        _mm512_add_ps(facc[h], _mm512_set1_ps(cz[h])));
  }
}

}  // namespace

void int2t_scores_spans_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans,
                               float* out, int out_stride) {
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), spans, n_spans,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void int2t_scores_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride) {
  if (n <= 0) return;
  const KvSpan sp = tile_span(block, t0, n);
  int2t_scores_spans_avx512(L, qp, n_q, &sp, 1, out, out_stride);
}

void int2t_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                        int t0, int n, float* acc) {
  if (n <= 0) return;
  const KvSpan sp = tile_span(block, t0, n);
  int2t_accum_spans_avx512(L, p, p_stride, n_q, &sp, 1, acc);
}

void int2t_accum_spans_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                              int n_spans, float* acc) {
  // Channel chunks of 32: per tile 2 loads (token octets), each 4 crumb planes (token quad x
  // channel half): quads 2o and 2o + 1 read the same 64 bytes.
  tiles_accum_avx512(L, p, p_stride, n_q, spans, n_spans, acc,
                     [](const uint8_t* codes, int c, int k, __m512i* lo, __m512i* hi) {
                       const __m512i x = _mm512_loadu_si512(codes + size_t(c) * 128 + 64 * (k / 2));
                       *lo = plane(x, 2 * (k % 2));
                       *hi = plane(x, 2 * (k % 2) + 1);
                     });
}

void kivi2t_scores_avx512(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd,
                          const uint8_t* tiles, int t0, int n, float* out, int out_stride) {
  if (n <= 0) return;
  const int nb = hd / 32;
  tile_row_passes(n_q, [&](int i, auto m) {
    kivi_scores_pass<decltype(m)::value>(q8 + size_t(i) * size_t(hd), dq + size_t(i) * size_t(nb), cz + i, hd, tiles,
                                         t0, n, out + size_t(i) * size_t(out_stride), out_stride);
  });
}

}  // namespace kvq
