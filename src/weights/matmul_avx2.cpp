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
#define KVQ_INTERLEAVE_MIN_TOKENS 8
#include "weights/matmul_x86.inl"

#include "weights/weights.h"

namespace kvq {

MatmulTileFn matmul_kernel_avx2(GgmlType t) { return x86_avx2::kernel_for(t); }

namespace {

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32 floats -> 32 int8 codes (x * id rounded to nearest even); returns their sum.
inline int quant32(const float* x, __m256 id, int8_t* q) {
  __m256i v[4];
  for (int k = 0; k < 4; ++k)
    v[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), id),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
  // packs interleave 128-bit lanes; the dword permute restores element order
  const __m256i p16a = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
}

inline __m256 abs_max(const float* x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  return m;
}

}  // namespace

void quantize_act_q8a_avx2(const float* x, BlockQ8A* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    const float amax = hmax(abs_max(x, kQK));
    const float d = act_scale(amax);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[b].sum = quant32(x, _mm256_set1_ps(id), y[b].qs);
    y[b].ds = d * float(y[b].sum);
    y[b].d = d;
  }
}

void quantize_act_q8k_avx2(const float* x, BlockQ8K* y, int64_t n) {
  for (int64_t b = 0; b < n / kQKK; ++b, x += kQKK) {
    const float amax = hmax(abs_max(x, kQKK));
    const float d = act_scale(amax);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    for (int g = 0; g < 8; ++g) quant32(x + 32 * g, idv, y[b].qs + 32 * g);
    for (int g = 0; g < 16; ++g) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(y[b].qs + 16 * g));
      const __m256i w = _mm256_madd_epi16(_mm256_cvtepi8_epi16(q), _mm256_set1_epi16(1));
      __m128i h = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
      h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
      h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
      y[b].bsum16[g] = int16_t(_mm_cvtsi128_si32(h));
    }
    for (int g = 0; g < 8; ++g) y[b].bsum32[g] = int16_t(y[b].bsum16[2 * g] + y[b].bsum16[2 * g + 1]);
    y[b].d = d;
    y[b].pad[0] = y[b].pad[1] = y[b].pad[2] = 0;
  }
}

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
