// Vector-width-generic bodies of the fused row kernels, included by kv_rows_avx2.cpp and
// kv_rows_avx512.cpp after each defines its ISA traits `Isa`:
//   using V;  static constexpr int W (floats per vector);  V zero(), load(const float*),
//   set1(float), fma(V a, V b, V c) (a*b + c);  void store(float*, V);  float hsum(V);
//   V hsum_w(const V* v) (lane j = sum of the lanes of v[j], j < W);  int acc_regs (vector
//   accumulators a kernel may keep live);
//   template <KvElem E> V dec(const KvRowFmt&, float scale, const uint8_t* row, int e)
//     -> elements [e, e + W) of the row, decoded to f32 (scales applied);
//   template <KvElem E> V dec_raw(const uint8_t* codes): W fp8 codes unscaled; pair_decode, and
//   when true template <KvElem E> void dec_raw2(const uint8_t* codes, V* x): 2W of them.
// One decoded vector is reused for all NQ query rows, so the codes are read (and decoded) once
// per GQA group.
#pragma once
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kv/kv_rows.h"
#include "kv/prefetch_along.h"

namespace kvq {
// q4_0 / int4g / int2g weighted sum (kv_rows_i8_avx512.cpp): int4g / int2g with int16 weights and
// VPDPWSSD for head_dim % 64 == 0 and groups of 32 / 64 / 128, else (and q4_0) a float table
// lookup; head_dim % 32 == 0.
void kv_rows_accum_4bit_avx512(const KvRowFmt& f, const float* p, int p_stride, int n_q, const uint8_t* rows,
                               size_t row_stride, int n, float* acc);
// bf16 and fp8 rows with head_dim % 32 == 0 (kv_rows_bf16_avx512.cpp): VDPBF16PS against the
// query / weights rounded to bf16 (kv_rows.h: kv_rows_bf16_dot_active, the bound at kv_rows_bf16_rel).
void kv_rows_scores_bf16_avx512(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows,
                                size_t row_stride, int n, float* out, int out_stride);
void kv_rows_accum_bf16_avx512(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                               const uint8_t* rows, size_t row_stride, int n, float* acc);
}  // namespace kvq

namespace kvq::kv_rows_simd {

// Software prefetch of the row stream: a head block spans several 4 KiB pages and the hardware
// prefetchers stop at each page boundary, so a kernel reading rows at the bus rate would stall on
// every page start. Rows kv_prefetch_bytes ahead of the current ones are requested (into L2) as the
// kernel walks the block (never past its last row). A block's first rows are requested one kernel
// call early by attn_decode (KvCodec::prefetch_range: the float and int4g / int2g rows), or, at
// SIMD levels, requested along the previous calls (KvRowCodec::prefetches_along).
// A longer distance here (8 / 16 KiB) or a stream that runs on into the next block measured slower.
inline constexpr size_t kv_prefetch_bytes = 4096;
[[gnu::always_inline]] inline void kv_prefetch_ahead(const uint8_t* rows, size_t row_stride, int t, int cnt, int n) {
  const size_t end = size_t(n) * row_stride;
  const size_t e = std::min(end, size_t(t + cnt) * row_stride + kv_prefetch_bytes);
  // Locality 2 (prefetcht1): a block of f16 rows is 16 KiB, so 4 KiB ahead into L1 would evict
  // rows still in use by the weighted sum's later strips.
  for (size_t b = size_t(t) * row_stride + kv_prefetch_bytes; b < e; b += 64) __builtin_prefetch(rows + b, 0, 2);
  // The tokens' share of the later block attention asked for (kv/prefetch_along.h), if any.
  kv_prefetch_along_tokens(kv_prefetch_along, t, cnt, n);
}

// fp8 rows: the kernels decode the codes unscaled (Isa::dec_raw: E5M2 as the f16 it is the high
// byte of, E4M3 as its f16 image, 2^-8 times its value; NaN codes stay NaN) and apply the token's
// multiplier once per score or weight instead of once per element: the per-element multiply was
// a fifth of the fp8 decode's instructions. The products and sums are of exactly representable
// values either way; only where the rounding of the scale happens moves (one more f32 rounding).
template <KvElem E>
inline constexpr bool kv_token_scaled =
    E == KvElem::e4m3 || E == KvElem::e5m2 || E == KvElem::e4m3_dyn || E == KvElem::e5m2_dyn;
template <KvElem E>
inline float kv_token_mul(float scale, const uint8_t* row) {
  float s = scale;
  if constexpr (E == KvElem::e4m3_dyn || E == KvElem::e5m2_dyn) std::memcpy(&s, row, sizeof(float));
  if constexpr (E == KvElem::e4m3 || E == KvElem::e4m3_dyn) s *= 256.f;
  return s;
}
// Elements [e, e + W) of a row: unscaled for the fp8 rows, else Isa::dec.
template <class Isa, KvElem E>
[[gnu::always_inline]] inline typename Isa::V dec_row(const KvRowFmt& f, float scale, const uint8_t* row, int e) {
  if constexpr (kv_token_scaled<E>) {
    constexpr size_t off = E == KvElem::e4m3_dyn || E == KvElem::e5m2_dyn ? sizeof(KvRowScaled) : 0;
    return Isa::template dec_raw<E>(row + off + e);
  } else {
    return Isa::template dec<E>(f, scale, row, e);
  }
}
// Elements [e, e + 2W) into x[0], x[1]: ISAs with pair_decode decode the fp8 rows' 2W codes in
// one pass (AVX2: one widening and one NaN fix for 16 codes instead of two of each).
template <class Isa, KvElem E>
[[gnu::always_inline]] inline void dec_row2(const KvRowFmt& f, float scale, const uint8_t* row, int e,
                                            typename Isa::V* x) {
  if constexpr (kv_token_scaled<E> && Isa::pair_decode) {
    constexpr size_t off = E == KvElem::e4m3_dyn || E == KvElem::e5m2_dyn ? sizeof(KvRowScaled) : 0;
    Isa::template dec_raw2<E>(row + off + e, x);
  } else {
    x[0] = dec_row<Isa, E>(f, scale, row, e);
    x[1] = dec_row<Isa, E>(f, scale, row, e + Isa::W);
  }
}
template <KvElem E>
[[gnu::always_inline]] inline float row_mul(float scale, const uint8_t* row) {
  if constexpr (kv_token_scaled<E>) return kv_token_mul<E>(scale, row);
  return 1.f;
}

// One step of scores_nq: TU tokens from row t (Full) or the last cnt < TU of them, the missing
// slots repeating the last row (their sums are dropped), so that every score comes out of the same
// hsum_w tree whatever NQ is: a query's scores do not depend on how many rows share the call
// (prefill batches rows; decode does not). Full steps keep compile-time counts.
template <class Isa, KvElem E, int NQ, int TU, bool Full>
[[gnu::always_inline]] inline void scores_step(const KvRowFmt& f, float scale, const float* q, const uint8_t* rows,
                                               size_t row_stride, int t, int cnt, int n, float* out, int out_stride) {
  using V = typename Isa::V;
  constexpr int W = Isa::W;
  const int hd = f.head_dim;
  kv_prefetch_ahead(rows, row_stride, t, Full ? TU : cnt, n);
  const uint8_t* r0 = rows + size_t(t) * row_stride;
  auto row = [&](int u) { return r0 + size_t(Full || u < cnt ? u : cnt - 1) * row_stride; };
  V a[W];  // slot o = i * TU + u: query i, token t + u
  for (int j = 0; j < W; ++j) a[j] = Isa::zero();
  int e0 = 0;
  if constexpr (kv_token_scaled<E> && Isa::pair_decode) {
    // Two vectors per token per step (the same FMA order per accumulator as one at a time).
    for (; e0 + 2 * W <= hd; e0 += 2 * W) {
      V x[TU][2];
      for (int u = 0; u < TU; ++u) dec_row2<Isa, E>(f, scale, row(u), e0, x[u]);
      for (int i = 0; i < NQ; ++i) {
        const V q0 = Isa::load(q + size_t(i) * hd + e0), q1 = Isa::load(q + size_t(i) * hd + e0 + W);
        for (int u = 0; u < TU; ++u) a[i * TU + u] = Isa::fma(x[u][1], q1, Isa::fma(x[u][0], q0, a[i * TU + u]));
      }
    }
  }
  for (int e = e0; e < hd; e += W) {
    V x[TU];
    for (int u = 0; u < TU; ++u) x[u] = dec_row<Isa, E>(f, scale, row(u), e);
    for (int i = 0; i < NQ; ++i) {
      const V qv = Isa::load(q + size_t(i) * hd + e);
      for (int u = 0; u < TU; ++u) a[i * TU + u] = Isa::fma(x[u], qv, a[i * TU + u]);
    }
  }
  alignas(64) float z[W];
  Isa::store(z, Isa::hsum_w(a));
  if constexpr (kv_token_scaled<E>) {
    float mu[TU];
    for (int u = 0; u < TU; ++u) mu[u] = row_mul<E>(scale, row(u));
    for (int i = 0; i < NQ; ++i)
      for (int u = 0; u < TU; ++u) z[i * TU + u] *= mu[u];
  }
  for (int i = 0; i < NQ; ++i)
    for (int u = 0; u < (Full ? TU : cnt); ++u) out[size_t(i) * size_t(out_stride) + size_t(t + u)] = z[i * TU + u];
}

// NQ query rows in NQP slots (NQ rounded up to a power of two), TU = W / NQP tokens per step: the
// W (token, query) dot products of a step finish with one Isa::hsum_w tree instead of W full
// horizontal reductions, and each decoded chunk of a token is reused by all NQ query rows.
template <class Isa, KvElem E, int NQ>
void scores_nq(const KvRowFmt& f, float scale, const float* q, const uint8_t* rows,
               size_t row_stride, int n, float* out, int out_stride) {
  constexpr int W = Isa::W;
  constexpr int NQP = NQ <= 1 ? 1 : NQ <= 2 ? 2 : NQ <= 4 ? 4 : 8;
  static_assert(NQP <= W);
  constexpr int TU = W / NQP;
  int t = 0;
  for (; t + TU <= n; t += TU) scores_step<Isa, E, NQ, TU, true>(f, scale, q, rows, row_stride, t, TU, n, out, out_stride);
  if (t < n) scores_step<Isa, E, NQ, TU, false>(f, scale, q, rows, row_stride, t, n - t, n, out, out_stride);
}

// Chunks of kChunk tokens, each in column strips of SV vectors: the NQ * SV accumulators stay in
// registers across a chunk's tokens (its rows are in L1 after the first strip, which is the one
// that prefetches the next chunk). Wider strips cut the per-token broadcasts of p (NQ per strip)
// and loop overhead. Chunks rather than whole blocks so that the prefetch runs through the whole
// call: with one strip pass over a 64-token block, the block's memory time fell into its first
// strip (1/8 of the work for f16 at head_dim 128) and none overlapped the other seven (measured
// at 32K tokens on AVX2, bench/BENCHMARKS.md: f32 15-27% faster cold with 16-token chunks, f16
// up to 16%, bf16 and fp8 within the host's drift; 8 tokens no better, 32 between). The
// accumulators go through acc between chunks: the same FMA order.
template <class Isa, KvElem E, int NQ, int SV>
void accum_nq(const KvRowFmt& f, float scale, const float* p, int p_stride, const uint8_t* rows,
              size_t row_stride, int n, float* acc) {
  using V = typename Isa::V;
  constexpr int W = Isa::W;
  const int hd = f.head_dim;
  // fp8 rows: the weights times the tokens' multipliers, formed once per chunk of tokens instead
  // of once per strip (fl(p * mu) either way).
  constexpr int kChunk = 16;
  alignas(64) float pw[kv_token_scaled<E> ? NQ : 1][kv_token_scaled<E> ? kChunk : 1];
  for (int t0 = 0; t0 < n; t0 += kChunk) {
    const int t1 = std::min(n, t0 + kChunk);
    const float* wp = p;  // weight of row i, token t at wp[i * ws + t - wt]
    size_t ws = size_t(p_stride);
    int wt = 0;
    if constexpr (kv_token_scaled<E>) {
      for (int t = t0; t < t1; ++t) {
        const float mu = row_mul<E>(scale, rows + size_t(t) * row_stride);
        for (int i = 0; i < NQ; ++i) pw[i][t - t0] = p[size_t(i) * size_t(p_stride) + size_t(t)] * mu;
      }
      wp = &pw[0][0];
      ws = kChunk;
      wt = t0;
    }
    for (int e = 0; e < hd; e += W * SV) {
      V a[NQ][SV];
      for (int i = 0; i < NQ; ++i)
        for (int v = 0; v < SV; ++v) a[i][v] = Isa::load(acc + size_t(i) * hd + e + W * v);
      for (int t = t0; t < t1; ++t) {
        if (e == 0) kv_prefetch_ahead(rows, row_stride, t, 1, n);
        const uint8_t* row = rows + size_t(t) * row_stride;
        V x[SV];
        if constexpr (SV % 2 == 0) {
          for (int v = 0; v < SV; v += 2) dec_row2<Isa, E>(f, scale, row, e + W * v, x + v);
        } else {
          for (int v = 0; v < SV; ++v) x[v] = dec_row<Isa, E>(f, scale, row, e + W * v);
        }
        for (int i = 0; i < NQ; ++i) {
          const V w = Isa::set1(wp[size_t(i) * ws + size_t(t - wt)]);
          for (int v = 0; v < SV; ++v) a[i][v] = Isa::fma(w, x[v], a[i][v]);
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int v = 0; v < SV; ++v) Isa::store(acc + size_t(i) * hd + e + W * v, a[i][v]);
    }
  }
}

// Query rows in batches of at most 8: enough to amortize the decode, few enough to keep the
// accumulators in registers.
// Calls fn(std::integral_constant<int, NQ>{}) with NQ = min(n, 8): the per-group-size kernels
// are instantiated for 1..8 query rows.
template <class Fn>
void with_nq(int n, Fn&& fn) {
  switch (n < 8 ? n : 8) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    default: return fn(std::integral_constant<int, 8>{});
  }
}

template <class Isa, KvElem E>
void scores_elem(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows,
                 size_t row_stride, int n, float* out, int out_stride) {
  const size_t hd = size_t(f.head_dim);
  for (int i0 = 0; i0 < n_q; i0 += 8) {
    const float* qi = q + size_t(i0) * hd;
    float* o = out + size_t(i0) * size_t(out_stride);
    with_nq(n_q - i0, [&](auto nq) { scores_nq<Isa, E, decltype(nq)::value>(f, scale, qi, rows, row_stride, n, o, out_stride); });
  }
}

// Strip width: the widest of 4 / 2 / 1 vectors that divides head_dim and keeps NQ * SV
// accumulators within Isa::acc_regs.
template <class Isa, KvElem E, int NQ>
void accum_sv(const KvRowFmt& f, float scale, const float* p, int p_stride, const uint8_t* rows,
              size_t row_stride, int n, float* acc) {
  const int nv = f.head_dim / Isa::W;
  if constexpr (NQ * 4 <= Isa::acc_regs)
    if (nv % 4 == 0) return accum_nq<Isa, E, NQ, 4>(f, scale, p, p_stride, rows, row_stride, n, acc);
  if constexpr (NQ * 2 <= Isa::acc_regs)
    if (nv % 2 == 0) return accum_nq<Isa, E, NQ, 2>(f, scale, p, p_stride, rows, row_stride, n, acc);
  accum_nq<Isa, E, NQ, 1>(f, scale, p, p_stride, rows, row_stride, n, acc);
}

template <class Isa, KvElem E>
void accum_elem(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                const uint8_t* rows, size_t row_stride, int n, float* acc) {
  const size_t hd = size_t(f.head_dim);
  for (int i0 = 0; i0 < n_q; i0 += 8) {
    const float* pi = p + size_t(i0) * size_t(p_stride);
    float* a = acc + size_t(i0) * hd;
    with_nq(n_q - i0, [&](auto nq) { accum_sv<Isa, E, decltype(nq)::value>(f, scale, pi, p_stride, rows, row_stride, n, a); });
  }
}

#define KVQ_ROWS_FOR_EACH_ELEM(X) \
  X(f32) X(f16) X(bf16) X(e4m3) X(e5m2) X(e4m3_dyn) X(e5m2_dyn) X(int8) X(int8_static) X(int4g) \
  X(int2g) X(q8_0) X(q4_0) X(q4_1) X(q5_0) X(q5_1) X(iq4_nl)
// llama.cpp's q4_1 / q5_* / iq4_nl rows are decoded only by ISAs with Isa::ggml_ext (kv_rows.h:
// kv_elem_ggml_ext); the others' switches never see them.
template <class Isa, KvElem E>
inline constexpr bool isa_decodes = !kv_elem_ggml_ext(E) || requires { Isa::ggml_ext; };

template <class Isa>
void scores(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows,
            size_t row_stride, int n, float* out, int out_stride) {
  switch (f.elem) {
#define X(e)                                                                                          \
  case KvElem::e:                                                                                     \
    if constexpr (isa_decodes<Isa, KvElem::e>)                                                        \
      return scores_elem<Isa, KvElem::e>(f, scale, q, n_q, rows, row_stride, n, out, out_stride);     \
    break;
    KVQ_ROWS_FOR_EACH_ELEM(X)
#undef X
  }
}

template <class Isa>
void accum(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
           const uint8_t* rows, size_t row_stride, int n, float* acc) {
  switch (f.elem) {
#define X(e)                                                                                          \
  case KvElem::e:                                                                                     \
    if constexpr (isa_decodes<Isa, KvElem::e>)                                                        \
      return accum_elem<Isa, KvElem::e>(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);        \
    break;
    KVQ_ROWS_FOR_EACH_ELEM(X)
#undef X
  }
}

}  // namespace kvq::kv_rows_simd
