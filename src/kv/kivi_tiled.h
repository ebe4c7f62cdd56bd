// kivi4t / kivi2t: KIVI-4's / KIVI-2's quantization (kv/kivi.h: keys per channel over groups of G
// tokens, values per token in groups of 32 channels, the newest R tokens full precision; decode
// bit-identical to kivi4p_k / kivi4p_v and kivi2p_k / kivi2p_v) stored in int4t's / int2t's 16-token
// tiles (kv/int4_tiled.h, kv/int2_tiled.h) so that the fused kernels are integer dots with one token
// per SIMD lane. One codec template serves both widths; only the code bytes and their kernels differ.
//
// Codecs kivi4t_k, kivi4t_v, kivi2t_k, kivi2t_v, formats kivi4t, kivi2t; kivi4_k / kivi4_v and
// kivi2_k / kivi2_v (formats kivi4, kivi2) are these codecs whenever the shape fits
// (kivi_tiled_fits). Grouped codecs with kivi's G and R (KvCodecParams::group_tokens /
// residual_tokens, defaults 32 / 128); G must be a multiple of 16 (whole tiles per group) and
// head_dim a multiple of 32 (at most kvg_max_head_dim).
//
// Key head block: block_tokens / G groups of group_bytes = 4 * hd + G * hd * b / 8 bytes (kivi's):
//   scale f16 [hd]   per channel, this group's
//   zero  f16 [hd]   per channel (the group minimum)
//   G / 16 tiles of code bytes:
//     b = 4: 8 * hd bytes in int4t's K layout: per dim-octet o 64 bytes,
//            byte 4j + i = code[j][8o + i] | code[j][8o + 4 + i] << 4.
//     b = 2: 4 * hd bytes in int2t's K layout: per dim-16 block o 64 bytes,
//            byte 4j + i holds code[j][16o + 4r + i] in bits 2r..2r+1.
// Value head block: int4t_g32's / int2t_g32's value tiles exactly (per token f16 scale / min per 32
// channels, codes in int4t's / int2t's V layout), holding kivi's codes, scales and zeros; the
// weighted sum is int4t_accum / int2t_accum itself (bounds in kv/int4_tiled.h, kv/int2_tiled.h).
//
// Key scores. With s_d, m_d the group's channel scale and zero,
//   score_t = sum_d q_d (s_d c_td + m_d) = sum_d (q_d s_d) c_td + sum_d q_d m_d.
// Per (query row, group) the fold forms q'_d = fl(q_d s_d), rounds it to int8 per 32-dim block b
// (step dq_b = max_{d in b} |q'_d| / 127, q8_d = round(q'_d / dq_b)) and C = sum_d q_d m_d in f32.
// A 16-token tile is then int4t's (b = 4) or int2t's (b = 2, kivi2t_scores in kv/int2_tiled.h)
// VPDPBUSD chain with unit token scale and zero minimum:
//   score_t = fl( sum_b dq_b * <c_tb, q8_b> ) + C.
// The integer dots are exact, so with |dq_b q8_d - q'_d| <= dq_b / 2 (+ 2^-22 relative of dq_b for
// the f32 division before rounding) and |q'_d - q_d s_d| <= 2^-24 |q_d s_d|:
//   |score_t - <q, decode(k_t)>| <= sum_d (dq_b(d) / 2)(1 + 2^-21) c_td + 2^-24 sum_d |q_d s_d| c_td
//                                  + f32 rounding of the block sums, of C (hd terms) and of
//                                    decode's own s c + m,
// i.e. |error| <= sum_d (dq_b(d) / 2)(1 + 2^-21) c_td + (hd + 4) 2^-24 sum_d |q_d| (s_d c_td + |m_d| + |decode|)
// (tests/kivi_tiled_bound.h evaluates it, codes 0..15 or 0..3). A block whose q' is not finite, or
// so small that the step's inverse overflows (max |q'| below ~3.7e-37), gets step 0 (nothing
// through its codes); a NaN / inf reaches the score through C as q_d m_d.
// The prepared query is the plain query (KvCodec's default): the fold depends on the group, so it
// runs inside scores(), hd multiply-adds per (row, group of G tokens) against G * hd / 2 code bytes.
// At G = 32 that is measurable (the AVX-512 fold costs about as much as the tile dots), hence SIMD
// folds that reproduce the scalar one bit for bit.
//
// Kernels (b = 4; kivi2t's are int2t's kivi2t_scores*): kivit_scores_ref (scalar), _avx2, _avx512 share one signature and are bit-identical
// (same per-lane operation order; the integer dot is exact); kivit_scores is the one dispatch point
// (cpu_level()).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvq/kv_format.h"

namespace kvq {

void kv_register_kivi_tiled();

// Whether kivi4t's / kivi2t's tiles fit a head_dim and group size (head_dim % 32 == 0, G % 16 == 0).
inline bool kivi_tiled_fits(int head_dim, int group_tokens) { return head_dim % 32 == 0 && group_tokens % 16 == 0; }
// kivi{bits}t_k (role key) or kivi{bits}t_v (role value), bits 4 or 2, for already-resolved G and R.
// Throws kvq::Error when the tiles do not fit or G / R are invalid. `kivi4` / `kivi2` use these when
// the shape allows (kv/kivi.h).
std::unique_ptr<KvCodec> kivi_tiled_codec_create(KvRole role, int bits, int head_dim, int group_tokens,
                                                 int residual_tokens);

// One group's folded query for n_q rows: q8 (n_q, hd) int8, dq (n_q, hd / 32), cz (n_q).
// params: the group's [f16 scale (hd)][f16 zero (hd)]; q: (n_q, hd).
// C is summed in a fixed order shared by every variant: lane l = fma chain over d = l (mod 16)
// in increasing d, then kivit_reduce_lanes; so the fold, and the scores, are bit-identical at
// every level. kivit_fold_query is the dispatch point.
inline constexpr int kivit_c_lanes = 16;
inline float kivit_reduce_lanes(const float* lane) {
  float r[8];
  for (int l = 0; l < 8; ++l) r[l] = lane[l] + lane[l + 8];
  for (int l = 0; l < 4; ++l) r[l] += r[l + 4];
  for (int l = 0; l < 2; ++l) r[l] += r[l + 2];
  return r[0] + r[1];
}
void kivit_fold_query_ref(const uint8_t* params, const float* q, int n_q, int hd, int8_t* q8, float* dq, float* cz);
#if defined(KVQ_HAVE_SIMD)
void kivit_fold_query_avx2(const uint8_t* params, const float* q, int n_q, int hd, int8_t* q8, float* dq,
                           float* cz);
void kivit_fold_query_avx512(const uint8_t* params, const float* q, int n_q, int hd, int8_t* q8, float* dq,
                             float* cz);
#endif
void kivit_fold_query(const uint8_t* params, const float* q, int n_q, int hd, int8_t* q8, float* dq, float* cz);

// out[i * out_stride + t] = score of row i against token t0 + t of the group's tiles, t < n
// (0 <= t0, t0 + n <= G). tiles: (G / 16) tiles of 8 * hd bytes.
using KivitScoresFn = void (*)(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd,
                               const uint8_t* tiles, int t0, int n, float* out, int out_stride);
void kivit_scores_ref(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                      int t0, int n, float* out, int out_stride);
#if defined(KVQ_HAVE_SIMD)
void kivit_scores_avx2(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                       int t0, int n, float* out, int out_stride);
void kivit_scores_avx512(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd,
                         const uint8_t* tiles, int t0, int n, float* out, int out_stride);
#endif
// The dispatch point.
void kivit_scores(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles, int t0,
                  int n, float* out, int out_stride);

}  // namespace kvq
