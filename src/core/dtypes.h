// Scalar conversions between f32 and the 16-bit float formats. Bit-exact, round-to-nearest-even;
// the SIMD kernels use F16C/AVX-512 BF16 instructions that agree with these.
#pragma once
#include <cstdint>
#include <cstring>

namespace kvq {

using f16_t = uint16_t;   // IEEE 754 binary16 bits
using bf16_t = uint16_t;  // bfloat16 bits

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float f16_to_f32(f16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  if (exp == 0) {
    // zero or subnormal: value = man * 2^-24
    float v = float(man) * 5.9604644775390625e-8f;
    return f32_from_bits(f32_bits(v) | sign);
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));  // inf / nan
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

inline f16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return f16_t(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));  // inf/nan
  if (ax >= 0x477ff000u) return f16_t(sign | 0x7c00);  // rounds to >= 65520: overflow to inf
  if (ax < 0x38800000u) {
    // result is subnormal or zero: add 0.5 (as float) to align the mantissa so that the FPU
    // performs the round-to-nearest-even at the 2^-24 position.
    float v = f32_from_bits(ax) + 0.5f;
    return f16_t(sign | (f32_bits(v) - 0x3f000000u));
  }
  uint32_t mant_odd = (ax >> 13) & 1;
  uint32_t r = ax + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round half to even
  return f16_t(sign | (r >> 13));
}

inline float bf16_to_f32(bf16_t h) { return f32_from_bits(uint32_t(h) << 16); }

inline bf16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16_t((x >> 16) | 0x40);  // quiet nan
  x += 0x7fff + ((x >> 16) & 1);
  return bf16_t(x >> 16);
}

}  // namespace kvq
