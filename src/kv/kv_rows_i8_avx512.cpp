// AVX-512 VNNI integer-dot scores for the 4-bit row formats (q4_0, int4g): the query is prepared
// once per step as int8 blocks (kv_rows_prepare_query; layout and error bound in kv_rows.h), so
// the inner loop is one AND, one shift and two VPDPBUSD per 128 elements and query row.
#include "core/avx512.h"

#include <algorithm>
#include <cstring>

#include "kv/hsum_avx512.h"
#include "kv/kv_rows.h"
#include "kv/kv_rows_simd.h"

namespace kvq {
namespace {

// Work unit: a chunk of 128 elements (4 blocks of 32): 64 code bytes, byte 16b + j holding
// elements j (low nibble) and j + 16 (high nibble) of block b, which is both formats' packing; a
// head_dim that is 64 mod 128 ends with a half chunk (upper 32 bytes zero, scales zero).
// Lane l = 4b + k of the int32 dot covers elements 4k..4k+3 and 16+4k..16+4k+3 of block b.
struct Ctx {
  int hd = 0;
  int n_chunks = 0;   // including the half chunk
  bool half = false;  // last chunk holds 64 elements
  size_t code_off = 0;  // int4g: bytes of the (scale, min) table before the codes
  int ng = 0;         // int4g: groups per row
  int group = 0;
  __m512i idx_a, idx_b;  // q4_0: code words, scale words; int4g: scale words, min words
  // head_dim 64, two tokens per vector (see scores_pairs): the same selections with the second
  // row's words taken from the second source of a two-source word permute.
  __m512i pair_a, pair_b, pair_c;  // q4_0: code words, scale words; int4g: scale words, min words
};

Ctx make_ctx(const KvRowFmt& f) {
  Ctx x;
  x.hd = f.head_dim;
  x.half = f.head_dim % 128 != 0;
  x.n_chunks = (f.head_dim + 127) / 128;
  alignas(64) int16_t a[32] = {}, b[32] = {};
  if (f.elem == KvElem::q4_0) {
    // A 128-element chunk is 4 blocks of 18 bytes = 36 words (18 is even, so every block starts
    // on a word); two loads 8 bytes apart (words 0..31 and 4..35) cover them, one two-source word
    // permute packs the 4 x 8 code words, another gathers the 4 scales.
    for (int w = 0; w < 32; ++w) {
      const int r = 9 * (w / 8) + 1 + (w % 8);
      a[w] = int16_t(r < 32 ? r : 32 + r - 4);
    }
    for (int k = 0; k < 16; ++k) b[k] = int16_t(9 * (k / 4));
  } else {
    x.group = f.group;
    x.ng = f.head_dim / f.group;
    x.code_off = sizeof(KvGroupParams) * size_t(x.ng);
    // Word offsets of lane l's (scale, min) relative to the chunk's first group.
    for (int k = 0; k < 16; ++k) {
      // Block of lane k: int4g k / 4; int2g (2-bit planes, kv_rows.h) (k % 8) / 2.
      const int blk = f.elem == KvElem::int2g ? (k % 8) / 2 : k / 4;
      a[k] = int16_t(2 * (blk * 32 / f.group));
      b[k] = int16_t(a[k] + 1);
    }
  }
  x.idx_a = _mm512_load_si512(a);
  x.idx_b = _mm512_load_si512(b);
  alignas(64) int16_t pa[32] = {}, pb[32] = {}, pc[32] = {};
  if (f.elem == KvElem::q4_0) {
    for (int w = 0; w < 16; ++w) {
      pa[w] = a[w];            // row 0's code words of blocks 0, 1 (all below word 18)
      pa[16 + w] = int16_t(32 + a[w]);  // row 1's
    }
    for (int k = 0; k < 8; ++k) {
      pb[k] = b[k];
      pb[8 + k] = int16_t(32 + b[k]);
    }
  } else {
    for (int k = 0; k < 8; ++k) {
      pb[k] = a[k];
      pb[8 + k] = int16_t(32 + a[k]);
      pc[k] = b[k];
      pc[8 + k] = int16_t(32 + b[k]);
    }
  }
  x.pair_a = _mm512_load_si512(pa);
  x.pair_b = _mm512_load_si512(pb);
  x.pair_c = _mm512_load_si512(pc);
  return x;
}

struct Chunk {
  __m512i lo, hi;  // codes, one per byte, matching the query image's qlo / qhi bytes
  __m512 s, m;     // per lane: x = s * c + m
};

[[gnu::always_inline]] inline void split_nibbles(__m512i codes, Chunk& k) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  k.lo = _mm512_and_si512(codes, low4);
  k.hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
}

template <KvElem E>
[[gnu::always_inline]] inline Chunk load_chunk(const Ctx& x, const uint8_t* row, int c, bool half) {
  Chunk k;
  if constexpr (E == KvElem::q4_0) {
    const uint8_t* base = row + size_t(c) * 4 * sizeof(kv_block_q4_0);
    if (!half) {
      const __m512i a = _mm512_loadu_si512(base), b = _mm512_loadu_si512(base + 8);
      split_nibbles(_mm512_permutex2var_epi16(a, x.idx_a, b), k);
      k.s = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(x.idx_b, a)));
    } else {
      // 2 blocks (36 bytes): masked load, so nothing past the row is read; the zeroed bytes
      // give scale 0 to lanes 8..15.
      const __m512i a = _mm512_maskz_loadu_epi8((__mmask64(1) << 36) - 1, base);
      split_nibbles(_mm512_maskz_permutexvar_epi16(0xffff, x.idx_a, a), k);
      k.s = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(x.idx_b, a)));
    }
    k.m = _mm512_mul_ps(k.s, _mm512_set1_ps(-8.f));
  } else {
    if constexpr (E == KvElem::int2g) {
      // 32 code bytes per 128 elements, in both halves; word shifts 0 | 2 give planes 0 | 1,
      // 4 | 6 planes 2 | 3 (a byte's crumbs never cross into its neighbour for shifts <= 6).
      const __m512i cc = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + x.code_off + size_t(c) * 32)));
      const __m512i three = _mm512_set1_epi8(3);
      const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
      const __m512i sh23 = _mm512_add_epi16(sh01, _mm512_set1_epi16(4));
      k.lo = _mm512_and_si512(_mm512_srlv_epi16(cc, sh01), three);
      k.hi = _mm512_and_si512(_mm512_srlv_epi16(cc, sh23), three);
    } else {
      const uint8_t* codes = row + x.code_off + size_t(c) * 64;
      split_nibbles(half ? _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)))
                         : _mm512_loadu_si512(codes),
                    k);
    }
    // The chunk's groups start at g0; a masked load of the rest of the table (at most 16 groups)
    // reads nothing past it and zeroes the lanes of a half chunk's missing blocks.
    const int g0 = (128 * c) / x.group;
    const int nb = std::min(64, 4 * (x.ng - g0));
    const __m512i p = _mm512_maskz_loadu_epi8(nb >= 64 ? ~__mmask64(0) : (__mmask64(1) << nb) - 1,
                                              row + sizeof(KvGroupParams) * size_t(g0));
    k.s = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(x.idx_a, p)));
    k.m = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(x.idx_b, p)));
  }
  return k;
}

// Prepared query row i: pointers into its int8 halves and lane vectors (kv_rows.h).
using QRow = KvRowsQueryRow;
inline QRow qrow(const Ctx& x, const float* qp, size_t q_stride, int i) { return kv_rows_query_row(x.hd, qp, q_stride, i); }

// F[i] += per-lane partial scores of one token for query rows 0..NQ-1. HD: head_dim when known at
// compile time (the chunk loop then unrolls and the half-chunk masks are constants), else 0.
template <KvElem E, int NQ, int HD>
[[gnu::always_inline]] inline void token_dot(const Ctx& x, const QRow* q, const uint8_t* row, __m512* F) {
  const int n_chunks = HD ? (HD + 127) / 128 : x.n_chunks;
  const bool has_half = HD ? HD % 128 != 0 : x.half;
  for (int c = 0; c < n_chunks; ++c) {
    const bool half = has_half && c == n_chunks - 1;
    const Chunk k = load_chunk<E>(x, row, c, half);
    const __m512i lo = k.lo, hi = k.hi;
    // A half chunk's lanes 8..15 must not see the next row's data in dq / qs (0 * inf).
    const __mmask16 lanes = half ? 0x00ff : 0xffff;
    for (int i = 0; i < NQ; ++i) {
      // Upper bytes of a half chunk's query loads belong to the next array of the same row:
      // they meet zero codes.
      __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q[i].lo + 64 * c));
      acc = _mm512_dpbusd_epi32(acc, hi, _mm512_loadu_si512(q[i].hi + 64 * c));
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_maskz_loadu_ps(lanes, q[i].dq + 16 * c));
      F[i] = _mm512_fmadd_ps(t, k.s, F[i]);
      F[i] = _mm512_fmadd_ps(k.m, _mm512_maskz_loadu_ps(lanes, q[i].qs + 16 * c), F[i]);
    }
  }
}

// One step of scores_nq: TU tokens from row t (Full) or the last cnt < TU of them, the missing
// slots repeating the last row (their sums are dropped), so that every score comes out of the same
// hsum16 tree whatever NQ is (kv_rows_simd::scores_nq). Full steps keep compile-time counts.
template <KvElem E, int NQ, int HD, int TU, bool Full>
[[gnu::always_inline]] inline void scores_step(const Ctx& x, const QRow* q, const uint8_t* rows, size_t row_stride,
                                               int t, int cnt, int n, float* out, int out_stride) {
  kv_rows_simd::kv_prefetch_ahead(rows, row_stride, t, Full ? TU : cnt, n);
  __m512 v[16];
  for (int j = 0; j < 16; ++j) v[j] = _mm512_setzero_ps();
  for (int u = 0; u < TU; ++u) {
    __m512 F[NQ];
    for (int i = 0; i < NQ; ++i) F[i] = _mm512_setzero_ps();
    token_dot<E, NQ, HD>(x, q, rows + size_t(t + (Full || u < cnt ? u : cnt - 1)) * row_stride, F);
    for (int i = 0; i < NQ; ++i) {
      const int o = i * TU + u;  // output lane: query i's TU scores are contiguous
      v[4 * (o % 4) + o / 4] = F[i];
    }
  }
  alignas(64) float z[16];
  _mm512_store_ps(z, hsum16_avx512(v));
  for (int i = 0; i < NQ; ++i)
    std::memcpy(out + size_t(i) * size_t(out_stride) + size_t(t), z + i * TU, sizeof(float) * size_t(Full ? TU : cnt));
}

// NQ query rows (1..4) against n tokens; 16 / NQ tokens per step (3 rows use the slots of 4) so
// that one hsum16 finishes 16 scores.
template <KvElem E, int NQ, int HD>
void scores_nq(const Ctx& x, const float* qp, size_t q_stride, const uint8_t* rows, size_t row_stride, int n,
               float* out, int out_stride) {
  constexpr int NQP = NQ == 3 ? 4 : NQ;
  constexpr int TU = 16 / NQP;
  QRow q[NQ];
  for (int i = 0; i < NQ; ++i) q[i] = qrow(x, qp, q_stride, i);
  int t = 0;
  for (; t + TU <= n; t += TU) scores_step<E, NQ, HD, TU, true>(x, q, rows, row_stride, t, TU, n, out, out_stride);
  if (t < n) scores_step<E, NQ, HD, TU, false>(x, q, rows, row_stride, t, n - t, n, out, out_stride);
}

// head_dim 64: one row fills only half a chunk, so two tokens share each vector: row t's 64 codes
// in bytes 0..31 (lanes 0..7), row t + 1's in bytes 32..63 (lanes 8..15), against the query image
// broadcast to both halves. Per vector the two tokens' 8-lane partial sums are already what
// hsum16_from_pairs_avx512 takes as one first-level input.
template <KvElem E>
[[gnu::always_inline]] inline Chunk load_pair(const Ctx& x, const uint8_t* r0, const uint8_t* r1) {
  Chunk k;
  if constexpr (E == KvElem::q4_0) {
    const __mmask64 m36 = (__mmask64(1) << 36) - 1;  // 2 blocks of 18 bytes: nothing past the row
    const __m512i a = _mm512_maskz_loadu_epi8(m36, r0), b = _mm512_maskz_loadu_epi8(m36, r1);
    split_nibbles(_mm512_permutex2var_epi16(a, x.pair_a, b), k);
    k.s = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(a, x.pair_b, b)));
    k.m = _mm512_mul_ps(k.s, _mm512_set1_ps(-8.f));
  } else {
    static_assert(E == KvElem::int4g);
    const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + x.code_off));
    const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + x.code_off));
    split_nibbles(_mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1), k);
    const __mmask64 mp = (__mmask64(1) << x.code_off) - 1;  // the (scale, min) table: <= 8 bytes
    const __m512i a = _mm512_maskz_loadu_epi8(mp, r0), b = _mm512_maskz_loadu_epi8(mp, r1);
    k.s = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(a, x.pair_b, b)));
    k.m = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(a, x.pair_c, b)));
  }
  return k;
}

// One step of scores_pairs: TU tokens (TU / 2 pairs) from row t (Full) or the last cnt < TU of
// them, the missing slots repeating the last row (dropped), so that every score comes out of the
// pair path and the same tree whatever NQ is. Slot of (query i, token u): pair vector
// j = i * PP + u / 2 is first-level input j of the tree, its token u % 2 the tree's input
// k = 2j + u % 2, which lands in lane 4 (k % 4) + k / 4.
template <KvElem E, int NQ, int TU, bool Full>
[[gnu::always_inline]] inline void pairs_step(const Ctx& x, const __m512i* qlo, const __m512i* qhi, const __m512* dq,
                                              const __m512* qs, const uint8_t* rows, size_t row_stride, int t, int cnt,
                                              int n, float* out, int out_stride) {
  constexpr int PP = TU / 2;
  kv_rows_simd::kv_prefetch_ahead(rows, row_stride, t, Full ? TU : cnt, n);
  __m512 u[8];
  for (int j = NQ * PP; j < 8; ++j) u[j] = _mm512_setzero_ps();
  for (int p = 0; p < PP; ++p) {
    const uint8_t* r0 = rows + size_t(t + (Full || 2 * p < cnt ? 2 * p : cnt - 1)) * row_stride;
    const uint8_t* r1 = rows + size_t(t + (Full || 2 * p + 1 < cnt ? 2 * p + 1 : cnt - 1)) * row_stride;
    const Chunk k = load_pair<E>(x, r0, r1);
    for (int i = 0; i < NQ; ++i) {
      __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k.lo, qlo[i]);
      acc = _mm512_dpbusd_epi32(acc, k.hi, qhi[i]);
      const __m512 tq = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), dq[i]);
      u[i * PP + p] = _mm512_fmadd_ps(k.m, qs[i], _mm512_mul_ps(tq, k.s));
    }
  }
  alignas(64) float z[16];
  _mm512_store_ps(z, hsum16_from_pairs_avx512(u));
  for (int i = 0; i < NQ; ++i)
    for (int v = 0; v < (Full ? TU : cnt); ++v) {
      const int kk = 2 * (i * PP + v / 2) + v % 2;
      out[size_t(i) * size_t(out_stride) + size_t(t + v)] = z[4 * (kk % 4) + kk / 4];
    }
}

template <KvElem E, int NQ>
void scores_pairs(const Ctx& x, const float* qp, size_t q_stride, const uint8_t* rows, size_t row_stride, int n,
                  float* out, int out_stride) {
  constexpr int NQP = NQ == 3 ? 4 : NQ;
  constexpr int TU = 16 / NQP;  // tokens per step, TU / 2 pairs
  QRow q[NQ];
  __m512i qlo[NQ], qhi[NQ];
  __m512 dq[NQ], qs[NQ];
  for (int i = 0; i < NQ; ++i) {
    q[i] = qrow(x, qp, q_stride, i);
    qlo[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[i].lo)));
    qhi[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[i].hi)));
    dq[i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[i].dq));
    qs[i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[i].qs));
  }
  int t = 0;
  for (; t + TU <= n; t += TU) pairs_step<E, NQ, TU, true>(x, qlo, qhi, dq, qs, rows, row_stride, t, TU, n, out, out_stride);
  if (t < n) pairs_step<E, NQ, TU, false>(x, qlo, qhi, dq, qs, rows, row_stride, t, n - t, n, out, out_stride);
}

template <KvElem E, int HD>
void scores_elem(const Ctx& x, const float* qp, size_t q_stride, int n_q, const uint8_t* rows, size_t row_stride,
                 int n, float* out, int out_stride) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* qi = qp + size_t(i0) * q_stride;
    float* o = out + size_t(i0) * size_t(out_stride);
    if constexpr (HD == 64 && E != KvElem::int2g) {
      switch (std::min(4, n_q - i0)) {
        case 1: scores_pairs<E, 1>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
        case 2: scores_pairs<E, 2>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
        case 3: scores_pairs<E, 3>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
        default: scores_pairs<E, 4>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
      }
      continue;
    }
    switch (std::min(4, n_q - i0)) {
      case 1: scores_nq<E, 1, HD>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
      case 2: scores_nq<E, 2, HD>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
      case 3: scores_nq<E, 3, HD>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
      default: scores_nq<E, 4, HD>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
    }
  }
}

}  // namespace

void kv_rows_scores_i8_avx512(const KvRowFmt& f, const float* qp, int n_q, const uint8_t* rows,
                              size_t row_stride, int n, float* out, int out_stride) {
  const Ctx x = make_ctx(f);
  const size_t q_stride = size_t(f.head_dim + kv_rows_query_extra_floats(f));
  if (f.elem == KvElem::int2g) {
    if (f.head_dim == 128) return scores_elem<KvElem::int2g, 128>(x, qp, q_stride, n_q, rows, row_stride, n, out, out_stride);
    if (f.head_dim == 256) return scores_elem<KvElem::int2g, 256>(x, qp, q_stride, n_q, rows, row_stride, n, out, out_stride);
    return scores_elem<KvElem::int2g, 0>(x, qp, q_stride, n_q, rows, row_stride, n, out, out_stride);
  }
  const bool q40 = f.elem == KvElem::q4_0;
#define KVQ_I8_CALL(HD)                                                                          \
  return q40 ? scores_elem<KvElem::q4_0, HD>(x, qp, q_stride, n_q, rows, row_stride, n, out, out_stride) \
             : scores_elem<KvElem::int4g, HD>(x, qp, q_stride, n_q, rows, row_stride, n, out, out_stride)
  switch (f.head_dim) {
    case 64: KVQ_I8_CALL(64);
    case 128: KVQ_I8_CALL(128);
    case 256: KVQ_I8_CALL(256);
    default: KVQ_I8_CALL(0);
  }
#undef KVQ_I8_CALL
}

}  // namespace kvq

// ---------------------------------------------------------------------------------------------
// Weighted sum of 4-bit rows (values). The probabilities stay f32 (an int8 image of them would
// cost accuracy on exactly the tokens that matter), but the decode is cut to a table lookup:
// one VPERMPS with a per-token 16-entry table s * c + m (q4_0: d * (c - 8)) turns 16 nibbles into
// their decoded values, bit-identical to the reference's fma(c, s, m) / (c - 8) * d.
namespace kvq {
namespace {

template <KvElem E, int NQ, int U>
void accum_nq(const KvRowFmt& f, const float* p, int p_stride, const uint8_t* rows, size_t row_stride, int n,
              float* acc) {
  const int hd = f.head_dim;
  const int G = f.group;
  const size_t code_off = E != KvElem::q4_0 ? sizeof(KvGroupParams) * size_t(hd / G) : 0;
  // int2g: VPERMPS sees the crumb plus the next one above it, so the 4 values repeat.
  const __m512 t0 = E == KvElem::q4_0    ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                    : E == KvElem::int4g ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                         : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  // int2g unit (8 bytes, byte j = elements j + 8k at bits 2k) loaded into both halves: shifts
  // 0 | 2 give elements 0..15 in order, 4 | 6 elements 16..31.
  const __m512i sh_lo = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i sh_hi = _mm512_add_epi32(sh_lo, _mm512_set1_epi32(4));
  for (int e0 = 0; e0 < hd; e0 += 32 * U) {  // strip of U units of 32 dims; accumulators in registers
    __m512 a[NQ][2 * U];
    for (int i = 0; i < NQ; ++i)
      for (int v = 0; v < 2 * U; ++v) a[i][v] = _mm512_loadu_ps(acc + size_t(i) * size_t(hd) + size_t(e0 + 16 * v));
    for (int t = 0; t < n; ++t) {
      if (e0 == 0) kv_rows_simd::kv_prefetch_ahead(rows, row_stride, t, 1, n);
      const uint8_t* row = rows + size_t(t) * row_stride;
      __m512 tbl = t0;
      for (int u = 0; u < U; ++u) {
        const int unit = e0 / 32 + u;
        __m512i c;
        if constexpr (E == KvElem::q4_0) {
          const uint8_t* b = row + size_t(unit) * sizeof(kv_block_q4_0);
          uint16_t d;
          std::memcpy(&d, b, 2);
          tbl = _mm512_mul_ps(t0, _mm512_cvtph_ps(_mm256_set1_epi16(short(d))));
          c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
        } else {
          if (u == 0 || G == 32) {  // larger groups: the strip's units share one (s, m)
            uint32_t sm;
            std::memcpy(&sm, row + sizeof(KvGroupParams) * size_t(unit * 32 / G), 4);
            const __m512 v = _mm512_cvtph_ps(_mm256_set1_epi32(int(sm)));  // s, m, s, m, ...
            tbl = _mm512_fmadd_ps(t0, _mm512_moveldup_ps(v), _mm512_movehdup_ps(v));
          }
          if constexpr (E == KvElem::int4g)
            c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + code_off + size_t(unit) * 16)));
          else {
            const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + code_off + size_t(unit) * 8));
            c = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b8, b8));
          }
        }
        // VPERMPS reads the low 4 bits of each index: the low nibble as is, the high after a shift.
        const __m512 xlo = E == KvElem::int2g ? _mm512_permutexvar_ps(_mm512_srlv_epi32(c, sh_lo), tbl)
                                              : _mm512_permutexvar_ps(c, tbl);
        const __m512 xhi = E == KvElem::int2g ? _mm512_permutexvar_ps(_mm512_srlv_epi32(c, sh_hi), tbl)
                                              : _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), tbl);
        for (int i = 0; i < NQ; ++i) {
          const __m512 w = _mm512_set1_ps(p[size_t(i) * size_t(p_stride) + size_t(t)]);
          a[i][2 * u] = _mm512_fmadd_ps(w, xlo, a[i][2 * u]);
          a[i][2 * u + 1] = _mm512_fmadd_ps(w, xhi, a[i][2 * u + 1]);
        }
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int v = 0; v < 2 * U; ++v) _mm512_storeu_ps(acc + size_t(i) * size_t(hd) + size_t(e0 + 16 * v), a[i][v]);
  }
}

// Integer weighted sum of int4g / int2g rows (head_dim % 64 == 0, groups of 32, 64 or 128
// channels). Every row is x = s_tg c + m_tg per group g, so per query row i and
// run of up to kRun tokens
//   acc_i += sum_t p_it x_t = sum_t w_itg c_t + Z_ig,  w = p s,  Z_ig = sum_t p_it m_tg (f32, exact
// as far as f32 goes). w is rounded to int16 steps dw_ig = max_t |w_itg| / 32767 per (query,
// group, run); two tokens' code bytes are interleaved into int16 pairs (one VPERMT2B per 32
// channels) and meet the pair (w_t, w_t+1) in one VPDPWSSD: 16 channels x 2 tokens per
// instruction instead of 2 x 16 FMAs. The codes are not shifted down: the high nibble (int2g: the
// upper crumbs) is accumulated as 16 c (4^k c) by masking alone and the exact power of two is
// divided out when a run is folded into acc. |int32 sum| <= kRun * 32767 * 240 < 2^31.
//
// Error bound (tests/kv_int_dot_bound.h, kv_int_accum_bound): the integer dot is exact, so per
// output channel the only approximation is the weight rounding, |w - dw round(w / dw)| <= dw / 2
// per token (+ dw * 4 * 2^-24 * 32767 < 0.008 dw for the f32 products p s, w / dw and dw),
// times that token's code c_t:  |acc - ref| <= sum_runs dw * 0.51 * sum_t c_t  plus f32 rounding
// of the sums (int32 -> f32 conversion, Z, the fold: relative 2^-24 each of sum_t |p_t| (|s c| + |m|)).
// In decode attention p <= 1 and s_t * c_max <= the token's group range <= 2 max|v|, so an output (acc / l, l >= 1) moves by at most n_tokens * 2 max|v| *
// 0.51 / 32767 (* 1.001 for the f16 rounding of the scale).
// 32 tokens: a block's first run waits for its rows (the scale walk needs them all before any
// code is summed), so a shorter first run exposes less memory latency per cold block: cold
// decode int4_g64 32K ~775 -> ~730 us (q4_0 layout: ~920 -> ~850); compute-only ~7% slower (twice the
// per-run reductions and folds).
constexpr int kRun = 32;

// acc += pairwise int16 products. GCC 12 keeps the intrinsic's loop-carried accumulators in
// different registers inside and outside the loop and copies all of them twice per iteration
// (16 extra moves per 8 dot products at 4 query rows); the asm ties the accumulator.
[[gnu::always_inline]] inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

template <KvElem E, int NQ, int G, int UC>
void accum_i16(const KvRowFmt& f, const float* p, int p_stride, const uint8_t* rows, size_t row_stride, int n,
               float* acc) {
  static_assert(G % 32 == 0);
  const int hd = f.head_dim, ng = hd / G, nu = hd / 32;
  static_assert(E == KvElem::int4g || E == KvElem::int2g);
  const size_t code_off = sizeof(KvGroupParams) * size_t(ng);
  const size_t unit_stride = E == KvElem::int4g ? kv_unit_int4_bytes : kv_unit_int2_bytes;
  alignas(64) int16_t w16[NQ * (kv_max_head_dim / 32) * kRun];  // (NQ, ng, kRun)
  float dw[NQ * (kv_max_head_dim / 32)], zs[NQ * (kv_max_head_dim / 32)];
  // Dword lane l of a unit's vector: [token A byte b(l), token B byte b(l)] as two int16 words
  // (the odd bytes are cleared by the masks below); b(l) = l, int2g: l % 8 (both halves see the
  // unit's 8 bytes, the masks pick crumbs 0 | 1 in lo and 2 | 3 in hi).
  alignas(64) uint8_t ib[64];
  for (int l = 0; l < 16; ++l) {
    const int b = E == KvElem::int2g ? l % 8 : l;
    ib[4 * l] = uint8_t(b);
    ib[4 * l + 1] = 0;
    ib[4 * l + 2] = uint8_t(64 + b);
    ib[4 * l + 3] = 0;
  }
  const __m512i idx = _mm512_load_si512(ib);
  const __m512i mlo = E == KvElem::int2g ? _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(0x00030003), _mm512_set1_epi32(0x000c000c))
                                         : _mm512_set1_epi32(0x000f000f);
  const __m512i mhi = E == KvElem::int2g ? _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(0x00300030), _mm512_set1_epi32(0x00c000c0))
                                         : _mm512_set1_epi32(0x00f000f0);
  const __m512 flo = E == KvElem::int2g ? _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(1.f), _mm512_set1_ps(0.25f))
                                        : _mm512_set1_ps(1.f);
  const __m512 fhi = E == KvElem::int2g ? _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(1.f / 16), _mm512_set1_ps(1.f / 64))
                                        : _mm512_set1_ps(1.f / 16);
  for (int t0 = 0; t0 < n; t0 += kRun) {
    const int cn = std::min(kRun, n - t0);
    const uint8_t* base = rows + size_t(t0) * row_stride;
    // Scales and minima of the run, token by token in row order (tokens past cn: 0, so w = 0 and
    // an odd last token pairs with zero). One gather per 16 rows and group measured no faster
    // (cold decode q4_0 32K ~930 us either way at 64-token runs).
    // The run's rows are requested up front (memory-level parallelism for the walk below; with
    // gathers it measured cold q4_0 32K ~975 -> ~930 us).
    for (size_t b = 0, e = size_t(cn) * row_stride; b < e; b += 64) __builtin_prefetch(base + b, 0, 3);
    alignas(64) float sva[(kv_max_head_dim / 32) * kRun], mva[(kv_max_head_dim / 32) * kRun];  // (ng, kRun)
    for (int t = 0; t < kRun; ++t) {
      const uint8_t* r = base + size_t(t) * row_stride;
      for (int g = 0; g < ng; ++g) {
        if (t >= cn) {
          sva[g * kRun + t] = mva[g * kRun + t] = 0.f;
          continue;
        }
        uint32_t sm = 0;
        std::memcpy(&sm, r + sizeof(KvGroupParams) * size_t(g), 4);
        const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(int(sm)));
        sva[g * kRun + t] = _mm_cvtss_f32(v);
        mva[g * kRun + t] = _mm_cvtss_f32(_mm_movehdup_ps(v));
      }
    }
    for (int g = 0; g < ng; ++g) {
      __m512 w[NQ][kRun / 16], wmax[NQ], zacc[NQ];
      for (int i = 0; i < NQ; ++i) wmax[i] = zacc[i] = _mm512_setzero_ps();
      for (int u = 0; u < kRun / 16; ++u) {
        const int left = cn - 16 * u;
        const __mmask16 m = left <= 0 ? __mmask16(0) : left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        const __m512 sv = _mm512_load_ps(sva + g * kRun + 16 * u), mv = _mm512_load_ps(mva + g * kRun + 16 * u);
        for (int i = 0; i < NQ; ++i) {
          const __m512 pv = _mm512_maskz_loadu_ps(m, p + size_t(i) * size_t(p_stride) + size_t(t0 + 16 * u));
          w[i][u] = _mm512_mul_ps(pv, sv);
          wmax[i] = _mm512_max_ps(wmax[i], _mm512_abs_ps(w[i][u]));
          zacc[i] = _mm512_fmadd_ps(pv, mv, zacc[i]);
        }
      }
      for (int i = 0; i < NQ; ++i) {
        const float mx = _mm512_reduce_max_ps(wmax[i]);
        // Tiny weights (probabilities far below the run's max elsewhere, tiny scales): lift by an
        // exact power of two so that 32767 / mx cannot overflow; dw itself stays mx / 32767.
        const float pre = mx < 0x1p-100f ? 0x1p100f : 1.f;
        dw[i * ng + g] = mx / 32767.f;
        zs[i * ng + g] = _mm512_reduce_add_ps(zacc[i]);
        const __m512 inv = _mm512_set1_ps(mx > 0 ? 32767.f / (mx * pre) : 0.f);
        for (int u = 0; u < kRun / 16; ++u)
          _mm256_store_si256(reinterpret_cast<__m256i*>(w16 + (size_t(i) * size_t(ng) + size_t(g)) * kRun + 16 * u),
                             _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                 _mm512_mul_ps(_mm512_mul_ps(w[i][u], _mm512_set1_ps(pre)), inv))));
      }
    }
    const int cn2 = (cn + 1) & ~1;
    // Chunks of UC units (32 UC channels): 2 UC accumulators per query row stay in registers
    // (UC = 1 and 2 measured the same at 4 query rows once the accumulators stay put, see dpwssd).
    for (int u0 = 0; u0 < nu; u0 += UC) {
      __m512i ai[NQ][2 * UC];  // unit u0 + k: [2k] channels 0..15, [2k + 1] channels 16..31
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 2 * UC; ++j) ai[i][j] = _mm512_setzero_si512();
      const uint8_t* c0 = base + code_off + unit_stride * size_t(u0);
      for (int u = 0; u < cn2; u += 2) {
        const uint8_t* ra = c0 + size_t(u) * row_stride;
        const uint8_t* rbp = u + 1 < cn ? ra + row_stride : ra;  // weight 0 for a missing partner
        // Spread over the first chunk's pass, as the float kernel does per token: requested at
        // once per run, the next run's rows arrived late for its scale gathers (cold decode
        // slower than before).
        if (u0 == 0) kv_rows_simd::kv_prefetch_ahead(rows, row_stride, t0 + u, 2, n);
#pragma GCC unroll 2
        for (int k = 0; k < UC; ++k) {
          __m512i x;
          if constexpr (E == KvElem::int2g)
            x = _mm512_permutex2var_epi8(
                _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ra + unit_stride * size_t(k)))), idx,
                _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rbp + unit_stride * size_t(k)))));
          else
            x = _mm512_permutex2var_epi8(
                _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ra + unit_stride * size_t(k)))), idx,
                _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rbp + unit_stride * size_t(k)))));
          const __m512i vl = _mm512_and_si512(x, mlo), vh = _mm512_and_si512(x, mhi);
          const int g = 32 * (u0 + k) / G;
#pragma GCC unroll 4
          for (int i = 0; i < NQ; ++i) {
            int32_t pw;
            std::memcpy(&pw, w16 + (size_t(i) * size_t(ng) + size_t(g)) * kRun + size_t(u), 4);
            const __m512i wv = _mm512_set1_epi32(pw);
            ai[i][2 * k] = dpwssd(ai[i][2 * k], vl, wv);
            ai[i][2 * k + 1] = dpwssd(ai[i][2 * k + 1], vh, wv);
          }
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int k = 0; k < UC; ++k) {
          const int g = 32 * (u0 + k) / G;
          const __m512 d = _mm512_set1_ps(dw[i * ng + g]), z = _mm512_set1_ps(zs[i * ng + g]);
          float* o = acc + size_t(i) * size_t(hd) + 32 * size_t(u0 + k);
          const __m512 fl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][2 * k]), _mm512_mul_ps(d, flo), z);
          const __m512 fh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[i][2 * k + 1]), _mm512_mul_ps(d, fhi), z);
          _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), fl));
          _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_loadu_ps(o + 16), fh));
        }
    }
  }
}

template <KvElem E, int G>
void accum_i16_nq(const KvRowFmt& f, const float* p, int p_stride, int n_q, const uint8_t* rows, size_t row_stride,
                  int n, float* acc) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* pi = p + size_t(i0) * size_t(p_stride);
    float* a = acc + size_t(i0) * size_t(f.head_dim);
    switch (std::min(4, n_q - i0)) {
      case 1: accum_i16<E, 1, G, 2>(f, pi, p_stride, rows, row_stride, n, a); break;
      case 2: accum_i16<E, 2, G, 2>(f, pi, p_stride, rows, row_stride, n, a); break;
      case 3: accum_i16<E, 3, G, 2>(f, pi, p_stride, rows, row_stride, n, a); break;
      default: accum_i16<E, 4, G, 2>(f, pi, p_stride, rows, row_stride, n, a); break;
    }
  }
}

// true when the integer kernel handled the call.
template <KvElem E>
bool accum_i16_try(const KvRowFmt& f, const float* p, int p_stride, int n_q, const uint8_t* rows, size_t row_stride,
                   int n, float* acc) {
  if (f.head_dim % 64 != 0) return false;
  switch (f.group) {
    case 32: accum_i16_nq<E, 32>(f, p, p_stride, n_q, rows, row_stride, n, acc); break;
    case 64: accum_i16_nq<E, 64>(f, p, p_stride, n_q, rows, row_stride, n, acc); break;
    case 128: accum_i16_nq<E, 128>(f, p, p_stride, n_q, rows, row_stride, n, acc); break;
    default: return false;
  }
  return true;
}

template <KvElem E>
void accum_elem(const KvRowFmt& f, const float* p, int p_stride, int n_q, const uint8_t* rows, size_t row_stride,
                int n, float* acc) {
  const size_t hd = size_t(f.head_dim);
  const bool u2 = f.head_dim % 64 == 0;
  for (int i0 = 0; i0 < n_q; i0 += 8) {
    const float* pi = p + size_t(i0) * size_t(p_stride);
    float* a = acc + size_t(i0) * hd;
    // Up to 4 query rows: 2 units (64 dims) per strip, 16 accumulators; more rows: 1 unit.
    switch (std::min(8, n_q - i0)) {
      case 1: u2 ? accum_nq<E, 1, 2>(f, pi, p_stride, rows, row_stride, n, a) : accum_nq<E, 1, 1>(f, pi, p_stride, rows, row_stride, n, a); break;
      case 2: u2 ? accum_nq<E, 2, 2>(f, pi, p_stride, rows, row_stride, n, a) : accum_nq<E, 2, 1>(f, pi, p_stride, rows, row_stride, n, a); break;
      case 3: u2 ? accum_nq<E, 3, 2>(f, pi, p_stride, rows, row_stride, n, a) : accum_nq<E, 3, 1>(f, pi, p_stride, rows, row_stride, n, a); break;
      case 4: u2 ? accum_nq<E, 4, 2>(f, pi, p_stride, rows, row_stride, n, a) : accum_nq<E, 4, 1>(f, pi, p_stride, rows, row_stride, n, a); break;
      case 5: accum_nq<E, 5, 1>(f, pi, p_stride, rows, row_stride, n, a); break;
      case 6: accum_nq<E, 6, 1>(f, pi, p_stride, rows, row_stride, n, a); break;
      case 7: accum_nq<E, 7, 1>(f, pi, p_stride, rows, row_stride, n, a); break;
      default: accum_nq<E, 8, 1>(f, pi, p_stride, rows, row_stride, n, a); break;
    }
  }
}

}  // namespace

void kv_rows_accum_4bit_avx512(const KvRowFmt& f, const float* p, int p_stride, int n_q, const uint8_t* rows,
                               size_t row_stride, int n, float* acc) {
  // q4_0 stays on the table lookup: the integer kernel (one (d, -8 d) group per 32 channels) was
  // ~4% faster compute-only but ~8% slower on cold blocks (decode 32K ~800 -> ~860 us), where the
  // float kernel's sequential walk hides the memory latency better.
  if (f.elem == KvElem::q4_0) {
    accum_elem<KvElem::q4_0>(f, p, p_stride, n_q, rows, row_stride, n, acc);
  } else if (f.elem == KvElem::int4g) {
    if (!accum_i16_try<KvElem::int4g>(f, p, p_stride, n_q, rows, row_stride, n, acc))
      accum_elem<KvElem::int4g>(f, p, p_stride, n_q, rows, row_stride, n, acc);
  } else if (!accum_i16_try<KvElem::int2g>(f, p, p_stride, n_q, rows, row_stride, n, acc)) {
    accum_elem<KvElem::int2g>(f, p, p_stride, n_q, rows, row_stride, n, acc);
  }
}

}  // namespace kvq
