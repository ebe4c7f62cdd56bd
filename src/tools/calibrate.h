// kvq calibrate: per layer and KV head, the K/V statistics and fitted artifacts that static-scale
// and codebook formats need, computed from sample text run through the model with an f16 cache.
//
// Output schema (read through --kv-scales by every subcommand):
//   {"model": ..., "data": ..., "tokens": N,
//    "layers": [{"layer": L,
//                "k_absmax": [per head], "v_absmax": [per head],
//                "k_scale": [absmax / 448], "v_scale": [...],          FP8 E4M3 (vLLM convention)
//                "int8_k_scale": [absmax / 127], "int8_v_scale": [...],
//                "k_mean" / "v_mean": [per head [per channel]],   post-RoPE keys, values (*_c formats)
//                "k_rms" / "v_rms" / "q_rms": [per head [per channel]]   root mean squares of the
//                    post-RoPE keys, the values and the queries (the KV head's query heads
//                    pooled), position 0 of each window left out (*_s formats)
//                "kvquant_k2" / "kvquant_k3" / "kvquant_k4": {codebook, ...},   (kvquant_fit)
//                "kvquant_pair_weight": [per head [per RoPE pair]]}]}   (kvquant_pair_weights:
//                    which pairs the mixed-precision KVQuant keys widen)
#pragma once
#include <string>
#include <vector>

#include "model/config.h"

namespace CLI { class App; }

namespace kvq {

struct CalibrateOptions {
  std::string model;
  std::string data;
  std::string out;
  int ctx = 512;        // tokens per window
  int chunks = 4;       // windows of sample text
  int threads = 0;
  std::vector<int> kvquant_bits{2, 3, 4};
  RopeOverrides rope;   // --rope-scaling etc.: the RoPE the keys are rotated with
};

void calibrate_add_cli(CLI::App& app, CalibrateOptions& o);
int calibrate_command(const CalibrateOptions& o);

}  // namespace kvq
