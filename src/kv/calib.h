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

#include "kvq/kv_format.h"

namespace kvq {

// Per-head scales (n_kv_heads entries) of p.role at p.layer; throws kvq::Error (naming `codec`)
// when p.calib is null or does not follow the schema.
std::vector<float> kv_calib_head_scales(const KvCodecParams& p, const std::string& codec);

}  // namespace kvq
