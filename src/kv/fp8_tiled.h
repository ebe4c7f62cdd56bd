// fp8t: the fp8 formats (E4M3 / E5M2 codes exactly as the rows round them, kv/fp8.h; a fixed or
// calibrated scale per head, or an f32 scale per token) stored in 16-token tiles, so that the
// AVX-512 kernels read one token per f32 lane (scores) or two tokens per lane pair (weighted sums)
// and need no horizontal sums or interleaving: the codes become bf16 through two byte tables
// (every FP8 value is a bf16) and meet the query or the weights in VDPBF16PS.
//
// Head block = block_tokens / 16 tiles, tile_bytes = 16 * hd (+ 64 with a per-token scale) apart:
//   scale f32 [16]             per-token-scale formats only: token j's scale at [j]
//   codes     [16 * hd]        64-byte units by role. Each unit is two vectors A and B of 32 codes
//                              in bf16-word order, stored so that the AVX-512 byte unpacks give
//                              them without a permute: word w of A at byte 16 (w / 8) + w % 8, word
//                              w of B at byte 16 (w / 8) + 8 + w % 8 (fp8t_unit_byte).
//  K: unit u = dims 4u..4u+3 of the 16 tokens; A word 2j + e = token j's dim 4u + e, B word
//     2j + e = its dim 4u + 2 + e (e = 0, 1): one VDPBF16PS of A against the broadcast query pair
//     (q[4u], q[4u + 1]) adds both products to token j's lane.
//  V: unit 8c + m = channels 32c..32c+31 of tokens 2m, 2m + 1; A word 2l + e = token 2m + e's
//     channel 32c + l, B word 2l + e = its channel 32c + 16 + l (l < 16): one VDPBF16PS of A
//     against the broadcast weight pair (w_2m, w_2m+1) adds both tokens to channels 32c..+15.
//
// Arithmetic (both roles, every level): the query (scores) or the weights p_t * mult_t (sums;
// mult_t = the token's scale, or the head's) are rounded to bf16 (RNE), the FP8 codes are exact
// bf16 values, products are summed in f32; a score is (the A sum + the B sum) * mult_t. So the
// bounds of the bf16 / fp8 rows' VDPBF16PS kernels hold (kv/kv_rows.h, kv_rows_bf16_rel): 2^-8
// relative to sum |q_i k_i| (or sum_t |p_t v_t[d]|), inputs below 2^-126 flushed, f32 summation.
// The reference (*_ref) sums token by token as the kernels do, the A and B halves of a score
// apart (the AVX-512 kernel adds them in one accumulator at four tiles per step, the AVX2 kernels
// sum f32 lanes); with the instruction's own rounding of its two products the levels agree
// within f32 summation error, not bit for bit.
//
// Ranges [t0, t0 + n) need not be tile-aligned: score lanes outside are computed on whatever the
// block holds but never stored; in weighted sums they weigh 0 and their codes are masked to 0
// (an unwritten slot may hold a NaN code).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvq/kv_format.h"

namespace kvq {

struct Fp8TiledLayout {
  int hd = 0;
  bool e4m3 = true;        // else E5M2
  bool token_scales = false;  // an f32 scale per token (the _dyn formats)
  size_t code_off = 0;     // 64 with token_scales
  size_t tile_bytes = 0;   // code_off + 16 * hd
  int qdim = 0;            // prepared query floats per row: hd f32 then hd bf16 (hd / 2 floats)
  float scale = 1.f;       // the head's multiplier (fixed / calibrated formats; 1 with token_scales)
};

// head_dim a multiple of 32 (at most kv_max_head_dim).
Fp8TiledLayout fp8t_layout(int head_dim, bool e4m3, bool token_scales);

// Byte of word w (0..31) of a unit's vector A (b = 0) or B (b = 1).
inline int fp8t_unit_byte(int w, int b) { return 16 * (w / 8) + 8 * b + w % 8; }
// Offset in a tile's code bytes of token j's element d, K and V layouts.
inline size_t fp8t_key_pos(int j, int d) {
  return 64 * size_t(d / 4) + size_t(fp8t_unit_byte(2 * j + d % 2, (d % 4) / 2));
}
inline size_t fp8t_value_pos(int j, int d) {
  const int l = d % 32;
  return 64 * size_t(8 * (d / 32) + j / 2) + size_t(fp8t_unit_byte(2 * (l % 16) + j % 2, l / 16));
}

// Multiplier of tile slot j: its token's scale, or the layout's.
float fp8t_mult(const Fp8TiledLayout& L, const uint8_t* tile, int j);

// q: (n_q, hd) -> qp: (n_q, L.qdim): the f32 query, then its bf16 image (RNE).
void fp8t_prepare_query(const Fp8TiledLayout& L, const float* q, int n_q, float* qp);
inline const uint16_t* fp8t_query_bf16(const Fp8TiledLayout& L, const float* qp, int row) {
  return reinterpret_cast<const uint16_t*>(qp + size_t(row) * size_t(L.qdim) + L.hd);
}

// out[i * out_stride + t] = <q_i, decode(k_{t0 + t})>, t < n (prepared rows qp, L.qdim apart).
void fp8t_scores_ref(const Fp8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                     float* out, int out_stride);
// acc[i * hd + d] += sum_t p[i * p_stride + t] * decode(v_{t0 + t})[d].
void fp8t_accum_ref(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                    int n, float* acc);
#if defined(KVQ_HAVE_SIMD)
void fp8t_scores_avx2(const Fp8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride);
void fp8t_accum_avx2(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc);
void fp8t_scores_avx512(const Fp8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                        float* out, int out_stride);
void fp8t_accum_avx512(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                       int t0, int n, float* acc);
// Several blocks per call (the spans' columns consecutive in out / p): attention batches blocks
// when both codecs fuse spans.
void fp8t_scores_spans_avx512(const Fp8TiledLayout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans,
                              float* out, int out_stride);
void fp8t_accum_spans_avx512(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                             int n_spans, float* acc);
#endif

// The dispatch points (cpu_level()).
void fp8t_scores(const Fp8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n, float* out,
                 int out_stride);
void fp8t_accum(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0, int n,
                float* acc);

}  // namespace kvq
