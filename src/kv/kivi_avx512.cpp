// AVX-512 KIVI kernels: a bit plane of 16 channels is one 16-bit mask register, so unpacking a
// code is one masked add per bit.
#include "core/avx512.h"

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

// hsum16_avx512 on int32 lanes: result lane 4L + e = sum of the 16 lanes of v[4e + L].
inline __m512i hsum16_epi32(const __m512i* v) {
  __m512i u[8], w[4];
  for (int j = 0; j < 8; ++j)
    u[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 4; ++j)
    w[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  auto shuf = [](__m512i a, __m512i b, int sel) {
    return sel ? _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), _MM_SHUFFLE(3, 1, 3, 1)))
               : _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), _MM_SHUFFLE(2, 0, 2, 0)));
  };
  const __m512i y0 = _mm512_add_epi32(shuf(w[0], w[1], 0), shuf(w[0], w[1], 1));
  const __m512i y1 = _mm512_add_epi32(shuf(w[2], w[3], 0), shuf(w[2], w[3], 1));
  return _mm512_add_epi32(shuf(y0, y1, 0), shuf(y0, y1, 1));
}

// 64 codes of block m of a row as bytes in channel order: plane j's 64-bit word is the mask of
// the byte adds of 2^j.
template <int B>
inline __m512i codes64(const uint8_t* row, int pb, int m) {
  __m512i v = _mm512_setzero_si512();
  for (int j = 0; j < B; ++j) {
    uint64_t w;
    std::memcpy(&w, row + j * pb + 8 * m, 8);
    v = _mm512_mask_add_epi8(v, __mmask64(w), v, _mm512_set1_epi8(char(1 << j)));
  }
  return v;
}

// Integer dot: the folded query rows are rounded to int16 (qi = round(qs / dq), dq = max|qs| /
// 32767 per row), codes widened to int16, vpdpwssd sums channel pairs into int32 (|sum| <=
// 32767 * 15 * 512 < 2^31). The only approximation is |qs - dq qi| <= dq / 2 per channel, ~1.5e-5
// of the row's largest |qs| (kivi.h, kivi_k_scores_fn).
template <int B, int NQ>
void k_scores_i16_nq(const uint8_t* codes, size_t row_bytes, int n, int head_dim, const int16_t* q16,
                     const float* dq, const float* qz, float* out, int out_stride) {
  constexpr int NQP = NQ == 3 ? 4 : NQ;
  constexpr int TU = 16 / NQP;
  const int pb = head_dim / 8, nm = head_dim / 64;
  alignas(64) float dl[16], zl[16];  // per output lane o = i * TU + u: query i's step and zero term
  for (int o = 0; o < 16; ++o) {
    dl[o] = o / TU < NQ ? dq[o / TU] : 0.f;
    zl[o] = o / TU < NQ ? qz[o / TU] : 0.f;
  }
  const __m512 dlv = _mm512_load_ps(dl), zlv = _mm512_load_ps(zl);
  int t = 0;
  for (; t + TU <= n; t += TU) {
    __m512i acc[NQ * TU];  // o = i * TU + u; constant indices once the loops unroll: registers
    for (auto& v : acc) v = _mm512_setzero_si512();
    for (int m = 0; m < nm; ++m) {
      __m512i qlo[NQ], qhi[NQ];
#pragma GCC unroll 4
      for (int i = 0; i < NQ; ++i) {
        qlo[i] = _mm512_load_si512(q16 + size_t(i) * head_dim + 64 * m);
        qhi[i] = _mm512_load_si512(q16 + size_t(i) * head_dim + 64 * m + 32);
      }
#pragma GCC unroll 16
      for (int u = 0; u < TU; ++u) {
        const __m512i v = codes64<B>(codes + size_t(t + u) * row_bytes, pb, m);
        const __m512i w0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v));
        const __m512i w1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1));
#pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) {
          acc[i * TU + u] = _mm512_dpwssd_epi32(acc[i * TU + u], w0, qlo[i]);
          acc[i * TU + u] = _mm512_dpwssd_epi32(acc[i * TU + u], w1, qhi[i]);
        }
      }
    }
    __m512i hv[16];
    for (int j = 0; j < 16; ++j) hv[j] = _mm512_setzero_si512();
    for (int o = 0; o < NQ * TU; ++o) hv[4 * (o % 4) + o / 4] = acc[o];  // hsum16 lane order
    alignas(64) float z[16];
    _mm512_store_ps(z, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hsum16_epi32(hv)), dlv, zlv));
    for (int i = 0; i < NQ; ++i)
      for (int u = 0; u < TU; ++u) out[size_t(i) * out_stride + size_t(t + u)] = z[i * TU + u];
  }
  for (; t < n; ++t) {
    const uint8_t* row = codes + size_t(t) * row_bytes;
    __m512i acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = _mm512_setzero_si512();
    for (int m = 0; m < nm; ++m) {
      const __m512i v = codes64<B>(row, pb, m);
      const __m512i w0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(v));
      const __m512i w1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v, 1));
      for (int i = 0; i < NQ; ++i) {
        const int16_t* qi = q16 + size_t(i) * head_dim + 64 * m;
        acc[i] = _mm512_dpwssd_epi32(acc[i], w0, _mm512_load_si512(qi));
        acc[i] = _mm512_dpwssd_epi32(acc[i], w1, _mm512_load_si512(qi + 32));
      }
    }
    for (int i = 0; i < NQ; ++i)
      out[size_t(i) * out_stride + size_t(t)] = float(_mm512_reduce_add_epi32(acc[i])) * dq[i] + qz[i];
  }
}

template <int B>
void k_scores_impl(const uint8_t* codes, size_t row_bytes, int n, int head_dim, const float* qs,
                   const float* qz, int n_q, float* out, int out_stride) {
  if (head_dim % 64 != 0) {  // the integer path takes whole 64-channel blocks
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
    return;
  }
  alignas(64) int16_t q16[4 * kvg_max_head_dim];
  float dq[4];
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const int m = std::min(4, n_q - i0);
    for (int i = 0; i < m; ++i) {
      const float* qi = qs + size_t(i0 + i) * head_dim;
      __m512 mx = _mm512_setzero_ps();
      for (int c = 0; c < head_dim; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qi + c)));
      const float amax = _mm512_reduce_max_ps(mx);
      dq[i] = amax / 32767.f;
      const __m512 inv = _mm512_set1_ps(amax > 0 ? 32767.f / amax : 0.f);
      for (int c = 0; c < head_dim; c += 16)
        _mm256_store_si256(reinterpret_cast<__m256i*>(q16 + size_t(i) * head_dim + c),
                           _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qi + c), inv))));
    }
    float* o = out + size_t(i0) * out_stride;
    switch (m) {
      case 1: k_scores_i16_nq<B, 1>(codes, row_bytes, n, head_dim, q16, dq, qz + i0, o, out_stride); break;
      case 2: k_scores_i16_nq<B, 2>(codes, row_bytes, n, head_dim, q16, dq, qz + i0, o, out_stride); break;
      case 3: k_scores_i16_nq<B, 3>(codes, row_bytes, n, head_dim, q16, dq, qz + i0, o, out_stride); break;
      default: k_scores_i16_nq<B, 4>(codes, row_bytes, n, head_dim, q16, dq, qz + i0, o, out_stride); break;
    }
  }
}

// Column strips of S chunks of 16 channels, the NQ x S accumulators in registers across all n
// tokens (instead of a load/add/store of acc per token and query). A chunk decodes to its values
// with one vpermps of the codes (integer masked adds of 2^j per bit plane) into the group's
// 16-entry table scale * j + zero, one FMA per group and token: scale * code is exact (f16 scale,
// code < 16), so the table entry is the reference's sc * code + ze, bit for bit, and the FMA
// pipes see only the table and the NQ accumulating FMAs.
template <int B, int NQ, int S>
void v_accum_nq(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group, const float* p,
                int p_stride, float* acc) {
  const int ng = head_dim / group, nk = head_dim / 16, pb = head_dim / 8;
  const bool blocks = head_dim % 64 == 0;  // strips (S % 4 == 0) then cover whole 64-channel blocks
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int k0 = 0; k0 < nk; k0 += S) {
    const int sn = std::min(S, nk - k0);
    __m512 a[NQ][S];
    for (int i = 0; i < NQ; ++i)
      for (int s = 0; s < S; ++s)
        a[i][s] = s < sn ? _mm512_loadu_ps(acc + size_t(i) * head_dim + 16 * (k0 + s)) : _mm512_setzero_ps();
    for (int t = 0; t < n; ++t) {
      const uint8_t* row = rows + size_t(t) * row_bytes;
      const uint8_t* planes = row + size_t(ng) * 4;
      __m512 pw[NQ];
      for (int i = 0; i < NQ; ++i) pw[i] = _mm512_set1_ps(p[size_t(i) * p_stride + t]);
      int g_prev = -1;
      __m512 tbl = _mm512_setzero_ps();
      __m512i c64 = _mm512_setzero_si512();
      for (int s = 0; s < sn; ++s) {
        const int k = k0 + s, g = 16 * k / group;
        if (g != g_prev) {
          tbl = _mm512_fmadd_ps(iota, _mm512_set1_ps(_cvtsh_ss(kvg_load_f16(row, size_t(g)))),
                                _mm512_set1_ps(_cvtsh_ss(kvg_load_f16(row, size_t(ng + g)))));
          g_prev = g;
        }
        __m512i c;
        if (blocks) {  // 64 codes as bytes once per block, widened per chunk
          if (k % 4 == 0) c64 = codes64<B>(planes, pb, k / 4);
          c = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c64, 0));
          if (k % 4 == 1) c = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c64, 1));
          if (k % 4 == 2) c = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c64, 2));
          if (k % 4 == 3) c = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c64, 3));
        } else {
          c = _mm512_setzero_si512();
          for (int j = 0; j < B; ++j) c = _mm512_mask_add_epi32(c, plane_mask(planes + j * pb, k), c, _mm512_set1_epi32(1 << j));
        }
        const __m512 v = _mm512_permutexvar_ps(c, tbl);
        for (int i = 0; i < NQ; ++i) a[i][s] = _mm512_fmadd_ps(pw[i], v, a[i][s]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int s = 0; s < sn; ++s) _mm512_storeu_ps(acc + size_t(i) * head_dim + 16 * (k0 + s), a[i][s]);
  }
}

// The common shape (head_dim % 64 == 0, value groups of 16 / 32 / >= 64 channels): strips of
// one 64-channel block, the block's 64 codes built once as bytes and widened per chunk, the
// scales / zeros of the block's groups loaded as one vector, chunk loops fully unrolled so the
// NQ x 4 accumulators and the group tables stay in registers. CPG: chunks per group (1, 2, 4).
template <int B, int NQ, int CPG>
void v_accum_blocks(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group, const float* p,
                    int p_stride, float* acc) {
  const int ng = head_dim / group, pb = head_dim / 8;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int m = 0; m < head_dim / 64; ++m) {
    const int g0 = 64 * m / group;  // first group of the block
    __m512 a[NQ][4];
    for (int i = 0; i < NQ; ++i)
      for (int s = 0; s < 4; ++s) a[i][s] = _mm512_loadu_ps(acc + size_t(i) * head_dim + 64 * m + 16 * s);
    for (int t = 0; t < n; ++t) {
      const uint8_t* row = rows + size_t(t) * row_bytes;
      const uint8_t* planes = row + size_t(ng) * 4;
      // [scale g0..g0+3][zero g0..g0+3] (entries past the block's groups unused; the reads stay
      // inside the row: zeros and planes follow the scales)
      uint64_t sraw, zraw;
      std::memcpy(&sraw, row + 2 * size_t(g0), 8);
      std::memcpy(&zraw, row + 2 * size_t(ng + g0), 8);
      const __m512 par = _mm512_castps256_ps512(
          _mm256_cvtph_ps(_mm_set_epi64x(static_cast<long long>(zraw), static_cast<long long>(sraw))));
      const __m512i c64 = codes64<B>(planes, pb, m);
      __m512 pw[NQ];
      for (int i = 0; i < NQ; ++i) pw[i] = _mm512_set1_ps(p[size_t(i) * p_stride + t]);
      __m512 tbl = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        if (s % CPG == 0) {
          const int gi = s / CPG;
          tbl = _mm512_fmadd_ps(iota, _mm512_permutexvar_ps(_mm512_set1_epi32(gi), par),
                                _mm512_permutexvar_ps(_mm512_set1_epi32(4 + gi), par));
        }
        __m512i c;
        switch (s) {
          case 0: c = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(c64)); break;
          case 1: c = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c64, 1)); break;
          case 2: c = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c64, 2)); break;
          default: c = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c64, 3)); break;
        }
        const __m512 v = _mm512_permutexvar_ps(c, tbl);
#pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) a[i][s] = _mm512_fmadd_ps(pw[i], v, a[i][s]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int s = 0; s < 4; ++s) _mm512_storeu_ps(acc + size_t(i) * head_dim + 64 * m + 16 * s, a[i][s]);
  }
}

template <int B, int CPG>
void v_accum_blocks_nq(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group, const float* p,
                       int p_stride, int n_q, float* acc) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + size_t(i0) * p_stride;
    float* a = acc + size_t(i0) * head_dim;
    switch (std::min(4, n_q - i0)) {
      case 1: v_accum_blocks<B, 1, CPG>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      case 2: v_accum_blocks<B, 2, CPG>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      case 3: v_accum_blocks<B, 3, CPG>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      default: v_accum_blocks<B, 4, CPG>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
    }
  }
}

// Integer weighted sum (head_dim % 64 == 0, group % 32 == 0), per run of up to 64 tokens:
// acc_i += sum_t p_it (s_tg code_t + z_tg) = sum_t w_itg code_t + Z_ig with w = p s rounded to
// int16 steps dw_ig = max_t |w_itg| / 32767 per (query, group, run) and Z = sum_t p z in f32.
// Two tokens' codes interleaved as int16 pairs (unpack of their byte codes, widened) meet the
// pair (w_t, w_t+1) in one vpdpwssd, 32 multiply-adds per instruction; |sum| <= 64 * 32767 * 15.
// The only approximation is |w - dw round(w / dw)| <= dw / 2 per token times its code
// (kivi.h, kivi_v_accum_fn). Accumulator lanes follow the unpack order; one permute per chunk
// restores channel order when a run is folded into acc.
constexpr int kVRun = 64;
template <int B, int NQ>
void v_accum_i16(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group, const float* p,
                 int p_stride, float* acc) {
  const int ng = head_dim / group, pb = head_dim / 8, nm = head_dim / 64;
  alignas(64) int16_t w16[NQ * (kvg_max_head_dim / 32) * kVRun];  // (NQ, ng, kVRun)
  float dw[NQ * (kvg_max_head_dim / 32)], zs[NQ * (kvg_max_head_dim / 32)];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i rb = _mm512_mullo_epi32(lane, _mm512_set1_epi32(int(row_bytes)));
  for (int t0 = 0; t0 < n; t0 += kVRun) {
    const int cn = std::min(kVRun, n - t0);
    const uint8_t* base = rows + size_t(t0) * row_bytes;
    // Weights of the run: scales / zeros of 16 rows at a time by gather (low f16 of each dword).
    alignas(64) float wf[NQ * (kvg_max_head_dim / 32) * kVRun];  // (NQ, ng, kVRun)
    for (int g = 0; g < ng; ++g) {
      __m512 wmax[NQ], zacc[NQ];
      for (int i = 0; i < NQ; ++i) wmax[i] = zacc[i] = _mm512_setzero_ps();
      for (int u = 0; u < kVRun; u += 16) {
        const __mmask16 m = u >= cn ? __mmask16(0) : (cn - u >= 16 ? __mmask16(0xffff) : __mmask16((1u << (cn - u)) - 1));
        const __m512i off = _mm512_add_epi32(rb, _mm512_set1_epi32(int(size_t(u) * row_bytes)));
        const __m512i sw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, off, base + 2 * g, 1);
        const __m512i zw = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, off, base + 2 * (ng + g), 1);
        const __m512 sv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sw)), zv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(zw));
        for (int i = 0; i < NQ; ++i) {
          const __m512 pv = _mm512_maskz_loadu_ps(m, p + size_t(i) * p_stride + t0 + u);
          const __m512 w = _mm512_mul_ps(pv, sv);
          _mm512_store_ps(wf + (size_t(i) * ng + g) * kVRun + u, w);
          wmax[i] = _mm512_max_ps(wmax[i], _mm512_abs_ps(w));
          zacc[i] = _mm512_fmadd_ps(pv, zv, zacc[i]);
        }
      }
      for (int i = 0; i < NQ; ++i) {
        const float mx = _mm512_reduce_max_ps(wmax[i]);
        dw[i * ng + g] = mx / 32767.f;
        zs[i * ng + g] = _mm512_reduce_add_ps(zacc[i]);
        const __m512 inv = _mm512_set1_ps(mx > 0 ? 32767.f / mx : 0.f);
        for (int u = 0; u < kVRun; u += 16)
          _mm256_store_si256(reinterpret_cast<__m256i*>(w16 + (size_t(i) * ng + g) * kVRun + u),
                             _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                 _mm512_mul_ps(_mm512_load_ps(wf + (size_t(i) * ng + g) * kVRun + u), inv))));
      }
    }
    const int cn2 = (cn + 1) & ~1;  // an odd last token pairs with a zero weight
    for (int mb = 0; mb < nm; ++mb) {
      // Vector j of the block: j = 0: channels {0-7, 16-23}, 1: {32-39, 48-55}, 2: {8-15, 24-31},
      // 3: {40-47, 56-63} (unpack lanes), so j = 0, 2 lie in the block's first 32 channels.
      const int ga = 64 * mb / group, gb = (64 * mb + 32) / group;
      __m512i ai[NQ][4];
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 4; ++j) ai[i][j] = _mm512_setzero_si512();
      for (int u = 0; u < cn2; u += 2) {
        const __m512i c0 = codes64<B>(base + size_t(u) * row_bytes + size_t(ng) * 4, pb, mb);
        const __m512i c1 = u + 1 < cn ? codes64<B>(base + size_t(u + 1) * row_bytes + size_t(ng) * 4, pb, mb)
                                      : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi8(c0, c1), hi = _mm512_unpackhi_epi8(c0, c1);
        const __m512i v0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo));
        const __m512i v1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1));
        const __m512i v2 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi));
        const __m512i v3 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1));
#pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) {
          int32_t pa, pbw;
          std::memcpy(&pa, w16 + (size_t(i) * ng + ga) * kVRun + u, 4);
          std::memcpy(&pbw, w16 + (size_t(i) * ng + gb) * kVRun + u, 4);
          const __m512i wa = _mm512_set1_epi32(pa), wb = _mm512_set1_epi32(pbw);
          ai[i][0] = _mm512_dpwssd_epi32(ai[i][0], v0, wa);
          ai[i][1] = _mm512_dpwssd_epi32(ai[i][1], v1, wb);
          ai[i][2] = _mm512_dpwssd_epi32(ai[i][2], v2, wa);
          ai[i][3] = _mm512_dpwssd_epi32(ai[i][3], v3, wb);
        }
      }
      const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
      for (int i = 0; i < NQ; ++i) {
        const __m512 da = _mm512_set1_ps(dw[i * ng + ga]), db = _mm512_set1_ps(dw[i * ng + gb]);
        const __m512 za = _mm512_set1_ps(zs[i * ng + ga]), zb = _mm512_set1_ps(zs[i * ng + gb]);
        const __m512 f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][0]), da, za);
        const __m512 f2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][2]), da, za);
        const __m512 f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][1]), db, zb);
        const __m512 f3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][3]), db, zb);
        float* o = acc + size_t(i) * head_dim + 64 * mb;
        // f0 = {0-7, 16-23}, f2 = {8-15, 24-31}; f1 = {32-39, 48-55}, f3 = {40-47, 56-63}
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_permutex2var_ps(f0, first, f2)));
        _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_loadu_ps(o + 16), _mm512_permutex2var_ps(f0, second, f2)));
        _mm512_storeu_ps(o + 32, _mm512_add_ps(_mm512_loadu_ps(o + 32), _mm512_permutex2var_ps(f1, first, f3)));
        _mm512_storeu_ps(o + 48, _mm512_add_ps(_mm512_loadu_ps(o + 48), _mm512_permutex2var_ps(f1, second, f3)));
      }
    }
  }
}

template <int B>
void v_accum_i16_nq(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group, const float* p,
                    int p_stride, int n_q, float* acc) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + size_t(i0) * p_stride;
    float* a = acc + size_t(i0) * head_dim;
    switch (std::min(4, n_q - i0)) {
      case 1: v_accum_i16<B, 1>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      case 2: v_accum_i16<B, 2>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      case 3: v_accum_i16<B, 3>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      default: v_accum_i16<B, 4>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
    }
  }
}

template <int B>
void v_accum_impl(const uint8_t* rows, size_t row_bytes, int n, int head_dim, int group,
                  const float* p, int p_stride, int n_q, float* acc) {
  if (head_dim % 64 == 0 && group % 32 == 0)
    return v_accum_i16_nq<B>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
  if (head_dim % 64 == 0) {
    if (group == 16) return v_accum_blocks_nq<B, 1>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
    if (group == 32) return v_accum_blocks_nq<B, 2>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
    if (group % 64 == 0) return v_accum_blocks_nq<B, 4>(rows, row_bytes, n, head_dim, group, p, p_stride, n_q, acc);
  }
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + size_t(i0) * p_stride;
    float* a = acc + size_t(i0) * head_dim;
    switch (std::min(4, n_q - i0)) {
      case 1: v_accum_nq<B, 1, 8>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
      case 2: v_accum_nq<B, 2, 8>(rows, row_bytes, n, head_dim, group, pi, p_stride, a); break;
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
