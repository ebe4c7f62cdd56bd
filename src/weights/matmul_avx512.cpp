// AVX-512 level of the weight kernels: VNNI (vpdpbusd) integer dots, masks for 5-bit codes, and
// 32 vector registers for larger register tiles (4 rows x 4 tokens share each unpacked block).
#define KVQ_X86_NS x86_avx512
#define KVQ_X86_VNNI 1
#define KVQ_NR_32 4
#define KVQ_NT_32 4
#define KVQ_NR_K 4
#define KVQ_NT_K 2
#define KVQ_NR_F 4
#define KVQ_NT_F 4
#define KVQ_INTERLEAVE_MIN_TOKENS 12
#include "core/aligned.h"
#include "weights/matmul_x86.inl"

// ---------------------------------------------------------------- row panels (prefill)
//
// For many tokens the quantized types switch to a layout where one 512-bit register holds 16
// weight rows: a panel of 16 rows is unpacked once per call into unsigned byte codes,
// interleaved as [group of 4 elements][row][4 codes], so one vpdpbusd with the token's 4
// activation bytes broadcast ({1to16}) advances 16 row dot products at once. The per-block
// scales are then applied to 16 rows with one vector op per token, outputs leave as 16
// consecutive floats of y (no horizontal sums), and the unpacking is paid once per row for all
// tokens instead of once per row per 2-4 tokens.

namespace kvq {
namespace x86_avx512 {
namespace {

constexpr int kPR = 16;             // rows per panel: the 16 int32 lanes of a zmm
constexpr int kPanelMinTokens = 12;  // below this the streaming kernels win (no unpack pass; see gemm)
constexpr int kPP = 2;              // panels per register tile: 32 rows share each activation broadcast
// tokens per register tile: kPP x kPT float accumulators + as many int32 dot sums (+ as many
// super-block sums for the K-quants) within the 32 zmm registers
template <GgmlType T>
constexpr int panel_tokens() {
  return act_format(T) == ActFormat::q8k ? 4 : 6;
}
constexpr int kTokBlock = 64;       // tokens whose activations stay in L2 while the panels pass

inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 16 rows x `n` bytes (row r at tmp + r * n) -> groups of 4: out[(g * 16 + r) * 4 + i] = row r byte 4g + i.
// Per 32 bytes of the rows, a 16 x 8 dword transpose: rows r and r + 8 share a zmm, and the two
// 8 x 8 transposes in its 256-bit halves run together (unpack 32, unpack 64, then 128-bit lanes
// across the pair of registers); a gather per output group measured slower.
inline void interleave16(const uint8_t* tmp, int n, uint8_t* out) {
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int c = 0; c < n / 32; ++c) {
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; ++i)
      z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load32(tmp + i * n + 32 * c)), load32(tmp + (i + 8) * n + 32 * c), 1);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // u[k] (k < 4) holds dword k and k + 4 of rows 0-3 (per 128-bit lane), u[k + 4] of rows 4-7
    uint8_t* o = out + size_t(8 * c) * 64;
    for (int k = 0; k < 4; ++k) {
      _mm512_storeu_si512(o + 64 * k, _mm512_permutex2var_epi64(u[k], lo, u[k + 4]));
      _mm512_storeu_si512(o + 64 * (k + 4), _mm512_permutex2var_epi64(u[k], hi, u[k + 4]));
    }
  }
}

// ---- 32-element types: unsigned codes u with w = d * (u - off) + m

template <GgmlType T>
constexpr int panel_off32() {
  return T == GgmlType::Q4_0 ? 8 : T == GgmlType::Q5_0 ? 16 : w32_signed<T>() ? 128 : 0;
}

// Codes of one block in element order (32 bytes), its scale and min.
template <GgmlType T>
inline __m256i unpack32(const uint8_t* p, float* d, float* m) {
  W32<T> w;
  load_w32<T>(p, w);
  *d = w.d;
  if constexpr (w32_has_min<T>()) *m = w.m;
  else *m = 0;
  if constexpr (w32_signed<T>()) return _mm256_xor_si256(w.sgn, _mm256_set1_epi8(char(0x80)));  // q + 128
  else return w.u;
}

// Panel of nb blocks: codes (nb, 8 groups, 16 rows, 4), d (nb, 16), m (nb, 16). Rows past nr are zero.
template <GgmlType T>
void pack32(const uint8_t* w, size_t ws, int nr, int64_t nb, uint8_t* codes, float* d, float* m) {
  alignas(64) uint8_t tmp[kPR * kQK];
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < kPR; ++r) {
      __m256i u = _mm256_setzero_si256();
      float dr = 0, mr = 0;
      if (r < nr) u = unpack32<T>(w + size_t(r) * ws + size_t(b) * w32_block_bytes<T>(), &dr, &mr);
      _mm256_store_si256(reinterpret_cast<__m256i*>(tmp + r * kQK), u);
      d[b * kPR + r] = dr;
      m[b * kPR + r] = mr;
    }
    interleave16(tmp, kQK, codes + size_t(b) * kPR * kQK);
  }
}

// P panels (16 P rows) x NT tokens: each broadcast activation word feeds P vpdpbusd.
template <GgmlType T, int P, int NT>
void panel_tile32(const uint8_t* const* codes, const float* const* d, const float* const* m, const uint8_t* x,
                  size_t xs, int64_t nb, float* y, int64_t ldy, const __mmask16* rmask) {
  __m512 acc[P][NT];
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < NT; ++t) acc[p][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ8A* xb[NT];
    __m512i ia[P][NT];
    for (int t = 0; t < NT; ++t) {
      xb[t] = reinterpret_cast<const BlockQ8A*>(x + size_t(t) * xs) + b;
      // w = d (u - off): the -off * sum(q) term is exact in the integer accumulator's start
      const __m512i init = panel_off32<T>() ? _mm512_set1_epi32(-panel_off32<T>() * xb[t]->sum) : _mm512_setzero_si512();
      for (int p = 0; p < P; ++p) ia[p][t] = init;
    }
    for (int g = 0; g < 8; ++g) {
      __m512i wv[P];
      for (int p = 0; p < P; ++p) wv[p] = _mm512_load_si512(codes[p] + size_t(b) * kPR * kQK + 64 * g);
      for (int t = 0; t < NT; ++t) {
        const __m512i xv = bcast32(xb[t]->qs + 4 * g);
        for (int p = 0; p < P; ++p) ia[p][t] = _mm512_dpbusd_epi32(ia[p][t], wv[p], xv);
      }
    }
    for (int p = 0; p < P; ++p) {
      const __m512 dv = _mm512_load_ps(d[p] + b * kPR);
      for (int t = 0; t < NT; ++t)
        acc[p][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[p][t]), _mm512_mul_ps(dv, _mm512_set1_ps(xb[t]->d)), acc[p][t]);
      if constexpr (w32_has_min<T>()) {
        const __m512 mv = _mm512_load_ps(m[p] + b * kPR);
        for (int t = 0; t < NT; ++t)
          acc[p][t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xb[t]->ds), acc[p][t]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + t * ldy + p * kPR, rmask[p], acc[p][t]);
}

// ---- K-quants and IQ4_XS: 256-element super-blocks, integer sub-block scales
//
// Every element is an unsigned code u (0..255) with w = d * sc_j * (u - off) - dmin * m_j for its
// sub-block j: Q4_K / Q5_K (8 sub-blocks of 32; off 0, mins), IQ4_XS (8 of 32; its levels + 128,
// off 128), Q6_K (16 of 16; q + 32, off 32), Q3_K (16 of 16; q + 4, off 4), Q2_K (16 of 16; off 0,
// mins). A panel of nb super-blocks: codes (nb, subs, groups, 16 rows, 4), sc (nb, subs, 16) int32
// scales, cp (nb, subs / 2, 16) int32 holding the int16 correction factors of sub-blocks 2p and
// 2p + 1 (the mins, or the scales for an offset: off is a power of two), d and dmin (nb, 16).

template <GgmlType T>
constexpr int k_subs() {
  return T == GgmlType::Q4_K || T == GgmlType::Q5_K || T == GgmlType::IQ4_XS ? 8 : 16;
}
template <GgmlType T>
constexpr bool k_has_min() {
  return T == GgmlType::Q4_K || T == GgmlType::Q5_K || T == GgmlType::Q2_K;
}
// log2 of the code offset (types without mins)
template <GgmlType T>
constexpr int k_off_shift() {
  return T == GgmlType::IQ4_XS ? 7 : T == GgmlType::Q6_K ? 5 : T == GgmlType::Q3_K ? 2 : 0;
}
template <GgmlType T>
constexpr size_t k_block_bytes() {
  return T == GgmlType::Q2_K ? sizeof(BlockQ2_K) : T == GgmlType::Q3_K ? sizeof(BlockQ3_K)
       : T == GgmlType::Q4_K ? sizeof(BlockQ4_K) : T == GgmlType::Q5_K ? sizeof(BlockQ5_K)
       : T == GgmlType::Q6_K ? sizeof(BlockQ6_K) : sizeof(BlockIQ4_XS);
}
// The super-block types: those whose activations are 256-element blocks.
template <GgmlType T>
constexpr bool k_panel() {
  return act_format(T) == ActFormat::q8k;
}

// One row's super-block b: its 256 codes in element order into tr, its scales, correction
// factors, d and dmin.
template <GgmlType T>
inline void unpack_k(const uint8_t* p, uint8_t* tr, int16_t* scale, int16_t* corr, float* d, float* dmin) {
  constexpr int subs = k_subs<T>();
  if constexpr (T == GgmlType::Q4_K || T == GgmlType::Q5_K) {
    using B = std::conditional_t<T == GgmlType::Q4_K, BlockQ4_K, BlockQ5_K>;
    const B* blk = reinterpret_cast<const B*>(p);
    for (int j = 0; j < subs; ++j) {
      uint8_t sc, mn;
      k_scale_min(blk->scales, j, &sc, &mn);
      scale[j] = sc;
      corr[j] = mn;
    }
    *d = f16(blk->d);
    *dmin = f16(blk->dmin);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (T == GgmlType::Q5_K) qh = load32(blk->qh);
    for (int c = 0; c < 4; ++c) {
      const __m256i q = load32(blk->qs + 32 * c);
      __m256i lo = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F));
      if constexpr (T == GgmlType::Q5_K) {
        const __m256i x10 = _mm256_set1_epi8(0x10);
        lo = _mm256_mask_add_epi8(lo, _mm256_test_epi8_mask(qh, _mm256_set1_epi8(char(1 << (2 * c)))), lo, x10);
        hi = _mm256_mask_add_epi8(hi, _mm256_test_epi8_mask(qh, _mm256_set1_epi8(char(2 << (2 * c)))), hi, x10);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(tr + 64 * c), lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(tr + 64 * c + 32), hi);
    }
  } else if constexpr (T == GgmlType::IQ4_XS) {
    const BlockIQ4_XS* blk = reinterpret_cast<const BlockIQ4_XS*>(p);
    alignas(16) int16_t ls[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(ls), iq4xs_scales16(blk));
    for (int j = 0; j < subs; ++j) scale[j] = corr[j] = ls[j];
    *d = f16(blk->d);
    *dmin = 0;
    for (int j = 0; j < subs; ++j) {
      const __m256i v = _mm256_shuffle_epi8(iq4nl_table(), unpack_nibbles16(blk->qs + 16 * j));
      _mm256_store_si256(reinterpret_cast<__m256i*>(tr + 32 * j), _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80))));
    }
  } else if constexpr (T == GgmlType::Q6_K) {
    const BlockQ6_K* blk = reinterpret_cast<const BlockQ6_K*>(p);
    for (int j = 0; j < subs; ++j) scale[j] = corr[j] = blk->scales[j];
    *d = f16(blk->d);
    *dmin = 0;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i qh = load32(blk->qh + 32 * h);
      for (int k = 0; k < 4; ++k) {  // elements 128h + 32k .. +32
        const __m256i ql = load32(blk->ql + 64 * h + 32 * (k & 1));
        const __m256i lo = k < 2 ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
        __m256i hb;
        switch (k) {
          case 0: hb = _mm256_slli_epi16(qh, 4); break;
          case 1: hb = _mm256_slli_epi16(qh, 2); break;
          case 2: hb = qh; break;
          default: hb = _mm256_srli_epi16(qh, 2); break;
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(tr + 128 * h + 32 * k), _mm256_or_si256(lo, _mm256_and_si256(hb, m30)));
      }
    }
  } else {
    static_assert(T == GgmlType::Q2_K || T == GgmlType::Q3_K);
    constexpr bool q3 = T == GgmlType::Q3_K;
    using B = std::conditional_t<q3, BlockQ3_K, BlockQ2_K>;
    const B* blk = reinterpret_cast<const B*>(p);
    *d = f16(blk->d);
    __m256i hm = _mm256_setzero_si256();
    if constexpr (q3) {
      int8_t sc[16];
      q3k_scales(blk->scales, sc);
      for (int j = 0; j < subs; ++j) scale[j] = corr[j] = sc[j];
      *dmin = 0;
      hm = load32(blk->hmask);
    } else {
      for (int j = 0; j < subs; ++j) {
        scale[j] = int16_t(blk->scales[j] & 0xF);
        corr[j] = int16_t(blk->scales[j] >> 4);
      }
      *dmin = f16(blk->dmin);
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i q = load32(blk->qs + 32 * h);
      for (int k = 0; k < 4; ++k) {
        __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), _mm256_set1_epi8(3));
        // Q3_K: + 4 where the high bit is set (q + 4 = low bits + 4 * high bit)
        if constexpr (q3)
          u = _mm256_mask_add_epi8(u, _mm256_test_epi8_mask(hm, _mm256_set1_epi8(char(1 << (4 * h + k)))), u,
                                   _mm256_set1_epi8(4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(tr + 128 * h + 32 * k), u);
      }
    }
  }
}

template <GgmlType T>
void pack_k(const uint8_t* w, size_t ws, int nr, int64_t nb, uint8_t* codes, int32_t* sc, int32_t* cp, float* d,
            float* dmin) {
  constexpr int subs = k_subs<T>();
  alignas(64) uint8_t tmp[kPR * kQKK];
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < kPR; ++r) {
      uint8_t* tr = tmp + r * kQKK;
      int16_t scale[subs] = {}, corr[subs] = {};
      float dr = 0, mr = 0;
      if (r < nr) unpack_k<T>(w + size_t(r) * ws + size_t(b) * k_block_bytes<T>(), tr, scale, corr, &dr, &mr);
      else std::memset(tr, 0, kQKK);
      for (int j = 0; j < subs; ++j) sc[(b * subs + j) * kPR + r] = scale[j];
      for (int q = 0; q < subs / 2; ++q)
        cp[(b * subs / 2 + q) * kPR + r] = int32_t(uint32_t(uint16_t(corr[2 * q])) | (uint32_t(uint16_t(corr[2 * q + 1])) << 16));
      d[b * kPR + r] = dr;
      dmin[b * kPR + r] = mr;
    }
    interleave16(tmp, kQKK, codes + size_t(b) * kPR * kQKK);
  }
}

// The 16-row interleave of a 256-byte row is [64 groups][16 rows][4]; a sub-block of 32 (16)
// elements is 8 (4) consecutive groups, so the per-sub-block loops walk the codes contiguously.
template <int P, int NT>
inline void dots_subblock(const uint8_t* const* cb, size_t off, const BlockQ8K* const* xb, int first_byte, int groups,
                          __m512i (*ia)[NT]) {
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < NT; ++t) ia[p][t] = _mm512_setzero_si512();
  for (int g = 0; g < groups; ++g) {
    __m512i wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm512_load_si512(cb[p] + off + 64 * g);
    for (int t = 0; t < NT; ++t) {
      const __m512i xv = bcast32(xb[t]->qs + first_byte + 4 * g);
      for (int p = 0; p < P; ++p) ia[p][t] = _mm512_dpbusd_epi32(ia[p][t], wv[p], xv);
    }
  }
}

template <GgmlType T, int P, int NT>
void panel_tile_k(const uint8_t* const* codes, const int32_t* const* sc, const int32_t* const* cp,
                  const float* const* d, const float* const* dmin, const uint8_t* x, size_t xs, int64_t nb,
                  float* y, int64_t ldy, const __mmask16* rmask) {
  constexpr int subs = k_subs<T>(), len = kQKK / subs;
  __m512 acc[P][NT];
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < NT; ++t) acc[p][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ8K* xb[NT];
    for (int t = 0; t < NT; ++t) xb[t] = reinterpret_cast<const BlockQ8K*>(x + size_t(t) * xs) + b;
    __m512i isum[P][NT], ia[P][NT];
    for (int p = 0; p < P; ++p)
      for (int t = 0; t < NT; ++t) isum[p][t] = _mm512_setzero_si512();
    for (int j = 0; j < subs; ++j) {
      dots_subblock<P, NT>(codes, size_t(b) * kPR * kQKK + size_t(j) * len * 16, xb, len * j, len / 4, ia);
      // exact: per sub-block |sc| * u * 127 * len <= 2^25 (IQ4_XS: 32 * 255 * 127 * 32), 16 of them < 2^31
      for (int p = 0; p < P; ++p) {
        const __m512i sv = _mm512_load_si512(sc[p] + (b * subs + j) * kPR);
        for (int t = 0; t < NT; ++t) isum[p][t] = _mm512_add_epi32(isum[p][t], _mm512_mullo_epi32(ia[p][t], sv));
      }
    }
    // sum_j c_j * (sum of x over sub-block j), two sub-blocks per vpdpwssd
    for (int p = 0; p < P; ++p)
      for (int t = 0; t < NT; ++t) ia[p][t] = _mm512_setzero_si512();
    for (int q = 0; q < subs / 2; ++q)
      for (int t = 0; t < NT; ++t) {
        const __m512i xv = bcast32(subs == 8 ? xb[t]->bsum32 + 2 * q : xb[t]->bsum16 + 2 * q);
        for (int p = 0; p < P; ++p)
          ia[p][t] = _mm512_dpwssd_epi32(ia[p][t], _mm512_load_si512(cp[p] + (b * subs / 2 + q) * kPR), xv);
      }
    for (int p = 0; p < P; ++p) {
      const __m512 dv = _mm512_load_ps(d[p] + b * kPR);
      for (int t = 0; t < NT; ++t) {
        const __m512 xd = _mm512_set1_ps(xb[t]->d);
        if constexpr (k_has_min<T>()) {
          acc[p][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[p][t]), _mm512_mul_ps(dv, xd), acc[p][t]);
          acc[p][t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ia[p][t]), _mm512_mul_ps(_mm512_load_ps(dmin[p] + b * kPR), xd), acc[p][t]);
        } else {
          // codes are q + off: subtract off * sum_j sc_j * sum(x in sub-block j)
          const __m512i tot = _mm512_sub_epi32(isum[p][t], _mm512_slli_epi32(ia[p][t], k_off_shift<T>()));
          acc[p][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(dv, xd), acc[p][t]);
        }
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + t * ldy + p * kPR, rmask[p], acc[p][t]);
}

// ---- driver: pack the call's rows once, then token blocks x panels x token tiles

// Bytes of packed data per panel and per block (codes + per-row metadata).
template <GgmlType T>
constexpr size_t panel_block_bytes() {
  if constexpr (k_panel<T>()) return kPR * (kQKK + 4 * (k_subs<T>() + k_subs<T>() / 2 + 2));
  else return kPR * (kQK + 4 * 2);
}

template <GgmlType T>
struct Panel {
  const uint8_t* codes;
  const int32_t* i0;  // super-block types: sub-block scales
  const int32_t* i1;  // super-block types: correction factor pairs
  const float* f0;    // d
  const float* f1;    // m (32-element types) or dmin (super-block types)
};

template <GgmlType T>
Panel<T> panel_at(uint8_t* base, int64_t nb) {
  // layout per panel: codes, then the int32 fields, then the float fields (all 64-byte multiples)
  const size_t bs = k_panel<T>() ? kQKK : kQK;
  Panel<T> p{};
  uint8_t* c = base;
  p.codes = c;
  c += size_t(nb) * kPR * bs;
  if constexpr (k_panel<T>()) {
    p.i0 = reinterpret_cast<const int32_t*>(c);
    c += size_t(nb) * k_subs<T>() * kPR * 4;
    p.i1 = reinterpret_cast<const int32_t*>(c);
    c += size_t(nb) * (k_subs<T>() / 2) * kPR * 4;
  }
  p.f0 = reinterpret_cast<const float*>(c);
  c += size_t(nb) * kPR * 4;
  p.f1 = reinterpret_cast<const float*>(c);
  return p;
}

template <GgmlType T, int P, int NT>
inline void panel_tile(const Panel<T>* pn, const uint8_t* x, size_t xs, int64_t nb, float* y, int64_t ldy,
                       const __mmask16* rm) {
  const uint8_t* codes[P];
  const int32_t *i0[P], *i1[P];
  const float *f0[P], *f1[P];
  for (int p = 0; p < P; ++p) {
    codes[p] = pn[p].codes;
    i0[p] = pn[p].i0;
    i1[p] = pn[p].i1;
    f0[p] = pn[p].f0;
    f1[p] = pn[p].f1;
  }
  if constexpr (k_panel<T>())
    panel_tile_k<T, P, NT>(codes, i0, i1, f0, f1, x, xs, nb, y, ldy, rm);
  else
    panel_tile32<T, P, NT>(codes, f0, f1, x, xs, nb, y, ldy, rm);
}

template <GgmlType T, int P, int NT>
void panel_tile_tail(int nt, const Panel<T>* pn, const uint8_t* x, size_t xs, int64_t nb, float* y, int64_t ldy,
                     const __mmask16* rm) {
  if constexpr (NT > 1) {
    if (nt < NT) return panel_tile_tail<T, P, NT - 1>(nt, pn, x, xs, nb, y, ldy, rm);
  }
  panel_tile<T, P, NT>(pn, x, xs, nb, y, ldy, rm);
}

// Rows packed at a time: the packed rows (~1.1-1.4 bytes per weight) and a 64-token block of
// activations stay in the 1 MiB L2 together, and the buffer stays bounded when one call gets a
// huge row range (a single thread over a 262144-row output matrix).
constexpr size_t kPackBytes = size_t(384) << 10;

template <GgmlType T>
void gemm_panels(const uint8_t* w, size_t ws, int64_t nr, const uint8_t* x, size_t xs, int64_t nt, int64_t n_in,
                 float* y, int64_t ldy) {
  const int64_t nb = n_in / (k_panel<T>() ? kQKK : kQK);
  const size_t pbytes = size_t(nb) * panel_block_bytes<T>();
  // whole 2-panel tiles per group, at least one
  const int64_t group_panels = std::max<int64_t>(kPP, int64_t(kPackBytes / pbytes) / kPP * kPP);
  const int64_t n_panels_all = (nr + kPR - 1) / kPR;
  thread_local AlignedBuf<uint8_t> buf;
  const size_t need = pbytes * size_t(std::min(group_panels, n_panels_all));
  if (buf.size() < need) buf.resize(need);
  for (int64_t g0 = 0; g0 < n_panels_all; g0 += group_panels) {
    const int64_t n_panels = std::min(group_panels, n_panels_all - g0);
    const int64_t r0 = g0 * kPR;  // first row of the group
    for (int64_t pi = 0; pi < n_panels; ++pi) {
      const Panel<T> p = panel_at<T>(buf.data() + size_t(pi) * pbytes, nb);
      const uint8_t* wr = w + size_t(r0 + pi * kPR) * ws;
      const int rows = int(std::min<int64_t>(kPR, nr - r0 - pi * kPR));
      if constexpr (k_panel<T>())
        pack_k<T>(wr, ws, rows, nb, const_cast<uint8_t*>(p.codes), const_cast<int32_t*>(p.i0),
                  const_cast<int32_t*>(p.i1), const_cast<float*>(p.f0), const_cast<float*>(p.f1));
      else
        pack32<T>(wr, ws, rows, nb, const_cast<uint8_t*>(p.codes), const_cast<float*>(p.f0), const_cast<float*>(p.f1));
    }
    for (int64_t t0 = 0; t0 < nt; t0 += kTokBlock) {
      const int64_t t1 = std::min<int64_t>(nt, t0 + kTokBlock);
      for (int64_t pi = 0; pi < n_panels; pi += kPP) {
        const int np = int(std::min<int64_t>(kPP, n_panels - pi));
        Panel<T> pn[kPP];
        __mmask16 rm[kPP];
        for (int q = 0; q < np; ++q) {
          pn[q] = panel_at<T>(buf.data() + size_t(pi + q) * pbytes, nb);
          const int rows = int(std::min<int64_t>(kPR, nr - r0 - (pi + q) * kPR));
          rm[q] = __mmask16((1u << rows) - 1);
        }
        float* yp = y + r0 + pi * kPR;
        constexpr int kPT = panel_tokens<T>();
        for (int64_t t = t0; t < t1; t += kPT) {
          const int n = int(std::min<int64_t>(kPT, t1 - t));
          if (np == kPP) panel_tile_tail<T, kPP, kPT>(n, pn, x + size_t(t) * xs, xs, nb, yp + t * ldy, ldy, rm);
          else panel_tile_tail<T, 1, kPT>(n, pn, x + size_t(t) * xs, xs, nb, yp + t * ldy, ldy, rm);
        }
      }
    }
  }
}

template <GgmlType T, int NR, int NT>
void gemm_any(const uint8_t* w, size_t ws, int64_t nr, const uint8_t* x, size_t xs, int64_t nt, int64_t n_in,
              float* y, int64_t ldy) {
  if (nt >= kPanelMinTokens) gemm_panels<T>(w, ws, nr, x, xs, nt, n_in, y, ldy);
  else gemm<T, NR, NT>(w, ws, nr, x, xs, nt, n_in, y, ldy);
}

}  // namespace

MatmulTileFn panel_kernel_for(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return gemm_any<GgmlType::Q4_0, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q4_1: return gemm_any<GgmlType::Q4_1, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q5_0: return gemm_any<GgmlType::Q5_0, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q5_1: return gemm_any<GgmlType::Q5_1, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q8_0: return gemm_any<GgmlType::Q8_0, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::IQ4_NL: return gemm_any<GgmlType::IQ4_NL, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::MXFP4: return gemm_any<GgmlType::MXFP4, KVQ_NR_32, KVQ_NT_32>;
    case GgmlType::Q4_K: return gemm_any<GgmlType::Q4_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::Q5_K: return gemm_any<GgmlType::Q5_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::Q6_K: return gemm_any<GgmlType::Q6_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::Q2_K: return gemm_any<GgmlType::Q2_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::Q3_K: return gemm_any<GgmlType::Q3_K, KVQ_NR_K, KVQ_NT_K>;
    case GgmlType::IQ4_XS: return gemm_any<GgmlType::IQ4_XS, KVQ_NR_K, KVQ_NT_K>;
    default: return kernel_for(t);
  }
}

}  // namespace x86_avx512

MatmulTileFn matmul_kernel_avx512(GgmlType t) { return x86_avx512::panel_kernel_for(t); }
MatmulTileFn matmul_kernel_avx512_streaming(GgmlType t) { return x86_avx512::kernel_for(t); }

}  // namespace kvq
