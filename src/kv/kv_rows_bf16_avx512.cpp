// bf16 and fp8 rows on AVX-512 BF16: scores and weighted sums as VDPBF16PS dot products (two bf16
// products per f32 lane and instruction), the other operand rounded to bf16 as GPU attention
// kernels round the query and the probabilities. FP8 codes become bf16 exactly (every E4M3 / E5M2
// value, subnormals, inf and NaN included, is a bf16) through tables of the 128 magnitudes
// (kv/fp8_bf16_avx512.h: byte tables, 64 codes at a time; word tables for a 32-code remainder)
// plus the sign; their scale (fixed, calibrated or per token) is applied once per score and folded
// into the weights. Bounds in kv/kv_rows.h (kv_rows_bf16_rel). On AVX-512 the fp8 formats store
// tiles (kv/fp8_tiled.h): these fp8 kernels serve the *_rows formats.
#include "core/avx512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/dtypes.h"
#include "kv/fp8.h"
#include "kv/fp8_bf16_avx512.h"
#include "kv/hsum_avx512.h"
#include "kv/kv_rows_simd.h"

namespace kvq {
namespace {

inline __m512bh ld_bh(const void* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }

constexpr bool is_e4m3(KvElem E) { return E == KvElem::e4m3 || E == KvElem::e4m3_dyn; }
constexpr bool is_dyn(KvElem E) { return E == KvElem::e4m3_dyn || E == KvElem::e5m2_dyn; }

// 32 FP8 codes -> their 32 values in bf16.
inline __m512bh fp8_to_bf16_32(const uint8_t* c, const Fp8Lut& L) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
  const __m512i lo = _mm512_permutex2var_epi16(L.t[0], x, L.t[1]);  // magnitudes 0..63 (index bits 0-5)
  const __m512i hi = _mm512_permutex2var_epi16(L.t[2], x, L.t[3]);  // 64..127
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), lo, hi);
  // | the code's sign bit (bit 7, shifted to 15): A | (B & C)
  return reinterpret_cast<__m512bh>(
      _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(x, 8), _mm512_set1_epi16(int16_t(0x8000)), 0xF8));
}

// 64 FP8 codes -> their 64 values in bf16, codes 0..31 in *a and 32..63 in *b: the codes' qwords
// put in the order 0, 4, 1, 5, 2, 6, 3, 7 so that fp8_bytes_to_bf16_64's in-lane interleave gives
// the values in channel order. Six instructions per 64 values where fp8_to_bf16_32 takes seven per
// 32 (its word permutes are the slow part on Zen 5).
[[gnu::always_inline]] inline void fp8_to_bf16_64(const uint8_t* c, const Fp8Lut& L, __m512bh* a, __m512bh* b) {
  const __m512i x = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), _mm512_loadu_si512(c));
  __m512i va, vb;
  fp8_bytes_to_bf16_64(x, L, &va, &vb);
  *a = reinterpret_cast<__m512bh>(va);
  *b = reinterpret_cast<__m512bh>(vb);
}

// Row access by element type: elements [e, e + 32) (dec) or [e, e + 64) (dec2) as bf16, and the
// row's multiplier (the fp8 scale; 1 for bf16).
template <KvElem E>
struct RowRead {
  const Fp8Lut* lut = nullptr;
  float scale = 1.f;
  explicit RowRead(float s) : scale(s) {
    if constexpr (E != KvElem::bf16) lut = &fp8_lut(is_e4m3(E));
  }
  [[gnu::always_inline]] __m512bh dec(const uint8_t* row, int e) const {
    if constexpr (E == KvElem::bf16) return ld_bh(row + 2 * size_t(e));
    else return fp8_to_bf16_32(row + (is_dyn(E) ? sizeof(KvRowScaled) : 0) + size_t(e), *lut);
  }
  [[gnu::always_inline]] void dec2(const uint8_t* row, int e, __m512bh* a, __m512bh* b) const {
    if constexpr (E == KvElem::bf16) {
      *a = ld_bh(row + 2 * size_t(e));
      *b = ld_bh(row + 2 * size_t(e + 32));
    } else {
      fp8_to_bf16_64(row + (is_dyn(E) ? sizeof(KvRowScaled) : 0) + size_t(e), *lut, a, b);
    }
  }
  [[gnu::always_inline]] float mul(const uint8_t* row) const {
    if constexpr (is_dyn(E)) {
      float s;
      std::memcpy(&s, row, sizeof s);
      return s;
    }
    return scale;
  }
};

// 32 floats -> 32 bf16 (RNE), in order.
inline __m512i to_bf16_32(const float* x) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)));
}

// Lane 4L + e of hsum16_avx512's result is the sum of its input 4e + L: hand the inputs over
// transposed so that lane j is the sum of v[j].
[[gnu::always_inline]] inline __m512 hsum_lanes(const __m512* v) {
  __m512 t[16];
  for (int k = 0; k < 16; ++k) t[k] = v[4 * (k % 4) + k / 4];
  return hsum16_avx512(t);
}

// Lanes i * TU .. i * TU + TU - 1 of z (query row i's scores of TU consecutive tokens) to
// out[i * out_stride ..]: one lane permute and one masked store per row instead of TU scalar stores.
template <int NQ, int TU>
[[gnu::always_inline]] inline void store_rows(__m512 z, float* out, int out_stride, int cnt) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int i = 0; i < NQ; ++i) {
    const __m512 v = i == 0 ? z : _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(i * TU)), z);
    _mm512_mask_storeu_ps(out + size_t(i) * size_t(out_stride), __mmask16((1u << cnt) - 1u), v);
  }
}

// NQ query rows in NQP slots, TU = 16 / NQP tokens per step (as kv_rows_simd::scores_nq).
template <KvElem E, int NQ>
void scores_nq(const RowRead<E>& rd, const uint16_t* qb, int hd, const uint8_t* rows, size_t row_stride, int n,
               float* out, int out_stride) {
  constexpr int NQP = NQ <= 1 ? 1 : NQ <= 2 ? 2 : NQ <= 4 ? 4 : 8;
  constexpr int TU = 16 / NQP;
  // A last step of fewer than TU tokens repeats its last row in the missing slots (dropped): every
  // score comes out of the same tree whatever NQ is (kv_rows_simd::scores_nq).
  for (int t = 0; t < n; t += TU) {
    const int cnt = n - t < TU ? n - t : TU;
    kv_rows_simd::kv_prefetch_ahead(rows, row_stride, t, cnt, n);
    const uint8_t* r0 = rows + size_t(t) * row_stride;
    const uint8_t* ru[TU];
    for (int u = 0; u < TU; ++u) ru[u] = r0 + size_t(u < cnt ? u : cnt - 1) * row_stride;
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
    int e = 0;
    for (; e + 64 <= hd; e += 64) {  // 64 elements per step: one conversion of 64 codes per row
      __m512bh x[TU], y[TU];
      for (int u = 0; u < TU; ++u) rd.dec2(ru[u], e, &x[u], &y[u]);
      for (int i = 0; i < NQ; ++i) {
        const __m512bh qv = ld_bh(qb + size_t(i) * size_t(hd) + size_t(e));
        for (int u = 0; u < TU; ++u) a[i * TU + u] = _mm512_dpbf16_ps(a[i * TU + u], x[u], qv);
        const __m512bh qw = ld_bh(qb + size_t(i) * size_t(hd) + size_t(e + 32));
        for (int u = 0; u < TU; ++u) a[i * TU + u] = _mm512_dpbf16_ps(a[i * TU + u], y[u], qw);
      }
    }
    for (; e < hd; e += 32) {
      __m512bh x[TU];
      for (int u = 0; u < TU; ++u) x[u] = rd.dec(ru[u], e);
      for (int i = 0; i < NQ; ++i) {
        const __m512bh qv = ld_bh(qb + size_t(i) * size_t(hd) + size_t(e));
        for (int u = 0; u < TU; ++u) a[i * TU + u] = _mm512_dpbf16_ps(a[i * TU + u], x[u], qv);
      }
    }
    __m512 z = hsum_lanes(a);
    if constexpr (E != KvElem::bf16) {  // the fp8 scale, once per score
      alignas(64) float mv[16];
      for (int u = 0; u < TU; ++u) {
        const float m = rd.mul(ru[u]);
        for (int i = 0; i < NQP; ++i) mv[i * TU + u] = m;
      }
      z = _mm512_mul_ps(z, _mm512_load_ps(mv));
    }
    store_rows<NQ, TU>(z, out + t, out_stride, cnt);
  }
}

// Weighted sum over token pairs: for rows t, t + 1, unpacklo / unpackhi of their 16-bit words give
// dwords (v_t[c], v_{t+1}[c]) for channels c = 8L + k (lo) and 8L + 4 + k (hi) at dword 4L + k of a
// 32-channel chunk; a dword broadcast of the pair's bf16 weights (p_t, p_{t+1}) (times the rows'
// fp8 scales) then adds both tokens with one VDPBF16PS. The accumulators stay in that order and
// are put back in channel order once per call. SV chunks of 32 channels per pass.
constexpr int kPairChunk = 64;  // weights converted per chunk of tokens (a stack buffer)

template <KvElem E, int NQ, int SV>
void accum_nq(const RowRead<E>& rd, const float* p, int p_stride, int hd, const uint8_t* rows, size_t row_stride,
              int n, float* acc) {
  // lo lanes 4L..4L+3 -> channels 8L..8L+3, hi lanes 4L..4L+3 -> channels 8L+4..8L+7:
  // channels 0-15 = [lo L0, hi L0, lo L1, hi L1], 16-31 = [lo L2, hi L2, lo L3, hi L3].
  const __m512i i0 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i i1 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int e = 0; e < hd; e += 32 * SV) {
    __m512 lo[NQ][SV], hi[NQ][SV];
    for (int i = 0; i < NQ; ++i)
      for (int v = 0; v < SV; ++v) lo[i][v] = hi[i][v] = _mm512_setzero_ps();
    for (int c0 = 0; c0 < n; c0 += kPairChunk) {
      const int m = std::min(kPairChunk, n - c0);
      alignas(64) float mu[kPairChunk];  // the rows' fp8 scales (1 for bf16)
      for (int t = 0; t < m; ++t) mu[t] = rd.mul(rows + size_t(c0 + t) * row_stride);
      alignas(64) uint32_t w[NQ][kPairChunk / 2];  // (p_t, p_{t+1}) as bf16, t even
      for (int i = 0; i < NQ; ++i) {
        alignas(64) float pf[kPairChunk];
        const float* pi = p + size_t(i) * size_t(p_stride) + size_t(c0);
        for (int t = 0; t < m; ++t) pf[t] = E == KvElem::bf16 ? pi[t] : pi[t] * mu[t];
        std::fill(pf + m, pf + kPairChunk, 0.f);  // an odd last token pairs with a zero weight
        for (int k = 0; k < kPairChunk; k += 32) _mm512_store_si512(w[i] + k / 2, to_bf16_32(pf + k));
      }
      for (int t = 0; t < m; t += 2) {
        const uint8_t* r0 = rows + size_t(c0 + t) * row_stride;
        const bool pair = t + 1 < m;
        if (e == 0) kv_rows_simd::kv_prefetch_ahead(rows, row_stride, c0 + t, 2, n);
        // The rows' elements [e, e + 32 SV) as bf16: one 64-code conversion per row when SV = 2.
        // An unpaired last token: the partner is zero (its weight is zero too, but the slot may
        // hold anything, NaN included).
        __m512bh d0[SV], d1[SV];
        if constexpr (SV == 2) {
          rd.dec2(r0, e, &d0[0], &d0[1]);
          if (pair) rd.dec2(r0 + row_stride, e, &d1[0], &d1[1]);
        } else {
          d0[0] = rd.dec(r0, e);
          if (pair) d1[0] = rd.dec(r0 + row_stride, e);
        }
        for (int v = 0; v < SV; ++v) {
          const __m512i x0 = reinterpret_cast<__m512i>(d0[v]);
          const __m512i x1 = pair ? reinterpret_cast<__m512i>(d1[v]) : _mm512_setzero_si512();
          const __m512bh l = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(x0, x1));
          const __m512bh h = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(x0, x1));
          for (int i = 0; i < NQ; ++i) {
            const __m512bh wb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(int(w[i][t / 2])));
            lo[i][v] = _mm512_dpbf16_ps(lo[i][v], l, wb);
            hi[i][v] = _mm512_dpbf16_ps(hi[i][v], h, wb);
          }
        }
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int v = 0; v < SV; ++v) {
        float* a = acc + size_t(i) * size_t(hd) + size_t(e + 32 * v);
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_permutex2var_ps(lo[i][v], i0, hi[i][v])));
        _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_permutex2var_ps(lo[i][v], i1, hi[i][v])));
      }
  }
}

template <KvElem E, int NQ>
void accum_sv(const RowRead<E>& rd, const float* p, int p_stride, int hd, const uint8_t* rows, size_t row_stride,
              int n, float* acc) {
  if constexpr (NQ <= 4)
    if (hd % 64 == 0) return accum_nq<E, NQ, 2>(rd, p, p_stride, hd, rows, row_stride, n, acc);
  accum_nq<E, NQ, 1>(rd, p, p_stride, hd, rows, row_stride, n, acc);
}

template <KvElem E>
void scores_elem(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows, size_t row_stride,
                 int n, float* out, int out_stride) {
  const int hd = f.head_dim;
  const RowRead<E> rd(scale);
  for (int i0 = 0; i0 < n_q; i0 += 8) {
    const int m = std::min(8, n_q - i0);
    alignas(64) uint16_t qb[8 * kv_max_head_dim];
    for (int i = 0; i < m; ++i)
      for (int e = 0; e < hd; e += 32)
        _mm512_store_si512(qb + size_t(i) * size_t(hd) + size_t(e), to_bf16_32(q + size_t(i0 + i) * size_t(hd) + size_t(e)));
    float* o = out + size_t(i0) * size_t(out_stride);
    kv_rows_simd::with_nq(m, [&](auto nq) { scores_nq<E, decltype(nq)::value>(rd, qb, hd, rows, row_stride, n, o, out_stride); });
  }
}

template <KvElem E>
void accum_elem(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q, const uint8_t* rows,
                size_t row_stride, int n, float* acc) {
  const int hd = f.head_dim;
  const RowRead<E> rd(scale);
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + size_t(i0) * size_t(p_stride);
    float* a = acc + size_t(i0) * size_t(hd);
    switch (std::min(4, n_q - i0)) {
      case 1: accum_sv<E, 1>(rd, pi, p_stride, hd, rows, row_stride, n, a); break;
      case 2: accum_sv<E, 2>(rd, pi, p_stride, hd, rows, row_stride, n, a); break;
      case 3: accum_sv<E, 3>(rd, pi, p_stride, hd, rows, row_stride, n, a); break;
      default: accum_sv<E, 4>(rd, pi, p_stride, hd, rows, row_stride, n, a); break;
    }
  }
}

// Calls f(std::integral_constant<KvElem, E>{}) for the row element type of this file's kernels.
template <class F>
void by_elem(KvElem e, F&& f) {
  switch (e) {
    case KvElem::e4m3: return f(std::integral_constant<KvElem, KvElem::e4m3>{});
    case KvElem::e5m2: return f(std::integral_constant<KvElem, KvElem::e5m2>{});
    case KvElem::e4m3_dyn: return f(std::integral_constant<KvElem, KvElem::e4m3_dyn>{});
    case KvElem::e5m2_dyn: return f(std::integral_constant<KvElem, KvElem::e5m2_dyn>{});
    default: return f(std::integral_constant<KvElem, KvElem::bf16>{});
  }
}

}  // namespace

void kv_rows_scores_bf16_avx512(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows,
                                size_t row_stride, int n, float* out, int out_stride) {
  by_elem(f.elem, [&](auto e) { scores_elem<decltype(e)::value>(f, scale, q, n_q, rows, row_stride, n, out, out_stride); });
}

void kv_rows_accum_bf16_avx512(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                               const uint8_t* rows, size_t row_stride, int n, float* acc) {
  by_elem(f.elem, [&](auto e) { accum_elem<decltype(e)::value>(f, scale, p, p_stride, n_q, rows, row_stride, n, acc); });
}

}  // namespace kvq
