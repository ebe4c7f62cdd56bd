// The ggml tensor types as numbered in GGUF files, with their block geometry. The table knows
// every type id ggml defines (so a file using one is read and reported by name); which types kvq
// can compute with is decided in src/weights.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>

namespace kvq {

enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

// The 16 levels of IQ4_NL / IQ4_XS codes (ggml's table; also kvq's iq4_nl KV cache type).
inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// The 16 levels of MXFP4 codes: the E2M1 values (sign bit 3; 0, 0.5, 1, 1.5, 2, 3, 4, 6) doubled,
// so they are integers; the block scale is halved to match (e8m0_half_to_f32).
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E8M0 scale byte e (2^(e - 127)) halved, as MXFP4's doubled levels need: 2^(e - 128). e = 0
// and 1 give the subnormals 2^-128 and 2^-127; e = 255 gives 2^127 (no NaN encoding is honoured).
inline float e8m0_half_to_f32(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23;
  return std::bit_cast<float>(bits);
}

struct GgmlTypeTraits {
  const char* name;
  int block_size;      // elements per block
  size_t type_size;    // bytes per block
};

// nullptr for ids ggml does not define (or has retired).
const GgmlTypeTraits* ggml_type_traits(uint32_t type_id);
const char* ggml_type_name(GgmlType t);
// Bytes of a row of n elements (n must be a multiple of the block size; callers check).
size_t ggml_row_bytes(GgmlType t, int64_t n);

}  // namespace kvq
