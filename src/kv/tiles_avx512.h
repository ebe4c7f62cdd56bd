// Small AVX-512 helpers of the tiled integer-dot kernels (int4t, kivi4t). Include only from
// *_avx512.cpp files (after core/avx512.h).
#pragma once
#include <cstdint>
#include <cstring>

namespace kvq {

// Four int8 values as one dword, broadcast to every lane (the VPDPBUSD operand).
inline __m512i tile_bcast32_avx512(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Lanes 4h..4h+3 of the result = the largest of the 16 lanes of v[h], h < 4: 6 shuffles and 5
// maxima for four vectors instead of a reduction each.
inline __m512 tile_max4x16_avx512(const __m512* v) {
  const __m512 a = _mm512_max_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 b = _mm512_max_ps(_mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 c = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d = _mm512_max_ps(c, _mm512_permute_ps(c, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_max_ps(d, _mm512_permute_ps(d, _MM_SHUFFLE(2, 3, 0, 1)));
}

}  // namespace kvq
