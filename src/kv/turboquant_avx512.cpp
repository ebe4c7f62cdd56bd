// TurboQuant kernels, AVX-512. Each u16 bit-plane word of a 16-channel group is a lane mask:
// the code index is built with one masked add per plane, and the whole codebook (<= 16 floats)
// sits in one register, so vpermps turns codes into centroids without touching memory.
#include <immintrin.h>

#include <cstring>

#include "core/dtypes.h"
#include "kv/turboquant.h"

namespace kvq {

namespace {

inline __mmask16 load_mask(const uint8_t* p) {
  uint16_t w;
  std::memcpy(&w, p, 2);
  return __mmask16(w);
}

// Centroids of the 16 channels of group g of a segment with `bits`-bit codes.
inline __m512 decode_group(const uint8_t* seg, int bits, int g, __m512 cb) {
  const uint8_t* w = seg + size_t(g) * size_t(bits) * 2;
  __m512i idx = _mm512_maskz_mov_epi32(load_mask(w), _mm512_set1_epi32(1));
  for (int j = 1; j < bits; ++j)
    idx = _mm512_mask_add_epi32(idx, load_mask(w + 2 * j), idx, _mm512_set1_epi32(1 << j));
  return _mm512_permutexvar_ps(idx, cb);
}

template <int NQ>
void scores_chunk(const TqKernelArgs& a, const float* qp, int qp_stride, const uint8_t* recs, int n,
                  float* out, int out_stride) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  const __m512 cb_hi = _mm512_loadu_ps(a.cb_hi);
  const __m512 cb_lo = _mm512_loadu_ps(a.cb_lo);
  const int g_hi = l.n_hi / 16, g_all = d / 16;
  float sq_sum[NQ];
  if (l.qjl)
    for (int i = 0; i < NQ; ++i) {
      __m512 s = _mm512_setzero_ps();
      const float* sq = qp + size_t(i) * size_t(qp_stride) + d;
      for (int g = 0; g < g_all; ++g) s = _mm512_add_ps(s, _mm512_loadu_ps(sq + 16 * g));
      sq_sum[i] = _mm512_reduce_add_ps(s);
    }
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = recs + size_t(t) * size_t(l.record_bytes);
    __m512 acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < g_hi; ++g) {
      const __m512 v = decode_group(rec + l.off_hi, l.bits_hi, g, cb_hi);
      for (int i = 0; i < NQ; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + size_t(i) * size_t(qp_stride) + 16 * g), v, acc[i]);
    }
    for (int g = g_hi; g < g_all; ++g) {
      const __m512 v = decode_group(rec + l.off_lo, l.bits_lo, g - g_hi, cb_lo);
      for (int i = 0; i < NQ; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + size_t(i) * size_t(qp_stride) + 16 * g), v, acc[i]);
    }
    const float norm = f16_to_f32(uint16_t(rec[0] | (rec[1] << 8)));
    float s[NQ];
    for (int i = 0; i < NQ; ++i) s[i] = _mm512_reduce_add_ps(acc[i]);
    if (l.qjl) {
      const uint8_t* q = rec + l.off_qjl;
      const float rs = f16_to_f32(uint16_t(q[0] | (q[1] << 8))) * a.qjl_scale;
      __m512 z[NQ];
      for (int i = 0; i < NQ; ++i) z[i] = _mm512_setzero_ps();
      // <Sq, sign> = 2 * (sum of Sq where the sign bit is set) - sum of Sq
      for (int g = 0; g < g_all; ++g) {
        const __mmask16 m = load_mask(q + 2 + 2 * g);
        for (int i = 0; i < NQ; ++i)
          z[i] = _mm512_mask_add_ps(z[i], m, z[i], _mm512_loadu_ps(qp + size_t(i) * size_t(qp_stride) + d + 16 * g));
      }
      for (int i = 0; i < NQ; ++i) s[i] += rs * (2.f * _mm512_reduce_add_ps(z[i]) - sq_sum[i]);
    }
    for (int i = 0; i < NQ; ++i) out[size_t(i) * size_t(out_stride) + size_t(t)] = norm * s[i];
  }
}

void scores_avx512(const TqKernelArgs& a, const float* qp, int qp_stride, int n_q,
                   const uint8_t* recs, int n, float* out, int out_stride) {
  int i = 0;
  for (; i + 4 <= n_q; i += 4)
    scores_chunk<4>(a, qp + size_t(i) * size_t(qp_stride), qp_stride, recs, n, out + size_t(i) * size_t(out_stride), out_stride);
  const float* q = qp + size_t(i) * size_t(qp_stride);
  float* o = out + size_t(i) * size_t(out_stride);
  switch (n_q - i) {
    case 3: scores_chunk<3>(a, q, qp_stride, recs, n, o, out_stride); break;
    case 2: scores_chunk<2>(a, q, qp_stride, recs, n, o, out_stride); break;
    case 1: scores_chunk<1>(a, q, qp_stride, recs, n, o, out_stride); break;
    default: break;
  }
}

void accumulate_avx512(const TqKernelArgs& a, const float* p, int p_stride, int n_q,
                       const uint8_t* recs, int n, float* acc) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  const __m512 cb_hi = _mm512_loadu_ps(a.cb_hi);
  const __m512 cb_lo = _mm512_loadu_ps(a.cb_lo);
  const int g_hi = l.n_hi / 16, g_all = d / 16;
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = recs + size_t(t) * size_t(l.record_bytes);
    const float norm = f16_to_f32(uint16_t(rec[0] | (rec[1] << 8)));
    for (int g = 0; g < g_all; ++g) {
      const __m512 v = g < g_hi ? decode_group(rec + l.off_hi, l.bits_hi, g, cb_hi)
                                : decode_group(rec + l.off_lo, l.bits_lo, g - g_hi, cb_lo);
      for (int i = 0; i < n_q; ++i) {
        const __m512 w = _mm512_set1_ps(p[size_t(i) * size_t(p_stride) + size_t(t)] * norm);
        float* o = acc + size_t(i) * size_t(d) + 16 * g;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(w, v, _mm512_loadu_ps(o)));
      }
    }
  }
}

}  // namespace

const TqKernels& tq_kernels_avx512() {
  static const TqKernels k{"avx512", scores_avx512, accumulate_avx512};
  return k;
}

}  // namespace kvq
