// AVX2 kernels of the tiled int4 codec (layout and error bounds in kv/int4_tiled.h): the same
// arithmetic as the AVX-512 ones on 8-token half tiles, with VPMADDUBSW (u8 codes x s8 query or
// weights, two products per int16: at most 2 * 15 * 127, no saturation) + VPMADDWD in place of
// VPDPBUSD.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtypes.h"
#include "kv/int4_tiled.h"

namespace kvq {
namespace {

constexpr int kMaxNq = 4;

inline __m256i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 load_f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// u8 x s8 products of 4 consecutive bytes summed into int32 lanes.
inline __m256i dot4(__m256i u8, __m256i s8) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1));
}

template <int NQ>
void scores_pass(const Int4TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const int bpg = L.group / 32;
  const int8_t* q8[NQ];
  const float* dq[NQ];
  const float* qs[NQ];
  for (int h = 0; h < NQ; ++h) {
    const float* row = qp + size_t(h) * size_t(L.qdim);
    q8[h] = reinterpret_cast<const int8_t*>(row + L.q8_off);
    dq[h] = row + L.dq_off;
    qs[h] = row + L.qsum_off;
  }
  // Half tiles of 8 tokens: bytes 32 * half .. + 31 of every 64-byte octet record.
  const int h0 = t0 / 8, h1 = (t0 + n + 7) / 8;
  for (int ht = h0; ht < h1; ++ht) {
    const int tile = ht / 2, half = ht % 2;
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off + 32 * half;
    __m256 score[NQ];
    for (int h = 0; h < NQ; ++h) score[h] = _mm256_setzero_ps();
    for (int g = 0; g < L.ng; ++g) {
      __m256 facc[NQ];
      for (int h = 0; h < NQ; ++h) facc[h] = _mm256_setzero_ps();
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
        __m256i idot[NQ];
        for (int h = 0; h < NQ; ++h) idot[h] = _mm256_setzero_si256();
        for (int o = 4 * b; o < 4 * b + 4; ++o) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o));
          const __m256i lo = _mm256_and_si256(x, m4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
          for (int h = 0; h < NQ; ++h) {
            const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(q8[h] + 8 * o)),
                                               _mm256_maddubs_epi16(hi, bcast32(q8[h] + 8 * o + 4)));
            idot[h] = _mm256_add_epi32(idot[h], _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
          }
        }
        for (int h = 0; h < NQ; ++h)
          facc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot[h]), _mm256_set1_ps(dq[h][b]), facc[h]);
      }
      const __m256 sv = load_f16x8(tp + 32 * size_t(g) + 16 * size_t(half));
      const __m256 mv = load_f16x8(tp + L.min_off + 32 * size_t(g) + 16 * size_t(half));
      for (int h = 0; h < NQ; ++h) {
        score[h] = _mm256_fmadd_ps(facc[h], sv, score[h]);
        score[h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(qs[h][g]), score[h]);
      }
    }
    const int base = ht * 8;
    const int lo = std::max(0, t0 - base), hi = std::min(8, t0 + n - base);
    for (int h = 0; h < NQ; ++h) {
      float* o = out + size_t(h) * size_t(out_stride);
      if (lo == 0 && hi == 8) {
        _mm256_storeu_ps(o + (base - t0), score[h]);
      } else {  // partial: only lanes inside [t0, t0 + n)
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, score[h]);
        std::memcpy(o + (base + lo - t0), tmp + lo, sizeof(float) * size_t(hi - lo));
      }
    }
  }
}

// One query row at a time: 4 int32 accumulators per chunk of 32 channels (lanes 0-7 / 8-15 of
// the low nibbles, the same of the high ones).
// u8: all weights >= 0, u8 weights (255 levels) x s8 codes; else s8 weights x u8 codes (the
// int16 pair sums stay below 2 * 255 * 15).
void accum_row(const Int4TiledLayout& L, const float* p, const uint8_t* block, int t0, int n, float* acc, bool u8) {
  const int hd = L.hd, ng = L.ng;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  float msum[1024 / 32] = {};
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    for (int g = 0; g < ng; ++g) {
      float w[16], wmax = 0;
      for (int j = 0; j < 16; ++j) {
        const int t = tile * 16 + j - t0;
        const bool valid = t >= 0 && t < n;
        uint16_t hs, hm;
        std::memcpy(&hs, tp + 32 * size_t(g) + 2 * size_t(j), 2);
        std::memcpy(&hm, tp + L.min_off + 32 * size_t(g) + 2 * size_t(j), 2);
        w[j] = valid ? p[t] * _cvtsh_ss(hs) : 0.f;
        wmax = std::max(wmax, std::fabs(w[j]));
        if (valid) msum[g] += p[t] * _cvtsh_ss(hm);
      }
      float dw, inv;
      const float levels = u8 ? kv_int4t_u8_levels : kv_int4t_s8_levels;
      int4t_weight_step(wmax, levels, &dw, &inv);
      alignas(16) uint8_t wq[16];
      for (int j = 0; j < 16; ++j) {
        const int v = int(std::min(levels, std::max(u8 ? 0.f : -levels, std::nearbyint(w[j] * inv))));
        wq[j] = uint8_t(v & 255);  // s8 weights: two's complement bytes
      }
      const __m256 s = _mm256_set1_ps(dw);
      for (int c = g * L.group / 32; c < (g + 1) * L.group / 32; ++c) {
        const uint8_t* cp = tp + L.code_off + size_t(c) * 256;
        __m256i i0 = _mm256_setzero_si256(), i1 = i0, i2 = i0, i3 = i0;
        for (int k = 0; k < 4; ++k) {
          const __m256i wb = bcast32(wq + 4 * k);
          const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * k));
          const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * k + 32));
          const __m256i c0 = _mm256_and_si256(xa, m4), c1 = _mm256_and_si256(xb, m4);
          const __m256i c2 = _mm256_and_si256(_mm256_srli_epi16(xa, 4), m4);
          const __m256i c3 = _mm256_and_si256(_mm256_srli_epi16(xb, 4), m4);
          i0 = _mm256_add_epi32(i0, u8 ? dot4(wb, c0) : dot4(c0, wb));
          i1 = _mm256_add_epi32(i1, u8 ? dot4(wb, c1) : dot4(c1, wb));
          i2 = _mm256_add_epi32(i2, u8 ? dot4(wb, c2) : dot4(c2, wb));
          i3 = _mm256_add_epi32(i3, u8 ? dot4(wb, c3) : dot4(c3, wb));
        }
        float* a = acc + 32 * c;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), s, _mm256_loadu_ps(a)));
        _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), s, _mm256_loadu_ps(a + 8)));
        _mm256_storeu_ps(a + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i2), s, _mm256_loadu_ps(a + 16)));
        _mm256_storeu_ps(a + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i3), s, _mm256_loadu_ps(a + 24)));
      }
    }
  }
  for (int d = 0; d < hd; ++d) acc[d] += msum[d / L.group];
}

}  // namespace

void int4t_scores_avx2(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride) {
  if (n <= 0) return;
  for (int i = 0; i < n_q; i += kMaxNq) {
    const int m = std::min(kMaxNq, n_q - i);
    const float* q = qp + size_t(i) * size_t(L.qdim);
    float* o = out + size_t(i) * size_t(out_stride);
    switch (m) {
      case 1: scores_pass<1>(L, q, block, t0, n, o, out_stride); break;
      case 2: scores_pass<2>(L, q, block, t0, n, o, out_stride); break;
      case 3: scores_pass<3>(L, q, block, t0, n, o, out_stride); break;
      default: scores_pass<4>(L, q, block, t0, n, o, out_stride); break;
    }
  }
}

void int4t_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc) {
  if (n <= 0) return;
  const bool u8 = int4t_weights_nonneg(p, p_stride, n_q, n);
  for (int i = 0; i < n_q; ++i)
    accum_row(L, p + size_t(i) * size_t(p_stride), block, t0, n, acc + size_t(i) * size_t(L.hd), u8);
}

}  // namespace kvq
