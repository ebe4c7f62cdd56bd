// int2t_g{32,64,128}: int2_gN's quantization (asymmetric min/max per group of G channels, f16
// scale + min, codes 0..3, the same rounding: decode is bit-identical) stored in 16-token tiles so
// that the fused kernels are integer dots with one token per SIMD lane, as int4t's
// (kv/int4_tiled.h). Everything but the code bytes is int4t's: the layout struct
// (Int4TiledLayout, built by int2t_layout: same scale / min tables, same prepared query), the
// query preparation (int4t_prepare_query), the weight steps (int4t_weight_step) and the codec
// boilerplate (TiledCodecBase).
//
// Head block = block_tokens / 16 tiles (block_tokens a multiple of 16), tile_bytes apart:
//   scale f16 [ng][16]   group g's scale of token j at [g][j] (one 32-byte load = 16 tokens)
//   min   f16 [ng][16]
//   codes u8  [4 * head_dim]   (16 tokens x head_dim / 4 bytes, 4 crumbs a byte; layout by role:)
//  K: per dim-16 block o (dims 16o..16o+15) 64 bytes; byte 4j + i holds code[j][16o + 4r + i] in
//     bits 2r..2r+1 (r = 0..3). One 64-byte load = 16 tokens x 16 dims as 4 crumb planes; plane r
//     ((x >> 2r) & 3, one shift and one AND) has in lane j dims 16o + 4r..+3 of token j, and a
//     VPDPBUSD against the query's 4 int8 values of those dims (one broadcast dword) gives 16
//     tokens' partial dots at once. A 32-dim query block is 2 loads and 8 VPDPBUSD per query row.
//  V: per dim chunk c (32 dims) and token octet k (tokens 8k..8k+7), 64 bytes at (2c + k) * 64;
//     lane i (dword i) byte m holds, in crumbs 0..3:
//       code[8k + m][32c + i], code[8k + m][32c + 16 + i], code[8k + 4 + m][32c + i],
//       code[8k + 4 + m][32c + 16 + i].
//     Plane 0 / 2 = channels 32c + i of token quads 2k / 2k + 1, plane 1 / 3 = channels 32c + 16 + i:
//     a VPDPBUSD of a plane against its quad's 4 int8 weights (one broadcast dword) adds 4 tokens
//     into 16 channels; a chunk of 32 channels (one group: G >= 32) is 2 loads and 4 VPDPBUSD
//     per query row and tile (int4t: 4 and 8).
// Bytes per tile = 16 * (head_dim / 4 + 4 * ng) = 16 * int2_gN's row bytes (same bits per element).
//
// Scores (error bound): int4t's derivation with codes 0..3. The prepared query is int4t's
// (plain f32, q8 per 32-dim block with step dq_b = absmax_b / 127, dq, exact float qsum per group),
//   score_t = sum_g ( s_tg * sum_{b in g} dq_b * <c_tb, q8_b> + m_tg * qsum_g ),
// the integer dots are exact (|<c_tb, q8_b>| <= 32 * 3 * 127), so
//   |score - <q, decode(k_t)>| <= sum_j (dq_b(j) / 2)(1 + 2^-21) * |s_t c_tj| + f32 rounding.
//
// Weighted sum (error bound): int4t's. Per (query row, group g, tile) the weights w_t = p_t * s_tg
// are rounded to steps dw = max_t |w_t| / W (int4t_weight_step; u8, W = 255, when every weight of
// the call is >= 0, else s8, W = 127), the min term sum_t p_t m_tg is summed in f32, the integer
// dot is exact (|sum| <= 16 * 3 * 255), so channel d of query row i moves by at most
//   sum_tiles (dw / 2)(1 + W 2^-21) * sum_{t in tile} c_t[d]  + f32 rounding,
// with c_t[d] <= 3 and s_t = range_t / 3: relative to attention's output (acc / l), at most
// 16 * max_t (pi_t range_t) / 510 per tile (pi: the softmax probabilities), the same as int4t's
// (15 codes of range / 15): the weight rounding costs the same share of the group range, int2's
// own quantization error (range / 6 per element) is what differs.
//
// Kernels: *_ref (scalar, same arithmetic: scores bit-identical to the SIMD ones, weighted sums
// equal up to f32 summation order), *_avx2, *_avx512 with one signature (Int4tScoresFn /
// Int4tAccumFn); int2t_scores / int2t_accum are the one dispatch point (cpu_level()). Ranges
// [t0, t0 + n) need not be tile-aligned: lanes outside are computed on whatever the block holds but
// never stored (scores) or weighted 0 (sums).
//
// kivi2t's keys (kv/kivi_tiled.cpp) are int2t's K tiles without the per-token tables (KIVI scales
// keys per channel over a group of G tokens; the scales are folded into the query by
// kivit_fold_query, kv/kivi_tiled.h): kivi2t_scores* below are int2t's score chain with unit
// token scale and zero minimum, score_t = fl(sum_b dq_b <c_tb, q8_b>) + C.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kv/int4_tiled.h"

namespace kvq {

// int4t's layout with 2-bit codes: tile_bytes = code_off + 4 * hd (the tables and the prepared
// query are int4t's). Requires group >= 32, group % 32 == 0, hd % group == 0, hd <= kv_max_head_dim.
Int4TiledLayout int2t_layout(int head_dim, int group);
// Code bytes of a tile: 16 tokens x hd / 4.
inline size_t int2t_code_bytes(int head_dim) { return size_t(4 * head_dim); }

// Crumb (2-bit code) of element d of tile slot j in a K / V tile's code bytes: the layout above.
inline int int2t_key_code(const uint8_t* codes, int j, int d) {
  return (codes[64 * (d / 16) + 4 * j + d % 4] >> (2 * ((d % 16) / 4))) & 3;
}
inline int int2t_value_code(const uint8_t* codes, int j, int d) {
  const int c = d / 32, r = d % 32, k = j / 8, m = j % 4, hi_quad = (j % 8) / 4;
  return (codes[64 * (2 * c + k) + 4 * (r % 16) + m] >> (2 * (r / 16 + 2 * hi_quad))) & 3;
}

void int2t_scores_ref(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride);
void int2t_accum_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc);
#if defined(KVQ_HAVE_SIMD)
void int2t_scores_avx2(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride);
void int2t_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc);
void int2t_scores_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride);
void int2t_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                        int t0, int n, float* acc);
void int2t_scores_spans_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans,
                               float* out, int out_stride);
void int2t_accum_spans_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                              int n_spans, float* acc);
#endif
// The dispatch point.
void int2t_scores(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                  float* out, int out_stride);
void int2t_accum(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                 int n, float* acc);

// kivi2t key scores: out[i * out_stride + t] = score of folded row i (q8 (n_q, hd), dq (n_q, hd / 32),
// cz (n_q), kivit_fold_query's output) against token t0 + t of a group's tiles, t < n.
// tiles: (G / 16) tiles of int2t_code_bytes(hd) bytes in int2t's K layout. Same signature as
// KivitScoresFn (kv/kivi_tiled.h).
void kivi2t_scores_ref(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                       int t0, int n, float* out, int out_stride);
#if defined(KVQ_HAVE_SIMD)
void kivi2t_scores_avx2(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                        int t0, int n, float* out, int out_stride);
void kivi2t_scores_avx512(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd,
                          const uint8_t* tiles, int t0, int n, float* out, int out_stride);
#endif
// The dispatch point.
void kivi2t_scores(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                   int t0, int n, float* out, int out_stride);

}  // namespace kvq
