// FP8 (OCP 8-bit floating point) conversions, bit-exact, round-to-nearest-even.
//  E4M3 (fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; max 448; no infinities; the only
//             NaN codes are 0x7f / 0xff. Encoding saturates: finite values and +-inf beyond the
//             range become +-448 (what KV caches want: an overflow must not poison attention).
//  E5M2:      sign, 5 exponent bits (bias 15), 2 mantissa bits; max 57344; IEEE-style inf
//             (0x7c) and NaN (0x7d..0x7f). Encoding saturates finite values to +-57344
//             ("satfinite"); +-inf stays inf; NaN stays NaN.
#pragma once
#include <cstdint>

namespace kvq {

uint8_t fp8_e4m3_from_f32(float x);
uint8_t fp8_e5m2_from_f32(float x);
// Decoding through 256-entry tables (exact).
float fp8_e4m3_to_f32(uint8_t c);
float fp8_e5m2_to_f32(uint8_t c);
const float* fp8_e4m3_table();  // [256]
const float* fp8_e5m2_table();  // [256]

// out[i] = fp8_*_from_f32(x[i] / scale) for i < n, 16 at a time (fp8_avx512.cpp); the same codes
// as the scalar conversion for every input. Callers dispatch on cpu_level().
#if defined(KVQ_HAVE_SIMD)
void fp8_e4m3_encode_avx512(const float* x, int n, float scale, uint8_t* out);
void fp8_e5m2_encode_avx512(const float* x, int n, float scale, uint8_t* out);
#endif

inline constexpr float fp8_e4m3_max = 448.f;
inline constexpr float fp8_e5m2_max = 57344.f;

}  // namespace kvq
