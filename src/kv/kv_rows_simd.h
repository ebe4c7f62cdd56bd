// Vector-width-generic bodies of the fused row kernels, included by kv_rows_avx2.cpp and
// kv_rows_avx512.cpp after each defines its ISA traits `Isa`:
//   using V;  static constexpr int W (floats per vector);  V zero(), load(const float*),
//   set1(float), fma(V a, V b, V c) (a*b + c);  void store(float*, V);  float hsum(V);
//   template <KvElem E> V dec(const KvRowFmt&, float scale, const uint8_t* row, int e)
//     -> elements [e, e + W) of the row, decoded to f32 (scales applied).
// One decoded vector is reused for all NQ query rows, so the codes are read (and decoded) once
// per GQA group.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kv/kv_rows.h"

namespace kvq {
// q4_0 / int4g weighted sum by table lookup (kv_rows_i8_avx512.cpp); head_dim % 32 == 0.
void kv_rows_accum_4bit_avx512(const KvRowFmt& f, const float* p, int p_stride, int n_q, const uint8_t* rows,
                               size_t row_stride, int n, float* acc);
}  // namespace kvq

namespace kvq::kv_rows_simd {

template <class Isa, KvElem E, int NQ>
void scores_nq(const KvRowFmt& f, float scale, const float* q, const uint8_t* rows,
               size_t row_stride, int n, float* out, int out_stride) {
  using V = typename Isa::V;
  const int hd = f.head_dim;
  int t = 0;
  // Two tokens per step: each query chunk loaded once serves both, and the two independent
  // accumulator sets hide the FMA latency when NQ is small.
  for (; t + 2 <= n; t += 2) {
    const uint8_t* r0 = rows + size_t(t) * row_stride;
    const uint8_t* r1 = r0 + row_stride;
    V a0[NQ], a1[NQ];
    for (int i = 0; i < NQ; ++i) a0[i] = a1[i] = Isa::zero();
    for (int e = 0; e < hd; e += Isa::W) {
      const V x0 = Isa::template dec<E>(f, scale, r0, e);
      const V x1 = Isa::template dec<E>(f, scale, r1, e);
      for (int i = 0; i < NQ; ++i) {
        const V qv = Isa::load(q + size_t(i) * hd + e);
        a0[i] = Isa::fma(x0, qv, a0[i]);
        a1[i] = Isa::fma(x1, qv, a1[i]);
      }
    }
    for (int i = 0; i < NQ; ++i) {
      out[size_t(i) * size_t(out_stride) + size_t(t)] = Isa::hsum(a0[i]);
      out[size_t(i) * size_t(out_stride) + size_t(t) + 1] = Isa::hsum(a1[i]);
    }
  }
  for (; t < n; ++t) {
    const uint8_t* row = rows + size_t(t) * row_stride;
    V acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = Isa::zero();
    for (int e = 0; e < hd; e += Isa::W) {
      const V x = Isa::template dec<E>(f, scale, row, e);
      for (int i = 0; i < NQ; ++i) acc[i] = Isa::fma(x, Isa::load(q + size_t(i) * hd + e), acc[i]);
    }
    for (int i = 0; i < NQ; ++i) out[size_t(i) * size_t(out_stride) + size_t(t)] = Isa::hsum(acc[i]);
  }
}

// Column-strip order: for each strip of W dims, the NQ accumulators stay in registers across
// all n tokens (the block's rows are in L1 after the first strip).
template <class Isa, KvElem E, int NQ>
void accum_nq(const KvRowFmt& f, float scale, const float* p, int p_stride, const uint8_t* rows,
              size_t row_stride, int n, float* acc) {
  using V = typename Isa::V;
  const int hd = f.head_dim;
  for (int e = 0; e < hd; e += Isa::W) {
    V a[NQ];
    for (int i = 0; i < NQ; ++i) a[i] = Isa::load(acc + size_t(i) * hd + e);
    for (int t = 0; t < n; ++t) {
      const V x = Isa::template dec<E>(f, scale, rows + size_t(t) * row_stride, e);
      for (int i = 0; i < NQ; ++i)
        a[i] = Isa::fma(Isa::set1(p[size_t(i) * size_t(p_stride) + size_t(t)]), x, a[i]);
    }
    for (int i = 0; i < NQ; ++i) Isa::store(acc + size_t(i) * hd + e, a[i]);
  }
}

// Query rows in batches of at most 8: enough to amortize the decode, few enough to keep the
// accumulators in registers.
template <class Isa, KvElem E>
void scores_elem(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows,
                 size_t row_stride, int n, float* out, int out_stride) {
  const size_t hd = size_t(f.head_dim);
  for (int i0 = 0; i0 < n_q; i0 += 8) {
    const float* qi = q + size_t(i0) * hd;
    float* o = out + size_t(i0) * size_t(out_stride);
    switch (n_q - i0 < 8 ? n_q - i0 : 8) {
      case 1: scores_nq<Isa, E, 1>(f, scale, qi, rows, row_stride, n, o, out_stride); break;
      case 2: scores_nq<Isa, E, 2>(f, scale, qi, rows, row_stride, n, o, out_stride); break;
      case 3: scores_nq<Isa, E, 3>(f, scale, qi, rows, row_stride, n, o, out_stride); break;
      case 4: scores_nq<Isa, E, 4>(f, scale, qi, rows, row_stride, n, o, out_stride); break;
      case 5: scores_nq<Isa, E, 5>(f, scale, qi, rows, row_stride, n, o, out_stride); break;
      case 6: scores_nq<Isa, E, 6>(f, scale, qi, rows, row_stride, n, o, out_stride); break;
      case 7: scores_nq<Isa, E, 7>(f, scale, qi, rows, row_stride, n, o, out_stride); break;
      default: scores_nq<Isa, E, 8>(f, scale, qi, rows, row_stride, n, o, out_stride); break;
    }
  }
}

template <class Isa, KvElem E>
void accum_elem(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                const uint8_t* rows, size_t row_stride, int n, float* acc) {
  const size_t hd = size_t(f.head_dim);
  for (int i0 = 0; i0 < n_q; i0 += 8) {
    const float* pi = p + size_t(i0) * size_t(p_stride);
    float* a = acc + size_t(i0) * hd;
    switch (n_q - i0 < 8 ? n_q - i0 : 8) {
      case 1: accum_nq<Isa, E, 1>(f, scale, pi, p_stride, rows, row_stride, n, a); break;
      case 2: accum_nq<Isa, E, 2>(f, scale, pi, p_stride, rows, row_stride, n, a); break;
      case 3: accum_nq<Isa, E, 3>(f, scale, pi, p_stride, rows, row_stride, n, a); break;
      case 4: accum_nq<Isa, E, 4>(f, scale, pi, p_stride, rows, row_stride, n, a); break;
      case 5: accum_nq<Isa, E, 5>(f, scale, pi, p_stride, rows, row_stride, n, a); break;
      case 6: accum_nq<Isa, E, 6>(f, scale, pi, p_stride, rows, row_stride, n, a); break;
      case 7: accum_nq<Isa, E, 7>(f, scale, pi, p_stride, rows, row_stride, n, a); break;
      default: accum_nq<Isa, E, 8>(f, scale, pi, p_stride, rows, row_stride, n, a); break;
    }
  }
}

#define KVQ_ROWS_FOR_EACH_ELEM(X) \
  X(f32) X(f16) X(bf16) X(e4m3) X(e5m2) X(e4m3_dyn) X(e5m2_dyn) X(int8) X(int8_static) X(int4g) \
  X(int2g) X(q8_0) X(q4_0)

template <class Isa>
void scores(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows,
            size_t row_stride, int n, float* out, int out_stride) {
  switch (f.elem) {
#define X(e) \
  case KvElem::e: return scores_elem<Isa, KvElem::e>(f, scale, q, n_q, rows, row_stride, n, out, out_stride);
    KVQ_ROWS_FOR_EACH_ELEM(X)
#undef X
  }
}

template <class Isa>
void accum(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
           const uint8_t* rows, size_t row_stride, int n, float* acc) {
  switch (f.elem) {
#define X(e) \
  case KvElem::e: return accum_elem<Isa, KvElem::e>(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);
    KVQ_ROWS_FOR_EACH_ELEM(X)
#undef X
  }
}

}  // namespace kvq::kv_rows_simd
