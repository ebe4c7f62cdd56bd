// AVX-512 KIVI kernels: a bit plane of 16 channels is one 16-bit mask register, so unpacking a
// code is one masked add per bit.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kv/grouped_common.h"
#include "kv/hsum_avx512.h"
#include "kv/kivi.h"

namespace kvq {

namespace {

inline __mmask16 plane_mask(const uint8_t* plane, int k) {
  uint16_t m;
  std::memcpy(&m, plane + 2 * k, 2);
  return __mmask16(m);
}

// Codes of a 16-channel chunk decoded once per token (masked adds of 2^j: exact small floats),
// then one FMA per query row; 16 / NQ tokens per step so that one hsum16 finishes 16 scores.
template <int B, int NQ>
inline void k_token(const uint8_t* row, int pb, int nk, const float* qs, int head_dim, __m512* F) {
  for (int k = 0; k < nk; ++k) {
    __m512 v = _mm512_setzero_ps();
    for (int j = 0; j < B; ++j)
      v = _mm512_mask_add_ps(v, plane_mask(row + j * pb, k), v, _mm512_set1_ps(float(1 << j)));
    for (int i = 0; i < NQ; ++i) F[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qs + size_t(i) * head_dim + 16 * k), v, F[i]);
  }
}

template <int B, int NQ>
void k_scores_nq(const uint8_t* codes, size_t row_bytes, int n, int head_dim, const float* qs, const float* qz,
                 float* out, int out_stride) {
  constexpr int NQP = NQ == 3 ? 4 : NQ;
  constexpr int TU = 16 / NQP;
  const int pb = head_dim / 8, nk = head_dim / 16;
  int t = 0;
  for (; t + TU <= n; t += TU) {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) v[j] = _mm512_setzero_ps();
    for (int u = 0; u < TU; ++u) {
      __m512 F[NQ];
      for (int i = 0; i < NQ; ++i) F[i] = _mm512_setzero_ps();
      k_token<B, NQ>(codes + size_t(t + u) * row_bytes, pb, nk, qs, head_dim, F);
      for (int i = 0; i < NQ; ++i) {
        const int o = i * TU + u;  // output lane: query i's TU scores are contiguous
        v[4 * (o % 4) + o / 4] = F[i];
      }
    }
    alignas(64) float z[16];
    _mm512_store_ps(z, hsum16_avx512(v));
    for (int i = 0; i < NQ; ++i)
      for (int u = 0; u < TU; ++u) out[size_t(i) * out_stride + size_t(t + u)] = z[i * TU + u] + qz[i];
  }
  for (; t < n; ++t) {
    __m512 F[NQ];
    for (int i = 0; i < NQ; ++i) F[i] = _mm512_setzero_ps();
    k_token<B, NQ>(codes + size_t(t) * row_bytes, pb, nk, qs, head_dim, F);
    for (int i = 0; i < NQ; ++i) out[size_t(i) * out_stride + size_t(t)] = _mm512_reduce_add_ps(F[i]) + qz[i];
  }
}

template <int B>
void k_scores_impl(const uint8_t* codes, size_t row_bytes, int n, int head_dim, const float* qs,
                   const float* qz, int n_q, float* out, int out_stride) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* qi = qs + size_t(i0) * head_dim;
    float* o = out + size_t(i0) * out_stride;
    switch (std::min(4, n_q - i0)) {
      case 1: k_scores_nq<B, 1>(codes, row_bytes, n, head_dim, qi, qz + i0, o, out_stride); break;
      case 2: k_scores_nq<B, 2>(codes, row_bytes, n, head_dim, qi, qz + i0, o, out_stride); break;
      case 3: k_scores_nq<B, 3>(codes, row_bytes, n, head_dim, qi, qz + i0, o, out_stride); break;
      default: k_scores_nq<B, 4>(codes, row_bytes, n, head_dim, qi, qz + i0, o, out_stride); break;
    }
  }
}

// Column strips of S chunks of 16 channels, the NQ x S accumulators in registers across all n
// tokens (instead of a load/add/store of acc per token and query). A chunk decodes to its values
// in registers: masked adds of scale * 2^j per bit plane give scale * code exactly (f16 scale,
// code < 16), then one add of the zero: the reference's rounding, bit for bit.
template <int B, int NQ, int S>
void v_accum_nq(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group, const float* p,
                int p_stride, float* acc) {
  const int ng = head_dim / group, nk = head_dim / 16, pb = head_dim / 8;
  for (int k0 = 0; k0 < nk; k0 += S) {
    const int sn = std::min(S, nk - k0);
    __m512 a[NQ][S];
    for (int i = 0; i < NQ; ++i)
      for (int s = 0; s < S; ++s)
        a[i][s] = s < sn ? _mm512_loadu_ps(acc + size_t(i) * head_dim + 16 * (k0 + s)) : _mm512_setzero_ps();
    for (int t = 0; t < n; ++t) {
      const uint8_t* row = rows + size_t(t) * row_bytes;
      const uint8_t* planes = row + size_t(ng) * 4;
      int g_prev = -1;
      __m512 sj[B], ze = _mm512_setzero_ps();
      for (int s = 0; s < sn; ++s) {
        const int k = k0 + s, g = 16 * k / group;
        if (g != g_prev) {
          const float sc = _cvtsh_ss(kvg_load_f16(row, size_t(g)));
          for (int j = 0; j < B; ++j) sj[j] = _mm512_set1_ps(sc * float(1 << j));
          ze = _mm512_set1_ps(_cvtsh_ss(kvg_load_f16(row, size_t(ng + g))));
          g_prev = g;
        }
        __m512 v = _mm512_setzero_ps();
        for (int j = 0; j < B; ++j) v = _mm512_mask_add_ps(v, plane_mask(planes + j * pb, k), v, sj[j]);
        v = _mm512_add_ps(v, ze);
        for (int i = 0; i < NQ; ++i)
          a[i][s] = _mm512_fmadd_ps(_mm512_set1_ps(p[size_t(i) * p_stride + t]), v, a[i][s]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int s = 0; s < sn; ++s) _mm512_storeu_ps(acc + size_t(i) * head_dim + 16 * (k0 + s), a[i][s]);
  }
}

template <int B>
void v_accum_impl(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group,
                  const float* p, int p_stride, int n_q, float* acc) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + size_t(i0) * p_stride;
    float* a = acc + size_t(i0) * head_dim;
    switch (std::min(4, n_q - i0)) {
      case 1: v_accum_nq<B, 1, 8>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      case 2: v_accum_nq<B, 2, 6>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      case 3: v_accum_nq<B, 3, 4>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      default: v_accum_nq<B, 4, 4>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
    }
  }
}

}  // namespace

void kivi_k_scores_avx512(const uint8_t* codes, size_t row_bytes, int n, int bits, int head_dim,
                          const float* qs, const float* qz, int n_q, float* out, int out_stride) {
  switch (bits) {
    case 2: return k_scores_impl<2>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
    case 3: return k_scores_impl<3>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
    default: return k_scores_impl<4>(codes, row_bytes, n, head_dim, qs, qz, n_q, out, out_stride);
  }
}

void kivi_v_accum_avx512(const uint8_t* rows, size_t row_bytes, int n, int bits, int head_dim,
                         int group, const float* p, int p_stride, int n_q, float* acc) {
  switch (bits) {
    case 2: return v_accum_impl<2>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
    case 3: return v_accum_impl<3>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
    default: return v_accum_impl<4>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
  }
}

void kivi_fold_query_avx512(const uint8_t* params, const float* q, int n_q, int head_dim, float* qs, float* qz) {
  const int nk = head_dim / 16;
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * head_dim;
    __m512 z = _mm512_setzero_ps();
    for (int k = 0; k < nk; ++k) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 32 * k)));
      const __m512 ze = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + 2 * size_t(head_dim) + 32 * k)));
      const __m512 qv = _mm512_loadu_ps(qi + 16 * k);
      _mm512_storeu_ps(qs + size_t(i) * head_dim + 16 * k, _mm512_mul_ps(qv, sc));
      z = _mm512_fmadd_ps(qv, ze, z);
    }
    qz[i] = _mm512_reduce_add_ps(z);
  }
}

}  // namespace kvq
