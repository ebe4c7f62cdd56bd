// Horizontal sums of 16 AVX-512 vectors at once, for fused score kernels that finish 16 (token,
// query) dot products per step. Include only from *_avx512.cpp files.
#pragma once
#include <immintrin.h>

namespace kvq {

// The 16-vector reduction tree with a combining operation op(a, b) (add: horizontal sums; max:
// horizontal maxima), always inlined: a call would pass 16 vectors through memory.
// The levels after the first: u[j]'s 128-bit lanes 0-1 hold partial results of the input 2j,
// lanes 2-3 of input 2j + 1.
template <class Op>
[[gnu::always_inline]] inline __m512 tree16_from_pairs_avx512(const __m512* u, Op op) {
  __m512 w[4];
  for (int j = 0; j < 4; ++j)
    w[j] = op(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y0 = op(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = op(_mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return op(_mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}
// Result lane 4L + e = op over the 16 lanes of v[4e + L]: 15 ops and 30 in-register shuffles for
// 16 results, against 16 x (4 shuffles + 4 ops) one vector at a time.
template <class Op>
[[gnu::always_inline]] inline __m512 tree16_avx512(const __m512* v, Op op) {
  __m512 u[8];
  for (int j = 0; j < 8; ++j)
    u[j] = op(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return tree16_from_pairs_avx512(u, op);
}
inline constexpr auto kv_add16 = [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); };
inline constexpr auto kv_max16 = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };

// Horizontal sums. Kernels that pack two tokens' 8-lane partials into one vector (head_dim 64)
// enter at the pairs' level directly.
[[gnu::always_inline]] inline __m512 hsum16_from_pairs_avx512(const __m512* u) {
  return tree16_from_pairs_avx512(u, kv_add16);
}
[[gnu::always_inline]] inline __m512 hsum16_avx512(const __m512* v) { return tree16_avx512(v, kv_add16); }

}  // namespace kvq
