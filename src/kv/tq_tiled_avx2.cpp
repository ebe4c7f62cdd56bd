// AVX2 kernels of TurboQuant's tiles (layout, arithmetic and error bounds in kv/tq_tiled.h): the
// AVX-512 kernels' integer dots on 8-token halves. Scores: each code looked up twice, as |C| (the
// unsigned VPMADDUBSW operand) and as C, whose sign goes onto the query bytes (VPSIGNB); a pair
// sum is at most 2 * 127 * 127 and is widened at once. Weighted sums: tiles_accum_lut_avx2 with
// C = 16 Ch + Cl in two int16 chains.
#include <immintrin.h>

#include <cstring>

#include "kv/prefetch_along.h"
#include "kv/tiles_avx2.h"
#include "kv/tq_tiled.h"

namespace kvq {
namespace {

inline __m256i table(const int8_t* t16) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t16)));
}

// Bit k of every byte of y moved to bit 2 (the high bit of a 3-bit code).
inline __m256i high_bit(__m256i y, int k) {
  const __m256i b = k >= 2 ? _mm256_srli_epi16(y, k - 2) : _mm256_slli_epi16(y, 2 - k);
  return _mm256_and_si256(b, _mm256_set1_epi8(4));
}

// Key block at `base`, 8-token half e: vec[v] = codes of channels 4v..4v+3, one token per lane.
inline void key_block_codes(const uint8_t* base, int bits, int e, __m256i* vec) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
  const auto ld = [&](size_t off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + off + 32 * size_t(e))); };
  if (bits == 4) {
    for (int o = 0; o < 4; ++o) {
      const __m256i x = ld(64 * size_t(o));
      vec[2 * o] = _mm256_and_si256(x, m4);
      vec[2 * o + 1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
    }
    return;
  }
  const __m256i y = bits == 3 ? ld(128) : _mm256_setzero_si256();
  for (int o = 0; o < 2; ++o) {
    const __m256i x = ld(64 * size_t(o));
    for (int r = 0; r < 4; ++r) {
      __m256i c = _mm256_and_si256(_mm256_srli_epi16(x, 2 * r), m2);
      if (bits == 3) c = _mm256_or_si256(c, high_bit(y, r + 4 * o));
      vec[4 * o + r] = c;
    }
  }
}

template <int NQ>
void scores_pass(const TqTiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const int8_t* q8[NQ];
  const float* dq[NQ];
  for (int h = 0; h < NQ; ++h) {
    const float* r = qp + size_t(h) * size_t(L.qdim);
    q8[h] = reinterpret_cast<const int8_t*>(r + L.q8_off);
    dq[h] = r + L.dq_off;
  }
  __m256i lut_abs[2], lut_sgn[2];
  for (int s = 0; s < L.nseg; ++s) {
    int8_t a[16];
    for (int i = 0; i < 16; ++i) a[i] = int8_t(L.seg[s].lut8[i] < 0 ? -L.seg[s].lut8[i] : L.seg[s].lut8[i]);
    lut_abs[s] = table(a);
    lut_sgn[s] = table(L.seg[s].lut8);
  }
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  const KvPrefetchAlong along = kv_prefetch_along;
  for (int tile = tile0; tile < tile1; ++tile) {
    kv_prefetch_along_step(along, tile - tile0, tile1 - tile0);
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    for (int e = 0; e < 2; ++e) {
      __m256 facc[NQ];
      for (int h = 0; h < NQ; ++h) facc[h] = _mm256_setzero_ps();
      for (int b = 0; b < L.hd / 32; ++b) {
        const int s = L.block_seg[b];
        const TqTileSeg& g = L.seg[s];
        __m256i vec[8], sgn[8];
        key_block_codes(tp + g.off + size_t(b - g.ch0 / 32) * size_t(64 * g.bits), g.bits, e, vec);
        for (int v = 0; v < 8; ++v) {
          sgn[v] = _mm256_shuffle_epi8(lut_sgn[s], vec[v]);
          vec[v] = _mm256_shuffle_epi8(lut_abs[s], vec[v]);
        }
        for (int h = 0; h < NQ; ++h) {
          __m256i dot = _mm256_setzero_si256();
          for (int v = 0; v < 8; ++v) {
            const __m256i qb = tile_bcast32_avx2(q8[h] + 32 * b + 4 * v);
            dot = _mm256_add_epi32(dot, tile_widen_avx2(_mm256_maddubs_epi16(vec[v], _mm256_sign_epi8(qb, sgn[v]))));
          }
          facc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dq[h][b]), facc[h]);
        }
      }
      const __m256 norms = tile_load_f16x8_avx2(tp + 16 * size_t(e));
      for (int h = 0; h < NQ; ++h)
        tile_store_half_avx2(out + size_t(h) * size_t(out_stride), tile * 16 + 8 * e, t0, n,
                             _mm256_mul_ps(facc[h], norms));
    }
  }
}

}  // namespace

void tq_tiled_scores_avx2(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                          float* out, int out_stride) {
  if (n <= 0) return;
  tile_row_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void tq_tiled_accum_avx2(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                         int n, float* acc) {
  if (n <= 0) return;
  if (!tiles_weights_nonneg_avx2(p, p_stride, n_q, n))
    return tq_tiled_accum_signed_ref(L, p, p_stride, n_q, block, t0, n, acc);
  __m256i lut_h[2], lut_l[2];  // C = 16 Ch + Cl: Ch = C >> 4 (-8..7), Cl = C & 15
  for (int s = 0; s < L.nseg; ++s) {
    int8_t th[16], tl[16];
    for (int i = 0; i < 16; ++i) {
      th[i] = int8_t(L.seg[s].lut8[i] >> 4);
      tl[i] = int8_t(L.seg[s].lut8[i] & 15);
    }
    lut_h[s] = table(th);
    lut_l[s] = table(tl);
  }
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
  tiles_accum_lut_avx2(
      L.values, p, p_stride, n_q, block, t0, n, acc,
      [&](const uint8_t* tp, int c, int half, __m256i* lo, __m256i* hi) {
        const TqTileSeg& g = L.seg[L.block_seg[c]];
        const uint8_t* base = tp + g.off + size_t(c - g.ch0 / 32) * size_t(64 * g.bits) + 32 * size_t(half);
        const auto ld = [&](size_t off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + off)); };
        if (g.bits == 4) {
          for (int k = 0; k < 4; ++k) {
            const __m256i x = ld(64 * size_t(k));
            lo[k] = _mm256_and_si256(x, m4);
            hi[k] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
          }
          return;
        }
        const __m256i y = g.bits == 3 ? ld(128) : _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
          const int p0 = 2 * (k % 2);
          const __m256i x = ld(64 * size_t(k / 2));
          lo[k] = _mm256_and_si256(_mm256_srli_epi16(x, 2 * p0), m2);
          hi[k] = _mm256_and_si256(_mm256_srli_epi16(x, 2 * p0 + 2), m2);
          if (g.bits == 3) {
            lo[k] = _mm256_or_si256(lo[k], high_bit(y, p0 + 4 * (k / 2)));
            hi[k] = _mm256_or_si256(hi[k], high_bit(y, p0 + 1 + 4 * (k / 2)));
          }
        }
      },
      [&](int c, __m256i* th, __m256i* tl) {
        *th = lut_h[L.block_seg[c]];
        *tl = lut_l[L.block_seg[c]];
      });
}

}  // namespace kvq
