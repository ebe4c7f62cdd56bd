// TurboQuant kernels, AVX-512. A 16-channel group of b-bit codes is 2b contiguous bytes of the
// segment's bit stream: one masked load, one vpermb that gives lane i the two bytes holding bits
// [b i, b i + b), one variable shift, and one vpermps into the codebook repeated to 16 entries
// (the repetition makes the next channel's bits above the code irrelevant) decode it.
// Scores finish 16 (token, query) dot products with one horizontal-sum tree; accumulate walks one
// pair of channel groups over all tokens of a tile with the accumulators in registers.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtypes.h"
#include "kv/hsum_avx512.h"
#include "kv/turboquant.h"

namespace kvq {

namespace {

constexpr int kMaxDim = 1024;

inline float load_f16(const uint8_t* p) { return f16_to_f32(uint16_t(p[0] | (p[1] << 8))); }

// Decoder of one segment: constants for its bit width and codebook.
struct Seg {
  int off = 0;      // byte offset of the segment in a record
  int bytes16 = 0;  // 2 * bits: bytes of one 16-channel group
  __mmask16 ld;     // the group's bytes
  __m512i ctrl;     // vpermb: dword lane i <- bytes (b i) / 8 and (b i) / 8 + 1
  __m512i shift;    // lane i: (b i) % 8
  __m512 cb;        // centroid of code k & (2^b - 1) at entry k
  __m512i cb_bf16;  // the same as bf16 words (RNE), 32 entries: bf16 accumulate
  __m512i wctrl;    // vpermb for 32 channels as words: word lane j <- bytes (b j) / 8, + 1
  __m512i wshift;   // word lane j: (b j) % 8
  __mmask16 ld32;   // the 4b bytes of 32 channels
};

inline uint16_t bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // centroids: finite
}

Seg make_seg(int off, int bits, const float* cb16) {
  Seg s;
  s.off = off;
  s.bytes16 = 2 * bits;
  s.ld = __mmask16((1u << (2 * bits)) - 1);
  alignas(64) uint8_t ctrl[64] = {};
  alignas(64) int32_t sh[16];
  alignas(64) float tb[16];
  for (int i = 0; i < 16; ++i) {
    const int bit = bits * i;
    ctrl[4 * i] = uint8_t(bit / 8);
    ctrl[4 * i + 1] = uint8_t(bit / 8 + 1);  // at most byte 2b: zero from the masked load
    sh[i] = bit % 8;
    tb[i] = cb16[i & ((1 << bits) - 1)];
  }
  s.ctrl = _mm512_load_si512(ctrl);
  s.shift = _mm512_load_si512(sh);
  s.cb = _mm512_load_ps(tb);
  alignas(64) uint16_t tw[32];
  for (int k = 0; k < 32; ++k) tw[k] = bf16_rne(cb16[k & ((1 << bits) - 1)]);
  s.cb_bf16 = _mm512_load_si512(tw);
  alignas(64) uint8_t wc[64];
  alignas(64) int16_t ws[32];
  for (int j = 0; j < 32; ++j) {
    const int bit = bits * j;
    wc[2 * j] = uint8_t(bit / 8);
    wc[2 * j + 1] = uint8_t(bit / 8 + 1);  // at most byte 4b: zero from the masked load
    ws[j] = int16_t(bit % 8);
  }
  s.wctrl = _mm512_load_si512(wc);
  s.wshift = _mm512_load_si512(ws);
  s.ld32 = __mmask16(bits == 4 ? 0xffffu : (1u << (4 * bits)) - 1);
  return s;
}

// Centroids of group g (16 channels) of the segment in record `rec`.
inline __m512 decode16(const uint8_t* rec, int g, const Seg& s) {
  const __m128i raw = _mm_maskz_loadu_epi8(s.ld, rec + s.off + s.bytes16 * g);
  const __m512i bytes = _mm512_permutexvar_epi8(s.ctrl, _mm512_zextsi128_si512(raw));
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, s.shift), s.cb);
}

// bf16 centroids of channels [16 gg, 16 gg + 32) of the segment in record `rec` (words).
inline __m512i decode32_bf16(const uint8_t* rec, int gg, const Seg& s) {
  const __m128i raw = _mm_maskz_loadu_epi8(s.ld32, rec + s.off + s.bytes16 * gg);
  const __m512i idx = _mm512_srlv_epi16(_mm512_permutexvar_epi8(s.wctrl, _mm512_zextsi128_si512(raw)), s.wshift);
  return _mm512_permutexvar_epi16(idx, s.cb_bf16);
}

inline __mmask16 load_mask(const uint8_t* p) {
  uint16_t w;
  std::memcpy(&w, p, 2);
  return __mmask16(w);
}

// 4-bit codes, 32 channels (16 bytes) at once: vpmovzxbd puts byte j = (channel 2j | channel
// 2j+1 << 4) in lane j, so the even channels come out of one vpermps and the odd ones out of a
// shift and another, without the byte permute. The even/odd split is undone on the other side:
// queries are reordered once per call, accumulators around a tile.
inline bool nibble_pair(const TqLayout& l, int g) {  // groups g, g+1 form one such step
  const int g_hi = l.n_hi / 16;
  if (g < g_hi) return l.bits_hi == 4 && g % 2 == 0 && g + 1 < g_hi;
  return l.bits_lo == 4 && (g - g_hi) % 2 == 0 && g + 1 < l.dim / 16;
}

inline void decode_nibble_pair(const uint8_t* p, __m512 cb, __m512& even, __m512& odd) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  even = _mm512_permutexvar_ps(x, cb);
  odd = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), cb);
}

inline __m512i idx_even() { return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30); }
inline __m512i idx_odd() { return _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31); }
inline __m512i idx_inter_lo() { return _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23); }
inline __m512i idx_inter_hi() { return _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31); }

// Tiles of TT tokens x NQ query rows finish 16 sums with one hsum16 tree, accumulator k = tt * NQ
// + i landing in lane 4 * (k % 4) + k / 4; sel[i] gathers query row i's TT scores into lanes
// 0..TT-1.
template <int NQ, int TT>
inline void hsum_lane_selectors(__m512i* sel) {
  for (int i = 0; i < NQ; ++i) {
    alignas(64) int32_t idx[16] = {};
    for (int tt = 0; tt < TT; ++tt) {
      const int k = tt * NQ + i;
      idx[tt] = 4 * (k % 4) + k / 4;
    }
    sel[i] = _mm512_load_si512(idx);
  }
}

template <int NQ>
void scores_chunk(const TqKernelArgs& a, const float* qp, int qp_stride, const uint8_t* recs, int n,
                  float* out, int out_stride) {
  constexpr int TT = 16 / NQ;  // tokens per horizontal-sum step: TT * NQ <= 16 accumulators
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  const size_t rb = size_t(l.record_bytes);
  const int g_hi = l.n_hi / 16, g_all = d / 16;
  const Seg hi = make_seg(l.off_hi, l.bits_hi, a.cb_hi);
  const Seg lo = make_seg(l.off_lo, l.n_hi < d ? l.bits_lo : l.bits_hi, a.cb_lo);
  float sq_sum[NQ] = {};
  if (l.qjl)
    for (int i = 0; i < NQ; ++i) {
      __m512 s = _mm512_setzero_ps();
      const float* sq = qp + size_t(i) * size_t(qp_stride) + d;
      for (int g = 0; g < g_all; ++g) s = _mm512_add_ps(s, _mm512_loadu_ps(sq + 16 * g));
      sq_sum[i] = _mm512_reduce_add_ps(s);
    }
  // Rotated queries with every 4-bit channel pair step in (even, odd) order.
  alignas(64) float qr[NQ][kMaxDim];
  for (int i = 0; i < NQ; ++i) {
    const float* q = qp + size_t(i) * size_t(qp_stride);
    for (int g = 0; g < g_all; ++g) {
      if (nibble_pair(l, g)) {
        const __m512 a0 = _mm512_loadu_ps(q + 16 * g), a1 = _mm512_loadu_ps(q + 16 * g + 16);
        _mm512_store_ps(&qr[i][16 * g], _mm512_permutex2var_ps(a0, idx_even(), a1));
        _mm512_store_ps(&qr[i][16 * g + 16], _mm512_permutex2var_ps(a0, idx_odd(), a1));
        ++g;
      } else {
        _mm512_store_ps(&qr[i][16 * g], _mm512_loadu_ps(q + 16 * g));
      }
    }
  }
  __m512i sel[NQ];  // lane tt <- the hsum16 lane of accumulator tt * NQ + i
  hsum_lane_selectors<NQ, TT>(sel);
  // Norms and QJL scales of a chunk of tokens, converted before its tiles: assembling them per
  // tile from 2-byte stores would stall every tile on store-to-load forwarding.
  constexpr int CH = TT * (64 / TT);
  alignas(64) float nrm[CH + 16], rsa[CH + 16];
  for (int t0 = 0; t0 < n; t0 += TT) {
    const int cnt = std::min(TT, n - t0);
    if (t0 % CH == 0) {
      const int m = std::min(CH, n - t0);
      alignas(64) uint16_t nh[CH + 16] = {}, rh[CH + 16] = {};
      for (int t = 0; t < m; ++t) {
        std::memcpy(&nh[t], recs + size_t(t0 + t) * rb, 2);
        if (l.qjl) std::memcpy(&rh[t], recs + size_t(t0 + t) * rb + l.off_qjl, 2);
      }
      const __m512 qs = _mm512_set1_ps(a.qjl_scale);
      for (int t = 0; t < m; t += 16) {
        _mm512_store_ps(nrm + t, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(nh + t))));
        if (l.qjl)
          _mm512_store_ps(rsa + t, _mm512_mul_ps(qs, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(rh + t)))));
      }
    }
    const float* rs = rsa + t0 % CH;
    __m512 acc[16];
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
    // Channel groups outer, tokens inner: each query vector is loaded once per group and tile.
    const uint8_t* rec0 = recs + size_t(t0) * rb;
    for (int g = 0; g < g_all; ++g) {
      const bool in_hi = g < g_hi;
      const Seg& sg = in_hi ? hi : lo;
      const int gg = in_hi ? g : g - g_hi;
      if (nibble_pair(l, g)) {
        __m512 qe[NQ], qo[NQ];
        for (int i = 0; i < NQ; ++i) {
          qe[i] = _mm512_load_ps(&qr[i][16 * g]);
          qo[i] = _mm512_load_ps(&qr[i][16 * g + 16]);
        }
        const uint8_t* p0 = rec0 + sg.off + 8 * gg;
#pragma GCC unroll 16
        for (int tt = 0; tt < TT; ++tt) {
          if (tt >= cnt) break;
          __m512 ve, vo;
          decode_nibble_pair(p0 + size_t(tt) * rb, sg.cb, ve, vo);
          for (int i = 0; i < NQ; ++i)
            acc[tt * NQ + i] = _mm512_fmadd_ps(qo[i], vo, _mm512_fmadd_ps(qe[i], ve, acc[tt * NQ + i]));
        }
        ++g;
        continue;
      }
      __m512 q[NQ];
      for (int i = 0; i < NQ; ++i) q[i] = _mm512_load_ps(&qr[i][16 * g]);
#pragma GCC unroll 16
      for (int tt = 0; tt < TT; ++tt) {
        if (tt >= cnt) break;
        const __m512 v = decode16(rec0 + size_t(tt) * rb, gg, sg);
        for (int i = 0; i < NQ; ++i) acc[tt * NQ + i] = _mm512_fmadd_ps(q[i], v, acc[tt * NQ + i]);
      }
    }
    if (l.qjl) {
#pragma GCC unroll 16
      for (int tt = 0; tt < TT; ++tt) {
        if (tt >= cnt) break;
        // <Sq, sign> = 2 * (sum of Sq where the sign bit is set) - sum of Sq: the masked sum
        // joins the dot product scaled by 2 rs, the constant part is subtracted after the tree.
        const uint8_t* qj = rec0 + size_t(tt) * rb + l.off_qjl;
        __m512 z[NQ];
        for (int i = 0; i < NQ; ++i) z[i] = _mm512_setzero_ps();
        for (int g = 0; g < g_all; ++g) {
          const __mmask16 m = load_mask(qj + 2 + 2 * g);
          for (int i = 0; i < NQ; ++i)
            z[i] = _mm512_mask_add_ps(z[i], m, z[i], _mm512_loadu_ps(qp + size_t(i) * size_t(qp_stride) + d + 16 * g));
        }
        const __m512 two_rs = _mm512_set1_ps(2.f * rs[tt]);
        for (int i = 0; i < NQ; ++i) acc[tt * NQ + i] = _mm512_fmadd_ps(two_rs, z[i], acc[tt * NQ + i]);
      }
    }
    const __m512 h = hsum16_avx512(acc);
    // Per query: its TT sums to lanes 0..TT-1, minus the QJL constant, times the token norms.
    const __mmask16 st = __mmask16((1u << cnt) - 1);
    const __m512 nv = _mm512_maskz_loadu_ps(st, nrm + t0 % CH);
    __m512 rsv = _mm512_setzero_ps();
    if (l.qjl) rsv = _mm512_maskz_loadu_ps(st, rs);
    for (int i = 0; i < NQ; ++i) {
      __m512 v = _mm512_permutexvar_ps(sel[i], h);
      if (l.qjl) v = _mm512_fnmadd_ps(rsv, _mm512_set1_ps(sq_sum[i]), v);
      _mm512_mask_storeu_ps(out + size_t(i) * size_t(out_stride) + size_t(t0), st, _mm512_mul_ps(v, nv));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Scores on int8 (scales and error bound: kTqScoreCbMax in turboquant.h). vpdpbusd does 64
// multiply-adds per instruction against 16 for an FMA. Codebook entries are biased by 128 to
// be unsigned; 128 * sum(Q) per query removes the bias again. The tile, tree and output steps
// are those of the float path above, which remains for queries with a non-finite entry.

// 64 channels of a segment (or its last 16, 32, 48) decoded to biased int8 centroids: vpermb
// gives qword L the b bytes of channels 8L..8L+7, vpmultishiftqb moves each channel's bits to its
// byte, vpshufb looks the low 4 bits up in the codebook (repeated so junk above b bits is inert).
struct BUnit {
  int off;         // byte offset in the record
  int c;           // first channel
  __mmask32 ld;    // bytes to load
  __mmask64 keep;  // channels of this unit (others zero: the query there belongs to another unit)
  int seg;         // 0 high, 1 low
};

struct BSeg {
  __m512i tbl, ctrl, msh;
};

BSeg make_bseg(int bits, const uint8_t* cu) {
  alignas(64) uint8_t tb[64], ctrl[64], msh[64];
  for (int j = 0; j < 64; ++j) {
    const int lane = j / 8, m = j % 8;
    tb[j] = cu[(j % 16) & ((1 << bits) - 1)];
    ctrl[j] = uint8_t(lane * bits + m);
    msh[j] = uint8_t(bits * m);
  }
  return {_mm512_load_si512(tb), _mm512_load_si512(ctrl), _mm512_load_si512(msh)};
}

int add_bunits(int c0, int n, int bits, int off, int seg, BUnit* u) {
  int k = 0;
  for (int c = 0; c < n; c += 64) {
    const int m = std::min(64, n - c);
    const int bytes = m * bits / 8;
    u[k++] = {off + c * bits / 8, c0 + c, __mmask32(bytes >= 32 ? ~0u : (1u << bytes) - 1),
              m == 64 ? ~__mmask64(0) : (__mmask64(1) << m) - 1, seg};
  }
  return k;
}

inline __m512i decode_bunit(const uint8_t* p, const BUnit& u, const BSeg& s) {
  const __m512i raw = _mm512_zextsi256_si512(_mm256_maskz_loadu_epi8(u.ld, p));
  const __m512i codes = _mm512_multishift_epi64_epi8(s.msh, _mm512_permutexvar_epi8(s.ctrl, raw));
  return _mm512_maskz_shuffle_epi8(u.keep, s.tbl, _mm512_and_si512(codes, _mm512_set1_epi8(0x0f)));
}

template <int NQ>
void scores_chunk_i8(const TqKernelArgs& a, const float* qp, int qp_stride, const uint8_t* recs, int n,
                     float* out, int out_stride, const BSeg* segs, float cs) {
  constexpr int TT = 16 / NQ;
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  const size_t rb = size_t(l.record_bytes);
  BUnit units[kMaxDim / 16];
  int n_units = add_bunits(0, l.n_hi, l.bits_hi, l.off_hi, 0, units);
  if (l.n_hi < d) n_units += add_bunits(l.n_hi, d - l.n_hi, l.bits_lo, l.off_lo, 1, units + n_units);
  // Rotated queries as int8, zero-padded by one unit.
  alignas(64) int8_t q8[NQ][kMaxDim + 64];
  float scale[NQ], bias[NQ];
  for (int i = 0; i < NQ; ++i) {
    const float* q = qp + size_t(i) * size_t(qp_stride);
    __m512 m = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(q + c)));
    alignas(64) float mv[16];
    _mm512_store_ps(mv, m);
    const float qmax = *std::max_element(mv, mv + 16);
    const __m512 vi = _mm512_set1_ps(qmax > 0 ? float(kTqScoreQMax) / qmax : 0.f);
    __m512i qsum = _mm512_setzero_si512();
    for (int c = 0; c < d; c += 16) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + c), vi));
      qsum = _mm512_add_epi32(qsum, qi);
      _mm_store_si128(reinterpret_cast<__m128i*>(&q8[i][c]), _mm512_cvtsepi32_epi8(qi));
    }
    std::memset(&q8[i][d], 0, 64);
    scale[i] = qmax > 0 ? qmax / float(kTqScoreQMax) * cs : 0.f;
    alignas(64) int32_t qv[16];
    _mm512_store_si512(qv, qsum);
    int qtot = 0;
    for (int k = 0; k < 16; ++k) qtot += qv[k];
    bias[i] = 128.f * float(qtot) * scale[i];  // the codebook's +128, times sum(Q), scaled
  }
  __m512i sel[NQ];
  hsum_lane_selectors<NQ, TT>(sel);
  constexpr int CH = TT * (64 / TT);
  alignas(64) float nrm[CH + 16];
  for (int t0 = 0; t0 < n; t0 += TT) {
    const int cnt = std::min(TT, n - t0);
    if (t0 % CH == 0) {  // norms of a chunk, converted before its tiles (see the float path)
      const int m = std::min(CH, n - t0);
      alignas(64) uint16_t nh[CH + 16] = {};
      for (int t = 0; t < m; ++t) std::memcpy(&nh[t], recs + size_t(t0 + t) * rb, 2);
      for (int t = 0; t < m; t += 16)
        _mm512_store_ps(nrm + t, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(nh + t))));
    }
    const uint8_t* rec0 = recs + size_t(t0) * rb;
    __m512i acc[16];
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_si512();
    for (int j = 0; j < n_units; ++j) {
      const BUnit& u = units[j];
      const BSeg& sg = segs[u.seg];
      __m512i q[NQ];
      for (int i = 0; i < NQ; ++i) q[i] = _mm512_loadu_si512(&q8[i][u.c]);  // u.c: any multiple of 16
      const uint8_t* p0 = rec0 + u.off;
#pragma GCC unroll 16
      for (int tt = 0; tt < TT; ++tt) {
        if (tt >= cnt) break;
        const __m512i v = decode_bunit(p0 + size_t(tt) * rb, u, sg);
        for (int i = 0; i < NQ; ++i) acc[tt * NQ + i] = _mm512_dpbusd_epi32(acc[tt * NQ + i], v, q[i]);
      }
    }
    __m512 accf[16];
    for (int k = 0; k < 16; ++k) accf[k] = _mm512_cvtepi32_ps(acc[k]);
    const __m512 h = hsum16_avx512(accf);
    const __mmask16 st = __mmask16((1u << cnt) - 1);
    const __m512 nv = _mm512_maskz_loadu_ps(st, nrm + t0 % CH);
    for (int i = 0; i < NQ; ++i) {
      const __m512 v = _mm512_fmsub_ps(_mm512_permutexvar_ps(sel[i], h), _mm512_set1_ps(scale[i]), _mm512_set1_ps(bias[i]));
      _mm512_mask_storeu_ps(out + size_t(i) * size_t(out_stride) + size_t(t0), st, _mm512_mul_ps(v, nv));
    }
  }
}

template <int NQ>
void scores_dispatch(const TqKernelArgs& a, const float* qp, int qp_stride, const uint8_t* recs, int n, float* out,
                     int out_stride, const BSeg* segs, float cs) {
  const int d = a.layout->dim;
  __m512 bad = _mm512_setzero_ps();  // q * 0 is 0 for finite q, NaN for inf / NaN
  for (int i = 0; i < NQ; ++i) {
    const float* q = qp + size_t(i) * size_t(qp_stride);
    for (int c = 0; c < d; c += 16) bad = _mm512_add_ps(bad, _mm512_mul_ps(_mm512_loadu_ps(q + c), _mm512_setzero_ps()));
  }
  // QJL keys stay on floats: their estimator is unbiased, and the rounded codebook would add a
  // fixed (query-correlated) bias that shows up in the unbiasedness test.
  if (a.layout->qjl || _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0)
    return scores_chunk<NQ>(a, qp, qp_stride, recs, n, out, out_stride);
  scores_chunk_i8<NQ>(a, qp, qp_stride, recs, n, out, out_stride, segs, cs);
}

// The int8 codebook tables of the last codebooks seen by this thread: building them takes longer
// than scoring a few tokens, and consecutive calls (blocks of one head) share the codebooks. The
// key is the codebook values themselves, so a codec at a reused address cannot hit a stale entry.
struct I8Tables {
  float cb[2][16] = {};
  int bits[2] = {0, 0};
  BSeg segs[2];
  float cs = 1;
};

const I8Tables& i8_tables(const TqKernelArgs& a) {
  thread_local I8Tables t;
  const TqLayout& l = *a.layout;
  const bool split = l.n_hi < l.dim;
  float cb[2][16];
  std::memcpy(cb[0], a.cb_hi, sizeof cb[0]);
  for (int k = 0; k < 16; ++k) cb[1][k] = split ? a.cb_lo[k] : 0.f;
  const int bits[2] = {l.bits_hi, split ? l.bits_lo : l.bits_hi};
  if (bits[0] == t.bits[0] && bits[1] == t.bits[1] && std::memcmp(cb, t.cb, sizeof cb) == 0) return t;
  float cmax = 0;
  for (int k = 0; k < 16; ++k) cmax = std::max({cmax, std::fabs(cb[0][k]), std::fabs(cb[1][k])});
  t.cs = cmax > 0 ? cmax / float(kTqScoreCbMax) : 1.f;
  for (int s = 0; s < 2; ++s) {
    uint8_t cu[16];
    for (int k = 0; k < 16; ++k) cu[k] = uint8_t(128 + std::lrint(cb[s][k] / t.cs));
    t.segs[s] = make_bseg(bits[s], cu);
    t.bits[s] = bits[s];
  }
  std::memcpy(t.cb, cb, sizeof cb);
  return t;
}

void scores_avx512(const TqKernelArgs& a, const float* qp, int qp_stride, int n_q,
                   const uint8_t* recs, int n, float* out, int out_stride) {
  const I8Tables& tb = i8_tables(a);
  const BSeg* segs = tb.segs;
  const float cs = tb.cs;
  int i = 0;
  for (; i + 4 <= n_q; i += 4)
    scores_dispatch<4>(a, qp + size_t(i) * size_t(qp_stride), qp_stride, recs, n, out + size_t(i) * size_t(out_stride),
                       out_stride, segs, cs);
  const float* q = qp + size_t(i) * size_t(qp_stride);
  float* o = out + size_t(i) * size_t(out_stride);
  switch (n_q - i) {
    case 3: scores_dispatch<3>(a, q, qp_stride, recs, n, o, out_stride, segs, cs); break;
    case 2: scores_dispatch<2>(a, q, qp_stride, recs, n, o, out_stride, segs, cs); break;
    case 1: scores_dispatch<1>(a, q, qp_stride, recs, n, o, out_stride, segs, cs); break;
    default: break;
  }
}

constexpr int kTile = 64;  // tokens whose weights are staged at once

// acc[i * d + c] += sum_t w[i][t] * centroid_t[c] for NQ queries: one or two channel groups at a
// time over all tokens, so the accumulators stay in registers for the whole tile.
template <int NQ>
void accumulate_tile(const TqLayout& l, const Seg& hi, const Seg& lo, size_t rb, const float (*w)[kTile],
                     const uint32_t (*wb)[kTile / 2], const uint8_t* recs, int cnt, float* acc) {
  const int d = l.dim, g_hi = l.n_hi / 16, g_all = d / 16;
  int g = 0;
  for (; g + 2 <= g_all; g += 2) {
    if (g + 4 <= g_all && nibble_pair(l, g) && nibble_pair(l, g + 2)) {
      // 64 channels of 4-bit codes per pass, two tokens per step in bf16 (vdpbf16ps: 32
      // multiply-adds per instruction, fp32 sums; bound in turboquant.h): each token's 32 code
      // bytes widen to words, vpermw looks up even / odd channels, vpermt2w pairs the two
      // tokens' words per channel; the even / odd accumulator order is that of the float path.
      const Seg& s0 = g < g_hi ? hi : lo;
      const int gg0 = g < g_hi ? g : g - g_hi;
      __m512 a[4][NQ];
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 2; ++j) {
          const __m512 x0 = _mm512_loadu_ps(acc + size_t(i) * size_t(d) + 16 * g + 32 * j);
          const __m512 x1 = _mm512_loadu_ps(acc + size_t(i) * size_t(d) + 16 * g + 32 * j + 16);
          a[2 * j][i] = _mm512_permutex2var_ps(x0, idx_even(), x1);
          a[2 * j + 1][i] = _mm512_permutex2var_ps(x0, idx_odd(), x1);
        }
      const uint8_t* p0 = recs + s0.off + 8 * gg0;
      const __m512i tbl = s0.cb_bf16;
      alignas(64) int16_t pl[32];
      for (int k = 0; k < 32; ++k) pl[k] = int16_t(k % 2 ? 32 + k / 2 : k / 2);  // (tok t, tok t+1) of word k/2
      const __m512i pair_lo = _mm512_load_si512(pl);
      const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
      for (int t = 0; t < cnt; t += 2) {
        const __m512i x0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + size_t(t) * rb)));
        const __m512i x1 = t + 1 < cnt ? _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                                             reinterpret_cast<const __m256i*>(p0 + size_t(t + 1) * rb)))
                                       : _mm512_setzero_si512();  // weight 0 there
        const __m512i e0 = _mm512_permutexvar_epi16(x0, tbl), e1 = _mm512_permutexvar_epi16(x1, tbl);
        const __m512i o0 = _mm512_permutexvar_epi16(_mm512_srli_epi16(x0, 4), tbl);
        const __m512i o1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(x1, 4), tbl);
        __m512bh v[4];
        v[0] = __m512bh(_mm512_permutex2var_epi16(e0, pair_lo, e1));
        v[1] = __m512bh(_mm512_permutex2var_epi16(o0, pair_lo, o1));
        v[2] = __m512bh(_mm512_permutex2var_epi16(e0, pair_hi, e1));
        v[3] = __m512bh(_mm512_permutex2var_epi16(o0, pair_hi, o1));
        for (int i = 0; i < NQ; ++i) {
          const __m512bh wi = __m512bh(_mm512_set1_epi32(int(wb[i][t / 2])));
          for (int j = 0; j < 4; ++j) a[j][i] = _mm512_dpbf16_ps(a[j][i], v[j], wi);
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 2; ++j) {
          float* o = acc + size_t(i) * size_t(d) + 16 * g + 32 * j;
          _mm512_storeu_ps(o, _mm512_permutex2var_ps(a[2 * j][i], idx_inter_lo(), a[2 * j + 1][i]));
          _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a[2 * j][i], idx_inter_hi(), a[2 * j + 1][i]));
        }
      g += 2;  // and 2 more by the loop
      continue;
    }
    if (g + 4 <= g_all && !nibble_pair(l, g) && !nibble_pair(l, g + 2) && (g < g_hi) == (g + 1 < g_hi) &&
        (g + 2 < g_hi) == (g + 3 < g_hi)) {
      // 64 channels of other widths in bf16 as the 4-bit path: 32 channels per word decode,
      // vpermt2w pairs two tokens per channel, natural channel order throughout.
      const Seg* su[2];
      int gu[2];
      for (int u = 0; u < 2; ++u) {
        su[u] = g + 2 * u < g_hi ? &hi : &lo;
        gu[u] = g + 2 * u < g_hi ? g + 2 * u : g + 2 * u - g_hi;
      }
      __m512 a[4][NQ];
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 4; ++j) a[j][i] = _mm512_loadu_ps(acc + size_t(i) * size_t(d) + 16 * (g + j));
      alignas(64) int16_t pl[32];
      for (int k = 0; k < 32; ++k) pl[k] = int16_t(k % 2 ? 32 + k / 2 : k / 2);
      const __m512i pair_lo = _mm512_load_si512(pl);
      const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
      for (int t = 0; t < cnt; t += 2) {
        const uint8_t* r0t = recs + size_t(t) * rb;
        __m512bh v[4];
        for (int u = 0; u < 2; ++u) {
          const __m512i c0 = decode32_bf16(r0t, gu[u], *su[u]);
          const __m512i c1 = t + 1 < cnt ? decode32_bf16(r0t + rb, gu[u], *su[u]) : _mm512_setzero_si512();
          v[2 * u] = __m512bh(_mm512_permutex2var_epi16(c0, pair_lo, c1));
          v[2 * u + 1] = __m512bh(_mm512_permutex2var_epi16(c0, pair_hi, c1));
        }
        for (int i = 0; i < NQ; ++i) {
          const __m512bh wi = __m512bh(_mm512_set1_epi32(int(wb[i][t / 2])));
          for (int j = 0; j < 4; ++j) a[j][i] = _mm512_dpbf16_ps(a[j][i], v[j], wi);
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + size_t(i) * size_t(d) + 16 * (g + j), a[j][i]);
      g += 2;
      continue;
    }
    if (g + 4 <= g_all && !nibble_pair(l, g) && !nibble_pair(l, g + 2)) {
      // 64 channels spanning the segment boundary, fp32: one vpermb decode per 16 channels.
      const Seg* sj[4];
      int gj[4];
      for (int j = 0; j < 4; ++j) {
        sj[j] = g + j < g_hi ? &hi : &lo;
        gj[j] = g + j < g_hi ? g + j : g + j - g_hi;
      }
      __m512 a[4][NQ];
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 4; ++j) a[j][i] = _mm512_loadu_ps(acc + size_t(i) * size_t(d) + 16 * (g + j));
      for (int t = 0; t < cnt; ++t) {
        const uint8_t* rec = recs + size_t(t) * rb;
        __m512 v[4];
        for (int j = 0; j < 4; ++j) v[j] = decode16(rec, gj[j], *sj[j]);
        for (int i = 0; i < NQ; ++i) {
          const __m512 wi = _mm512_set1_ps(w[i][t]);
          for (int j = 0; j < 4; ++j) a[j][i] = _mm512_fmadd_ps(wi, v[j], a[j][i]);
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + size_t(i) * size_t(d) + 16 * (g + j), a[j][i]);
      g += 2;
      continue;
    }
    const Seg& s0 = g < g_hi ? hi : lo;
    const Seg& s1 = g + 1 < g_hi ? hi : lo;
    const int gg0 = g < g_hi ? g : g - g_hi, gg1 = g + 1 < g_hi ? g + 1 : g + 1 - g_hi;
    const bool pair4 = nibble_pair(l, g);
    __m512 a0[NQ], a1[NQ];
    for (int i = 0; i < NQ; ++i) {
      a0[i] = _mm512_loadu_ps(acc + size_t(i) * size_t(d) + 16 * g);
      a1[i] = _mm512_loadu_ps(acc + size_t(i) * size_t(d) + 16 * g + 16);
    }
    if (pair4) {  // (even, odd) channels in a0 / a1 during the tile
      for (int i = 0; i < NQ; ++i) {
        const __m512 e = _mm512_permutex2var_ps(a0[i], idx_even(), a1[i]);
        a1[i] = _mm512_permutex2var_ps(a0[i], idx_odd(), a1[i]);
        a0[i] = e;
      }
      const uint8_t* p0 = recs + s0.off + 8 * gg0;
      for (int t = 0; t < cnt; ++t) {
        __m512 v0, v1;
        decode_nibble_pair(p0 + size_t(t) * rb, s0.cb, v0, v1);
        for (int i = 0; i < NQ; ++i) {
          const __m512 wi = _mm512_set1_ps(w[i][t]);
          a0[i] = _mm512_fmadd_ps(wi, v0, a0[i]);
          a1[i] = _mm512_fmadd_ps(wi, v1, a1[i]);
        }
      }
      for (int i = 0; i < NQ; ++i) {
        const __m512 lo16 = _mm512_permutex2var_ps(a0[i], idx_inter_lo(), a1[i]);
        a1[i] = _mm512_permutex2var_ps(a0[i], idx_inter_hi(), a1[i]);
        a0[i] = lo16;
      }
    } else {
    for (int t = 0; t < cnt; ++t) {
      const uint8_t* rec = recs + size_t(t) * rb;
      const __m512 v0 = decode16(rec, gg0, s0), v1 = decode16(rec, gg1, s1);
      for (int i = 0; i < NQ; ++i) {
        const __m512 wi = _mm512_set1_ps(w[i][t]);
        a0[i] = _mm512_fmadd_ps(wi, v0, a0[i]);
        a1[i] = _mm512_fmadd_ps(wi, v1, a1[i]);
      }
    }
    }
    for (int i = 0; i < NQ; ++i) {
      _mm512_storeu_ps(acc + size_t(i) * size_t(d) + 16 * g, a0[i]);
      _mm512_storeu_ps(acc + size_t(i) * size_t(d) + 16 * g + 16, a1[i]);
    }
  }
  if (g < g_all) {
    const Seg& s0 = g < g_hi ? hi : lo;
    const int gg0 = g < g_hi ? g : g - g_hi;
    __m512 a0[NQ];
    for (int i = 0; i < NQ; ++i) a0[i] = _mm512_loadu_ps(acc + size_t(i) * size_t(d) + 16 * g);
    for (int t = 0; t < cnt; ++t) {
      const __m512 v0 = decode16(recs + size_t(t) * rb, gg0, s0);
      for (int i = 0; i < NQ; ++i) a0[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i][t]), v0, a0[i]);
    }
    for (int i = 0; i < NQ; ++i) _mm512_storeu_ps(acc + size_t(i) * size_t(d) + 16 * g, a0[i]);
  }
}

void accumulate_avx512(const TqKernelArgs& a, const float* p, int p_stride, int n_q,
                       const uint8_t* recs, int n, float* acc) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  const size_t rb = size_t(l.record_bytes);
  const Seg hi = make_seg(l.off_hi, l.bits_hi, a.cb_hi);
  const Seg lo = make_seg(l.off_lo, l.n_hi < d ? l.bits_lo : l.bits_hi, a.cb_lo);
  alignas(64) float w[4][kTile];
  alignas(64) uint32_t wb[4][kTile / 2];  // bf16 pairs (token 2p low, 2p + 1 high) of w
  alignas(64) float norms[kTile];
  for (int t0 = 0; t0 < n; t0 += kTile) {
    const int cnt = std::min(kTile, n - t0);
    const uint8_t* r0 = recs + size_t(t0) * rb;
    alignas(64) uint16_t nh[kTile] = {};
    for (int t = 0; t < cnt; ++t) std::memcpy(&nh[t], r0 + size_t(t) * rb, 2);
    for (int t = 0; t < cnt; t += 16)
      _mm512_storeu_ps(norms + t, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(nh + t))));
    for (int i0 = 0; i0 < n_q; i0 += 4) {
      const int nq = std::min(4, n_q - i0);
      for (int i = 0; i < nq; ++i) {
        const float* pi = p + size_t(i0 + i) * size_t(p_stride) + size_t(t0);
        for (int t = 0; t < cnt; ++t) w[i][t] = pi[t] * norms[t];
        for (int t = cnt; t < kTile; ++t) w[i][t] = 0;
        for (int t = 0; t < kTile; t += 16)
          _mm256_store_si256(reinterpret_cast<__m256i*>(&wb[i][t / 2]),
                             __m256i(_mm512_cvtneps_pbh(_mm512_load_ps(&w[i][t]))));
      }
      float* o = acc + size_t(i0) * size_t(d);
      switch (nq) {
        case 4: accumulate_tile<4>(l, hi, lo, rb, w, wb, r0, cnt, o); break;
        case 3: accumulate_tile<3>(l, hi, lo, rb, w, wb, r0, cnt, o); break;
        case 2: accumulate_tile<2>(l, hi, lo, rb, w, wb, r0, cnt, o); break;
        default: accumulate_tile<1>(l, hi, lo, rb, w, wb, r0, cnt, o); break;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Encode: bit-identical to the scalar reference (see TqEncodeFn).

// tq_dot_ref's order: lane l of the 8 doubles sums c % 8 == l; then the fixed tree.
inline double dot_pd(const float* a, const float* b, int n) {
  __m512d s = _mm512_setzero_pd();
  for (int c = 0; c < n; c += 8)
    s = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(a + c)), _mm512_cvtps_pd(_mm256_loadu_ps(b + c)), s);
  alignas(64) double l[8];
  _mm512_store_pd(l, s);
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// In-place unnormalized FWHT, the butterflies of tq_fwht in the same stages (each output is the
// same a + b or a - b of the same inputs, so the result is identical).
void fwht16(float* x, int n) {
  for (int len = 1; len < 16; len <<= 1) {
    alignas(64) int32_t perm[16];
    for (int i = 0; i < 16; ++i) perm[i] = i ^ len;
    const __m512i pi = _mm512_load_si512(perm);
    __mmask16 upper = 0;
    for (int i = 0; i < 16; ++i)
      if (i & len) upper = __mmask16(upper | (1u << i));
    for (int c = 0; c < n; c += 16) {
      const __m512 v = _mm512_loadu_ps(x + c);
      const __m512 p = _mm512_permutexvar_ps(pi, v);
      // lower lane j: x[j] + x[j + len]; upper lane j: x[j - len] - x[j]
      _mm512_storeu_ps(x + c, _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper, p, v));
    }
  }
  for (int len = 16; len < n; len <<= 1)
    for (int i = 0; i < n; i += 2 * len)
      for (int j = i; j < i + len; j += 16) {
        const __m512 va = _mm512_loadu_ps(x + j), vb = _mm512_loadu_ps(x + j + len);
        _mm512_storeu_ps(x + j, _mm512_add_ps(va, vb));
        _mm512_storeu_ps(x + j + len, _mm512_sub_ps(va, vb));
      }
}

// Cell index of 16 values: the number of thresholds below each (branchless binary search over
// the 16 ascending, +inf-padded thresholds; equal to counting them).
inline __m512i quantize16(__m512 y, __m512 bounds) {
  __m512i idx = _mm512_setzero_si512();
  for (int step = 8; step >= 1; step >>= 1) {
    const __m512 th = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(step - 1)), bounds);
    idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(th, y, _CMP_LT_OQ), idx, _mm512_set1_epi32(step));
  }
  return idx;
}

// Codes (n, one per byte) -> the segment bit stream; 16 codes are 2 * bits bytes.
inline void pack16(const uint8_t* c, int bits, uint8_t* out) {
  uint64_t w = 0;
  for (int i = 0; i < 16; ++i) w |= uint64_t(c[i]) << (bits * i);
  std::memcpy(out, &w, size_t(2 * bits));
}

void encode_avx512(const TqEncodeArgs& a, const float* x, uint8_t* rec) {
  const TqLayout& l = *a.layout;
  const int d = l.dim;
  std::memset(rec, 0, size_t(l.record_bytes));
  const double nrm = std::sqrt(dot_pd(x, x, d));
  if (!std::isfinite(nrm)) {
    const uint16_t h = f32_to_f16(float(nrm));
    std::memcpy(rec, &h, 2);
    return;
  }
  if (nrm == 0) return;
  const uint16_t h = f32_to_f16(float(std::min(nrm, 65504.0)));
  std::memcpy(rec, &h, 2);
  alignas(64) float u[kMaxDim];
  const __m512d vn = _mm512_set1_pd(nrm);
  for (int c = 0; c < d; c += 8)
    _mm256_store_ps(u + c, _mm512_cvtpd_ps(_mm512_div_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + c)), vn)));
  if (a.rotation == TqRotationKind::hadamard) {
    for (int c = 0; c < d; c += 16)
      _mm512_store_ps(u + c, _mm512_mul_ps(_mm512_load_ps(u + c), _mm512_loadu_ps(a.signs + c)));
    fwht16(u, d);
    const __m512 s = _mm512_set1_ps(1.f / std::sqrt(float(d)));
    for (int c = 0; c < d; c += 16) _mm512_store_ps(u + c, _mm512_mul_ps(_mm512_load_ps(u + c), s));
  } else {
    alignas(64) float y[kMaxDim];
    for (int r = 0; r < d; ++r) y[r] = float(dot_pd(a.matrix + size_t(r) * size_t(d), u, d));
    std::memcpy(u, y, sizeof(float) * size_t(d));
  }
  const __m512 b_hi = _mm512_loadu_ps(a.bounds_hi), b_lo = _mm512_loadu_ps(a.bounds_lo);
  const __m512 c_hi = _mm512_loadu_ps(a.cb_hi), c_lo = _mm512_loadu_ps(a.cb_lo);
  alignas(64) uint8_t codes[kMaxDim];
  alignas(64) float r[kMaxDim];
  for (int c = 0; c < d; c += 16) {
    const bool is_hi = c < l.n_hi;
    const __m512 y = _mm512_load_ps(u + c);
    const __m512i k = quantize16(y, is_hi ? b_hi : b_lo);
    _mm_store_si128(reinterpret_cast<__m128i*>(codes + c), _mm512_cvtepi32_epi8(k));
    if (l.qjl) _mm512_store_ps(r + c, _mm512_sub_ps(y, _mm512_permutexvar_ps(k, is_hi ? c_hi : c_lo)));
  }
  for (int c = 0; c < l.n_hi; c += 16) pack16(codes + c, l.bits_hi, rec + l.off_hi + (c / 16) * 2 * l.bits_hi);
  for (int c = l.n_hi; c < d; c += 16)
    pack16(codes + c, l.bits_lo, rec + l.off_lo + ((c - l.n_hi) / 16) * 2 * l.bits_lo);
  if (!l.qjl) return;
  const uint16_t hr = f32_to_f16(float(std::sqrt(dot_pd(r, r, d))));
  std::memcpy(rec + l.off_qjl, &hr, 2);
  uint8_t* sg = rec + l.off_qjl + 2;
  for (int j = 0; j < d; ++j)
    if (dot_pd(a.qjl + size_t(j) * size_t(d), r, d) >= 0) sg[j / 8] = uint8_t(sg[j / 8] | (1u << (j % 8)));
}

}  // namespace

const TqKernels& tq_kernels_avx512() {
  static const TqKernels k{"avx512", scores_avx512, accumulate_avx512, encode_avx512};
  return k;
}

}  // namespace kvq
