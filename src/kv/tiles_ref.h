// Scalar pieces shared by the tiled codecs' reference kernels (int4t, int2t, int8t): the weight
// quantization of one (query row, group, tile) (int4t_weight_step) and the weighted sum over value
// tiles with per-token f16 scale / min tables, one template over the layout's code reader. The SIMD
// kernels reproduce this rounding bit for bit (kv/tiles_avx512.h, kv/tiles_avx2.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/dtypes.h"
#include "kv/grouped_common.h"
#include "kv/int4_tiled.h"
#include "kv/kv_rows.h"

namespace kvq {

// Entry i of a tile's f16 table (scale or min row) as f32.
inline float tile_f16(const uint8_t* p, size_t i) { return f16_to_f32(kvg_load_f16(p, i)); }

// Largest magnitude of a tile's 16 values (0 outside the call's range).
inline float tile_abs_max(const float* x) {
  float m = 0;
  for (int j = 0; j < kv_tile_tokens; ++j) m = std::max(m, std::fabs(x[j]));
  return m;
}

// A tile's 16 weights w (0 outside the call's range) rounded to integer steps wq with
// int4t_weight_step's arithmetic: u8 (all weights of the call >= 0; wq in [0, 255]) or s8 (wq in
// [-127, 127]). Returns the step dw.
inline float tile_quantize_weights_ref(const float* w, bool u8, int32_t* wq) {
  const float levels = u8 ? kv_int4t_u8_levels : kv_int4t_s8_levels;
  float dw, inv;
  int4t_weight_step(tile_abs_max(w), levels, &dw, &inv);
  for (int j = 0; j < kv_tile_tokens; ++j)
    wq[j] = int32_t(std::min(levels, std::max(u8 ? 0.f : -levels, std::nearbyint(w[j] * inv))));
  return dw;
}

// The scalar scores of int4t's / int2t's key tiles (layout L, prepared query rows qp):
// score_t = sum_g fma chain of ( s_tg * sum_{b in g} fl(dot_b) dq_b ) + m_tg * qsum_g, in the order
// the SIMD kernels reproduce. block_dot(codes, j, b, q8): the exact integer dot of tile slot j's
// codes over the 32-dim block b with the query's int8 image.
template <class BlockDot>
void tiles_scores_ref(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride, BlockDot block_dot) {
  const int bpg = L.group / 32;  // 32-dim query blocks per group
  for (int i = 0; i < n_q; ++i) {
    const Int4tQueryRow qr = int4t_query_row(L, qp, i);
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L.tile_bytes;
      const uint8_t* codes = tp + L.code_off;
      float score = 0;
      for (int g = 0; g < L.ng; ++g) {
        float facc = 0;
        for (int b = g * bpg; b < (g + 1) * bpg; ++b)
          facc = std::fma(float(block_dot(codes, j, b, qr.q8)), qr.dq[b], facc);
        score = std::fma(facc, tile_f16(tp, size_t(g * 16 + j)), score);
        score = std::fma(tile_f16(tp + L.min_off, size_t(g * 16 + j)), qr.qsum[g], score);
      }
      out[size_t(i) * size_t(out_stride) + size_t(t)] = score;
    }
  }
}

// The scalar weighted sum of int4t's / int2t's value tiles (layout L): acc[i * hd + d] += sum_t
// p[i * p_stride + t] * v_{t0 + t}[d], per (query row, group, tile) the weights p_t s_tg quantized
// by tile_quantize_weights_ref and dotted exactly with the codes, the min term sum_t p_t m_tg in
// f32. code_of(codes, j, d): the code of element d of tile slot j.
template <class CodeOf>
void tiles_accum_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc, CodeOf code_of) {
  if (n <= 0) return;
  const int hd = L.hd;
  const int tile0 = t0 / kv_tile_tokens, tile1 = (t0 + n + kv_tile_tokens - 1) / kv_tile_tokens;
  float facc[kv_max_head_dim];
  float msum[kv_max_head_dim / 32];
  const bool u8 = !L.signed_scales && int4t_weights_nonneg(p, p_stride, n_q, n);
  for (int i = 0; i < n_q; ++i) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    std::fill(facc, facc + hd, 0.f);
    std::fill(msum, msum + L.ng, 0.f);
    for (int tile = tile0; tile < tile1; ++tile) {
      const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
      const uint8_t* codes = tp + L.code_off;
      // Tokens outside [t0, t0 + n) weigh 0 and their table entries (possibly NaN) are not read.
      float pt[kv_tile_tokens];
      bool valid[kv_tile_tokens];
      for (int j = 0; j < kv_tile_tokens; ++j) {
        const int t = tile * kv_tile_tokens + j - t0;
        valid[j] = t >= 0 && t < n;
        pt[j] = valid[j] ? pi[t] : 0.f;
      }
      for (int g = 0; g < L.ng; ++g) {
        float w[kv_tile_tokens];
        for (int j = 0; j < kv_tile_tokens; ++j) {
          w[j] = valid[j] ? pt[j] * tile_f16(tp, size_t(g * 16 + j)) : 0.f;
          if (valid[j]) msum[g] += pt[j] * tile_f16(tp + L.min_off, size_t(g * 16 + j));
        }
        int32_t wq[kv_tile_tokens];
        const float dw = tile_quantize_weights_ref(w, u8, wq);
        for (int d = g * L.group; d < (g + 1) * L.group; ++d) {
          int32_t dot = 0;
          for (int j = 0; j < kv_tile_tokens; ++j) dot += wq[j] * int32_t(code_of(codes, j, d));
          facc[d] = std::fma(float(dot), dw, facc[d]);
        }
      }
    }
    float* a = acc + size_t(i) * size_t(hd);
    for (int d = 0; d < hd; ++d) a[d] += facc[d] + L.min_mul * msum[d / L.group];
  }
}

}  // namespace kvq
