// AVX2 + FMA + F16C level of the weight kernels (integer dots via maddubs + madd).
#define KVQ_X86_NS x86_avx2
#define KVQ_X86_VNNI 0
// 16 ymm registers: tiles sized so accumulators + unpacked weights stay in registers
#define KVQ_NR_32 4
#define KVQ_NT_32 2
#define KVQ_NR_K 2
#define KVQ_NT_K 2
#define KVQ_NR_F 4
#define KVQ_NT_F 2
#include "weights/matmul_x86.inl"

#include "weights/weights.h"

namespace kvq {

MatmulTileFn matmul_kernel_avx2(GgmlType t) { return x86_avx2::kernel_for(t); }

void dequantize_row_f16_avx2(GgmlType t, const void* src, float* dst, int64_t n) {
  const auto* s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  if (t == GgmlType::F16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(s[i]);
  } else {
    for (; i + 8 <= n; i += 8) {
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(v, 16));
    }
    for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  }
}

}  // namespace kvq
