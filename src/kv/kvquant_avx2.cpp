// AVX2 KVQuant score kernel: each key is dequantized (8 codes per byte of each bit plane, spread
// by a table; the 16-entry codebook lookup is two vpermps blended on bit 3 of the code), split into pair order,
// patched with its outliers, turned by R(t) and dotted with every query row.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/dtypes.h"
#include "kv/bitplanes_avx2.h"
#include "kv/grouped_common.h"
#include "kv/kvquant.h"
#include "kv/sincos_poly.h"

namespace kvq {

namespace {

// Byte b -> 8 bytes, byte i = bit i of b: a bit plane's byte spread over its 8 channels.
struct BitSpread {
  uint64_t t[256];
  constexpr BitSpread() : t() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) t[b] |= uint64_t((b >> i) & 1) << (8 * i);
  }
};
constexpr BitSpread kBitSpread;

// Byte b -> its even bits spread over bytes 0..3 and its odd bits over bytes 4..7: a plane byte of
// 4 adjacent RoPE pairs split into the pairs' a- and b-elements while still codes.
struct PairSpread {
  uint64_t t[256];
  constexpr PairSpread() : t() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 4; ++i)
        t[b] |= (uint64_t((b >> (2 * i)) & 1) << (8 * i)) | (uint64_t((b >> (2 * i + 1)) & 1) << (32 + 8 * i));
  }
};
constexpr PairSpread kPairSpread;

// Codes (one byte each) as codebook values times the channel scale plus mid.
template <int bits>
inline __m256 lookup8(uint64_t codes, __m256 cb_lo, __m256 cb_hi, const float* sc, const float* md) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(codes)));
  __m256 val = _mm256_permutevar8x32_ps(cb_lo, v);
  if constexpr (bits == 4)  // bit 3 moved to the sign bit selects the high half
    val = _mm256_blendv_ps(val, _mm256_permutevar8x32_ps(cb_hi, v), _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
  return _mm256_fmadd_ps(val, _mm256_loadu_ps(sc), _mm256_loadu_ps(md));
}

// 8 channels 8k..8k+7 of one row, dequantized. The codes are gathered in a general register (one
// table load per plane) and widened once: the vector ports see 2 ops per 8 codes instead of 5 per
// plane.
template <int bits>
inline __m256 dequant8(const uint8_t* planes, int pb, int k, __m256 cb_lo, __m256 cb_hi, const float* sc,
                       const float* md) {
  uint64_t codes = 0;
  for (int j = 0; j < bits; ++j) codes |= kBitSpread.t[planes[j * pb + k]] << j;
  return lookup8<bits>(codes, cb_lo, cb_hi, sc + 8 * k, md + 8 * k);
}

constexpr int kSub = 8;  // tokens dequantized before their outliers are patched: (kSub, head_dim) floats in L1

// 32 channels at a time in vector registers: the codes from the planes by bitplane_codes32_avx2
// (kv/bitplanes_avx2.h) in an order chosen per chunk, the codebook values by VPSHUFB on the
// entries' 4 bytes and two rounds of unpacks, which leave in float vector r the code bytes
// 4r..4r+3 (low lane) and 16+4r..16+4r+3 (high lane); the order is chosen so that vector r holds
// 8 consecutive score positions.
struct Chunk32 {
  alignas(32) uint8_t rep[32], bit[32];
  // target(r, i): channel (of the chunk) that lands in element i of float vector r
  template <class F>
  constexpr explicit Chunk32(F target) : rep(), bit() {
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 8; ++i) {
        const int p = i < 4 ? 4 * r + i : 16 + 4 * r + (i - 4), ch = target(r, i);
        rep[p] = uint8_t(ch / 8);
        bit[p] = uint8_t(1u << (ch % 8));
      }
  }
};
// Channels in order: vector r = channels 8r..8r+7.
constexpr Chunk32 kChunkIdentity([](int r, int i) { return 8 * r + i; });
// Adjacent RoPE pairs 0..15 of the chunk: vectors 0, 1 = their a-elements (channels 2i), 2, 3 = b.
constexpr Chunk32 kChunkPairs([](int r, int i) { return 16 * (r % 2) + 2 * i + r / 2; });

// f[r] = codebook[code] for the 32 codes (order above); cbb[k]: byte k of the 16 entries, both lanes.
inline void values32(__m256i codes, const __m256i* cbb, __m256* f) {
  const __m256i b0 = _mm256_shuffle_epi8(cbb[0], codes), b1 = _mm256_shuffle_epi8(cbb[1], codes);
  const __m256i b2 = _mm256_shuffle_epi8(cbb[2], codes), b3 = _mm256_shuffle_epi8(cbb[3], codes);
  const __m256i lo01 = _mm256_unpacklo_epi8(b0, b1), hi01 = _mm256_unpackhi_epi8(b0, b1);
  const __m256i lo23 = _mm256_unpacklo_epi8(b2, b3), hi23 = _mm256_unpackhi_epi8(b2, b3);
  f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(lo01, lo23));
  f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(lo01, lo23));
  f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(hi01, hi23));
  f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(hi01, hi23));
}

// 32 channels from channel ch0 (a multiple of 8) into kp at the score positions pos[r] .. +7 of
// vector r; sc and md in score order.
template <int bits>
inline void dequant32(const uint8_t* row, int pb, int ch0, const Chunk32& ck, const __m256i* cbb, const int* pos,
                      const float* sc, const float* md, float* kp) {
  const __m256i codes =
      bitplane_codes32_avx2<bits>(row, pb, ch0 / 8, _mm256_load_si256(reinterpret_cast<const __m256i*>(ck.rep)),
                                  _mm256_load_si256(reinterpret_cast<const __m256i*>(ck.bit)));
  __m256 f[4];
  values32(codes, cbb, f);
  for (int r = 0; r < 4; ++r)
    _mm256_store_ps(kp + pos[r], _mm256_fmadd_ps(f[r], _mm256_loadu_ps(sc + pos[r]), _mm256_loadu_ps(md + pos[r])));
}

// Token u's key into kp (head_dim floats, score order), outliers not applied.
template <int bits>
inline void dequant_row(const uint8_t* row, int D, int n_rot, int half, bool lanes, bool neox, const KvquantScoreLayout& l,
                        __m256 cb_lo, __m256 cb_hi, const __m256i* cbb, const float* sc, const float* md, float* kn,
                        float* kp) {
  const int pb = D / 8;
  if (lanes) {  // channel order, then permuted (the lanes order serves the AVX-512 kernel)
    for (int k = 0; k < D / 8; ++k) _mm256_store_ps(kn + 8 * k, dequant8<bits>(row, pb, k, cb_lo, cb_hi, sc, md));
    for (int c = 0; c < D; ++c) kp[l.slot[size_t(c)]] = kn[c];
    return;
  }
  // sc and md are in score order here (halves).
  int k = 0;
  if (!neox) {
    // Channels 32m..32m+31 = pairs 16m..16m+15: a-elements to 16m.., b-elements to half + 16m..
    for (; 8 * k + 32 <= n_rot; k += 4) {
      const int pos[4] = {4 * k, 4 * k + 8, half + 4 * k, half + 4 * k + 8};
      dequant32<bits>(row, pb, 8 * k, kChunkPairs, cbb, pos, sc, md, kp);
    }
    // Channels 16m..16m+15 = pairs 8m..8m+7, split into a- and b-elements as codes (kPairSpread).
    for (; 8 * k < n_rot; k += 2) {
      uint64_t ca = 0, cb = 0;
      for (int j = 0; j < bits; ++j) {
        const uint64_t t0 = kPairSpread.t[row[j * pb + k]], t1 = kPairSpread.t[row[j * pb + k + 1]];
        ca |= ((t0 & 0xffffffffu) | (t1 << 32)) << j;
        cb |= ((t0 >> 32) | (t1 & ~uint64_t(0xffffffffu))) << j;
      }
      _mm256_store_ps(kp + 4 * k, lookup8<bits>(ca, cb_lo, cb_hi, sc + 4 * k, md + 4 * k));
      _mm256_store_ps(kp + half + 4 * k, lookup8<bits>(cb, cb_lo, cb_hi, sc + half + 4 * k, md + half + 4 * k));
    }
  }
  for (; 8 * k + 32 <= D; k += 4) {
    const int pos[4] = {8 * k, 8 * k + 8, 8 * k + 16, 8 * k + 24};
    dequant32<bits>(row, pb, 8 * k, kChunkIdentity, cbb, pos, sc, md, kp);
  }
  for (; k < D / 8; ++k) _mm256_store_ps(kp + 8 * k, dequant8<bits>(row, pb, k, cb_lo, cb_hi, sc, md));
}

// R(t) on 8 pairs: (ka, kb) -> (ka c - kb s, ka s + kb c). The one arithmetic of both the keys
// turned in registers and the keys turned in place, so their scores are the same bit for bit.
inline void turn8(__m256 ka, __m256 kb, const float* rc, const float* rs, __m256& ra, __m256& rb) {
  const __m256 c = _mm256_loadu_ps(rc), s = _mm256_loadu_ps(rs);
  ra = _mm256_fmsub_ps(ka, c, _mm256_mul_ps(kb, s));
  rb = _mm256_fmadd_ps(ka, s, _mm256_mul_ps(kb, c));
}

// Up to four query rows (q: nr rows of D floats in score order) against one key kp: the pairs
// (a-elements at ia, b-elements at ib), turned by (c, s) here when Turn, else already turned in kp
// by the same arithmetic, then the unrotated channels. One summation order either way, and each
// row's sum independent of its neighbours (a missing row is zeros): a query scores the same alone,
// in a group of up to 4 rows or in a larger batch. Row h's score goes to out[h * out_stride + t].
template <bool Turn>
inline void dot4(const float* kp, const float* rc, const float* rs, const float* q, int nr, int D, int n_rot, int half,
                 bool runs, float* out, int out_stride, int t) {
  const float* qr[4];
  for (int h = 0; h < 4; ++h) qr[h] = q + size_t(std::min(h, nr - 1)) * D;
  __m256 a0[4], a1[4];
  for (int h = 0; h < 4; ++h) a0[h] = a1[h] = _mm256_setzero_ps();
  for (int m = 0; m < half; m += 8) {
    const int ia = runs ? 32 * (m / 16) + m % 16 : m, ib = ia + (runs ? 16 : half);
    __m256 ra = _mm256_load_ps(kp + ia), rb = _mm256_load_ps(kp + ib);
    if constexpr (Turn) turn8(ra, rb, rc + m, rs + m, ra, rb);
    for (int h = 0; h < 4; ++h) {
      a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[h] + ia), ra, a0[h]);
      a1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[h] + ib), rb, a1[h]);
    }
  }
  for (int c = n_rot; c < D; c += 16) {
    const __m256 k0 = _mm256_load_ps(kp + c), k1 = _mm256_load_ps(kp + c + 8);
    for (int h = 0; h < 4; ++h) {
      a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[h] + c), k0, a0[h]);
      a1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[h] + c + 8), k1, a1[h]);
    }
  }
  // Two rounds of VHADDPS leave row h's sum in lanes h and 4 + h.
  __m256 r[4];
  for (int h = 0; h < 4; ++h) r[h] = h < nr ? _mm256_add_ps(a0[h], a1[h]) : _mm256_setzero_ps();
  const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
  alignas(16) float sum[4];
  _mm_store_ps(sum, _mm_add_ps(_mm256_castps256_ps128(h4), _mm256_extractf128_ps(h4, 1)));
  for (int h = 0; h < nr; ++h) out[size_t(h) * out_stride + t] = sum[h];
}

template <int bits>
void scores_bits(const KvquantScoreArgs& a, float* out, int out_stride) {
  const int D = a.head_dim, half = a.n_rot / 2;
  alignas(32) float sc[kvg_max_head_dim], md[kvg_max_head_dim];
  for (int k = 0; k < D / 8; ++k) {
    _mm256_store_ps(sc + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.params + 16 * k))));
    _mm256_store_ps(md + 8 * k, _mm256_cvtph_ps(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(a.params + 2 * size_t(D) + 16 * k))));
  }
  const KvquantScoreLayout& l = *a.layout;
  const bool lanes = l.layout == kvquant_layout_lanes;
  if (!lanes && !l.neox && a.n_rot > 0) {
    // Scales and mids into score order, once per call: the rows are split into it as codes.
    alignas(32) float tmp[2 * kvg_max_head_dim];
    std::copy(sc, sc + D, tmp);
    std::copy(md, md + D, tmp + D);
    for (int c = 0; c < a.n_rot; ++c) {
      sc[l.slot[size_t(c)]] = tmp[c];
      md[l.slot[size_t(c)]] = tmp[D + c];
    }
  }
  const __m256 cb_lo = _mm256_loadu_ps(a.codebook), cb_hi = _mm256_loadu_ps(a.codebook + 8);
  __m256i cbb[4];  // byte k of each codebook entry, for VPSHUFB (entries past 2^bits are never indexed)
  {
    alignas(16) uint8_t tb[4][16];
    for (int e = 0; e < 16; ++e) {
      uint32_t u;
      std::memcpy(&u, a.codebook + e, 4);
      for (int k = 0; k < 4; ++k) tb[k][e] = uint8_t(u >> (8 * k));
    }
    for (int k = 0; k < 4; ++k)
      cbb[k] = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(tb[k])));
  }
  alignas(32) float kn[kvg_max_head_dim];
  alignas(32) float kbuf[kSub * kvg_max_head_dim];
  for (int t0 = 0; t0 < a.n; t0 += kSub) {
    const int nt = std::min(kSub, a.n - t0);
    for (int u = 0; u < nt; ++u)
      dequant_row<bits>(a.rows + size_t(t0 + u) * a.row_bytes, D, a.n_rot, half, lanes, l.neox, l, cb_lo, cb_hi, cbb,
                        sc, md, kn, kbuf + size_t(u) * D);
    // Outliers patched after the sub-block's rows were written, so the vector loads below seldom
    // wait on these scalar stores.
    for (int u = 0; u < nt; ++u)
      for (int j = 0; j < a.k; ++j) {
        const size_t e = size_t(t0 + u) * a.k + j;
        kbuf[size_t(u) * D + l.slot[a.oidx[e]]] = _cvtsh_ss(kvg_load_f16(a.ovals, e));
      }
    const bool runs = lanes && !l.neox;  // a-elements in runs of 16, b-elements 16 after
    for (int u = 0; u < nt; ++u) {
      const int t = t0 + u;
      float* kp = kbuf + size_t(u) * D;
      const float* rc = a.rot_c + size_t(t) * a.rot_stride;
      const float* rs = a.rot_s + size_t(t) * a.rot_stride;
      if (a.n_q <= 4) {  // one group of rows: the key is turned in registers, straight into the dots
        dot4<true>(kp, rc, rs, a.q, a.n_q, D, a.n_rot, half, runs, out, out_stride, t);
        continue;
      }
      for (int m = 0; m < half; m += 8) {  // turned in place once for all the groups
        const int ia = runs ? 32 * (m / 16) + m % 16 : m, ib = ia + (runs ? 16 : half);
        __m256 ra, rb;
        turn8(_mm256_load_ps(kp + ia), _mm256_load_ps(kp + ib), rc + m, rs + m, ra, rb);
        _mm256_store_ps(kp + ia, ra);
        _mm256_store_ps(kp + ib, rb);
      }
      for (int i = 0; i < a.n_q; i += 4)
        dot4<false>(kp, rc, rs, a.q + size_t(i) * D, std::min(4, a.n_q - i), D, a.n_rot, half, runs,
                    out + size_t(i) * out_stride, out_stride, t);
    }
  }
}

}  // namespace

// kvquant_prep_scalar for the halves layout (the AVX2 kernel's): a-elements at 0..half-1, b-elements
// at half.., unrotated channels in place; adjacent pairs split with the key kernel's shuffles.
void kvquant_prep_avx2(const float* q, int n_q, int head_dim, int n_rot, const KvquantScoreLayout& l,
                       const float* c, const float* s, float* out) {
  const int D = head_dim, half = n_rot / 2;
  if (l.layout != kvquant_layout_halves || half % 8 != 0) return kvquant_prep_scalar(q, n_q, head_dim, n_rot, l, c, s, out);
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * D;
    float* o = out + size_t(i) * D;
    for (int p = 0; p < half; p += 8) {
      __m256 qa, qb;
      if (l.neox) {
        qa = _mm256_loadu_ps(qi + p);
        qb = _mm256_loadu_ps(qi + half + p);
      } else {
        const __m256 x0 = _mm256_loadu_ps(qi + 2 * p), x1 = _mm256_loadu_ps(qi + 2 * p + 8);
        qa = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(2, 0, 2, 0))),
                                                    _MM_SHUFFLE(3, 1, 2, 0)));
        qb = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 1, 3, 1))),
                                                    _MM_SHUFFLE(3, 1, 2, 0)));
      }
      const __m256 cv = _mm256_loadu_ps(c + p), sv = _mm256_loadu_ps(s + p);
      _mm256_storeu_ps(o + p, _mm256_fmadd_ps(qa, cv, _mm256_mul_ps(qb, sv)));
      _mm256_storeu_ps(o + half + p, _mm256_fmsub_ps(qb, cv, _mm256_mul_ps(qa, sv)));
    }
    for (int ch = n_rot; ch < D; ++ch) o[ch] = qi[ch];
  }
}

// kvquant_sincos_avx512's evaluation (kv/sincos_poly.h) on 4 doubles, the quadrant from n mod 4
// (n < 2^30 here; larger angles go to libm).
void kvquant_sincos_avx2(long pos, const double* theta, int half, float* c, float* s) {
  const __m256d p = _mm256_set1_pd(double(pos));
  const __m256d two_over_pi = _mm256_set1_pd(kSincosTwoOverPi);
  const __m256d p1 = _mm256_set1_pd(kSincosHalfPi[0]), p2 = _mm256_set1_pd(kSincosHalfPi[1]),
                p3 = _mm256_set1_pd(kSincosHalfPi[2]);
  const __m256d sign = _mm256_set1_pd(-0.0);
  int j = 0;
  for (; j + 4 <= half; j += 4) {
    const __m256d x = _mm256_mul_pd(p, _mm256_loadu_pd(theta + j));
    const __m256d nf = _mm256_mul_pd(x, two_over_pi);
    if (_mm256_movemask_pd(_mm256_cmp_pd(_mm256_andnot_pd(sign, nf), _mm256_set1_pd(1073741824.0), _CMP_NLT_UQ))) {
      kvquant_sincos_scalar(pos, theta + j, 4, c + j, s + j);
      continue;
    }
    const __m256d n = _mm256_round_pd(nf, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(n, p1, x);
    r = _mm256_fnmadd_pd(n, p2, r);
    r = _mm256_fnmadd_pd(n, p3, r);
    const __m256d z = _mm256_mul_pd(r, r);
    __m256d ps = _mm256_set1_pd(kSinTaylor[0]), pc = _mm256_set1_pd(kCosTaylor[0]);
    for (int i = 1; i < 8; ++i) {
      ps = _mm256_fmadd_pd(ps, z, _mm256_set1_pd(kSinTaylor[i]));
      pc = _mm256_fmadd_pd(pc, z, _mm256_set1_pd(kCosTaylor[i]));
    }
    const __m256d sr = _mm256_fmadd_pd(_mm256_mul_pd(ps, z), r, r);
    const __m256d cr = _mm256_fmadd_pd(pc, z, _mm256_set1_pd(1.0));
    // Quadrant q = n mod 4: sin = (q odd ? cos r : sin r), negated for q in {2, 3}; cos = (q odd ?
    // sin r : cos r), negated for q in {1, 2}.
    const __m256i q = _mm256_cvtepi32_epi64(_mm_and_si128(_mm256_cvtpd_epi32(n), _mm_set1_epi32(3)));
    const __m256i one = _mm256_set1_epi64x(1), two = _mm256_set1_epi64x(2);
    const __m256d odd = _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(q, one), one));
    const __m256d neg_s = _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(q, two), two));
    const __m256d neg_c =
        _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(_mm256_add_epi64(q, one), two), two));
    const __m256d so = _mm256_xor_pd(_mm256_blendv_pd(sr, cr, odd), _mm256_and_pd(neg_s, sign));
    const __m256d co = _mm256_xor_pd(_mm256_blendv_pd(cr, sr, odd), _mm256_and_pd(neg_c, sign));
    _mm_storeu_ps(s + j, _mm256_cvtpd_ps(so));
    _mm_storeu_ps(c + j, _mm256_cvtpd_ps(co));
  }
  if (j < half) kvquant_sincos_scalar(pos, theta + j, half - j, c + j, s + j);
}

void kvquant_scores_avx2(const KvquantScoreArgs& a, float* out, int out_stride) {
  if (a.n_rot / 2 % 8 != 0 || a.head_dim > kvg_max_head_dim) return kvquant_scores_scalar(a, out, out_stride);
  switch (a.bits) {
    case 2: return scores_bits<2>(a, out, out_stride);
    case 3: return scores_bits<3>(a, out, out_stride);
    default: return scores_bits<4>(a, out, out_stride);
  }
}

}  // namespace kvq
