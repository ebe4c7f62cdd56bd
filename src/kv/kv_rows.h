// Per-token row formats: one token of one KV head stored as a fixed-size row, and the kernels that
// read rows packed (fused scores against queries, fused probability-weighted accumulation).
// Every per-token codec of the basic families (float, fp8, int8, grouped int4/int2, and llama.cpp's
// KV cache types q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl)
// is a KvRowCodec (row_codec.h) over one of these row formats; a head block is simply
// block_tokens rows, row_bytes apart, so block_bytes = block_tokens * row_bytes exactly.
//
// Kernels come in three variants with one signature: *_ref (scalar: decode the row to f32, then
// dot / axpy), *_avx2 and *_avx512 (decode 8 / 16 elements in registers, reuse them for all n_q
// query rows of the GQA group). kv_rows_scores / kv_rows_accum are the one dispatch point
// (by cpu_level()).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/dtypes.h"
#include "gguf/ggml_types.h"

namespace kvq {

// Largest head_dim the row kernels accept (the reference decodes one row into a stack buffer).
inline constexpr int kv_max_head_dim = 1024;

enum class KvElem : uint8_t {
  f32,          // float[head_dim]
  f16,          // f16[head_dim]
  bf16,         // bf16[head_dim]
  e4m3,         // u8[head_dim] fp8 E4M3 codes; value = fp8 * scale (scale per head: fixed / calibrated)
  e5m2,         // u8[head_dim] fp8 E5M2 codes; value = fp8 * scale
  e4m3_dyn,     // KvRowScaled: f32 scale (absmax / 448) then E4M3 codes
  e5m2_dyn,     // KvRowScaled: f32 scale (absmax / 57344) then E5M2 codes
  int8,         // KvRowScaled: f32 scale (absmax / 127) then int8 codes (symmetric, -127..127)
  int8_static,  // i8[head_dim]; value = code * scale (scale per head, calibrated)
  int4g,        // KvGroupParams[head_dim / group] then u8 codes[head_dim / 2] (see kv_unit_int4)
  int2g,        // KvGroupParams[head_dim / group] then u8 codes[head_dim / 4] (see kv_unit_int2)
  q8_0,         // kv_block_q8_0[head_dim / 32]
  q4_0,         // kv_block_q4_0[head_dim / 32]
  q4_1,         // kv_block_q4_1[head_dim / 32]
  q5_0,         // kv_block_q5_0[head_dim / 32]
  q5_1,         // kv_block_q5_1[head_dim / 32]
  iq4_nl,       // kv_block_iq4_nl[head_dim / 32]
};

// Header of a row whose scale is computed per token at write time. f32 rather than f16: a per-token
// scale must cover any magnitude the model produces (f16 would flush absmax < ~8e-3 / 127 to
// subnormals and overflow above 65504 * 127); it costs 32 / head_dim bits per element.
struct KvRowScaled {
  float scale;
  // followed by head_dim one-byte codes
};
static_assert(sizeof(KvRowScaled) == 4);

// Scale and minimum of one group of the asymmetric grouped formats: x ~= min + code * scale.
// f16 for both, as in the published grouped KV caches (b + 32/g bits per element).
struct KvGroupParams {
  f16_t scale;
  f16_t min;
};
static_assert(sizeof(KvGroupParams) == 4);

// Code packing of the grouped formats, in units of 32 elements so that one unit decodes with
// one load whatever the vector width:
//  int4: 16 bytes per unit; byte j holds element j in its low nibble and element j + 16 in its
//        high nibble (the same order as q4_0, so one decoder serves both);
//  int2: 8 bytes per unit; byte j holds element j + 8k in bits 2k..2k+1 (k = 0..3).
inline constexpr int kv_unit_elems = 32;
inline constexpr int kv_unit_int4_bytes = 16;
inline constexpr int kv_unit_int2_bytes = 8;

// llama.cpp's KV blocks: 32 elements along head_dim, f16 scale d. Same layout and rounding as
// ggml's, so codes and decoded values are bit-comparable.
struct kv_block_q8_0 {
  f16_t d;        // absmax / 127
  int8_t qs[32];  // x ~= d * qs
};
static_assert(sizeof(kv_block_q8_0) == 34);
struct kv_block_q4_0 {
  f16_t d;         // (signed value of largest magnitude) / -8
  uint8_t qs[16];  // element j in the low nibble of qs[j], element j + 16 in the high; x ~= d * (q - 8)
};
static_assert(sizeof(kv_block_q4_0) == 18);
// The other types llama.cpp's -ctk / -ctv take, element order as q4_0 (element j in the low nibble
// of qs[j], j + 16 in the high one). q5_*: the fifth bit of element j is bit j of the 32-bit
// little-endian qh.
struct kv_block_q4_1 {
  f16_t d;         // (max - min) / 15
  f16_t m;         // min
  uint8_t qs[16];  // x ~= d * q + m, q 0..15
};
static_assert(sizeof(kv_block_q4_1) == 20);
struct kv_block_q5_0 {
  f16_t d;         // (signed value of largest magnitude) / -16
  uint8_t qh[4];   // fifth bits
  uint8_t qs[16];  // x ~= d * (q - 16), q 0..31
};
static_assert(sizeof(kv_block_q5_0) == 22);
struct kv_block_q5_1 {
  f16_t d;         // (max - min) / 31
  f16_t m;         // min
  uint8_t qh[4];   // fifth bits
  uint8_t qs[16];  // x ~= d * q + m, q 0..31
};
static_assert(sizeof(kv_block_q5_1) == 24);
// iq4_nl: a 4-bit index into a fixed non-uniform grid (denser near 0), one f16 scale per block.
struct kv_block_iq4_nl {
  f16_t d;         // least-squares scale for the chosen grid points
  uint8_t qs[16];  // x ~= d * kv_iq4nl_grid[q]
};
static_assert(sizeof(kv_block_iq4_nl) == 18);
inline constexpr const int8_t (&kv_iq4nl_grid)[16] = kIq4nlValues;
// The formats whose SIMD kernels are the AVX2 ones at every level (the float-decode row kernels;
// they run unchanged on AVX-512 machines).
constexpr bool kv_elem_ggml_ext(KvElem e) {
  return e == KvElem::q4_1 || e == KvElem::q5_0 || e == KvElem::q5_1 || e == KvElem::iq4_nl;
}

struct KvRowFmt {
  KvElem elem = KvElem::f32;
  int head_dim = 0;
  int group = 0;         // int4g / int2g: elements per (scale, min) group
  size_t row_bytes = 0;  // bytes of one token row
};

// Exact size of one row; the formats' layouts above are the only thing it depends on.
size_t kv_row_bytes(KvElem e, int head_dim, int group);
// Builds a format; KVQ_CHECKs the shape (codec factories validate user input before this).
KvRowFmt kv_row_fmt(KvElem e, int head_dim, int group = 0);
// Bits per element of the codes alone (no scales).
double kv_elem_code_bits(KvElem e);

// `scale` is the per-head multiplier of the fixed/static formats (e4m3, e5m2, int8_static) and is
// ignored by the others. x: (head_dim) f32; row: row_bytes.
void kv_row_encode(const KvRowFmt& f, float scale, const float* x, uint8_t* row);
void kv_row_decode(const KvRowFmt& f, float scale, const uint8_t* row, float* x);

// out[i * out_stride + t] = <q_i, row_t> for i < n_q, t < n.
// q: (n_q, head_dim) rows head_dim apart; rows: n rows, row_stride bytes apart.
using KvScoresFn = void (*)(const KvRowFmt& f, float scale, const float* q, int n_q,
                            const uint8_t* rows, size_t row_stride, int n, float* out,
                            int out_stride);
// acc[i * head_dim + d] += sum_t p[i * p_stride + t] * row_t[d].
// p: (n_q, p_stride); acc: (n_q, head_dim); rows: n rows, row_stride bytes apart.
using KvAccumFn = void (*)(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                           const uint8_t* rows, size_t row_stride, int n, float* acc);

void kv_rows_scores_ref(const KvRowFmt& f, float scale, const float* q, int n_q,
                        const uint8_t* rows, size_t row_stride, int n, float* out, int out_stride);
void kv_rows_accum_ref(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                       const uint8_t* rows, size_t row_stride, int n, float* acc);
#if defined(KVQ_HAVE_SIMD)
void kv_rows_scores_avx2(const KvRowFmt& f, float scale, const float* q, int n_q,
                         const uint8_t* rows, size_t row_stride, int n, float* out, int out_stride);
void kv_rows_accum_avx2(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                        const uint8_t* rows, size_t row_stride, int n, float* acc);
void kv_rows_scores_avx512(const KvRowFmt& f, float scale, const float* q, int n_q,
                           const uint8_t* rows, size_t row_stride, int n, float* out,
                           int out_stride);
void kv_rows_accum_avx512(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                          const uint8_t* rows, size_t row_stride, int n, float* acc);
#endif

// Integer-dot scores for the 4-bit formats (q4_0, int4g; head_dim % 64 == 0) and int2g. A 4-bit code times
// a float query costs a nibble decode, an int->float conversion and an FMA per element and query;
// with the query quantized once per decode step to int8 per 32-element block (dq_b = absmax_b /
// 127, q ~= dq_b * round(q / dq_b)), 4 code bytes x 4 query bytes are one VNNI dot (u8 x s8:
// codes are unsigned 0..15, so no sign fix-up), and both nibble halves decode with one AND/shift.
// Every 4-bit row is x = s * c + m per block (q4_0: s = d, m = -8 d), so
//   <q, x> = sum_b s_b dq_b <c_b, q8_b> + sum_b m_b sum_{j in b} q_j,
// where the second sum uses the exact float query: the only approximation is q8 in the first,
// |error| <= sum_j (dq_b(j) / 2) |s c_j|.
// Prepared query row: head_dim floats of the plain query, then kv_rows_query_extra_floats(f)
// floats holding (bytes): qlo int8[hd/2] (qlo[16b + j] = q8[32b + j]), qhi int8[hd/2]
// (qhi[16b + j] = q8[32b + 16 + j]), dq float[hd/8] and qs float[hd/8]. Lane l = 4b + k of the
// last two (one int32 lane of the VNNI dot, covering elements 32b + 4k..+3 and 32b + 16 + 4k..+3):
// dq[l] = dq_b, qs[l] = the float sum of q over those 8 elements.
// int2g (head_dim % 128 == 0) uses the same scheme with 2-bit planes: per 128 elements the code
// bytes (32) give planes P_k = (codes >> 2k) & 3, P_k byte 8u + j = element 32u + 8k + j; the
// query image holds "qlo" = [q8 of plane 0 | plane 1] and "qhi" = [plane 2 | plane 3] per 64
// bytes, and lane l = 8h + 2u + r (h = 0, 1) covers elements 32u + 8h + 4r..+3 and
// 32u + 8(h + 2) + 4r..+3: the same sizes, dq per block, qs per lane.
inline bool kv_rows_int_dot_ok(const KvRowFmt& f) {
  if (f.elem == KvElem::int2g) return f.head_dim % 128 == 0;
  return (f.elem == KvElem::q4_0 || f.elem == KvElem::int4g) && f.head_dim % 64 == 0;
}
// 0 when the format has no integer-dot path.
int kv_rows_query_extra_floats(const KvRowFmt& f);
// The parts of prepared query row i (rows q_stride floats apart) that the integer kernels read.
struct KvRowsQueryRow {
  const uint8_t* lo;  // qlo int8[hd/2]
  const uint8_t* hi;  // qhi int8[hd/2]
  const float* dq;    // [hd/8]
  const float* qs;    // [hd/8]
};
inline KvRowsQueryRow kv_rows_query_row(int hd, const float* qp, size_t q_stride, int i) {
  const float* r = qp + size_t(i) * q_stride;
  KvRowsQueryRow q;
  q.lo = reinterpret_cast<const uint8_t*>(r + hd);
  q.hi = q.lo + hd / 2;
  q.dq = r + hd + hd / 4;
  q.qs = q.dq + hd / 8;
  return q;
}
// q: (n_q, head_dim) -> qp: (n_q, head_dim + extra) (see above). Once per decode step.
void kv_rows_prepare_query(const KvRowFmt& f, const float* q, int n_q, float* qp);
// kv_rows_scores over prepared query rows (q_stride = head_dim + extra floats apart): the integer
// kernels at AVX2 / AVX-512, the float reference on the plain part at the scalar level.
void kv_rows_scores_prepared(const KvRowFmt& f, float scale, const float* qp, int n_q, const uint8_t* rows,
                             size_t row_stride, int n, float* out, int out_stride);
#if defined(KVQ_HAVE_SIMD)
// qp: prepared rows as above. Parity with kv_rows_scores_ref is within the bound stated above.
void kv_rows_scores_i8_avx2(const KvRowFmt& f, const float* qp, int n_q, const uint8_t* rows,
                            size_t row_stride, int n, float* out, int out_stride);
void kv_rows_scores_i8_avx512(const KvRowFmt& f, const float* qp, int n_q, const uint8_t* rows,
                              size_t row_stride, int n, float* out, int out_stride);
#endif

// SIMD variants decode 16 elements per step (AVX2 as two halves): other head_dims use the reference.
inline bool kv_rows_simd_ok(const KvRowFmt& f) { return f.head_dim % 16 == 0; }

// bf16 and fp8 rows at the AVX-512 level, head_dim % 32 == 0 (kv_rows_bf16_avx512.cpp): scores
// and weighted sums are VDPBF16PS dot products against the query (scores) or the weights (sums)
// rounded to bf16, as GPU attention kernels round the query and the probabilities of a bf16
// cache; the f32-FMA kernels spent two thirds of the time converting and multiplying, the
// VDPBF16PS ones do two bf16 products per lane and instruction. FP8 values are bf16 values
// exactly (a table lookup); their scale multiplies the score / the weight.
// Rounding to nearest even moves a value by at most 2^-8 of itself (8-bit significand); the
// instructions treat inputs below 2^-126 as 0 (the rows' too). Products of two bf16 are exact in
// f32, so with f32 sums:
//   |score - <q, k>|                <= 2^-8 sum_i |q_i k_i| + 2^-126 sum_i (|q_i| + |k_i|) + f32 summation
//   |acc[d] - sum_t p_t v_t[d]|     <= 2^-8 sum_t |p_t v_t[d]| + 2^-126 sum_t (|p_t| + |v_t[d]|) + f32 summation
// (tests: test_kv_formats, test_attention).
inline constexpr double kv_rows_bf16_rel = 1.0 / 256;
inline constexpr double kv_rows_bf16_flush = 1.1754943508222875e-38;  // 2^-126
// The fp8 rows with a per-token scale (e4m3_dyn, e5m2_dyn: a 4-byte scale before the codes) too,
// since the codes turn into bf16 through byte tables (64 per six instructions): 2x faster than
// their f32 kernels at 32K tokens (bench/BENCHMARKS.md, "FP8 codes through byte tables").
inline bool kv_rows_bf16_dot_active(const KvRowFmt& f) {
  const bool elem = f.elem == KvElem::bf16 || f.elem == KvElem::e4m3 || f.elem == KvElem::e5m2 ||
                    f.elem == KvElem::e4m3_dyn || f.elem == KvElem::e5m2_dyn;
  return elem && f.head_dim % 32 == 0;
}

// The dispatch point: picks the variant for cpu_level() and the format.
void kv_rows_scores(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows,
                    size_t row_stride, int n, float* out, int out_stride);
void kv_rows_accum(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                   const uint8_t* rows, size_t row_stride, int n, float* acc);

}  // namespace kvq
