// One struct per ggml block type, laid out byte for byte as in GGUF files (the format is fixed by
// the files kvq reads, so every size is asserted). Weight blocks are read in place from the mmap.
// Also the 8-bit activation blocks kvq quantizes x into before integer dot products.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/dtypes.h"
#include "gguf/ggml_types.h"

namespace kvq {

constexpr int kQK = 32;    // elements per block of the 32-element types
constexpr int kQKK = 256;  // elements per K-quant super-block

// w = d * (q - 8), q a nibble; element i in the low nibble of qs[i], element i+16 in the high.
struct BlockQ4_0 {
  f16_t d;
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ4_0) == 18);

// w = d * q + m: an offset per block instead of a symmetric code, same nibble order as Q4_0.
struct BlockQ4_1 {
  f16_t d;
  f16_t m;
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ4_1) == 20);

// w = d * (q - 16), q 5 bits: low 4 bits as in Q4_0, bit 4 of element i is bit i of qh.
struct BlockQ5_0 {
  f16_t d;
  uint8_t qh[4];  // a little-endian uint32; bytes, because the block is only 2-byte aligned
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ5_0) == 22);

// w = d * q + m, q 5 bits as in Q5_0.
struct BlockQ5_1 {
  f16_t d;
  f16_t m;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ5_1) == 24);

// w = d * q, q signed 8 bits.
struct BlockQ8_0 {
  f16_t d;
  int8_t qs[kQK];
};
static_assert(sizeof(BlockQ8_0) == 34);

// 8 sub-blocks of 32: w = d * sc[j] * q - dmin * m[j], with 6-bit sc/m packed in 12 bytes
// (bytes 0-3: sc[0..3] low 6 bits, top 2 bits = sc[4..7] bits 4-5; bytes 4-7: m[0..3] likewise
// for m[4..7]; bytes 8-11: low nibble sc[4+i] bits 0-3, high nibble m[4+i] bits 0-3).
// qs: 4 chunks of 32 bytes, chunk c holds sub-block 2c in low nibbles and 2c+1 in high nibbles.
struct BlockQ4_K {
  f16_t d;
  f16_t dmin;
  uint8_t scales[12];
  uint8_t qs[kQKK / 2];
};
static_assert(sizeof(BlockQ4_K) == 144);

// Q4_K plus a fifth bit: bit 4 of element i of sub-block j is bit j of qh[i].
struct BlockQ5_K {
  f16_t d;
  f16_t dmin;
  uint8_t scales[12];
  uint8_t qh[kQKK / 8];
  uint8_t qs[kQKK / 2];
};
static_assert(sizeof(BlockQ5_K) == 176);

// 16 sub-blocks of 16: w = d * sc[j] * (q - 32), q 6 bits. Per half h (128 elements):
// element e < 64 low nibble of ql[64h + e], e >= 64 high nibble of ql[64h + e - 64];
// bits 4-5 of element 32k + l are bits 2k, 2k+1 of qh[32h + l].
struct BlockQ6_K {
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  f16_t d;
};
static_assert(sizeof(BlockQ6_K) == 210);

// 16 sub-blocks of 16: w = d * (sc[j] & 15) * q - dmin * (sc[j] >> 4), q 2 bits. Per half h (128
// elements): element 32k + l (k < 4, l < 32) is bits 2k, 2k+1 of qs[32h + l], sub-block 8h + 2k + l / 16.
struct BlockQ2_K {
  uint8_t scales[kQKK / 16];  // low nibble scale, high nibble min
  uint8_t qs[kQKK / 4];
  f16_t d;
  f16_t dmin;
};
static_assert(sizeof(BlockQ2_K) == 84);

// 16 sub-blocks of 16: w = d * (sc[j] - 32) * (q - 4 * !hbit), q 2 bits laid out as Q2_K's; the
// high bit of element 32k + l of half h is bit 4h + k of hmask[l]; 16 6-bit scales packed in 12
// bytes (bytes 0-7: low nibbles of scales 0-7 and, in the high nibbles, of 8-15; bytes 8-11: the
// top 2 bits, scale j at bits 2 * (j / 4) of byte 8 + j % 4).
struct BlockQ3_K {
  uint8_t hmask[kQKK / 8];
  uint8_t qs[kQKK / 4];
  uint8_t scales[12];
  f16_t d;
};
static_assert(sizeof(BlockQ3_K) == 110);

// Non-linear 4-bit codes: w = d * kIq4nlValues[q], nibbles in Q4_0's order.
struct BlockIQ4_NL {
  f16_t d;
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockIQ4_NL) == 18);

// OCP microscaling FP4: w = e8m0_half_to_f32(e) * kMxfp4Values[q], nibbles in Q4_0's order. No
// fp16 field: 17 bytes, so consecutive blocks sit at any byte alignment.
struct BlockMXFP4 {
  uint8_t e;
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockMXFP4) == 17);

// 8 sub-blocks of 32 with IQ4_NL's codes: w = d * (ls[j] - 32) * kIq4nlValues[q], ls 6 bits (low
// nibble j % 2 of scales_l[j / 2], top 2 bits at bit 2j of scales_h); sub-block j's 16 bytes of qs
// hold its elements 0..15 in low nibbles and 16..31 in high.
struct BlockIQ4_XS {
  f16_t d;
  uint16_t scales_h;
  uint8_t scales_l[kQKK / 64];
  uint8_t qs[kQKK / 2];
};
static_assert(sizeof(BlockIQ4_XS) == 136);

// IQ4_XS's 6-bit scale of sub-block j, minus 32.
inline int iq4xs_scale(const BlockIQ4_XS& b, int j) {
  return (((b.scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((b.scales_h >> (2 * j)) & 3) << 4)) - 32;
}

// Unpacks Q3_K's 16 6-bit scales (minus 32) into sc.
inline void q3k_scales(const uint8_t* s, int8_t* sc) {
  for (int j = 0; j < 16; ++j) {
    const int lo = j < 8 ? (s[j] & 0xF) : (s[j - 8] >> 4);
    const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    sc[j] = int8_t((lo | (hi << 4)) - 32);
  }
}

// ---- activation blocks (kvq-internal, built per matmul call) ----

// x ~= d * qs for 32 elements; sum = sum(qs) lets offset-coded weights (Q4_1, Q5_1: + m) and
// unsigned codes (Q4_0: q - 8) be corrected once per block instead of per element; ds = d * float(sum)
// (the min term's factor, formed once per activation block instead of once per weight row).
struct BlockQ8A {
  int8_t qs[kQK];
  float d;
  int32_t sum;
  float ds;
};
static_assert(sizeof(BlockQ8A) == 44);

// x ~= d * qs for 256 elements, with the sums of qs per 16 (Q6_K's -32 offset per 16-sub-block)
// and per 32 (Q4_K/Q5_K mins per 32-sub-block). 320 bytes so qs stays 64-byte aligned.
struct BlockQ8K {
  int8_t qs[kQKK];
  int16_t bsum16[16];
  int16_t bsum32[8];
  float d;
  float pad[3];
};
static_assert(sizeof(BlockQ8K) == 320);

// Unpacks the 6-bit scale j and min j of a Q4_K/Q5_K block.
inline void k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = uint8_t((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    *m = uint8_t((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

}  // namespace kvq
