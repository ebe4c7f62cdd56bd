// int8t: int8's quantization (symmetric per token and head, f32 scale absmax / 127, codes
// -127..127, the same rounding: decode is bit-identical) stored in 16-token tiles so that the
// fused kernels are VPDPBUSD chains with one token per int32 lane, as int4t (kv/int4_tiled.h).
//
// Head block = block_tokens / 16 tiles, tile_bytes = 16 * (4 + head_dim) apart (= 16 int8 rows):
//   scale f32 [16]             token j's scale at [j] (one 64-byte load = 16 tokens)
//   codes     [16 * head_dim]  by role:
//  K: per dim-quad o (dims 4o..4o+3) 64 bytes; byte 4j + i = code[j][4o + i] ^ 0x80 (u8 = code +
//     128): lane j holds 4 dims of token j, the unsigned operand of VPDPBUSD against the
//     query's 4 int8 values (one broadcast dword).
//  V: per 16-dim chunk c and token quad k (tokens 4k..4k+3), 64 bytes at (4c + k) * 64; lane i
//     byte m = code[4k + m][16c + i] (s8): a VPDPBUSD of the 4 tokens' u8 weights (broadcast
//     dword, unsigned operand) and these codes adds 4 tokens into 16 channels.
//
// Scores (error bound). The prepared query (qdim floats per row): [0, hd) the plain f32 query;
// then two int8 digits per element: q8 = round(q / dq_b) (dq_b = absmax_b / 127 per 32-dim block
// b) and q8lo = round((q / dq_b - q8) * 254), so q ~= (dq_b / 254)(254 q8 + q8lo); then
// dq[hd / 32] = dq_b / 254 and qs8[hd / 32] int32 = 128 * sum_b (254 q8 + q8lo); then the two
// digits as one int16 per element, q16 = 254 q8 + q8lo (|q16| <= 32385: the AVX2 kernels' VPMADDWD
// operand, hd / 2 floats). One digit alone
// (step dq_b) measurably raised the KL divergence over int8's float-query kernels (SmolLM2 ctx
// 512: 0.00077 vs 0.00053); two digits cost a second VPDPBUSD per code load.
// Per block the integer dots of the stored u8 codes are <c + 128, q8_b>, so
//   D_b = 254 <c + 128, q8_b> + <c + 128, q8lo_b> - qs8_b = <c, 254 q8_b + q8lo_b>   (exact,
//   |D_b| <= 32 * 127 * 127 * 255 < 2^31), and score_t = s_t * sum_b (dq_b / 254) D_b.
// The only approximation is the query rounding |q_j - (dq_b / 254)(254 q8_j + q8lo_j)| <=
// dq_b / 508, plus relative 2^-22 for the f32 step and the conversion of D_b (rounded to 24 bits):
//   |score - <q, decode(k_t)>| <= sum_j (dq_b(j) / 508)(1 + 2^-20) |s_t c_tj| + 2^-22 sum_j |q_j| |s_t c_tj|
//                                 + f32 rounding.
// Weighted sum (error bound). Per (query row, tile) the weights w_t = p_t * s_t are rounded to
// integer steps dw = max_t |w_t| / W. When every weight of the call is >= 0 (attention's
// probabilities always are) they are u8 (W = 255) against the s8 codes; otherwise s8 (W = 127)
// against the u8 image c + 128 of the codes, minus 128 * sum_t w8_t (exact). The integer dots are
// exact (|sum| <= 16 * 255 * 127), so channel d of query row i moves by at most
//   sum_tiles (dw / 2)(1 + 2^-20) * sum_{t in tile} |c_t[d]|  + f32 rounding.
// Relative to attention's output (acc / l) a tile's step is max_t (pi_t s_t) / 255 with pi the
// softmax probabilities.
//
// q8_0t: llama.cpp q8_0's quantization (int8 codes, d = absmax / 127 in f16 per 32 channels;
// decode bit-identical to q8_0's, same bytes) in these tiles with a per-(token, block) scale table
// (Int8TiledLayout::block_scales). Scores: score_t = sum_b fl(fl(dq_b / 254 * D_b) * d_tb), so the
// bound above holds with s_t replaced by each block's d_tb (one more f32 rounding per block).
// Weighted sums: weights p_t d_tb quantized per (query row, block, tile), the bound above per
// block (d >= 0: the u8 path for probabilities). Format "q8_0" stores it; "q8_0_rows" keeps the rows.
//
// Kernels: *_ref (scalar, same arithmetic: scores bit-identical to the SIMD ones, weighted sums
// equal up to f32 summation order), *_avx2 (VPMADDWD on codes widened to int16, see
// int8_tiled_avx2.cpp), *_avx512 (VNNI). int8t_scores / int8t_accum are the one dispatch point
// (cpu_level()).
// Ranges [t0, t0 + n) need not be tile-aligned: lanes outside are computed on whatever the block
// holds but never stored (scores) or weighted 0 (sums).
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvq {

struct Int8TiledLayout {
  int hd = 0;
  size_t tile_bytes = 0;  // 16 * (4 + hd)
  size_t code_off = 64;   // bytes of the scale table
  // q8_0t (llama.cpp q8_0's quantization: int8 codes with one f16 scale d >= 0 per 32 channels)
  // has a scale per (token, 32-channel block): f16 [hd / 32][16] (token j of block b at [b][j],
  // code_off = hd bytes) instead of int8t's f32 [16]. Scores multiply each block's dot by its
  // d_tb; weighted sums quantize p_t d_tb per (row, block, tile).
  bool block_scales = false;
  int qdim = 0;           // prepared query floats per row
  int q8_off = 0;         // float offsets inside a prepared row
  int q8lo_off = 0;
  int dq_off = 0;
  int qs8_off = 0;
  int q16_off = 0;
};

Int8TiledLayout int8t_layout(int head_dim);
Int8TiledLayout q8_0t_layout(int head_dim);

// Scale of token slot j (of the tile at tp) for the 32-channel block b: int8t's per-token f32,
// q8_0t's per-(token, block) f16.
float int8t_tile_scale(const Int8TiledLayout& L, const uint8_t* tp, int j, int b);

// Levels of the query's second int8 digit (its residual below half a step of the first).
inline constexpr float kv_int8t_lo_levels = 254.f;

struct Int8tQueryRow {
  const int8_t* q8;    // (hd) int8 image: first digit
  const int8_t* q8lo;  // (hd) second digit
  const float* dq;     // (hd / 32) step of the second digit per 32-dim block (dq_b / 254)
  const int32_t* qs8;  // (hd / 32) 128 * sum over the block of (254 q8 + q8lo)
  const int16_t* q16;  // (hd) the two digits as one int16: 254 q8 + q8lo (|.| <= 32385)
};
Int8tQueryRow int8t_query_row(const Int8TiledLayout& L, const float* qp, int row);

// q: (n_q, hd) -> qp: (n_q, L.qdim).
void int8t_prepare_query(const Int8TiledLayout& L, const float* q, int n_q, float* qp);

// Same contracts as int4t's (kv/int4_tiled.h).
void int8t_scores_ref(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride);
void int8t_accum_ref(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc);
#if defined(KVQ_HAVE_SIMD)
void int8t_scores_avx2(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride);
void int8t_accum_avx2(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc);
void int8t_scores_avx512(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride);
void int8t_accum_avx512(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                        int t0, int n, float* acc);
#endif

// The dispatch point.
void int8t_scores(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                  float* out, int out_stride);
void int8t_accum(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                 int n, float* acc);

}  // namespace kvq
