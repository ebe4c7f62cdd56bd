// tq4t: TurboQuant 4-bit (tq4: Hadamard rotation, fp16 norm, Lloyd-Max codes; kv/turboquant.h)
// stored in int4t's 16-token tiles (kv/int4_tiled.h) so that the fused kernels are int4t's integer
// dots with one token per SIMD lane instead of a horizontal reduction per token.
//
// Same quantization, bytes per token and decode as tq4 (decode is bit-identical: the tile's norm
// and codes are tq4's record, rearranged). Tile = int4t's layout with one group of head_dim
// channels and no min table: scale row = the 16 tokens' fp16 norms, then the codes (K and V
// layouts as int4t's). Bits per element 4 + 16 / head_dim, as tq4.
//
// Kernels (rotated basis, as tq4's): the codebook c (16 centroids) becomes an int8 image
// C = round(c / cs), cs = max|c| / 127, looked up per code (lut8).
//  Scores: the rotated query q is rounded per 32-dim block as int4t's (dq_b = absmax_b / 127,
//   q8 = round(q / dq_b)) and score_t = ||x_t|| * sum_b (dq_b cs) <C[code_t,b], q8_b>; the integer
//   dots are exact, so with q = dq q8 + eq and c = cs C + ec (|eq| <= dq_b / 2, |ec| <= cs / 2)
//     |score - ||x|| <q, c>| <= ||x|| * sum_j ( dq_b(j) / 2 |c_j| + |q_j| cs / 2 + dq_b(j) cs / 4 )
//   plus f32 rounding (tq4t_score_bound).
//  Weighted sums: int4t's u8 weight steps per (query row, tile) on w_t = p_t ||x_t|| against the
//   s8 codebook image, then times cs; channel c of the rotated output moves by at most
//     sum_tiles (dw / 2)(1 + 255 * 2^-21) cs sum_{t in tile} |C[code_t,c]|  +  (cs / 2) sum_t |w_t|
//   plus f32 rounding. The accumulator holds the sums in codebook-image units (storage basis
//   R v / cs, as a rotation's is R v): finish_output multiplies by cs, then applies R^T. Weights with a negative entry (never the case in
//   attention) are summed in f32 against C instead (tq4t_accum_signed_ref).
// Scalar reference, AVX2 and AVX-512 kernels (same arithmetic: scores bit-identical, weighted
// sums equal up to f32 summation order). AVX-512 looks codes up with VPSHUFB into VPDPBUSD (u8
// operand C + 128, the block's 128 * sum(q8) subtracted); AVX2 signs the query bytes by C
// (VPSIGNB) against |C| in VPMADDUBSW, and splits C = 16 Ch + Cl in the weighted sum.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvq/kv_format.h"

#include "kv/int4_tiled.h"

namespace kvq {

// The layout of tq4t at head_dim hd (hd % 32 == 0) with codebook centroids cb (16, ascending):
// lut8 = round(cb / cs), *cs = max|cb| / 127.
Int4TiledLayout tq4t_layout(int hd, const float* cb, float* cs);

// Rotated queries (n_q, hd) -> prepared rows (n_q, L.qdim): the rotated query, its int8 image and
// steps times cs, and the per-block corrections; rq may alias the first hd floats of each row.
void tq4t_prepare_query(const Int4TiledLayout& L, float cs, const float* rq, int n_q, float* qp);

void tq4t_scores_ref(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                     float* out, int out_stride);
// acc += the weighted sums in codebook-image units (the codec multiplies by cs).
void tq4t_accum_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                    int n, float* acc);
// The f32 path for weights with a negative entry: acc[i][d] += sum_t p_t ||x_t|| lut8[code_t,d].
void tq4t_accum_signed_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                           int t0, int n, float* acc);
#if defined(KVQ_HAVE_SIMD)
void tq4t_scores_avx2(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride);
void tq4t_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc);
void tq4t_scores_avx512(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                        float* out, int out_stride);
void tq4t_accum_avx512(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                       int n, float* acc);
#endif
void tq4t_scores(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n, float* out,
                 int out_stride);
void tq4t_accum(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0, int n,
                float* acc);

// The tq4t codec for p (throws kvq::Error unless p.head_dim % 32 == 0, at most kv_max_head_dim).
// Codec "tq4" is this codec wherever its head_dim allows, else tq4's rows ("tq4_rows").
std::unique_ptr<KvCodec> tq4t_codec_create(const KvCodecParams& p);
bool tq4t_fits(int head_dim);

// Registers codec and format "tq4t" (called once by the registry).
void kv_register_tq_tiled();

}  // namespace kvq
