// KVQuant-style keys (after Hooper et al., 2024): per-channel key quantization *before* RoPE,
// with a non-uniform codebook ("nuq"), per-vector dense-and-sparse outliers and an exact
// attention sink.
//
// Codecs kvquant2_k, kvquant3_k, kvquant4_k (KvCodecInfo::pre_rope = true: the engine hands
// encode() the pre-RoPE keys; decode()/scores() rotate after dequantizing, at position
// pos0 + t). Values: kvquant2_v / kvquant3_v / kvquant4_v are the KIVI per-token value codec at
// the same bits (asymmetric uniform, groups of 32 channels) with the keys' G and R; KVQuant's
// non-uniform, dense-and-sparse *values* are not implemented. Formats kvquant2/3/4.
//
// Head block of block_tokens tokens:
//   [f16 sink rows (S, head_dim)]        positions 0..S-1 of the sequence, exact (f16); every
//                                        block reserves them so all blocks have one size
//   block_tokens / G groups, each:
//   [f16 scale (head_dim)][f16 mid (head_dim)]   per channel over the group's G tokens:
//                                        x ~= mid + scale * codebook[code]
//   [code rows (G, bits planes)]         bit planes as in kivi.h
//   [f16 outlier values (G, k)][u8 outlier channels (G, k)]
// Dense-and-sparse: per token, the k = ceil(outlier_fraction * head_dim) channels farthest from
// their channel's mean in units of the channel's standard deviation (over the group) are kept
// exact and excluded from the channel's min/max, so one spike does not stretch the range for the
// other G - 1 tokens. Sink tokens are excluded from the statistics too.
// The codebook holds 2^bits ascending values in [-1, 1] (the per-channel normalized domain):
// from the calibration artifacts when given, else a default fitted (kvquant_fit) at codec
// creation on synthetic standard-normal keys.
//
// Calibration schema (KvCodecParams::calib):
//   {"layers": [{"layer": 0, "kvquant_k3": {"codebook": [8 floats], ...}, ...}, ...]}
// the entry for layer L is the one whose "layer" equals L (or the L-th entry when entries have no
// "layer"); "kvquant_k<bits>" is what kvquant_fit returns for that layer.
//
// Defaults: G = 32, R = 0 (KVQuant has no full-precision window; the cache's tail holds < G
// tokens), S = 1, outlier_fraction = 0.01 (k = 2 at head_dim 128).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvq/kv_format.h"

namespace kvq {

void kv_register_kvquant();

constexpr int kvquant_default_group_tokens = 32;
constexpr int kvquant_default_residual_tokens = 0;
constexpr int kvquant_default_sink_tokens = 1;
constexpr double kvquant_default_outlier_fraction = 0.01;

struct KvquantKeyConfig {
  int bits = 3;  // 2, 3 or 4
  int head_dim = 128;
  int group_tokens = kvquant_default_group_tokens;
  int residual_tokens = kvquant_default_residual_tokens;
  int sink_tokens = kvquant_default_sink_tokens;   // S; 0 disables the exact sink
  int outliers_per_token = -1;                      // k; -1: ceil(0.01 * head_dim); 0 disables
  KvRope rope;                                      // n_rot = 0: no RoPE (plain per-channel nuq)
  std::vector<float> codebook;                      // empty: default for `bits`
  std::string name = "kvquant3_k";
};

// Throws kvq::Error on invalid parameters.
std::unique_ptr<KvCodec> kvquant_key_codec_create(const KvquantKeyConfig& cfg);

// The default codebook for `bits` (Lloyd fit on standard-normal keys), computed once.
const std::vector<float>& kvquant_default_codebook(int bits);

// Fits one layer's artifacts from calibration keys. keys_pre_rope: (n_tokens, n_kv_heads,
// head_dim), before RoPE. Groups of group_tokens consecutive tokens per head are normalized per
// channel exactly as the codec does (outliers and token 0 .. sink_tokens-1 excluded) and a
// 2^bits-level Lloyd-Max codebook is fitted to the normalized values. Returns
//   {"kvquant_k<bits>": {"codebook": [...], "group_tokens": G, "outliers_per_token": k,
//                        "n_samples": N, "mse": normalized-domain MSE}}
// Throws kvq::Error on invalid shapes or non-finite input.
nlohmann::json kvquant_fit(const float* keys_pre_rope, int n_tokens, int n_kv_heads, int head_dim,
                           int bits, int group_tokens = kvquant_default_group_tokens,
                           int sink_tokens = kvquant_default_sink_tokens,
                           int outliers_per_token = -1);

// RoPE as the KVQuant keys apply it after dequantization: pair i of the n_rot rotated dims
// turns by pos * freq_scale * freq_base^(-2i / n_rot) (angles in double). x: (head_dim), in place.
// The engine should rotate q and the tail keys with the same function so both sides agree.
void kv_rope_apply(const KvRope& r, int pos, float* x, int head_dim);

// ---- kernels: scalar reference and SIMD variants share these signatures ----
// out[c] = scale[c] * codebook[code_c] + mid[c]; planes: bits planes of head_dim/8 bytes;
// codebook: 16 floats (entries past 2^bits unused); scale, mid, out: (head_dim)
using kvquant_dequant_fn = void (*)(const uint8_t* planes, int bits, int head_dim,
                                    const float* codebook, const float* scale, const float* mid,
                                    float* out);
// out[i * out_stride] = <q_i, k>; q: (n_q, head_dim), k: (head_dim)
using kvquant_dot_fn = void (*)(const float* q, int n_q, const float* k, int head_dim, float* out,
                                int out_stride);

// RoPE of one dequantized key in the score path, positions walked token by token: when `step`,
// advances (c, s) = (cos, sin)(pos * theta_i) to pos + 1 by angle addition in double
// (c' = c dc - s ds, s' = s dc + c ds, dc/ds = cos/sin theta_i) and rounds them to f32 in (cf, sf);
// then rotates pair i of x: (2i, 2i+1), or (i, i + half) when neox, by (cf[i], sf[i]).
// c, s, dc, ds: (half) double; cf, sf: (half) f32; x: (>= 2 half) f32.
using kvquant_rope_fn = void (*)(double* c, double* s, const double* dc, const double* ds, float* cf,
                                 float* sf, int half, bool step, float* x, bool neox);

struct KvquantKernels {
  kvquant_dequant_fn dequant;
  kvquant_dot_fn dot;
  kvquant_rope_fn rope;
};

// Bit-identical variants (separate multiplies and adds, no contraction): rope results do not
// depend on the CPU level.
void kvquant_rope_scalar(double* c, double* s, const double* dc, const double* ds, float* cf, float* sf,
                         int half, bool step, float* x, bool neox);
#if defined(KVQ_HAVE_SIMD)
void kvquant_rope_avx512(double* c, double* s, const double* dc, const double* ds, float* cf, float* sf,
                         int half, bool step, float* x, bool neox);
#endif

void kvquant_dequant_scalar(const uint8_t*, int, int, const float*, const float*, const float*,
                            float*);
void kvquant_dot_scalar(const float*, int, const float*, int, float*, int);
#if defined(KVQ_HAVE_SIMD)
void kvquant_dequant_avx2(const uint8_t*, int, int, const float*, const float*, const float*,
                          float*);
void kvquant_dot_avx2(const float*, int, const float*, int, float*, int);
void kvquant_dequant_avx512(const uint8_t*, int, int, const float*, const float*, const float*,
                            float*);
void kvquant_dot_avx512(const float*, int, const float*, int, float*, int);
#endif

// The variant for cpu_level() (the one dispatch point of this family).
const KvquantKernels& kvquant_kernels();

}  // namespace kvq
