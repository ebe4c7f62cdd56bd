// AVX2 KVQuant score kernel: each key is dequantized (8 codes per byte of each bit plane, spread
// by a table; the 16-entry codebook lookup is two vpermps blended on bit 3 of the code), split into pair order,
// patched with its outliers, turned by R(t) and dotted with every query row.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "core/dtypes.h"
#include "kv/grouped_common.h"
#include "kv/kvquant.h"

namespace kvq {

namespace {

// Byte b -> 8 bytes, byte i = bit i of b: a bit plane's byte spread over its 8 channels.
struct BitSpread {
  uint64_t t[256];
  constexpr BitSpread() : t() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) t[b] |= uint64_t((b >> i) & 1) << (8 * i);
  }
};
constexpr BitSpread kBitSpread;

// 8 channels 8k..8k+7 of one row, dequantized. The codes are gathered in a general register (one
// table load per plane) and widened once: the vector ports see 2 ops per 8 codes instead of 5 per
// plane.
template <int bits>
inline __m256 dequant8(const uint8_t* planes, int pb, int k, __m256 cb_lo, __m256 cb_hi, const float* sc,
                       const float* md) {
  uint64_t codes = 0;
  for (int j = 0; j < bits; ++j) codes |= kBitSpread.t[planes[j * pb + k]] << j;
  const __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(codes)));
  __m256 val = _mm256_permutevar8x32_ps(cb_lo, v);
  if constexpr (bits == 4)  // bit 3 moved to the sign bit selects the high half
    val = _mm256_blendv_ps(val, _mm256_permutevar8x32_ps(cb_hi, v), _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
  return _mm256_fmadd_ps(val, _mm256_loadu_ps(sc + 8 * k), _mm256_loadu_ps(md + 8 * k));
}

template <int bits>
void scores_bits(const KvquantScoreArgs& a, float* out, int out_stride) {
  const int D = a.head_dim, half = a.n_rot / 2, pb = D / 8;
  alignas(32) float sc[kvg_max_head_dim], md[kvg_max_head_dim], kp[kvg_max_head_dim];
  for (int k = 0; k < D / 8; ++k) {
    _mm256_store_ps(sc + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.params + 16 * k))));
    _mm256_store_ps(md + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(a.params + 2 * size_t(D) + 16 * k))));
  }
  const KvquantScoreLayout& l = *a.layout;
  const bool lanes = l.layout == kvquant_layout_lanes;
  const __m256 cb_lo = _mm256_loadu_ps(a.codebook), cb_hi = _mm256_loadu_ps(a.codebook + 8);
  alignas(32) float kn[kvg_max_head_dim];
  for (int t = 0; t < a.n; ++t) {
    const uint8_t* row = a.rows + size_t(t) * a.row_bytes;
    if (lanes) {  // channel order, then permuted (the lanes order serves the AVX-512 kernel)
      for (int k = 0; k < D / 8; ++k) _mm256_store_ps(kn + 8 * k, dequant8<bits>(row, pb, k, cb_lo, cb_hi, sc, md));
      for (int j = 0; j < a.k; ++j) {
        const size_t e = size_t(t) * a.k + j;
        kn[a.oidx[e]] = _cvtsh_ss(kvg_load_f16(a.ovals, e));
      }
      for (int c = 0; c < D; ++c) kp[l.slot[size_t(c)]] = kn[c];
    } else {
      int k = 0;
      if (!l.neox) {
        // Channels 16m..16m+15 = pairs 8m..8m+7: even lanes are the a-elements, odd the b-elements.
        for (; 8 * k < a.n_rot; k += 2) {
          const __m256 x0 = dequant8<bits>(row, pb, k, cb_lo, cb_hi, sc, md);
          const __m256 x1 = dequant8<bits>(row, pb, k + 1, cb_lo, cb_hi, sc, md);
          const __m256 ev = _mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));
          const __m256 od = _mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
          _mm256_store_ps(kp + 4 * k, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), _MM_SHUFFLE(3, 1, 2, 0))));
          _mm256_store_ps(kp + half + 4 * k,
                          _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), _MM_SHUFFLE(3, 1, 2, 0))));
        }
      }
      for (; k < D / 8; ++k) _mm256_store_ps(kp + 8 * k, dequant8<bits>(row, pb, k, cb_lo, cb_hi, sc, md));
      for (int j = 0; j < a.k; ++j) {
        const size_t e = size_t(t) * a.k + j;
        kp[l.slot[a.oidx[e]]] = _cvtsh_ss(kvg_load_f16(a.ovals, e));
      }
    }
    const float* rc = a.rot_c + size_t(t) * a.rot_stride;
    const float* rs = a.rot_s + size_t(t) * a.rot_stride;
    const bool runs = lanes && !l.neox;  // a-elements in runs of 16, b-elements 16 after
    for (int m = 0; m < half; m += 8) {
      const int ia = runs ? 32 * (m / 16) + m % 16 : m, ib = ia + (runs ? 16 : half);
      const __m256 ka = _mm256_load_ps(kp + ia), kb = _mm256_load_ps(kp + ib);
      const __m256 c = _mm256_loadu_ps(rc + m), s = _mm256_loadu_ps(rs + m);
      _mm256_store_ps(kp + ia, _mm256_fmsub_ps(ka, c, _mm256_mul_ps(kb, s)));
      _mm256_store_ps(kp + ib, _mm256_fmadd_ps(ka, s, _mm256_mul_ps(kb, c)));
    }
    // Four query rows at a time share one reduction: two rounds of VHADDPS leave row h's sum in
    // lanes h and 4 + h. A row's sum does not depend on its neighbours (a missing row is zeros),
    // so a query scores the same alone or batched with others.
    for (int i = 0; i < a.n_q; i += 4) {
      const int nr = std::min(4, a.n_q - i);
      // The rows side by side: each key vector loaded once, 8 independent FMA chains.
      const float* qr[4];
      for (int h = 0; h < 4; ++h) qr[h] = a.q + size_t(i + std::min(h, nr - 1)) * D;
      __m256 a0[4], a1[4];
      for (int h = 0; h < 4; ++h) a0[h] = a1[h] = _mm256_setzero_ps();
      for (int c = 0; c < D; c += 16) {
        const __m256 k0 = _mm256_load_ps(kp + c), k1 = _mm256_load_ps(kp + c + 8);
        for (int h = 0; h < 4; ++h) {
          a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[h] + c), k0, a0[h]);
          a1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[h] + c + 8), k1, a1[h]);
        }
      }
      __m256 r[4];
      for (int h = 0; h < 4; ++h) r[h] = h < nr ? _mm256_add_ps(a0[h], a1[h]) : _mm256_setzero_ps();
      const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
      alignas(16) float sum[4];
      _mm_store_ps(sum, _mm_add_ps(_mm256_castps256_ps128(h4), _mm256_extractf128_ps(h4, 1)));
      for (int h = 0; h < nr; ++h) out[size_t(i + h) * out_stride + t] = sum[h];
    }
  }
}

}  // namespace

void kvquant_scores_avx2(const KvquantScoreArgs& a, float* out, int out_stride) {
  if (a.n_rot / 2 % 8 != 0 || a.head_dim > kvg_max_head_dim) return kvquant_scores_scalar(a, out, out_stride);
  switch (a.bits) {
    case 2: return scores_bits<2>(a, out, out_stride);
    case 3: return scores_bits<3>(a, out, out_stride);
    default: return scores_bits<4>(a, out, out_stride);
  }
}

}  // namespace kvq
