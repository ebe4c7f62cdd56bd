#include "kv/calib.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kv/kvquant.h"

namespace kvq {

std::string kv_calib_missing_hint(const nlohmann::json* calib) {
  if (!calib || !calib->is_object() || calib->value("source", std::string()) != "qk-norm") return "";
  return " (--kv-scales qk-norm holds only the key and query channel RMS that the model's QK-norm weights imply; "
         "the rest comes from `kvq calibrate -m MODEL --data TEXT -o calib.json`)";
}

std::vector<float> kv_calib_head_scales(const KvCodecParams& p, const std::string& codec) {
  std::string key_s = p.role == KvRole::key ? "k_scale" : "v_scale";
  if (!p.calib)
    fail("KV codec '{}' needs calibration scales: pass a calibration JSON of the form "
         "{{\"layers\": [{{\"k_scale\": s, \"v_scale\": s}}, ...]}} (s a number or one per KV head)",
         codec);
  const nlohmann::json& j = *p.calib;
  if (!j.is_object() || !j.contains("layers") || !j["layers"].is_array())
    fail("KV codec '{}': calibration JSON has no \"layers\" array", codec);
  const auto& layers = j["layers"];
  if (p.layer < 0 || size_t(p.layer) >= layers.size())
    fail("KV codec '{}': calibration JSON has {} layers, layer {} requested", codec, layers.size(), p.layer);
  const auto& L = layers[size_t(p.layer)];
  // A codec family may carry its own scales ("int8_k_scale": int8 codes span +-127 while FP8's
  // span +-448, so one multiplier cannot serve both); the plain key is the shared fallback.
  const std::string family = codec.substr(0, codec.find('_'));
  if (L.is_object() && L.contains(family + "_" + key_s)) key_s = family + "_" + key_s;
  const char* key = key_s.c_str();
  if (!L.is_object() || !L.contains(key))
    fail("KV codec '{}': calibration layer {} has no \"{}\"{}", codec, p.layer, key, kv_calib_missing_hint(p.calib));
  const auto& s = L[key];
  auto value = [&](const nlohmann::json& v) -> float {
    if (!v.is_number()) fail("KV codec '{}': layer {} \"{}\": expected a number, got {}", codec, p.layer, key, v.dump());
    const double d = v.get<double>();
    if (!std::isfinite(d) || d <= 0 || d > 3.0e38)
      fail("KV codec '{}': layer {} \"{}\": scale {} must be positive and finite", codec, p.layer, key, d);
    return float(d);
  };
  if (s.is_array()) {
    if (int(s.size()) != p.n_kv_heads)
      fail("KV codec '{}': layer {} \"{}\" has {} entries, expected one per KV head ({})", codec, p.layer, key,
           s.size(), p.n_kv_heads);
    std::vector<float> out;
    for (const auto& v : s) out.push_back(value(v));
    return out;
  }
  return std::vector<float>(size_t(p.n_kv_heads), value(s));
}

std::vector<std::vector<float>> kv_calib_head_vectors(const nlohmann::json& v, const std::string& where, int n_heads,
                                                      int dim) {
  if (!v.is_array() || v.size() != size_t(n_heads)) fail("{} must hold {} heads of {} numbers", where, n_heads, dim);
  std::vector<std::vector<float>> out;
  for (const auto& h : v) {
    if (!h.is_array() || h.size() != size_t(dim)) fail("{} must hold {} heads of {} numbers", where, n_heads, dim);
    std::vector<float> row;
    for (const auto& x : h) {
      if (!x.is_number() || !std::isfinite(x.get<double>())) fail("{} holds a non-numeric or non-finite value", where);
      row.push_back(x.get<float>());
    }
    out.push_back(std::move(row));
  }
  return out;
}

nlohmann::json kv_placeholder_calib(int n_layers, int n_kv_heads, int head_dim) {
  const std::vector<std::vector<float>> zero(size_t(n_kv_heads), std::vector<float>(size_t(head_dim), 0.f));
  const std::vector<std::vector<float>> one(size_t(n_kv_heads), std::vector<float>(size_t(head_dim), 1.f));
  nlohmann::json entry = {{"k_scale", 1.0}, {"v_scale", 1.0}, {"k_mean", zero}, {"v_mean", zero},
                          {"k_rms", one},   {"q_rms", one},   {"v_rms", one}};
  for (int b : {2, 3, 4}) {
    entry["kvquant_k" + std::to_string(b)] = {{"codebook", kvquant_default_codebook(b)}};
    entry["kvquant_cal_k" + std::to_string(b)] = kvquant_cal_artifact(zero, one, b);
  }
  nlohmann::json cal = {{"layers", nlohmann::json::array()}};
  for (int i = 0; i < n_layers; ++i) {
    entry["layer"] = i;
    cal["layers"].push_back(entry);
  }
  return cal;
}

}  // namespace kvq
