// The gated FFN activation applied between the up/gate matmuls and the down matmul:
// out[i] = act(gate[i]) * up[i], act = SiLU (llama) or GELU with the tanh approximation (Gemma);
// or gpt-oss's clamped SwiGLU: g = min(gate, 7), out = g * sigmoid(1.702 g) * (clamp(up, -7, 7) + 1).
// It runs over n_tok * n_ff elements per layer, so in prefill a scalar std::tanh / std::exp loop
// costs as much as a weight matmul; the SIMD variants (AVX-512, and AVX2 with the same arithmetic
// on 8 lanes) evaluate both through one exp:
// silu(x) = x / (1 + e^-x) and gelu_tanh(x) = x / (1 + e^-2u), u = sqrt(2/pi) (x + 0.044715 x^3)
// (since 0.5 (1 + tanh u) = 1 / (1 + e^-2u)), and swiglu_oai(g) = g / (1 + e^(-1.702 g)).
#pragma once
#include <cstddef>

#include "core/thread_pool.h"

namespace kvq {

enum class GluAct { silu, gelu_tanh, swiglu_oai };
// gpt-oss's SwiGLU constants (its reference implementation's alpha and limit)
inline constexpr float kSwigluOaiAlpha = 1.702f, kSwigluOaiLimit = 7.0f;

// gate, up, out: (n). out may alias gate or up.
void glu_ref(GluAct act, const float* gate, const float* up, float* out, size_t n);
// nullptr-free dispatch targets; same signature as the reference.
void glu_avx512(GluAct act, const float* gate, const float* up, float* out, size_t n);
void glu_avx2(GluAct act, const float* gate, const float* up, float* out, size_t n);
// The variant for cpu_level(), split over the pool when n is large (prefill).
void glu(GluAct act, const float* gate, const float* up, float* out, size_t n, ThreadPool& pool);

}  // namespace kvq
