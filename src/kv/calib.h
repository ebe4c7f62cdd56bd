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

// "" for a calibration from `kvq calibrate` (or none); for `--kv-scales qk-norm`'s (source
// "qk-norm": key and query channel RMS only), a sentence to append to a missing-field error saying
// what that calibration holds and where the rest comes from.
std::string kv_calib_missing_hint(const nlohmann::json* calib);

// Placeholder artifacts for every family that reads calibration (static scales 1, channel means
// 0, channel RMS 1, KVQuant key ranges [-1, 1]) in n_layers entries of n_kv_heads x head_dim:
// enough to build any calibrated codec where only its size matters (kvq plan, kvq formats), since
// no codec's bytes depend on the values.
nlohmann::json kv_placeholder_calib(int n_layers, int n_kv_heads, int head_dim);

}  // namespace kvq
