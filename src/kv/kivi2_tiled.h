// kivi2t: KIVI-2's quantization (kv/kivi.h: keys per channel over groups of G tokens, values per
// token in groups of 32 channels, the newest R tokens full precision; decode bit-identical to
// kivi2_k / kivi2_v) stored in int2t's 16-token tiles (kv/int2_tiled.h), with kivi4t's per-group
// query fold (kv/kivi_tiled.h), so that the fused kernels are integer dots with one token per
// SIMD lane.
//
// Codecs kivi2t_k, kivi2t_v, format kivi2t. Grouped codecs with kivi's G and R
// (KvCodecParams::group_tokens / residual_tokens, defaults 32 / 128); G must be a multiple of 16
// (whole tiles per group) and head_dim a multiple of 32 (at most kvg_max_head_dim).
//
// Key head block: block_tokens / G groups of group_bytes = 4 * hd + G * hd / 4 bytes (kivi2_k's):
//   scale f16 [hd]   per channel, this group's
//   zero  f16 [hd]   per channel (the group minimum)
//   G / 16 tiles of 4 * hd code bytes in int2t's K layout: per dim-16 block o 64 bytes,
//     byte 4j + i holds code[j][16o + 4r + i] in bits 2r..2r+1.
// Value head block: int2t_g32's value tiles exactly (per token f16 scale / min per 32 channels,
// codes in int2t's V layout), holding kivi2_v's codes, scales and zeros; the weighted sum is
// int2t_accum itself (bound in kv/int2_tiled.h).
//
// Key scores: kivi4t's derivation with codes 0..3. Per (query row, group) kivit_fold_query forms
// q'_d = fl(q_d s_d), its int8 image per 32-dim block (step dq_b = max_{d in b} |q'_d| / 127) and
// C = sum_d q_d m_d; a tile is int2t's VPDPBUSD chain with unit token scale (kivi2t_scores,
// kv/int2_tiled.h): score_t = fl(sum_b dq_b <c_tb, q8_b>) + C, and
//   |score_t - <q, decode(k_t)>| <= sum_d (dq_b(d) / 2)(1 + 2^-21) c_td
//                                   + (hd + 4) 2^-24 sum_d |q_d| (s_d c_td + |m_d| + |decode_td|)
// (tests/int2_tiled_bound.h evaluates it). The scalar, AVX2 and AVX-512 scores are bit-identical
// (the fold is kivi4t's, bit-identical at every level; the integer dots are exact).
#pragma once

namespace kvq {

void kv_register_kivi2_tiled();

}  // namespace kvq
