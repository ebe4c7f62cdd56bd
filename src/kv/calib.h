// Static per-layer KV scales from calibration JSON (KvCodecParams::calib), for the fixed-scale
// codecs (fp8_*_static, int8_static). Schema:
//   {"layers": [ {"k_scale": S, "v_scale": S}, ... ]}     one entry per layer, in layer order
// where S is a positive finite number (per tensor) or an array of n_kv_heads of them (per head).
// The scale is the dequantization multiplier: x ~= code * S (as vLLM's k_scale / v_scale).
// A family-specific key wins over the shared one: int8_static reads "int8_k_scale" / "int8_v_scale"
// when present (kvq calibrate writes both conventions). Other top-level keys are ignored, so one calibration file can carry several families' artifacts.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvq/kv_format.h"

namespace kvq {

// Per-head scales (n_kv_heads entries) of p.role at p.layer; throws kvq::Error (naming `codec`)
// when p.calib is null or does not follow the schema.
std::vector<float> kv_calib_head_scales(const KvCodecParams& p, const std::string& codec);

// v as n_heads arrays of dim finite numbers (a per-head channel vector of a calibration entry);
// throws kvq::Error "<where> must hold ..." otherwise.
std::vector<std::vector<float>> kv_calib_head_vectors(const nlohmann::json& v, const std::string& where, int n_heads,
                                                      int dim);

// One head's channel scales s of the channel-scaled formats (*_s, *_cs; kv/centered_codecs.cpp),
// from dim-long channel statistics: x the RMS, mu the means (centered formats; null otherwise),
// q the query channel RMS for keys (null for values). Keys: s^2 = sd(k) / rms(q), one scale per
// RoPE pair of `rope` from the pair's pooled mean squares, a pair that queries never read
// (rms(q) = 0) given the largest scale of the others; values: s^2 = sd(v) (sd: the RMS, or the
// standard deviation when centered). Normalized to a geometric mean of 1 and floored at 1e-3 of
// the largest.
std::vector<float> kv_channel_scales(const float* x, const float* mu, const float* q, int dim, const KvRope& rope);

// "" for a calibration from `kvq calibrate` (or none); for `--kv-scales qk-norm`'s (source
// "qk-norm": key and query channel RMS only), a sentence to append to a missing-field error saying
// what that calibration holds and where the rest comes from.
std::string kv_calib_missing_hint(const nlohmann::json* calib);

// Placeholder artifacts for every family that reads calibration (static scales 1, channel means
// 0, channel RMS 1, KVQuant's default key codebooks and key ranges [-1, 1]) in n_layers entries of n_kv_heads x head_dim:
// enough to build any calibrated codec where only its size matters (kvq plan, kvq formats), since
// no codec's bytes depend on the values.
nlohmann::json kv_placeholder_calib(int n_layers, int n_kv_heads, int head_dim);

}  // namespace kvq
