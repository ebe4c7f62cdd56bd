// TurboQuant kernels, AVX2. Eight channels of b-bit codes are b contiguous bytes of the segment's
// bit stream: broadcast them, shift lane i right by b i, and vpermps looks the low 3 bits up in an
// 8-entry codebook half (the codebook repeated, so bits of the next channels do not matter; two
// halves and a blend on index bit 3 for 4-bit codes).
#include <immintrin.h>

#include <cstring>

#include "core/dtypes.h"
#include "kv/turboquant.h"

namespace kvq {

namespace {

inline __m256i lane_bits() { return _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128); }

// Lanes whose bit is set in `byte` become all-ones.
inline __m256i byte_mask(uint8_t byte, __m256i bits) {
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(byte), bits), bits);
}

struct Codebook8 {
  __m256 lo, hi;  // entries 0..7 and 8..15 of the codebook repeated to 16 (entry k: code k & mask)
  __m256i shift;  // lane i: b * i
  int bits;
};

Codebook8 make_cb(const float* cb16, int bits) {
  alignas(32) float tb[16];
  alignas(32) int32_t sh[8];
  for (int k = 0; k < 16; ++k) tb[k] = cb16[k & ((1 << bits) - 1)];
  for (int i = 0; i < 8; ++i) sh[i] = bits * i;
  return {_mm256_load_ps(tb), _mm256_load_ps(tb + 8), _mm256_load_si256(reinterpret_cast<const __m256i*>(sh)), bits};
}

// Centroids of channels [8h, 8h + 8) of a segment with the codebook's bit width.
inline __m256 decode_half(const uint8_t* seg, int h, const Codebook8& cb) {
  uint32_t w = 0;
  const uint8_t* p = seg + size_t(h) * size_t(cb.bits);
  switch (cb.bits) {  // exactly the b bytes of the 8 codes: the last record may end there
    case 1: w = p[0]; break;
    case 2: std::memcpy(&w, p, 2); break;
    case 3: std::memcpy(&w, p, 3); break;
    default: std::memcpy(&w, p, 4); break;
  }
  const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(int(w)), cb.shift);
  const __m256 lo = _mm256_permutevar8x32_ps(cb.lo, idx);
  if (cb.bits < 4) return lo;
  const __m256 hi = _mm256_permutevar8x32_ps(cb.hi, idx);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int NQ>
void scores_chunk(const TqKernelArgs& a, const float* qp, int qp_stride, const uint8_t* recs, int n,
                  float* out, int out_stride) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  const Codebook8 cb_hi = make_cb(a.cb_hi, l.bits_hi);
  const Codebook8 cb_lo = make_cb(a.cb_lo, l.n_hi < d ? l.bits_lo : l.bits_hi);
  const __m256i lb = lane_bits();
  const int g_hi = l.n_hi / 16, g_all = d / 16;
  float sq_sum[NQ];
  if (l.qjl)
    for (int i = 0; i < NQ; ++i) {
      __m256 s = _mm256_setzero_ps();
      const float* sq = qp + size_t(i) * size_t(qp_stride) + d;
      for (int c = 0; c < d; c += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(sq + c));
      sq_sum[i] = hsum(s);
    }
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = recs + size_t(t) * size_t(l.record_bytes);
    __m256 acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = _mm256_setzero_ps();
    for (int g = 0; g < g_all; ++g) {
      for (int h = 0; h < 2; ++h) {
        const __m256 v = g < g_hi ? decode_half(rec + l.off_hi, 2 * g + h, cb_hi)
                                  : decode_half(rec + l.off_lo, 2 * (g - g_hi) + h, cb_lo);
        for (int i = 0; i < NQ; ++i)
          acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + size_t(i) * size_t(qp_stride) + 16 * g + 8 * h), v, acc[i]);
      }
    }
    const float norm = f16_to_f32(uint16_t(rec[0] | (rec[1] << 8)));
    float s[NQ];
    for (int i = 0; i < NQ; ++i) s[i] = hsum(acc[i]);
    if (l.qjl) {
      const uint8_t* q = rec + l.off_qjl;
      const float rs = f16_to_f32(uint16_t(q[0] | (q[1] << 8))) * a.qjl_scale;
      __m256 z[NQ];
      for (int i = 0; i < NQ; ++i) z[i] = _mm256_setzero_ps();
      // <Sq, sign> = 2 * (sum of Sq where the sign bit is set) - sum of Sq
      for (int c = 0; c < d; c += 8) {
        const __m256 m = _mm256_castsi256_ps(byte_mask(q[2 + c / 8], lb));
        for (int i = 0; i < NQ; ++i)
          z[i] = _mm256_add_ps(z[i], _mm256_and_ps(m, _mm256_loadu_ps(qp + size_t(i) * size_t(qp_stride) + d + c)));
      }
      for (int i = 0; i < NQ; ++i) s[i] += rs * (2.f * hsum(z[i]) - sq_sum[i]);
    }
    for (int i = 0; i < NQ; ++i) out[size_t(i) * size_t(out_stride) + size_t(t)] = norm * s[i];
  }
}

void scores_avx2(const TqKernelArgs& a, const float* qp, int qp_stride, int n_q, const uint8_t* recs,
                 int n, float* out, int out_stride) {
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

void accumulate_avx2(const TqKernelArgs& a, const float* p, int p_stride, int n_q, const uint8_t* recs,
                     int n, float* acc) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  const Codebook8 cb_hi = make_cb(a.cb_hi, l.bits_hi);
  const Codebook8 cb_lo = make_cb(a.cb_lo, l.n_hi < d ? l.bits_lo : l.bits_hi);
  const int g_hi = l.n_hi / 16, g_all = d / 16;
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = recs + size_t(t) * size_t(l.record_bytes);
    const float norm = f16_to_f32(uint16_t(rec[0] | (rec[1] << 8)));
    for (int g = 0; g < g_all; ++g)
      for (int h = 0; h < 2; ++h) {
        const __m256 v = g < g_hi ? decode_half(rec + l.off_hi, 2 * g + h, cb_hi)
                                  : decode_half(rec + l.off_lo, 2 * (g - g_hi) + h, cb_lo);
        for (int i = 0; i < n_q; ++i) {
          const __m256 w = _mm256_set1_ps(p[size_t(i) * size_t(p_stride) + size_t(t)] * norm);
          float* o = acc + size_t(i) * size_t(d) + 16 * g + 8 * h;
          _mm256_storeu_ps(o, _mm256_fmadd_ps(w, v, _mm256_loadu_ps(o)));
        }
      }
  }
}

}  // namespace

const TqKernels& tq_kernels_avx2() {
  // Encode: the scalar reference (the AVX-512 variant is the vectorized one).
  static const TqKernels k{"avx2", scores_avx2, accumulate_avx2, tq_kernels_scalar().encode};
  return k;
}

}  // namespace kvq
