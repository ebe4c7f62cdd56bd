// AVX2 row kernels: 8 elements per step, decoded in registers (same algorithms as AVX-512).
#include <immintrin.h>

#include <cstring>

#include "kv/fp8_f16_avx2.h"
#include "kv/kv_rows_simd.h"

namespace kvq {
namespace {

inline float ld_f32(const uint8_t* p) { float v; std::memcpy(&v, p, 4); return v; }
// F16C: the scalar software conversion would dominate the per-chunk cost of the f16-scaled formats.
inline float ld_f16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return _cvtsh_ss(v); }
inline __m128i ld8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

struct Avx2 {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  // 8 accumulators for the weighted sum: 16 ymm registers hold them plus the decoded chunks.
  static constexpr int acc_regs = 8;
  // Decodes llama.cpp's q4_1 / q5_0 / q5_1 / iq4_nl rows (kv_elem_ggml_ext; the AVX-512 level
  // runs these kernels for them).
  static constexpr bool ggml_ext = true;
  // Lane j = sum of v[j]: two hadd levels per 128-bit half, then the halves are added.
  static V hsum_w(const V* v) {
    const V a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const V b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // See kv_rows_avx512.cpp: the sign-extended E4M3 byte << 7 with bit 14 cleared is an f16 of value
  // E4M3 * 2^-8. The NaN codes (S.1111.111) are the only ones whose bits 7..13 are all set, so
  // adding 1 << 7 carries into bit 14 for them alone: OR-ing that carry back sets the f16 exponent
  // to all ones (a NaN, the mantissa being nonzero) in integer ops, no compare and blend.
  static V e4m3_8_raw(const uint8_t* c) {
    const __m128i b = _mm_cvtepi8_epi16(ld8(c));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(int16_t(0xbfff)));
    const __m128i nan = _mm_and_si128(_mm_add_epi16(h, _mm_set1_epi16(0x0080)), _mm_set1_epi16(0x4000));
    return _mm256_cvtph_ps(_mm_or_si128(h, nan));
  }
  // E5M2 is the high byte of an f16: the byte interleaved above a zero byte.
  static V e5m2_8_raw(const uint8_t* c) { return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), ld8(c))); }
  // 16 codes at once: one widening (and for E4M3 one NaN fix) for both vectors.
  static constexpr bool pair_decode = true;
  template <KvElem E>
  static void dec_raw2(const uint8_t* c, V* x) {
    fp8_codes16_to_f32_avx2<E == KvElem::e4m3 || E == KvElem::e4m3_dyn>(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), x);
  }
  static V e4m3_8(const uint8_t* c, float mul) { return _mm256_mul_ps(e4m3_8_raw(c), _mm256_set1_ps(256.f * mul)); }
  static V e5m2_8(const uint8_t* c, float mul) { return _mm256_mul_ps(e5m2_8_raw(c), _mm256_set1_ps(mul)); }
  // The fp8 rows' codes unscaled (kv_rows_simd.h: kv_token_scaled).
  template <KvElem E>
  static V dec_raw(const uint8_t* c) {
    if constexpr (E == KvElem::e4m3 || E == KvElem::e4m3_dyn) return e4m3_8_raw(c);
    else return e5m2_8_raw(c);
  }
  static V i8_8(const uint8_t* c, float mul) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld8(c))), _mm256_set1_ps(mul));
  }
  // Elements 8j..8j+7 of a 32-element int4 unit: bytes (j % 2) * 8.., nibble j / 2.
  static __m256i nib_8(const uint8_t* unit, int j) {
    const __m256i w = _mm256_cvtepu8_epi32(ld8(unit + (j % 2) * 8));
    return _mm256_and_si256(_mm256_srl_epi32(w, _mm_cvtsi32_si128((j / 2) * 4)), _mm256_set1_epi32(15));
  }
  // Elements 8j..8j+7 of a 32-element int2 unit: bytes 0..7 at shift 2j.
  static __m256i crumb_8(const uint8_t* unit, int j) {
    const __m256i w = _mm256_cvtepu8_epi32(ld8(unit));
    return _mm256_and_si256(_mm256_srl_epi32(w, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi32(3));
  }

  template <KvElem E>
  static V dec(const KvRowFmt& f, float scale, const uint8_t* row, int e) {
    if constexpr (E == KvElem::f32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + e);
    } else if constexpr (E == KvElem::f16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * e)));
    } else if constexpr (E == KvElem::bf16) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * e)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    } else if constexpr (E == KvElem::e4m3) {
      return e4m3_8(row + e, scale);
    } else if constexpr (E == KvElem::e5m2) {
      return e5m2_8(row + e, scale);
    } else if constexpr (E == KvElem::e4m3_dyn) {
      return e4m3_8(row + sizeof(KvRowScaled) + e, ld_f32(row));
    } else if constexpr (E == KvElem::e5m2_dyn) {
      return e5m2_8(row + sizeof(KvRowScaled) + e, ld_f32(row));
    } else if constexpr (E == KvElem::int8) {
      return i8_8(row + sizeof(KvRowScaled) + e, ld_f32(row));
    } else if constexpr (E == KvElem::int8_static) {
      return i8_8(row + e, scale);
    } else if constexpr (E == KvElem::int4g || E == KvElem::int2g) {
      const uint8_t* gp = row + sizeof(KvGroupParams) * size_t(e / f.group);
      const uint8_t* codes = row + sizeof(KvGroupParams) * size_t(f.head_dim / f.group);
      const __m256i c = E == KvElem::int4g ? nib_8(codes + (e / 32) * kv_unit_int4_bytes, (e % 32) / 8)
                                           : crumb_8(codes + (e / 32) * kv_unit_int2_bytes, (e % 32) / 8);
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(ld_f16(gp)), _mm256_set1_ps(ld_f16(gp + 2)));
    } else if constexpr (E == KvElem::q8_0) {
      const uint8_t* b = row + sizeof(kv_block_q8_0) * size_t(e / 32);
      return i8_8(b + 2 + (e % 32), ld_f16(b));
    } else if constexpr (E == KvElem::q4_0) {
      const uint8_t* b = row + sizeof(kv_block_q4_0) * size_t(e / 32);
      const float d = ld_f16(b);
      const __m256i c = nib_8(b + 2, (e % 32) / 8);
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(d), _mm256_set1_ps(-8.f * d));
    } else if constexpr (E == KvElem::q4_1) {
      // d * q + m with the product exact: the FMA rounds once, as the reference's sum does.
      const uint8_t* b = row + sizeof(kv_block_q4_1) * size_t(e / 32);
      const __m256i c = nib_8(b + 4, (e % 32) / 8);
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(ld_f16(b)), _mm256_set1_ps(ld_f16(b + 2)));
    } else if constexpr (E == KvElem::q5_0 || E == KvElem::q5_1) {
      constexpr bool one = E == KvElem::q5_1;
      const uint8_t* b = row + (one ? sizeof(kv_block_q5_1) : sizeof(kv_block_q5_0)) * size_t(e / 32);
      const uint8_t* qh = b + (one ? 4 : 2);
      uint32_t h;
      std::memcpy(&h, qh, 4);
      // Fifth bit of element j (lane i: j = e % 32 + i) is bit j of h.
      const __m256i sh = _mm256_add_epi32(_mm256_set1_epi32(e % 32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256i hi = _mm256_slli_epi32(
          _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(h)), sh), _mm256_set1_epi32(1)), 4);
      const __m256i c = _mm256_or_si256(nib_8(qh + 4, (e % 32) / 8), hi);
      if constexpr (one)
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(ld_f16(b)), _mm256_set1_ps(ld_f16(b + 2)));
      else
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(16))), _mm256_set1_ps(ld_f16(b)));
    } else {
      static_assert(E == KvElem::iq4_nl);
      // Grid points by index: two 8-entry permutes on the low 3 bits, bit 3 (moved to the sign)
      // picks the half.
      const uint8_t* b = row + sizeof(kv_block_iq4_nl) * size_t(e / 32);
      const __m256i c = nib_8(b + 2, (e % 32) / 8);
      const __m256 lo = _mm256_permutevar8x32_ps(_mm256_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10), c);
      const __m256 hi = _mm256_permutevar8x32_ps(_mm256_setr_ps(1, 13, 25, 38, 53, 69, 89, 113), c);
      const __m256 v = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
      return _mm256_mul_ps(v, _mm256_set1_ps(ld_f16(b)));
    }
  }
};

}  // namespace

void kv_rows_scores_avx2(const KvRowFmt& f, float scale, const float* q, int n_q,
                         const uint8_t* rows, size_t row_stride, int n, float* out, int out_stride) {
  kv_rows_simd::scores<Avx2>(f, scale, q, n_q, rows, row_stride, n, out, out_stride);
}

void kv_rows_accum_avx2(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                        const uint8_t* rows, size_t row_stride, int n, float* acc) {
  kv_rows_simd::accum<Avx2>(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);
}

}  // namespace kvq
