// AVX2 kernels of the tiled int2 codec and kivi2t's key scores (layout and error bounds in
// kv/int2_tiled.h): the arithmetic of the AVX-512 ones with VPMADDUBSW (u8 x s8, two products per
// int16) in place of VPDPBUSD, int16 chains widened once per 32-dim block (scores) or tile
// (weighted sum), as int4t's AVX2 kernels.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kv/int2_tiled.h"

namespace kvq {
namespace {

constexpr int kMaxNq = 4;     // query rows per pass (accumulator registers)
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
inline __m256i widen(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
inline __m256i plane(__m256i x, int r) {
  const __m256i m2 = _mm256_set1_epi8(0x03);
  return r == 0 ? _mm256_and_si256(x, m2) : _mm256_and_si256(_mm256_srli_epi16(x, 2 * r), m2);
}

// Exact dots of both 8-token halves of a K tile's 32-dim block b (bytes 0..31 and 32..63 of the
// two 64-byte records) with each row's int8 query. int16 chain per (row, half): 8 VPMADDUBSW of
// at most 2 * 3 * 127, 6096 in all.
template <int NQ>
inline void key_block_dots(const uint8_t* codes, int b, const int8_t* const* q8, __m256i (*dot)[2]) {
  __m256i s16[NQ][2];
  for (int h = 0; h < NQ; ++h) s16[h][0] = s16[h][1] = _mm256_setzero_si256();
  for (int o = 2 * b; o < 2 * b + 2; ++o)
    for (int e = 0; e < 2; ++e) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * o + 32 * e));
      const __m256i p0 = plane(x, 0), p1 = plane(x, 1), p2 = plane(x, 2), p3 = plane(x, 3);
      for (int h = 0; h < NQ; ++h) {
        const int8_t* q = q8[h] + 16 * o;
        const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(p0, bcast32(q)), _mm256_maddubs_epi16(p1, bcast32(q + 4)));
        const __m256i c =
            _mm256_add_epi16(_mm256_maddubs_epi16(p2, bcast32(q + 8)), _mm256_maddubs_epi16(p3, bcast32(q + 12)));
        s16[h][e] = _mm256_add_epi16(s16[h][e], _mm256_add_epi16(a, c));
      }
    }
  for (int h = 0; h < NQ; ++h) {
    dot[h][0] = widen(s16[h][0]);
    dot[h][1] = widen(s16[h][1]);
  }
}

// Stores the lanes of half e of a tile (tokens base..base+7) that lie in [t0, t0 + n).
inline void store_half(float* o, int base, int t0, int n, __m256 v) {
  const int lo = std::max(0, t0 - base), hi = std::min(8, t0 + n - base);
  if (hi <= lo) return;
  if (lo == 0 && hi == 8) {
    _mm256_storeu_ps(o + (base - t0), v);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(o + (base + lo - t0), tmp + lo, sizeof(float) * size_t(hi - lo));
  }
}

template <int NQ>
void scores_pass(const Int4TiledLayout& L, const float* qp, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  const int bpg = L.group / 32;
  Int4tQueryRow qr[NQ];
  const int8_t* q8[NQ];
  for (int h = 0; h < NQ; ++h) {
    qr[h] = int4t_query_row(L, qp, h);
    q8[h] = qr[h].q8;
  }
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
        __m256i dot[NQ][2];
        key_block_dots<NQ>(codes, b, q8, dot);
        for (int h = 0; h < NQ; ++h) {
          const __m256 d = _mm256_set1_ps(qr[h].dq[b]);
          facc[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][0]), d, facc[h][0]);
          facc[h][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][1]), d, facc[h][1]);
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
    for (int h = 0; h < NQ; ++h)
      for (int e = 0; e < 2; ++e)
        store_half(out + size_t(h) * size_t(out_stride), tile * 16 + 8 * e, t0, n, score[h][e]);
  }
}

template <int NQ>
void kivi_scores_pass(const int8_t* q8, const float* dq, const float* cz, int hd, const uint8_t* tiles, int t0,
                      int n, float* out, int out_stride) {
  const size_t tile_bytes = int2t_code_bytes(hd);
  const int nb = hd / 32;
  const int8_t* qh[NQ];
  for (int h = 0; h < NQ; ++h) qh[h] = q8 + size_t(h) * size_t(hd);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  for (int tile = tile0; tile < tile1; ++tile) {
    const uint8_t* codes = tiles + size_t(tile) * tile_bytes;
    __m256 facc[NQ][2];
    for (int h = 0; h < NQ; ++h) facc[h][0] = facc[h][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      __m256i dot[NQ][2];
      key_block_dots<NQ>(codes, b, qh, dot);
      for (int h = 0; h < NQ; ++h) {
        const __m256 d = _mm256_set1_ps(dq[size_t(h) * size_t(nb) + size_t(b)]);
        facc[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][0]), d, facc[h][0]);
        facc[h][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][1]), d, facc[h][1]);
      }
    }
    for (int h = 0; h < NQ; ++h)
      for (int e = 0; e < 2; ++e)
        store_half(out + size_t(h) * size_t(out_stride), tile * 16 + 8 * e, t0, n,
                   _mm256_add_ps(facc[h][e], _mm256_set1_ps(cz[h])));
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
// A and B leave the token quads in the dwords A: 0 4 1 5, B: 2 6 3 7, read through this index.
inline int w8_dword(int h, int k) { return (h & 1) * 2 + (k >> 1) + (k & 1) * 4; }

// The weighted sum in segments of kSegTiles tiles: weights quantized with the scalar steps of
// int4t_weight_step (bit for bit), then per tile, 8-lane half and chunk of 32 channels, the tile's
// 2 octet loads split into 8 planes (4 token quads x 2 channel halves) and 2 int16 chains per row:
// u8 weights x s8 codes 4 quads * 2 * 255 * 3 = 6120, or s8 x u8 4 * 2 * 3 * 127.
template <int NQ, bool U8>
void accum_pass(const Int4TiledLayout& L, const float* p, int p_stride, const uint8_t* block, int t0, int n,
                float* acc) {
  constexpr int NP = (NQ + 1) / 2;  // row pairs
  const int hd = L.hd, ng = L.ng, cpg = L.group / 32;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 lv = _mm256_set1_ps(U8 ? kv_int4t_u8_levels : kv_int4t_s8_levels);
  const int tile0 = t0 / 16, tile1 = (t0 + n + 15) / 16;
  alignas(32) float msv[NQ][kMaxGroups][8];
  for (int h = 0; h < NQ; ++h)
    for (int g = 0; g < ng; ++g) _mm256_store_ps(msv[h][g], _mm256_setzero_ps());
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
      for (int half = 0; half < 2; ++half)
        for (int c = 0, g = 0, cg = 0; c < hd / 32; ++c) {
          const uint8_t* cp = codes + size_t(c) * 128 + 32 * size_t(half);
          // Token quad k: lo = channels 32c + 8 half + i, hi = 32c + 16 + 8 half + i.
          __m256i lo[4], hi[4];
          for (int o = 0; o < 2; ++o) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * o));
            lo[2 * o] = plane(x, 0);
            hi[2 * o] = plane(x, 1);
            lo[2 * o + 1] = plane(x, 2);
            hi[2 * o + 1] = plane(x, 3);
          }
          for (int h = 0; h < NQ; ++h) {
            const uint8_t* wp = w8[tt][g][h / 2];
            __m256i slo = _mm256_setzero_si256(), shi = _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k) {
              const __m256i wb = bcast32(wp + 4 * w8_dword(h, k));
              slo = _mm256_add_epi16(slo, U8 ? _mm256_maddubs_epi16(wb, lo[k]) : _mm256_maddubs_epi16(lo[k], wb));
              shi = _mm256_add_epi16(shi, U8 ? _mm256_maddubs_epi16(wb, hi[k]) : _mm256_maddubs_epi16(hi[k], wb));
            }
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

template <typename F>
void by_passes(int n_q, F&& f) {
  for (int i = 0; i < n_q; i += kMaxNq) {
    switch (std::min(kMaxNq, n_q - i)) {
      case 1: f(i, std::integral_constant<int, 1>{}); break;
      case 2: f(i, std::integral_constant<int, 2>{}); break;
      case 3: f(i, std::integral_constant<int, 3>{}); break;
      default: f(i, std::integral_constant<int, 4>{}); break;
    }
  }
}

}  // namespace

void int2t_scores_avx2(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                       float* out, int out_stride) {
  if (n <= 0) return;
  by_passes(n_q, [&](int i, auto m) {
    scores_pass<decltype(m)::value>(L, qp + size_t(i) * size_t(L.qdim), block, t0, n,
                                    out + size_t(i) * size_t(out_stride), out_stride);
  });
}

void int2t_accum_avx2(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                      int n, float* acc) {
  if (n <= 0) return;
  const bool u8 = weights_nonneg(p, p_stride, n_q, n);
  by_passes(n_q, [&](int i, auto m) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    float* a = acc + size_t(i) * size_t(L.hd);
    if (u8) accum_pass<decltype(m)::value, true>(L, pi, p_stride, block, t0, n, a);
    else accum_pass<decltype(m)::value, false>(L, pi, p_stride, block, t0, n, a);
  });
}

void kivi2t_scores_avx2(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                        int t0, int n, float* out, int out_stride) {
  if (n <= 0) return;
  const int nb = hd / 32;
  by_passes(n_q, [&](int i, auto m) {
    kivi_scores_pass<decltype(m)::value>(q8 + size_t(i) * size_t(hd), dq + size_t(i) * size_t(nb), cz + i, hd, tiles,
                                         t0, n, out + size_t(i) * size_t(out_stride), out_stride);
  });
}

}  // namespace kvq
