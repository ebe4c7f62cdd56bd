// TurboQuant MSE codes (kv/turboquant.h: Hadamard rotation, fp16 norm, Lloyd-Max codes at 2, 3 or
// 4 bits, fractional rates as two channel segments) stored in 16-token tiles, so that the fused
// kernels are integer dots with one token per SIMD lane (as int4t's, kv/int4_tiled.h) instead of
// a horizontal reduction per token. Codecs tq4t, tq3.5t, tq3t, tq2.5t, tq2.25t, tq2t; the formats
// tq4, tq3.5, tq3, tq2.5, tq2.25 and tq2 store them where the head allows (tq_tiled_fits).
//
// Same quantization, bytes per token and decode as the record codecs (decode is bit-identical: a
// tile holds the records' norms and codes, rearranged; test_tq_tiled).
//
// Tile (16 tokens): the 16 fp16 norms (32 bytes), then per channel segment (channels [0, n_hi) at
// bits_hi, [n_hi, hd) at bits_lo; each a multiple of 32 channels) 2 * n * bits code bytes, laid out
// per 32-channel block by role and width (j: token slot, w: channel within the block):
//  K, 4 bits (int4t's): 256 bytes; byte 64 o + 4 j + i (o = w / 8, i = w % 4) holds the code of
//     w = 8o + i in its low nibble and of 8o + 4 + i in its high one.
//  K, 2 bits (int2t's): 128 bytes; byte 64 o + 4 j + i (o = w / 16) holds the codes of
//     w = 16o + 4r + i in bits 2r..2r+1, r = 0..3.
//  K, 3 bits: the 2-bit layout of the codes' low two bits (128 bytes), then 64 bytes whose byte
//     4 j + i holds their high bits: bit r + 4o for w = 16o + 4r + i.
//  V, 4 bits (int4t's): 256 bytes; per token quad k, 64 bytes at 64 k; lane i byte m (token 4k + m)
//     holds channel i in its low nibble and 16 + i in its high one.
//  V, 2 bits (int2t's): 128 bytes; per token octet ko, 64 bytes at 64 ko; lane i byte m holds in
//     crumbs 0..3: token 8ko + m channel i, token 8ko + m channel 16 + i, token 8ko + 4 + m channel
//     i, token 8ko + 4 + m channel 16 + i.
//  V, 3 bits: the 2-bit layout of the low bits, then 64 bytes: lane i byte m holds the high bit of
//     crumb p of octet ko in bit p + 4 ko.
// Every width yields, per 32-channel block, 8 vectors of 16 lanes x 4 codes (keys: channels
// 4v..4v+3 of block; values: token quad k, channels i or 16 + i), which the kernels look up in
// the segment's int8 codebook image.
//
// Kernels (rotated basis, as the records'): segment s's codebook c (2^bits centroids) becomes
// C = round(c / cs_s), cs_s = max|c| / 127.
//  Scores: the rotated query q rounded per 32-dim block (dq_b = absmax_b / 127, q8 = round(q /
//   dq_b), int4t's) and score_t = ||x_t|| * sum_b (dq_b cs_s(b)) <C[code_t,b], q8_b>; the integer
//   dots are exact, so with q = dq q8 + eq, c = cs C + ec (|eq| <= dq_b / 2, |ec| <= cs / 2)
//     |score - ||x|| <q, c>| <= ||x|| * sum_j ( dq_b(j) / 2 |c_j| + (|q_j| + dq_b(j) / 2) cs / 2 )
//   plus f32 rounding.
//  Weighted sums: int4t's u8 weight steps per (query row, tile) on w_t = p_t ||x_t|| against C;
//   channel c of segment s moves by at most
//     cs_s ( sum_tiles (dw / 2)(1 + 255 * 2^-21) sum_{t in tile} |C[code_t,c]|  +  sum_t |w_t| / 2 )
//   plus f32 rounding. The accumulator holds the sums in codebook-image units (storage basis
//   R v / cs per channel, as a rotation's is R v): finish_output multiplies by cs_s, then applies
//   R^T. Weights with a negative entry (never the case in attention) are summed in f32 against C
//   (tq_tiled_accum_signed_ref).
// Scalar reference, AVX2 and AVX-512 kernels (same arithmetic: scores bit-identical, weighted
// sums equal up to f32 summation order). AVX-512: the codes looked up with VPSHUFB (keys: C + 128,
// the block's 128 * sum(q8) subtracted from the VPDPBUSD sum) into VPDPBUSD. AVX2: the query
// bytes signed by C (VPSIGNB) against |C| in VPMADDUBSW; the weighted sum splits C = 16 Ch + Cl so
// that the int16 pair sums cannot overflow.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kv/int4_tiled.h"
#include "kv/kv_rows.h"
#include "kvq/kv_format.h"

namespace kvq {

struct TqTileSeg {
  int ch0 = 0, nch = 0, bits = 0;
  size_t off = 0;        // the segment's code bytes, from the tile start
  int8_t lut8[16] = {};  // the int8 image C of its codebook
  float cs = 0;          // and its step
};

struct TqTiledLayout {
  int hd = 0;
  int nseg = 0;
  TqTileSeg seg[2];
  size_t tile_bytes = 0;
  // Prepared query row (floats): [0, hd) the rotated query; q8 (hd int8) at q8_off; dq (hd / 32,
  // times the block's cs) at dq_off; corr (hd / 32 int32: 128 * the block's sum of q8) at corr_off.
  int q8_off = 0, dq_off = 0, corr_off = 0, qdim = 0;
  uint8_t block_seg[kv_max_head_dim / 32] = {};  // segment of each 32-channel block
  // The same tiles as int4t's weighted sums see them: one group of hd channels whose scale is the
  // norm, no min table (min_mul 0), code bytes from the tile start.
  Int4TiledLayout values;
};

// Whether head_dim and the split fit the tiles: hd % 32 == 0 (at most kv_max_head_dim), each
// segment a multiple of 32 channels, bits in 2..4.
bool tq_tiled_fits(int hd, int n_hi, int bits_hi, int bits_lo);
// Throws kvq::Error when it does not fit. cb_hi / cb_lo: the segments' centroids (2^bits each).
TqTiledLayout tq_tiled_layout(int hd, int n_hi, int bits_hi, int bits_lo, const float* cb_hi, const float* cb_lo);

// Code of channel d of slot j of a tile (tp: the tile start).
int tq_tiled_code(const TqTiledLayout& L, KvRole role, const uint8_t* tp, int j, int d);

// Rotated queries (n_q, hd) -> prepared rows (n_q, L.qdim); rq may be the first hd floats of each row.
void tq_tiled_prepare_query(const TqTiledLayout& L, const float* rq, int n_q, float* qp);

using TqTiledScoresFn = void (*)(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0,
                                 int n, float* out, int out_stride);
// acc += the weighted sums in codebook-image units.
using TqTiledAccumFn = void (*)(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                                int t0, int n, float* acc);

void tq_tiled_scores_ref(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride);
void tq_tiled_accum_ref(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                        int n, float* acc);
// The f32 path for weights with a negative entry: acc[i][d] += sum_t p_t ||x_t|| C[code_t,d].
void tq_tiled_accum_signed_ref(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                               int t0, int n, float* acc);
#if defined(KVQ_HAVE_SIMD)
void tq_tiled_scores_avx2(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                          float* out, int out_stride);
void tq_tiled_accum_avx2(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                         int n, float* acc);
void tq_tiled_scores_avx512(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                            float* out, int out_stride);
void tq_tiled_accum_avx512(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                           int t0, int n, float* acc);
void tq_tiled_scores_spans_avx512(const TqTiledLayout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans,
                                  float* out, int out_stride);
void tq_tiled_accum_spans_avx512(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const KvSpan* spans,
                                 int n_spans, float* acc);
#endif
void tq_tiled_scores(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                     float* out, int out_stride);
void tq_tiled_accum(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                    int n, float* acc);

// The tiled codec of TurboQuant MSE at `bits` (2..4, fractional as the record codecs), named
// `name`; throws kvq::Error when the head does not fit (tq_tiled_fits). tq_codec_tiles_or_rows: the
// tiles where they fit, else the record codec (what the formats use).
std::unique_ptr<KvCodec> tq_tiled_codec_create(const std::string& name, double bits, const KvCodecParams& p);
std::unique_ptr<KvCodec> tq_codec_tiles_or_rows(const std::string& tiled_name, const std::string& rows_name,
                                                double bits, const KvCodecParams& p);

}  // namespace kvq
