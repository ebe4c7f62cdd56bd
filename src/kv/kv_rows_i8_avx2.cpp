// AVX2 integer-dot scores for the 4-bit row formats (q4_0, int4g), same algorithm as
// kv_rows_i8_avx512.cpp on 64-element chunks. AVX2 has no VNNI: u8 x s8 pairs go through
// VPMADDUBSW (int16; at most 2 x 15 x 127 per pair, and the low- and high-nibble halves summed
// stay below 2^15, so nothing saturates) and VPMADDWD with ones to int32.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kv/kv_rows.h"
#include "kv/kv_rows_simd.h"

namespace kvq {
namespace {

struct Ctx {
  int hd = 0;
  int n_chunks = 0;     // 64-element chunks (2 blocks of 32)
  size_t code_off = 0;  // int4g: bytes of the (scale, min) table before the codes
  int group = 0;
  __m256i idx_s, idx_m;  // int4g: lane -> f32 slot of the chunk's (s_a, m_a, s_b, m_b)
};

Ctx make_ctx(const KvRowFmt& f) {
  Ctx x;
  x.hd = f.head_dim;
  x.n_chunks = f.head_dim / 64;
  if (f.elem == KvElem::int4g) {
    x.group = f.group;
    x.code_off = sizeof(KvGroupParams) * size_t(f.head_dim / f.group);
    // g = 32: the chunk's two blocks are groups 2h and 2h + 1; larger groups: one group.
    x.idx_s = f.group == 32 ? _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2) : _mm256_setzero_si256();
    x.idx_m = _mm256_add_epi32(x.idx_s, _mm256_set1_epi32(1));
  } else if (f.elem == KvElem::int2g) {
    // 128-element chunks; lane l = 2u + r belongs to unit (block) u: group u (g 32), u / 2 (g 64),
    // 0 (g 128) of the chunk's first group.
    x.n_chunks = f.head_dim / 128;
    x.group = f.group;
    x.code_off = sizeof(KvGroupParams) * size_t(f.head_dim / f.group);
    x.idx_s = f.group == 32   ? _mm256_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6)
              : f.group == 64 ? _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)
                              : _mm256_setzero_si256();
    x.idx_m = _mm256_add_epi32(x.idx_s, _mm256_set1_epi32(1));
  } else {
    x.idx_s = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    x.idx_m = x.idx_s;
  }
  return x;
}

inline uint16_t ld_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

struct Chunk {
  __m256i codes;  // byte 16b + j: elements j (low nibble) and j + 16 (high) of block b
  __m256 s, m;    // per int32 lane l = 4b + k
};

template <KvElem E>
[[gnu::always_inline]] inline Chunk load_chunk(const Ctx& x, const uint8_t* row, int h) {
  Chunk k;
  if constexpr (E == KvElem::q4_0) {
    const uint8_t* base = row + size_t(h) * 2 * sizeof(kv_block_q4_0);
    k.codes = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(base + sizeof(kv_block_q4_0) + 2),
                                  reinterpret_cast<const __m128i*>(base + 2));
    const __m128i d = _mm_insert_epi16(_mm_cvtsi32_si128(ld_u16(base)), ld_u16(base + sizeof(kv_block_q4_0)), 1);
    k.s = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(d)), x.idx_s);
    k.m = _mm256_mul_ps(k.s, _mm256_set1_ps(-8.f));
  } else {
    k.codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + x.code_off + size_t(h) * 32));
    // 8 bytes from the chunk's first group: (s, m) of it and of the next (g = 32), which for
    // larger groups reads a neighbour that the index vectors ignore; the codes follow the
    // table, so the read stays inside the row.
    const int g0 = (64 * h) / x.group;
    const __m128 p = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + sizeof(KvGroupParams) * size_t(g0))));
    const __m256 p8 = _mm256_castps128_ps256(p);
    k.s = _mm256_permutevar8x32_ps(p8, x.idx_s);
    k.m = _mm256_permutevar8x32_ps(p8, x.idx_m);
  }
  return k;
}

// Prepared query row i: pointers into its int8 halves and lane vectors (kv_rows.h).
using QRow = KvRowsQueryRow;
inline QRow qrow(const Ctx& x, const float* qp, size_t q_stride, int i) { return kv_rows_query_row(x.hd, qp, q_stride, i); }

inline __m256i ld256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// int2g: 2-bit planes of 128-element chunks (kv_rows.h); the image's lanes 8h + l (h = 0, 1) share
// unit and scale with this kernel's lane l, so their qs add up and dq is read from the first 8.
template <int NQ>
[[gnu::always_inline]] inline void token_dot_int2(const Ctx& x, const QRow* q, const uint8_t* row, __m256* F) {
  const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  for (int c = 0; c < x.n_chunks; ++c) {
    const __m256i codes = ld256(row + x.code_off + size_t(c) * 32);
    const int g0 = (128 * c) / x.group;
    // 16 bytes of (s, m) pairs from the chunk's first group; past the table they read codes of
    // this row, which the index vectors never select.
    const __m256 p8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + sizeof(KvGroupParams) * size_t(g0))));
    const __m256 s = _mm256_permutevar8x32_ps(p8, x.idx_s), m = _mm256_permutevar8x32_ps(p8, x.idx_m);
    __m256i pl[4];
    for (int k = 0; k < 4; ++k) pl[k] = _mm256_and_si256(_mm256_srli_epi16(codes, 2 * k), three);
    for (int i = 0; i < NQ; ++i) {
      // Each u8 x s8 pair is at most 2 x 3 x 127: four planes summed stay far below 2^15.
      __m256i p16 = _mm256_maddubs_epi16(pl[0], ld256(q[i].lo + 64 * c));
      p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(pl[1], ld256(q[i].lo + 64 * c + 32)));
      p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(pl[2], ld256(q[i].hi + 64 * c)));
      p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(pl[3], ld256(q[i].hi + 64 * c + 32)));
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), _mm256_loadu_ps(q[i].dq + 16 * c));
      const __m256 qs = _mm256_add_ps(_mm256_loadu_ps(q[i].qs + 16 * c), _mm256_loadu_ps(q[i].qs + 16 * c + 8));
      F[i] = _mm256_fmadd_ps(t, s, F[i]);
      F[i] = _mm256_fmadd_ps(m, qs, F[i]);
    }
  }
}

template <KvElem E, int NQ>
[[gnu::always_inline]] inline void token_dot(const Ctx& x, const QRow* q, const uint8_t* row, __m256* F) {
  if constexpr (E == KvElem::int2g) return token_dot_int2<NQ>(x, q, row, F);
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < x.n_chunks; ++h) {
    const Chunk k = load_chunk<E>(x, row, h);
    const __m256i lo = _mm256_and_si256(k.codes, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(k.codes, 4), low4);
    for (int i = 0; i < NQ; ++i) {
      const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ld256(q[i].lo + 32 * h)),
                                           _mm256_maddubs_epi16(hi, ld256(q[i].hi + 32 * h)));
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), _mm256_loadu_ps(q[i].dq + 8 * h));
      F[i] = _mm256_fmadd_ps(t, k.s, F[i]);
      F[i] = _mm256_fmadd_ps(k.m, _mm256_loadu_ps(q[i].qs + 8 * h), F[i]);
    }
  }
}

// Lane k of the result = sum of v[k].
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 e = _mm256_hadd_ps(a, b), f = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(e, f, 0x20), _mm256_permute2f128_ps(e, f, 0x31));
}

// One step of scores_nq: TU tokens from row t (Full) or the last cnt < TU of them, the missing
// slots repeating the last row (their sums are dropped), so that every score comes out of the same
// tree whatever NQ is (kv_rows_simd::scores_nq). Full steps keep compile-time counts.
template <KvElem E, int NQ, int TU, bool Full>
[[gnu::always_inline]] inline void scores_step(const Ctx& x, const QRow* q, const uint8_t* rows, size_t row_stride,
                                               int t, int cnt, int n, float* out, int out_stride) {
  kv_rows_simd::kv_prefetch_ahead(rows, row_stride, t, Full ? TU : cnt, n);
  __m256 v[8];
  for (int j = 0; j < 8; ++j) v[j] = _mm256_setzero_ps();
  for (int u = 0; u < TU; ++u) {
    __m256 F[NQ];
    for (int i = 0; i < NQ; ++i) F[i] = _mm256_setzero_ps();
    token_dot<E, NQ>(x, q, rows + size_t(t + (Full || u < cnt ? u : cnt - 1)) * row_stride, F);
    for (int i = 0; i < NQ; ++i) v[i * TU + u] = F[i];
  }
  alignas(32) float z[8];
  _mm256_store_ps(z, hsum8(v));
  for (int i = 0; i < NQ; ++i)
    std::memcpy(out + size_t(i) * size_t(out_stride) + size_t(t), z + i * TU, sizeof(float) * size_t(Full ? TU : cnt));
}

template <KvElem E, int NQ>
void scores_nq(const Ctx& x, const float* qp, size_t q_stride, const uint8_t* rows, size_t row_stride, int n,
               float* out, int out_stride) {
  constexpr int NQP = NQ == 3 ? 4 : NQ;
  constexpr int TU = 8 / NQP;
  QRow q[NQ];
  for (int i = 0; i < NQ; ++i) q[i] = qrow(x, qp, q_stride, i);
  int t = 0;
  for (; t + TU <= n; t += TU) scores_step<E, NQ, TU, true>(x, q, rows, row_stride, t, TU, n, out, out_stride);
  if (t < n) scores_step<E, NQ, TU, false>(x, q, rows, row_stride, t, n - t, n, out, out_stride);
}

template <KvElem E>
void scores_elem(const Ctx& x, const float* qp, size_t q_stride, int n_q, const uint8_t* rows, size_t row_stride,
                 int n, float* out, int out_stride) {
  for (int i0 = 0; i0 < n_q; i0 += 4) {
    const float* qi = qp + size_t(i0) * q_stride;
    float* o = out + size_t(i0) * size_t(out_stride);
    switch (std::min(4, n_q - i0)) {
      case 1: scores_nq<E, 1>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
      case 2: scores_nq<E, 2>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
      case 3: scores_nq<E, 3>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
      default: scores_nq<E, 4>(x, qi, q_stride, rows, row_stride, n, o, out_stride); break;
    }
  }
}

}  // namespace

void kv_rows_scores_i8_avx2(const KvRowFmt& f, const float* qp, int n_q, const uint8_t* rows,
                            size_t row_stride, int n, float* out, int out_stride) {
  const Ctx x = make_ctx(f);
  const size_t q_stride = size_t(f.head_dim + kv_rows_query_extra_floats(f));
  if (f.elem == KvElem::q4_0) scores_elem<KvElem::q4_0>(x, qp, q_stride, n_q, rows, row_stride, n, out, out_stride);
  else if (f.elem == KvElem::int4g) scores_elem<KvElem::int4g>(x, qp, q_stride, n_q, rows, row_stride, n, out, out_stride);
  else scores_elem<KvElem::int2g>(x, qp, q_stride, n_q, rows, row_stride, n, out, out_stride);
}

}  // namespace kvq
