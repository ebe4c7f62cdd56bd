// Reference dequantization of every supported weight type. The arithmetic order (d * sc first,
// then * q, then - dmin * m) is the one the format's own reference uses, so results agree bit for
// bit with independent implementations (tests/golden).
#include <cstring>

#include "core/cpu.h"
#include "core/error.h"
#include "weights/blocks.h"
#include "weights/kernels.h"
#include "weights/weights.h"

namespace kvq {

bool weight_type_supported(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0:
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1:
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K:
    case GgmlType::IQ4_NL: case GgmlType::IQ4_XS: case GgmlType::MXFP4:
      return true;
    default:
      return false;
  }
}

namespace {

void deq_q4_0(const BlockQ4_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * float(int(b[i].qs[j] & 0xF) - 8);
      y[j + 16] = d * float(int(b[i].qs[j] >> 4) - 8);
    }
  }
}

void deq_q4_1(const BlockQ4_1* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * float(b[i].qs[j] & 0xF) + m;
      y[j + 16] = d * float(b[i].qs[j] >> 4) + m;
    }
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void deq_q5_0(const BlockQ5_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = f16_to_f32(b[i].d);
    const uint32_t qh = load_u32(b[i].qh);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (b[i].qs[j] & 0xF) | int(((qh >> j) & 1) << 4);
      const int hi = (b[i].qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
      y[j] = d * float(lo - 16);
      y[j + 16] = d * float(hi - 16);
    }
  }
}

void deq_q5_1(const BlockQ5_1* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
    const uint32_t qh = load_u32(b[i].qh);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (b[i].qs[j] & 0xF) | int(((qh >> j) & 1) << 4);
      const int hi = (b[i].qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
      y[j] = d * float(lo) + m;
      y[j + 16] = d * float(hi) + m;
    }
  }
}

void deq_q8_0(const BlockQ8_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < kQK; ++j) y[j] = float(b[i].qs[j]) * d;
  }
}

void deq_q2_k(const BlockQ2_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = f16_to_f32(b[i].d), dmin = f16_to_f32(b[i].dmin);
    for (int e = 0; e < kQKK; ++e) {
      const int h = e / 128, k = (e % 128) / 32, l = e % 32;
      const uint8_t sc = b[i].scales[8 * h + 2 * k + l / 16];
      const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
      y[e] = dl * float((b[i].qs[32 * h + l] >> (2 * k)) & 3) - ml;
    }
  }
}

void deq_q3_k(const BlockQ3_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = f16_to_f32(b[i].d);
    int8_t sc[16];
    q3k_scales(b[i].scales, sc);
    for (int e = 0; e < kQKK; ++e) {
      const int h = e / 128, k = (e % 128) / 32, l = e % 32;
      const int q = ((b[i].qs[32 * h + l] >> (2 * k)) & 3) - (((b[i].hmask[l] >> (4 * h + k)) & 1) ? 0 : 4);
      const float dl = d * float(sc[8 * h + 2 * k + l / 16]);
      y[e] = dl * float(q);
    }
  }
}

void deq_iq4_nl(const BlockIQ4_NL* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * float(kIq4nlValues[b[i].qs[j] & 0xF]);
      y[j + 16] = d * float(kIq4nlValues[b[i].qs[j] >> 4]);
    }
  }
}

void deq_mxfp4(const BlockMXFP4* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = e8m0_half_to_f32(b[i].e);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = float(kMxfp4Values[b[i].qs[j] & 0xF]) * d;
      y[j + 16] = float(kMxfp4Values[b[i].qs[j] >> 4]) * d;
    }
  }
}

void deq_iq4_xs(const BlockIQ4_XS* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * float(iq4xs_scale(b[i], j));
      const uint8_t* q = b[i].qs + 16 * j;
      for (int l = 0; l < 16; ++l) {
        y[32 * j + l] = dl * float(kIq4nlValues[q[l] & 0xF]);
        y[32 * j + l + 16] = dl * float(kIq4nlValues[q[l] >> 4]);
      }
    }
  }
}

void deq_q4_k(const BlockQ4_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = f16_to_f32(b[i].d), dmin = f16_to_f32(b[i].dmin);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      k_scale_min(b[i].scales, j, &sc, &m);
      const float ds = d * float(sc), dm = dmin * float(m);
      const uint8_t* q = b[i].qs + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int l = 0; l < 32; ++l) y[32 * j + l] = ds * float((q[l] >> shift) & 0xF) - dm;
    }
  }
}

void deq_q5_k(const BlockQ5_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = f16_to_f32(b[i].d), dmin = f16_to_f32(b[i].dmin);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      k_scale_min(b[i].scales, j, &sc, &m);
      const float ds = d * float(sc), dm = dmin * float(m);
      const uint8_t* q = b[i].qs + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> shift) & 0xF) | (((b[i].qh[l] >> j) & 1) << 4);
        y[32 * j + l] = ds * float(v) - dm;
      }
    }
  }
}

void deq_q6_k(const BlockQ6_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQKK) {
    const float d = f16_to_f32(b[i].d);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b[i].ql + 64 * h;
      const uint8_t* qh = b[i].qh + 32 * h;
      for (int e = 0; e < 128; ++e) {
        const int lo = e < 64 ? (ql[e] & 0xF) : (ql[e - 64] >> 4);
        const int hi = (qh[e % 32] >> (2 * (e / 32))) & 3;
        const int q = (lo | (hi << 4)) - 32;
        const float ds = d * float(b[i].scales[8 * h + e / 16]);
        y[128 * h + e] = ds * float(q);
      }
    }
  }
}

}  // namespace

void dequantize_row_ref(GgmlType t, const void* src, float* dst, int64_t n) {
  const auto* tr = ggml_type_traits(uint32_t(t));
  KVQ_CHECK(tr && weight_type_supported(t), "type {}", uint32_t(t));
  KVQ_CHECK(n % tr->block_size == 0, "n={} not a multiple of {}", n, tr->block_size);
  const int64_t nb = n / tr->block_size;
  switch (t) {
    case GgmlType::F32: std::memcpy(dst, src, size_t(n) * 4); break;
    case GgmlType::F16: {
      const auto* s = static_cast<const f16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      break;
    }
    case GgmlType::BF16: {
      const auto* s = static_cast<const bf16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      break;
    }
    case GgmlType::Q4_0: deq_q4_0(static_cast<const BlockQ4_0*>(src), dst, nb); break;
    case GgmlType::Q4_1: deq_q4_1(static_cast<const BlockQ4_1*>(src), dst, nb); break;
    case GgmlType::Q5_0: deq_q5_0(static_cast<const BlockQ5_0*>(src), dst, nb); break;
    case GgmlType::Q5_1: deq_q5_1(static_cast<const BlockQ5_1*>(src), dst, nb); break;
    case GgmlType::Q8_0: deq_q8_0(static_cast<const BlockQ8_0*>(src), dst, nb); break;
    case GgmlType::Q2_K: deq_q2_k(static_cast<const BlockQ2_K*>(src), dst, nb); break;
    case GgmlType::Q3_K: deq_q3_k(static_cast<const BlockQ3_K*>(src), dst, nb); break;
    case GgmlType::IQ4_NL: deq_iq4_nl(static_cast<const BlockIQ4_NL*>(src), dst, nb); break;
    case GgmlType::IQ4_XS: deq_iq4_xs(static_cast<const BlockIQ4_XS*>(src), dst, nb); break;
    case GgmlType::MXFP4: deq_mxfp4(static_cast<const BlockMXFP4*>(src), dst, nb); break;
    case GgmlType::Q4_K: deq_q4_k(static_cast<const BlockQ4_K*>(src), dst, nb); break;
    case GgmlType::Q5_K: deq_q5_k(static_cast<const BlockQ5_K*>(src), dst, nb); break;
    case GgmlType::Q6_K: deq_q6_k(static_cast<const BlockQ6_K*>(src), dst, nb); break;
    default: KVQ_CHECK(false, "unreachable");
  }
}

void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n) {
#if defined(KVQ_HAVE_SIMD)
  // Only the 16-bit float types have a faster path worth a kernel (F16C / shifts); the quantized
  // types' reference loops are already vectorized by the compiler and are used for embeddings.
  if (cpu_level() >= CpuLevel::avx2 && (t == GgmlType::F16 || t == GgmlType::BF16)) {
    dequantize_row_f16_avx2(t, src, dst, n);
    return;
  }
#endif
  dequantize_row_ref(t, src, dst, n);
}

}  // namespace kvq
