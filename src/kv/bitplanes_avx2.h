// The codes of 32 channels of a row of bit planes (kv/kivi.h layout: plane j holds bit j, byte b
// of a plane channels 8b..8b+7, bit i channel 8b+i) as 32 bytes, in an order the caller picks.
// Byte p of the result is the code of channel src(p) of the chunk, with rep[p] = src(p) / 8 and
// bit[p] = 1 << (src(p) % 8): each plane's 4 bytes are broadcast, byte src(p) / 8 picked by VPSHUFB
// and bit src(p) % 8 tested, the planes summed by Horner. Shared by the KIVI and KVQuant AVX2
// kernels. Include only from *_avx2.cpp files.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvq {

// Planes `pb` bytes apart; the chunk's channels start at byte byte0 of each plane.
template <int Bits>
inline __m256i bitplane_codes32_avx2(const uint8_t* planes, int pb, int byte0, __m256i rep, __m256i bit) {
  __m256i codes = _mm256_setzero_si256();
  for (int j = Bits - 1; j >= 0; --j) {  // Horner over the planes: codes = 2 codes + bit j
    int32_t w;
    std::memcpy(&w, planes + j * pb + byte0, 4);
    const __m256i x = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(w), rep), bit);
    codes = _mm256_sub_epi8(_mm256_add_epi8(codes, codes), _mm256_cmpeq_epi8(x, bit));
  }
  return codes;
}

// rep and bit of the channels in order (byte p = channel p).
inline __m256i bitplane_rep_identity_avx2() {
  return _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3,
                          3);
}
inline __m256i bitplane_bit_identity_avx2() {
  return _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128, 1,
                          2, 4, 8, 16, 32, 64, -128);
}

}  // namespace kvq
