// TurboQuant kernels: scalar reference and the one dispatch point for the SIMD variants.
#include <cstring>

#include "core/dtypes.h"
#include "kv/turboquant.h"

namespace kvq {

namespace {

inline uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

// Code of channel c (within its segment) from grouped bit planes of `bits` bits.
inline int code_at(const uint8_t* seg, int bits, int c) {
  const uint8_t* grp = seg + size_t(c / 16) * size_t(bits) * 2;
  int code = 0;
  for (int j = 0; j < bits; ++j) code |= ((load_u16(grp + 2 * j) >> (c % 16)) & 1) << j;
  return code;
}

void scores_scalar(const TqKernelArgs& a, const float* qp, int qp_stride, int n_q,
                   const uint8_t* recs, int n, float* out, int out_stride) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  for (int i = 0; i < n_q; ++i) {
    const float* q = qp + size_t(i) * size_t(qp_stride);
    const float* sq = q + d;
    for (int t = 0; t < n; ++t) {
      const uint8_t* rec = recs + size_t(t) * size_t(l.record_bytes);
      float s = 0;
      for (int c = 0; c < l.n_hi; ++c) s += q[c] * a.cb_hi[code_at(rec + l.off_hi, l.bits_hi, c)];
      for (int c = l.n_hi; c < d; ++c) s += q[c] * a.cb_lo[code_at(rec + l.off_lo, l.bits_lo, c - l.n_hi)];
      if (l.qjl) {
        const uint8_t* sg = rec + l.off_qjl + 2;
        float z = 0;
        for (int c = 0; c < d; ++c) z += ((sg[c / 8] >> (c % 8)) & 1) ? sq[c] : -sq[c];
        s += f16_to_f32(load_u16(rec + l.off_qjl)) * a.qjl_scale * z;
      }
      out[size_t(i) * size_t(out_stride) + size_t(t)] = f16_to_f32(load_u16(rec)) * s;
    }
  }
}

void accumulate_scalar(const TqKernelArgs& a, const float* p, int p_stride, int n_q,
                       const uint8_t* recs, int n, float* acc) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = recs + size_t(t) * size_t(l.record_bytes);
    const float norm = f16_to_f32(load_u16(rec));
    for (int i = 0; i < n_q; ++i) {
      const float w = p[size_t(i) * size_t(p_stride) + size_t(t)] * norm;
      float* o = acc + size_t(i) * size_t(d);
      for (int c = 0; c < l.n_hi; ++c) o[c] += w * a.cb_hi[code_at(rec + l.off_hi, l.bits_hi, c)];
      for (int c = l.n_hi; c < d; ++c) o[c] += w * a.cb_lo[code_at(rec + l.off_lo, l.bits_lo, c - l.n_hi)];
    }
  }
}

}  // namespace

const TqKernels& tq_kernels_scalar() {
  static const TqKernels k{"scalar", scores_scalar, accumulate_scalar};
  return k;
}

const TqKernels& tq_kernels_for(CpuLevel level) {
#if defined(KVQ_HAVE_SIMD)
  if (level >= CpuLevel::avx512) return tq_kernels_avx512();
  if (level >= CpuLevel::avx2) return tq_kernels_avx2();
#else
  (void)level;
#endif
  return tq_kernels_scalar();
}

}  // namespace kvq
