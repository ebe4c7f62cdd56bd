// KIVI (Liu et al., ICML 2024): asymmetric min/max quantization of keys per channel (each
// channel's scale and zero span a group of G tokens) and of values per token (groups of g
// channels), at 2 or 4 bits, with the newest R tokens kept full precision by the cache.
//
// Codecs: kivi2_k, kivi4_k (keys), kivi2_v, kivi4_v (values); formats kivi2, kivi4. These store
// kivi2t's / kivi4t's 16-token tiles (kv/kivi_tiled.h: same quantization, bytes and decode) when
// head_dim % 32 == 0 and G % 16 == 0, else these bit planes; kivi2p_k / kivi2p_v / kivi4p_k / kivi4p_v
// (formats kivi2p, kivi4p) always the planes.
// Both roles are grouped codecs with the same G and R (KvCodecParams::group_tokens /
// residual_tokens; defaults G = 32, R = 128 as in the paper), because K and V of a token must
// leave the full-precision tail together. Values are still scaled per token: G only sets when
// they are encoded. Validation: bits in {2, 3, 4} (3 only through the KVQuant value codecs),
// head_dim % 16 == 0, G >= 1, R >= 0 and R % G == 0 (the tail then cycles through R..R+G-1
// tokens, the paper's streaming scheme), value group g % 16 == 0 dividing head_dim, and
// block_tokens % G == 0 (checked by block_bytes / encode). Other G / R are chosen through
// KvCodecParams, not through extra codec names ("kivi2_k" with group_tokens = 64 is KIVI-2 at
// G = 64), so that every K/V pair in a format shares one G and R.
//
// Code layout: bit planes. A row of head_dim b-bit codes is b planes of head_dim/8 bytes; bit
// (c % 8) of byte c / 8 of plane j is bit j of code c. Planes let the same unpacking serve 2, 3
// and 4 bits, and map directly onto AVX-512 mask registers (16 channels = one 16-bit load) and
// AVX2 byte masks, so fused kernels never shift codes out of bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/dtypes.h"
#include "kvq/kv_format.h"

namespace kvq {

void kv_register_kivi();

constexpr int kivi_default_group_tokens = 32;
constexpr int kivi_default_residual_tokens = 128;
constexpr int kivi_default_value_group = 32;

struct KiviConfig {
  KvRole role = KvRole::key;
  int bits = 2;             // 2, 3 or 4
  int head_dim = 128;
  int group_tokens = kivi_default_group_tokens;        // G
  int residual_tokens = kivi_default_residual_tokens;  // R
  int value_group = kivi_default_value_group;          // g (values only)
  std::string name = "kivi2_k";
};

// Throws kvq::Error on invalid parameters.
std::unique_ptr<KvCodec> kivi_codec_create(const KiviConfig& cfg);

// ---- bit-plane rows (shared with KVQuant) ----
inline size_t bitplane_row_bytes(int bits, int head_dim) { return size_t(bits) * head_dim / 8; }
// codes (head_dim) -> row (bits planes of head_dim/8 bytes)
void bitplane_pack(const uint8_t* codes, int bits, int head_dim, uint8_t* row);
inline int bitplane_code(const uint8_t* row, int bits, int head_dim, int c) {
  int v = 0;
  for (int j = 0; j < bits; ++j) v |= ((row[j * (head_dim / 8) + c / 8] >> (c % 8)) & 1) << j;
  return v;
}

// ---- kernels: scalar reference and SIMD variants share these signatures ----
// Per-channel keys of one group: out[i * out_stride + t] = sum_c qs[i, c] * code_{t, c} + qz[i]
// for t < n, i < n_q, where qs = q * scale (per channel) and qz = q . zero were folded once per
// group by the caller, so the inner loop is codes times one precomputed vector.
//   codes: n rows of bitplane_row_bytes(bits, head_dim) bytes, row_bytes apart
//   qs: (n_q, head_dim), qz: (n_q), out: (n_q, out_stride)
// AVX-512 (head_dim % 64 == 0) rounds each qs row to int16 steps dq = max|qs| / 32767 and sums
// codes exactly with vpdpwssd: |error| <= dq / 2 * sum_c code_c (tests/kivi_int_dot_bound.h).
using kivi_k_scores_fn = void (*)(const uint8_t* codes, size_t row_bytes, int n, int bits,
                                  int head_dim, const float* qs, const float* qz, int n_q,
                                  float* out, int out_stride);
// Per-token values: acc[i, c] += p[i * p_stride + t] * (scale_{t, c/g} * code_{t, c} + zero_{t, c/g}).
//   rows: n value rows (kivi_v_row_bytes), row_bytes apart, each [f16 scale (head_dim/g)]
//         [f16 zero (head_dim/g)][bit planes]
//   p: (n_q, p_stride), acc: (n_q, head_dim)
// AVX-512 (head_dim % 64 == 0, g % 32 == 0) rounds w = p * scale per query, group and run of 64
// tokens to int16 steps dw = max|w| / 32767 (zero terms in f32): |error| <= sum_t dw / 2 * code.
using kivi_v_accum_fn = void (*)(const uint8_t* rows, size_t row_bytes, int n, int bits,
                                 int head_dim, int group, const float* p, int p_stride, int n_q,
                                 float* acc);

struct KiviKernels {
  kivi_k_scores_fn k_scores;
  kivi_v_accum_fn v_accum;
};

void kivi_k_scores_scalar(const uint8_t*, size_t, int, int, int, const float*, const float*, int,
                          float*, int);
void kivi_v_accum_scalar(const uint8_t*, size_t, int, int, int, int, const float*, int, int,
                         float*);
#if defined(KVQ_HAVE_SIMD)
void kivi_k_scores_avx2(const uint8_t*, size_t, int, int, int, const float*, const float*, int,
                        float*, int);
void kivi_v_accum_avx2(const uint8_t*, size_t, int, int, int, int, const float*, int, int,
                       float*);
void kivi_k_scores_avx512(const uint8_t*, size_t, int, int, int, const float*, const float*, int,
                          float*, int);
void kivi_v_accum_avx512(const uint8_t*, size_t, int, int, int, int, const float*, int, int,
                         float*);
#endif

// Folds a key group's per-channel scales and zeros into the query rows, once per group:
// qs[i, c] = q[i, c] * scale_c, qz[i] = sum_c q[i, c] * zero_c.
//   params: [f16 scale (head_dim)][f16 zero (head_dim)]; q, qs: (n_q, head_dim); qz: (n_q)
void kivi_fold_query_scalar(const uint8_t* params, const float* q, int n_q, int head_dim, float* qs, float* qz);
#if defined(KVQ_HAVE_SIMD)
void kivi_fold_query_avx512(const uint8_t* params, const float* q, int n_q, int head_dim, float* qs, float* qz);
#endif
// Dispatches on cpu_level() (AVX2 uses the scalar fold).
void kivi_fold_query(const uint8_t* params, const float* q, int n_q, int head_dim, float* qs, float* qz);

// The variant for cpu_level() (the one dispatch point of this family).
const KiviKernels& kivi_kernels();

inline size_t kivi_v_row_bytes(int bits, int head_dim, int group) {
  return size_t(head_dim / group) * 4 + bitplane_row_bytes(bits, head_dim);
}

}  // namespace kvq
