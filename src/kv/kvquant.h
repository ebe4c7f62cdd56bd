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
// Calibrated ranges (codecs kvquant2_cal_k .. kvquant4_cal_k, formats kvquant2_cal ..): the
// per-channel mid and scale of each head come from `kvq calibrate` (kvquant_fit_static) instead
// of each group of G tokens, as KVQuant computes its key scaling offline. The codec is then per
// token (G = 1, no window: every token is packed as it arrives) and a head block is
//   [f16 sink rows (S, head_dim)][code rows (block_tokens)][f16 outlier values (block_tokens, k)]
//   [u8 outlier channels (block_tokens, k)]
// so the codes cost bits + 24 k / head_dim bits per element and nothing else. A token's outliers
// are the k channels farthest outside the calibrated range (largest |x - mid| / scale).
//
// Defaults: G = 32, R = 0 (KVQuant has no full-precision window; the cache's tail holds < G
// tokens), S = 1, outlier_fraction = 0.01 (k = 2 at head_dim 128).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
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
  // Calibrated ranges (KVQuant's offline per-channel scaling): (n_kv_heads * head_dim) each,
  // x ~= mid + scale * codebook[code] with the same mid and scale for every token of head h.
  // Non-empty: a per-token codec whose blocks hold no group parameters (see below).
  int n_kv_heads = 1;
  std::vector<float> static_mid, static_scale;
  // Explicit RoPE angle rates (the parts of the mixed-precision keys, kvquant_mixed.h):
  // n_kv_heads x rope.n_rot / 2 values, head h's pair j turning by pos * pair_theta[h * n_rot/2 + j]
  // (0: a pair RoPE leaves alone). Needs rope.neox (pair j = channels j and j + n_rot / 2).
  // Empty: the rates of `rope`.
  std::vector<double> pair_theta;
};

// Throws kvq::Error on invalid parameters.
std::unique_ptr<KvCodec> kvquant_key_codec_create(const KvquantKeyConfig& cfg);

// The default codebook for `bits` (Lloyd fit on standard-normal keys), computed once.
const std::vector<float>& kvquant_default_codebook(int bits);

// The codebook of "kvquant_k<bits>" in calibration layer p.layer of p.calib: empty (the codec's
// default) without a calibration or with --kv-scales qk-norm's (which holds no codebooks). A
// calibration without the layer, the entry or the model's key shape (n_kv_heads x head_dim channel
// statistics) is an error: it was fitted for another model or other bit widths. The calibration
// entry of a layer (null when absent). Both throw kvq::Error, naming `name`, on entries that break
// the schema.
std::vector<float> kvquant_codebook_from_calib(const std::string& name, const KvCodecParams& p, int bits);
const nlohmann::json* kvquant_calib_layer(const std::string& name, const nlohmann::json* calib, int layer);

// Fits one layer's artifacts from calibration keys. keys_pre_rope: (n_tokens, n_kv_heads,
// head_dim), before RoPE: consecutive sequences of window_tokens tokens each (0: one sequence).
// Groups of group_tokens consecutive tokens per head are normalized per channel exactly as the
// codec does (outliers and each sequence's positions 0 .. sink_tokens-1 excluded) and a
// 2^bits-level Lloyd-Max codebook is fitted to the normalized values. Returns
//   {"kvquant_k<bits>": {"codebook": [...], "group_tokens": G, "outliers_per_token": k,
//                        "n_samples": N, "mse": normalized-domain MSE}}
// Throws kvq::Error on invalid shapes or non-finite input.
nlohmann::json kvquant_fit(const float* keys_pre_rope, int n_tokens, int n_kv_heads, int head_dim,
                           int bits, int group_tokens = kvquant_default_group_tokens,
                           int sink_tokens = kvquant_default_sink_tokens,
                           int outliers_per_token = -1, int window_tokens = 0);

// Fits the calibrated ranges and codebook of the kvquant<bits>_cal_k codecs from one layer's
// pre-RoPE calibration keys (same shape as kvquant_fit), which are consecutive sequences of
// window_tokens tokens each (0: one sequence); each sequence's first sink_tokens positions are
// left out, as the codec keeps them exact. Per head and channel, the range is the
// [min, max] of the channel's keys with sink tokens and each token's k outliers (by distance from
// the channel mean in standard deviations) left out; the Lloyd-Max codebook is fitted to the keys
// normalized by these ranges. Returns
//   {"kvquant_cal_k<bits>": {"mid": [[head_dim] x n_kv_heads], "scale": [...], "codebook": [...],
//                            "outliers_per_token": k, "sink_tokens": S,
//                            "rel_mse": error / energy of the centered keys, "n_samples": N}}
nlohmann::json kvquant_fit_static(const float* keys_pre_rope, int n_tokens, int n_kv_heads, int head_dim,
                                  int bits, int sink_tokens = kvquant_default_sink_tokens,
                                  int outliers_per_token = -1, int window_tokens = 0);

// A kvquant<bits>_cal_k artifact from given per-head ranges (mid, scale: n_kv_heads x head_dim)
// with the default codebook: what synthetic calibrations (tests, benchmarks, `kvq formats`)
// hand the codec. Real ones come from kvquant_fit_static.
nlohmann::json kvquant_cal_artifact(const std::vector<std::vector<float>>& mid,
                                    const std::vector<std::vector<float>>& scale, int bits);

// RoPE as the KVQuant keys apply it after dequantization: pair i of the n_rot rotated dims
// turns by pos * freq_scale * freq_base^(-2i / n_rot) (angles in double). x: (head_dim), in place.
// The engine should rotate q and the tail keys with the same function so both sides agree.
void kv_rope_apply(const KvRope& r, int pos, float* x, int head_dim);
// Throws kvq::Error naming `name` unless r fits head_dim: n_rot even and <= head_dim, freq_base > 1,
// freq_scale > 0, and freq_factors empty or n_rot / 2 finite numbers > 0.
void kv_check_rope(const char* name, const KvRope& r, int head_dim);

// The angle rate of RoPE pair i (pos * rate radians): freq_scale * freq_base^(-2i / n_rot), divided
// by freq_factors[i] when the RoPE has factors.
double kv_rope_theta(const KvRope& r, int i);

// ---- kernels: scalar reference and SIMD variants share these signatures ----
// out[c] = scale[c] * codebook[code_c] + mid[c]; planes: bits planes of head_dim/8 bytes;
// codebook: 16 floats (entries past 2^bits unused); scale, mid, out: (head_dim)
void kvquant_dequant_scalar(const uint8_t* planes, int bits, int head_dim, const float* codebook,
                            const float* scale, const float* mid, float* out);

// The score path works in a "score order" of the channels, chosen per codec (kvquant_layout):
//   halves: the n_rot rotated dims as [a-elements of the n_rot/2 pairs][b-elements], then the
//           unrotated dims n_rot..head_dim-1 in channel order;
//   lanes:  inside each block of 64 channels, channel 64m + 4L + r at 64m + 16r + L (what 16
//           dword lanes of a byte-code vector shifted by 8r hold), for head_dim % 64 == 0 and
//           n_rot % 64 == 0 (adjacent pairs: pair (4L + r, 4L + r + 1) sits at (16r + L,
//           16(r + 1) + L)) or n_rot / 2 % 64 == 0 (neox: b = a + n_rot / 2).
// Pair j is (2j, 2j+1), or (j, j + n_rot/2) when neox. Table entry p (0 <= p < n_rot/2) is the
// pair whose a-element is the p-th a-element in score order.
// RoPE of position P + t factors as R(P + t) = R(P) R(t), so <q, R(P + t) k> =
// <R(P)^T q, R(t) k>: the caller rotates the query once per run of tokens starting at P (and
// permutes it into score order); the kernel turns each key by R(t) from a table of the first
// tokens' cos/sin (the same for every run) instead of evaluating sin/cos per token.
enum KvquantLayout : int { kvquant_layout_halves = 0, kvquant_layout_lanes = 1 };
struct KvquantScoreLayout {
  int layout = kvquant_layout_halves;
  bool neox = false;
  std::vector<uint16_t> slot;            // (head_dim): score-order position of channel c
  std::vector<uint16_t> pair_a, pair_b;  // (n_rot/2): score-order positions of entry p's elements
  std::vector<uint16_t> pair_j;          // (n_rot/2): the RoPE pair index of entry p
};
// lanes when the shape allows it and allow_lanes (the AVX-512 kernels' order; the AVX2 kernel
// reads halves without a scatter), else halves.
KvquantScoreLayout kvquant_layout(int head_dim, int n_rot, bool neox, bool allow_lanes = true);

struct KvquantScoreArgs {
  const uint8_t* rows;      // n code rows (bits planes of head_dim/8 bytes), row_bytes apart
  size_t row_bytes;
  int n, bits, head_dim;
  const float* codebook;    // (16)
  const uint8_t* params;    // the group's [f16 scale (head_dim)][f16 mid (head_dim)]
  const uint8_t* ovals;     // (n, k) f16 outlier values (unaligned)
  const uint8_t* oidx;      // (n, k) outlier channels
  int k;
  const float* rot_c;       // (n, rot_stride): cos of token t's turn, entry p at [t * rot_stride + p]
  const float* rot_s;       // (n, rot_stride): sin of the same
  int rot_stride;
  int n_rot;
  const KvquantScoreLayout* layout;
  const float* q;           // (n_q, head_dim) already rotated by R(P)^T, in score order
  int n_q;
};
// out[i * out_stride + t] = sum_p qa_ip (ka c_tp - kb s_tp) + qb_ip (ka s_tp + kb c_tp)
//                           + sum_{c >= n_rot} q_i,slot(c) k_c
// with k the dequantized key of row t (outlier channels replaced by their f16 values), (ka, kb)
// the elements of table entry p (at pair_a[p], pair_b[p] in score order) and (qa_ip, qb_ip) the
// query's elements there.
using kvquant_scores_fn = void (*)(const KvquantScoreArgs& a, float* out, int out_stride);
// c[j] = float(cos(pos * theta[j])), s[j] = float(sin(pos * theta[j])) for j < half, the angle
// taken in double as double(pos) * theta[j] (what kv_rope_apply evaluates).
using kvquant_sincos_fn = void (*)(long pos, const double* theta, int half, float* c, float* s);

// The query side of a run: out[i, pair_a[p]] = qa c[p] + qb s[p], out[i, pair_b[p]] = qb c[p] -
// qa s[p] with (qa, qb) = q[i]'s elements of entry p's RoPE pair (R(P)^T), and out[i, slot[c]] =
// q[i, c] for c >= n_rot. q, out: (n_q, head_dim); c, s: (n_rot / 2) in table order.
using kvquant_prep_fn = void (*)(const float* q, int n_q, int head_dim, int n_rot,
                                 const KvquantScoreLayout& l, const float* c, const float* s, float* out);

struct KvquantKernels {
  kvquant_scores_fn scores;
  kvquant_sincos_fn sincos;
  kvquant_prep_fn prep;
};
void kvquant_prep_scalar(const float* q, int n_q, int head_dim, int n_rot, const KvquantScoreLayout& l,
                         const float* c, const float* s, float* out);
#if defined(KVQ_HAVE_SIMD)
void kvquant_prep_avx512(const float* q, int n_q, int head_dim, int n_rot, const KvquantScoreLayout& l,
                         const float* c, const float* s, float* out);
#endif

void kvquant_scores_scalar(const KvquantScoreArgs& a, float* out, int out_stride);
void kvquant_sincos_scalar(long pos, const double* theta, int half, float* c, float* s);
#if defined(KVQ_HAVE_SIMD)
void kvquant_scores_avx2(const KvquantScoreArgs& a, float* out, int out_stride);
void kvquant_sincos_avx2(long pos, const double* theta, int half, float* c, float* s);
void kvquant_prep_avx2(const float* q, int n_q, int head_dim, int n_rot, const KvquantScoreLayout& l,
                       const float* c, const float* s, float* out);
void kvquant_scores_avx512(const KvquantScoreArgs& a, float* out, int out_stride);
// Range reduction by pi/2 in three parts with FMAs and Taylor polynomials on [-pi/4, pi/4]:
// ~1e-16 absolute error for |angle| < 2^30, below the f32 rounding of the result.
void kvquant_sincos_avx512(long pos, const double* theta, int half, float* c, float* s);
#endif

// The variant for cpu_level() (the one dispatch point of this family).
const KvquantKernels& kvquant_kernels();

}  // namespace kvq
