// AVX2 kernels of the tiled fp8 codecs (layout and arithmetic in kv/fp8_tiled.h). Each 16-byte
// lane of a 64-byte unit holds 4 tokens x 4 dims (keys) or 4 channels x 2 tokens x 2 halves
// (values); its codes turn into f32 through f16 (E5M2 is the high byte of an f16; an E4M3 byte
// shifted into an f16 is its value times 2^-8) and meet the bf16-rounded query or weights, as
// broadcast pairs, in f32 FMAs; adjacent lanes are added at the end.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "core/dtypes.h"
#include "kv/fp8_f16_avx2.h"
#include "kv/fp8_tiled.h"
#include "kv/int4_tiled.h"
#include "kv/kv_rows.h"
#include "kv/prefetch_along.h"

namespace kvq {
namespace {

constexpr int kSegTiles = 8;

// 16 codes -> f32 (kv/fp8_f16_avx2.h): x[0] from bytes 0..7, x[1] from bytes 8..15, E4M3 unscaled
// by 2^-8 (the caller's multiplier carries the 256).
inline void codes16(const uint8_t* c, bool e4m3, __m256* x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  if (e4m3) fp8_codes16_to_f32_avx2<true>(b, x);
  else fp8_codes16_to_f32_avx2<false>(b, x);
}

// (v[0], v[1]) repeated over 8 lanes.
inline __m256 bcast_pair(const float* v) {
  double d;
  std::memcpy(&d, v, 8);
  return _mm256_castpd_ps(_mm256_set1_pd(d));
}

// 8 floats rounded to bf16 (RNE, NaN kept quiet), as f32.
inline __m256 round_bf16(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd),
                                     _mm256_set1_epi32(int32_t(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256i q = _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(int32_t(0xffff0000u))),
                                    _mm256_set1_epi32(0x00400000));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan);
}

inline float code_unit(const Fp8TiledLayout& L) { return L.e4m3 ? 256.f : 1.f; }

template <int NQ>
void scores_pass(const Fp8TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const int hd = L.hd;
  alignas(32) float qf[4][kv_max_head_dim];  // the bf16 query as f32
  for (int i = 0; i < NQ; ++i) {
    const uint16_t* qb = fp8t_query_bf16(L, qp, i);
    for (int d = 0; d < hd; ++d) qf[i][d] = bf16_to_f32(qb[d]);
  }
  const float unit = code_unit(L);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const KvPrefetchAlong along = kv_prefetch_along;
  for (int tile = tile0; tile < tile1; ++tile) {
    kv_prefetch_along_step(along, tile - tile0, tile1 - tile0);
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off;
    for (int l = 0; l < 4; l += 2) {  // tokens 4l..4l+7: lanes l, l + 1 of every unit
      // One accumulator per (row, lane): 2 NQ chains (one per row left the FMAs waiting on their
      // own latency).
      __m256 acc[NQ][2];
      for (int i = 0; i < NQ; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      for (int u = 0; u < hd / 4; ++u) {
        __m256 x[2][2];
        for (int h = 0; h < 2; ++h) codes16(codes + 64 * size_t(u) + 16 * size_t(l + h), L.e4m3, x[h]);
        for (int i = 0; i < NQ; ++i) {
          const __m256 qa = bcast_pair(qf[i] + 4 * u), qb = bcast_pair(qf[i] + 4 * u + 2);
          for (int h = 0; h < 2; ++h) {
            acc[i][h] = _mm256_fmadd_ps(x[h][0], qa, acc[i][h]);
            acc[i][h] = _mm256_fmadd_ps(x[h][1], qb, acc[i][h]);
          }
        }
      }
      for (int i = 0; i < NQ; ++i) {
        alignas(32) float s[8];
        // [l: t0, t1, l+1: t0, t1 | l: t2, t3, l+1: t2, t3] (tokens 4l + k)
        _mm256_store_ps(s, _mm256_hadd_ps(acc[i][0], acc[i][1]));
        for (int k = 0; k < 8; ++k) {
          const int j = 4 * l + k, t = tile * 16 + j - t0;
          const int lane = (k / 4) * 2 + (k % 4 < 2 ? k % 4 : k % 4 + 2);
          if (t >= 0 && t < n)
            out[size_t(i) * size_t(out_stride) + size_t(t)] = s[lane] * (unit * fp8t_mult(L, tp, j));
        }
      }
    }
  }
}

template <int NQ>
void accum_pass(const Fp8TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0, int n,
                float* acc) {
  const int hd = L.hd;
  const float unit = code_unit(L);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  alignas(32) float w[kSegTiles][4][16];  // bf16-rounded p_t * mult_t (0 outside the range)
  uint16_t valid[kSegTiles];
  const KvPrefetchAlong along = kv_prefetch_along;
  const int n_seg = (tile1 - tile0 + kSegTiles - 1) / kSegTiles;
  for (int seg = tile0; seg < tile1; seg += kSegTiles) {
    kv_prefetch_along_step(along, (seg - tile0) / kSegTiles, n_seg);
    const int nt = std::min(kSegTiles, tile1 - seg);
    const uint8_t* seg_tp = block + size_t(seg) * L.tile_bytes;
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* tp = seg_tp + size_t(tt) * L.tile_bytes;
      valid[tt] = 0;
      for (int i = 0; i < NQ; ++i) {
        float* x = w[tt][i];
        for (int j = 0; j < 16; ++j) {
          const int t = (seg + tt) * 16 + j - t0;
          const bool ok = t >= 0 && t < n;
          if (ok) valid[tt] = uint16_t(valid[tt] | (1u << j));
          x[j] = ok ? p[size_t(i) * size_t(p_stride) + size_t(t)] * fp8t_mult(L, tp, j) : 0.f;
        }
        for (int h = 0; h < 2; ++h) _mm256_store_ps(x + 8 * h, round_bf16(_mm256_load_ps(x + 8 * h)));
      }
    }
    for (int c = 0; c < hd / 32; ++c)
      for (int l = 0; l < 4; ++l) {  // channels 32c + 4l..+3 (A) and 32c + 16 + 4l..+3 (B)
        __m256 a[NQ], b[NQ];
        for (int i = 0; i < NQ; ++i) a[i] = b[i] = _mm256_setzero_ps();
        for (int tt = 0; tt < nt; ++tt) {
          const uint8_t* cp = seg_tp + size_t(tt) * L.tile_bytes + L.code_off + 512 * size_t(c) + 16 * size_t(l);
          for (int m = 0; m < 8; ++m) {
            __m256 x[2];
            codes16(cp + 64 * m, L.e4m3, x);
            if (valid[tt] != 0xffff) {  // slots outside the range: codes 0 (an unwritten slot may hold NaN)
              const int e = (valid[tt] >> (2 * m)) & 1 ? -1 : 0, o = (valid[tt] >> (2 * m + 1)) & 1 ? -1 : 0;
              const __m256 k = _mm256_castsi256_ps(_mm256_setr_epi32(e, o, e, o, e, o, e, o));
              x[0] = _mm256_and_ps(x[0], k);
              x[1] = _mm256_and_ps(x[1], k);
            }
            for (int i = 0; i < NQ; ++i) {
              const __m256 wp = bcast_pair(w[tt][i] + 2 * m);
              a[i] = _mm256_fmadd_ps(x[0], wp, a[i]);
              b[i] = _mm256_fmadd_ps(x[1], wp, b[i]);
            }
          }
        }
        for (int i = 0; i < NQ; ++i) {
          alignas(32) float s[8];
          // [a01, a23, b01, b23 | a45, a67, b45, b67]: channel pairs of both tokens added
          _mm256_store_ps(s, _mm256_mul_ps(_mm256_hadd_ps(a[i], b[i]), _mm256_set1_ps(unit)));
          float* d = acc + size_t(i) * size_t(hd) + 32 * size_t(c) + 4 * size_t(l);
          d[0] += s[0];
          d[1] += s[1];
          d[2] += s[4];
          d[3] += s[5];
          d[16] += s[2];
          d[17] += s[3];
          d[18] += s[6];
          d[19] += s[7];
        }
      }
  }
}

}  // namespace

void fp8t_scores_avx2(const Fp8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void fp8t_accum_avx2(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    accum_pass<decltype(m)::value>(L, p + size_t(i) * size_t(p_stride), p_stride, block, t0, n,
                                   acc + size_t(i) * size_t(L.hd));
  });
}

}  // namespace kvq
