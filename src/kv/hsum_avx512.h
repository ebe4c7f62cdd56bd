// Horizontal sums of 16 AVX-512 vectors at once, for fused score kernels that finish 16 (token,
// query) dot products per step. Include only from *_avx512.cpp files.
#pragma once
#include <immintrin.h>

namespace kvq {

// The levels after the first: u[j]'s 128-bit lanes 0-1 hold partial sums of the result's input
// 2j, lanes 2-3 of input 2j + 1. Kernels that pack two tokens' 8-lane partials into one vector
// (head_dim 64) enter here directly. Always inlined: a call would pass 16 vectors through memory.
[[gnu::always_inline]] inline __m512 hsum16_from_pairs_avx512(const __m512* u) {
  __m512 w[4];
  for (int j = 0; j < 4; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * j], u[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Result lane 4L + e = sum of the 16 lanes of v[4e + L]: 15 adds and 30 in-register shuffles for
// 16 sums, against 16 x (4 shuffles + 4 adds) one vector at a time.
[[gnu::always_inline]] inline __m512 hsum16_avx512(const __m512* v) {
  __m512 u[8];
  for (int j = 0; j < 8; ++j)
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return hsum16_from_pairs_avx512(u);
}

}  // namespace kvq
