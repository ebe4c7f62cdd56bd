// AVX2 kernels of the tiled int8 codec (layout and error bounds in kv/int8_tiled.h). VPMADDUBSW
// sums two u8 x s8 products into int16, which saturates for these operands (2 * 255 * 127 >
// 32767), so:
//  scores: the key's u8 image is turned back into s8 codes c (|c| <= 127) and multiplied as
//          |c| x sign(q, c) (2 * 127 * 127 fits), widened to int32 by VPMADDWD;
//  sums:   the u8 weights go in two passes, even and odd token of each pair zeroed, so every
//          int16 holds one product (255 * 127 fits), widened by VPMADDWD.
// Both give the reference's integer dots exactly: scores bit-identical, sums up to f32 order.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kv/int4_tiled.h"
#include "kv/int8_tiled.h"
#include "kv/tiles_avx2.h"
#include "kv/tiles_ref.h"

namespace kvq {
namespace {

// 8 tokens (half of a tile: `half` 0 or 1) for NQ query rows.
template <int NQ>
void scores_half(const Int8TiledLayout& L, const Int8tQueryRow* qr, const uint8_t* tp, int half, __m256* res) {
  const __m256i flip = _mm256_set1_epi8(int8_t(0x80));
  const uint8_t* codes = tp + L.code_off + 32 * half;
  __m256 facc[NQ];
  for (int h = 0; h < NQ; ++h) facc[h] = _mm256_setzero_ps();
  for (int b = 0; b < L.hd / 32; ++b) {
    __m256i ih[NQ], il[NQ];
    for (int h = 0; h < NQ; ++h) ih[h] = il[h] = _mm256_setzero_si256();
    for (int o = 8 * b; o < 8 * b + 8; ++o) {
      const __m256i c = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o)), flip);
      const __m256i ac = _mm256_abs_epi8(c);
      for (int h = 0; h < NQ; ++h) {
        const __m256i qh = _mm256_sign_epi8(tile_bcast32_avx2(qr[h].q8 + 4 * o), c);
        const __m256i ql = _mm256_sign_epi8(tile_bcast32_avx2(qr[h].q8lo + 4 * o), c);
        ih[h] = _mm256_add_epi32(ih[h], tile_widen_avx2(_mm256_maddubs_epi16(ac, qh)));
        il[h] = _mm256_add_epi32(il[h], tile_widen_avx2(_mm256_maddubs_epi16(ac, ql)));
      }
    }
    for (int h = 0; h < NQ; ++h) {
      // = the reference's 254 <c + 128, q8> + <c + 128, q8lo> - qs8 (the 128 terms cancel).
      const __m256i dot =
          _mm256_add_epi32(_mm256_mullo_epi32(ih[h], _mm256_set1_epi32(int32_t(kv_int8t_lo_levels))), il[h]);
      if (L.block_scales) {  // q8_0t: the reference's fma(float(dot) * dq_b, d_tb, facc)
        facc[h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(qr[h].dq[b])),
                                  tile_load_f16x8_avx2(tp + 32 * size_t(b) + 16 * size_t(half)), facc[h]);
      } else {
        facc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(qr[h].dq[b]), facc[h]);
      }
    }
  }
  if (L.block_scales) {
    for (int h = 0; h < NQ; ++h) res[h] = facc[h];
    return;
  }
  const __m256 sv = _mm256_loadu_ps(reinterpret_cast<const float*>(tp) + 8 * half);
  for (int h = 0; h < NQ; ++h) res[h] = _mm256_mul_ps(facc[h], sv);
}

template <int NQ>
void scores_pass(const Int8TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  Int8tQueryRow qr[NQ];
  for (int h = 0; h < NQ; ++h) qr[h] = int8t_query_row(L, qp, h);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    for (int half = 0; half < 2; ++half) {
      const int base = tile * 16 + 8 * half;
      if (std::min(8, t0 + n - base) <= std::max(0, t0 - base)) continue;  // no token of the range
      __m256 res[NQ];
      scores_half<NQ>(L, qr, tp, half, res);
      for (int h = 0; h < NQ; ++h) tile_store_half_avx2(out + size_t(h) * size_t(out_stride), base, t0, n, res[h]);
    }
  }
}

template <int NQ>
void accum_pass(const Int8TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0, int n, bool u8,
                float* acc) {
  const int hd = L.hd;
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const __m256i even = _mm256_set1_epi32(0x00ff00ff), odd = _mm256_set1_epi32(int32_t(0xff00ff00u));
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off;
    // Weights per scale block (the whole head for int8t, 32 channels for q8_0t), with the
    // reference's quantization (the same expressions: identical weights).
    const int nsb = L.block_scales ? hd / 32 : 1, chunks = hd / 16 / nsb;
    float pt[NQ][16];
    for (int h = 0; h < NQ; ++h) {
      const float* ph = p + size_t(h) * size_t(p_stride);
      for (int j = 0; j < 16; ++j) {
        const int t = tile * 16 + j - t0;
        pt[h][j] = t >= 0 && t < n ? ph[t] : 0.f;
      }
    }
    for (int sb = 0; sb < nsb; ++sb) {
      alignas(16) int8_t w8[NQ][16];
      float dw[NQ];
      float st[16];
      for (int j = 0; j < 16; ++j) {
        const int t = tile * 16 + j - t0;
        st[j] = t >= 0 && t < n ? int8t_tile_scale(L, tp, j, sb) : 0.f;
      }
      for (int h = 0; h < NQ; ++h) {
        float w[16];
        for (int j = 0; j < 16; ++j) w[j] = pt[h][j] * st[j];
        int32_t wq[16];
        dw[h] = tile_quantize_weights_ref(w, u8, wq);
        for (int j = 0; j < 16; ++j) w8[h][j] = int8_t(uint8_t(wq[j]));  // u8 path: the byte 0..255; s8: -127..127
      }
      for (int c = sb * chunks; c < (sb + 1) * chunks; ++c) {
        for (int half = 0; half < 2; ++half) {  // channels 16c + 8 * half .. + 7
          __m256i isum[NQ];
          for (int h = 0; h < NQ; ++h) isum[h] = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) {
            const __m256i x =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * (4 * c + k) + 32 * half));
            if (u8) {
              for (int h = 0; h < NQ; ++h) {
                const __m256i wb = tile_bcast32_avx2(&w8[h][4 * k]);
                const __m256i a = tile_widen_avx2(_mm256_maddubs_epi16(_mm256_and_si256(wb, even), x));
                const __m256i b = tile_widen_avx2(_mm256_maddubs_epi16(_mm256_and_si256(wb, odd), x));
                isum[h] = _mm256_add_epi32(isum[h], _mm256_add_epi32(a, b));
              }
            } else {
              // s8 weights and s8 codes: |c| x sign(w, c), 2 * 127 * 127 fits int16.
              const __m256i ax = _mm256_abs_epi8(x);
              for (int h = 0; h < NQ; ++h) {
                const __m256i ws = _mm256_sign_epi8(tile_bcast32_avx2(&w8[h][4 * k]), x);
                isum[h] = _mm256_add_epi32(isum[h], tile_widen_avx2(_mm256_maddubs_epi16(ax, ws)));
              }
            }
          }
          for (int h = 0; h < NQ; ++h) {
            float* a = acc + size_t(h) * size_t(hd) + size_t(16 * c + 8 * half);
            _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), _mm256_set1_ps(dw[h]), _mm256_loadu_ps(a)));
          }
        }
      }
    }
  }
}

}  // namespace

void int8t_scores_avx2(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void int8t_accum_avx2(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc) {
  if (n <= 0) return;
  const bool u8 = int4t_weights_nonneg(p, p_stride, n_q, n);
  tile_row_passes(n_q, [&](int i, auto m) {
    accum_pass<decltype(m)::value>(L, p + size_t(i) * size_t(p_stride), p_stride, block, t0, n, u8,
                                   acc + size_t(i) * size_t(L.hd));
  });
}

}  // namespace kvq
