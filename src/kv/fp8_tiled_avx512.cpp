// AVX-512 BF16 kernels of the tiled fp8 codecs (layout and arithmetic in kv/fp8_tiled.h): each
// 64-byte unit turns into two bf16 vectors with two byte-table permutes, a sign merge and two
// unpacks (kv/fp8_bf16_avx512.h), and meets the query or the weights in VDPBF16PS against a
// broadcast bf16 pair: scores come out one token per lane, weighted sums in channel order.
#include "core/avx512.h"

#include <algorithm>
#include <cstring>

#include "kv/fp8_bf16_avx512.h"
#include "kv/fp8_tiled.h"
#include "kv/int4_tiled.h"
#include "kv/prefetch_along.h"
#include "kv/tiles_avx512.h"

namespace kvq {
namespace {

constexpr int kSegTiles = 8;  // tiles whose weights are formed ahead of the channel loop
constexpr int kAhead = 2;     // sums: tiles ahead requested into L1 (as int8t's kernels)
constexpr int kScoreTiles = 4;  // scores: tiles per step (one query broadcast), the next step requested into L1

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }
inline __m512bh bcast_pair(const uint32_t* p) { return as_bh(_mm512_set1_epi32(int32_t(*p))); }

// T (1, 2 or 4) tiles from tp, tile_bytes apart, against NQ query rows: a query pair broadcast
// serves all T tiles. With T = 4 the A and B products share one accumulator per (tile, row).
// Scores of tile t, row i to out + i * out_stride at tokens base + 16 t.
template <int NQ, int T>
[[gnu::always_inline]] inline void score_tiles(const Fp8TiledLayout& L, const Fp8Lut& lut, const uint32_t* const* q,
                                               const uint8_t* tp, int base, int t0, int n, float* out,
                                               int out_stride) {
  constexpr bool kSplit = T < 4;
  __m512 a[T][NQ], b[kSplit ? T : 1][NQ];
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < NQ; ++i) a[t][i] = _mm512_setzero_ps();
  if constexpr (kSplit)
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < NQ; ++i) b[t][i] = _mm512_setzero_ps();
  const uint8_t* c = tp + L.code_off;
  for (int u = 0; u < L.hd / 4; ++u) {
    __m512i va[T], vb[T];
    for (int t = 0; t < T; ++t)
      fp8_bytes_to_bf16_64(_mm512_loadu_si512(c + size_t(t) * L.tile_bytes + 64 * size_t(u)), lut, &va[t], &vb[t]);
    for (int i = 0; i < NQ; ++i) {
      const __m512bh qa = bcast_pair(q[i] + 2 * u), qb = bcast_pair(q[i] + 2 * u + 1);
      for (int t = 0; t < T; ++t) {
        a[t][i] = _mm512_dpbf16_ps(a[t][i], as_bh(va[t]), qa);
        if constexpr (kSplit) b[t][i] = _mm512_dpbf16_ps(b[t][i], as_bh(vb[t]), qb);
        else a[t][i] = _mm512_dpbf16_ps(a[t][i], as_bh(vb[t]), qb);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const uint8_t* tt = tp + size_t(t) * L.tile_bytes;
    const __m512 m = L.token_scales ? _mm512_loadu_ps(reinterpret_cast<const float*>(tt)) : _mm512_set1_ps(L.scale);
    for (int i = 0; i < NQ; ++i) {
      __m512 z = a[t][i];
      if constexpr (kSplit) z = _mm512_add_ps(z, b[t][i]);
      tile_store_avx512(out + size_t(i) * size_t(out_stride), base + 16 * t, t0, n, _mm512_mul_ps(z, m));
    }
  }
}

template <int NQ>
void scores_pass(const Fp8TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const Fp8Lut& lut = fp8_lut(L.e4m3);
  const uint32_t* q[NQ];
  for (int i = 0; i < NQ; ++i) q[i] = reinterpret_cast<const uint32_t*>(fp8t_query_bf16(L, qp, i));
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  // A step's share of the along range at once (spread over the score loop, hot ran 18% slower;
  // the sums spread theirs, below).
  const KvPrefetchAlong along = kv_prefetch_along;
  const int steps = (tile1 - tile0 + kScoreTiles - 1) / kScoreTiles;
  for (int tile = tile0; tile < tile1; tile += kScoreTiles) {
    kv_prefetch_along_step(along, (tile - tile0) / kScoreTiles, steps);
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    if (tile + 2 * kScoreTiles <= tile1) tile_prefetch_l1(tp + kScoreTiles * L.tile_bytes, kScoreTiles * L.tile_bytes);
    switch (std::min(kScoreTiles, tile1 - tile)) {
      case 4: score_tiles<NQ, 4>(L, lut, q, tp, tile * 16, t0, n, out, out_stride); break;
      case 3:
        score_tiles<NQ, 2>(L, lut, q, tp, tile * 16, t0, n, out, out_stride);
        score_tiles<NQ, 1>(L, lut, q, tp + 2 * L.tile_bytes, tile * 16 + 32, t0, n, out, out_stride);
        break;
      case 2: score_tiles<NQ, 2>(L, lut, q, tp, tile * 16, t0, n, out, out_stride); break;
      default: score_tiles<NQ, 1>(L, lut, q, tp, tile * 16, t0, n, out, out_stride); break;
    }
  }
}

// Word mask of a value unit's vectors for tokens 2m (even words) and 2m + 1 (odd words) of a tile
// whose valid slots are `valid`.
inline __mmask32 pair_words(__mmask16 valid, int m) {
  return __mmask32(((valid >> (2 * m)) & 1 ? 0x55555555u : 0u) | ((valid >> (2 * m + 1)) & 1 ? 0xAAAAAAAAu : 0u));
}

// Channel chunks c0 .. c0 + C - 1 (32 channels each) of the segment's tiles for NQ rows.
template <int NQ, int C>
[[gnu::always_inline]] inline void accum_chunks(const Fp8TiledLayout& L, const Fp8Lut& lut, const uint8_t* seg_tp,
                                                int nt, const uint32_t (*w)[4][8], const __mmask16* valid, int c0,
                                                float* acc, KvAlongSpread& along) {
  __m512 a[NQ][C][2];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < C; ++c) a[i][c][0] = a[i][c][1] = _mm512_setzero_ps();
  for (int tt = 0; tt < nt; ++tt) {
    along.step();
    const uint8_t* cp = seg_tp + size_t(tt) * L.tile_bytes + L.code_off + 512 * size_t(c0);
    const bool full = valid[tt] == 0xffff;
    for (int m = 0; m < 8; ++m) {
      __m512i va[C], vb[C];
      for (int c = 0; c < C; ++c) {
        fp8_bytes_to_bf16_64(_mm512_loadu_si512(cp + 512 * c + 64 * m), lut, &va[c], &vb[c]);
        if (!full) {  // slots outside the range: codes 0 (an unwritten slot may hold a NaN code)
          const __mmask32 k = pair_words(valid[tt], m);
          va[c] = _mm512_maskz_mov_epi16(k, va[c]);
          vb[c] = _mm512_maskz_mov_epi16(k, vb[c]);
        }
      }
      for (int i = 0; i < NQ; ++i) {
        const __m512bh wb = bcast_pair(&w[tt][i][m]);
        for (int c = 0; c < C; ++c) {
          a[i][c][0] = _mm512_dpbf16_ps(a[i][c][0], as_bh(va[c]), wb);
          a[i][c][1] = _mm512_dpbf16_ps(a[i][c][1], as_bh(vb[c]), wb);
        }
      }
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) {
        float* d = acc + size_t(i) * size_t(L.hd) + 32 * size_t(c0 + c) + 16 * size_t(h);
        _mm512_storeu_ps(d, _mm512_add_ps(_mm512_loadu_ps(d), a[i][c][h]));
      }
}

template <int NQ>
void accum_pass(const Fp8TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0, int n,
                float* acc) {
  const Fp8Lut& lut = fp8_lut(L.e4m3);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16, nc = L.hd / 32;
  alignas(64) uint32_t w[kSegTiles][4][8];  // (p_2m, p_2m+1) * mult as bf16 pairs: tile, row, pair
  __mmask16 valid[kSegTiles];
  KvAlongSpread along(kv_prefetch_along, (tile1 - tile0) * ((nc + 1) / 2));  // per (tile, chunk pair)
  for (int seg = tile0; seg < tile1; seg += kSegTiles) {
    const int nt = std::min(kSegTiles, tile1 - seg);
    const uint8_t* seg_tp = block + size_t(seg) * L.tile_bytes;
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* tp = seg_tp + size_t(tt) * L.tile_bytes;
      if (seg + tt + kAhead < tile1) tile_prefetch_l1(tp + kAhead * L.tile_bytes, L.tile_bytes);
      __m512 pv[4];
      valid[tt] = tile_load_weights_avx512<NQ>(p, p_stride, t0, n, (seg + tt) * 16, pv);
      // Masked: slots outside the range may hold anything (NaN scales of unwritten tokens).
      const __m512 m = L.token_scales ? _mm512_maskz_loadu_ps(valid[tt], reinterpret_cast<const float*>(tp))
                                      : _mm512_set1_ps(L.scale);
      for (int i = 0; i < NQ; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(w[tt][i]),
                           reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_mul_ps(valid[tt], pv[i], m))));
    }
    int c = 0;
    for (; c + 2 <= nc; c += 2) accum_chunks<NQ, 2>(L, lut, seg_tp, nt, w, valid, c, acc, along);
    if (c < nc) accum_chunks<NQ, 1>(L, lut, seg_tp, nt, w, valid, c, acc, along);
  }
}

}  // namespace

void fp8t_scores_avx512(const Fp8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                        float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void fp8t_accum_avx512(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                       int t0, int n, float* acc) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    accum_pass<decltype(m)::value>(L, p + size_t(i) * size_t(p_stride), p_stride, block, t0, n,
                                   acc + size_t(i) * size_t(L.hd));
  });
}

// Several head blocks per call (KvCodec::scores_spans / accumulate_spans): the kernels above per
// span, each with its span's along range. What fusing spans buys is attention's batching (one
// softmax update per batch of blocks instead of per block), for blocks small enough to batch.
void fp8t_scores_spans_avx512(const Fp8TiledLayout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans,
                              float* out, int out_stride) {
  kv_for_spans(spans, n_spans, [&](const KvSpan& sp, int o) {
    fp8t_scores_avx512(L, qp, n_q, sp.block, sp.t0, sp.n, out + o, out_stride);
  });
}

void fp8t_accum_spans_avx512(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                             int n_spans, float* acc) {
  kv_for_spans(spans, n_spans, [&](const KvSpan& sp, int o) {
    fp8t_accum_avx512(L, p + o, p_stride, n_q, sp.block, sp.t0, sp.n, acc);
  });
}

}  // namespace kvq
