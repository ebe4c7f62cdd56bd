// AVX-512 row kernels: 16 elements per step, decoded in registers.
#include "core/avx512.h"

#include <cstring>

#include "kv/hsum_avx512.h"
#include "kv/kv_rows_simd.h"

namespace kvq {
namespace {

inline float ld_f32(const uint8_t* p) { float v; std::memcpy(&v, p, 4); return v; }
// F16C: the scalar software conversion would dominate the per-chunk cost of the f16-scaled formats.
inline float ld_f16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return _cvtsh_ss(v); }

struct Avx512 {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static constexpr int acc_regs = 16;
  // Lane j = sum of v[j]: hsum16_avx512 returns lane 4L + e = sum of its input 4e + L, so the
  // input is handed over transposed.
  static V hsum_w(const V* v) {
    V t[16];
    for (int k = 0; k < 16; ++k) t[k] = v[4 * (k % 4) + k / 4];
    return hsum16_avx512(t);
  }

  // 16 E4M3 codes -> f32 times 2^-8 (kv_rows_simd.h applies the 256 * scale per token). The
  // sign-extended byte shifted left by 7 holds the 7 magnitude bits at 7..13 and the sign at 14
  // and 15: with bit 14 cleared it is the f16 with the same exponent and mantissa fields, whose
  // value is the E4M3 value times 2^-8 (biases 15 vs 7), subnormals included. The NaN codes
  // (0x7f, 0xff) would decode to 480 and are patched.
  static V e4m3_16_raw(const uint8_t* c) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(int16_t(0xbfff)));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x3f80)), _mm256_set1_epi16(0x3f80));
    return _mm512_mask_blend_ps(nan, _mm512_cvtph_ps(h), _mm512_set1_ps(__builtin_nanf("")));
  }
  // E5M2 is the high byte of an f16: exact, inf and NaN included.
  static V e5m2_16_raw(const uint8_t* c) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
  }
  static V e4m3_16(const uint8_t* c, float mul) { return _mm512_mul_ps(e4m3_16_raw(c), _mm512_set1_ps(256.f * mul)); }
  static V e5m2_16(const uint8_t* c, float mul) { return _mm512_mul_ps(e5m2_16_raw(c), _mm512_set1_ps(mul)); }
  // The fp8 rows' codes unscaled (kv_rows_simd.h: kv_token_scaled).
  template <KvElem E>
  static V dec_raw(const uint8_t* c) {
    if constexpr (E == KvElem::e4m3 || E == KvElem::e4m3_dyn) return e4m3_16_raw(c);
    else return e5m2_16_raw(c);
  }
  static constexpr bool pair_decode = false;  // one vector's 16 codes are already one widening
  static V i8_16(const uint8_t* c, float mul) {
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_set1_ps(mul));
  }
  // 16 nibbles of a 32-element unit: half 0 = low nibbles of bytes 0..15, half 1 = high nibbles.
  static __m512i nib_16(const uint8_t* unit, int half) {
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit)));
    return _mm512_and_si512(_mm512_srli_epi32(w, unsigned(half * 4)), _mm512_set1_epi32(15));
  }
  // 16 2-bit codes of a 32-element unit (8 bytes): elements 16h..16h+15 are bytes 0..7 at
  // shifts 4h and 4h + 2.
  static __m512i crumb_16(const uint8_t* unit, int half) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit));
    const __m512i w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b, b));
    const __m512i sh = _mm512_add_epi32(
        _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_set1_epi32(4 * half));
    return _mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(3));
  }

  template <KvElem E>
  static V dec(const KvRowFmt& f, float scale, const uint8_t* row, int e) {
    if constexpr (E == KvElem::f32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + e);
    } else if constexpr (E == KvElem::f16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * e)));
    } else if constexpr (E == KvElem::bf16) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * e)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    } else if constexpr (E == KvElem::e4m3) {
      return e4m3_16(row + e, scale);
    } else if constexpr (E == KvElem::e5m2) {
      return e5m2_16(row + e, scale);
    } else if constexpr (E == KvElem::e4m3_dyn) {
      return e4m3_16(row + sizeof(KvRowScaled) + e, ld_f32(row));
    } else if constexpr (E == KvElem::e5m2_dyn) {
      return e5m2_16(row + sizeof(KvRowScaled) + e, ld_f32(row));
    } else if constexpr (E == KvElem::int8) {
      return i8_16(row + sizeof(KvRowScaled) + e, ld_f32(row));
    } else if constexpr (E == KvElem::int8_static) {
      return i8_16(row + e, scale);
    } else if constexpr (E == KvElem::int4g || E == KvElem::int2g) {
      const uint8_t* gp = row + sizeof(KvGroupParams) * size_t(e / f.group);
      const uint8_t* codes = row + sizeof(KvGroupParams) * size_t(f.head_dim / f.group);
      const __m512i c = E == KvElem::int4g ? nib_16(codes + (e / 32) * kv_unit_int4_bytes, (e % 32) / 16)
                                           : crumb_16(codes + (e / 32) * kv_unit_int2_bytes, (e % 32) / 16);
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(ld_f16(gp)), _mm512_set1_ps(ld_f16(gp + 2)));
    } else if constexpr (E == KvElem::q8_0) {
      const uint8_t* b = row + sizeof(kv_block_q8_0) * size_t(e / 32);
      return i8_16(b + 2 + (e % 32), ld_f16(b));
    } else {
      static_assert(E == KvElem::q4_0);
      const uint8_t* b = row + sizeof(kv_block_q4_0) * size_t(e / 32);
      const float d = ld_f16(b);
      const __m512i c = nib_16(b + 2, (e % 32) / 16);
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(d), _mm512_set1_ps(-8.f * d));
    }
  }
};

}  // namespace

void kv_rows_scores_avx512(const KvRowFmt& f, float scale, const float* q, int n_q,
                           const uint8_t* rows, size_t row_stride, int n, float* out,
                           int out_stride) {
  if (kv_elem_ggml_ext(f.elem)) return kv_rows_scores_avx2(f, scale, q, n_q, rows, row_stride, n, out, out_stride);
  if (kv_rows_bf16_dot_active(f))
    return kv_rows_scores_bf16_avx512(f, scale, q, n_q, rows, row_stride, n, out, out_stride);
  kv_rows_simd::scores<Avx512>(f, scale, q, n_q, rows, row_stride, n, out, out_stride);
}

void kv_rows_accum_avx512(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                          const uint8_t* rows, size_t row_stride, int n, float* acc) {
  if (kv_elem_ggml_ext(f.elem)) return kv_rows_accum_avx2(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);
  if (f.elem == KvElem::q4_0 || f.elem == KvElem::int4g || f.elem == KvElem::int2g)
    return kv_rows_accum_4bit_avx512(f, p, p_stride, n_q, rows, row_stride, n, acc);
  if (kv_rows_bf16_dot_active(f))
    return kv_rows_accum_bf16_avx512(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);
  kv_rows_simd::accum<Avx512>(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);
}

}  // namespace kvq
