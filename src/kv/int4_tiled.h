// int4t_g{32,64,128}: int4_gN's quantization (asymmetric min/max per group of G channels, f16
// scale + min, codes 0..15, the same rounding: decode is bit-identical) stored in 16-token tiles
// so that the fused kernels are integer dots with one token per SIMD lane: no horizontal
// reduction per token, no float FMA per element.
//
// Head block = block_tokens / 16 tiles (block_tokens a multiple of 16), tile_bytes apart:
//   scale f16 [ng][16]   group g's scale of token j at [g][j] (one 32-byte load = 16 tokens)
//   min   f16 [ng][16]
//   codes u8  [8 * head_dim]   (16 tokens x head_dim / 2 bytes, layout by role:)
//  K: per dim-octet o (dims 8o..8o+7) 64 bytes; byte 4j + i = code[j][8o + i] | code[j][8o + 4 + i] << 4:
//     one 64-byte load, low nibbles = lane j holds dims 8o..8o+3 of token j, high nibbles dims
//     8o+4..8o+7. A VPDPBUSD against the query's 4 int8 values (one broadcast dword) gives 16
//     tokens' partial dots at once.
//  V: per dim chunk c (32 dims) and token quad k (tokens 4k..4k+3), 64 bytes at (4c + k) * 64;
//     lane i byte m = code[4k + m][32c + i] | code[4k + m][32c + 16 + i] << 4: a VPDPBUSD against
//     the 4 tokens' int8 weights (one broadcast dword) adds 4 tokens into 16 channels.
// Bytes per tile = 16 * (head_dim / 2 + 4 * ng) = 16 * int4_gN's row bytes (same bits per element).
//
// Scores (error bound). The prepared query (prepared_query_dim floats per query row):
//   [0, hd)                plain f32 query
//   hd floats onward       int8 q8[hd] (natural order; q8 = round(q / dq_b), dq_b = absmax_b / 127
//                          per 32-dim block b), then dq[hd / 32] f32, then qsum[ng] f32 (exact
//                          float sum of q over group g).
// score_t = sum_g ( s_tg * sum_{b in g} dq_b * <c_tb, q8_b> + m_tg * qsum_g ): the integer dots are
// exact, so the only approximation is the query rounding |dq_b q8_j - q_j| <= dq_b / 2 (+ a relative
// 2^-22 of dq_b for the f32 product before rounding), i.e.
//   |score - <q, decode(k_t)>| <= sum_j (dq_b(j) / 2)(1 + 2^-21) * |s_t c_tj| + f32 rounding,
// the same bound as int4_gN's integer-dot kernels (kv_rows.h).
//
// Weighted sum (error bound). Per (query row, group g, tile) the weights w_t = p_t * s_tg of the
// tile's tokens are rounded to integer steps dw = max_t |w_t| / W (int4t_weight_step); the min
// term sum_t p_t m_tg is summed in f32. When every weight of the call is >= 0 (attention's
// probabilities always are) the weights are u8 (W = 255) and the codes, 0..15, are the s8 operand
// of the u8 x s8 dot; otherwise the weights are s8 (W = 127) against u8 codes. The integer dot of
// codes and weights is exact (|sum| <= 16 * 15 * 255), so channel d of query row i moves by at most
//   sum_tiles (dw / 2)(1 + W 2^-21) * sum_{t in tile} c_t[d]  + f32 rounding.
// Relative to the output of attention (acc / l) the step of a tile is max_t (pi_t s_t) / 255 with
// pi the softmax probabilities: the error is at most ~1/510 of the tile's largest probability
// times its code range, per tile.
//
// q4_0t: llama.cpp q4_0's quantization (x = (c - 8) d per 32 channels, d = f16, possibly
// negative; decode bit-identical to q4_0's, same bytes) in these tiles without a min table: the
// scale table doubles as the min table and the min terms are scaled by -8 (q4_0t_layout). Its
// weights always take the s8 path (a negative d makes p * d negative), so the weighted sum's
// step is max_t |p_t d_t| / 127 per (row, tile). Format "q4_0" stores it; "q4_0_rows" keeps the rows.
//
// q5_0t / q5_1t: llama.cpp's q5_0 (x = (c - 16) d, no min table, min_mul -16, signed scales, as
// q4_0t) and q5_1 (x = c d + m: int4t_g32's tables) with 5-bit codes 0..31 (decode bit-identical
// to the rows, same bytes). code_bits 5: each 32-dim block (K) / 32-channel chunk (V) of the code
// bytes is 320 bytes, int4t's 256 nibble bytes of it (the codes' low 4 bits, int4t's layout) then
// 64 bytes of fifth bits, placed so that word shifts (VPSLLW / VPSRLW) and a VPAND move a
// vector's fifth bits to bit 4 of the bytes its nibbles occupy:
//  K: byte 256 + 32 e + 4 (j % 8) + k, e = j / 8 (the tile half), bit 2 oo + nib: the fifth bit of
//     dim 8 oo + 4 nib + k of the block (oo: octet within the block; a token owns its bytes).
//  V: byte 256 + 32 half + 4 (r % 8) + j % 4 (r: channel within the chunk, half = (r % 16) / 8),
//     bit 4 (r / 16) + j / 4 (the token quad; a byte holds bits of 4 tokens).
// The integer dots stay exact: scores widen their int16 sums every 2 octets (4 * 2 * 31 * 127 <
// 2^15), the u8 weighted sums every 2 token quads (2 * 2 * 255 * 31); s8 weights against 0..31
// fit 4 quads as int4t's. Format "q5_0" / "q5_1" store them; "q5_0_rows" / "q5_1_rows" keep the rows.
//
// iq4_nlt: llama.cpp's iq4_nl (x = d * grid[c] per 32 channels, kv_iq4nl_grid, d f16 of either
// sign; decode bit-identical to the rows, same bytes) in q4_0t's tiles with lut = the grid and no
// min term (min_mul 0): the kernels dot the grid's int8 values (|grid| <= 127) instead of the
// codes. Scores and (s8) weighted sums take VPSIGNB's sign of the grid value onto the other
// operand against |grid| in VPMADDUBSW; a pair sum reaches 2 * 127 * 127 and is widened at once.
// Bounds as q4_0t's with |grid[c]| for c. Format "iq4_nl" stores it; "iq4_nl_rows" keeps the rows.
//
// Kernels: *_ref (scalar, same arithmetic: scores are bit-identical to the SIMD ones, weighted
// sums equal up to f32 summation order), *_avx2, *_avx512; int4t_scores / int4t_accum are the one
// dispatch point (cpu_level()). The AVX-512 kernels of q5_0t / q5_1t OR the fifth bits into the
// nibbles (int32 lanes: no widening); iq4_nlt's look the grid up as grid + 128 (VPSHUFB) for the
// u8 operand and subtract 128 times the other operand's sum (the query block's int8 sum in scores,
// each tile's weight sum in weighted sums). Ranges [t0, t0 + n) need not be tile-aligned: lanes
// outside are computed on whatever the block holds but never stored (scores) or weighted 0 (sums).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvq/kv_format.h"

namespace kvq {

inline constexpr int kv_tile_tokens = 16;

struct Int4TiledLayout {
  int hd = 0;
  int group = 0;
  int ng = 0;             // hd / group
  size_t tile_bytes = 0;  // 16 * (hd / 2 + 4 * ng)
  size_t min_off = 0;     // bytes of the scale table (= ng * 32)
  size_t code_off = 0;    // bytes of scale + min tables (= ng * 64)
  int qdim = 0;           // prepared query floats per row
  int q8_off = 0;         // float offsets inside a prepared row
  int dq_off = 0;
  int qsum_off = 0;
  // q4_0t (llama.cpp's q4_0 in these tiles: x = (c - 8) d per 32 channels) has no min table: it
  // reads its scale table as the min table (min_off = 0) and scales the min term by min_mul = -8
  // (m = -8 d exactly: a power-of-two factor commutes with every rounding). Its d may be negative
  // (q4_0 puts the largest magnitude on code 0 whatever its sign), so its weights p * d take the
  // s8 path (signed_scales).
  float min_mul = 1.f;
  bool signed_scales = false;
  int code_bits = 4;     // 5: q5_0t / q5_1t
  int unit_bytes = 256;  // code bytes per 32-dim block (K) / 32-channel chunk (V): 320 at 5 bits
  const int8_t* lut = nullptr;  // iq4_nlt: code c stands for lut[c] (kv_iq4nl_grid)
};

Int4TiledLayout int4t_layout(int head_dim, int group);
// q4_0t: group 32, min_off 0, min_mul -8, signed scales; tile_bytes = 16 * q4_0's row bytes.
Int4TiledLayout q4_0t_layout(int head_dim);
// q5_0t (with_min false: q4_0t's tables, min_mul -16) and q5_1t (int4t_g32's tables), code_bits 5;
// tile_bytes = 16 * q5_0's / q5_1's row bytes.
Int4TiledLayout q5t_layout(int head_dim, bool with_min);
// iq4_nlt: q4_0t's tables, min_mul 0, lut kv_iq4nl_grid; tile_bytes = 16 * iq4_nl's row bytes.
Int4TiledLayout iq4nlt_layout(int head_dim);

// Byte range of the units (tiles, or groups of tiles) of `unit_tokens` tokens, `unit_bytes` apart,
// that hold tokens [t0, t0 + n) of a head block: what the tiled codecs ask attention to request
// (prefetch_along_range; its first prefetch_lead_bytes for prefetch_range). {0, 0} when n <= 0.
inline void kv_unit_range(size_t unit_bytes, int unit_tokens, int t0, int n, size_t* offset, size_t* bytes) {
  if (n <= 0) {
    *offset = *bytes = 0;
    return;
  }
  const size_t first = size_t(t0 / unit_tokens) * unit_bytes;
  const size_t last = size_t((t0 + n + unit_tokens - 1) / unit_tokens) * unit_bytes;
  *offset = first;
  *bytes = last - first;
}

// f(i, m) for the passes of the SIMD kernels over n_q query rows: at most MaxRows (<= 4) rows a
// pass (the accumulator registers), i the pass's first row, m its row count as
// std::integral_constant<int, 1..MaxRows> so that each count has its own kernel instance.
template <int MaxRows, typename F>
inline void tile_row_passes_of(int n_q, F&& f) {
  static_assert(MaxRows >= 1 && MaxRows <= 4);
  for (int i = 0; i < n_q; i += MaxRows) {
    switch (std::min(MaxRows, n_q - i)) {
      case 1: f(i, std::integral_constant<int, 1>{}); break;
      case 2: if constexpr (MaxRows >= 2) f(i, std::integral_constant<int, 2>{}); break;
      case 3: if constexpr (MaxRows >= 3) f(i, std::integral_constant<int, 3>{}); break;
      default: if constexpr (MaxRows >= 4) f(i, std::integral_constant<int, 4>{}); break;
    }
  }
}
template <typename F>
inline void tile_row_passes(int n_q, F&& f) {
  tile_row_passes_of<4>(n_q, f);
}

// Code (0..15) of element d of tile slot j in a K / V tile's code bytes: the layout above.
inline int int4t_key_code(const uint8_t* codes, int j, int d) {
  return (codes[64 * (d / 8) + 4 * j + d % 4] >> ((d % 8) / 4 * 4)) & 15;
}
inline int int4t_value_code(const uint8_t* codes, int j, int d) {
  const int c = d / 32, r = d % 32;
  return (codes[64 * (4 * c + j / 4) + 4 * (r % 16) + j % 4] >> (r / 16 * 4)) & 15;
}

// q5_0t's / q5_1t's 5-bit codes (layout above).
inline int int5t_key_code(const uint8_t* codes, int j, int d) {
  const uint8_t* u = codes + 320 * (d / 32);
  const int w = d % 32, oo = w / 8, nib = (w % 8) / 4, k = w % 4;
  const int lo = (u[64 * oo + 4 * j + k] >> (4 * nib)) & 15;
  return lo | ((u[256 + 32 * (j / 8) + 4 * (j % 8) + k] >> (2 * oo + nib)) & 1) << 4;
}
inline int int5t_value_code(const uint8_t* codes, int j, int d) {
  const uint8_t* u = codes + 320 * (d / 32);
  const int r = d % 32;
  const int lo = (u[64 * (j / 4) + 4 * (r % 16) + j % 4] >> (r / 16 * 4)) & 15;
  return lo | ((u[256 + 32 * ((r % 16) / 8) + 4 * (r % 8) + j % 4] >> (4 * (r / 16) + j / 4)) & 1) << 4;
}

// The parts of prepared query row `row` of qp (n_q, L.qdim) that the score kernels read.
struct Int4tQueryRow {
  const int8_t* q8;   // (hd) int8 image
  const float* dq;    // (hd / 32) its step per 32-dim block
  const float* qsum;  // (ng) exact float sum of the query over each group
};
inline Int4tQueryRow int4t_query_row(const Int4TiledLayout& L, const float* qp, int row) {
  const float* r = qp + size_t(row) * size_t(L.qdim);
  return {reinterpret_cast<const int8_t*>(r + L.q8_off), r + L.dq_off, r + L.qsum_off};
}

// q: (n_q, hd) -> qp: (n_q, L.qdim); q may be the first hd floats of each row of qp.
void int4t_prepare_query(const Int4TiledLayout& L, const float* q, int n_q, float* qp);

// out[i * out_stride + t] = score of query row i against token t0 + t of the block, t < n.
// qp: (n_q, L.qdim); block: a head block.
using Int4tScoresFn = void (*)(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0,
                               int n, float* out, int out_stride);
// acc[i * hd + d] += sum_t p[i * p_stride + t] * v_{t0 + t}[d]. p: (n_q, p_stride); acc: (n_q, hd).
using Int4tAccumFn = void (*)(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                              int t0, int n, float* acc);

void int4t_scores_ref(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride);
void int4t_accum_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc);
#if defined(KVQ_HAVE_SIMD)
void int4t_scores_avx2(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride);
void int4t_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc);
void int4t_scores_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride);
void int4t_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                        int t0, int n, float* acc);
// Several blocks in one call (KvCodec::scores_spans / accumulate_spans); the per-block AVX-512
// kernels are these with one span.
void int4t_scores_spans_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans,
                               float* out, int out_stride);
void int4t_accum_spans_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                              int n_spans, float* acc);
#endif

// The dispatch point.
void int4t_scores(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                  float* out, int out_stride);
void int4t_accum(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                 int n, float* acc);

// Weight quantization of the tiled weighted sums (int4t, int2t, q4_0t, kivi values, int8t, q8_0t),
// shared by every variant so that all of them round identically. Per (query row, group, tile) the
// weights w_t = p_t s_tg (f32 products) and wmax = max_t |w_t|:
//   dw = wmax / levels, inv = levels / wmax, weight wq_t = clamp(rint(w_t * inv)),
// levels = 255 (u8 weights, all weights of the call >= 0) or 127 (s8 weights). From the roundings
// of inv, of w_t * inv and of dw (2^-24 relative each) and |w_t| <= levels * dw (1 + 2^-24):
//   |wq_t dw - w_t| <= (dw / 2)(1 + levels 2^-21).
// A tile whose largest weight is below 2^-100 (probabilities that underflowed, near-zero scales)
// gets inv = 0 and zero weights (levels / wmax would overflow to inf, and 0 * inf is NaN): those
// tokens lose |w_t| < 2^-100.
inline constexpr float kv_int4t_u8_levels = 255.f, kv_int4t_s8_levels = 127.f;
inline constexpr float kv_tile_wmin = 0x1p-100f;
inline void int4t_weight_step(float wmax, float levels, float* dw, float* inv) {
  *dw = wmax / levels;
  *inv = wmax >= kv_tile_wmin ? levels / wmax : 0.f;
}
// The relative slack of that bound: 1 + levels * 2^-21.
inline double int4t_weight_step_slack(float levels) { return 1.0 + double(levels) * 0x1p-21; }

// True when every weight p[i * p_stride + t] (i < n_q, t < n) is >= 0: the u8-weight path.
inline bool int4t_weights_nonneg(const float* p, int p_stride, int n_q, int n) {
  for (int i = 0; i < n_q; ++i)
    for (int t = 0; t < n; ++t)
      if (p[size_t(i) * size_t(p_stride) + size_t(t)] < 0) return false;
  return true;
}

}  // namespace kvq
