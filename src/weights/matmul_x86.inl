// x86 tile kernels shared by matmul_avx2.cpp and matmul_avx512.cpp (included by both, compiled
// with each file's ISA flags). 256-bit vectors throughout: the target cores execute 512-bit
// integer ops as two 256-bit halves, so wider vectors would buy fewer instructions but not more
// throughput, while the AVX-512 build still gets 32 registers (bigger tiles) and VNNI.
// KVQ_X86_VNNI selects vpdpbusd (exact int32 accumulation) over maddubs+madd (int16 pairs, which
// saturate above 32767: every use below keeps |u*s + u*s| < 2^15).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "weights/blocks.h"
#include "weights/kernels.h"

namespace kvq {
namespace KVQ_X86_NS {
namespace {

inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if KVQ_X86_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// acc + the int32 sums of adjacent int16 products. vpmaddwd + vpaddd rather than VNNI's vpdpwssd:
// the accumulator's dependency chain then costs one add per step instead of a multiply's latency
// (Q4_K decode measured ~8% slower with vpdpwssd).
inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float f16(f16_t h) { return _cvtsh_ss(h); }

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 16 bytes of nibbles -> 32 codes: low nibbles are elements 0..15, high nibbles 16..31.
inline __m256i unpack_nibbles16(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i v = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes holding 0x10 where the bit is set (bit 4 of the 5-bit codes).
inline __m256i bits_to_0x10(uint32_t bits) {
#if KVQ_X86_VNNI
  return _mm256_maskz_mov_epi8(_cvtu32_mask32(bits), _mm256_set1_epi8(0x10));
#else
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i sel = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  const __m256i hit = _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
  return _mm256_and_si256(hit, _mm256_set1_epi8(0x10));
#endif
}

// IQ4_NL's 16 levels in both 128-bit lanes, for vpshufb on 4-bit codes.
inline __m256i iq4nl_table() {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
}
// MXFP4's 16 (doubled E2M1) levels, likewise.
inline __m256i mxfp4_table() {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------- 32-element types

// One weight block as unsigned codes u (0..31, or |q| for the signed Q8_0, IQ4_NL and MXFP4) with
// w = d * (u - off) + m. The signed types keep their codes in `sgn` (sign trick: |q| * (x * sign q),
// since Q8_0's u may reach 128).
template <GgmlType T>
struct W32 {
  __m256i u;
  __m256i sgn;
  float d, m;
};

template <GgmlType T>
inline void load_w32(const uint8_t* p, W32<T>& w) {
  if constexpr (T == GgmlType::Q4_0) {
    const auto* b = reinterpret_cast<const BlockQ4_0*>(p);
    w.d = f16(b->d);
    w.u = unpack_nibbles16(b->qs);
  } else if constexpr (T == GgmlType::Q4_1) {
    const auto* b = reinterpret_cast<const BlockQ4_1*>(p);
    w.d = f16(b->d);
    w.m = f16(b->m);
    w.u = unpack_nibbles16(b->qs);
  } else if constexpr (T == GgmlType::Q5_0) {
    const auto* b = reinterpret_cast<const BlockQ5_0*>(p);
    w.d = f16(b->d);
    w.u = _mm256_or_si256(unpack_nibbles16(b->qs), bits_to_0x10(load_u32(b->qh)));
  } else if constexpr (T == GgmlType::Q5_1) {
    const auto* b = reinterpret_cast<const BlockQ5_1*>(p);
    w.d = f16(b->d);
    w.m = f16(b->m);
    w.u = _mm256_or_si256(unpack_nibbles16(b->qs), bits_to_0x10(load_u32(b->qh)));
  } else if constexpr (T == GgmlType::IQ4_NL) {
    const auto* b = reinterpret_cast<const BlockIQ4_NL*>(p);
    w.d = f16(b->d);
    w.sgn = _mm256_shuffle_epi8(iq4nl_table(), unpack_nibbles16(b->qs));
    w.u = _mm256_abs_epi8(w.sgn);
  } else if constexpr (T == GgmlType::MXFP4) {
    // 17-byte blocks: qs at any alignment (unpack_nibbles16 loads unaligned)
    const auto* b = reinterpret_cast<const BlockMXFP4*>(p);
    w.d = e8m0_half_to_f32(b->e);
    w.sgn = _mm256_shuffle_epi8(mxfp4_table(), unpack_nibbles16(b->qs));
    w.u = _mm256_abs_epi8(w.sgn);
  } else {
    const auto* b = reinterpret_cast<const BlockQ8_0*>(p);
    w.d = f16(b->d);
    w.sgn = load32(b->qs);
    w.u = _mm256_abs_epi8(w.sgn);
  }
}

// Codes kept signed (see W32).
template <GgmlType T>
constexpr bool w32_signed() {
  return T == GgmlType::Q8_0 || T == GgmlType::IQ4_NL || T == GgmlType::MXFP4;
}

// Integer offset subtracted from u: folded into the dot product through sum(qx) = s / d.
template <GgmlType T>
constexpr int w32_offset() {
  return T == GgmlType::Q4_0 ? 8 : T == GgmlType::Q5_0 ? 16 : 0;
}
template <GgmlType T>
constexpr bool w32_has_min() {
  return T == GgmlType::Q4_1 || T == GgmlType::Q5_1;
}

template <GgmlType T>
constexpr size_t w32_block_bytes() {
  return T == GgmlType::Q4_0 ? sizeof(BlockQ4_0) : T == GgmlType::Q4_1 ? sizeof(BlockQ4_1)
       : T == GgmlType::Q5_0 ? sizeof(BlockQ5_0) : T == GgmlType::Q5_1 ? sizeof(BlockQ5_1)
       : T == GgmlType::IQ4_NL ? sizeof(BlockIQ4_NL) : T == GgmlType::MXFP4 ? sizeof(BlockMXFP4)
       : sizeof(BlockQ8_0);
}

// NR rows x NT tokens; one block of 32 at a time, each weight block unpacked once and used NT times.
template <GgmlType T, int NR, int NT>
void tile32(const uint8_t* w, size_t ws, const uint8_t* x, size_t xs, int64_t nb, float* y, int64_t ldy) {
  __m256 acc[NR][NT];
  // min terms m * s, vectorised over the NT tokens (one register per row instead of NR*NT scalars)
  __m128 macc[NR];
  for (int r = 0; r < NR; ++r) {
    macc[r] = _mm_setzero_ps();
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    W32<T> wb[NR];
    for (int r = 0; r < NR; ++r) load_w32<T>(w + size_t(r) * ws + size_t(b) * w32_block_bytes<T>(), wb[r]);
    float svals[4] = {0, 0, 0, 0};
    for (int t = 0; t < NT; ++t) {
      const BlockQ8A* xb = reinterpret_cast<const BlockQ8A*>(x + size_t(t) * xs) + b;
      const __m256i xv = load32(xb->qs);
      // -off * sum(q) placed in lane 0 of the accumulator: exact, and free per row
      __m256i init = _mm256_setzero_si256();
      if constexpr (w32_offset<T>() != 0) {
        init = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-w32_offset<T>() * xb->sum));
      }
      if constexpr (w32_has_min<T>()) svals[t] = xb->ds;
      for (int r = 0; r < NR; ++r) {
        __m256i p;
        if constexpr (w32_signed<T>())
          p = dot_u8s8(init, wb[r].u, _mm256_sign_epi8(xv, wb[r].sgn));
        else
          p = dot_u8s8(init, wb[r].u, xv);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wb[r].d * xb->d), acc[r][t]);
      }
    }
    if constexpr (w32_has_min<T>()) {
      // built from registers: a store + vector reload here stalls on store forwarding
      const __m128 sv = _mm_setr_ps(svals[0], svals[1], svals[2], svals[3]);
      for (int r = 0; r < NR; ++r) macc[r] = _mm_fmadd_ps(_mm_set1_ps(wb[r].m), sv, macc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    alignas(16) float mv[4];
    _mm_store_ps(mv, macc[r]);
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = hsum(acc[r][t]) + mv[t];
  }
}

// ---------------------------------------------------------------- K-quants

template <GgmlType T, int NR, int NT>
void tile_q45k(const uint8_t* w, size_t ws, const uint8_t* x, size_t xs, int64_t nb, float* y, int64_t ldy) {
  using B = std::conditional_t<T == GgmlType::Q4_K, BlockQ4_K, BlockQ5_K>;
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const B* wb[NR];
    __m256i scv[NR];   // the 8 scales as int16, in both 128-bit halves (for in-lane shuffles)
    __m128i mins[NR];  // the 8 mins as int16
    for (int r = 0; r < NR; ++r) {
      wb[r] = reinterpret_cast<const B*>(w + size_t(r) * ws) + b;
      // all 8 scales and mins at once: word-wide masks and shifts over the 12 packed bytes
      uint32_t a, bb, c;
      std::memcpy(&a, wb[r]->scales, 4);
      std::memcpy(&bb, wb[r]->scales + 4, 4);
      std::memcpy(&c, wb[r]->scales + 8, 4);
      const uint32_t sc_lo = a & 0x3f3f3f3f, m_lo = bb & 0x3f3f3f3f;
      const uint32_t sc_hi = (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030);
      const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0f) | ((bb >> 2) & 0x30303030);
      const __m128i sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(uint64_t(sc_lo) | (uint64_t(sc_hi) << 32))));
      mins[r] = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(uint64_t(m_lo) | (uint64_t(m_hi) << 32))));
      scv[r] = _mm256_broadcastsi128_si256(sc16);
    }
    __m256i iacc[NR][NT];
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) iacc[r][t] = _mm256_setzero_si256();
    __m256i qh[NR];
    if constexpr (T == GgmlType::Q5_K)
      for (int r = 0; r < NR; ++r) qh[r] = load32(wb[r]->qh);
    for (int c = 0; c < 4; ++c) {  // chunk c: sub-blocks 2c (low nibbles), 2c+1 (high)
      __m256i lo[NR], hi[NR], s0[NR], s1[NR];
      // int16 scale 2c (and 2c+1) broadcast to every lane: bytes 4c, 4c+1 (4c+2, 4c+3) repeated
      const __m256i bc0 = _mm256_set1_epi16(int16_t((4 * c) | ((4 * c + 1) << 8)));
      const __m256i bc1 = _mm256_set1_epi16(int16_t((4 * c + 2) | ((4 * c + 3) << 8)));
      for (int r = 0; r < NR; ++r) {
        s0[r] = _mm256_shuffle_epi8(scv[r], bc0);
        s1[r] = _mm256_shuffle_epi8(scv[r], bc1);
        const __m256i q = load32(wb[r]->qs + 32 * c);
        lo[r] = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
        hi[r] = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F));
        if constexpr (T == GgmlType::Q5_K) {
          // bit 4 of sub-block j's codes is bit j of qh
          const __m256i b0 = _mm256_set1_epi8(char(1 << (2 * c))), b1 = _mm256_set1_epi8(char(2 << (2 * c)));
          const __m256i x10 = _mm256_set1_epi8(0x10);
#if KVQ_X86_VNNI
          lo[r] = _mm256_mask_add_epi8(lo[r], _mm256_test_epi8_mask(qh[r], b0), lo[r], x10);
          hi[r] = _mm256_mask_add_epi8(hi[r], _mm256_test_epi8_mask(qh[r], b1), hi[r], x10);
#else
          lo[r] = _mm256_or_si256(lo[r], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh[r], b0), b0), x10));
          hi[r] = _mm256_or_si256(hi[r], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh[r], b1), b1), x10));
#endif
        }
      }
      for (int t = 0; t < NT; ++t) {
        const BlockQ8K* xb = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs) + b;
        const __m256i x0 = load32(xb->qs + 64 * c), x1 = load32(xb->qs + 64 * c + 32);
        for (int r = 0; r < NR; ++r) {
          // u <= 31, |x| <= 127: pair sums <= 7874, no int16 saturation
          const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[r], x0), s0[r]);
          const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[r], x1), s1[r]);
          iacc[r][t] = _mm256_add_epi32(iacc[r][t], _mm256_add_epi32(p0, p1));
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const BlockQ8K* xb = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs) + b;
      const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb->bsum32));
      for (int r = 0; r < NR; ++r) {
        const float dd = f16(wb[r]->d) * xb->d, dm = f16(wb[r]->dmin) * xb->d;
        const __m256i msum = _mm256_zextsi128_si256(_mm_madd_epi16(mins[r], bs));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][t]), _mm256_set1_ps(dd), acc[r][t]);
        acc[r][t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(dm), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = hsum(acc[r][t]);
}

template <int NR, int NT>
void tile_q6k(const uint8_t* w, size_t ws, const uint8_t* x, size_t xs, int64_t nb, float* y, int64_t ldy) {
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ6_K* wb[NR];
    __m128i sc8[NR];
    for (int r = 0; r < NR; ++r) {
      wb[r] = reinterpret_cast<const BlockQ6_K*>(w + size_t(r) * ws) + b;
      sc8[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb[r]->scales));
    }
    __m256i iacc[NR][NT];
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) iacc[r][t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; ++k) {  // elements 128h + 32k .. +32: sub-blocks 8h+2k, 8h+2k+1
        __m256i u[NR], sv[NR];
        for (int r = 0; r < NR; ++r) {
          const __m256i ql = load32(wb[r]->ql + 64 * h + 32 * (k & 1));
          const __m256i qh = load32(wb[r]->qh + 32 * h);
          const __m256i lo = k < 2 ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
          // bits 2k, 2k+1 of qh moved to bits 4-5 (16-bit shifts; the mask drops cross-byte bits)
          __m256i hb;
          switch (k) {
            case 0: hb = _mm256_slli_epi16(qh, 4); break;
            case 1: hb = _mm256_slli_epi16(qh, 2); break;
            case 2: hb = qh; break;
            default: hb = _mm256_srli_epi16(qh, 2); break;
          }
          u[r] = _mm256_or_si256(lo, _mm256_and_si256(hb, m30));
          // lanes 0-7: scale j, lanes 8-15: scale j+1 (two broadcast loads)
          const int j = 8 * h + 2 * k;
          sv[r] = _mm256_set_m128i(_mm_set1_epi16(wb[r]->scales[j + 1]), _mm_set1_epi16(wb[r]->scales[j]));
        }
        for (int t = 0; t < NT; ++t) {
          const BlockQ8K* xb = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs) + b;
          const __m256i xv = load32(xb->qs + 128 * h + 32 * k);
          for (int r = 0; r < NR; ++r)  // u <= 63: pair sums <= 16002
            iacc[r][t] = madd_acc(iacc[r][t], _mm256_maddubs_epi16(u[r], xv), sv[r]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const BlockQ8K* xb = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs) + b;
      const __m256i bs = load32(xb->bsum16);
      for (int r = 0; r < NR; ++r) {
        // codes are q + 32: subtract 32 * sum_j sc_j * sum(x in sub-block j)
        const __m256i corr = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8[r]), bs);
        const __m256i tot = _mm256_sub_epi32(iacc[r][t], _mm256_slli_epi32(corr, 5));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(f16(wb[r]->d) * xb->d), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = hsum(acc[r][t]);
}

// Q2_K and Q3_K: 16 sub-blocks of 16, 2-bit codes (Q3_K: plus a high bit, as u - 4 with u = 0..7).
// A chunk (h, k) is elements 128h + 32k .. +32: bits 2k of qs[32h .. 32h + 32], sub-blocks
// j = 8h + 2k (the lower 128-bit lane) and j + 1 (the upper), whose scales one vpshufb spreads
// from the 16 scale bytes (int16, zero-extended) to the matching lanes.
template <int J>
inline __m256i scale_pair_ctl() {
  return _mm256_set_m128i(_mm_set1_epi16(int16_t(0x8000 | (J + 1))), _mm_set1_epi16(int16_t(0x8000 | J)));
}

// Bit B of each byte moved to bit D (16-bit shifts; the caller masks the other bits out).
template <int B, int D>
inline __m256i move_bit(__m256i v) {
  if constexpr (B > D) return _mm256_srli_epi16(v, B - D);
  else if constexpr (B < D) return _mm256_slli_epi16(v, D - B);
  else return v;
}

// Q3_K's 16 6-bit scales (unsigned, before the -32) as 16 bytes.
inline __m128i q3k_scale_bytes(const uint8_t* s) {
  uint32_t a0, a1, t;
  std::memcpy(&a0, s, 4);
  std::memcpy(&a1, s + 4, 4);
  std::memcpy(&t, s + 8, 4);
  const uint32_t m4 = 0x0f0f0f0f, m2 = 0x03030303;
  const uint32_t s0 = (a0 & m4) | ((t & m2) << 4), s1 = (a1 & m4) | (((t >> 2) & m2) << 4);
  const uint32_t s2 = ((a0 >> 4) & m4) | (((t >> 4) & m2) << 4), s3 = ((a1 >> 4) & m4) | (((t >> 6) & m2) << 4);
  return _mm_set_epi32(int(s3), int(s2), int(s1), int(s0));
}

template <GgmlType T, int NR, int NT>
void tile_q23k(const uint8_t* w, size_t ws, const uint8_t* x, size_t xs, int64_t nb, float* y, int64_t ldy) {
  constexpr bool q3 = T == GgmlType::Q3_K;
  using B = std::conditional_t<q3, BlockQ3_K, BlockQ2_K>;
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
  for (int64_t b = 0; b < nb; ++b) {
    const B* wb[NR];
    // Q2_K: the 16 scales (low nibbles) as bytes in both 128-bit lanes, zero-extended by the
    // per-chunk vpshufb; Q3_K: the int16 scales - 32 of half h (8 of them) in both lanes
    __m256i scb[NR][2];
    __m256i corr16[NR];  // per sub-block int16: Q2_K its min, Q3_K its scale - 32
    __m256i hm[NR];
    for (int r = 0; r < NR; ++r) {
      wb[r] = reinterpret_cast<const B*>(w + size_t(r) * ws) + b;
      if constexpr (q3) {
        corr16[r] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(q3k_scale_bytes(wb[r]->scales)), _mm256_set1_epi16(32));
        scb[r][0] = _mm256_permute4x64_epi64(corr16[r], 0x44);
        scb[r][1] = _mm256_permute4x64_epi64(corr16[r], 0xEE);
        hm[r] = load32(wb[r]->hmask);
      } else {
        const __m128i sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb[r]->scales));
        scb[r][0] = _mm256_broadcastsi128_si256(_mm_and_si128(sb, _mm_set1_epi8(0x0F)));
        corr16[r] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sb, 4), _mm_set1_epi8(0x0F)));
      }
    }
    __m256i iacc[NR][NT];
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) iacc[r][t] = _mm256_setzero_si256();
    auto chunk = [&](auto hk) {
      constexpr int h = decltype(hk)::value / 4, k = decltype(hk)::value % 4;
      __m256i u[NR], sv[NR];
      for (int r = 0; r < NR; ++r) {
        const __m256i q = load32(wb[r]->qs + 32 * h);
        u[r] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3);
        if constexpr (q3) {
          // int16 scales 2k, 2k + 1 of the half to the lower and upper lane
          sv[r] = _mm256_shuffle_epi8(scb[r][h], _mm256_set_m128i(_mm_set1_epi16(int16_t((4 * k + 2) | ((4 * k + 3) << 8))),
                                                                  _mm_set1_epi16(int16_t((4 * k) | ((4 * k + 1) << 8)))));
          // u = low bits + 4 * high bit (0..7); the -4 goes into the sub-block sums' correction
#if KVQ_X86_VNNI
          u[r] = _mm256_mask_add_epi8(u[r], _mm256_test_epi8_mask(hm[r], _mm256_set1_epi8(char(1 << (4 * h + k)))), u[r], m4);
#else
          u[r] = _mm256_or_si256(u[r], _mm256_and_si256(move_bit<4 * h + k, 2>(hm[r]), m4));
#endif
        } else {
          sv[r] = _mm256_shuffle_epi8(scb[r][0], scale_pair_ctl<8 * h + 2 * k>());
        }
      }
      for (int t = 0; t < NT; ++t) {
        const BlockQ8K* xb = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs) + b;
        const __m256i xv = load32(xb->qs + 128 * h + 32 * k);
        for (int r = 0; r < NR; ++r)  // u <= 7: pair sums <= 1778
          iacc[r][t] = madd_acc(iacc[r][t], _mm256_maddubs_epi16(u[r], xv), sv[r]);
      }
    };
    [&]<int... I>(std::integer_sequence<int, I...>) { (chunk(std::integral_constant<int, I>{}), ...); }(
        std::make_integer_sequence<int, 8>{});
    for (int t = 0; t < NT; ++t) {
      const BlockQ8K* xb = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs) + b;
      const __m256i bs = load32(xb->bsum16);
      for (int r = 0; r < NR; ++r) {
        const __m256i c = _mm256_madd_epi16(corr16[r], bs);
        const float dd = f16(wb[r]->d) * xb->d;
        if constexpr (q3) {
          // codes are u - 4: subtract 4 * sum_j sc_j * sum(x in sub-block j)
          const __m256i tot = _mm256_sub_epi32(iacc[r][t], _mm256_slli_epi32(c, 2));
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(dd), acc[r][t]);
        } else {
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][t]), _mm256_set1_ps(dd), acc[r][t]);
          acc[r][t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(f16(wb[r]->dmin) * xb->d), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = hsum(acc[r][t]);
}

// IQ4_XS's 8 6-bit sub-block scales minus 32, as int16.
inline __m128i iq4xs_scales16(const BlockIQ4_XS* b) {
  uint32_t l;
  std::memcpy(&l, b->scales_l, 4);
  // the 2-bit high parts of scales 0..7 spread to one byte each
  uint64_t hb = b->scales_h;
  hb = (hb | (hb << 24)) & 0x000000FF000000FFull;
  hb = (hb | (hb << 12)) & 0x000F000F000F000Full;
  hb = (hb | (hb << 6)) & 0x0303030303030303ull;
  const __m128i lo = _mm_unpacklo_epi8(_mm_cvtsi32_si128(int(l & 0x0f0f0f0f)), _mm_cvtsi32_si128(int((l >> 4) & 0x0f0f0f0f)));
  const __m128i ls = _mm_or_si128(lo, _mm_cvtsi64_si128(int64_t(hb << 4)));
  return _mm_sub_epi16(_mm_cvtepu8_epi16(ls), _mm_set1_epi16(32));
}

// IQ4_XS: sub-block j's 32 codes looked up as signed levels v; |v| * (x * sign v) as in tile32,
// each sub-block's pair sums scaled by its int16 scale in the madd.
template <int NR, int NT>
void tile_iq4xs(const uint8_t* w, size_t ws, const uint8_t* x, size_t xs, int64_t nb, float* y, int64_t ldy) {
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i tbl = iq4nl_table();
  for (int64_t b = 0; b < nb; ++b) {
    const BlockIQ4_XS* wb[NR];
    __m256i scv[NR];
    for (int r = 0; r < NR; ++r) {
      wb[r] = reinterpret_cast<const BlockIQ4_XS*>(w + size_t(r) * ws) + b;
      scv[r] = _mm256_broadcastsi128_si256(iq4xs_scales16(wb[r]));
    }
    __m256i iacc[NR][NT];
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) iacc[r][t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i v[NR], u[NR], sv[NR];
      const __m256i bc = _mm256_set1_epi16(int16_t((2 * j) | ((2 * j + 1) << 8)));
      for (int r = 0; r < NR; ++r) {
        v[r] = _mm256_shuffle_epi8(tbl, unpack_nibbles16(wb[r]->qs + 16 * j));
        u[r] = _mm256_abs_epi8(v[r]);
        sv[r] = _mm256_shuffle_epi8(scv[r], bc);
      }
      for (int t = 0; t < NT; ++t) {
        const BlockQ8K* xb = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs) + b;
        const __m256i xv = load32(xb->qs + 32 * j);
        for (int r = 0; r < NR; ++r)  // |v|, |x| <= 127: pair sums <= 32258
          iacc[r][t] = madd_acc(iacc[r][t], _mm256_maddubs_epi16(u[r], _mm256_sign_epi8(xv, v[r])), sv[r]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      const float dx = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs)[b].d;
      for (int r = 0; r < NR; ++r)
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][t]), _mm256_set1_ps(f16(wb[r]->d) * dx), acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = hsum(acc[r][t]);
}

// ---------------------------------------------------------------- float types

template <GgmlType T>
inline __m256 load_w8(const uint8_t* p) {
  if constexpr (T == GgmlType::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  else if constexpr (T == GgmlType::F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <GgmlType T>
inline float load_w1(const uint8_t* p) {
  if constexpr (T == GgmlType::F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return T == GgmlType::F16 ? f16(h) : bf16_to_f32(h);
  }
}

template <GgmlType T, int NR, int NT>
void tile_float(const uint8_t* w, size_t ws, const uint8_t* x, size_t xs, int64_t n, float* y, int64_t ldy) {
  constexpr size_t es = T == GgmlType::F32 ? 4 : 2;
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load_w8<T>(w + size_t(r) * ws + size_t(i) * es);
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(reinterpret_cast<const float*>(x + size_t(t) * xs) + i);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      float s = hsum(acc[r][t]);
      const float* xt = reinterpret_cast<const float*>(x + size_t(t) * xs);
      for (int64_t k = i; k < n; ++k) s += load_w1<T>(w + size_t(r) * ws + size_t(k) * es) * xt[k];
      y[t * ldy + r] = s;
    }
}

// ---------------------------------------------------------------- tiling driver

template <GgmlType T, int NR, int NT>
void tile(const uint8_t* w, size_t ws, const uint8_t* x, size_t xs, int64_t n_in, float* y, int64_t ldy) {
  if constexpr (T == GgmlType::F32 || T == GgmlType::F16 || T == GgmlType::BF16)
    tile_float<T, NR, NT>(w, ws, x, xs, n_in, y, ldy);
  else if constexpr (T == GgmlType::Q4_K || T == GgmlType::Q5_K)
    tile_q45k<T, NR, NT>(w, ws, x, xs, n_in / kQKK, y, ldy);
  else if constexpr (T == GgmlType::Q6_K)
    tile_q6k<NR, NT>(w, ws, x, xs, n_in / kQKK, y, ldy);
  else if constexpr (T == GgmlType::Q2_K || T == GgmlType::Q3_K)
    tile_q23k<T, NR, NT>(w, ws, x, xs, n_in / kQKK, y, ldy);
  else if constexpr (T == GgmlType::IQ4_XS)
    tile_iq4xs<NR, NT>(w, ws, x, xs, n_in / kQKK, y, ldy);
  else
    tile32<T, NR, NT>(w, ws, x, xs, n_in / kQK, y, ldy);
}

template <GgmlType T, int NR, int NT>
void tile_rows(const uint8_t* w, size_t ws, const uint8_t* x, size_t xs, int nt, int64_t n_in, float* y, int64_t ldy) {
  if constexpr (NT > 1) {
    if (nt < NT) return tile_rows<T, NR, NT - 1>(w, ws, x, xs, nt, n_in, y, ldy);
  }
  tile<T, NR, NT>(w, ws, x, xs, n_in, y, ldy);
}

#if !KVQ_X86_VNNI
// AVX2 prefill over the 4- and 5-bit 32-element types: a row tile's blocks are unpacked once into
// codes and scales (what load_w32 gives) and every token tile reads those, instead of unpacking
// each block again per token tile (Q5_0 / Q5_1: ~10 ops per block and row, against 3 per dot).
template <GgmlType T>
constexpr bool w32_packs() {
  return T == GgmlType::Q4_0 || T == GgmlType::Q4_1 || T == GgmlType::Q5_0 || T == GgmlType::Q5_1;
}
// A row tile's blocks as load_w32 gives them: codes (rows, nb, 32), scales and mins (rows, nb).
struct PackedW32 {
  const uint8_t* u;
  const float* d;
  const float* m;
  int64_t nb;
};
// Tokens per packed tile (4 x 3 accumulators fit the 16 ymm registers, see tile32_packed).
constexpr int kPackedNT = 3;
// tile32's arithmetic on unpacked rows, row by row inside a block: one row's codes live at a time
// (the activations come from memory), which leaves the registers to NR x NT accumulators with
// NT = 3 where tile32 holds NR rows' codes and fits NT = 2. Same values as tile32.
template <GgmlType T, int NR, int NT>
void tile32_packed(const PackedW32& pw, const uint8_t* x, size_t xs, int64_t nb, float* y, int64_t ldy) {
  __m256 acc[NR][NT];
  __m128 macc[NR];
  for (int r = 0; r < NR; ++r) {
    macc[r] = _mm_setzero_ps();
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ8A* xb[NT];
    for (int t = 0; t < NT; ++t) xb[t] = reinterpret_cast<const BlockQ8A*>(x + size_t(t) * xs) + b;
    for (int r = 0; r < NR; ++r) {
      const size_t i = size_t(r) * size_t(pw.nb) + size_t(b);
      const __m256i u = load32(pw.u + 32 * i);
      const float dw = pw.d[i];
      for (int t = 0; t < NT; ++t) {
        __m256i init = _mm256_setzero_si256();
        if constexpr (w32_offset<T>() != 0) init = _mm256_zextsi128_si256(_mm_cvtsi32_si128(-w32_offset<T>() * xb[t]->sum));
        const __m256i p = dot_u8s8(init, u, load32(xb[t]->qs));
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xb[t]->d), acc[r][t]);
      }
    }
    if constexpr (w32_has_min<T>()) {
      float svals[4] = {0, 0, 0, 0};
      for (int t = 0; t < NT; ++t) svals[t] = xb[t]->ds;
      const __m128 sv = _mm_setr_ps(svals[0], svals[1], svals[2], svals[3]);
      for (int r = 0; r < NR; ++r)
        macc[r] = _mm_fmadd_ps(_mm_set1_ps(pw.m[size_t(r) * size_t(pw.nb) + size_t(b)]), sv, macc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    alignas(16) float mv[4];
    _mm_store_ps(mv, macc[r]);
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = hsum(acc[r][t]) + mv[t];
  }
}
template <GgmlType T, int NR, int NT>
void tile_rows_packed(const PackedW32& pw, const uint8_t* x, size_t xs, int nt, int64_t nb, float* y, int64_t ldy) {
  if constexpr (NT > 1) {
    if (nt < NT) return tile_rows_packed<T, NR, NT - 1>(pw, x, xs, nt, nb, y, ldy);
  }
  tile32_packed<T, NR, NT>(pw, x, xs, nb, y, ldy);
}
template <GgmlType T, int NR, int NT>
int64_t gemm_packed_rows(const uint8_t* w, size_t ws, int64_t nr, const uint8_t* x, size_t xs, int64_t nt,
                         int64_t n_in, float* y, int64_t ldy) {
  const int64_t nb = n_in / kQK;
  thread_local std::vector<uint8_t> ubuf;
  thread_local std::vector<float> dbuf, mbuf;
  ubuf.resize(size_t(NR) * size_t(nb) * 32);
  dbuf.resize(size_t(NR) * size_t(nb));
  mbuf.resize(size_t(NR) * size_t(nb));
  int64_t r = 0;
  for (; r + NR <= nr; r += NR) {
    for (int rr = 0; rr < NR; ++rr)
      for (int64_t b = 0; b < nb; ++b) {
        W32<T> wv{};
        load_w32<T>(w + size_t(r + rr) * ws + size_t(b) * w32_block_bytes<T>(), wv);
        const size_t i = size_t(rr) * size_t(nb) + size_t(b);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ubuf.data() + 32 * i), wv.u);
        dbuf[i] = wv.d;
        mbuf[i] = w32_has_min<T>() ? wv.m : 0.f;
      }
    const PackedW32 pw{ubuf.data(), dbuf.data(), mbuf.data(), nb};
    for (int64_t t = 0; t < nt; t += NT)
      tile_rows_packed<T, NR, NT>(pw, x + size_t(t) * xs, xs, int(std::min<int64_t>(NT, nt - t)), nb, y + t * ldy + r, ldy);
  }
  return r;
}
#endif

// Rows outer, tokens inner: the NR weight rows stay in L1 while every token tile streams past.
// Up to kInterleaveMinTokens - 1 tokens (decode, and the few rows of a batched decode step) go row
// by row instead: W then arrives as one sequential stream per thread, which the hardware
// prefetchers follow at close to full bandwidth, whereas NR interleaved row streams measured at
// half of it and less (Gemma 3's 262144 x 640 Q8_0 output projection at 4 tokens: 7.6 GB/s,
// 22 ms against 6 ms for one token; bench/BENCHMARKS.md).
constexpr int64_t kInterleaveMinTokens = KVQ_INTERLEAVE_MIN_TOKENS;
template <GgmlType T, int NR, int NT>
void gemm(const uint8_t* w, size_t ws, int64_t nr, const uint8_t* x, size_t xs, int64_t nt, int64_t n_in,
          float* y, int64_t ldy) {
  int64_t r = 0;
#if !KVQ_X86_VNNI
  if constexpr (w32_packs<T>()) {
    if (nt >= kPackedNT) r = gemm_packed_rows<T, NR, kPackedNT>(w, ws, nr, x, xs, nt, n_in, y, ldy);
  }
#endif
  if (nt >= kInterleaveMinTokens)
    for (; r + NR <= nr; r += NR)
      for (int64_t t = 0; t < nt; t += NT)
        tile_rows<T, NR, NT>(w + size_t(r) * ws, ws, x + size_t(t) * xs, xs, int(std::min<int64_t>(NT, nt - t)),
                             n_in, y + t * ldy + r, ldy);
  for (; r < nr; ++r)
    for (int64_t t = 0; t < nt; t += NT)
      tile_rows<T, 1, NT>(w + size_t(r) * ws, ws, x + size_t(t) * xs, xs, int(std::min<int64_t>(NT, nt - t)),
                          n_in, y + t * ldy + r, ldy);
}

}  // namespace

MatmulTileFn kernel_for(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return gemm<GgmlType::F32, KVQ_NR_F, KVQ_NT_F>;
    case GgmlType::F16: return gemm<GgmlType::F16, KVQ_NR_F, KVQ_NT_F>;
    case GgmlType::BF16: return gemm<GgmlType::BF16, KVQ_NR_F, KVQ_NT_F>;
    case GgmlType::Q4_0: return gemm<GgmlType::Q4_0, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q4_1: return gemm<GgmlType::Q4_1, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q5_0: return gemm<GgmlType::Q5_0, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q5_1: return gemm<GgmlType::Q5_1, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q8_0: return gemm<GgmlType::Q8_0, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::IQ4_NL: return gemm<GgmlType::IQ4_NL, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::MXFP4: return gemm<GgmlType::MXFP4, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q4_K: return gemm<GgmlType::Q4_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::Q5_K: return gemm<GgmlType::Q5_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::Q6_K: return gemm<GgmlType::Q6_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::Q2_K: return gemm<GgmlType::Q2_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::Q3_K: return gemm<GgmlType::Q3_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::IQ4_XS: return gemm<GgmlType::IQ4_XS, KVQ_NR_K, KVQ_NT_K>;
    default: return nullptr;
  }
}

}  // namespace KVQ_X86_NS
}  // namespace kvq
