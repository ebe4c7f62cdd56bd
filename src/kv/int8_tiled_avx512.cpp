// AVX-512 VNNI kernels of the tiled int8 codec (layout and error bounds in kv/int8_tiled.h): one
// token per int32 lane (scores) or 4 tokens per lane into 16 channels (weighted sums), so both are
// plain VPDPBUSD chains against an embedded dword broadcast.
#include "core/avx512.h"

#include <algorithm>
#include <cstring>

#include "kv/int4_tiled.h"
#include "kv/int8_tiled.h"
#include "kv/prefetch_along.h"
#include "kv/tiles_avx512.h"

namespace kvq {
namespace {

constexpr int kSegTiles = 8;  // tiles whose weights are quantized ahead of the channel loop (4: ~40 us slower)

// The tile kAhead tiles on, requested while this one is computed: at 2 KB a tile (hd 128) the
// hardware prefetchers and attention's one-call-early request left the dots waiting on memory.
constexpr int kAhead = 2;

// BS: q8_0t's per-(token, block) scales (kv/int8_tiled.h); else int8t's per-token scale.
template <int NQ, bool BS>
void scores_pass(const Int8TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  Int8tQueryRow qr[NQ];
  for (int h = 0; h < NQ; ++h) qr[h] = int8t_query_row(L, qp, h);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  KvAlongSpread along(kv_prefetch_along, (tile1 - tile0) * (L.hd / 32));  // per (tile, 32-dim block)
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off;
    if (tile + kAhead < tile1) tile_prefetch_l1(tp + kAhead * L.tile_bytes, L.tile_bytes);
    __m512 facc[NQ];
    for (int h = 0; h < NQ; ++h) facc[h] = _mm512_setzero_ps();
    for (int b = 0; b < L.hd / 32; ++b) {
      along.step();
      // The query's two digits in separate chains: 2 * NQ independent VPDPBUSD chains.
      __m512i ih[NQ], il[NQ];
      for (int h = 0; h < NQ; ++h) ih[h] = il[h] = _mm512_setzero_si512();
      for (int o = 8 * b; o < 8 * b + 8; ++o) {
        const __m512i x = _mm512_loadu_si512(codes + 64 * o);
        for (int h = 0; h < NQ; ++h) {
          ih[h] = _mm512_dpbusd_epi32(ih[h], x, tile_bcast32_avx512(qr[h].q8 + 4 * o));
          il[h] = _mm512_dpbusd_epi32(il[h], x, tile_bcast32_avx512(qr[h].q8lo + 4 * o));
        }
      }
      for (int h = 0; h < NQ; ++h) {
        // 254 * hi + lo - qs8, in the reference's integer order (exact in int32 either way).
        const __m512i dot = _mm512_sub_epi32(
            _mm512_add_epi32(_mm512_mullo_epi32(ih[h], _mm512_set1_epi32(int32_t(kv_int8t_lo_levels))), il[h]),
            _mm512_set1_epi32(qr[h].qs8[b]));
        if (BS) {  // the reference's fma(float(dot) * dq_b, d_tb, facc)
          facc[h] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(qr[h].dq[b])),
                                    tile_load_f16x16_avx512(tp + 32 * size_t(b)), facc[h]);
        } else {
          facc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(qr[h].dq[b]), facc[h]);
        }
      }
    }
    const __m512 sv = BS ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(reinterpret_cast<const float*>(tp));
    for (int h = 0; h < NQ; ++h)
      tile_store_avx512(out + size_t(h) * size_t(out_stride), tile * 16, t0, n, BS ? facc[h] : _mm512_mul_ps(facc[h], sv));
  }
}

// U8: all weights >= 0: u8 weights (255 levels) x s8 codes. Else s8 weights (127 levels) x the u8
// image codes ^ 0x80 = c + 128, minus 128 * (sum of the tile's weights) per lane.
// BS: weights per (row, 32-channel block) with q8_0t's block scales; else per row.
constexpr int kMaxSB = 1024 / 32;
template <int NQ, bool U8, bool BS>
void accum_pass(const Int8TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0, int n,
                float* acc) {
  const int hd = L.hd;
  const int nsb = BS ? hd / 32 : 1;
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const __m512i flip = _mm512_set1_epi8(int8_t(0x80));
  const int nsbc = (nsb + 3) / 4;
  // Per segment tile tt and scale block sb: the packed weights (w8[tt * nsb + sb], byte 16k + 4h + m:
  // row h, token 4k + m), the steps (dws[tt * nsbc + sb / 4], lane 4h + sb % 4) and, for s8
  // weights, 128 * each row's weight sum (wsum[tt][h * nsb + sb]).
  alignas(64) uint8_t w8[kSegTiles * (BS ? kMaxSB : 1)][64];
  alignas(64) float dws[kSegTiles * (BS ? kMaxSB / 4 : 1)][16];
  int32_t wsum[kSegTiles][U8 ? 1 : NQ * (BS ? kMaxSB : 1)];
  KvAlongSpread along(kv_prefetch_along, (tile1 - tile0) * (hd / 16));  // per (channel chunk, tile)
  for (int seg = tile0; seg < tile1; seg += kSegTiles) {
    const int nt = std::min(kSegTiles, tile1 - seg);
    // 1. Quantized weights of the segment's tiles (tile_quantize_weights_avx512: int4t_weight_step).
    for (int tt = 0; tt < nt; ++tt) {
      const int base = (seg + tt) * 16;
      const uint8_t* tp = block + size_t(seg + tt) * L.tile_bytes;
      if (seg + tt + kAhead < tile1) tile_prefetch_l1(tp + kAhead * L.tile_bytes, L.tile_bytes);
      __m512 pv[4];
      const __mmask16 mask = tile_load_weights_avx512<NQ>(p, p_stride, t0, n, base, pv);
      // Masked: slots outside the range may hold anything (NaN scales of unwritten tokens).
      tile_quantize_weights_avx512<NQ, U8>(
          pv, nsb,
          [&](int sb) {
            return BS ? _mm512_maskz_mov_ps(mask, tile_load_f16x16_avx512(tp + 32 * size_t(sb)))
                      : _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(tp));
          },
          w8 + tt * nsb, dws + tt * nsbc, U8 ? nullptr : wsum[tt]);
    }
    // 2. Channel chunks of 16: per tile 4 loads (token quads) and NQ dot chains, flushed to f32
    // with the tile's step; the f32 sums go to acc once per segment.
    for (int c = 0; c < hd / 16; ++c) {
      const int sb = BS ? c / 2 : 0;
      __m512 f[NQ];
      for (int h = 0; h < NQ; ++h) f[h] = _mm512_setzero_ps();
      for (int tt = 0; tt < nt; ++tt) {
        along.step();
        const uint8_t* cp = block + size_t(seg + tt) * L.tile_bytes + L.code_off + size_t(c) * 256;
        __m512i ia[NQ], ib[NQ];
        for (int h = 0; h < NQ; ++h) ia[h] = ib[h] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k += 2) {
          __m512i x0 = _mm512_loadu_si512(cp + 64 * k);
          __m512i x1 = _mm512_loadu_si512(cp + 64 * (k + 1));
          if (!U8) {
            x0 = _mm512_xor_si512(x0, flip);
            x1 = _mm512_xor_si512(x1, flip);
          }
          for (int h = 0; h < NQ; ++h) {
            const __m512i w0 = tile_bcast32_avx512(w8[tt * nsb + sb] + 16 * k + 4 * h);
            const __m512i w1 = tile_bcast32_avx512(w8[tt * nsb + sb] + 16 * (k + 1) + 4 * h);
            if (U8) {
              ia[h] = _mm512_dpbusd_epi32(ia[h], w0, x0);
              ib[h] = _mm512_dpbusd_epi32(ib[h], w1, x1);
            } else {
              ia[h] = _mm512_dpbusd_epi32(ia[h], x0, w0);
              ib[h] = _mm512_dpbusd_epi32(ib[h], x1, w1);
            }
          }
        }
        for (int h = 0; h < NQ; ++h) {
          __m512i dot = _mm512_add_epi32(ia[h], ib[h]);
          if (!U8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(wsum[tt][h * nsb + sb]));
          f[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(dws[tt * nsbc + sb / 4][4 * h + sb % 4]), f[h]);
        }
      }
      for (int h = 0; h < NQ; ++h) {
        float* a = acc + size_t(h) * size_t(hd) + size_t(16 * c);
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), f[h]));
      }
    }
  }
}

}  // namespace

void int8t_scores_avx512(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    const float* q = qp + size_t(i) * size_t(L.qdim);
    float* o = out + size_t(i) * size_t(out_stride);
    if (L.block_scales) scores_pass<decltype(m)::value, true>(L, q, block, t0, n, o, out_stride);
    else scores_pass<decltype(m)::value, false>(L, q, block, t0, n, o, out_stride);
  });
}

void int8t_accum_avx512(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                        int t0, int n, float* acc) {
  if (n <= 0) return;
  const bool u8 = tiles_weights_nonneg_avx512(p, p_stride, n_q, n);
  tile_row_passes(n_q, [&](int i, auto m) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    float* a = acc + size_t(i) * size_t(L.hd);
    constexpr int M = decltype(m)::value;
    if (L.block_scales) {
      if (u8) accum_pass<M, true, true>(L, pi, p_stride, block, t0, n, a);
      else accum_pass<M, false, true>(L, pi, p_stride, block, t0, n, a);
    } else {
      if (u8) accum_pass<M, true, false>(L, pi, p_stride, block, t0, n, a);
      else accum_pass<M, false, false>(L, pi, p_stride, block, t0, n, a);
    }
  });
}

}  // namespace kvq
