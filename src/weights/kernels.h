// Internal to src/weights: the per-ISA matmul tile kernels behind matmul(), and the activation
// formats they read. One signature for every type and level, so parity tests are one call.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>

#include "gguf/ggml_types.h"
#include "weights/blocks.h"

namespace kvq {

// What x is converted to before the dot products with a weight type.
enum class ActFormat { f32, q8a, q8k };
constexpr ActFormat act_format(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1:
    case GgmlType::Q8_0: case GgmlType::IQ4_NL: case GgmlType::MXFP4:
      return ActFormat::q8a;
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K:
    case GgmlType::IQ4_XS:
      return ActFormat::q8k;
    default:
      return ActFormat::f32;
  }
}
// Bytes of one converted activation row of n_in elements.
size_t act_row_bytes(ActFormat f, int64_t n_in);

// The scale of an activation block whose largest |x| is amax: amax / 127, or 0 when its inverse
// would overflow to infinity (d < 1 / FLT_MAX: such a block, |x| < 3.8e-37, quantizes to zeros
// instead of to codes out of range).
inline float act_scale(float amax) {
  const float d = amax / 127.0f;
  return d >= 1.0f / std::numeric_limits<float>::max() ? d : 0.0f;
}

// Activation quantizers (scalar; exact same output at every CPU level).
// x: (n) -> y: (n / 32) blocks, d = amax / 127, qs = round(x / d).
void quantize_act_q8a(const float* x, BlockQ8A* y, int64_t n);
// x: (n) -> y: (n / 256) blocks.
void quantize_act_q8k(const float* x, BlockQ8K* y, int64_t n);

// y[t * ldy + r] = dot(row r of w, activation row t), r < nr, t < nt.
// w: (nr, w_stride bytes) weight rows in their GGUF type; x: (nt, x_stride bytes) activation
// rows in act_format(type) (float for F32/F16/BF16); y: (nt, ldy) floats.
using MatmulTileFn = void (*)(const uint8_t* w, size_t w_stride, int64_t nr, const uint8_t* x,
                              size_t x_stride, int64_t nt, int64_t n_in, float* y, int64_t ldy);

// nullptr where a level has no kernel for a type.
MatmulTileFn matmul_kernel_scalar(GgmlType t);
MatmulTileFn matmul_kernel_avx2(GgmlType t);
MatmulTileFn matmul_kernel_avx512(GgmlType t);
// The AVX-512 kernels without the prefill panels: every call runs what a one-token call runs.
MatmulTileFn matmul_kernel_avx512_streaming(GgmlType t);
// The kernel for cpu_level() (falls back level by level); matmul_batch_invariant(): the one whose
// per-token results do not depend on the call's token count.
MatmulTileFn matmul_kernel(GgmlType t);

// Rows per tile of the SIMD kernels: chunks of rows handed to threads are multiples of this
// (the AVX-512 prefill tiles hold two 16-row panels; the smaller streaming tiles divide it).
constexpr int kTileRows = 32;

// AVX2 versions of the activation quantizers: the same operations in the same order (max of |x|,
// one division, multiply, round to nearest even), so their output is bit-identical.
void quantize_act_q8a_avx2(const float* x, BlockQ8A* y, int64_t n);
void quantize_act_q8k_avx2(const float* x, BlockQ8K* y, int64_t n);

void dequantize_row_f16_avx2(GgmlType t, const void* src, float* dst, int64_t n);

}  // namespace kvq
