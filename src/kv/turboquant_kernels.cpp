// TurboQuant kernels: scalar reference and the one dispatch point for the SIMD variants.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtypes.h"
#include "kv/turboquant.h"

namespace kvq {

namespace {

constexpr int kMaxDim = 1024;

inline uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
inline void store_u16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}

// Code of channel c (within its segment) from the segment's bit stream of `bits`-bit codes.
inline int code_at(const uint8_t* seg, int bits, int c) {
  const int bit = bits * c;
  unsigned v = seg[bit / 8];
  if (bit % 8 + bits > 8) v |= unsigned(seg[bit / 8 + 1]) << 8;
  return int((v >> (bit % 8)) & ((1u << bits) - 1));
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

// Index of the cell of y: the number of thresholds below it (bounds ascending, +inf padded).
inline uint8_t quantize(float y, const float* bounds) {
  int k = 0;
  for (int j = 0; j < 15; ++j) k += bounds[j] < y;
  return uint8_t(k);
}

void encode_scalar(const TqEncodeArgs& a, const float* x, uint8_t* rec) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  std::memset(rec, 0, size_t(l.record_bytes));
  const double nrm = std::sqrt(tq_dot_ref(x, x, d));
  if (!std::isfinite(nrm)) {  // inf / nan input: keep it visible in the norm, codes zero
    store_u16(rec, f32_to_f16(float(nrm)));
    return;
  }
  if (nrm == 0) return;
  // Norms past the fp16 range saturate at 65504 (no finite K/V of an fp16/bf16 model gets
  // there in practice); norms below 2^-14 lose relative precision as fp16 subnormals.
  store_u16(rec, f32_to_f16(float(std::min(nrm, 65504.0))));
  float u[kMaxDim];
  for (int c = 0; c < d; ++c) u[c] = float(double(x[c]) / nrm);
  if (a.rotation == TqRotationKind::hadamard) {
    const float s = 1.f / std::sqrt(float(d));
    for (int c = 0; c < d; ++c) u[c] *= a.signs[c];
    tq_fwht(u, d);
    for (int c = 0; c < d; ++c) u[c] *= s;
  } else {
    float y[kMaxDim];
    for (int r = 0; r < d; ++r) y[r] = float(tq_dot_ref(a.matrix + size_t(r) * size_t(d), u, d));
    std::memcpy(u, y, sizeof(float) * size_t(d));
  }
  uint8_t codes[kMaxDim];
  for (int c = 0; c < l.n_hi; ++c) codes[c] = quantize(u[c], a.bounds_hi);
  for (int c = l.n_hi; c < d; ++c) codes[c] = quantize(u[c], a.bounds_lo);
  tq_pack_codes(codes, l.n_hi, l.bits_hi, rec + l.off_hi);
  if (l.n_hi < d) tq_pack_codes(codes + l.n_hi, d - l.n_hi, l.bits_lo, rec + l.off_lo);
  if (!l.qjl) return;
  float r[kMaxDim];
  for (int c = 0; c < d; ++c) r[c] = u[c] - (c < l.n_hi ? a.cb_hi[codes[c]] : a.cb_lo[codes[c]]);
  store_u16(rec + l.off_qjl, f32_to_f16(float(std::sqrt(tq_dot_ref(r, r, d)))));
  uint8_t* sg = rec + l.off_qjl + 2;
  for (int j = 0; j < d; ++j)
    if (tq_dot_ref(a.qjl + size_t(j) * size_t(d), r, d) >= 0) sg[j / 8] = uint8_t(sg[j / 8] | (1u << (j % 8)));
}

}  // namespace

double tq_dot_ref(const float* a, const float* b, int n) {
  double lane[8] = {};
  for (int c = 0; c < n; c += 8)
    for (int j = 0; j < 8; ++j) lane[j] += double(a[c + j]) * double(b[c + j]);
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

const TqKernels& tq_kernels_scalar() {
  static const TqKernels k{"scalar", scores_scalar, accumulate_scalar, encode_scalar};
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
