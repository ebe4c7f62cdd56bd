// AVX2 kernels of the tiled int4 codec (layout and error bounds in kv/int4_tiled.h): the
// arithmetic of the AVX-512 ones with VPMADDUBSW (u8 x s8, two products per int16) in place of
// VPDPBUSD. The int16 pair sums are added in int16 as long as the bound allows and widened once
// (VPMADDWD by ones), so the multiply ports do about one widening per 8 (scores) or 4 (weighted
// sum) VPMADDUBSW instead of one each.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kv/int4_tiled.h"

namespace kvq {
namespace {

constexpr int kMaxNq = 4;  // query rows per pass (accumulator registers)
constexpr int kSegTiles = 4;  // tiles whose weights are quantized ahead of the channel loop
constexpr int kMaxGroups = 1024 / 32;

inline __m256i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 load_f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// int16 pairs -> int32 lanes.
inline __m256i widen(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }

// Scores on whole tiles: both 8-token halves (bytes 0..31 and 32..63 of every 64-byte octet
// record) against the same query broadcasts. Per query block b (4 octets, low and high nibbles:
// 8 VPMADDUBSW per half) the int16 sums stay within 8 * 2 * 15 * 127 = 30480, so a block's dot
// is one int16 chain and one widening per (row, half).
template <int NQ>
void scores_pass(const Int4TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const int bpg = L.group / 32;
  Int4tQueryRow qr[NQ];
  for (int h = 0; h < NQ; ++h) qr[h] = int4t_query_row(L, qp, h);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
    const uint8_t* codes = tp + L.code_off;
    __m256 score[NQ][2];
    for (int h = 0; h < NQ; ++h) score[h][0] = score[h][1] = _mm256_setzero_ps();
    for (int g = 0; g < L.ng; ++g) {
      __m256 facc[NQ][2];
      for (int h = 0; h < NQ; ++h) facc[h][0] = facc[h][1] = _mm256_setzero_ps();
      for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
        __m256i s16[NQ][2];
        for (int h = 0; h < NQ; ++h) s16[h][0] = s16[h][1] = _mm256_setzero_si256();
        for (int o = 4 * b; o < 4 * b + 4; ++o) {
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o + 32));
          const __m256i lo0 = _mm256_and_si256(x0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(x0, 4), m4);
          const __m256i lo1 = _mm256_and_si256(x1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(x1, 4), m4);
          for (int h = 0; h < NQ; ++h) {
            const __m256i ql = bcast32(qr[h].q8 + 8 * o), qh = bcast32(qr[h].q8 + 8 * o + 4);
            s16[h][0] = _mm256_add_epi16(
                s16[h][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, ql), _mm256_maddubs_epi16(hi0, qh)));
            s16[h][1] = _mm256_add_epi16(
                s16[h][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, ql), _mm256_maddubs_epi16(hi1, qh)));
          }
        }
        for (int h = 0; h < NQ; ++h) {
          const __m256 d = _mm256_set1_ps(qr[h].dq[b]);
          facc[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(s16[h][0])), d, facc[h][0]);
          facc[h][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(s16[h][1])), d, facc[h][1]);
        }
      }
      for (int e = 0; e < 2; ++e) {
        const __m256 sv = load_f16x8(tp + 32 * size_t(g) + 16 * size_t(e));
        const __m256 mv = load_f16x8(tp + L.min_off + 32 * size_t(g) + 16 * size_t(e));
        for (int h = 0; h < NQ; ++h) {
          score[h][e] = _mm256_fmadd_ps(facc[h][e], sv, score[h][e]);
          score[h][e] = _mm256_fmadd_ps(mv, _mm256_set1_ps(qr[h].qsum[g]), score[h][e]);
        }
      }
    }
    for (int e = 0; e < 2; ++e) {
      const int base = tile * 16 + 8 * e;
      const int lo = std::max(0, t0 - base), hi = std::min(8, t0 + n - base);
      if (hi <= lo) continue;
      for (int h = 0; h < NQ; ++h) {
        float* o = out + size_t(h) * size_t(out_stride);
        if (lo == 0 && hi == 8) {
          _mm256_storeu_ps(o + (base - t0), score[h][e]);
        } else {  // partial: only lanes inside [t0, t0 + n)
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, score[h][e]);
          std::memcpy(o + (base + lo - t0), tmp + lo, sizeof(float) * size_t(hi - lo));
        }
      }
    }
  }
}

// Lanes h and 4 + h of the result = the largest of the 8 lanes of v[h], h < 4.
inline __m256 max4x8(const __m256* v) {
  const __m256 a = _mm256_max_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
  const __m256 b = _mm256_max_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
  const __m256 c = _mm256_max_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_max_ps(c, _mm256_permute2f128_ps(c, c, 1));
}

// Quantized weights of one (group, row pair) of a tile: VPACKSSDW / VPACKUSWB (VPACKSSWB) of rows
// A and B leave the token quads in the dwords A: 0 4 1 5, B: 2 6 3 7, read through this index
// instead of a permute.
inline int w8_dword(int h, int k) { return (h & 1) * 2 + (k >> 1) + (k & 1) * 4; }

// The weighted sum in segments of kSegTiles tiles: their weights quantized with vector
// arithmetic (the scalar steps of int4t_weight_step, bit for bit), then per tile, chunk of 32
// channels and 8-lane half, NQ * 2 int16 chains over the tile's 4 token quads, widened and scaled
// into acc once per tile (the f32 sums live in acc: registers hold the int16 chains).
// U8: all weights >= 0, u8 weights (255 levels) x s8 codes: 4 quads * 2 * 255 * 15 = 30600;
// else s8 weights x u8 codes: 4 * 2 * 15 * 127. Both fit int16.
template <int NQ, bool U8>
void accum_pass(const Int4TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0, int n,
                float* acc) {
  constexpr int NP = (NQ + 1) / 2;  // row pairs
  const int hd = L.hd, ng = L.ng, cpg = L.group / 32;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 lv = _mm256_set1_ps(U8 ? kv_int4t_u8_levels : kv_int4t_s8_levels);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  // Per (row, group): the min term sum_t p_t m_tg in 8 lanes, reduced once per call.
  alignas(32) float msv[NQ][kMaxGroups][8];
  for (int h = 0; h < NQ; ++h)
    for (int g = 0; g < ng; ++g) _mm256_store_ps(msv[h][g], _mm256_setzero_ps());
  // (tile of the segment, group, row pair): quantized weights; (.., group, row h in lane h):
  // their steps. A segment's tiles are quantized before its channel loop reads them, so the
  // dword loads find the stores long retired.
  alignas(32) uint8_t w8[kSegTiles][kMaxGroups][NP][32];
  alignas(32) float dw[kSegTiles][kMaxGroups][8];
  for (int seg = tile0; seg < tile1; seg += kSegTiles) {
    const int nt = std::min(kSegTiles, tile1 - seg);
    for (int tt = 0; tt < nt; ++tt) {
      const int base = (seg + tt) * 16;
      const uint8_t* tp = block + size_t(seg + tt) * L.tile_bytes;
      const bool full = base >= t0 && base + 16 <= t0 + n;
      __m256 pv[NQ][2];
      __m256 mk[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      if (full) {
        for (int h = 0; h < NQ; ++h) {
          const float* ph = p + size_t(h) * size_t(p_stride) + size_t(base - t0);
          pv[h][0] = _mm256_loadu_ps(ph);
          pv[h][1] = _mm256_loadu_ps(ph + 8);
        }
      } else {
        // Edge tile: weights outside the range are 0 and the scales / minimums of their slots
        // (which may hold anything, NaN included) are masked off.
        const int lo = std::max(0, t0 - base), hi = std::min(16, t0 + n - base);
        alignas(32) float pt[NQ][16] = {};
        alignas(32) int32_t mi[16];
        for (int j = 0; j < 16; ++j) mi[j] = j >= lo && j < hi ? -1 : 0;
        for (int h = 0; h < NQ; ++h)
          for (int j = lo; j < hi; ++j) pt[h][j] = p[size_t(h) * size_t(p_stride) + size_t(base + j - t0)];
        for (int h = 0; h < NQ; ++h) {
          pv[h][0] = _mm256_load_ps(pt[h]);
          pv[h][1] = _mm256_load_ps(pt[h] + 8);
        }
        mk[0] = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mi)));
        mk[1] = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mi + 8)));
      }
      for (int g = 0; g < ng; ++g) {
        __m256 sv0 = load_f16x8(tp + 32 * size_t(g)), sv1 = load_f16x8(tp + 32 * size_t(g) + 16);
        __m256 mv0 = load_f16x8(tp + L.min_off + 32 * size_t(g));
        __m256 mv1 = load_f16x8(tp + L.min_off + 32 * size_t(g) + 16);
        if (!full) {
          sv0 = _mm256_and_ps(sv0, mk[0]);
          sv1 = _mm256_and_ps(sv1, mk[1]);
          mv0 = _mm256_and_ps(mv0, mk[0]);
          mv1 = _mm256_and_ps(mv1, mk[1]);
        }
        __m256 w[NQ][2], wa[4];
        for (int h = 0; h < 4; ++h) {
          if (h < NQ) {
            w[h][0] = _mm256_mul_ps(pv[h][0], sv0);
            w[h][1] = _mm256_mul_ps(pv[h][1], sv1);
            wa[h] = _mm256_max_ps(_mm256_andnot_ps(sign, w[h][0]), _mm256_andnot_ps(sign, w[h][1]));
          } else {
            wa[h] = _mm256_setzero_ps();
          }
        }
        // int4t_weight_step for all rows at once: dw = wmax / levels, inv = levels / wmax or 0.
        const __m256 wmax = max4x8(wa);
        _mm256_store_ps(dw[tt][g], _mm256_div_ps(wmax, lv));
        const __m256 inv =
            _mm256_and_ps(_mm256_div_ps(lv, wmax), _mm256_cmp_ps(wmax, _mm256_setzero_ps(), _CMP_GT_OQ));
        for (int r = 0; r < NP; ++r) {
          __m256i pk[2];
          for (int e = 0; e < 2; ++e) {
            const int h = 2 * r + e;
            if (h < NQ) {
              const __m256 ih = _mm256_permutevar_ps(inv, _mm256_set1_epi32(h));
              pk[e] = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w[h][0], ih)),
                                         _mm256_cvtps_epi32(_mm256_mul_ps(w[h][1], ih)));
            } else {
              pk[e] = _mm256_setzero_si256();
            }
          }
          // Saturation is the reference's clamp: [0, 255], or [-127, 127] (a NaN product
          // converts to INT_MIN, which the reference's clamp makes -127).
          const __m256i q = U8 ? _mm256_packus_epi16(pk[0], pk[1])
                               : _mm256_max_epi8(_mm256_packs_epi16(pk[0], pk[1]), _mm256_set1_epi8(-127));
          _mm256_store_si256(reinterpret_cast<__m256i*>(w8[tt][g][r]), q);
        }
        for (int h = 0; h < NQ; ++h)
          _mm256_store_ps(msv[h][g],
                          _mm256_fmadd_ps(pv[h][1], mv1, _mm256_fmadd_ps(pv[h][0], mv0, _mm256_load_ps(msv[h][g]))));
      }
    }
    for (int tt = 0; tt < nt; ++tt) {
      const uint8_t* codes = block + size_t(seg + tt) * L.tile_bytes + L.code_off;
      // Per (half, chunk) the tile's 4 token-quad loads are split into 8 code vectors once;
      // then each row's two int16 chains run and are flushed before the next row's: about 12
      // live registers (all rows' chains at once need 8 more and spilled). The group is
      // stepped along the one chunk loop (no c / cpg division; and in a loop per group the
      // compiler hoists the 16 weight broadcasts it shares, spilling most of them).
      for (int half = 0; half < 2; ++half)
        for (int c = 0, g = 0, cg = 0; c < hd / 32; ++c) {
            const uint8_t* cp = codes + size_t(c) * 256 + 32 * size_t(half);
            __m256i lo[4], hi[4];
            for (int k = 0; k < 4; ++k) {
              const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * k));
              lo[k] = _mm256_and_si256(x, m4);
              hi[k] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            }
            for (int h = 0; h < NQ; ++h) {
              const uint8_t* wp = w8[tt][g][h / 2];
              __m256i slo = _mm256_setzero_si256(), shi = _mm256_setzero_si256();
              for (int k = 0; k < 4; ++k) {
                const __m256i wb = bcast32(wp + 4 * w8_dword(h, k));
                slo = _mm256_add_epi16(slo, U8 ? _mm256_maddubs_epi16(wb, lo[k]) : _mm256_maddubs_epi16(lo[k], wb));
                shi = _mm256_add_epi16(shi, U8 ? _mm256_maddubs_epi16(wb, hi[k]) : _mm256_maddubs_epi16(hi[k], wb));
              }
              // Lanes: channel 32c + 8 half + i (low nibbles), 32c + 16 + 8 half + i (high).
              const __m256 s = _mm256_broadcast_ss(&dw[tt][g][h]);
              float* a = acc + size_t(h) * size_t(hd) + size_t(32 * c + 8 * half);
              _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(slo)), s, _mm256_loadu_ps(a)));
              _mm256_storeu_ps(a + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(shi)), s, _mm256_loadu_ps(a + 16)));
            }
            if (++cg == cpg) {  // chunk c + 1 starts the next group
              cg = 0;
              ++g;
            }
          }
    }
  }
  for (int h = 0; h < NQ; ++h)
    for (int g = 0; g < ng; ++g) {
      const __m256 v = _mm256_load_ps(msv[h][g]);
      __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      x = _mm_add_ps(x, _mm_movehl_ps(x, x));
      x = _mm_add_ss(x, _mm_movehdup_ps(x));
      const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(x));
      float* a = acc + size_t(h) * size_t(hd) + size_t(g * L.group);
      for (int d = 0; d < L.group; d += 8) _mm256_storeu_ps(a + d, _mm256_add_ps(_mm256_loadu_ps(a + d), m));
    }
}

// int4t_weights_nonneg, 8 weights per compare.
bool weights_nonneg(const float* p, int p_stride, int n_q, int n) {
  __m256 neg = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
  for (int i = 0; i < n_q; ++i) {
    const float* r = p + size_t(i) * size_t(p_stride);
    int t = 0;
    for (; t + 8 <= n; t += 8) neg = _mm256_or_ps(neg, _mm256_cmp_ps(_mm256_loadu_ps(r + t), zero, _CMP_LT_OQ));
    for (; t < n; ++t)
      if (r[t] < 0) return false;
  }
  return _mm256_movemask_ps(neg) == 0;
}

template <bool U8>
void accum_rows(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0, int n,
                float* acc) {
  for (int i = 0; i < n_q; i += kMaxNq) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    float* a = acc + size_t(i) * size_t(L.hd);
    switch (std::min(kMaxNq, n_q - i)) {
      case 1: accum_pass<1, U8>(L, pi, p_stride, block, t0, n, a); break;
      case 2: accum_pass<2, U8>(L, pi, p_stride, block, t0, n, a); break;
      case 3: accum_pass<3, U8>(L, pi, p_stride, block, t0, n, a); break;
      default: accum_pass<4, U8>(L, pi, p_stride, block, t0, n, a); break;
    }
  }
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
  if (weights_nonneg(p, p_stride, n_q, n))
    accum_rows<true>(L, p, p_stride, n_q, block, t0, n, acc);
  else
    accum_rows<false>(L, p, p_stride, n_q, block, t0, n, acc);
}

}  // namespace kvq
